"""Token-by-token float64 kernels of the recurrences (the definitions, no chunking), with the APIs the handler's
mixer methods take: the references of tests/test_hybrid.py, and kernels whose float64 arithmetic shows state
passing errors the installed float32 kernels would round away."""

import torch
import torch.nn.functional as F


def gated_delta_recurrent(query, key, value, g, beta, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, chunk_size=None):
    """``S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t / sqrt(Dk)``; ``g`` per
    value head ``(B, S, Hv)`` or per key channel ``(B, S, Hv, Dk)`` (Kimi delta attention)."""
    batch, length, k_heads, dk = key.shape
    v_heads, dv = value.shape[2:]
    q, k = (t.repeat_interleave(v_heads // k_heads, dim=2) for t in (query, key))
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q * dk ** -0.5
    state = value.new_zeros(batch, v_heads, dk, dv) if initial_state is None else initial_state
    outs = []
    for t in range(length):
        decay = g[:, t].exp()
        decayed = state * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        kt, b = k[:, t][..., :, None], beta[:, t][..., None, None]
        state = decayed - b * kt @ (kt.transpose(-1, -2) @ decayed) + b * kt @ value[:, t][..., None, :]
        outs.append((q[:, t][..., None, :] @ state)[..., 0, :])
    return torch.stack(outs, 1), (state if output_final_state else None)


def ssd_recurrent(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False,
                  dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False):
    """Mamba2: ``S_t = exp(A dt_t) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t`` per head (groups of B, C)."""
    batch, length, heads, head_dim = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    bh, ch = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1]) if initial_states is None else initial_states
    ys = []
    for t in range(length):
        state = (A * dt[:, t]).exp()[..., None, None] * state + \
            (dt[:, t, :, None] * x[:, t])[..., None] * bh[:, t, :, None, :]
        y = (state * ch[:, t, :, None, :]).sum(-1)
        ys.append(y if D is None else y + D[:, None] * x[:, t])
    y = torch.stack(ys, 1)
    return (y, state) if return_final_states else y


def selective_recurrent(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                        return_last_state=False):
    """Mamba: ``s_t = exp(A dt_t) s_{t-1} + dt_t u_t B_t`` per channel, ``y_t = (C_t . s_t + D u_t) silu(z_t)``."""
    if delta_bias is not None:
        delta = delta + delta_bias[..., None]
    if delta_softplus:
        delta = F.softplus(delta)
    state = u.new_zeros(u.shape[0], u.shape[1], A.shape[-1])
    ys = []
    for t in range(u.shape[2]):
        state = (A * delta[:, :, t, None]).exp() * state + (delta[:, :, t] * u[:, :, t])[..., None] * B[:, None, :, t]
        ys.append((state * C[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * F.silu(z)
    return (y, state) if return_last_state else y
