"""Masked blocks on CUDA FlashAttention-2 (``flash``, ``flash_gqa``): a block's causal edge and window edges as
the kernel's own ``window_size_left`` / ``window_size_right`` (``aten._flash_attention_forward`` /
``_flash_attention_backward``, dense form), instead of explicit float32 scores.

FlashAttention-2's local attention (``flash_attn_func`` docstring; ``set_params_fprop`` in torch's
``flash_api.cpp``): query ``i`` of ``Sq`` sees keys ``j`` with
``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (bottom-right aligned), ``-1`` unbounded; ``left < 0`` with
``right == 0`` is its causal mask. Every block of :func:`~cp_handler.core.masks.mask_blocks` whose needs are the causal
edge and windows (no chunk boundary, no soft-cap: :func:`~cp_handler.core.masks.block_needs`) is such a band in its own
coordinates: query ``i`` sees ``j - i`` in ``[lo, hi]`` with ``d = q_pos - k_pos``, ``lo = d - (W - 1)`` and ``hi =
d`` (causal) or ``d + R`` (right window). :func:`band` maps it onto the kernel's convention, first cutting the keys
no query sees at the end and the queries that see no key at the end (a negative ``left`` / ``right`` would mean
"unbounded" to the kernel); the cut queries get ``out = 0`` and the lowest finite lse. The kernel returns
``lse = +inf`` for a query that sees no key of the block; it is set to the lowest finite value as well (the
contract of :mod:`.base`).

Not verified on a GPU yet: :attr:`~.base.AttnKernel.verified_masks` is empty, so the automatic routing never takes
these calls; ``CP_HANDLER_MASKED_KERNEL=flash`` (or ``flash_gqa``) opts in, which the GPU pass's masks part
(``tests/test_masks.py::test_flash_windows_on_gpu``) runs against a float64 reference. The band arithmetic is checked
on CPU against the mask's own visibility (tests/test_masked_kernels.py). Here too, for both FlashAttention-2 calls of
``aten._flash_attention_backward`` (these and ``flash_varlen``'s): the rng tensors its backward takes for dropout 0
(:func:`rng_inputs`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...core.masks import BlockMask, block_needs

aten = torch.ops.aten

@functools.cache
def _rng_layout() -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the rng tensors ``aten._flash_attention_forward`` returns (from its meta kernel)."""
    q = torch.empty(2, 1, 8, device="meta", dtype=torch.bfloat16)
    cu = torch.tensor([0, 2], dtype=torch.int32, device="meta")
    rng_state, unused = aten._flash_attention_forward(q, q, q, cu, cu, 2, 2, 0.0, False, False)[2:4]
    return (tuple(rng_state.shape), rng_state.dtype), (tuple(unused.shape), unused.dtype)


@functools.lru_cache(maxsize=16)
def rng_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's rng tensors for dropout 0 (read only when ``dropout_p > 0``, never written):
    made once per device instead of two fills per call."""
    (seed_shape, seed_dtype), (offset_shape, offset_dtype) = _rng_layout()
    return (torch.zeros(seed_shape, dtype=seed_dtype, device=device),
            torch.zeros(offset_shape, dtype=offset_dtype, device=device))


MASKS = frozenset({"causal", "window", "window_right"})
"""What a band computes: the causal edge at any offset and both window edges."""


def band(block: BlockMask, nq: int, nk: int) -> tuple[int, int, int, int]:
    """``(queries, keys, left, right)``: the first ``queries`` rows against the first ``keys`` keys with
    FlashAttention-2's ``window_size_left`` / ``window_size_right`` (``-1``: unbounded) compute ``block`` (``nq``
    rows, ``nk`` keys) exactly; the rows after ``queries`` see no key, the keys after ``keys`` no query.

    The soft-cap changes scores, not which pairs are seen: FlashAttention-4 takes it beside the band (:mod:`.fa4`).

    Raises:
        ValueError: a block with a chunk boundary inside (not a band: a planner bug).
    """
    if "chunk" in block_needs(block, nq, nk):
        raise ValueError(f"{block} of {nq} x {nk} is not a band (a chunk boundary inside): a bug in the routing")
    mask, offset = block.mask, block.q_pos - block.k_pos  # within one chunk, the chunk bounds nothing
    lo = None if mask.window is None else offset - (mask.window - 1)
    hi = offset if mask.causal else (None if mask.window_right is None else offset + mask.window_right)
    keys = nk if hi is None else max(0, min(nk, nq + hi))
    queries = nq if lo is None else max(0, min(nq, keys - lo))
    skew = keys - queries
    return queries, keys, -1 if lo is None else skew - lo, -1 if hi is None else hi - skew


def _seq(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # (B, H, S, D) <-> (B, S, H, D), a view


def whole_rows(out: torch.Tensor, lse: torch.Tensor, nq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A band call's ``out (B, queries, H, Dv)`` and ``lse (B, H, queries)`` back to the block's ``nq`` rows
    as ``(B, H, nq, Dv)`` / ``(B, H, nq)``: the cut rows ``out = 0``, and every row that saw no key (the cut ones,
    and the ones the kernel marks with an infinite lse: ``+inf`` FlashAttention-2, ``-inf`` FlashAttention-4) the
    lowest finite lse (:mod:`.base`)."""
    lowest = torch.finfo(lse.dtype).min
    lse = lse.masked_fill(torch.isinf(lse), lowest)
    queries = out.shape[1]
    if queries == nq:
        return _seq(out), lse
    full = out.new_zeros(out.shape[0], nq, *out.shape[2:])
    full[:, :queries] = out
    return _seq(full), F.pad(lse, (0, nq - queries), value=lowest)


def whole_grads(grads, q: torch.Tensor, k: torch.Tensor):
    """A band call's ``(dq, dk, dv)`` (``(B, S, H, D)``, the cut rows and keys missing) as the block's
    ``(B, H, S, D)`` gradients, zeros where cut; dk / dv keep k's heads."""
    out = []
    for grad, whole in zip(grads, (q.shape[-2], k.shape[-2], k.shape[-2]), strict=True):
        grad = _seq(grad)
        out.append(grad if grad.shape[-2] == whole else F.pad(grad, (0, 0, 0, whole - grad.shape[-2])))
    return tuple(out)


def _refuse_softcap(block: BlockMask) -> None:
    if block.mask.softcap is not None:
        raise ValueError(f"{block}: FlashAttention-2's aten op takes no soft-cap (a bug in the routing)")


def masked_forward(q, k, v, block: BlockMask, *, scale: float):
    """``(out (B,H,Sq,D) in q's dtype, lse (B,H,Sq) float32)`` of one band block (see the module doc); K/V keep
    their ``Hkv`` heads (FlashAttention-2 takes GQA itself)."""
    _refuse_softcap(block)
    queries, keys, left, right = band(block, q.shape[-2], k.shape[-2])
    out, lse = aten._flash_attention_forward(
        _seq(q)[:, :queries], _seq(k)[:, :keys], _seq(v)[:, :keys], None, None, queries, keys, 0.0, False, False,
        scale=scale, window_size_left=left, window_size_right=right)[:2]
    return whole_rows(out, lse, q.shape[-2])


def masked_backward(dout, q, k, v, out, lse, block: BlockMask, *, scale: float):
    """``(dq, dk, dv)`` of one band block given the merged out / lse (dk, dv with k's heads)."""
    _refuse_softcap(block)
    queries, keys, left, right = band(block, q.shape[-2], k.shape[-2])
    rng_state, unused = rng_inputs(q.device)
    grads = aten._flash_attention_backward(
        _seq(dout)[:, :queries].contiguous(), _seq(q)[:, :queries], _seq(k)[:, :keys], _seq(v)[:, :keys],
        _seq(out)[:, :queries].contiguous(), lse[..., :queries].contiguous(), None, None, queries, keys, 0.0, False,
        rng_state, unused, scale=scale, window_size_left=left, window_size_right=right)
    return whole_grads(grads, q, k)
