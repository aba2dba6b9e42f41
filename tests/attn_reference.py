"""Single-process attention reference and a uniform way to call every CP attention pattern."""

import torch
import torch.nn.functional as F

from cp_handler.core.layout import ZigzagDocs
from cp_handler.ops.all_gather import all_gather_attn
from cp_handler.ops.ring import ring_attn
from cp_handler.ops.ulysses import a2a_attn


def single_process_attention(q, k, v, dout, causal):
    """out, lse (same CPU flash kernel, whole sequence) and dq, dk, dv (autograd of SDPA)."""
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[1]
    return out.detach(), lse, qr.grad, kr.grad, vr.grad


def run_pattern(pattern, q, k, v, groups, *, causal, scale, layout=None):
    """``(out, lse)`` of ``pattern`` on local ``(B, H, S_local, D)`` tensors.

    ``groups``: a ``DataContextParallelGroups`` (its ``hierarchical_cp_groups`` for a2a+p2p);
    ``layout``: the documents (thd), default one sequence (bshd).
    """
    cp_group = groups.cp_group
    if pattern == "p2p":
        return ring_attn(q, k, v, group=cp_group, causal=causal, scale=scale, layout=layout)
    if pattern == "all_gather":  # one KV head per chunk: exercises the chunked, overlapped gathers
        return all_gather_attn(q, k, v, group=cp_group, causal=causal, scale=scale, layout=layout,
                               kv_heads_per_chunk=1)
    if pattern == "a2a":
        return a2a_attn(q, k, v, a2a_group=cp_group, causal=causal, scale=scale, layout=layout, return_lse=True)
    a2a_group, p2p_group = groups.hierarchical_cp_groups
    return a2a_attn(q, k, v, a2a_group=a2a_group, p2p_group=p2p_group, causal=causal, scale=scale, layout=layout,
                    return_lse=True)


def per_document_attention(q, k, v, dout, cu_seqlens, causal):
    """Reference for packed ``(T, H, D)`` tensors: each document attended alone, results concatenated
    (out, lse ``(H, T)``, dq, dk, dv)."""
    bounds = cu_seqlens.tolist()
    parts = [single_process_attention(*(t[s:e].transpose(0, 1).unsqueeze(0) for t in (q, k, v, dout)), causal)
             for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s]  # a zero-length document: nothing
    out, lse, dq, dk, dv = (torch.cat([p[i][0] for p in parts], dim=1) for i in range(5))
    return out.transpose(0, 1), lse, dq.transpose(0, 1), dk.transpose(0, 1), dv.transpose(0, 1)


def zigzag_shard(t, dim, rank, world):
    """This rank's zigzag shard of a bshd-style tensor along ``dim`` (one document, no padding)."""
    return t.index_select(dim, ZigzagDocs.uniform(t.shape[dim], world).dispatch_index(rank))
