"""All-to-all attention over heads (``"a2a"``, DeepSpeed-Ulysses) and its hierarchical form (``"a2a+p2p"``).

Ulysses (Jacobs et al., 2023): an all-to-all scatters heads and gathers the sequence, so each rank
holds ``H / A`` heads of the whole sequence of its a2a group; attention runs on that; the inverse
all-to-all brings the output back to sequence shards with all heads.

Hierarchical (Transformer Engine / Megatron-LM ``a2a+p2p``): the a2a runs inside the inner group
(adjacent ranks, fast links, size ``A``) and a zigzag ring (:mod:`.ring`) across the outer group
(size ``P``, ``cp = A * P``). After the a2a a rank holds the zigzag chunks of its ``A`` group
members; :meth:`~cp_handler.layout.ZigzagDocs.a2a_reorder_index` arranges them (per document)
into the two super-chunks ``p`` and ``2P-1-p`` of a zigzag over the outer ranks, which is exactly
the ring's layout (:meth:`~cp_handler.layout.ZigzagDocs.inner`). With
``P == 1`` the ring is local attention in global order (plain a2a); with ``A == 1`` there is no
all-to-all (plain ring).

GQA: KV heads are scattered like query heads when ``Hkv % A == 0``; when ``Hkv < A`` and
``A % Hkv == 0`` each KV head is replicated ``A / Hkv`` times before the all-to-all (the fewest
copies that give every rank one), and the replicas' gradients are summed back.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.distributed as dist
from einops import rearrange

from ..layout import ZigzagDocs
from ..masks import AttentionMask
from .collectives import _AllToAll
from .ring import ring_attention
from .spec import AttnSpec, attn_spec


def seq_to_heads(tensors: tuple[torch.Tensor, ...], group) -> list[torch.Tensor]:
    """``(B, H_i, S_l, D_i)`` sequence shards -> ``(B, H_i/A, A*S_l, D_i)``: shards of the group rank by rank, every
    tensor in one all-to-all (q, k and v: one collective instead of three; each keeps its own heads and head dim).
    Differentiable: the backward is one reverse all-to-all."""
    n = dist.get_world_size(group)
    parts, flat, sizes = [], [], []  # loops, not comprehensions (the hot path: each of those is a call)
    for t in tensors:
        part = rearrange(t, "b (n h) s d -> n b h s d", n=n)
        parts.append(part)
        flat.append(part.reshape(n, -1))
        sizes.append(part[0].numel())
    received = _AllToAll.apply(torch.cat(flat, dim=1), group, None, None).split(sizes, dim=1)  # all_to_all inline
    out = []
    for r, part in zip(received, parts, strict=True):
        out.append(rearrange(r.reshape(part.shape), "n b h s d -> b h (n s) d"))
    return out


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads` for one tensor."""
    n = dist.get_world_size(group)
    received = _AllToAll.apply(rearrange(x, "b h (n s) d -> n b h s d", n=n), group, None, None)  # all_to_all
    return rearrange(received, "n b h s d -> b (n h) s d")


@functools.lru_cache(maxsize=256)
def check_a2a_heads(heads: int, kv_heads: int, a2a_size: int) -> int:
    """KV replication factor for an a2a over ``a2a_size`` ranks (1 = none).

    Raises:
        ValueError: query heads not divisible by the a2a size, or KV heads neither divisible by
            it nor dividing it.
    """
    if heads % a2a_size:
        raise ValueError(f"a2a needs query heads ({heads}) divisible by the a2a size ({a2a_size})")
    if kv_heads % a2a_size == 0:
        return 1
    if a2a_size % kv_heads == 0:
        return a2a_size // kv_heads
    raise ValueError(
        f"a2a needs KV heads ({kv_heads}) divisible by the a2a size ({a2a_size}), or dividing it "
        "(then each KV head is replicated a2a_size / kv_heads times)"
    )


def a2a_attn(q, k, v, *, a2a_group: dist.ProcessGroup, causal: bool, scale: float,
             p2p_group: dist.ProcessGroup | None = None, layout: ZigzagDocs | None = None,
             return_lse: bool = False, attn_kernel: str | None = None, mask: AttentionMask | None = None,
             sinks: torch.Tensor | None = None):
    """Differentiable a2a attention; with ``p2p_group``, hierarchical a2a+p2p. Its arguments are checked
    (:func:`~.spec.attn_spec`, :func:`check_a2a_heads`).

    Args:
        q: ``(B, H, S_local, D)`` local queries, zigzag layout over the whole CP group
            (rank ``p * A + a`` is member ``a`` of a2a group ``p``).
        k, v: ``(B, Hkv, S_local, D)``.
        a2a_group: the all-to-all level (size ``A``; plain a2a: the whole CP group).
        p2p_group: the ring level across a2a groups (size ``P``, a2a+p2p); ``None`` for plain a2a.
        layout: documents of the local sequence over the whole CP group (thd); default one
            document (bshd).
        return_lse: also bring the log-sum-exp back to the sequence layout (one more small a2a).
        attn_kernel: force a block kernel by name (:func:`~.kernels.select_kernel`); default automatic.
        mask: window / chunks / soft-cap (:class:`~cp_handler.masks.AttentionMask`), run by the ring
            after the all-to-all (positions are unchanged by it); default the plain mask.
        sinks: ``(H,)`` learnable sink logits; each rank passes the ring its heads' slice (the slice's
            gradient flows back to the whole tensor).

    Returns:
        ``(out (B, H, S_local, D), lse (B, H, S_local) float32 or None)``.

    Raises:
        ValueError: head counts that the a2a cannot split (see :func:`check_a2a_heads`); a mask or
            sinks that :func:`~.spec.attn_spec` refuses.
    """
    size = dist.get_world_size(a2a_group) * (1 if p2p_group is None else dist.get_world_size(p2p_group))
    spec = attn_spec(q, causal=causal, scale=scale, layout=layout or ZigzagDocs.uniform(q.shape[2] * size, size),
                     attn_kernel=attn_kernel, mask=mask, sinks=sinks, group=a2a_group, p2p_group=p2p_group,
                     v_head_dim=v.shape[-1])
    check_a2a_heads(q.shape[1], k.shape[1], dist.get_world_size(a2a_group))
    return a2a_attention(q, k, v, spec, return_lse)


@functools.lru_cache(maxsize=256)
def _reordered(layout: ZigzagDocs, a2a_size: int, device: torch.device):
    """``(order, inverse, inner layout)`` after the all-to-all over ``a2a_size`` ranks (computed once per layout)."""
    order = layout.a2a_reorder_index(a2a_size).to(device)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=device))
    return order, inverse, layout.inner(a2a_size)


def a2a_attention(q, k, v, spec: AttnSpec, return_lse: bool = False):
    """a2a (and a2a+p2p) attention of a checked call: ``spec.group`` is the a2a level, ``spec.p2p_group`` the
    ring level (:func:`a2a_attn` checks a direct call; a handler's pre-flight checks the heads with the
    config). Returns ``(out, lse or None)`` as :func:`a2a_attn`."""
    a2a_size = dist.get_world_size(spec.group)
    ring_spec = replace(spec, group=spec.p2p_group, p2p_group=None)
    if a2a_size == 1:
        return ring_attention(q, k, v, ring_spec)
    replicas = check_a2a_heads(q.shape[1], k.shape[1], a2a_size)
    if spec.sinks is not None:
        heads = q.shape[1] // a2a_size
        rank = dist.get_rank(spec.group)
        ring_spec = replace(ring_spec, sinks=spec.sinks[rank * heads:(rank + 1) * heads])
    if replicas > 1:
        k, v = k.repeat_interleave(replicas, dim=1), v.repeat_interleave(replicas, dim=1)
    order, inverse, inner = _reordered(spec.layout, a2a_size, q.device)
    q, k, v = seq_to_heads((q, k, v), spec.group)
    q, k, v = q.index_select(2, order), k.index_select(2, order), v.index_select(2, order)
    out, lse = ring_attention(q, k, v, replace(ring_spec, layout=inner))
    out = heads_to_seq(out.index_select(2, inverse), spec.group)
    if return_lse:
        lse = heads_to_seq(lse.index_select(2, inverse).unsqueeze(-1), spec.group).squeeze(-1)
    return out, lse if return_lse else None
