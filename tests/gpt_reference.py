"""Shared GPT parity helpers: one training step's loss and gradients, and the parity assertion.

Tolerance (float32): loss rtol 1e-6; gradients atol 1e-6 + rtol 1e-4. A CP run reorders float32
sums (ring merges, cross-rank gradient all-reduce, token-count reduction); measured differences
are ~1e-8 absolute on gradients of size ~1e-3..1e-1, so the bounds leave >10x headroom while an
off-by-one position or a missing token changes gradients by >1e-3.

GPU mode: the step runs on CUDA in the case's dtype and is compared with a float64 CPU step from the
same initial parameters by relative norm, per tensor: ``|got - want| <= tol * |want|`` for the loss
and each gradient, ``tol`` = ``GPT_GPU_TOLERANCE`` (fp32 1e-5: no TF32, measured kernel error 5e-7;
bf16 5e-2 and fp16 1e-2: twice the attention tolerance of tests/device_cases.py, as one step
compounds a dozen matmuls, norms and the softmax in that dtype, while a wrong position or token
moves a gradient by O(1) of its norm). With the one-process run in the same dtype given, a tensor
also passes within twice that run's own error (``assert_close_by_norm``).
"""

import torch
import torch.distributed as dist

from cp_handler.models import GPTConfig, GPTModel
from cp_handler.training import global_token_count, masked_token_loss_sum, next_token_batch

CONFIG = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=128)


GPT_GPU_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def loss_and_grads(config, handler, tokens, group, device="cpu", dtype=torch.float32, prepare=None, model=None):
    """Token-weighted loss of one step and every parameter gradient, summed over ``group``; the
    model is initialised on CPU (seed 0) and then moved to ``device`` / ``dtype`` (and given to ``prepare``,
    e.g. to compile its layers), or ``model`` is used as it is (its gradients zeroed first)."""
    if model is None:
        torch.manual_seed(0)
        model = GPTModel(config).to(device, dtype)
        if prepare is not None:
            prepare(model)
    model.zero_grad(set_to_none=True)
    input_ids, labels, loss_mask = next_token_batch(handler, tokens.to(device))
    loss = masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask)
    loss = loss / global_token_count(loss_mask, group)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    loss = loss.detach()
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return loss, grads


def assert_parity(got, want, label):
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0, msg=lambda m: f"{label} loss: {m}")
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{label} grad {n}: {m}")




def assert_close_by_norm(got, want, tol, label, one_process=None):
    """GPU mode: loss and every gradient within ``tol`` of the reference, relative in norm; with
    ``one_process`` (the same step in the same dtype and device without CP), also accepted within
    twice that run's own error, so CP is held to the dtype's round-off rather than to a fixed guess
    (fp16, 4 ranks, H100: one q_proj gradient at 1.12e-2, measured 2026-11-24). Returns the worst
    ``error / bound`` and its tensor's name."""
    assert got[1].keys() == want[1].keys()
    worst = (0.0, None)
    for name, a, b in [("loss", got[0], want[0]), *((n, got[1][n], want[1][n]) for n in want[1])]:
        a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
        error, bound = (a - b).norm().item(), tol * b.norm().item()
        if one_process is not None:
            c = (one_process[0] if name == "loss" else one_process[1][name]).detach().to("cpu", torch.float64)
            bound = max(bound, 2 * (c - b).norm().item())
        worst = max(worst, (error / bound if bound else float("inf"), name), key=lambda w: w[0])
        assert error <= bound, f"{label} {name}: |got - want| = {error:.3g} > {bound:.3g} (tol {tol}, one process x2)"
    return worst
