"""Evaluation at another CP degree than training (e.g. wide CP for a small held-out set).

Because handlers are built per batch, evaluating at another degree is only building handlers on
other groups: :meth:`EvalContextParallel.build` makes the evaluation CP and DP groups once (every
rank calls it), :meth:`EvalContextParallel.evaluate` runs a model on held-out batches with handlers
on them. Nothing in the model or its config is touched: the model's train/eval mode and the RNG
states are restored when evaluation ends, also when it raises, so training resumes bit-identically.
Everything position-dependent (rotary table length, layouts) comes from the live handler.

Evaluation is data-parallel over the evaluation DP replicas: sequence ``i`` of a batch goes to
replica ``i % dp`` (strided, so each held-out sequence is evaluated exactly once), and the loss is
token-weighted over all ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..handlers import build_cp_handler
from ..models.loss import TokenLoss, next_token_batch
from ..runtime.config import AttentionShape, ContextParallelConfig, check_seq_len
from ..runtime.groups import DataContextParallelGroups, build_dp_cp_groups, check_world_divisible


def eval_config(train: ContextParallelConfig, eval_context_parallel_size: int,
                hierarchical_context_parallel_sizes: list[int] | None = None) -> ContextParallelConfig:
    """The evaluation CP config: training's comm type and backend at another size. Hierarchical sizes
    are taken from the argument, else from training when their product is the evaluation size.

    Raises:
        ValueError: invalid size, or ``a2a+p2p`` without hierarchical sizes for this size.
    """
    sizes = hierarchical_context_parallel_sizes
    train_sizes = train.hierarchical_context_parallel_sizes
    if sizes is None and train_sizes and math.prod(train_sizes) == eval_context_parallel_size:
        sizes = list(train_sizes)
    return ContextParallelConfig(context_parallel_size=eval_context_parallel_size, cp_comm_type=train.cp_comm_type,
                                 hierarchical_context_parallel_sizes=sizes, backend=train.backend,
                                 qkv_format=train.qkv_format, num_layers=train.num_layers,
                                 deterministic=train.deterministic)


def check_eval_layout(world_size: int, config: ContextParallelConfig, seq_len: int) -> None:
    """Raises ValueError unless the evaluation CP size divides the world and ``seq_len`` (bshd/sbhd:
    by ``2 * cp``)."""
    check_world_divisible(world_size, config.context_parallel_size)
    check_seq_len(seq_len, config.context_parallel_size, config.qkv_format)


@contextlib.contextmanager
def preserved_training_state(model: torch.nn.Module):
    """Evaluation mode, no autograd, RNG states saved; all restored on exit, also on error."""
    was_training = model.training
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@dataclass
class EvalContextParallel:
    """Groups and config of evaluation at one CP degree."""

    groups: DataContextParallelGroups
    config: ContextParallelConfig
    attn_shape: AttentionShape | None = None

    @classmethod
    def build(cls, config: ContextParallelConfig, device_type: str = "cpu",
              attn_shape: AttentionShape | None = None) -> EvalContextParallel:
        """Build the evaluation (dp, cp) groups once; every rank must call it.

        Raises:
            ValueError: the CP size does not divide the world size (before any collective).
        """
        check_world_divisible(dist.get_world_size(), config.context_parallel_size)
        groups = build_dp_cp_groups(config.context_parallel_size, device_type,
                                    config.hierarchical_context_parallel_sizes)
        return cls(groups, config, attn_shape)

    def handler(self, **batch_metadata):
        """A handler on the evaluation groups for one batch (``qkv_format``, ``cu_seqlens``, ...)."""
        return build_cp_handler(self.config, self.groups.cp_group, self.groups.hierarchical_cp_groups,
                                self.attn_shape, **batch_metadata)

    def my_rows(self, num_sequences: int) -> list[int]:
        """Sequences of a batch that this rank's DP replica evaluates (``i % dp == dp_rank``)."""
        return list(range(self.groups.dp_rank, num_sequences, self.groups.dp_size))

    def evaluate(self, model: torch.nn.Module, batches: Iterable, handler_inputs, loss_chunks=None) -> float:
        """Token-weighted mean loss of ``model`` over ``batches``, every sequence evaluated once.

        Args:
            model: the (possibly DDP-wrapped) model; only its forward is used.
            batches: global batches (the same on every rank); each must support ``rows(list)``.
            handler_inputs: ``f(batch_rows) -> (tokens (B, S) or (1, T), handler metadata dict)``.
            loss_chunks: ``None``: the model's logits, then the loss. Else ``input_ids -> tokens per loss chunk``
                (``None``: whole), and the model computes the loss sum itself from ``labels`` / ``loss_mask`` /
                ``loss_chunk_tokens`` (:class:`~cp_handler.models.GPTModel`,
                :class:`~cp_handler.integrations.transformers.CPCausalLM`): a rank's whole logits never exist.

        Raises:
            whatever the model raises; the training state is restored first.
        """
        module = getattr(model, "module", model)
        device = next(module.parameters()).device
        total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
        with preserved_training_state(module):
            for batch in batches:
                rows = self.my_rows(len(batch))
                if not rows:
                    continue
                tokens, metadata = handler_inputs(batch.rows(rows))
                handler = self.handler(**metadata)
                input_ids, labels, loss_mask = next_token_batch(handler, tokens)
                chunk = None if loss_chunks is None else loss_chunks(input_ids)
                loss_sum = module(input_ids, cp_handler=handler, output=TokenLoss(labels, loss_mask, chunk))
                total[0] += loss_sum.double()
                total[1] += loss_mask.sum().double()
        dist.all_reduce(total)
        return (total[0] / total[1]).item()
