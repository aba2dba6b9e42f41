"""GPU tests (marked ``gpu``): each GPU backend vs the local handler on the same batch, on CUDA with
NCCL. Skipped where CUDA, two GPUs or the package is missing, and then not counted as passed.

Tolerance: Transformer Engine's own bf16 CP tests, 2.5e-2 (3.5e-2 with GQA) on outputs and
gradients: bf16 keeps 8 mantissa bits and the backends sum in different orders.
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu

needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs")


def _attention_parity(rank, world, backend):
    import torch.distributed as dist

    from cp_handler import get_cp_handler_cls
    from cp_handler.models.gpt import GPTConfig, SelfAttention

    torch.cuda.set_device(rank)
    group = dist.new_group(list(range(world)), backend="nccl")
    for heads, kv_heads, tol in ((8, 8, 2.5e-2), (8, 2, 3.5e-2)):
        config = GPTConfig(hidden_size=8 * 64, num_attention_heads=heads, num_query_groups=kv_heads)
        attn = SelfAttention(config, 1).cuda()
        torch.manual_seed(0)
        q = torch.randn(2, 1024, heads, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 1024, kv_heads, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        results = []
        for name in ("local", backend):
            extra = {"num_heads_q": heads, "num_heads_kv": kv_heads, "head_dim": 64} if name == "magi" else {}
            h = get_cp_handler_cls(name, "p2p")(cp_group=group, cp_comm_type="p2p", **extra)
            q_l, k_l, v_l = (h.dispatch(t, 1).detach().requires_grad_() for t in (q, k, v))
            out = h.core_attn(attn, q_l, k_l, v_l)
            out.float().square().sum().backward()
            results.append([h.combine(t, 1) for t in (out, q_l.grad, k_l.grad, v_l.grad)])
        for got, want in zip(results[1], results[0], strict=True):
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _gpu_worker(rank, init, world, backend):
    import torch.distributed as dist

    from cp_handler import destroy_process_groups

    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        _attention_parity(rank, world, backend)
    finally:
        destroy_process_groups()


def _run(backend):
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gpu_worker, args=(os.path.join(tmp, "init"), 2, backend), nprocs=2)


@needs_two_gpus
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="transformer_engine missing")
def test_transformer_engine_matches_local_bf16():
    _run("transformer_engine")


@needs_two_gpus
@pytest.mark.skipif(importlib.util.find_spec("magi_attention") is None, reason="magi_attention missing")
def test_magi_matches_local_bf16():
    _run("magi")
