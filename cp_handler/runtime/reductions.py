"""The sums over process groups a training loop makes around the loss (:mod:`cp_handler.models.loss`): the global
count of loss tokens, gradients summed over ranks in one flat all-reduce, a tensor-parallel row-wise linear's
partial sums added in one order (the deterministic mode), and a key or value projection replicated over the TP ranks
(fewer key-value heads than TP ranks), whose input gradient is summed over the TP group."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ..ops.collectives import all_gather_single, all_to_all_single


def global_token_count(loss_mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Number of loss tokens summed over ``group`` (``None``: this process only)."""
    count = loss_mask.sum().to(torch.float64)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum ``tensors`` over ``group`` (default: all ranks) in place, in one flat all-reduce."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class _SumGradOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_group(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` unchanged in the forward; its gradient summed over ``group`` in the backward (Megatron-LM's
    ``copy_to_tensor_model_parallel_region``): the output of a replicated weight each TP rank applies to its own
    heads, whose gradient each rank holds only its heads' part of."""
    return _SumGradOverGroup.apply(x, group)


def _sum_in_order(parts: torch.Tensor) -> torch.Tensor:
    """``((parts[0] + parts[1]) + parts[2]) + ...`` elementwise: one order, whatever the size of ``parts``."""
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


class _OrderedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        size = dist.get_world_size(group)
        gathered = partial.new_empty(size * partial.numel())
        all_gather_single(gathered, partial.reshape(-1), group)
        return _sum_in_order(gathered.view(size, *partial.shape))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def ordered_sum_over_group(partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over ``group`` of each rank's ``partial`` (any shape and dtype), added in group-rank order:
    ``((p0 + p1) + p2) + ...`` elementwise, the same bits on every rank and whatever the tensor's size (an
    all-reduce may add an element's partials in an order that depends on where the element falls in the buffer:
    a ring all-reduce's chunks). One all-gather of ``size x partial`` instead of an all-reduce: ``size / 2`` times its
    bytes and a ``size x`` buffer. The gradient of each rank's partial is the output's (the output is replicated:
    every rank computes the same thing from it), as a row-parallel linear's all-reduce (Megatron-LM's
    ``reduce_from_tensor_model_parallel_region``)."""
    return _OrderedSum.apply(partial, group)


class _OrderedReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, group, dim: int) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.size = group, dim, size
        chunks = torch.stack(partial.chunk(size, dim))  # (size, ...): chunk r goes to rank r
        received = torch.empty_like(chunks)
        all_to_all_single(received, chunks, group)  # received[r]: rank r's partial of this rank's chunk
        return _sum_in_order(received)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gathered = grad.new_empty(ctx.size * grad.numel())
        all_gather_single(gathered, grad.reshape(-1), ctx.group)
        return torch.cat(gathered.view(ctx.size, *grad.shape).unbind(0), ctx.dim), None, None


def ordered_reduce_scatter(partial: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Chunk ``r`` (along ``dim``, which the group's size divides) of the sum over ``group`` of each rank's
    ``partial``, on rank ``r``, added in group-rank order ``((p0 + p1) + p2) + ...``: a reduce-scatter whose bits do
    not depend on the buffer's size. One all-to-all of the chunks (the bytes of a reduce-scatter), then the sum in
    order; the backward all-gathers the gradient (a reduce-scatter's adjoint: Megatron-LM's
    ``reduce_scatter_to_sequence_parallel_region``)."""
    if partial.shape[dim] % dist.get_world_size(group):
        raise ValueError(f"ordered_reduce_scatter: dim {dim} of {tuple(partial.shape)} does not split over "
                         f"{dist.get_world_size(group)} ranks")
    return _OrderedReduceScatter.apply(partial, group, dim)


@functools.cache
def ordered_rowwise_parallel():
    """``RowwiseParallel`` whose partial sums are added in TP-rank order (the deterministic mode's row-wise style).

    PyTorch's ``RowwiseParallel`` all-reduces each token's partial products over the TP group; over more than two
    ranks an all-reduce may add them in an order that depends on the buffer's size, which the CP degree changes.
    This style adds them with :func:`~cp_handler.runtime.reductions.ordered_sum_over_group` instead (an all-gather,
    then ``((p0 + p1) + p2) + ...``), so a token's output is the same bits at every CP degree at one TP size. Its
    output: replicated (the local tensor, ``use_local_output``), or sharded along a dim (sequence parallelism's
    ``output_layouts=Shard(1)``: :func:`ordered_reduce_scatter`, local or as a DTensor); another layout is refused."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    class OrderedRowwiseParallel(RowwiseParallel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            layout = self.output_layouts[0]
            if not (layout.is_replicate() and self.use_local_output) and not layout.is_shard():
                raise ValueError(f"OrderedRowwiseParallel: output_layouts={self.output_layouts}, use_local_output="
                                 f"{self.use_local_output}: it returns the replicated local output or a Shard(dim)")

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            if not outputs.placements[0].is_partial():
                raise ValueError(f"OrderedRowwiseParallel: the output's placement is {outputs.placements}, not a "
                                 "partial sum")
            partial, group = outputs.to_local(grad_placements=(Replicate(),)), device_mesh.get_group()
            layout = output_layouts[0] if isinstance(output_layouts, tuple) else output_layouts
            if layout.is_replicate():
                return ordered_sum_over_group(partial, group)
            local = ordered_reduce_scatter(partial, group, layout.dim)
            return local if use_local_output else DTensor.from_local(local, device_mesh, (layout,), run_check=False)

    return OrderedRowwiseParallel


@functools.cache
def replicated_kv_heads():
    """The ``ReplicatedKVHeads`` style (a ``ParallelStyle`` class, built on first use; the reference GPT's plan and
    transformers' plans under TP use it, :mod:`cp_handler.training.tensor_parallel`)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    class ReplicatedKVHeads(ParallelStyle):
        """A key or value projection when ``Hkv < tp``: its weight stays whole (a plain tensor) on every TP rank, its
        output keeps the one head of ``head_dim`` columns this rank's query heads use (rank ``r``: head
        ``r // (tp / Hkv)``), and its input's gradient (each rank's from its own heads) is summed over the TP group,
        as a column-wise input's: with the block's input a replicated DTensor, as a partial sum joining the
        column-wise projections' before their one reduction."""

        def __init__(self, num_kv_heads: int, head_dim: int):
            super().__init__()
            self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            from torch.distributed.tensor import DTensor, Partial

            head = device_mesh.get_local_rank() // (device_mesh.size() // self.num_kv_heads)
            start, width, group = head * self.head_dim, self.head_dim, device_mesh.get_group()

            def local_input(_, args):
                x = args[0]
                if isinstance(x, DTensor):  # the block's replicated input (gpt_tp_plan): its gradient a partial sum,
                    x = x.to_local(grad_placements=[Partial()])  # added to the column-wise ones' before one reduction
                else:
                    x = sum_grad_over_group(x, group)
                return (x, *args[1:])

            module.register_forward_pre_hook(local_input)
            module.register_forward_hook(lambda _, args, out: out.narrow(-1, start, width))
            return module

    return ReplicatedKVHeads


def all_reduce_grads(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Sum the gradients of ``params`` over ``group`` (default: all ranks) in one flat all-reduce;
    a missing gradient counts as zero."""
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    all_reduce_flat([p.grad for p in params], group)
