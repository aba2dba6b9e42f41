"""Expert parallelism for MoE layers: the handler-style object a MoE feed-forward calls.

Like :class:`~cp_handler.handlers.base.ContextParallelHandler` for attention, an
:class:`ExpertParallelHandler` is built per batch, holds the groups, and hides every collective
from the model: tokens stay sequence-sharded from attention; each rank routes its own tokens,
and ``token_dispatch`` sends every (token, expert) pair to the rank holding that expert with one
``all_to_all_single`` of uneven splits (after a small all-to-all of the per-expert counts), as
Megatron-LM's ``MoEAlltoAllTokenDispatcher`` does; ``token_combine`` is the inverse exchange.
Both are differentiable (the backward of an uneven all-to-all is the all-to-all with the splits
swapped). Experts are laid out contiguously: rank ``r`` of the expert-parallel group holds experts
``[r * E / ep, (r + 1) * E / ep)``.

Router statistics for the load-balancing loss (Switch Transformer, Fedus et al. 2021) are summed
over ``stats_group`` (the data x context parallel ranks that share one global batch), so the loss
equals the one of a single process holding the whole batch; each rank adds its share to
``aux_losses`` and the shares sum to the global loss. Only the batch's tokens count: the padding a CP layout adds
(thd documents padded to multiples of ``2 cp``) is routed but left out of the statistics, its rows named by the CP
handler's layout (``token_layout.real_token_mask()``), never by a tensor's shape. In the deterministic mode (a CP
handler with ``deterministic``, docs/deterministic.md) the router probabilities are summed over the CP group's tokens
in one order (:meth:`ExpertParallelHandler.probs_sum`), so every rank of a CP group holds its group's share, bitwise
the same at every CP degree. With the mode's exact parameter gradients (:mod:`~cp_handler.runtime.exact_grads`) the
pairs carry their unit through the exchange, and each local expert runs under :meth:`ExpertParallelHandler.expert_rows`:
its weight gradients are summed per unit of the rows it received (a unit's pairs routed to one expert: the same tokens
in the same order at every CP degree), so expert gradients are bitwise the same at every degree too.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..ops.collectives import all_to_all, all_to_all_single


class ExpertParallelHandler:
    """Token exchange and router statistics of MoE layers for one batch.

    Args:
        num_experts: E, the experts of each MoE layer (divisible by the expert-parallel size).
        ep_group: expert-parallel group (``None``: this rank holds every expert).
        stats_group: ranks whose router statistics are summed for the load-balancing loss
            (``None``: this rank alone).
        cp_handler: the batch's CP handler (its real tokens and its mode: module doc); ``None``: every row a token.
        exact: the deterministic mode's exact gradients, told this batch's units (module doc); ``None``: autograd's.

    Raises:
        ValueError: ``num_experts`` < 1 or not divisible by the expert-parallel size.
    """

    def __init__(self, *, num_experts: int, ep_group: dist.ProcessGroup | None = None,
                 stats_group: dist.ProcessGroup | None = None, cp_handler=None, exact=None):
        self.ep_group, self.stats_group, self.exact = ep_group, stats_group, exact
        self.real = None if cp_handler is None else cp_handler.token_layout.real_token_mask()  # (S_local,) or None
        self.canonical = cp_handler if cp_handler is not None and cp_handler.deterministic else None
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts < 1 or num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} must be >= 1 and divisible by the expert-parallel size "
                             f"{self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.aux_losses: list[torch.Tensor] = []

    @property
    def local_expert_ids(self) -> range:
        """Global ids of the experts this rank holds."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    def router_stats(self, counts: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``counts (E,)`` (this rank's routed pairs per expert) and its token count, summed over
        ``stats_group``; not differentiable. Returns ``(counts (E,) float32, tokens () float32)``."""
        stats = torch.cat([counts.detach().float(), counts.new_tensor([num_tokens]).float()])
        if self.stats_group is not None:
            dist.all_reduce(stats, group=self.stats_group)
        return stats[:-1], stats[-1]

    def real_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows of ``rows (B, S_local, ...)`` that hold the batch's tokens, flattened to ``(N_real, ...)``."""
        return (rows if self.real is None else rows[:, self.real.to(rows.device)]).flatten(0, 1)

    def probs_sum(self, probs: torch.Tensor) -> torch.Tensor:
        """``probs (B, S_local, E)`` float32 summed over the batch's tokens (padding left out), ``(E,)``: this rank's;
        in the deterministic mode the CP group's, put in global order by the CP handler's ``combine`` (which drops
        the padding; its backward keeps this rank's tokens) and added one token after another (a cumulative sum: an
        order that depends on neither the group nor the thread count, as
        :func:`~cp_handler.models.loss.canonical_loss_sum`)."""
        if self.canonical is None:
            return self.real_rows(probs).sum(0)
        return self.canonical.combine(probs, 1).flatten(0, 1).cumsum(0)[-1]

    def add_aux_loss(self, loss: torch.Tensor) -> None:
        """Keep a layer's share of the load-balancing loss (the training loop adds their sum)."""
        self.aux_losses.append(loss)

    def token_dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor):
        """Send ``tokens (N, h)`` to the ranks of their experts ``expert_ids``: ``(N,)`` int64, or ``(T, k)`` when
        the rows are ``T`` tokens' pairs with ``k`` experts each, token-major (``N = T k``: what the exact sums need
        to find each pair's unit).

        Returns ``(expert_tokens (M, h), tokens_per_local_expert: list[int], state)``: the tokens
        this rank's experts must process, grouped by local expert in ``local_expert_ids`` order,
        and the state :meth:`token_combine` and :meth:`expert_rows` need.

        Raises:
            ValueError: an expert id outside ``[0, num_experts)``; with exact sums, rows that are not whole batch rows
                of the told units.
        """
        per_token = expert_ids.shape[1] if expert_ids.dim() == 2 else 1
        expert_ids = expert_ids.flatten()
        if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= self.num_experts):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts}), got "
                             f"[{int(expert_ids.min())}, {int(expert_ids.max())}]")
        order = torch.argsort(expert_ids, stable=True)
        counts = torch.bincount(expert_ids, minlength=self.num_experts)  # (E,)
        sorted_tokens = tokens.index_select(0, order)
        tags = None
        if self.exact is not None:  # each pair's unit, in the order the pairs are sent
            tags = self._pair_units(expert_ids.numel(), per_token, order.device).index_select(0, order)
        if self.ep_group is None:
            local = counts.tolist()
            return sorted_tokens, local, (order, None, _runs(tags, local))
        per_rank = counts.view(self.ep_size, self.num_local_experts)  # [destination rank][its local expert]
        received = torch.empty_like(per_rank)
        all_to_all_single(received, per_rank.contiguous(), self.ep_group)  # [source rank][my local expert]
        send_splits, recv_splits = per_rank.sum(1).tolist(), received.sum(1).tolist()
        arrived = all_to_all(sorted_tokens, self.ep_group, send_splits, recv_splits)
        by_expert = self._source_major_to_expert_major(received)
        local = received.sum(0).tolist()
        if tags is not None:
            tags = all_to_all(tags, self.ep_group, send_splits, recv_splits).index_select(0, by_expert)
        state = (order, (send_splits, recv_splits, by_expert), _runs(tags, local))
        return arrived.index_select(0, by_expert), local, state

    def _pair_units(self, pairs: int, per_token: int, device: torch.device) -> torch.Tensor:
        """``(pairs,)`` int64: the unit of each pair (the told units of every batch row, in order), numbered apart on
        every rank of the expert-parallel group (its rank in the upper 32 bits)."""
        units = self.exact.units
        row = sum(units) if units else 0
        if units is None or not row or pairs % per_token or (pairs // per_token) % row:
            raise ValueError(f"exact gradients of the experts: {pairs} pairs of {per_token} per token are not whole "
                             f"batch rows of the told units ({units})")
        lengths = torch.tensor(units * (pairs // per_token // row), device=device)
        tokens = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        return tokens.repeat_interleave(per_token) + (self.ep_rank << 32)

    @contextlib.contextmanager
    def expert_rows(self, state, index: int):
        """The block in which local expert ``index`` (of :meth:`token_dispatch`'s ``state``) runs on its rows: with
        exact sums, its weight gradients cut by the units of those rows (module doc); else nothing."""
        runs = state[2]
        if runs is None:
            yield
            return
        told, self.exact.units = self.exact.units, runs[index]
        try:
            yield
        finally:
            self.exact.units = told

    @staticmethod
    def _source_major_to_expert_major(received: torch.Tensor) -> torch.Tensor:
        """Row index taking arrived tokens from [source][expert] blocks to [expert][source] blocks."""
        starts = torch.cumsum(received.flatten(), 0) - received.flatten()
        starts = starts.view_as(received)
        pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + received[s, e]))
                  for e in range(received.shape[1]) for s in range(received.shape[0])]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)

    def token_combine(self, expert_out: torch.Tensor, state) -> torch.Tensor:
        """Inverse of :meth:`token_dispatch`: ``expert_out (M, h)`` -> ``(N, h)`` in the order of the
        tokens given to it."""
        order, exchange, _ = state
        if exchange is not None:
            send_splits, recv_splits, by_expert = exchange
            source_major = torch.empty_like(expert_out).index_copy(0, by_expert, expert_out)
            expert_out = all_to_all(source_major, self.ep_group, recv_splits, send_splits)
        return torch.empty_like(expert_out).index_copy(0, order, expert_out)


def _runs(tags: torch.Tensor | None, counts: list[int]) -> list[tuple[int, ...]] | None:
    """Per local expert (its ``counts`` rows of ``tags``), the lengths of its runs of equal units (``None``: no
    tags)."""
    if tags is None:
        return None
    return [tuple(torch.unique_consecutive(chunk, return_counts=True)[1].tolist()) if chunk.numel() else ()
            for chunk in tags.split(counts)]
