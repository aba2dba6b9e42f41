"""dispatch / combine / roll_tensor / RoPE of the zigzag handler vs single-process torch, cp in {1, 2, 4}.

These ops only move or rotate values, so results must be bit-exact: compared with torch.equal.
Gradients pass through the same moves (plus one sum over ranks in float64), so also exact.
GPU mode (``-m gpu``): the same checks with every tensor on CUDA (RoPE on both sides on CUDA: exact).
"""

import pytest
import torch
import torch.distributed as dist
from device_cases import GPU_CASES
from dist_utils import new_cp_group, run_distributed

from cp_handler import LocalContextParallelHandler
from cp_handler.runtime.rope import apply_rotary, rotary_freqs


def roll_reference(x: torch.Tensor, shift: int, dim: int) -> torch.Tensor:
    """torch.roll with the wrapped-around positions zeroed (Megatron's roll_tensor)."""
    y = torch.roll(x, shift, dim)
    wrapped = slice(shift, None) if shift < 0 else slice(0, shift)
    y.narrow(dim, wrapped.start if wrapped.start >= 0 else y.shape[dim] + wrapped.start, abs(shift)).zero_()
    return y


def summed_grad(x: torch.Tensor, group) -> torch.Tensor:
    grad = x.grad.clone()
    if group is not None:
        dist.all_reduce(grad, group=group)
    return grad


def _check_dispatch_combine(h, group, seq_dim, device):
    torch.manual_seed(1)
    x = torch.randn(2, 24, 3, dtype=torch.float64).movedim(1, seq_dim).contiguous().to(device).requires_grad_()
    w, u = torch.randn_like(x), torch.randn_like(x)
    local = h.dispatch(x, seq_dim=seq_dim)
    assert local.shape[seq_dim] == 24 // h.cp_size
    full = h.combine(local * h.dispatch(w, seq_dim=seq_dim), seq_dim=seq_dim)
    assert torch.equal(h.combine(h.dispatch(x.detach(), seq_dim), seq_dim), x.detach())
    (full * u).sum().backward()
    assert torch.equal(summed_grad(x, group), w * u)


def _check_roll(h, group, shift, device):
    torch.manual_seed(2)
    x = torch.randn(2, 24, 3, dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn_like(x)
    rolled, total = h.roll_tensor(h.dispatch(x, 1), shifts=shift, dims=1)
    expected = roll_reference(x.detach(), shift, 1)
    assert torch.equal(h.combine(rolled.detach(), 1), expected)
    assert torch.equal(total, rolled.sum())
    (rolled * h.dispatch(w, 1)).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    (roll_reference(x_ref, shift, 1) * w).sum().backward()
    assert torch.equal(summed_grad(x, group), x_ref.grad)
    labels = torch.arange(24, device=device).repeat(2, 1)
    rolled_labels, _ = h.roll_tensor(h.dispatch(labels, 1), shifts=shift, dims=-1)
    assert torch.equal(h.combine(rolled_labels, 1), roll_reference(labels, shift, 1))


def _check_rope(h, device):
    torch.manual_seed(3)
    t = torch.randn(2, 24, 4, 16).to(device)
    freqs = rotary_freqs(h.get_rotary_seq_len(24 // h.cp_size), 16, base=500.0, device=device)
    assert freqs.shape[0] == 24
    local = h.apply_rotary_pos_emb(h.dispatch(t, 1), h.get_emb_on_this_cp_rank(freqs))
    assert torch.equal(local, h.dispatch(apply_rotary(t, freqs, "bshd"), 1))


def _check_layout_api(h, group, device):
    """The layout's public API (docs/api.md "The token layout") against the dispatch of the tokens' own indices:
    ``token_index`` (bshd and thd, padding slots = the real token count), ``padded_document_lengths``."""
    layout = h.token_layout
    assert torch.equal(layout.token_index(24 // h.cp_size, device), h.dispatch(torch.arange(24, device=device), 0))
    assert layout.padded_document_lengths is None and layout.document_lengths is None
    lengths = (5, 11, 1)
    cu = torch.tensor([0, 5, 16, 17], dtype=torch.int32)
    thd = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu)
    shifted = thd.dispatch(torch.arange(1, 18, device=device), 0)  # 0 at the padding the layout inserts
    index = thd.token_layout.token_index(shifted.shape[0], device)
    assert torch.equal(index, torch.where(shifted == 0, 17, shifted - 1))
    step = 2 * h.cp_size if h.cp_size > 1 else 1  # no padding at cp 1 (outside the deterministic mode)
    assert thd.token_layout.document_lengths == lengths
    assert thd.token_layout.padded_document_lengths == tuple(-(-n // step) * step for n in lengths)


def _layout_worker(rank, world, device="cpu"):
    group = new_cp_group() if world > 1 else None
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="bshd")
    assert (h.cp_size, h.cp_rank) == (world, rank)
    for seq_dim in (0, 1, 2):
        _check_dispatch_combine(h, group, seq_dim, device)
    chunk = 24 // (2 * world)
    for shift in sorted({-1, -3, 2, chunk, -chunk}):
        _check_roll(h, group, shift, device)
    _check_rope(h, device)
    _check_layout_api(h, group, device)
    if world > 1:  # a failed call leaves a handler unusable on its rank: a new one per check
        with pytest.raises(ValueError, match=r"seq_len=10 is not divisible by 2 \* context_parallel_size"):
            LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").dispatch(torch.zeros(1, 10), seq_dim=1)
        with pytest.raises(ValueError, match=r"\|shifts\| must be <= the zigzag chunk length"):
            h.roll_tensor(torch.zeros(1, 24 // world), shifts=24 // (2 * world) + 1, dims=1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layout_ops_match_single_process(world):
    run_distributed(_layout_worker, world)


@pytest.mark.parametrize("case", GPU_CASES[:1])
@pytest.mark.parametrize("world", [2, 4])
def test_layout_ops_on_gpu(world, case):
    run_distributed(_layout_worker, world, case.device, device=case.device)
