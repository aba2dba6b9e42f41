"""cp-bench: the PyTorch ring peer is numerically the same attention, the work counter partitions
the causal triangle exactly, ``cp-bench`` writes its JSON, table and plots, and its plan mode (per-rank
compute on one device) runs on CPU.

Peer tolerances: fp32 inputs, same CPU flash kernel on the same blocks; the merge orders differ,
so outputs and gradients agree to float32 rounding of a few merges (atol 1e-5 on O(1) values).
"""

import gzip
import json
import statistics
import sys

import commands
import pytest
import torch
from attn_reference import single_process_attention, zigzag_shard
from conftest import HANG_GUARD_S
from dist_utils import new_cp_group, run_distributed

from cp_handler.bench import torch_ring
from cp_handler.bench.attention import stdlib_document_lengths
from cp_handler.bench.case_progress import each_case
from cp_handler.bench.cli import build_parser, main, parse_args
from cp_handler.bench.defaults import DEFAULTS, defaults, flags, resolve
from cp_handler.bench.launches import ATTENTION_OPS, LaunchCounter
from cp_handler.bench.plan import PlanCase, PlanShape, doc_lengths, plan_tiles, profile_case, rank_plan, whole_tiles
from cp_handler.bench.plots import IMPLEMENTATIONS, style
from cp_handler.bench.report import add_efficiency, attention_table
from cp_handler.bench.torch_ring import check_available, torch_ring_attn
from cp_handler.ops.kernels import count_attn_work
from cp_handler.ops.kernels.work import block_pairs, block_tiles
from cp_handler.ops.ring import ring_attn

B, H, S, D = 1, 4, 64, 16
ATOL = 1e-5


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, S, D, generator=g) for _ in range(4)]


def _peer_worker(rank, world):
    q, k, v, dout = _inputs()
    out, _, dq, dk, dv = single_process_attention(q, k, v, dout, causal=True)
    local = [zigzag_shard(t, 2, rank, world).requires_grad_() for t in (q, k, v)]
    group = new_cp_group()
    for method in ("allgather", "alltoall"):
        for t in local:
            t.grad = None
        got = torch_ring_attn(*local, group=group, causal=True, scale=D**-0.5, rotate_method=method)
        got.backward(zigzag_shard(dout, 2, rank, world))
        torch.testing.assert_close(got, zigzag_shard(out, 2, rank, world), atol=ATOL, rtol=0)
        for t, ref in zip(local, (dq, dk, dv), strict=True):
            torch.testing.assert_close(t.grad, zigzag_shard(ref, 2, rank, world), atol=ATOL, rtol=0)


@pytest.mark.skipif(check_available() is not None, reason="PyTorch ring templates missing in this torch")
@pytest.mark.parametrize("world", [2, 4])
def test_torch_ring_peer_matches_single_process(world):
    run_distributed(_peer_worker, world)


def _work_worker(rank, world):
    q, k, v, _ = _inputs()
    local = [zigzag_shard(t, 2, rank, world) for t in (q, k, v)]
    with count_attn_work() as ours:
        ring_attn(*local, group=new_cp_group(), causal=True, scale=D**-0.5)
    with count_attn_work() as peer:
        torch_ring_attn(*local, group=new_cp_group(), causal=True, scale=D**-0.5)
    pairs = torch.tensor([ours.pairs, peer.pairs])
    total = pairs.clone()
    torch.distributed.all_reduce(total)
    assert total.tolist() == [B * H * S * (S + 1) // 2] * 2  # the causal triangle, exactly once
    maximum = pairs.clone()
    torch.distributed.all_reduce(maximum, op=torch.distributed.ReduceOp.MAX)
    assert maximum.tolist() == [B * H * S * (S + 1) // 2 // world] * 2  # zigzag: equal work per rank


def test_work_counter_partitions_the_causal_triangle():
    run_distributed(_work_worker, 4)


def test_stdlib_document_lengths_pack_exactly():
    for seq_len in (256, 4096):
        lengths = stdlib_document_lengths(seq_len)
        assert sum(lengths) == seq_len and len(lengths) >= 8 and max(lengths) <= seq_len // 8
        assert lengths == stdlib_document_lengths(seq_len)  # deterministic in the seed


def test_parse_args_rejects_a_length_the_zigzag_cannot_split():
    with pytest.raises(SystemExit):
        parse_args(["--seq-lens", "100", "--cp-sizes", "4"])


def test_cp_bench_writes_json_table_and_plots(tmp_path):
    out = tmp_path / "bench"
    result = commands.run("cp_handler.bench.cli", ["--quick", "--cp-sizes", "1", "2", "--seq-lens", "256", "--reps",
                                                   "1", "--e2e-seq-len", "128", "--e2e-steps", "2", "--out-dir",
                                                   str(out)], timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    rows = results["attention"]
    impls = {(r["impl"], r["comm_type"], r["qkv_format"]) for r in rows}
    assert ("torch_ring", "allgather", "bshd") in impls and ("local", "p2p", "thd") in impls
    assert ("single", "none", "bshd") in impls
    for r in rows:
        assert r["median_ms"] > 0 and r["peak_memory_bytes"] > 0
        if r["cp_size"] == 2 and r["impl"] != "single":
            assert r["bytes_sent"] > 0 and r["cp_efficiency"] > 0
    assert [t["cp_size"] for t in results["e2e"]["train"]] == [1, 2]
    assert (out / "results.md").read_text().count("| torch_ring |") >= 2
    assert sorted(p.name for p in out.glob("*.png")) == [
        "attn_fwd_bshd.png", "attn_fwd_bwd_bshd.png", "attn_fwd_bwd_thd.png", "attn_fwd_thd.png"]
    assert "cp-bench: attn cp=2 1/" in result.stderr and "cp-bench: e2e 5/5 case overhead cp=1" in result.stderr
    assert "results.md and 4 plots (attn_fwd_bshd.png, " in result.stderr  # progress lines, the plots written


def test_memory_counts_saved_bytes_and_projects_from_them():
    """The saved-tensor count of ``--modes memory`` on a tiny layer shape: a chunked loss keeps no logits (the
    whole one keeps at least the float32 logits' V x 4 bytes per token), recomputation keeps less per layer, a tiled
    MLP keeps its input only (hidden x 2 bytes per token in bfloat16; whole SwiGLU: (hidden + 4 ffn) x 2), and the
    projection's tokens per rank follow from its bytes per token (a larger CP size frees state, never less)."""
    from cp_handler.bench import memory

    shape = {"hidden_size": 32, "num_layers": 4, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 64, "vocab_size": 1000}
    rows = {(r["recompute"], r["loss_chunk_tokens"], r["mlp_chunk_tokens"]): r
            for r in memory.measure_layer(32, shape, chunk=8)}
    assert rows[False, None, None]["other_bytes_per_token"] >= 1000 * 4 > \
        10 * rows[False, 8, None]["other_bytes_per_token"]
    assert rows[False, None, None]["layer_bytes_per_token"] == rows[False, 8, None]["layer_bytes_per_token"] > 0
    whole, tiled = rows[False, 8, None], rows[False, 8, 8]
    assert (whole["mlp_bytes_per_token"], tiled["mlp_bytes_per_token"]) == ((32 + 4 * 64) * 2, 32 * 2)
    assert whole["layer_bytes_per_token"] - tiled["layer_bytes_per_token"] == 4 * 64 * 2
    projected = memory.project(list(rows.values()), cp_sizes=(1, 8), shape=shape)
    for row in projected:
        assert row["tokens_per_rank"] * row["gpu_bytes_per_token"] <= 0.9 * 80e9
    by = {(r["cp_size"], r["recompute"], r["chunked_loss"], r["offload"], r["tiled_mlp"]): r["tokens_per_rank"]
          for r in projected}
    assert by[8, True, True, False, False] > by[8, False, True, False, False]
    assert by[8, True, True, True, False] > by[8, True, True, False, False]
    assert by[8, True, True, False, True] > by[8, True, True, False, False]
    assert memory.parameters(memory.LLAMA3_8B) == 8_030_261_248  # Llama-3-8B's published count


def test_plan_mode_on_cpu_writes_efficiency_table(tmp_path, capsys):
    """The per-rank plan benchmark in its CPU emulation mode: every pattern, bshd and thd, an
    efficiency per row; each pattern's rank plan computes 1/cp of the causal score pairs (zigzag). The plot
    it wrote is named, with a progress line per case (stderr is not a terminal here)."""
    out = tmp_path / "plan"
    assert main(["--modes", "plan", "--plan-seq-lens", "128", "--plan-cp-sizes", "2", "4", "--reps", "1",
                 "--warmup", "0", "--plan-heads", "4", "--plan-kv-heads", "2", "--plan-head-dim", "16",
                 "--thd-mean-doc", "20", "--out-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert "cp-bench: plan 1/16 case whole sdpa bshd S=128\n" in err and "cp-bench: plan 16/16 case a2a+p2p thd" in err
    assert "results.md and 1 plot (plan_efficiency.png) in " in err
    rows = json.loads((out / "results.json").read_text())["plan"]["rows"]
    assert {(r["pattern"], r["qkv_format"]) for r in rows} == {
        (p, f) for p in ("whole", "p2p", "all_gather", "a2a", "a2a+p2p") for f in ("bshd", "thd")}
    assert all(r["efficiency"] > 0 and set(r["efficiency_vs"]) == {"sdpa"} for r in rows if r["pattern"] != "whole")
    assert {r["reference"] for r in rows if r["pattern"] == "whole"} == {"sdpa"}  # auto on CPU: SDPA (per document)
    assert (out / "plan_efficiency.png").exists() and "| bshd | 128 | a2a+p2p | 4 |" in (out / "results.md").read_text()
    shape = PlanShape(num_heads=4, num_kv_heads=2)
    for pattern, cp in (("p2p", 4), ("all_gather", 4), ("a2a", 2), ("a2a+p2p", 4)):
        plan = rank_plan(PlanCase(pattern, "bshd", cp, 128), shape)
        pairs = sum(block_pairs(q.stop - q.start, k.stop - k.start, c) for step in plan.steps for q, k, c in step)
        assert pairs * plan.heads == 4 * 128 * 129 // 2 // cp, pattern


def test_plan_heads_the_a2a_size_does_not_split_run_padded():
    """Heads an all-to-all size does not divide (once refused by ``--plan-heads``) are planned as the a2a runs them:
    padded (:func:`~cp_handler.ops.ulysses.a2a_head_plan`), heads per rank rounded up; the other patterns and the
    even case keep their heads."""
    parse_args(["--modes", "launches", "--plan-heads", "24", "--plan-cp-sizes", "16", "--comm-types", "a2a"])
    for (heads, kv_heads), pattern, cp, per_rank in [
        ((24, 8), "a2a", 16, (2, 1)),  # (Hkv, g) = (8, 3) -> (8, 4), KV replicated twice: 32 / 16 heads
        ((24, 8), "a2a+p2p", 16, (12, 4)),  # a2a size 2 divides both: no padding
        ((6, 3), "a2a", 4, (2, 1)),  # (3, 2) -> (4, 2)
        ((6, 3), "a2a+p2p", 4, (4, 2)),  # a2a size 2: (3, 2) -> (4, 2)
        ((4, 2), "a2a", 2, (2, 1)), ((4, 1), "a2a", 4, (1, 1)),  # even: as before
        ((6, 3), "p2p", 4, (6, 3)), ((6, 3), "all_gather", 4, (6, 3)),
    ]:
        plan = rank_plan(PlanCase(pattern, "bshd", cp, 2 * cp), PlanShape(num_heads=heads, num_kv_heads=kv_heads))
        assert (plan.heads, plan.kv_heads) == per_rank, (heads, kv_heads, pattern, cp)


def test_profile_case_traces_one_rank_step(tmp_path):
    """gpu_check's profile_thd stage on CPU: rank 0's thd ring step under torch.profiler, a gzipped Chrome trace
    holding the attention kernel's operator, and its table naming the kernel."""
    shape = PlanShape(num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", device="cpu", thd_mean_doc=20)
    table = profile_case(PlanCase("p2p", "thd", 4, 256), shape, str(tmp_path / "trace.json.gz"), warmup=0)
    assert table.startswith("kernel cpu_flash") and "scaled_dot_product" in table
    trace = json.loads(gzip.decompress((tmp_path / "trace.json.gz").read_bytes()))
    assert any("scaled_dot_product" in e.get("name", "") for e in trace["traceEvents"])


def test_hybrid_mode_state_passing_beside_the_sequence_gather(tmp_path):
    """``--modes hybrid``: one Gated DeltaNet layer at cp 1 and 2 with both paths; the state passing sends the
    same bytes at every length (summaries and a halo), the gather twice as many for twice the tokens, and the two
    outputs agree (float32: both exact, sums reordered)."""
    out = tmp_path / "hybrid"
    assert main(["--modes", "hybrid", "--hybrid-seq-lens", "64", "128", "--hybrid-cp-sizes", "1", "2", "--reps", "1",
                 "--hybrid-hidden-size", "32", "--hybrid-head-dim", "8", "--no-plots", "--out-dir", str(out)]) == 0
    rows = {(r["cp_size"], r["seq_len"]): r for r in json.loads((out / "results.json").read_text())["hybrid"]["rows"]}
    assert rows[1, 64]["cp_bytes"] == rows[1, 64]["gather_bytes"] == 0
    assert 0 < rows[2, 64]["cp_bytes"] == rows[2, 128]["cp_bytes"]
    assert rows[2, 128]["gather_bytes"] == 2 * rows[2, 64]["gather_bytes"] == 2 * 2 * 32 * 32 * 4  # fwd + bwd
    assert all(r["max_abs_diff"] < 1e-5 for r in rows.values())
    assert "| 128 | 2 |" in (out / "results.md").read_text()


def test_compile_mode_compiled_beside_eager(tmp_path):
    """``--modes compile``: per comm type, the whole forward is one graph with no break, the compiled logits equal
    the eager ones (float32, Inductor's reordered sums: 1e-5), and the eager forward's Python calls are counted."""
    out = tmp_path / "compile"
    assert main(["--modes", "compile", "--compile-seq-len", "64", "--compile-comm-types", "p2p", "a2a", "--reps",
                 "1", "--no-plots", "--out-dir", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["compile"]["rows"]
    assert [r["comm_type"] for r in rows] == ["p2p", "a2a"]
    assert all((r["graphs"], r["breaks"]) == (1, 0) and r["max_abs_diff"] < 1e-5 and r["python_calls"] > 0
               for r in rows)
    assert "| p2p | 64 | 2 |" in (out / "results.md").read_text()


def _tiles_of(mask: torch.Tensor, tile: int) -> int:
    """Tiles of a dense (Sq, Sk) bool mask holding at least one True: the brute-force count."""
    rows, cols = -(-mask.shape[0] // tile), -(-mask.shape[1] // tile)
    padded = torch.zeros(rows * tile, cols * tile, dtype=torch.bool)
    padded[:mask.shape[0], :mask.shape[1]] = mask
    return int(padded.view(rows, tile, cols, tile).any(3).any(1).sum())


@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 9), (16, 16), (17, 40), (100, 33)])
def test_block_tiles_counts_the_tiles_a_block_touches(sq, sk):
    assert block_tiles(sq, sk, False, 16) == _tiles_of(torch.ones(sq, sk, dtype=torch.bool), 16)
    assert block_tiles(sq, sq, True, 16) == _tiles_of(torch.ones(sq, sq, dtype=torch.bool).tril(), 16)


def test_tile_model_against_the_dense_masks():
    """The whole pack's tiles are those of its document-causal mask (brute force); split into zigzag
    chunks, bshd visits the same tiles at any cp (chunks of whole tiles) and thd more (pieces of
    documents shorter than a tile), a2a fewest (whole documents)."""
    shape, seq_len, tile = PlanShape(num_heads=4, num_kv_heads=4, thd_mean_doc=40), 1024, 128
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths(seq_len, 40))), torch.tensor(doc_lengths(seq_len, 40)))
    document_causal = (doc[:, None] == doc[None, :]).tril()
    assert whole_tiles(PlanCase("whole", "thd", 1, seq_len), shape) == 4 * _tiles_of(document_causal, tile)
    ratio = {}
    for fmt in ("bshd", "thd"):
        whole = whole_tiles(PlanCase("whole", fmt, 1, seq_len), shape)
        for pattern in ("p2p", "a2a"):
            case = PlanCase(pattern, fmt, 4, seq_len)
            ratio[fmt, pattern] = case.cp_size * plan_tiles(rank_plan(case, shape)) / whole
    assert ratio["bshd", "p2p"] == ratio["bshd", "a2a"] == 1.0
    assert ratio["thd", "p2p"] > ratio["thd", "a2a"] > 1.0, ratio


def test_plan_mode_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        parse_args(["--modes", "plan", "--device", "cuda"])
    assert "--device cuda: no CUDA device is available here" in capsys.readouterr().err


def test_launches_mode_counts_each_kernels_operators(tmp_path, capsys):
    """``--modes launches`` on meta tensors (no GPU): native GQA drops the K/V copies and the dk/dv
    sums, packed calls cut thd's per-document launches, bshd's packed calls read views where their
    rows are one range (no gathers), and a ring's steps share their lse row copies. It draws no plot, and
    says none (plots on)."""
    out = tmp_path / "launches"
    assert main(["--modes", "launches", "--plan-seq-lens", "2048", "--plan-cp-sizes", "4", "--thd-mean-doc", "64",
                 "--comm-types", "p2p", "all_gather", "a2a", "--out-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert "results.md in " in err and "plot" not in err.splitlines()[-1] and not list(out.glob("*.png"))
    results = json.loads((out / "results.json").read_text())["launches"]
    rows = {(r["qkv_format"], r["pattern"]): r for r in results["rows"]}
    assert set(rows) == {(f, p) for f in ("bshd", "thd") for p in ("p2p", "all_gather", "a2a")}
    for (fmt, pattern), r in rows.items():
        ops, by_op = r["ops"], r["by_operator"]
        assert ops["flash_gqa"] < ops["flash"] and "sum" not in by_op["flash_gqa"]
        assert by_op["flash"]["_scaled_dot_product_flash_attention"] == r["blocks"]  # one forward call per block
        if fmt == "thd":
            assert ops["flash_varlen"] < ops["flash_gqa"] / 2, r
        else:  # p2p: every call's rows are one range; all_gather's causal call gathers its two K/V chunks
            assert ops["flash_varlen"] <= ops["flash_gqa"], r
            assert ("index_select" in by_op["flash_varlen"]) == (pattern == "all_gather"), r
        if (fmt, pattern) == ("bshd", "p2p"):  # the steps share two lse row ranges (LseRows): one copy each at most
            assert by_op["flash_gqa"].get("clone", 0) <= 2, by_op["flash_gqa"]
    assert all(r["tile_ratio"] == 1.0 for r in results["rows"] if r["qkv_format"] == "bshd")
    assert rows["thd", "p2p"]["tile_ratio"] > 1.0  # documents of mean 64 cut into pieces of 8 rows
    assert f"| thd | 2048 | p2p | 4 | {rows['thd', 'p2p']['rank']} | 512 |" in (out / "results.md").read_text()
    for r in results["rows"]:  # bytes outside the kernels: every operator's but the attention kernels'
        assert r["rank"] in (0, 3), r["rank"]  # the busier end of the ring was counted
        for name, by_bytes in r["bytes_by_operator"].items():
            assert not set(by_bytes) & ATTENTION_OPS and sum(by_bytes.values()) == r["bytes_outside"][name]
    assert "MB moved outside the attention kernels" in (out / "results.md").read_text()
    # a2a over packed documents: the inner ring's reorder folded into the all-to-all's own, so its one causal call
    # reads every real row as one range: no gather or scatter, bshd's bytes (issue 72, part 5)
    thd_a2a = rows["thd", "a2a"]
    assert not {"index_select", "index_add_", "index_copy_"} & set(thd_a2a["by_operator"]["flash_varlen"]), thd_a2a
    assert thd_a2a["bytes_outside"]["flash_varlen"] <= 1.05 * rows["bshd", "a2a"]["bytes_outside"]["flash_varlen"]


def test_launch_counter_bytes_are_every_tensor_read_and_written():
    """An out-of-place op reads its inputs and writes its result; an in-place op reads and writes its tensor; an
    attention kernel is counted as a launch, its bytes are not."""
    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")  # 128 bytes each (float32)
    q = torch.empty(1, 2, 16, 8, device="meta", dtype=torch.bfloat16)
    with LaunchCounter() as counter:
        c = a + b
        c.mul_(2.0)
        torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False)
    assert counter.bytes_outside == {"add": 3 * 128, "mul_": 2 * 128}
    assert counter.ops["_scaled_dot_product_efficient_attention"] == 1


@pytest.mark.parametrize("flags, message", [
    (["--modes", "launches", "--launch-kernels", "cpu_flash"], "--launch-kernels: 'cpu_flash' is not a CUDA kernel"),
    (["--modes", "launches", "--plan-head-dim", "512"],
     "--launch-kernels: 'flash' cannot run this shape: it takes head dims <= 256, q has 512"),
    (["--modes", "launches", "--plan-dtype", "float32"], "--launch-kernels: 'flash' cannot run this shape: it takes"),
    (["--modes", "launches", "--plan-heads", "30"], "--plan-heads 30 must be a multiple of --plan-kv-heads 8 (GQA)"),
    (["--modes", "launches", "--plan-kv-heads", "0"], "--plan-kv-heads: 0 must be >= 1"),
    (["--modes", "plan", "--plan-seq-lens", "1000", "--plan-cp-sizes", "8"],
     "--plan-seq-lens 1000 must be divisible by 2 * cp = 16"),
    (["--modes", "plan", "--attn-kernel", "flash"], "--attn-kernel 'flash' cannot run this attention: it runs on cuda"),
    (["--modes", "plan", "--whole-kernels", "flex"], "--whole-kernels flex (bshd): FlexAttention has no CPU backward"),
    (["--modes", "plan", "--whole-kernels", "fa4"], "--whole-kernels fa4 (bshd): FlashAttention-4 runs on CUDA only"),
    (["--modes", "hybrid", "--hybrid-seq-lens", "100", "--hybrid-cp-sizes", "4"],
     "--hybrid-seq-lens 100 must be divisible by 2 * cp = 8"),
    (["--modes", "hybrid", "--hybrid-heads", "3"], "--hybrid-heads 3 must be a multiple of --hybrid-key-heads 2"),
])
def test_plan_and_launches_flags_are_checked_before_running(capsys, flags, message):
    """Each rule of the plan / launches flags is one line naming the flag, before any case runs
    (before: a silent skip of the length, nonsense GQA shapes counted, a traceback from the kernel)."""
    with pytest.raises(SystemExit):
        parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("gpus, flags, message", [
    (1, ["--cp-sizes", "1", "2", "--dtype", "bfloat16"],
     "--cp-sizes up to 2 needs 2 GPUs (one per rank; NCCL refuses two ranks on one GPU), this machine has 1"),
    (8, ["--cp-sizes", "2", "4"], "--dtype float32: use bfloat16 (PyTorch's ring runs FlashAttention-2)"),
])
def test_attn_mode_on_cuda_needs_a_gpu_per_rank_and_bf16(monkeypatch, capsys, gpus, flags, message):
    """``--modes attn --device cuda`` (NCCL, one GPU per rank) is refused before any rank starts
    when the machine has too few GPUs or the dtype is one PyTorch's flash ring cannot run."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit):
        parse_args(["--modes", "attn", "--device", "cuda", *flags])
    assert message in capsys.readouterr().err


def test_e2e_mode_refuses_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        parse_args(["--modes", "e2e", "--device", "cuda"])
    assert "--device cuda runs --modes attn, plan and launches" in capsys.readouterr().err


def test_torch_ring_cuda_ops_take_what_the_peer_passes():
    """The CUDA peer's forward and backward calls (PyTorch's flash ops, with the arguments its own
    ring-flash wrappers pass, the backward's extras taken from the forward's outputs) run through
    the ops' meta kernels: every name and type matches this torch's schemas without a GPU."""
    q = torch.empty(1, 4, 16, 8, device="meta", dtype=torch.bfloat16)
    out, lse, *rest = torch_ring.forward_op(q, q, q, is_causal=True, dropout_p=0.0, scale=0.3)
    extras = torch_ring.backward_extras("cuda", rest)
    assert set(extras) == {"cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset"}
    dq, dk, dv = torch_ring.flash_ops("meta")[1](grad_out=out, query=q, key=q, value=q, out=out, logsumexp=lse,
                                                 is_causal=True, dropout_p=0.0, scale=0.3, **extras)[:3]
    assert dq.shape == dk.shape == dv.shape == q.shape
    assert torch_ring.backward_extras("cpu", rest) == {}


def _row(impl, comm_type, times):
    return {"impl": impl, "comm_type": comm_type, "cp_size": 2, "seq_len": 256, "qkv_format": "bshd",
            "pass_name": "fwd", "threads": 1, "times_ms": times, "median_ms": statistics.median(times),
            "peak_memory_bytes": 1, "bytes_sent": 1, "load_balance": 1.0}


def test_report_ratios_are_the_printed_medians_and_noisy_rows_get_no_verdict():
    rows = add_efficiency([_row("single", "none", [100.0, 101.0, 102.0]), _row("local", "p2p", [50.0, 51.0, 52.0]),
                           _row("local", "a2a", [40.0, 80.0, 41.0]),  # spread 98%: noisy
                           _row("torch_ring", "allgather", [60.0, 61.0, 62.0])])
    by_impl = {(r["impl"], r["comm_type"]): r for r in rows}
    assert by_impl[("local", "p2p")]["cp_efficiency"] == 101.0 / 51.0
    assert by_impl[("torch_ring", "allgather")]["ours_speedup"] == 61.0 / 51.0  # PyTorch's median / ours
    assert by_impl[("local", "a2a")]["cp_efficiency"] is None and by_impl[("local", "a2a")]["noisy"]  # spread 98%
    table = attention_table(rows)
    assert "| 41.0 | 98% (noisy) | noisy |" in table and "| 61.0 | 3% | 1.656 | 1.196 |" in table


def test_every_implementation_has_one_style_in_every_plot():
    styles = [tuple(style(name).values()) for name in IMPLEMENTATIONS]
    assert len(set(styles)) == len(styles)
    assert style("p2p") == style("local p2p") and style("a2a+p2p") == style("local a2a+p2p")  # plan patterns


def test_plots_without_matplotlib_name_the_extra_before_any_benchmark(monkeypatch, capsys):
    """matplotlib is the ``bench`` extra: without it cp-bench stops before measuring anything, naming the
    extra (or runs with ``--no-plots``)."""

    from cp_handler.bench import plots
    from cp_handler.bench.cli import parse_args

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(ImportError, match=r"cp-bench plots need matplotlib, an optional dependency: pip install "
                                          r"'matplotlib>=3.7' \(cp_handler's bench extra.*"
                                          r"\(or run cp-bench --no-plots\)"):
        plots.require_matplotlib()
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--modes", "attn"])
    assert "pip install 'matplotlib>=3.7' (cp_handler's bench extra" in capsys.readouterr().err
    assert parse_args(["--quick", "--modes", "attn", "--no-plots"]).no_plots


def test_the_package_installs_no_top_level_module_but_cp_handler():
    """The reference models live in cp_handler.models: a top-level ``models`` shadowed (or was shadowed by)
    users' own packages of that very common name."""
    from pathlib import Path

    import tomllib
    from setuptools import find_packages

    root = Path(__file__).parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(root), include=config["include"])
    assert packages and all(p == "cp_handler" or p.startswith("cp_handler.") for p in packages), packages
    assert "cp_handler.models" in packages and not (root / "models").exists()
    assert "matplotlib" not in " ".join(tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"])


def _resolved(mode, *flags_given):
    return resolve(parse_args(["--modes", mode, "--no-plots", *flags_given]), mode)


def test_launches_defaults_on_cpu_are_a_small_grid_and_the_cuda_grid_is_asked_for(monkeypatch):
    """Issue 50: ``--modes launches`` on a CPU ran the CUDA grid (S 4k-128k x cp 1-32, 22.6 silent minutes). Its
    default is now a small grid of the Llama-3-8B attention shape (the CUDA kernels' counts need it); the CUDA grid
    comes with ``--device cuda``, which needs no GPU for launches; given flags are kept."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    llama = {"plan_heads": 32, "plan_kv_heads": 8, "plan_head_dim": 128, "plan_dtype": "bfloat16"}
    for flags_given, seq_lens, cp_sizes in (((), [4096, 16384, 65536], [2, 4, 8]),
                                            (("--quick",), [4096, 16384], [2, 4, 8]),
                                            (("--device", "cuda"), [4096, 8192, 16384, 32768, 65536, 131072],
                                             [1, 2, 4, 8, 16, 32]),
                                            (("--plan-seq-lens", "2048"), [2048], [2, 4, 8])):
        args = _resolved("launches", *flags_given)
        assert (args.plan_seq_lens, args.plan_cp_sizes) == (seq_lens, cp_sizes), flags_given
        assert {key: getattr(args, key) for key in llama} == llama
    plan_and_launches = parse_args(["--modes", "plan", "launches", "--no-plots"])  # before: float32 refused by flash
    assert resolve(plan_and_launches, "plan").plan_dtype == "float32"
    assert resolve(plan_and_launches, "launches").plan_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parse_args(["--modes", "plan", "launches", "--device", "cuda", "--no-plots"])  # plan still needs the GPU


def test_every_modes_cpu_defaults_are_the_small_ones():
    """The flags each mode runs with on CPU when none is given (and with --quick): the small sizes the help shows."""
    assert _resolved("plan").plan_seq_lens == [1024, 4096] and _resolved("plan").plan_dtype == "float32"
    assert _resolved("masks").plan_heads == 8 and _resolved("masks", "--quick").reps == 3
    memory_args = _resolved("memory")
    assert (memory_args.mem_seq_len, memory_args.mem_layer_tokens) == (2048, 64)
    assert _resolved("hybrid", "--quick").hybrid_seq_lens == [2048, 8192]
    assert _resolved("generate", "--quick").gen_prompt_lens == [4096, 8192]
    assert (_resolved("e2e", "--quick").e2e_seq_len, _resolved("attn", "--quick").seq_lens) == (2048, [2048, 4096])
    assert parse_args(["--modes", "launches", "--no-plots"]).plan_seq_lens is None  # each mode fills its own


def test_help_shows_every_modes_defaults_on_cpu_and_cuda(monkeypatch):
    """``cp-bench --help`` lists, per mode, the flags it runs with when none is given, on CPU and with --device cuda:
    exactly what the modes resolve (CPU, and launches' CUDA grid, which needs no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    text = " ".join(build_parser().format_help().split())
    for mode in DEFAULTS:
        args = _resolved(mode)
        where = "CPU and --device cuda" if DEFAULTS[mode].get("cuda") == DEFAULTS[mode]["cpu"] else "CPU"
        sizes = flags({k: getattr(args, k) for k in defaults(mode)}) or "nothing to size"
        assert f"{mode} ({where}): {sizes}" in text, mode
    cuda = _resolved("launches", "--device", "cuda")
    assert f"launches (--device cuda): {flags({k: getattr(cuda, k) for k in defaults('launches', 'cuda')})}" in text
    assert "launches: 4096 16384 65536 (--quick: 4096 16384) on CPU" in text  # in --plan-seq-lens' own help
    assert "counted on meta tensors (no GPU needed; a small grid unless --device cuda)" in text


def test_each_mode_prints_a_line_per_case_when_stderr_is_not_a_terminal(tmp_path, capsys):
    """Progress of every mode through one helper: a line per case in a log (a bar on a terminal); each mode first
    says the sizes it runs; no plot claimed with --no-plots."""
    assert list(each_case(["a", "b"], "demo", str.upper)) == ["a", "b"]
    assert capsys.readouterr().err == ("cp-bench: demo 1/2 started case A\ncp-bench: demo 1/2 case A\n"
                                       "cp-bench: demo 2/2 started case B\ncp-bench: demo 2/2 case B\n")
    out = tmp_path / "small"
    assert main(["--modes", "launches", "masks", "--plan-seq-lens", "256", "--plan-cp-sizes", "2", "--comm-types",
                 "p2p", "--formats", "bshd", "--launch-kernels", "flash", "--mask-seq-len", "64", "--mask-cp-size",
                 "2", "--mask-window", "8", "--mask-chunk", "16", "--reps", "1", "--warmup", "0", "--no-plots",
                 "--out-dir", str(out)]) == 0
    err = capsys.readouterr().err
    assert "cp-bench: launches: --comm-types p2p --plan-seq-lens 256 --plan-cp-sizes 2 --plan-heads 32" in err
    assert "cp-bench: launches 1/1 case p2p bshd S=256 cp=2\n" in err
    assert "cp-bench: masks 1/10 case full causal rank 0\n" in err
    assert "cp-bench: masks 6/10 case chunk 16 rank 1\n" in err
    rows = json.loads((out / "results.json").read_text())["masks"]["rows"]
    explicit = {r["case"]: r["explicit_blocks"] for r in rows}
    # windows on cpu_flash's additive mask; FA2's windows only by opt-in until a GPU run; soft-caps explicit
    assert explicit["window 8"]["cpu"] == explicit["window 8"]["cuda flash_gqa opt-in"] == 0
    assert explicit["window 8"]["cuda automatic"] > 0
    assert explicit["window 8 + softcap 50"]["cpu"] == explicit["window 8 + softcap 50"]["cuda flash_gqa opt-in"] > 0
    assert explicit["window 8 + softcap 50"]["cuda fa4 opt-in"] == explicit["softcap 50"]["cuda fa4 opt-in"] == 0
    compared = {r["case"]: r["explicit_scores_ms"] is not None for r in rows}  # timed both ways where it differs
    assert compared == {"full causal": False, "window 8": True, "chunk 16": False, "softcap 50": False,
                        "window 8 + softcap 50": False}
    assert err.splitlines()[-1].startswith(f"cp-bench: wrote {out}/results.json, results.md in ")


def test_memory_mode_counts_fake_tensors_as_real_ones():
    """``--modes memory`` measures the Llama-3-8B layer on fake tensors (seconds, where real bfloat16 weights took
    over 13 minutes on a CPU without bfloat16 instructions): every saved byte is the same as on real tensors."""
    from cp_handler.bench import memory

    shape = {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 64, "vocab_size": 1000}
    fake = memory.measure_layer(32, shape, chunk=8)
    assert fake == memory.measure_layer(32, shape, chunk=8, fake=False)
    assert {r["layer_bytes_per_token"] for r in fake if not r["recompute"]} == {1496.0, 984.0}  # whole / tiled MLP


@pytest.mark.parametrize("mode", ["generate", "hybrid", "memory"])
def test_cpu_only_modes_refuse_cuda(monkeypatch, capsys, mode):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        parse_args(["--modes", mode, "--device", "cuda", "--no-plots"])
    err = capsys.readouterr().err
    assert f"--modes {mode} runs on CPU" in err and "drop --device cuda" in err


def test_cp_bench_takes_flags_only_spelled_in_full(capsys):
    """Issue 50: no prefix of a flag is taken for it (``--plan-seq 256`` is not ``--plan-seq-lens``); the one meant
    is named."""
    with pytest.raises(SystemExit):
        parse_args(["--modes", "launches", "--plan-seq", "256", "--no-plots"])
    assert "unrecognized arguments: --plan-seq (did you mean --plan-seq-lens?)" in capsys.readouterr().err


def test_memory_tp_projection_follows_its_bytes():
    """The TP x CP projection of ``--modes memory`` (Llama-3-70B, 70.55B parameters; Llama-3-8B): each layout's tokens
    fit its free bytes; one node of 8 x 80 GB holds no 70B layout's training state (16 bytes per parameter over 8
    ranks: 141 GB or more per rank) and every 8B layout's; without sequence parallelism more CP and less TP holds a
    longer sequence (TP does not divide the checkpointed layer inputs); sequence parallelism keeps fewer bytes per
    token and holds more tokens per rank than the same layout without it; a TP rank saves less per recomputed layer
    than a whole one. The bytes-per-token rule is checked on real ranks in tests/test_tensor_parallel.py."""
    from cp_handler.bench import memory

    assert memory.parameters(memory.LLAMA3_70B) == 70_553_706_496  # Llama-3-70B's count
    for name, shape in memory.TP_SHAPES.items():
        measured = memory.measure_tp_layer(16, shape, chunk=8)
        saved = {r["tp"]: r["layer_bytes_per_token"] for r in measured if not r["recompute"]}
        assert saved[1] > saved[2] > saved[4] > saved[8] > 0
        rows = memory.project_tp(measured, shape)
        for row in rows:
            assert row["tokens_per_rank"] * row["gpu_bytes_per_token"] <= 0.9 * 80e9
        one_node = [r for r in rows if r["where"] == "one node of 8 GPUs"]
        assert len(one_node) == 7  # tp 8, 4, 2 with and without sequence parallelism, tp 1
        if name == "Llama-3-70B":
            assert all(r["sequence"] == 0 and r["state_gb"] > 72 for r in one_node)
        else:
            assert all(r["sequence"] > 0 for r in one_node)
        for where in memory.TP_LAYOUTS:
            plain = [r["sequence"] for r in rows if r["where"] == where and not r["sequence_parallel"]]  # tp 8 .. 1
            assert plain == sorted(plain), (name, where, plain)
        by = {(r["where"], r["tp"], r["sequence_parallel"]): r for r in rows}
        for (where, tp, sp), row in by.items():
            if sp:
                off = by[where, tp, False]
                assert row["gpu_bytes_per_token"] < off["gpu_bytes_per_token"], (name, where, tp)
                assert row["tokens_per_rank"] >= off["tokens_per_rank"], (name, where, tp)


def test_tp_mode_layouts_and_table():
    """``--modes tp``: every TP x CP layout of the world whose tp divides the heads (sequence parallelism on and off
    above tp 1), each run's flags cp-train's own rules accept, and its table from a result's rows."""
    from cp_handler.bench import tensor_parallel
    from cp_handler.bench.report import tp_table
    from cp_handler.cli.args import parse

    layouts = tensor_parallel.layouts(4)
    assert layouts == [(1, 4, False), (2, 2, False), (2, 2, True), (4, 1, False), (4, 1, True)]
    for tp, cp, sp in layouts:
        config, _ = parse(tensor_parallel.command(4, tp, cp, sp, 256, 2))
        assert (config.tensor_parallel_size, config.cp.context_parallel_size, config.sequence_parallel) == (tp, cp, sp)
    rows = [{"tp": tp, "cp": cp, "sequence_parallel": sp, "seq_len": 256, "tokens_per_s": 100.0 * cp,
             "peak_memory_bytes_per_rank": [2**20]} for tp, cp, sp in layouts]
    text = tp_table({"model": tensor_parallel.MODEL, "world": 4, "rows": rows})
    assert "| 2 | 2 | on | 256 | 200 | 0.50 | 1 |" in text, text
