"""Fake ``magi_attention.api`` (current API: key from cu_seqlens and head shape, then dispatch,
calc_attn, undispatch, roll, get_position_ids). Its own layout: the sequence padded to a multiple
of ``cp * CHUNK`` and chunks dealt round-robin, so it differs from the zigzag layout on purpose.
Tensors are packed tokens ``(T, ...)``; q/k/v ``(T_local, heads, head_dim)``.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import GatherSumGrad  # tests/ helper: the fake is only imported inside test ranks

from cp_handler.ops.seq_gather import all_gather_seq

CHUNK = 4
CALLS: list[dict] = []


@dataclass(eq=False)
class DistAttnRuntimeKey:
    cu_seqlens: torch.Tensor
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    group: dist.ProcessGroup
    causal: bool
    total: int
    padded: int
    positions: torch.Tensor = field(repr=False)  # global positions of this rank's tokens


def magi_attn_varlen_key(cu_seqlens_q, cu_seqlens_k, num_heads_q, num_heads_kv, head_dim, pad_size,
                         cp_group_or_mesh, causal=False, window_size=(-1, -1), dist_attn_config=None,
                         chunk_size=None, head_dim_v=None):
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32"
    assert torch.equal(cu_seqlens_q, cu_seqlens_k), "self-attention: the same cu_seqlens for q and k"
    if head_dim % 8 != 0 or head_dim > 192:
        raise ValueError(f"head_dim ({head_dim}) must be divisible by 8 and <= 192")
    assert not causal or tuple(window_size) == (-1, -1), "causal requires window_size=(-1, -1)"
    assert isinstance(cp_group_or_mesh, dist.ProcessGroup)
    size, rank = dist.get_world_size(cp_group_or_mesh), dist.get_rank(cp_group_or_mesh)
    total = int(cu_seqlens_q[-1])
    padded = -(-total // (size * CHUNK)) * size * CHUNK
    chunks = [j for j in range(padded // CHUNK) if j % size == rank]
    positions = torch.cat([torch.arange(j * CHUNK, (j + 1) * CHUNK) for j in chunks])
    CALLS.append({"call": "magi_attn_varlen_key", "cu_seqlens_q": cu_seqlens_q.cpu(), "num_heads_q": num_heads_q,
                  "num_heads_kv": num_heads_kv, "head_dim": head_dim, "group": cp_group_or_mesh, "causal": causal,
                  "pad_size": pad_size})
    return DistAttnRuntimeKey(cu_seqlens_q.cpu(), num_heads_q, num_heads_kv, head_dim, cp_group_or_mesh, causal,
                              total, padded, positions)


def _pad(x, key):
    return torch.cat([x, x.new_zeros((key.padded - x.shape[0], *x.shape[1:]))])


def dispatch(x, key, pad_value=0.0):
    assert x.shape[0] == key.total, f"dispatch takes the global tensor of {key.total} tokens, got {x.shape[0]}"
    return _pad(x, key).index_select(0, key.positions.to(x.device))


def _global_order(key, device):
    size = dist.get_world_size(key.group)
    per_rank = key.positions.numel()
    order = torch.empty(key.padded, dtype=torch.long)
    for rank in range(size):
        chunks = [j for j in range(key.padded // CHUNK) if j % size == rank]
        pos = torch.cat([torch.arange(j * CHUNK, (j + 1) * CHUNK) for j in chunks])
        order[pos] = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    return order.to(device)


def undispatch(x, key, is_partial_grad=False):
    gathered = all_gather_seq(x, 0, key.group)
    return gathered.index_select(0, _global_order(key, x.device))[: key.total]


def roll(x, shift, dim, key):
    assert dim == 0
    return dispatch(torch.roll(undispatch(x, key), shift, 0), key)


def get_position_ids(key):
    return key.positions.clone()


def calc_attn(q, k, v, key, sink=None, softmax_scale=None, softcap=0.0, return_max_logits=False):
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v are [num_tokens_local, heads, head_dim]"
    assert q.shape[1] == key.num_heads_q and k.shape[1] == key.num_heads_kv and q.shape[2] == key.head_dim
    CALLS.append({"call": "calc_attn", "softmax_scale": softmax_scale, "shape": tuple(q.shape)})
    order = _global_order(key, q.device)
    k_all, v_all = (GatherSumGrad.apply(t, key.group).index_select(0, order) for t in (k, v))
    doc_of = torch.searchsorted(key.cu_seqlens, torch.arange(key.padded), right=True).to(q.device)
    qpos, kpos = key.positions.to(q.device), torch.arange(key.padded, device=q.device)
    mask = (doc_of[qpos][:, None] == doc_of[kpos][None, :]) & (kpos[None, :] < key.total)
    if key.causal:
        mask &= kpos[None, :] <= qpos[:, None]
    empty = ~mask.any(dim=1)
    mask[empty, 0] = True  # padding rows: any key, output zeroed below
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1),
                                         attn_mask=mask, scale=softmax_scale, enable_gqa=True).transpose(0, 1)
    return out * (~empty)[:, None, None].to(out.dtype), SimpleNamespace(lse=None, max_logits=None)
