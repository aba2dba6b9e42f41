"""All-to-all attention over heads (``"a2a"``, DeepSpeed-Ulysses) and its hierarchical form (``"a2a+p2p"``).

Ulysses (Jacobs et al., 2023): an all-to-all scatters heads and gathers the sequence, so each rank
holds ``H / A`` heads of the whole sequence of its a2a group; attention runs on that; the inverse
all-to-all brings the output back to sequence shards with all heads.

Hierarchical (Transformer Engine / Megatron-LM ``a2a+p2p``): the a2a runs inside the inner group
(adjacent ranks, fast links, size ``A``) and a zigzag ring (:mod:`.ring`) across the outer group
(size ``P``, ``cp = A * P``). After the a2a a rank holds the zigzag chunks of its ``A`` group
members; :meth:`~cp_handler.core.layout.ZigzagDocs.a2a_reorder_index` arranges them (per document)
into the two super-chunks ``p`` and ``2P-1-p`` of a zigzag over the outer ranks, which is exactly
the ring's layout (:meth:`~cp_handler.core.layout.ZigzagDocs.inner`). With
``P == 1`` the ring is local attention in global order (plain a2a); with ``A == 1`` there is no
all-to-all (plain ring). Packed documents through a packed kernel: the inner ring's own reorder (real rows
first, padding last: :mod:`.halves`) is folded into that arrangement, one gather for both, so the ring's calls
read ranges (plain a2a: one causal call over every real row, no gather of its own).

GQA: KV heads are scattered like query heads when ``Hkv % A == 0``; when ``Hkv < A`` and
``A % Hkv == 0`` each KV head is replicated ``A / Hkv`` times before the all-to-all (the fewest
copies that give every rank one), and the replicas' gradients are summed back.

Any other head count (``H % A`` or ``Hkv`` neither a multiple nor a divisor of ``A``; DeepSpeed pads
uneven heads too, its issue #6392) runs exactly by padding heads (:func:`a2a_head_plan`). The query
heads are viewed as ``(Hkv, g)`` (``g = H / Hkv``, the GQA groups) and zero-padded to ``(Hkv', g')``,
K and V to ``Hkv'`` zero heads (sinks like q), with ``Hkv' >= Hkv`` and ``g' >= g`` the pair for which the
even rule above holds and the all-to-alls move the fewest elements: forward (q, k, v, out) and backward
(dout, dq, dk, dv) together send ``2 (A-1)/A B S_local (D + Dv) (H' + Hkv' r)`` elements per rank
(``H' = Hkv' g'``, ``r`` the replicas), so the plan minimises ``H' + Hkv' r`` (ties: fewer query heads,
less compute). For a fixed ``Hkv'`` the smallest ``g'`` is ``g`` (``Hkv' % A == 0``) or ``g`` rounded up
to a multiple of ``r = A / Hkv'``; every ``Hkv'`` above ``ceil(Hkv / A) * A`` is a multiple of ``A`` that
costs more than that one, so the search over ``Hkv'`` in ``[Hkv, ceil(Hkv / A) * A]`` is exhaustive.
When the even rule already holds for ``(H, Hkv)``, that pair is the unique minimum (``H' >= H`` and
``max(Hkv', A) >= max(Hkv, A)``): no padding, no copy. After the inverse all-to-all the padded query
heads (and lse rows) are dropped. Exact, gradients included: a padded query head's output is dropped,
so its upstream gradient is zero and it adds nothing to dK / dV; a padded KV head meets only padded
query heads. Cost: the padded heads' bytes and flops, ``(H' - H) / H`` more q traffic and compute and
``(Hkv' r - max(Hkv, A)) / max(Hkv, A)`` more K/V traffic (e.g. H = Hkv = 7 at A = 4: 8 heads, +14%).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange

from ..core.layout import ZigzagDocs
from ..core.masks import AttentionMask
from .canonical import canonical_attention
from .collectives import _AllToAll
from .halves import halves_order, uses_halves
from .ring import halves_ring_attention, ring_attention
from .spec import AttnSpec, attn_spec
from .tiling import canonical_applies


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


@dataclass(frozen=True)
class A2AHeads:
    """How an all-to-all over ``a2a_size`` ranks splits ``heads`` query and ``kv_heads`` KV heads
    (:func:`a2a_head_plan`).

    Attributes:
        heads, kv_heads, a2a_size: the call's ``H``, ``Hkv`` and ``A``.
        padded_kv_heads: ``Hkv' >= Hkv``, the KV heads after zero padding.
        padded_group: ``g' >= H / Hkv``, query heads per KV head after zero padding.
        replicas: ``r``, copies of each (padded) KV head before the all-to-all (1 = none).
        padded: ``(Hkv', g') != (Hkv, H / Hkv)``; ``False``: the tensors go to the all-to-all as they are.
    """

    heads: int
    kv_heads: int
    a2a_size: int
    padded_kv_heads: int
    padded_group: int
    replicas: int
    padded: bool

    @property
    def padded_heads(self) -> int:
        """``H' = Hkv' * g'``, the query heads the all-to-all moves."""
        return self.padded_kv_heads * self.padded_group

    @property
    def heads_per_rank(self) -> int:
        """Query heads each rank attends to after the all-to-all (``H' / A``)."""
        return self.padded_heads // self.a2a_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds after the all-to-all (``Hkv' r / A``)."""
        return self.padded_kv_heads * self.replicas // self.a2a_size

    def pad_q(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``t`` with ``H`` query heads at ``dim`` (q, sinks) -> ``H'``: heads viewed as ``(Hkv, g)``, zeros appended
        to each group and as whole groups (differentiable)."""
        group = self.heads // self.kv_heads
        t = t.unflatten(dim, (self.kv_heads, group))
        after = [0, 0] * (t.dim() - dim - 2)  # F.pad lists the last dimension first
        return F.pad(t, (*after, 0, self.padded_group - group, 0, self.padded_kv_heads - self.kv_heads)).flatten(
            dim, dim + 1)

    def pad_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, Hkv, S, D)`` -> ``(B, Hkv', S, D)``: zero heads appended."""
        return F.pad(t, (0, 0, 0, 0, 0, self.padded_kv_heads - self.kv_heads))

    def unpad(self, t: torch.Tensor) -> torch.Tensor:
        """``(B, H', ...)`` -> ``(B, H, ...)``: the real query heads, in their order (inverse of :meth:`pad_q`)."""
        t = t.unflatten(1, (self.padded_kv_heads, self.padded_group))
        return t[:, :self.kv_heads, :self.heads // self.kv_heads].flatten(1, 2)


def _replicas(kv_heads: int, a2a_size: int) -> int | None:
    """The even rule's KV replication for ``kv_heads`` over ``a2a_size`` ranks; ``None``: it does not hold."""
    if kv_heads % a2a_size == 0:
        return 1
    return a2a_size // kv_heads if a2a_size % kv_heads == 0 else None


@functools.lru_cache(maxsize=256)
def a2a_head_plan(heads: int, kv_heads: int, a2a_size: int) -> A2AHeads:
    """How an all-to-all over ``a2a_size`` ranks splits the heads: every head count runs, padded when the even rule
    (``H % A == 0``, and ``Hkv % A == 0`` or ``A % Hkv == 0``) does not hold (the module doc: the padding, its
    minimality, its cost). Cached: the hot path calls it once per layer.

    Raises:
        ValueError: ``heads``, ``kv_heads`` or ``a2a_size`` < 1, or ``heads`` not a multiple of ``kv_heads``.
    """
    if heads < 1 or kv_heads < 1 or a2a_size < 1:
        raise ValueError(f"a2a needs query heads ({heads}), KV heads ({kv_heads}) and the a2a size ({a2a_size}) "
                         ">= 1")
    if heads % kv_heads:
        raise ValueError(f"a2a needs query heads ({heads}) a multiple of KV heads ({kv_heads}) (GQA)")
    group = heads // kv_heads
    best = None
    for padded_kv in range(kv_heads, -(-kv_heads // a2a_size) * a2a_size + 1):
        replicas = _replicas(padded_kv, a2a_size)
        if replicas is None:
            continue
        padded_group = -(-group // replicas) * replicas  # padded_kv * g' % A == 0 <=> g' % replicas == 0
        cost = (padded_kv * (padded_group + replicas), padded_kv * padded_group)  # elements sent; then compute
        if best is None or cost < best[0]:
            best = cost, padded_kv, padded_group, replicas
    _, padded_kv, padded_group, replicas = best
    return A2AHeads(heads, kv_heads, a2a_size, padded_kv, padded_group, replicas,
                    padded=(padded_kv, padded_group) != (kv_heads, group))


def a2a_attn(q, k, v, *, a2a_group: dist.ProcessGroup, causal: bool, scale: float,
             p2p_group: dist.ProcessGroup | None = None, layout: ZigzagDocs | None = None,
             return_lse: bool = False, attn_kernel: str | None = None, mask: AttentionMask | None = None,
             sinks: torch.Tensor | None = None):
    """Differentiable a2a attention; with ``p2p_group``, hierarchical a2a+p2p. Its arguments are checked
    (:func:`~.spec.attn_spec`, :func:`a2a_head_plan`); any head count runs (padded when the a2a size does not
    split it, see the module doc).

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
        mask: window / chunks / soft-cap (:class:`~cp_handler.core.masks.AttentionMask`), run by the ring
            after the all-to-all (positions are unchanged by it); default the plain mask.
        sinks: ``(H,)`` learnable sink logits; each rank passes the ring its heads' slice (the slice's
            gradient flows back to the whole tensor).

    Returns:
        ``(out (B, H, S_local, D), lse (B, H, S_local) float32 or None)``.

    Raises:
        ValueError: query heads not a multiple of KV heads (:func:`a2a_head_plan`); a mask or sinks that
            :func:`~.spec.attn_spec` refuses.
    """
    size = dist.get_world_size(a2a_group) * (1 if p2p_group is None else dist.get_world_size(p2p_group))
    spec = attn_spec(q, causal=causal, scale=scale, layout=layout or ZigzagDocs.uniform(q.shape[2] * size, size),
                     attn_kernel=attn_kernel, mask=mask, sinks=sinks, group=a2a_group, p2p_group=p2p_group,
                     v_head_dim=v.shape[-1])
    a2a_head_plan(q.shape[1], k.shape[1], dist.get_world_size(a2a_group))
    return a2a_attention(q, k, v, spec, return_lse)


@functools.lru_cache(maxsize=256)
def _reordered(layout: ZigzagDocs, a2a_size: int, packed: bool, mask: AttentionMask, ring_rank: int,
               device: torch.device):
    """``(order, inverse, inner layout, halves)`` of the rows after the all-to-all over ``a2a_size`` ranks: the
    inner layout's order (:meth:`~cp_handler.core.layout.ZigzagDocs.a2a_reorder_index`), with the inner ring's
    own reorder on ``ring_rank`` folded in when it has one (``halves``: :func:`~.halves.uses_halves`, packed
    documents), so one gather does both (computed once per layout)."""
    inner = layout.inner(a2a_size)
    halves = uses_halves(inner, packed, mask)
    order = layout.a2a_reorder_index(a2a_size)
    if halves:
        order = order[halves_order(inner, ring_rank, torch.device("cpu"))[0]]
    order = order.to(device)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=device))
    return order, inverse, inner, halves


def a2a_attention(q, k, v, spec: AttnSpec, return_lse: bool = False):
    """a2a (and a2a+p2p) attention of a checked call: ``spec.group`` is the a2a level, ``spec.p2p_group`` the
    ring level (:func:`a2a_attn` checks a direct call; a handler's pre-flight checks the heads with the
    config). Uneven heads are padded (:func:`a2a_head_plan`). Returns ``(out, lse or None)`` as :func:`a2a_attn`."""
    a2a_size = dist.get_world_size(spec.group)
    ring_spec = replace(spec, group=spec.p2p_group, p2p_group=None)
    if a2a_size == 1:
        return ring_attention(q, k, v, ring_spec)
    plan = a2a_head_plan(q.shape[1], k.shape[1], a2a_size)
    sinks = spec.sinks
    if plan.padded:  # uneven heads: zero heads appended (the module doc); the even case copies nothing
        q, k, v = plan.pad_q(q), plan.pad_kv(k), plan.pad_kv(v)
        sinks = plan.pad_q(sinks, 0) if sinks is not None else None
    if sinks is not None:
        heads = plan.heads_per_rank
        rank = dist.get_rank(spec.group)
        ring_spec = replace(ring_spec, sinks=sinks[rank * heads:(rank + 1) * heads])
    if plan.replicas > 1:
        k, v = k.repeat_interleave(plan.replicas, dim=1), v.repeat_interleave(plan.replicas, dim=1)
    ring_rank = 0 if spec.p2p_group is None else dist.get_rank(spec.p2p_group)
    order, inverse, inner, halves = _reordered(spec.layout, a2a_size, spec.kernel.packed, spec.mask, ring_rank,
                                               q.device)
    q, k, v = seq_to_heads((q, k, v), spec.group)
    q, k, v = q.index_select(2, order), k.index_select(2, order), v.index_select(2, order)
    if spec.canonical and canonical_applies(spec.layout, spec.mask, spec.sinks, tiled=spec.p2p_group is not None):
        out, lse = canonical_attention(q, k, v, replace(ring_spec, layout=inner), ring=spec.p2p_group is not None)
    else:
        out, lse = (halves_ring_attention if halves else ring_attention)(q, k, v, replace(ring_spec, layout=inner))
    out = heads_to_seq(out.index_select(2, inverse), spec.group)
    if return_lse:
        lse = heads_to_seq(lse.index_select(2, inverse).unsqueeze(-1), spec.group).squeeze(-1)
    if plan.padded:
        out, lse = plan.unpad(out), plan.unpad(lse) if return_lse else None
    return out, lse if return_lse else None
