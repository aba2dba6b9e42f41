"""This rank's shard of the KV cache of a CP group (:mod:`cp_handler.inference`).

A prefill (a forward over prompts dispatched with a thd handler that holds the cache) stores, per
layer, the real local rows of K and V (after RoPE, as ``core_attn`` receives them) with the sequence
each belongs to and its global position; padding rows are not kept. Decode steps append each new
token's K/V on one rank, the one holding the fewest rows (ties: the lowest rank), so every rank holds
about ``1 / cp`` of the cache. Rows that no later query may see (a sliding window or chunked layer:
:class:`~cp_handler.core.masks.AttentionMask`) are dropped after each decode step, so such a layer keeps at
most ``W - 1`` rows per sequence (window ``W``) or the current chunk's; the owner choice keeps counting
every row appended (balance of the rows a layer without a window keeps). Every rank knows every
rank's row count (the layout decides it), so the choice needs no communication.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from ..core.layout import ZigzagDocs
from ..runtime.rope import PositionTablesChanged


class _Shard:
    """One layer's rows: ``k (N, Hkv, Dqk)``, ``v (N, Hkv, Dv)`` (each its own width: MLA), ``seq (N,)`` sequence
    index, ``pos (N,)`` global position."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor):
        self.k, self.v, self.seq, self.pos, self.size = k, v, seq, pos, k.shape[0]

    def append(self, k: torch.Tensor, v: torch.Tensor, seq: int, pos: int) -> None:
        """Add one row (``k (Hkv, Dqk)``, ``v (Hkv, Dv)``), doubling the buffers when they are full."""
        if self.size == self.k.shape[0]:
            grow = max(16, self.size)
            self.k, self.v = (torch.cat([t, t.new_empty((grow, *t.shape[1:]))]) for t in (self.k, self.v))
            self.seq, self.pos = (torch.cat([t, t.new_empty(grow)]) for t in (self.seq, self.pos))
        self.k[self.size], self.v[self.size] = k, v
        self.seq[self.size], self.pos[self.size] = seq, pos
        self.size += 1

    def keep(self, kept: torch.Tensor) -> None:
        """Keep only the rows where ``kept (N,)`` is true (order preserved)."""
        self.k, self.v, self.seq, self.pos = (t[: self.size][kept] for t in (self.k, self.v, self.seq, self.pos))
        self.size = self.k.shape[0]

    def rows(self):
        n = self.size
        return self.k[:n], self.v[:n], self.seq[:n], self.pos[:n]


class KVCache:
    """This rank's shard of a CP group's KV cache.

    Args:
        cp_group: the CP group the prefill and every decode step run on (``None``: one process).
        num_layers: attention layers (``attn_mod.layer_number`` is 1-based).

    Attributes:
        lengths: tokens so far of each sequence (global; known on every rank).
        rows_per_rank: cached rows held by each rank of the group (known on every rank).
    """

    def __init__(self, cp_group, num_layers: int):
        self.cp_group, self.num_layers = cp_group, num_layers
        self.group_ranks = tuple(dist.get_process_group_ranks(cp_group)) if cp_group is not None else None
        self.cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
        self.cp_rank = 0 if cp_group is None else dist.get_rank(cp_group)
        self.layers: dict[int, list[_Shard]] = {}
        self._calls: dict[int, int] | None = None  # attention calls per layer in the current decode step
        self.lengths: list[int] = []
        self.rows_per_rank: list[int] = []
        self.prefilled = False
        self.position_tables: dict[Hashable, tuple[torch.Tensor, ...]] = {}

    def check_position_tables(self, key: Hashable, rows: tuple[torch.Tensor, ...]) -> None:
        """Position-table rows ``rows`` of one module (``key``) at a fixed probe position: kept during the
        prefill; a decode step's must be identical.

        Raises:
            PositionTablesChanged: they differ (the tables depend on the sequence length).
        """
        if not self.prefilled:
            self.position_tables[key] = tuple(t.detach().clone() for t in rows)
            return
        kept = self.position_tables.get(key)
        if kept is None or len(kept) != len(rows) or not all(map(torch.equal, kept, rows)):
            raise PositionTablesChanged(f"{key}: the position tables at length {max(self.lengths)} differ from the "
                                        "prefill's")

    def check_group(self, cp_group, what: str) -> None:
        """Raises ValueError when ``cp_group`` is not the group this cache was built for."""
        ranks = tuple(dist.get_process_group_ranks(cp_group)) if cp_group is not None else None
        if ranks != self.group_ranks:
            raise ValueError(f"{what}: this KV cache belongs to the CP group of global ranks {self.group_ranks}, not "
                             f"{ranks}: a cache is used with the group (and the handler kind) it was filled on")

    def store_prefill(self, layer_number: int, k: torch.Tensor, v: torch.Tensor, layout: ZigzagDocs) -> None:
        """Keep layer ``layer_number``'s real local rows of ``k (T_local, Hkv, Dqk)``, ``v (T_local, Hkv, Dv)``
        (prefill, thd). A layer
        that calls attention several times per forward (DiffLlama: twice, with two halves of V) gets one
        shard per call, in call order."""
        if self.prefilled:
            raise ValueError("KVCache: prefill after the cache was filled; build a new cache per generation")
        if not 1 <= layer_number <= self.num_layers:
            raise ValueError(f"KVCache: layer_number {layer_number} outside 1..{self.num_layers}")
        real = layout.real_mask(self.cp_rank).to(k.device)
        seq = torch.repeat_interleave(torch.arange(layout.num_docs), torch.tensor(layout.padded_lengths) // layout.size)
        self.layers.setdefault(layer_number, []).append(
            _Shard(k[real].detach().clone(), v[real].detach().clone(), seq.to(k.device)[real],
                   layout.positions(self.cp_rank).to(k.device)[real]))
        if not self.lengths:
            self.lengths = list(layout.lengths)
            self.rows_per_rank = [int(layout.real_mask(r).sum()) for r in range(layout.size)]

    def finish_prefill(self) -> None:
        """Mark the prefill done. Raises ValueError unless every layer stored its rows."""
        missing = [n for n in range(1, self.num_layers + 1) if n not in self.layers]
        if missing:
            raise ValueError(f"KVCache: the prefill stored no rows for layers {missing} (did every attention layer run "
                             "core_attn with this handler?)")
        self.prefilled = True

    def next_token_owners(self) -> tuple[list[int], list[int]]:
        """``(owner rank, global position)`` of each sequence's next token; advances the counts (one call per
        decode step, on every rank alike). Raises ValueError when the previous step did not make every
        attention call the prefill made (:meth:`check_step`)."""
        self.check_step()
        owners, positions = [], []
        for i in range(len(self.lengths)):
            owner = min(range(self.cp_size), key=lambda r: (self.rows_per_rank[r], r))
            owners.append(owner)
            positions.append(self.lengths[i])
            self.rows_per_rank[owner] += 1
            self.lengths[i] += 1
        self._calls = {}
        return owners, positions

    def layer(self, layer_number: int) -> _Shard:
        """The shard of this decode step's next attention call of layer ``layer_number``.

        Raises:
            ValueError: no such layer, or more calls of it than in the prefill.
        """
        if layer_number not in self.layers:
            raise ValueError(f"KVCache: no rows for layer_number {layer_number} (1..{self.num_layers})")
        call = self._calls.get(layer_number, 0)
        if call >= len(self.layers[layer_number]):
            raise ValueError(f"KVCache: layer {layer_number} called attention {call + 1} times in this decode step, "
                             f"{len(self.layers[layer_number])} in the prefill")
        self._calls[layer_number] = call + 1
        return self.layers[layer_number][call]

    def check_step(self) -> None:
        """Raises ValueError unless the last decode step (if any) made exactly the prefill's attention calls."""
        calls = self._calls
        if calls is None:
            return
        short = {n: (calls.get(n, 0), len(shards)) for n, shards in self.layers.items()
                 if calls.get(n, 0) != len(shards)}
        if short:
            raise ValueError("KVCache: the last decode step made other attention calls than the prefill (layer: "
                             f"(step, prefill) calls) {short}: its output left cached rows unread")

    def nbytes(self) -> int:
        """Bytes of K and V this rank holds (the rows in use)."""
        return sum(shard.size * (t.shape[1:].numel() * t.element_size())
                   for shards in self.layers.values() for shard in shards for t in (shard.k, shard.v))
