"""``cp_comm_type="auto"`` (cp_handler.auto): the pick is the same on every rank and the attention it runs equals
the single process (outputs and gradients); the model's bytes equal what the collectives send; profiles that do not
fit the run are refused by name; dynamic CP chooses sizes and patterns from the same model.

Tolerances: float32 on CPU, atol = rtol = 1e-5 as tests/test_attn_patterns.py (the patterns are exact; only the
order of the log-sum-exp merges differs from the one-process softmax).
"""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_cli import cp_train

from cp_handler import ContextParallelConfig, build_dp_cp_groups
from cp_handler.auto import (
    NAMED_PROFILES,
    AttnCase,
    CostProfile,
    GroupProfile,
    LinkFit,
    candidates,
    choose_comm_type,
    load_profile,
    pattern_work,
    predict,
)
from cp_handler.auto.catalog import payload_links
from cp_handler.auto.profile import ComputeFit
from cp_handler.auto.workload import PatternWorkload
from cp_handler.bench.calibrate import fit_compute, fit_patterns
from cp_handler.bench.cli import main as bench_main
from cp_handler.bench.cli import parse_args as parse_bench
from cp_handler.core.masks import CAUSAL, AttentionMask
from cp_handler.dynamic import schedule_sequences
from cp_handler.handlers import build_cp_handler
from cp_handler.ops.collectives import count_comms

TOL = {"atol": 1e-5, "rtol": 1e-5}
LINKS = ("p2p", "all_gather", "reduce_scatter", "all_to_all")


def toy_profile(device="cpu", dtype="float32", sizes=(2, 4), latency=0.05, gbps=1.0, name="toy") -> CostProfile:
    """A profile with round numbers: 1 ms per unit of matmul pairs, nothing else in compute."""
    compute = {dtype: ComputeFit((1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))}
    links = {k: LinkFit(latency, gbps) for k in LINKS}
    return CostProfile(name, "test", device, 0.0, {s: GroupProfile(compute, links) for s in sizes})


# -- the model, no ranks ---------------------------------------------------------------------------------------------

def test_candidates_need_levels_for_the_hierarchical_pattern():
    flat = AttnCase((64,), cp=4)
    assert candidates(flat) == ["p2p", "all_gather", "a2a"]
    assert candidates(AttnCase((64,), cp=4, hierarchical=(2, 2))) == ["p2p", "all_gather", "a2a", "a2a+p2p"]
    assert candidates(AttnCase((64,), cp=4, hierarchical=(4, 1))) == ["p2p", "all_gather", "a2a"]


def test_the_pick_follows_the_links():
    """Latency-bound links favour the fewest collectives; with free links, the least compute wins. Both checked
    against the predictions themselves: the pick is their minimum."""
    case = AttnCase((256,), heads=8, kv_heads=8, head_dim=16, v_head_dim=16, cp=4)
    for latency in (0.0, 100.0):
        choice = choose_comm_type(case, toy_profile(latency=latency, gbps=1e6), "float32")
        best = min(choice.predictions, key=lambda p: p.total_ms)
        assert choice.comm_type == best.comm_type
    slow = choose_comm_type(case, toy_profile(latency=100.0), "float32")
    per_pattern = {p.comm_type: len(pattern_work(p.comm_type, case).transfers) for p in slow.predictions}
    assert per_pattern[slow.comm_type] == min(per_pattern.values())  # 4 all-to-alls beat 9 ring sends and 6 gathers


def test_windows_move_only_the_halo():
    """A window of 32 under p2p: two all-to-alls of the halo rows, far fewer bytes than the ring's K/V shards."""
    full = pattern_work("p2p", AttnCase((1024,), cp=4))
    window = pattern_work("p2p", AttnCase((1024,), cp=4, mask=AttentionMask(window=32)))
    assert [t.kind for t in window.transfers] == ["all_to_all", "all_to_all"]
    assert sum(t.bytes_sent for t in window.transfers) * 8 < sum(t.bytes_sent for t in full.transfers)
    assert window.compute.full_pairs + window.compute.causal_pairs < full.compute.full_pairs + full.compute.causal_pairs


def test_a_halo_that_rank_0_does_not_receive_is_priced_as_a_halo():
    """Llama 4's chunks of 48 over zigzag chunks of 64 at cp 2: the halo exchange replaces the ring, and rank 0's
    queries need no other rank's keys (rank 1 receives 16 rows). Until 2026-12-06 the model took rank 0's rows alone
    for the sign of a halo, priced the ring's steps on the halo's one step, and ``"auto"`` raised IndexError on every
    chunked-attention call of that shape."""
    work = pattern_work("p2p", AttnCase((256,), cp=2, mask=AttentionMask(chunk=48)))
    assert [t.kind for t in work.transfers] == ["all_to_all", "all_to_all"]
    assert all(t.bytes_sent > 0 for t in work.transfers)


def test_uneven_heads_are_priced_padded():
    """7 heads over an a2a of 4 move as 8: the a2a's bytes grow by 8/7 against 8 real heads."""
    seven, eight = (pattern_work("a2a", AttnCase((64,), heads=h, kv_heads=h, cp=4)) for h in (7, 8))
    assert [t.nbytes for t in seven.transfers] == [t.nbytes for t in eight.transfers]


def test_profile_round_trip_and_refusals(tmp_path):
    profile = toy_profile()
    path = tmp_path / "p.json"
    profile.save(str(path))
    loaded = load_profile(str(path))
    case = AttnCase((128,), cp=4)
    assert predict("p2p", case, loaded, "float32") == predict("p2p", case, profile, "float32")
    with pytest.raises(ValueError, match=r"cost profile 'toy' covers CP groups of \[2, 4\] ranks, not 8"):
        profile.check(8, "cpu", "float32")
    with pytest.raises(ValueError, match=r"cost profile 'toy' describes cpu devices, the inputs are on cuda"):
        profile.check(2, "cuda", "float32")
    with pytest.raises(ValueError, match=r"cost profile 'toy' has compute fits for \['float32'\], not bfloat16"):
        profile.check(2, "cpu", "bfloat16")
    with pytest.raises(ValueError, match=r"cp_comm_profile='nope.json' is neither a named profile"):
        load_profile("nope.json")
    data = json.loads(path.read_text())
    del data["groups"]["2"]["links"]["p2p"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"cost profile 'toy', group size 2: needs links .*missing \['p2p'\]"):
        load_profile(str(path))


def test_named_profiles_say_what_is_modelled_and_price_every_pattern():
    """Every named GPU profile is labelled modelled and prices each pattern (its compute fit has a weight per
    feature: the H100 fit's five weights for seven features raised on every GPU prediction until 2026-12-05)."""
    gpus = [name for name, p in NAMED_PROFILES.items() if p.device == "cuda"]
    assert {"h100-nvlink", "h200-nvlink", "h800-nvlink", "a100-nvlink", "b200-nvlink", "gb200-nvl72"} <= set(gpus)
    for name in gpus:
        assert NAMED_PROFILES[name].source.startswith("modelled")
        case = AttnCase((8192,), 1, 32, 8, 128, 128, 2, CAUSAL, 8, (4, 2))
        for comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            assert predict(comm_type, case, NAMED_PROFILES[name], "bfloat16").total_ms > 0
    assert NAMED_PROFILES["cpu-2core-gloo"].source.startswith("measured by cp-bench --calibrate")
    with pytest.raises(ValueError, match=r"ComputeFit: weights=\(1.0, 2.0\) must be 8 values >= 0"):
        ComputeFit((1.0, 2.0))


def test_spec_links_price_the_bytes_each_collective_sends():
    """A named profile's bandwidth is per direction per GPU: an all-gather of a payload sends (n - 1) of them, an
    all-to-all (n - 1) / n, a ring step one (cp_handler.auto.catalog.payload_links)."""
    links = payload_links(8, 0.0, 100.0)
    payload = 10**9
    assert links["p2p"].ms(payload) == pytest.approx(10.0)
    assert links["all_gather"].ms(payload) == pytest.approx(70.0)
    assert links["reduce_scatter"].ms(payload) == pytest.approx(70.0)
    assert links["all_to_all"].ms(payload) == pytest.approx(8.75)


def test_config_rules():
    config = ContextParallelConfig(context_parallel_size=4, cp_comm_type="auto",
                                   hierarchical_context_parallel_sizes=[2, 2], cp_comm_profile="h100-nvlink")
    assert config.comm_types == ["auto"]
    ContextParallelConfig(context_parallel_size=2, cp_comm_type=["auto", "p2p"], num_layers=2)
    with pytest.raises(ValueError, match=r"cp_comm_profile='h100-nvlink' prices the patterns of cp_comm_type='auto'"):
        ContextParallelConfig(context_parallel_size=2, cp_comm_type="p2p", cp_comm_profile="h100-nvlink")
    with pytest.raises(ValueError, match=r"cost profile 'h100-nvlink' covers CP groups of .* not 128"):
        ContextParallelConfig(context_parallel_size=128, cp_comm_type="auto", cp_comm_profile="h100-nvlink")


def test_fit_compute_recovers_weights():
    """The least-squares fit of calibration rows returns the weights that made them (exact rows)."""
    weights = (2.0, 3.0, 0.5, 0.0, 0.25, 0.01, 0.1, 0.3)
    rows = []
    for i in range(1, 30):
        features = (i * 0.1, (i % 7) * 0.2, (i % 5) * 0.3, (i % 3) * 0.1, i * 0.05 + (i % 4), float(i % 6 + 1),
                    float(i % 4 + 1), (i % 9) * 0.07 + (i % 2))
        rows.append((features, sum(w * f for w, f in zip(weights, features, strict=True))))
    fit = fit_compute(rows)
    assert fit.fit_error["max_rel"] < 1e-9
    assert fit.weights == pytest.approx(weights, abs=1e-9)


def test_dynamic_cp_chooses_size_and_pattern():
    """Short sequences stay on one rank (a collective's latency costs more than their attention), a long one is
    sharded (its attention outweighs the transfers), and the pattern comes from the same model."""
    workload = PatternWorkload(toy_profile(sizes=(2, 4, 8), latency=1.0, gbps=100.0), "float32", 8, 8, 64, 64, 4)
    short, long_ = [64] * 8, [16384]
    assert workload.cost(64, 1) < workload.cost(64, 2)
    assert workload.cost(16384, 4) < workload.cost(16384, 1)
    schedule = schedule_sequences(short + long_, 8, 16384, 1, workload)
    assert schedule.cp_sizes[:8] == [1] * 8
    assert schedule.cp_sizes[8] > 1
    assert workload.comm_type(16384, schedule.cp_sizes[8]) in ("p2p", "all_gather", "a2a")


# -- on ranks --------------------------------------------------------------------------------------------------------

class _Layer(torch.nn.Module):
    """An attention module as a model's: its layer number (the ranks agree once per layer) and its window."""

    def __init__(self, window=None):
        super().__init__()
        self.layer_number = 1
        if window is not None:
            self.window_size = (window - 1, 0)  # Transformer Engine's convention: a causal window of W


def _single(q, k, v, dout, mask: AttentionMask):
    """One-process reference on whole (B, S, H, D) tensors, GQA expanded, the mask built densely."""
    groups = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    kk, vv = (t.repeat_interleave(groups, dim=2).transpose(1, 2) for t in (kf, vf))
    s = q.shape[1]
    pos = torch.arange(s)
    visible = pos[None, :] <= pos[:, None]
    if mask.window is not None:
        visible &= pos[:, None] - pos[None, :] < mask.window
    out = torch.nn.functional.scaled_dot_product_attention(qf.transpose(1, 2), kk, vv, attn_mask=visible)
    out = out.transpose(1, 2)
    out.backward(dout)
    return out.detach(), qf.grad, kf.grad, vf.grad


def _auto_worker(rank, world):
    profile = toy_profile(latency=0.05, gbps=0.5)
    cases = [((2, 64, 8, 8, 16), None, None), ((1, 64, 6, 3, 8), None, [2, 2]), ((1, 128, 4, 2, 8), 16, None)]
    for (b, s, h, hkv, d), window, levels in cases:
        groups = build_dp_cp_groups(world, "cpu", levels)
        config = ContextParallelConfig(context_parallel_size=world, cp_comm_type="auto",
                                       hierarchical_context_parallel_sizes=levels)
        handler = build_cp_handler(config, groups.cp_group, groups.hierarchical_cp_groups, cp_comm_profile=profile)
        g = torch.Generator().manual_seed(s + h)
        q, dout = (torch.randn(b, s, h, d, generator=g) for _ in range(2))
        k, v = (torch.randn(b, s, hkv, d, generator=g) for _ in range(2))
        mask = AttentionMask(window=window) if window else CAUSAL
        ref = _single(q, k, v, dout, mask)
        lq, lk, lv = (handler.dispatch(t, 1).detach().requires_grad_(True) for t in (q, k, v))
        attn_mod = _Layer(window)
        with torch.no_grad():  # the first call also agrees across the ranks (a small collective, not attention's)
            handler.core_attn(attn_mod, lq, lk, lv)
        ldout = handler.dispatch(dout, 1)  # dispatch agrees across the ranks at every call (not attention's bytes)
        with count_comms() as counter:
            out = handler.core_attn(attn_mod, lq, lk, lv)
            out.backward(ldout)
        for got, want in zip((out, lq.grad, lk.grad, lv.grad), ref, strict=True):
            torch.testing.assert_close(got, handler.dispatch(want, 1), **TOL)
        (choice,) = handler.auto_choices.values()
        picks = [None] * world
        dist.all_gather_object(picks, choice.comm_type)
        assert len(set(picks)) == 1, picks
        case = next(iter(handler.auto_choices))
        if window is None:  # the model's bytes are what the collectives sent (the halo's uneven a2a: see its test)
            modelled = sum(t.bytes_sent for t in pattern_work(choice.comm_type, case).transfers)
            assert counter.bytes_sent == modelled, (choice.comm_type, counter.bytes_sent, modelled)
    # per layer: layer 1 "auto", layer 2 "p2p" in one handler; both equal one process
    groups = build_dp_cp_groups(world, "cpu")
    handler = build_cp_handler(ContextParallelConfig(context_parallel_size=world, cp_comm_type=["auto", "p2p"]),
                               groups.cp_group, cp_comm_profile=profile)
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(1, 32, 4, 8, generator=g) for _ in range(4))
    want = _single(q, k, v, dout, CAUSAL)[0]
    for number in (1, 2):
        layer = _Layer()
        layer.layer_number = number
        with torch.no_grad():
            out = handler.core_attn(layer, *(handler.dispatch(t, 1) for t in (q, k, v)))
        torch.testing.assert_close(out, handler.dispatch(want, 1), **TOL)
    assert len(handler.auto_choices) == 1  # layer 2 named its pattern
    # a profile of another device is refused by name on every rank, before the attention communicates
    handler = build_cp_handler(ContextParallelConfig(context_parallel_size=world, cp_comm_type="auto"),
                               build_dp_cp_groups(world, "cpu").cp_group, cp_comm_profile="h100-nvlink")
    x = handler.dispatch(torch.randn(1, 32, 4, 8), 1)
    with pytest.raises(ValueError, match=r"cost profile 'h100-nvlink' describes cuda devices, the inputs are on cpu"):
        handler.core_attn(None, x, x, x)


def _bytes_worker(rank, world):
    """Every pattern's modelled bytes against count_comms, bf16, GQA and a wider V (MLA), bshd and thd."""
    groups = build_dp_cp_groups(world, "cpu", [2, 2])
    for lengths, (h, hkv, d, dv) in (((64,), (8, 2, 16, 24)), ((13, 40, 11), (6, 3, 8, 8))):
        for comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            levels = [2, 2] if comm_type == "a2a+p2p" else None
            config = ContextParallelConfig(context_parallel_size=world, cp_comm_type=comm_type,
                                           hierarchical_context_parallel_sizes=levels,
                                           qkv_format="thd" if len(lengths) > 1 else "bshd")
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            handler = build_cp_handler(config, groups.cp_group, groups.hierarchical_cp_groups,
                                       **({"cu_seqlens": cu} if len(lengths) > 1 else {}))
            total = sum(lengths)
            shape = (total,) if len(lengths) > 1 else (1, total)
            dim = 0 if len(lengths) > 1 else 1
            q = handler.dispatch(torch.randn(*shape, h, d, dtype=torch.bfloat16), dim).requires_grad_(True)
            k = handler.dispatch(torch.randn(*shape, hkv, d, dtype=torch.bfloat16), dim).requires_grad_(True)
            v = handler.dispatch(torch.randn(*shape, hkv, dv, dtype=torch.bfloat16), dim).requires_grad_(True)
            with torch.no_grad():  # the first call agrees across the ranks (not counted: attention's bytes only)
                handler.core_attn(_Layer(), q, k, v)
            with count_comms() as counter:
                handler.core_attn(_Layer(), q, k, v).float().sum().backward()
            case = AttnCase(lengths, 1, h, hkv, d, dv, 2, CAUSAL, world, (2, 2) if levels else None)
            modelled = sum(t.bytes_sent for t in pattern_work(comm_type, case).transfers)
            assert counter.bytes_sent == modelled, (comm_type, lengths, counter.bytes_sent, modelled)
            with count_comms() as counter, torch.no_grad():  # the forward alone (prefill): its transfers only
                handler.core_attn(_Layer(), q, k, v)
            forward = pattern_work(comm_type, dataclasses.replace(case, backward=False))
            assert counter.bytes_sent == sum(t.bytes_sent for t in forward.transfers), (comm_type, lengths)


def test_auto_on_ranks_equals_one_process():
    run_distributed(_auto_worker, 4)


def test_modelled_bytes_equal_counted_bytes():
    run_distributed(_bytes_worker, 4)



def test_fit_patterns_recovers_scale_fixed_and_per_element():
    """A pattern's calls measured as 1.3 x the model + 4 ms + 2 ms per million elements of q, k, v, and packed
    documents 5 ms more per million query-side elements, give those back (exact rows of several shapes); the
    prediction of a thd case then adds the packed term. Rows whose best fit would need a negative packed cost get
    0 for it, not a negative one."""
    profile = toy_profile()
    group = profile.group(4)
    rows = []
    for lengths, heads in (((128,), 4), ((256,), 4), ((512,), 2), ((256,), 16), ((96, 160), 4), ((300, 212), 8)):
        case = AttnCase(lengths, heads=heads, kv_heads=heads, head_dim=16, v_head_dim=16, cp=4)
        work = pattern_work("p2p", case)
        assert work.packed_elements == (0 if len(lengths) == 1 else
                                        case.layout(4).local_len * heads * 32)  # q and out rows x heads x (D + Dv)
        modelled = predict("p2p", case, profile, "float32").total_ms
        rows.append(("p2p", case, 1.3 * modelled + 4.0 + 2.0 * work.elements / 1e6 + 5.0 * work.packed_elements / 1e6))
    (fit,) = fit_patterns(rows, group, 4, "float32", "cpu").values()
    assert (fit.scale, fit.fixed_ms, fit.ms_per_melement, fit.ms_per_packed_melement) == \
        pytest.approx((1.3, 4.0, 2.0, 5.0), rel=1e-6)
    cheaper = [(name, case, ms - (8.0 * pattern_work(name, case).packed_elements / 1e6)) for name, case, ms in rows]
    (fit,) = fit_patterns(cheaper, group, 4, "float32", "cpu").values()
    assert fit.ms_per_packed_melement == 0.0 and min(fit.scale, fit.fixed_ms, fit.ms_per_melement) >= 0


def test_cp_train_auto_passes_parity(tmp_path):
    """cp-train --cp-comm-type auto: every step equals one process (the pick logged once for the run)."""
    flags = ["--nproc", "2", "--cp-comm-type", "auto", "--check-parity", "--steps", "3", "--seq-len", "128",
             "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-layers", "2", "--num-heads", "4",
             "--num-kv-heads", "2", "--max-corpus-bytes", "2000000"]
    result = cp_train(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr
    assert result.stderr.count("cp_comm_type='auto' -> ") == 1


def test_cp_bench_auto_and_calibrate_flags(tmp_path):
    """--calibrate alone runs only the calibration; --modes auto on the tiny grid writes its scores and rows, one
    per (case, pattern), each with a prediction; a profile that does not exist is refused by name."""
    assert parse_bench(["--calibrate"]).modes == ["calibrate"]
    assert parse_bench(["--calibrate", "--modes", "auto"]).modes == ["calibrate", "auto"]
    with pytest.raises(SystemExit):
        parse_bench(["--modes", "auto", "--cost-profile", "nope"])
    out = tmp_path / "auto"
    assert bench_main(["--modes", "auto", "--auto-grid", "tiny", "--reps", "1", "--warmup", "0", "--no-plots",
                       "--out-dir", str(out)]) == 0
    auto = json.loads((out / "results.json").read_text())["auto"]
    assert auto["profile"] == "cpu-2core-gloo" and auto["summary"]["cases"] == 4
    assert len(auto["rows"]) == 3 + 3 + 4 + 4  # cp 2: p2p, all_gather, a2a; cp 4: and a2a+p2p
    assert all(r["predicted_ms"] > 0 and r["median_ms"] > 0 for r in auto["rows"])
    assert {c["auto"] for c in auto["cases"]} <= {"p2p", "all_gather", "a2a", "a2a+p2p"}


def test_a_layer_holds_its_pattern_until_another_is_predicted_5_percent_faster():
    """PatternHold: the first call's best is held per (layer, cp); a later call switches only when its best beats
    the held pattern by more than the margin, or when the held one is not a candidate; layers are independent."""
    from cp_handler.auto import AutoChoice, PatternHold, Prediction

    def choice(**ms):
        predictions = tuple(Prediction(name, 0.0, 0.0, t)
                            for name, t in ms.items())
        return AutoChoice(min(predictions, key=lambda p: p.total_ms).comm_type, predictions)

    hold = PatternHold()
    assert hold.pick(1, 4, choice(p2p=100.0, a2a=104.0)) == "p2p"
    assert hold.pick(1, 4, choice(p2p=100.0, a2a=96.0)) == "p2p"  # a2a 4% faster: held
    assert hold.pick(2, 4, choice(p2p=100.0, a2a=96.0)) == "a2a"  # another layer: its own best
    assert hold.pick(1, 4, choice(p2p=100.0, a2a=94.0)) == "a2a"  # 6% faster: switched
    assert hold.pick(1, 2, choice(p2p=50.0, a2a=52.0)) == "p2p"  # another CP size: its own
    assert hold.pick(1, 4, choice(p2p=90.0, all_gather=95.0)) == "p2p"  # a2a not a candidate any more
    assert hold.switches == 2
    assert PatternHold(margin=0.0).pick(1, 4, choice(p2p=100.0, a2a=99.0)) == "a2a"
    with pytest.raises(ValueError, match=r"PatternHold: margin=-0.1 must be >= 0"):
        PatternHold(margin=-0.1)


def test_a_hold_is_refused_without_auto():
    from cp_handler import LocalContextParallelHandler
    from cp_handler.auto import PatternHold

    with pytest.raises(ValueError, match=r"cp_comm_hold holds the patterns of cp_comm_type='auto'"):
        LocalContextParallelHandler(cp_comm_type="p2p", cp_comm_hold=PatternHold())
    with pytest.raises(TypeError, match=r"cp_comm_hold='x' is not a cp_handler.auto.PatternHold"):
        LocalContextParallelHandler(cp_comm_type="auto", cp_comm_hold="x")
    shared = PatternHold()
    assert LocalContextParallelHandler(cp_comm_type="auto", cp_comm_hold=shared).cp_comm_hold is shared
    from cp_handler.auto.hold import hold_for

    assert hold_for(ContextParallelConfig(context_parallel_size=2, cp_comm_type="p2p")) == {}
    assert isinstance(hold_for(ContextParallelConfig(context_parallel_size=2, cp_comm_type=["auto", "p2p"],
                                                     num_layers=2))["cp_comm_hold"], PatternHold)


def test_key_value_heads_priced_where_they_run():
    """The compute's key-value feature counts the KV heads a rank's kernel reads (the ring: all of them; the a2a at
    cp 4 over one KV head: the head replicated, one per rank), and the a2a's copies count what its all-to-all
    carries (the replicated KV head four times), so GQA is not priced as MHA."""
    mha, gqa = (AttnCase((4096,), 1, 8, kv, 64, 64, 4, CAUSAL, 4) for kv in (8, 1))
    ring_mha, ring_gqa = (pattern_work("p2p", c).compute for c in (mha, gqa))
    assert ring_mha.causal_pairs == ring_gqa.causal_pairs and ring_mha.kv_pairs == 8 * ring_gqa.kv_pairs
    a2a = pattern_work("a2a", gqa)
    assert a2a.compute.kv_pairs * 2 == pytest.approx(a2a.compute.causal_pairs + a2a.compute.full_pairs)  # 2 q, 1 kv
    rows = 4096 // 4
    assert pattern_work("p2p", gqa).elements == gqa.local_elements == rows * (8 * 64 + 1 * 128)
    assert a2a.elements == rows * (8 * 64 + 4 * 128)  # the KV head replicated to each of the 4 ranks
