"""Mamba2's state-space scan (SSD: Mamba2, Bamba, Falcon-H1, Granite 4, Nemotron-H, Zamba2) under CP.

Per head ``h`` the state ``S`` (``P x N``: head dim by state size) follows ``S_t = exp(A_h dt_t) S_{t-1} +
dt_t x_t B_t^T`` and the output is ``y_t = S_t C_t + D_h x_t`` (Dao and Gu, "Transformers are SSMs", 2024;
``mamba_chunk_scan_combined`` of ``mamba_ssm``). The decay is a scalar per head, so a chunk's summary is its
final state from zero ``Q`` and its total log decay; with the chunk's entry state ``S_in`` the output is
``y_t = y0_t + exp(sum_{s<=t} A dt_s) S_in C_t`` (:mod:`.state`). ``dt`` is processed as the kernel does before
its scan: ``+ dt_bias``, ``softplus`` when asked, clamped to ``dt_limit``. One kernel call per chunk group
(zero start); per rank and layer one all-gather of ``2 * docs`` summaries of ``H x (P N + 1)`` float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import segment_plan, to_segments
from .state import pass_states, plain_chunks


def _log_decay(dt, A, dt_bias, dt_softplus: bool, dt_limit) -> torch.Tensor:
    """``A dt`` per token and head after the kernel's processing of ``dt (n B, L, H)``, cumulated over the chunk."""
    dt = dt.float() if dt.dtype != torch.float64 else dt
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return (A.to(dt.dtype) * dt).cumsum(1)


def ssd_scan(kernel, x, dt, A, B, C, chunk_size: int, *, D=None, dt_bias=None, dt_softplus: bool = False,
             dt_limit=(0.0, float("inf")), layout, rank: int, group, **kernel_kwargs):
    """Mamba2's scan over the whole sequence from this rank's zigzag shard (module doc).

    Args:
        kernel: ``kernel(x, dt, A, B, C, chunk_size, D=, dt_bias=, dt_softplus=, dt_limit=,
            return_final_states=True, **kernel_kwargs) -> (y, final_state)`` (transformers' ``mamba2_chunk_scan``,
            ``mamba_ssm``'s ``mamba_chunk_scan_combined``).
        x: ``(B, S_local, H, P)``; dt: ``(B, S_local, H)``; A: ``(H,)``; B, C: ``(B, S_local, G, N)``, ``G``
            dividing ``H``; D, dt_bias: ``(H,)``.
        layout, rank, group: the batch's layout, this rank, the CP group.

    Returns:
        ``y (B, S_local, H, P)`` in the kernel's output dtype; zero at padding rows.
    """
    options = {"D": D, "dt_bias": dt_bias, "dt_softplus": dt_softplus, "dt_limit": dt_limit, **kernel_kwargs}
    if layout.size == 1 and layout.num_docs == 1:
        return kernel(x, dt, A, B, C, chunk_size, **options)
    plan, inputs = segment_plan(layout, rank), (x, dt, B, C)
    batch, heads, head_dim, state_size = x.shape[0], x.shape[2], x.shape[3], B.shape[-1]
    acc = torch.promote_types(x.dtype, torch.float32)
    blank = x.new_zeros(batch, 0, heads, head_dim, dtype=acc)
    if layout.size == 1:
        return plain_chunks(plan, seq_dim=1, blank=blank, run=lambda grp: kernel(
            *(to_segments(t, 1, grp) for t in (x, dt)), A, *(to_segments(t, 1, grp) for t in (B, C)), chunk_size,
            **options))

    def run(grp):
        xs, dts, bs, cs = (to_segments(t, 1, grp) for t in inputs)
        y0, final = kernel(xs, dts, A, bs, cs, chunk_size, return_final_states=True, **options)
        total = _log_decay(dts, A, dt_bias, dt_softplus, dt_limit)[:, -1]  # (n B, H)
        return y0, torch.cat([final.flatten(2).to(acc), total.to(acc)[..., None]], dim=-1)

    def apply(summary, state):  # S_end = exp(total) S_in + Q
        q_part = summary[..., :-1].unflatten(-1, (head_dim, state_size))
        return q_part if state is None else summary[..., -1, None, None].exp() * state + q_part

    def correct(grp, y0, s_in):  # y_t += exp(cum A dt)_t S_in C_t
        decay = _log_decay(to_segments(dt, 1, grp), A, dt_bias, dt_softplus, dt_limit).exp()  # (n B, L, H)
        c = to_segments(C, 1, grp).to(acc).repeat_interleave(heads // C.shape[2], dim=2)  # (n B, L, H, N)
        extra = torch.einsum("blhn,bhpn->blhp", c, s_in) * decay.to(acc)[..., None]
        return y0 + extra.to(y0.dtype)

    return pass_states(plan, layout, rank, group, seq_dim=1, blank=blank,
                       summary_like=x.new_zeros(batch, heads, head_dim * state_size + 1, dtype=acc),
                       state_like=x.new_zeros(batch, heads, head_dim, state_size, dtype=acc), inputs=inputs,
                       run=run, apply=apply, correct=correct)
