"""The conformance cases, run inside each spawned rank: every check compares the handler on this rank with the
single-process reference (:mod:`.reference`) on the same global inputs (every rank draws them from one seed).

A case ends in ``("PASS", "")``, ``("FAIL", why)`` or ``("NOT-SUPPORTED", the handler's refusal)``: a handler
declares what it does not run by refusing it by name (``ValueError`` / ``TypeError`` / ``NotImplementedError`` at
construction or in the call) on every rank; the kit then records the refusal instead of a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import AttentionShape, ContextParallelConfig
from ..masks import AttentionMask
from ..rope import rotary_freqs
from . import reference

REFUSALS = (ValueError, TypeError, NotImplementedError)
THD_LENGTHS = (13, 0, 6, 21)
"""Packed documents of the thd cases: uneven, one empty (a batch's padding slot), one shorter than 2 * cp."""
SCALE = 0.3


@dataclass(frozen=True)
class Variant:
    """One attention case: what the attention module carries and the mask it means."""

    name: str
    mask: AttentionMask
    attn_mask_type: str = "causal"
    window_size: tuple[int, int] | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False
    heads: tuple[int, int] = (4, 2)  # (H, Hkv)
    head_dims: tuple[int, int] = (8, 8)  # (D of q / k, Dv)


VARIANTS = {v.name: v for v in (
    Variant("causal", AttentionMask()),
    Variant("no_mask", AttentionMask(causal=False), attn_mask_type="no_mask"),
    Variant("mha", AttentionMask(), heads=(4, 4)),
    Variant("mqa", AttentionMask(), heads=(4, 1)),
    Variant("window", AttentionMask(window=5), window_size=(4, 0)),
    Variant("chunk", AttentionMask(chunk=6), chunk=6),
    Variant("softcap", AttentionMask(softcap=2.0), softcap=2.0),
    Variant("sinks", AttentionMask(), sinks=True),
    Variant("mla", AttentionMask(), head_dims=(8, 12)),
)}
"""The attention variants the kit runs by default (``check_handler(variants=...)`` picks among them)."""


@dataclass(frozen=True)
class Case:
    """What one handler is built for: its comm type, format and dtype, on ``world`` ranks."""

    comm_type: str
    qkv_format: str
    dtype: torch.dtype
    world: int

    @property
    def levels(self) -> tuple[int, ...] | None:
        """``"a2a+p2p"``'s hierarchical sizes (a2a inner: ``[2, world / 2]``); ``None`` for the flat patterns."""
        return (2, self.world // 2) if self.comm_type == "a2a+p2p" else None

    @property
    def lengths(self) -> list[int]:
        """The documents: one per batch row (bshd / sbhd, two rows of ``8 * world`` tokens) or packed (thd)."""
        return list(THD_LENGTHS) if self.qkv_format == "thd" else [8 * self.world] * 2

    @property
    def seq_dim(self) -> int:
        return 1 if self.qkv_format == "bshd" else 0

    def tolerance(self) -> float:
        """float64 1e-10; float32 2e-5 (merge order); half types 2e-2 of the largest reference value."""
        return {torch.float64: 1e-10, torch.float32: 2e-5}.get(self.dtype, 2e-2)

    def to_format(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed ``(T, ...)`` rows -> the handler's global layout (bshd / sbhd: documents are batch rows)."""
        if self.qkv_format == "thd":
            return packed
        rows = packed.view(2, -1, *packed.shape[1:])
        return rows if self.qkv_format == "bshd" else rows.transpose(0, 1).contiguous()

    def from_format(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_format`."""
        if self.qkv_format == "thd":
            return t
        rows = t if self.qkv_format == "bshd" else t.transpose(0, 1)
        return rows.reshape(-1, *rows.shape[2:])


def build(handler_cls, case: Case, groups, variant: Variant) -> object:
    """The handler of ``case`` on this rank, as the library builds one (``build_cp_handler``): the class's
    ``check_config`` (its rules before a run starts) and ``from_config`` with the CP groups, the attention shape
    of ``variant`` and, for thd, the batch's ``cu_seqlens``."""
    levels = list(case.levels) if case.levels else None
    config = ContextParallelConfig(context_parallel_size=case.world, cp_comm_type=case.comm_type,
                                   hierarchical_context_parallel_sizes=levels, qkv_format=case.qkv_format)
    (heads, kv_heads), (d, dv) = variant.heads, variant.head_dims
    shape = AttentionShape(heads, kv_heads, d, dv if dv != d else None)
    handler_cls.check_config(config, shape, case.dtype)
    batch = {}
    if case.qkv_format == "thd":
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    return handler_cls.from_config(config, cp_group=groups.cp_group,
                                   hierarchical_cp_groups=groups.hierarchical_cp_groups or None, attn_shape=shape,
                                   **batch)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> str | None:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got - want).abs().max().item() if want.numel() else 0.0
    return None if err <= tol * scale else f"{what}: max error {err:.3g} > {tol * scale:.3g}"


def _sum_over_group(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def check_layout(h, case: Case, group) -> str | None:
    """dispatch / combine inverse and dispatch's gradient (the global layout, summed over the group)."""
    torch.manual_seed(1)
    x = torch.randn(sum(case.lengths), 3, 5, dtype=torch.float64)
    g = case.to_format(x).to(case.dtype).requires_grad_()
    local = h.dispatch(g, case.seq_dim)
    if err := _close(h.combine(local.detach(), case.seq_dim), g, 0.0, "combine(dispatch(x))"):
        return err
    w = case.to_format(torch.randn_like(x)).to(case.dtype)
    (local * h.dispatch(w, case.seq_dim)).sum().backward()
    return _close(_sum_over_group(g.grad, group), w, case.tolerance(), "dispatch gradient")


def check_roll(h, case: Case, group) -> str | None:
    """``roll_tensor`` by -1 and +1: values in global order (zero where a document is left) and the gradient."""
    torch.manual_seed(2)
    for shift in (-1, 1):
        x = torch.randn(sum(case.lengths), 3, dtype=torch.float64, requires_grad=True)
        w = torch.randn_like(x)
        (reference.roll(x, shift, case.lengths) * w).sum().backward()
        g = case.to_format(x.detach()).to(case.dtype).requires_grad_()
        rolled, _ = h.roll_tensor(h.dispatch(g, case.seq_dim), shifts=shift, dims=case.seq_dim)
        want = case.to_format(reference.roll(x.detach(), shift, case.lengths))
        if err := _close(h.combine(rolled.detach(), case.seq_dim), want, case.tolerance(), f"roll_tensor({shift})"):
            return err
        (rolled * h.dispatch(case.to_format(w).to(case.dtype), case.seq_dim)).sum().backward()
        got = case.from_format(_sum_over_group(g.grad, group))
        if err := _close(got, x.grad, case.tolerance(), f"roll_tensor({shift}) gradient"):
            return err
    return None


def check_rope(h, case: Case) -> str | None:
    """RoPE through ``get_rotary_seq_len`` / ``get_emb_on_this_cp_rank`` / ``apply_rotary_pos_emb`` at each
    token's global position (thd: inside its document)."""
    torch.manual_seed(3)
    x = torch.randn(sum(case.lengths), 2, 8, dtype=torch.float64)
    local = h.dispatch(case.to_format(x).to(case.dtype), case.seq_dim)
    freqs = rotary_freqs(h.get_rotary_seq_len(local.shape[case.seq_dim]), 8)
    got = h.apply_rotary_pos_emb(local, h.get_emb_on_this_cp_rank(freqs))
    want = case.to_format(reference.rope(x, rotary_freqs(max(case.lengths), 8).double(), case.lengths))
    return _close(h.combine(got.detach(), case.seq_dim), want, case.tolerance(), "apply_rotary_pos_emb")


def attn_module(variant: Variant, sinks) -> torch.nn.Module:
    """A model's attention module for ``variant``: an ``nn.Module`` (a backend may register children on it, as
    Transformer Engine's does) carrying what ``core_attn`` reads."""
    module = torch.nn.Module()
    for name, value in (("window_size", variant.window_size), ("attention_chunk_size", variant.chunk),
                        ("softcap", variant.softcap), ("sinks", sinks), ("softmax_scale", SCALE)):
        object.__setattr__(module, name, value)  # plain attributes (sinks: the caller's leaf, not a parameter)
    return module


def check_attention(h, case: Case, variant: Variant, group) -> str | None:
    """``core_attn``: the output and the gradients of q, k, v (and the sinks) against the float64 reference."""
    torch.manual_seed(4)
    (heads, kv_heads), (d, dv) = variant.heads, variant.head_dims
    total = sum(case.lengths)
    q = torch.randn(total, heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, kv_heads, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, kv_heads, dv, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(heads, dtype=torch.float64, requires_grad=True) if variant.sinks else None
    dout = torch.randn(total, heads, dv, dtype=torch.float64)
    rounded = [t.detach().to(case.dtype).double().requires_grad_() for t in (q, k, v)]
    ref_sinks = sinks.detach().to(case.dtype).double().requires_grad_() if sinks is not None else None
    want = reference.attention(*rounded, variant.mask, SCALE, ref_sinks, case.lengths)
    want.backward(dout.to(case.dtype).double())
    local = [h.dispatch(case.to_format(t.detach()).to(case.dtype), case.seq_dim).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.detach().to(case.dtype).requires_grad_() if sinks is not None else None
    out = h.core_attn(attn_module(variant, local_sinks), *local, attn_mask_type=variant.attn_mask_type)
    out.backward(h.dispatch(case.to_format(dout).to(case.dtype), case.seq_dim))
    tol = case.tolerance()
    if err := _close(h.combine(out.detach(), case.seq_dim), case.to_format(want), tol, "out"):
        return err
    for name, t, ref in zip(("dq", "dk", "dv"), local, rounded, strict=True):
        if err := _close(h.combine(t.grad, case.seq_dim), case.to_format(ref.grad), tol, name):
            return err
    if sinks is not None:
        return _close(_sum_over_group(local_sinks.grad, group), ref_sinks.grad, tol, "dsinks")
    return None
