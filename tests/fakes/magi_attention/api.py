"""Fake ``magi_attention.api``: the public API of one MagiAttention release at a time.

``install_version(v)`` binds this module's functions to release ``v``'s signatures (read in
SandAI-org/MagiAttention, ``magi_attention/api/magi_attn_interface.py`` and ``api/functools.py``):

* ``"1.0.4"`` (tag v1.0.4; v1.0.5 identical): ``magi_attn_varlen_key(cu_seqlens_q, cu_seqlens_k, pad_size,
  chunk_size, cp_group_or_mesh, causal, window_size, dist_attn_config)`` (lines 49-58) returns the key;
  ``calc_attn(q, k, v, key, softmax_scale, softcap)`` returns ``(out, lse)`` (707-714); no ``roll``;
* ``"1.1.0"`` (tag v1.1.0): the key adds ``num_heads_q, num_heads_kv, head_dim`` before a required
  ``pad_size`` and ``chunk_size`` (135-147); ``calc_attn(q, k, v, key, sink, softmax_scale, softcap,
  return_max_logits)`` returns ``(out, AttnForwardMeta)`` (869-878); no ``roll``;
* ``"1.1.1"`` (tag v1.1.1 and main at 2c641357): ``chunk_size`` moves last and is optional, ``pad_size``
  is computed inside (a non-zero value is deprecated) (160-172); ``undispatch(x, key,
  is_partial_grad)`` (924-928); ``roll(x, shift, dim, key)`` (960-962).

Common to all: ``dispatch(x, key, pad_value)`` pads the global tensor by the key's pad size and
returns this rank's tokens; its backward all-gathers the gradient (undispatch), so every rank gets
the *full* gradient; ``undispatch`` gathers and unpads; ``get_position_ids`` gives the global
(padded) position of every local token; ``compute_pad_size`` (functools.py 25-50) pads to a
multiple of ``chunk_size * cp``. Rules enforced as the library does: int32 ``cu_seqlens``,
``(total + pad_size) % (chunk_size * cp) == 0``, causal needs ``window_size=(-1, -1)``, q/k/v
``[tokens, heads, head_dim]`` in float16 / bfloat16 (FFA's ``compute_dtype``, head_dim <= 128:
``functional/_flex_flash_attn_jit.py`` 153-161 at 2c641357), an NCCL-only group replaced by gloo
here. The layout deals chunks round-robin, so it differs from the zigzag layout on purpose.
Attention: dense masked SDPA over the gathered sequence (document-causal).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import GatherSumGrad  # tests/ helper: the fake is only imported inside test ranks

import magi_attention
from cp_handler.ops.seq_gather import all_gather_seq

CALLS: list[dict] = []
VERSIONS = ("1.0.4", "1.1.0", "1.1.1")
INTERNAL_CHUNK = 4  # 1.1.1 picks its chunk size itself


@dataclass(eq=False)
class DistAttnRuntimeKey:
    cu_seqlens: torch.Tensor
    heads: tuple | None
    group: dist.ProcessGroup
    causal: bool
    total: int
    pad_size: int
    chunk: int
    positions: torch.Tensor = field(repr=False)  # global (padded) positions of this rank's tokens

    @property
    def padded(self) -> int:
        return self.total + self.pad_size


def compute_pad_size(total_seqlen_q, cp_size, chunk_size):
    return (-total_seqlen_q) % (chunk_size * cp_size)


def _key(cu_seqlens_q, cu_seqlens_k, heads, pad_size, chunk_size, group, causal, window_size):
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32"
    assert torch.equal(cu_seqlens_q, cu_seqlens_k), "self-attention: the same cu_seqlens for q and k"
    assert not causal or tuple(window_size) == (-1, -1), "causal requires window_size=(-1, -1)"
    assert isinstance(group, dist.ProcessGroup)
    size, rank, total = dist.get_world_size(group), dist.get_rank(group), int(cu_seqlens_q[-1])
    assert (total + pad_size) % (chunk_size * size) == 0, "seqlen + pad_size must divide by chunk_size * cp_size"
    padded = total + pad_size
    chunks = [j for j in range(padded // chunk_size) if j % size == rank]
    positions = torch.cat([torch.arange(j * chunk_size, (j + 1) * chunk_size) for j in chunks])
    CALLS.append({"call": "magi_attn_varlen_key", "cu_seqlens_q": cu_seqlens_q.cpu(), "heads": heads,
                  "group": group, "causal": causal, "pad_size": pad_size, "chunk_size": chunk_size})
    return DistAttnRuntimeKey(cu_seqlens_q.cpu(), heads, group, causal, total, pad_size, chunk_size, positions)


def _key_1_0_4(cu_seqlens_q, cu_seqlens_k, pad_size, chunk_size, cp_group_or_mesh, causal=False,
               window_size=(-1, -1), dist_attn_config=None):
    return _key(cu_seqlens_q, cu_seqlens_k, None, pad_size, chunk_size, cp_group_or_mesh, causal, window_size)


def _key_1_1_0(cu_seqlens_q, cu_seqlens_k, num_heads_q, num_heads_kv, head_dim, pad_size, chunk_size,
               cp_group_or_mesh, causal=False, window_size=(-1, -1), dist_attn_config=None):
    return _key(cu_seqlens_q, cu_seqlens_k, (num_heads_q, num_heads_kv, head_dim), pad_size, chunk_size,
                cp_group_or_mesh, causal, window_size)


def _key_1_1_1(cu_seqlens_q, cu_seqlens_k, num_heads_q, num_heads_kv, head_dim, pad_size, cp_group_or_mesh,
               causal=False, window_size=(-1, -1), dist_attn_config=None, chunk_size=None):
    chunk = chunk_size or INTERNAL_CHUNK
    pad = compute_pad_size(int(cu_seqlens_q[-1]), dist.get_world_size(cp_group_or_mesh), chunk)
    return _key(cu_seqlens_q, cu_seqlens_k, (num_heads_q, num_heads_kv, head_dim), pad, chunk, cp_group_or_mesh,
                causal, window_size)


def _global_order(key, device):
    size, per_rank = dist.get_world_size(key.group), key.positions.numel()
    order = torch.empty(key.padded, dtype=torch.long)
    for rank in range(size):
        chunks = [j for j in range(key.padded // key.chunk) if j % size == rank]
        pos = torch.cat([torch.arange(j * key.chunk, (j + 1) * key.chunk) for j in chunks])
        order[pos] = torch.arange(rank * per_rank, (rank + 1) * per_rank)
    return order.to(device)


def _undispatch(x, key):
    """Differentiable: backward keeps this rank's slice (the all-gather's adjoint for a replicated use)."""
    return all_gather_seq(x, 0, key.group).index_select(0, _global_order(key, x.device))[: key.total]


class _Dispatch(torch.autograd.Function):
    """Forward: pad and keep this rank's tokens. Backward: all-gather the gradient (as the real
    dispatch's backward, an undispatch), so every rank holds the full gradient."""

    @staticmethod
    def forward(ctx, x, key, pad_value):
        ctx.key = key
        padded = torch.cat([x, x.new_full((key.pad_size, *x.shape[1:]), pad_value)])
        return padded.index_select(0, key.positions.to(x.device))

    @staticmethod
    def backward(ctx, grad):
        with torch.no_grad():
            return _undispatch(grad.contiguous(), ctx.key), None, None


def dispatch(x, key, pad_value=0.0):
    assert x.shape[0] == key.total, f"dispatch takes the global tensor of {key.total} tokens, got {x.shape[0]}"
    return _Dispatch.apply(x, key, pad_value)


def _undispatch_1_0(x, key):
    return _undispatch(x, key)


def _undispatch_1_1_1(x, key, is_partial_grad=False):
    return _undispatch(x, key)


def roll(x, shift, dim, key):
    assert dim == 0
    return dispatch(torch.roll(_undispatch(x, key), shift, 0), key)


def get_position_ids(key):
    return key.positions.clone()


def _attention(q, k, v, key, softmax_scale):
    assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v are [num_tokens_local, heads, head_dim]"
    assert q.dtype in (torch.float16, torch.bfloat16), "compute_dtype must be float16 or bfloat16"
    assert q.shape[2] <= 128, "head_dim must be <= 128 for now"
    if key.heads is not None:
        assert (q.shape[1], k.shape[1], q.shape[2]) == key.heads, "q/k heads and head_dim must match the key"
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
    return out * (~empty)[:, None, None].to(out.dtype)


def _calc_attn_1_0_4(q, k, v, key, softmax_scale=None, softcap=0.0):
    return _attention(q, k, v, key, softmax_scale), None


def _calc_attn_1_1(q, k, v, key, sink=None, softmax_scale=None, softcap=0.0, return_max_logits=False):
    return _attention(q, k, v, key, softmax_scale), SimpleNamespace(lse=None, max_logits=None)


_RELEASES = {
    "1.0.4": {"magi_attn_varlen_key": _key_1_0_4, "calc_attn": _calc_attn_1_0_4, "undispatch": _undispatch_1_0},
    "1.1.0": {"magi_attn_varlen_key": _key_1_1_0, "calc_attn": _calc_attn_1_1, "undispatch": _undispatch_1_0},
    "1.1.1": {"magi_attn_varlen_key": _key_1_1_1, "calc_attn": _calc_attn_1_1, "undispatch": _undispatch_1_1_1,
              "roll": roll},
}


def install_version(version: str) -> None:
    """Give this module (and ``magi_attention.__version__``) the API of release ``version``."""
    module = sys.modules[__name__]
    for name, fn in _RELEASES[version].items():
        setattr(module, name, fn)
    if "roll" not in _RELEASES[version] and "roll" in vars(module):
        delattr(module, "roll")
    magi_attention.__version__ = version


install_version("1.1.1")
