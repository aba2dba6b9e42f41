"""Mamba's selective scan (Mamba, Falcon-Mamba, Jamba, Zamba) under CP.

Per channel ``d`` the state ``s`` (``N``) follows ``s_t = exp(A_d dt_t) * s_{t-1} + dt_t u_t B_t`` and the output
is ``y_t = (C_t . s_t + D_d u_t) * silu(z_t)`` (Gu and Dao, "Mamba", 2023; ``mamba_ssm``'s ``selective_scan_fn``).
The kernel takes no initial state, so each chunk runs from zero and its output is corrected outside:
``y_t += silu(z_t) sum_n C_t[n] exp(A_dn sum_{s<=t} dt_s) S_in[d, n]`` (``dt`` processed as the kernel does:
``+ delta_bias``, ``softplus`` when asked). A chunk's summary is its final state from zero and its decay
``exp(A_dn sum dt)`` (:mod:`.state`). Per rank and layer one all-gather of ``2 * docs`` summaries of
``D_inner x N x 2`` float32; the correction holds a ``(B, D_inner, L, N)`` float32 tensor per chunk group, as the
kernel's own discretisation does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import segment_plan, to_segments
from .state import pass_states, plain_chunks


def _cum_dt(delta, delta_bias, delta_softplus: bool) -> torch.Tensor:
    """``dt`` after the kernel's processing, cumulated over the chunk: ``(n B, D, L)``."""
    dt = delta.float() if delta.dtype != torch.float64 else delta
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    return dt.cumsum(-1)


def selective_scan(kernel, u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus: bool = False,
                   layout, rank: int, group, **kernel_kwargs):
    """Mamba's selective scan over the whole sequence from this rank's zigzag shard (module doc).

    Args:
        kernel: ``kernel(u, delta, A, B, C, D=, z=, delta_bias=, delta_softplus=, return_last_state=True,
            **kernel_kwargs) -> (y, last_state)`` (transformers' ``mamba_selective_scan``, ``mamba_ssm``'s
            ``selective_scan_fn``).
        u, delta: ``(B, D_inner, S_local)``; A: ``(D_inner, N)``; B, C: ``(B, N, S_local)``; D, delta_bias:
            ``(D_inner,)``; z: ``(B, D_inner, S_local)`` or ``None``.
        layout, rank, group: the batch's layout, this rank, the CP group.

    Returns:
        ``y (B, D_inner, S_local)`` in the kernel's output dtype; zero at padding rows.
    """
    options = {"D": D, "delta_bias": delta_bias, "delta_softplus": delta_softplus, **kernel_kwargs}
    if layout.size == 1 and layout.num_docs == 1:
        return kernel(u, delta, A, B, C, z=z, **options)
    plan = segment_plan(layout, rank)
    inputs = (u, delta, B, C) if z is None else (u, delta, B, C, z)
    batch, channels, state_size = u.shape[0], u.shape[1], A.shape[-1]
    acc = torch.promote_types(u.dtype, torch.float32)
    blank = u.new_zeros(batch, channels, 0)

    def pieces(grp):
        return [to_segments(t, 2, grp) for t in inputs] + ([None] if z is None else [])

    if layout.size == 1:
        def alone(grp):
            us, ds, bs, cs, zs = pieces(grp)
            return kernel(us, ds, A, bs, cs, z=zs, **options)
        return plain_chunks(plan, seq_dim=2, blank=blank, run=alone)

    def run(grp):
        us, ds, bs, cs, zs = pieces(grp)
        y0, last = kernel(us, ds, A, bs, cs, z=zs, return_last_state=True, **options)
        decay = (A.to(acc) * _cum_dt(ds, delta_bias, delta_softplus)[..., -1:].to(acc)).exp()  # (n B, D, N)
        return y0, torch.stack([last.to(acc), decay], dim=-1)

    def apply(summary, state):  # s_end = decay * s_in + q
        return summary[..., 0] if state is None else summary[..., 1] * state + summary[..., 0]

    def correct(grp, y0, s_in):
        _, ds, _, cs, zs = pieces(grp)
        decay = (A.to(acc)[None, :, None, :] * _cum_dt(ds, delta_bias, delta_softplus).to(acc)[..., None]).exp()
        extra = torch.einsum("bdln,bnl,bdn->bdl", decay, cs.to(acc), s_in)  # (n B, D, L)
        if zs is not None:
            extra = extra * F.silu(zs.to(acc))
        return y0 + extra.to(y0.dtype)

    return pass_states(plan, layout, rank, group, seq_dim=2, blank=blank,
                       summary_like=u.new_zeros(batch, channels, state_size, 2, dtype=acc),
                       state_like=u.new_zeros(batch, channels, state_size, dtype=acc), inputs=inputs,
                       run=run, apply=apply, correct=correct)
