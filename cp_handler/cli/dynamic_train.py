"""Dynamic CP in ``cp-train``: per global batch, schedule the documents onto aligned CP groups
(:mod:`cp_handler.dynamic`), run each pack of this rank's group in every micro-batch on a handler
of that group, and reduce gradients once over all DP x CP ranks. The loss is normalised by the global batch's loss
tokens (every document's length - 1, known from the schedule on every rank), so each token weighs
the same whatever group it ran on. Ranks with an empty micro-batch skip it (their whole group is
empty) and still take part in the gradient reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..dynamic import GroupPool, schedule_sequences
from ..training import all_reduce_grads, masked_token_loss_sum, next_token_batch
from .data import DocumentBatches, collect_files, read_token_stream


def load_documents(args) -> DocumentBatches:
    stream, doc_starts = read_token_stream(collect_files(args.data), args.max_corpus_bytes)
    return DocumentBatches(stream, doc_starts, args.seq_len, args.seed)


def _pack(docs: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([d.numel() for d in docs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32)
    return torch.cat(docs).view(1, -1).to(device), cu.to(device)


def _loss_share(model, handler, tokens, total_loss_tokens: int) -> torch.Tensor:
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    loss = masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask) / total_loss_tokens
    loss.backward()
    return loss.detach()


def dynamic_step(model, args, documents: DocumentBatches, pool: GroupPool, handler_cls, comm_type, device):
    rank, world = dist.get_rank(), dist.get_world_size()

    def run(step: int):
        docs = documents.global_batch(step, args.batch_size * world)
        lengths = [d.numel() for d in docs]
        schedule = schedule_sequences(lengths, world, args.max_seqlen_per_rank, args.min_cp_size,
                                      max_dynamic_context_parallel_size=getattr(args, "max_cp_size", None))
        total = sum(n - 1 for n in lengths)
        loss = torch.zeros((), dtype=torch.float64, device=device)
        for group in schedule.for_rank(rank):
            for pack in group.packs:  # one forward/backward per pack, inside this rank's group
                tokens, cu = _pack([docs[i] for i in pack], device)
                handler = handler_cls(cp_group=pool.group(group.size, group.first), qkv_format="thd", cu_seqlens=cu,
                                      cp_comm_type=comm_type)
                loss += _loss_share(model, handler, tokens, total)
        all_reduce_grads(list(model.parameters()))
        return loss, sum(lengths)
    return run


def reference_dynamic_step(model, args, documents: DocumentBatches, handler_cls, device):
    """The same global batches on one process: all documents in one thd pack at cp=1."""
    world = dist.get_world_size()

    def run(step: int):
        docs = documents.global_batch(step, args.batch_size * world)
        tokens, cu = _pack(docs, device)
        handler = handler_cls(cp_group=None, qkv_format="thd", cu_seqlens=cu)
        return _loss_share(model, handler, tokens, sum(d.numel() - 1 for d in docs)), tokens.numel()
    return run
