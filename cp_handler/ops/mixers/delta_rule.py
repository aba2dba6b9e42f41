"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5; with a per-channel decay: Kimi delta attention)
under CP, and a plain chunked kernel of it.

Per value head the state ``S`` (``Dk x Dv``) follows ``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``
(``a_t = exp(g_t)``; KDA: ``Diag(exp(g_t))`` per key channel) and the output is ``o_t = S_t^T q_t``
(Yang, Kautz, Hatamizadeh, "Gated Delta Networks", 2024; FLA's ``chunk_gated_delta_rule`` API).

:func:`gated_delta_rule` runs any kernel of that API on each local chunk (:mod:`.segments`) and passes the
state between chunks (:mod:`.state`). The state's value columns evolve independently, so **one** call of the
unmodified kernel per chunk with values ``[v | 0]`` (``Dk`` zero columns) and initial state ``[0 | I]`` returns
the output from a zero state ``o0``, the *effective query* ``q_eff_t = P_{<=t}^T q_t`` and the final state
``[Q | P]``: the chunk's summary. With the chunk's true entry state ``S_in`` the output is
``o = o0 + q_eff @ S_in``; nothing runs twice. Cost: the kernel on ``Dv + Dk`` value columns instead of ``Dv``
(about 2x its FLOPs with the correction) and one all-gather of ``2 * docs`` summaries of ``Hv x Dk x (Dv + Dk)``
float32 per rank and layer, independent of the sequence length.
"""

from __future__ import annotations

import torch

from .segments import segment_plan, to_segments
from .state import pass_states, plain_chunks


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False, scale=None):
    """The chunked gated delta rule in plain torch (per-head decay ``g``), written from the paper's WY form.

    Args:
        query, key: ``(B, S, Hk, Dk)``; value: ``(B, S, Hv, Dv)`` with ``Hv`` a multiple of ``Hk`` (grouped
            value heads: each key head serves ``Hv / Hk`` consecutive value heads).
        g: ``(B, S, Hv)`` log decays (<= 0); beta: ``(B, S, Hv)`` write strengths.
        chunk_size: tokens per chunk of the WY solve. initial_state: ``(B, Hv, Dk, Dv)`` or ``None`` (zero).
        use_qk_l2norm_in_kernel: L2-normalise q and k first (eps 1e-6). scale: of the queries, default
            ``Dk ** -0.5``.

    Returns:
        ``(out (B, S, Hv, Dv) in query's dtype, final state (B, Hv, Dk, Dv) or None)``; computed in float32
        (float64 for float64 inputs).
    """
    batch, length, k_heads, dk = key.shape
    v_heads = value.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    if v_heads != k_heads:
        query, key = (t.repeat_interleave(v_heads // k_heads, dim=2) for t in (query, key))
    q, k, v, g, beta = (t.transpose(1, 2).to(acc) for t in (query, key, value, g, beta))  # (B, H, S, ...)
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * (dk ** -0.5 if scale is None else scale)
    pad = -length % chunk_size
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    q, k, v = (t.unflatten(2, (-1, chunk_size)) for t in (q, k, v))  # (B, H, N, C, D)
    g, beta = (t.unflatten(2, (-1, chunk_size)) for t in (g, beta))
    gc = g.cumsum(-1)  # log of the decay from the chunk start to each token
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # (γ_i / γ_j), i >= j
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * decay).tril(-1)  # L: (I + L) W = beta (V - gamma K S_0)
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    scores = q @ k.transpose(-1, -2) * decay
    state = q.new_zeros(batch, v_heads, dk, v.shape[-1]) if initial_state is None else initial_state.to(acc)
    outs = []
    for n in range(q.shape[2]):
        w = new_values[:, :, n] - k_decayed[:, :, n] @ state
        outs.append((q[:, :, n] * gc[:, :, n, :, None].exp()) @ state + scores[:, :, n] @ w)
        to_end = (gc[:, :, n, -1:] - gc[:, :, n]).exp()[..., None]
        state = gc[:, :, n, -1, None, None].exp() * state + (k[:, :, n] * to_end).transpose(-1, -2) @ w
    out = torch.cat(outs, dim=2)[:, :, :length].transpose(1, 2).to(query.dtype)
    return out, (state if output_final_state else None)


def _apply(summary: torch.Tensor, state: torch.Tensor | None, v_dim: int) -> torch.Tensor:
    """A chunk's summary ``[Q | P]`` (``(..., Dk, Dv + Dk)``) acting on an entry state ``(..., Dk, Dv)``."""
    q_part, p_part = summary[..., :v_dim], summary[..., v_dim:]
    return q_part if state is None else p_part @ state + q_part


def gated_delta_rule(kernel, query, key, value, g, beta, *, layout, rank: int, group, **kernel_kwargs):
    """The gated delta rule over the whole sequence from this rank's zigzag shard (module doc).

    Args:
        kernel: a function of FLA's ``chunk_gated_delta_rule`` API (:func:`chunk_gated_delta_rule`, transformers'
            torch fallback, FLA's Triton kernel, KDA's ``chunk_kimi_delta_attention``) taking ``initial_state``
            and ``output_final_state``.
        query, key, value, g, beta: local tensors ``(B, S_local, ...)`` as the kernel takes them.
        layout, rank, group: the batch's :class:`~cp_handler.core.layout.ZigzagDocs`, this rank, the CP group.
        kernel_kwargs: passed on (``chunk_size``, ``use_qk_l2norm_in_kernel``, ...).

    Returns:
        ``(B, S_local, Hv, Dv)`` in value's dtype; zero at padding rows.
    """
    if layout.size == 1 and layout.num_docs == 1:
        return kernel(query, key, value, g, beta, **kernel_kwargs)[0]
    plan, inputs = segment_plan(layout, rank), (query, key, value, g, beta)
    batch, heads, dk, dv = value.shape[0], value.shape[2], key.shape[-1], value.shape[-1]
    blank = value.new_zeros(batch, 0, heads, dv)
    if layout.size == 1:  # every chunk a whole document: the plain kernel from a zero state
        return plain_chunks(plan, seq_dim=1, blank=blank, run=lambda grp: kernel(
            *(to_segments(t, 1, grp) for t in inputs), **kernel_kwargs)[0])
    acc = torch.promote_types(value.dtype, torch.float32)

    def run(grp):  # one call: [o0 | q_eff] and [Q | P] (module doc)
        q, k, v, gg, b = (to_segments(t, 1, grp).to(acc) if t.is_floating_point() else to_segments(t, 1, grp)
                          for t in inputs)
        identity = torch.eye(dk, dtype=acc, device=v.device).expand(v.shape[0], heads, dk, dk)
        start = torch.cat([v.new_zeros(v.shape[0], heads, dk, dv), identity], dim=-1)
        return kernel(q, k, torch.cat([v, v.new_zeros(*v.shape[:-1], dk)], dim=-1), gg, b, initial_state=start,
                      output_final_state=True, **kernel_kwargs)

    def correct(grp, out, s_in):  # o = o0 + q_eff @ S_in
        o = out[..., :dv] + torch.einsum("blhk,bhkv->blhv", out[..., dv:].to(s_in.dtype), s_in)
        return o.to(value.dtype)

    like = value.new_zeros(batch, heads, dk, dv + dk, dtype=acc)
    return pass_states(plan, layout, rank, group, seq_dim=1, blank=blank, summary_like=like,
                       state_like=like[..., :dv], inputs=inputs, run=run,
                       apply=lambda summary, state: _apply(summary, state, dv), correct=correct)
