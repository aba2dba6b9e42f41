"""One training step's forward and backward: at a fixed CP layout, with dynamic CP, and the
single-process reference of ``--check-parity`` (:mod:`.reference`).

A step's micro-batches come from :class:`StaticBatches` or :class:`DynamicBatches` (``parts(step)``: global
batch ``step``, drawn the same on every rank, :mod:`.data`, sharded by handlers) and run through
:func:`forward_backward`, which returns this rank's share of the global batch's loss (the shares sum to it); the
trainer (:mod:`.trainer`) reduces the gradients.

Dynamic CP (:class:`DynamicBatches`): per global batch, the documents are scheduled onto aligned CP
groups (:mod:`cp_handler.dynamic`); each pack of this rank's group runs on a handler of that group,
and gradients are reduced once over all ranks. The loss is normalised by the global batch's loss
tokens (every document's length - 1, known from the schedule on every rank), so each token weighs the
same whatever group it ran on. Ranks with an empty micro-batch skip it and still join the reduction.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist

from ..auto.catalog import default_profile, load_profile
from ..auto.hold import hold_for
from ..auto.workload import PatternWorkload
from ..dynamic import GroupPool, schedule_sequences
from ..handlers import build_cp_handler
from ..models.loss import TokenLoss, loss_chunk_tokens, next_token_batch
from ..runtime.config import AUTO
from ..runtime.exact_grads import ExactGradients, unit_lengths
from ..runtime.reductions import global_token_count
from .config import TrainConfig
from .data import Batch, DocumentBatches, SequenceBatches, collect_files, read_token_stream
from .experts import ExpertGroups
from .fsdp import is_sharded
from .reference import PlainAttention, next_token_loss, predicted_tokens
from .tokens import tokens_for


def token_stream(config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's tokens (bytes, or the Hugging Face model folder's tokenizer) and document starts."""
    return read_token_stream(collect_files(config.data), config.max_corpus_bytes, tokens_for(config.hf_source))


def load_batches(config: TrainConfig) -> SequenceBatches:
    """The corpus cut into ``seq_len`` sequences (thd: documents of at most ``thd_max_doc_len``)."""
    stream, doc_starts = token_stream(config)
    max_doc_len = (config.thd_max_doc_len or max(1, config.seq_len // 4)) if config.packing == "thd" else None
    return SequenceBatches(stream, doc_starts, config.seq_len, config.seed, max_doc_len=max_doc_len)


def load_documents(config: TrainConfig) -> DocumentBatches:
    """The corpus as whole documents cut at ``seq_len`` (dynamic CP)."""
    stream, doc_starts = token_stream(config)
    return DocumentBatches(stream, doc_starts, config.seq_len, config.seed)


def handler_inputs(batch: Batch, packing: str, device) -> tuple[torch.Tensor, dict]:
    """Global tokens of a batch's rows and the handler's batch metadata (thd: ``cu_seqlens``)."""
    if packing == "thd":
        tokens, cu_seqlens = batch.packed()
        return tokens.to(device), {"qkv_format": "thd", "cu_seqlens": cu_seqlens.to(device)}
    return batch.tokens.to(device), {"qkv_format": "bshd"}


def micro_batch_rows(config: TrainConfig, dp_size: int, index: int) -> list[int]:
    """Rows of the global batch in micro-batch ``index`` over all data-parallel replicas (replica ``r``
    holds rows ``[r * batch_size, (r + 1) * batch_size)`` and runs them ``micro_batch_size`` at a time)."""
    micro = config.micro_batch_size or config.batch_size
    return [r * config.batch_size + index * micro + j for r in range(dp_size) for j in range(micro)]


class StaticBatches:
    """A fixed CP layout's micro-batches (:meth:`parts`): this DP replica's rows of the global batch on ``groups`` (a
    :class:`~cp_handler.runtime.groups.DataContextParallelGroups`), ``config.micro_batches`` of them, each sharded
    over the CP group by its own handler."""

    def __init__(self, config: TrainConfig, batches: SequenceBatches, groups, global_batch: int, count_group, device):
        self.config, self.batches, self.groups, self.global_batch = config, batches, groups, global_batch
        self.count_group, self.device = count_group, device
        self.hold = hold_for(config.cp)

    def parts(self, step: int) -> tuple[list[tuple], torch.Tensor, int]:
        """``(parts, loss tokens, tokens)`` of global batch ``step``: each part ``(handler, input_ids, labels,
        loss_mask)``; the loss tokens counted over every micro-batch and ``count_group`` (one all-reduce) before
        any forward, so each token weighs the same; the global batch's tokens."""
        config, groups = self.config, self.groups
        batch = self.batches.global_batch(step, self.global_batch)
        parts = []
        for index in range(config.micro_batches):
            rows = [r for r in micro_batch_rows(config, groups.dp_size, index)
                    if r // config.batch_size == groups.dp_rank]
            tokens, metadata = handler_inputs(batch.rows(rows), config.packing, self.device)
            handler = build_cp_handler(config.cp, groups.cp_group, groups.hierarchical_cp_groups, config.attn_shape,
                                       **metadata, **self.hold)
            parts.append((handler, *next_token_batch(handler, tokens)))
        total = global_token_count(torch.cat([mask.flatten() for *_, mask in parts]), self.count_group)
        return parts, total, self.global_batch * config.seq_len


def forward_backward(model, parts, total, config: TrainConfig, device, grad_scale: float = 1.0,
                     experts: ExpertGroups | None = None, exact: ExactGradients | None = None) -> torch.Tensor:
    """The forward and backward of a step's ``parts`` (:meth:`StaticBatches.parts`, :meth:`DynamicBatches.parts`):
    each part's loss divided by the step's ``total`` loss tokens, its backward scaled by ``grad_scale`` (DDP and
    FSDP2 average gradients over the world: the world size); gradients synchronised after the last part only
    (:func:`gradient_sync`). MoE models add each micro-batch's load-balancing loss divided by the number of parts
    (Megatron-LM's convention). Returns this rank's share of the step's loss (float64, detached; zero on ``device``
    for a rank without parts); in the deterministic mode (``config.cp.deterministic``) every rank of a CP group holds
    the group's whole loss, summed in one order (:func:`~cp_handler.models.loss.canonical_loss_sum`; its backward
    gives each rank its own tokens' gradient, as without the mode). ``exact``: the mode's exact parameter gradients
    (:mod:`~cp_handler.runtime.exact_grads`, entered by the caller), told each micro-batch's units."""
    chunk_of = loss_chunks(model, config)
    loss = None
    parts = list(parts) if experts else parts  # the load-balancing losses are averaged over the parts
    pending = iter(parts)
    current = next(pending, None)
    while current is not None:
        following = next(pending, None)  # parts may be built lazily (dynamic CP): one looked ahead
        handler, input_ids, labels, loss_mask = current
        if exact is not None:
            exact.units = unit_lengths(handler, input_ids.shape[1])
        with gradient_sync(model, following is None), activations_kept(config):
            moe = experts.handler(handler, exact) if experts else None
            canonical = handler if config.cp.deterministic else None  # the group's whole sum, in one order
            share = model(input_ids, cp_handler=handler, moe_handler=moe,
                          output=TokenLoss(labels, loss_mask, chunk_of(input_ids), canonical)) / total
            if moe:
                share = share + sum(moe.aux_losses) / len(parts)
            (share * grad_scale).backward()
        loss = share.detach().double() if loss is None else loss + share.detach().double()
        current = following
    return loss if loss is not None else torch.zeros((), dtype=torch.float64, device=device)


def activations_kept(config: TrainConfig):
    """Where the forward's saved activations live: pinned host memory with ``--offload-activations`` (each copied
    back for its backward: the same values), else where they were computed."""
    if config.offload_activations:
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def gradient_sync(model, last: bool):
    """A micro-batch's context: gradients reduced after the last one only (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(last)  # reduce-scatter after the last micro-batch only
        return contextlib.nullcontext()
    return contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()


def loss_chunks(model, config: TrainConfig):
    """``input_ids -> tokens per loss chunk`` (``None``: the whole loss) for ``model`` (possibly DDP-wrapped)."""
    vocab = getattr(model, "module", model).vocab_size
    return lambda input_ids: loss_chunk_tokens(config.loss_chunk_tokens, input_ids.numel(), vocab)


def _pack(docs: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([d.numel() for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    return torch.cat(docs).view(1, -1).to(device), cu.to(device)


def auto_workload(config: TrainConfig, device: torch.device) -> PatternWorkload | None:
    """Dynamic CP's workload under ``cp_comm_type="auto"``: sizes and patterns from the cost profile
    (:class:`~cp_handler.auto.workload.PatternWorkload`); ``None`` otherwise (``L^2 / cp``)."""
    shape = config.attn_shape
    if AUTO not in config.cp.comm_types or shape is None:
        return None
    profile = load_profile(config.cp.cp_comm_profile) if config.cp.cp_comm_profile else default_profile(device.type)
    return PatternWorkload(profile, config.dtype, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                           shape.v_head_dim or shape.head_dim, getattr(torch, config.dtype).itemsize,
                           layers=config.cp.num_layers or 1)


class DynamicBatches:
    """Dynamic CP's micro-batches (module doc, :meth:`parts`): every rank holds a full model; with
    ``cp_comm_type="auto"`` the cost profile chooses each document's group size and each pack's pattern."""

    def __init__(self, config: TrainConfig, documents: DocumentBatches, pool: GroupPool, device):
        self.config, self.documents, self.pool, self.device = config, documents, pool, device
        self.workload = auto_workload(config, torch.device(device))
        self.hold = hold_for(config.cp)

    def parts(self, step: int):
        """``(parts, loss tokens, tokens)`` of global batch ``step``: the parts (one per pack of this rank's groups,
        built as they are consumed: each pack's handler on its group) and the loss tokens of the whole global batch
        (every document's length - 1, the same on every rank)."""
        config, rank, world = self.config, dist.get_rank(), dist.get_world_size()
        docs = self.documents.global_batch(step, config.batch_size * world)
        lengths = [d.numel() for d in docs]
        schedule = schedule_sequences(lengths, world, config.dynamic.max_seqlen_per_rank, config.dynamic.min_cp_size,
                                      self.workload, max_dynamic_context_parallel_size=config.dynamic.max_cp_size)
        self.pool.prepare(schedule)  # every rank the same schedule: the same new groups, in the same order

        def packs():
            for group in schedule.for_rank(rank):
                for pack in group.packs:  # one forward/backward per pack, inside this rank's group
                    tokens, cu = _pack([docs[i] for i in pack], self.device)
                    handler = build_cp_handler(config.cp, self.pool.group(group.size, group.first),
                                               attn_shape=config.attn_shape, qkv_format="thd", cu_seqlens=cu,
                                               **self.hold)
                    yield (handler, *next_token_batch(handler, tokens))

        return packs(), sum(n - 1 for n in lengths), sum(lengths)


def reference_step(model, config: TrainConfig, logits_of, source, global_batch: int | None = None):
    """``--check-parity``: the whole global batch of every step on one process through ``logits_of
    (model, tokens, cu_seqlens, moe_handler) -> logits`` (:mod:`.reference`: no cp_handler code);
    ``source``: the run's batches (:func:`load_batches`), or for dynamic CP its documents
    (:func:`load_documents`), run as one pack. With micro-batches, one forward per global micro-batch
    (:func:`micro_batch_rows`), each token weighted the same, MoE load-balancing losses averaged."""
    device = next(model.parameters()).device
    experts = ExpertGroups.local(config.moe_experts) if config.moe_experts else None

    def run(step: int):
        if config.dynamic:
            tokens, cu = _pack(source.global_batch(step, config.batch_size * dist.get_world_size()), device)
            parts = [(tokens, cu)]
        else:
            batch = source.global_batch(step, global_batch)
            rows = [micro_batch_rows(config, global_batch // config.batch_size, i) for i in range(config.micro_batches)]
            parts = [handler_inputs(batch.rows(index), config.packing, device) for index in rows]
            parts = [(tokens, metadata.get("cu_seqlens")) for tokens, metadata in parts]
        counts = [predicted_tokens(tokens, cu) for tokens, cu in parts]
        loss = 0.0
        for (tokens, cu), count in zip(parts, counts, strict=True):  # one part: weight 1.0, aux / 1 (exact)
            moe = experts.handler() if experts else None
            share = next_token_loss(logits_of(model, tokens, cu, moe), tokens, cu) * (count / sum(counts))
            share = share + (sum(moe.aux_losses) / len(parts) if moe else 0.0)
            share.backward()
            loss = loss + share.detach()
        return loss, sum(tokens.numel() for tokens, _ in parts)
    return run


def twin_step(model, config: TrainConfig, source, global_batch: int):
    """``--check-parity`` in the deterministic mode with exact gradients (dp 1): the step's global batch on one
    process through the mode itself (a deterministic handler at cp 1, the same micro-batches, the loss summed in one
    order, the gradients summed exactly), whose loss and every gradient must be the CP run's bits. ``run(step) ->
    loss`` (float64, the gradients left in ``model``'s ``.grad``)."""
    device = next(model.parameters()).device
    one = dataclasses.replace(config.cp, context_parallel_size=1)
    exact = ExactGradients(model)
    experts = ExpertGroups.local(config.moe_experts) if config.moe_experts else None  # every expert here

    def run(step: int) -> torch.Tensor:
        batch = source.global_batch(step, global_batch)
        parts = []
        for index in range(config.micro_batches):
            tokens, metadata = handler_inputs(batch.rows(micro_batch_rows(config, 1, index)), config.packing, device)
            handler = build_cp_handler(one, None, None, config.attn_shape, **metadata)
            parts.append((handler, *next_token_batch(handler, tokens)))
        total = global_token_count(torch.cat([mask.flatten() for *_, mask in parts]), None)
        with exact:
            loss = forward_backward(model, parts, total, config, device, experts=experts, exact=exact)
        exact.all_reduce_()
        return loss
    return run


def gpt_logits(model, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None, moe_handler) -> torch.Tensor:
    """The reference GPT on the whole batch with :class:`~.reference.PlainAttention`."""
    return model(tokens, cp_handler=PlainAttention(cu_seqlens), moe_handler=moe_handler)
