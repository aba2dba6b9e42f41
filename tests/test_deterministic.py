"""The deterministic mode (``LocalContextParallelHandler(deterministic=True)``, issue 73) through ``a2a``: attention's
output, log-sum-exp and the gradients of q, k and v are ``torch.equal`` at cp 2, 3, 4, 6 and 8 to cp 1 on the same
global inputs: fp32 and bf16, MHA and GQA, causal and full, a sliding window, chunks, a soft-cap, sinks (their
gradient too), multi-head latent attention's widths, one query head per rank and fewer (bshd), sbhd, thd packs
alone and with the variants; hypothesis over bshd lengths and thd packs at every degree. The reference GPT's logits
and per-token losses in fp32 and bf16. The negative control: the default ring (p2p) on the same inputs differs in
at least one bit at cp 2, so the comparison can fail. Refusals by name: ``"auto"`` where no pattern runs the call,
key-value heads the all-to-all's ranks do not divide (fewer than the query heads), another kernel, the GPU path
without its opt-in. The patterns on canonical tiles: tests/test_deterministic_tiles.py.

Tolerances: none (bitwise).
"""

from functools import partial

import pytest
import torch
from deterministic_cases import (
    CASES,
    GPT_OUTPUTS,
    VARIANTS,
    D,
    S,
    assert_equal,
    case_handler,
    case_runs_heads,
    gpt_outputs,
    results,
    results_with_lse,
)
from dist_utils import computed_once, fails_fast, new_cp_group, run_distributed
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from cp_handler import ContextParallelConfig, LocalContextParallelHandler


def _case_runs(name: str, cp: int) -> bool:
    _, heads, kv_heads, *_ = next(c for c in CASES if c[0] == name)
    return case_runs_heads(heads, kv_heads, cp)


def _handler(group, comm_type="a2a", deterministic=True):
    return LocalContextParallelHandler(cp_group=group, cp_comm_type=comm_type, deterministic=deterministic)


def _thd_heads(world: int) -> tuple[int, int]:
    """Heads the mode's ``a2a`` runs at ``world`` (a key-value head's query heads on one rank): GQA 8 / 4 at cp 2 and 4,
    6 / 6 at cp 3, 8 / 8 at cp 6 and 8 (padded heads)."""
    return {3: (6, 6), 6: (8, 8), 8: (8, 8)}.get(world, (8, 4))


def _worker(rank, world):
    torch.manual_seed(0)
    group = new_cp_group()
    plain = {case[-1]: computed_once(results, case_handler(None, case[-1]), case)[0]
             for case in CASES if case[0] in ("mha-fp32", "thd-fp32")}  # the plain bshd call and the variants' pack
    for case in CASES:
        if case[0].removeprefix("thd-") in VARIANTS or case[0] == "thd-window-fp32":  # the variant took effect
            assert not torch.equal(computed_once(results, case_handler(None, case[-1]), case)[0], plain[case[-1]])
        if not _case_runs(case[0], world):
            continue
        want = computed_once(results_with_lse, partial(case_handler, None, case[-1]), case)  # one process (rank 0's)
        assert_equal(results_with_lse(partial(case_handler, group, case[-1]), case), want, f"{case[0]} cp {world}",
                     lse=True)
    # the reference GPT (8 heads; one per rank at cp 8) in fp32 and bf16: its logits and per-token losses
    for dtype in (torch.float32, torch.bfloat16):
        want = computed_once(gpt_outputs, _handler(None), S, dtype)
        assert_equal(gpt_outputs(_handler(group), S, dtype), want, f"GPT {dtype} cp {world}", names=GPT_OUTPUTS)

    @settings(max_examples=4, derandomize=True, deadline=None,  # every rank draws the same cases
              phases=[Phase.explicit, Phase.generate])
    @given(chunk=st.integers(1, 40), gqa=st.booleans())
    @example(chunk=1, gqa=True)
    @fails_fast  # a rank's failure ends the run with its message (no replay the other ranks do not make)
    def bshd(chunk, gqa):  # any bshd length the zigzag layout takes: 2 x cp x chunk tokens
        heads = _thd_heads(world) if gqa else (8, 8)
        case = ("bshd", *heads, torch.bfloat16 if gqa else torch.float32, "causal", None, "bshd")
        seq_len = 2 * world * chunk
        want = computed_once(results, _handler(None), case, seq_len)
        assert_equal(results(_handler(group), case, seq_len), want, f"S {seq_len} {heads} cp {world}")

    bshd()

    @settings(max_examples=4, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate])
    @given(lengths=st.lists(st.one_of(st.just(0), st.integers(1, 5), st.integers(6, 70), st.integers(71, 200)),
                            min_size=1, max_size=7).filter(lambda lengths: sum(lengths) > 0))
    @example(lengths=[100, 37, 1, 180, 66])
    @fails_fast
    def thd(lengths):
        case = ("thd", *_thd_heads(world), torch.float32, "causal", None, tuple(lengths))
        want = computed_once(results, case_handler(None, case[-1]), case)
        assert_equal(results(case_handler(group, case[-1]), case), want, f"{lengths} cp {world}")

    thd()
    if world == 2:  # the negative control: the default ring on the same inputs is not bitwise one process's
        case = CASES[0]
        want = computed_once(results, _handler(None), case)
        got = results(_handler(group, "p2p", deterministic=False), case)
        assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_attention_is_bitwise_the_same_at_every_cp_degree(world):
    """``a2a`` in the mode: every case of ``CASES`` the heads allow, output, log-sum-exp, dq, dk, dv (and dsinks)
    ``torch.equal`` to cp 1; hypothesis over bshd lengths (``2 x cp x 1..40`` tokens, fp32 MHA and bf16 GQA) and over
    packed documents (zero-length, tiny and long documents, any split; every document padded to a multiple of 48 at
    every degree, :data:`~cp_handler.core.layout.DETERMINISTIC_MULTIPLE`); the reference GPT's logits and per-token
    losses in fp32 and bf16; at cp 2 the default ring differs (the control)."""
    run_distributed(_worker, world)


def _refusal_worker(rank, world):
    group = new_cp_group()
    handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", deterministic=True, qkv_format="thd",
                                          cu_seqlens=torch.tensor([0, 64, 100], dtype=torch.int32))
    q = handler.dispatch(torch.zeros(100, 4, D), 0)
    with pytest.raises(ValueError, match=r"its canonical tiles run causal masks on padded documents"):
        handler.core_attn(torch.nn.Module(), q, q, q, attn_mask_type="no_mask")
    for heads, kv_heads, rule in ((8, 2, "a key-value head's query heads would sit on several ranks"),):
        handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="a2a", deterministic=True)
        q = torch.zeros(1, 2 * S // world, heads, D)
        kv = torch.zeros(1, 2 * S // world, kv_heads, D)
        module = torch.nn.Module()
        module.softmax_scale = 0.25
        with pytest.raises(ValueError, match=rule):
            handler.core_attn(module, q, kv, kv, attn_mask_type="causal")
        # auto: canonical tiles refuse a full mask on padded documents, a2a the heads
        handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="auto", deterministic=True,
                                              qkv_format="thd", cu_seqlens=torch.tensor([0, 100], dtype=torch.int32))
        q, kv = (handler.dispatch(torch.zeros(100, h, D), 0) for h in (heads, kv_heads))
        with pytest.raises(ValueError, match=r"'auto' with deterministic=True: no pattern runs this call in the mode: "
                                             r"p2p: .*causal masks on padded documents.*; a2a: .*query heads"):
            handler.core_attn(module, q, kv, kv, attn_mask_type="no_mask")


def test_what_the_mode_does_not_make_bitwise_is_refused_by_name():
    run_distributed(_refusal_worker, 4)
    with pytest.raises(ValueError, match="pins the block kernel by device"):
        LocalContextParallelHandler(cp_group=None, deterministic=True, attn_kernel="flash_gqa")


def test_the_gpu_path_is_opt_in(monkeypatch):
    """On CUDA the mode runs only with ``CP_HANDLER_DETERMINISTIC_CUDA=1`` and ``torch.use_deterministic_algorithms
    (True)`` (not warn_only), and not through an all-to-all, each refusal naming what is missing; other devices
    refused; the CPU runs it. (The GPU path itself: tests/test_deterministic_gpu.py, pending a GPU.)"""
    from cp_handler.handlers.local import DETERMINISTIC_CUDA_ENV, deterministic_device_refusal

    assert deterministic_device_refusal("cpu") is None
    assert "runs on the CPU" in deterministic_device_refusal("mps")
    monkeypatch.delenv(DETERMINISTIC_CUDA_ENV, raising=False)
    assert f"set {DETERMINISTIC_CUDA_ENV}=1" in deterministic_device_refusal("cuda")
    monkeypatch.setenv(DETERMINISTIC_CUDA_ENV, "1")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        assert "needs torch.use_deterministic_algorithms(True)" in deterministic_device_refusal("cuda")
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert "not warn_only" in deterministic_device_refusal("cuda")
        torch.use_deterministic_algorithms(True)
        assert deterministic_device_refusal("cuda") is None
        assert deterministic_device_refusal("cuda", "p2p") is None
        assert "use 'p2p' or 'all_gather'" in deterministic_device_refusal("cuda", "a2a+p2p")
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_the_config_field_builds_the_mode_and_refuses_what_it_does_not_run():
    """``ContextParallelConfig(deterministic=True)``: the local handler in the mode (thd too); another comm type at
    cp > 1, a value that is not a bool and a backend without the mode refused by name."""
    from cp_handler import build_cp_handler
    from cp_handler.handlers.base import ContextParallelHandler

    assert build_cp_handler(ContextParallelConfig(deterministic=True)).deterministic
    assert not build_cp_handler(ContextParallelConfig()).deterministic
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="auto", deterministic=True)
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="p2p", qkv_format="thd", deterministic=True)
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="p2p", deterministic=True)
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="a2a", qkv_format="thd", deterministic=True)
    with pytest.raises(ValueError, match=r"deterministic=1 must be True or False"):
        ContextParallelConfig(deterministic=1)

    class WithoutTheMode(ContextParallelHandler):
        def attend(self, call):
            raise AssertionError("never reached")

    with pytest.raises(ValueError, match=r"backend 'local' \(WithoutTheMode\) does not implement the deterministic"):
        WithoutTheMode.from_config(ContextParallelConfig(deterministic=True))


def _rl_model():
    """A tiny Llama (8 query, 4 key-value heads: 2 and 1 per rank at cp 4) with TRL's fused LM head."""
    import transformers
    from hf_trainer_cases import VOCAB
    from trl.trainer.utils import add_fused_lm_head

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                                      max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def _rl_log_probs(cp: int, group, deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's per-token log-probs and entropies of GRPO's layout (tests/test_hf_fused_head.py's batch) through the
    fused head under CP (what CPGRPOTrainer / CPRLOOTrainer / CPDPOTrainer score with), in the deterministic mode
    (else the default ring)."""
    from test_hf_fused_head import batch

    from cp_handler.integrations.hf_fused_head import install_cp_fused_head
    from cp_handler.integrations.transformers import register

    model = _rl_model()
    register(model)
    install_cp_fused_head(model, ContextParallelConfig(context_parallel_size=cp, cp_comm_type="a2a" if deterministic
                                                       else "p2p", deterministic=deterministic), group)
    ids, mask, labels = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs, out.entropy


def _rl_worker(rank, world, out):
    import torch.distributed as dist

    got = [_rl_log_probs(world, dist.group.WORLD), _rl_log_probs(world, dist.group.WORLD, deterministic=False)]
    if rank == 0:
        torch.save(got, out)


def test_rl_log_probs_and_entropies_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """The RL trainers' scores (TRL's fused head on shards, left-padded prompts and right-padded completions) in the
    deterministic mode: ``torch.equal`` to cp 1 at cp 2 and 4 (rows padded to one length at every degree,
    ``core.layout.DETERMINISTIC_MULTIPLE``: without it cp 4's padded rows gave results 2e-7 apart, measured). Negative
    control: the default ring at cp 4 differs from cp 1 in at least one bit."""
    want = _rl_log_probs(1, None)
    for world in (2, 4):
        run_distributed(_rl_worker, world, str(tmp_path / f"{world}.pt"))
        got, default = torch.load(tmp_path / f"{world}.pt")
        for name, a, b in zip(("log_probs", "entropy"), got, want, strict=True):
            assert torch.equal(a, b), (world, name, (a - b).abs().max().item())
    assert not all(torch.equal(a, b) for a, b in zip(default, want, strict=True))
