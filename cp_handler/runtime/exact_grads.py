"""Exact parameter gradients: the deterministic mode's sums over tokens, the same bits at every CP degree.

A parameter's gradient is a sum over tokens. Under CP each rank sums its own tokens (inside a GEMM, in an order that
follows its token count) and the ranks' sums are all-reduced (in an order that follows the group), so the bits
follow the degree: ~1e-7 relative per step, which moves later steps' losses by an ulp (docs/deterministic.md).
Here the sum is taken in pieces that are the same at every degree, and the pieces are added **exactly**, so the
order no longer matters:

* **Pieces.** A linear layer's weight gradient is computed per *unit* (one GEMM each, ``dY_u^T X_u``): every
  document (bshd: the sequence) is cut into 48 units (16 for a bshd sequence that 48 does not divide), each inside
  one zigzag chunk at the degrees compared (:func:`unit_lengths`; thd documents are padded to multiples of 48 in the
  mode), so a unit is the same set of global tokens, and the same GEMM shape, at every degree. A bias's, an RMSNorm
  weight's (``dy * x_hat``) and an embedding row's (``dy``) pieces are single tokens.
* **Exact sums.** Each piece's float32 value is put on a fixed-point grid of ``2**-56``
  (:func:`~.fixed_point.to_fixed`: two int64 limbs of 32 bits below and the rest above, a deterministic rounding of
  the piece alone) and the limbs are added as integers: associative, so the local sums, the micro-batches, the
  index-adds of the embedding and the all-reduce over the dp x cp ranks (int64) give the same integers in any order.
  The total is rounded once to float32 (:func:`~.fixed_point.from_fixed`).

Accuracy: each piece is rounded down to ``2**-56`` (1.4e-17) absolute, the sum is exact, the result rounded once to
float32: at least as close to the exact gradient as a float32 sum, whose error grows with the number of terms.
Range: a piece must be finite with ``|x| < 2**15``, and an element may receive at most ``2**24`` pieces per step
(a larger value is counted, and every rank raises after the all-reduce: no rank hangs). Cost: two int64 limbs per
parameter element (16 bytes, beside the float32 gradient), one GEMM per unit instead of one per layer (the same
flops), the pieces' conversion and sum (one fused pass per large piece on the CPU:
:func:`~.fixed_point.fixed_sums`), one all-reduce of the limbs instead of DDP's float32 one.

Covered: ``nn.Linear``, ``nn.RMSNorm`` (with a weight), ``nn.Embedding`` (without ``max_norm``, gradient scaling by
frequency or sparse gradients) and any normalisation that ends in ``weight * x_hat`` (:func:`is_scaled_norm`, by
behaviour: the RMSNorm classes of Llama, Qwen2 and others in transformers): the reference GPT's layers and dense
Hugging Face models (:func:`uncovered` names what is not: a MoE's fused experts, Gemma's ``(1 + weight)`` norm...).
Used in the deterministic mode by cp-train's :class:`~cp_handler.training.trainer.Trainer` and by the Hugging Face
trainers (:mod:`cp_handler.integrations.hf_exact_grads`).
"""

from __future__ import annotations

import copy
import functools
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .fixed_point import MAX_PIECE, fixed_sums, from_fixed, to_fixed


def unit_parts(seq_len: int, qkv_format: str) -> int:
    """Units per document: 48 for thd packs (the mode pads every document to a multiple of 48) and for a sequence
    that 48 divides, else 16 (a function of the sequence alone, so every degree cuts the same units)."""
    return 48 if qkv_format == "thd" or seq_len % 48 == 0 else 16


def units_refusal(seq_len: int, cp_size: int, qkv_format: str) -> str | None:
    """Why a run's units cannot sit inside the zigzag chunks (``None``: they can): ``seq_len`` tokens per sequence
    (bshd: a multiple of the unit count; thd: any, documents are padded), ``cp_size`` ranks."""
    parts = unit_parts(seq_len, qkv_format)
    if (qkv_format != "thd" and seq_len % parts) or (cp_size > 1 and parts % (2 * cp_size)):
        return (f"exact parameter gradients sum a document in {parts} units, each inside one zigzag chunk (2 x cp = "
                f"{2 * cp_size} of them): not at cp {cp_size} with {qkv_format} sequences of {seq_len} tokens (48 "
                "units when 48 divides the sequence, and for thd: cp 1, 2, 3, 4, 6 or 8; else 16: a sequence that 16 "
                "divides, cp 1, 2, 4 or 8)")
    return None


def unit_lengths(handler, local_len: int) -> tuple[int, ...]:
    """Tokens of each unit of a rank's local rows, in order (module doc): every document (bshd: the sequence)
    padded to ``L`` tokens is cut into :func:`unit_parts` units of ``L / parts`` tokens, and a rank's two chunks of
    it hold ``parts / cp`` of them. The same global token sets at every CP degree.

    Args:
        handler: the micro-batch's handler (thd: its layout's ``padded_document_lengths``).
        local_len: the rank's local tokens per batch row.

    Raises:
        ValueError: :func:`units_refusal`'s reason.
    """
    cp, fmt = handler.cp_size, handler.qkv_format
    padded = list(handler.token_layout.padded_document_lengths) if fmt == "thd" else [local_len * cp]
    parts = unit_parts(sum(padded), fmt)
    if reason := units_refusal(sum(padded), cp, fmt) or (
            fmt == "thd" and any(length % parts for length in padded) and
            f"thd documents padded to {padded}: not multiples of {parts} (the deterministic mode's padding)"):
        raise ValueError(reason)
    units = tuple(length // parts for length in padded if length for _ in range(parts // cp))
    if sum(units) != local_len:
        raise ValueError(f"exact parameter gradients: units of {sum(units)} local tokens for {local_len} local rows")
    return units


def _kind(module: nn.Module):
    """How a module's parameters are summed exactly (the forward installed in the scope), or ``None``: not covered."""
    if type(module) is nn.Linear:
        return _linear
    if type(module) is nn.RMSNorm and module.weight is not None:
        return _rms_norm
    if type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq \
            and not module.sparse:
        return _embedding
    return _scaled_norm if is_scaled_norm(module) else None


def is_scaled_norm(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation followed by a scale ``weight * x_hat`` (Llama's and Qwen2's RMSNorm
    classes in transformers, T5's LayerNorm...), by behaviour: its only parameter is a 1-D ``weight`` over the last
    dim, it has no children, and on a probe input its output with a random weight is bitwise that weight times its
    output with a weight of ones (Gemma's ``(1 + weight) * x_hat`` is not: it is refused)."""
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1 or any(True for _ in module.children()):
        return False
    weight = params["weight"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, weight.shape[0], generator=g).to(weight.device)
    scale = (torch.rand(weight.shape, generator=g) + 0.5).to(weight)
    try:
        with torch.no_grad():
            scaled, plain = _with_weight(module, scale, x), _with_weight(module, torch.ones_like(weight), x)
    except Exception:  # a module that does not run on (B, S, hidden) alone: not a norm of this kind  # noqa: BLE001
        return False
    return isinstance(scaled, torch.Tensor) and scaled.shape == x.shape and torch.equal(scaled, scale * plain)


def _kinds(model: nn.Module) -> dict:
    """``{module: kind or None}`` of each module of ``model`` that holds parameters of its own (:func:`_kind`)."""
    return {module: _kind(module) for module in model.modules() if any(True for _ in module.parameters(recurse=False))}


def _uncovered(model: nn.Module, kinds: dict) -> list[str]:
    return [f"{name or '<model>'} ({type(module).__name__})" for name, module in model.named_modules()
            if module in kinds and kinds[module] is None]


def uncovered(model: nn.Module) -> list[str]:
    """``"name (class)"`` of each module of ``model`` that holds parameters of its own and is not covered (module
    doc): its gradients could not be summed exactly. Empty: every parameter is covered."""
    return _uncovered(model, _kinds(model))


class ExactGradients:
    """The exact gradient sums of ``model``'s parameters (module doc). Use as a context manager around each
    micro-batch's forward and backward: inside, the covered layers compute their parameters' pieces into the limbs
    (their ``.grad`` stays untouched); :meth:`all_reduce_` then sums the limbs over a group and writes ``.grad``.

    Args:
        model: every parameter-holding module covered (:func:`uncovered` empty).

    Set :attr:`units` (:func:`unit_lengths`) for each micro-batch before its forward (a layer's backward cuts the
    units its forward was told).

    Raises:
        ValueError: an uncovered module (named); in the backward, a linear layer's input whose rows are not whole
            units (a loss chunk of another size: ``--loss-chunk-tokens``), or no units told.
    """

    def __init__(self, model: nn.Module):
        self.kinds = _kinds(model)  # probed once
        if missing := _uncovered(model, self.kinds):
            raise ValueError(f"exact parameter gradients cover nn.Linear, nn.RMSNorm, nn.Embedding and norms ending "
                             f"in a scale (is_scaled_norm); {missing} hold parameters of their own")
        self.model, self.units, self.patched = model, None, []
        self.params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))  # tied: once
        self.limbs = {p: None for p in self.params}
        self.bad = 0  # pieces out of range (a tensor once one was checked)

    # --- accumulation ----------------------------------------------------------------------------------------------

    def _limbs(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.limbs[param] is None:
            self.limbs[param] = tuple(torch.zeros(param.shape, dtype=torch.int64, device=param.device) for _ in "hl")
        return self.limbs[param]

    def add_(self, param: torch.Tensor, piece: torch.Tensor) -> None:
        """Add one piece (``param``'s shape) to ``param``'s sum."""
        self.add_rows_(param, piece.unsqueeze(0))

    def add_rows_(self, param: torch.Tensor, pieces: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """Add pieces ``(N, *row)`` into ``param``'s rows ``index (N,)`` (``None``: each piece is ``param``'s shape,
        all summed); elements out of range counted (NaN too)."""
        limbs = self._limbs(param)
        if index is None:
            hi, lo, bad = fixed_sums(pieces)
            for acc, part in zip(limbs, (hi, lo), strict=True):
                acc.add_(part)
        else:
            bad = (~(pieces.abs() < MAX_PIECE)).sum()
            for acc, part in zip(limbs, to_fixed(pieces), strict=True):
                acc.index_add_(0, index, part)
        self.bad = self.bad + bad

    # --- the layers --------------------------------------------------------------------------------------------------

    def __enter__(self) -> ExactGradients:
        self.patched = []
        for name, module in self.model.named_modules():
            kind = self.kinds.get(module)
            if kind is None:
                continue
            if "forward" in vars(module):
                self.__exit__()
                raise ValueError(f"exact parameter gradients: {name} ({type(module).__name__}) already has a forward "
                                 "of its own (an instance attribute); its gradient pieces cannot be taken")
            module.forward = functools.partial(kind, module, self)  # an instance attribute: __exit__ drops it
            self.patched.append((module, module.forward))
        return self

    def __exit__(self, *exc) -> None:
        for module, forward in self.patched:
            if vars(module).get("forward") is forward:  # another hand may have replaced it (transformers' kernelize
                del module.forward  # at train() / eval()): then its weight's autograd gradient is named in all_reduce_
        self.patched = []

    # --- the reduction -----------------------------------------------------------------------------------------------

    def all_reduce_(self, group: dist.ProcessGroup | None = None, experts: set[int] | None = None,
                    expert_group: dist.ProcessGroup | None = None) -> None:
        """Sum the limbs over ``group`` (``None``: this process alone) as int64, write each parameter's ``.grad``
        (float32, the same bits on every rank and at every degree whose units are the same) and clear the limbs.
        ``experts``: ``id`` of the parameters of sharded experts, summed over ``expert_group`` instead (the ranks
        holding the same experts; every rank of ``group`` must take part, with its own experts).

        Raises:
            FloatingPointError: some piece was not finite or above :data:`MAX_PIECE` on some rank (every rank
                raises, after the all-reduce).
            RuntimeError: some parameter received a gradient from autograd (``.grad`` set: a computation that used
                its weight outside the covered layers' forwards, whose sum would be dropped); named, every rank
                raises after the all-reduce.
        """
        experts = experts or set()
        dense = [p for p in self.params if id(p) not in experts]
        sharded = [p for p in self.params if id(p) in experts]
        leaked = [name for name, p in self.model.named_parameters() if p.grad is not None]
        flags = torch.as_tensor([self.bad, len(leaked)], dtype=torch.int64, device=self.params[0].device)
        buffer = torch.cat([*(self._limbs(p)[i].flatten() for p in dense for i in (0, 1)), flags])
        if group is not None:
            dist.all_reduce(buffer, group=group)
        if sharded:
            expert_buffer = torch.cat([self._limbs(p)[i].flatten() for p in sharded for i in (0, 1)])
            if expert_group is not None:
                dist.all_reduce(expert_buffer, group=expert_group)
        if buffer[-1].item():
            raise RuntimeError(f"exact parameter gradients: parameters received gradients outside the covered layers' "
                               f"pieces (here: {leaked or 'none; on another rank'}): their weights were used by "
                               "another computation, whose gradient the exact sums would drop; the step stops before "
                               "the optimizer step")
        if buffer[-2].item():
            raise FloatingPointError(f"exact parameter gradients: {buffer[-2].item()} gradient pieces were not finite "
                                     f"or reached {MAX_PIECE:g} (the fixed-point range); the step stops before the "
                                     "optimizer step")
        for params, summed in ((dense, buffer), (sharded, expert_buffer if sharded else None)):
            offset = 0
            for p in params:
                n = p.numel()
                hi, lo = summed[offset:offset + n], summed[offset + n:offset + 2 * n]
                p.grad = from_fixed(hi, lo, p.dtype).view(p.shape)
                offset += 2 * n
        self.limbs = {p: None for p in self.params}
        self.bad = 0


def _linear(module: nn.Linear, sums: ExactGradients, x: torch.Tensor) -> torch.Tensor:
    return _ExactLinear.apply(x, module.weight, module.bias, sums)


def _rms_norm(module: nn.RMSNorm, sums: ExactGradients, x: torch.Tensor) -> torch.Tensor:
    x_hat = F.rms_norm(x, module.normalized_shape, None, module.eps)
    return _ExactScale.apply(x_hat, module.weight, sums)


def _with_weight(module: nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``module``'s class forward on ``x`` with ``weight`` in place of its own (a shallow copy holds it: the module
    and its instance forward, if the scope installed one, are left alone)."""
    proxy = copy.copy(module)
    proxy._parameters = {**module._parameters, "weight": weight}
    return type(module).forward(proxy, x)


def _scaled_norm(module: nn.Module, sums: ExactGradients, x: torch.Tensor) -> torch.Tensor:
    x_hat = _with_weight(module, torch.ones_like(module.weight), x)  # ones * x_hat: x_hat's values
    return _ExactScale.apply(x_hat, module.weight, sums)


def _embedding(module: nn.Embedding, sums: ExactGradients, ids: torch.Tensor) -> torch.Tensor:
    return _ExactEmbedding.apply(ids, module.weight, module.padding_idx, sums)


class _ExactLinear(torch.autograd.Function):
    """``F.linear``; backward: the input's gradient as autograd's, the weight's per unit into the sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, sums):
        ctx.save_for_backward(x)
        ctx.sums, ctx.weight, ctx.bias, ctx.units = sums, weight, bias, sums.units
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (x,), weight, bias = ctx.saved_tensors, ctx.weight, ctx.bias
        rows_x, rows_g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        if weight.requires_grad:
            for rows in unit_slices(ctx.units, rows_x.shape[0]):
                ctx.sums.add_(weight, rows_g[rows].t().mm(rows_x[rows]))
        if bias is not None and bias.requires_grad:
            ctx.sums.add_rows_(bias, rows_g)
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


def unit_slices(units: tuple[int, ...] | None, rows: int) -> list[slice]:
    """The units of ``rows`` rows of a batch's tokens flattened (a linear layer's input): every local row of the batch
    (``B`` batch rows of the units), or, when the units are all alike (bshd), any whole number of them (a loss
    chunk); none for no rows (an expert that received no token). Raises ValueError when the rows are not whole
    units, or no units were told (``None``)."""
    if rows == 0:
        return []
    if units is None:
        raise ValueError("exact parameter gradients: a layer ran a forward with gradients before the batch's units "
                         "were told (ExactGradients.units = unit_lengths(handler, local_len))")
    local = sum(units)
    if rows % local == 0:
        lengths = units * (rows // local)
    elif len(set(units)) == 1 and rows % units[0] == 0:
        lengths = units[:1] * (rows // units[0])
    else:
        raise ValueError(f"exact parameter gradients: a linear layer's input of {rows} rows is not whole units of "
                         f"this batch ({local} local tokens; units of {sorted(set(units))}): a loss chunk of another "
                         f"size? (cp-train --loss-chunk-tokens: a multiple of {units[0]}, or 0)")
    ends = [0, *itertools.accumulate(lengths)]
    return [slice(a, b) for a, b in zip(ends, ends[1:], strict=False)]


class _ExactScale(torch.autograd.Function):
    """``x_hat * weight`` (an RMSNorm's scale); backward: ``dy * weight`` for ``x_hat`` (in its dtype), ``dy * x_hat``
    per token into the sums for the weight. The parameters are held as attributes, not saved tensors: they are the
    sums' keys, and a saved-tensor hook (activation offloading, as TRL's) unpacks copies."""

    @staticmethod
    def forward(ctx, x_hat, weight, sums):
        ctx.save_for_backward(x_hat)
        ctx.sums, ctx.weight = sums, weight
        return x_hat * weight

    @staticmethod
    def backward(ctx, grad):
        (x_hat,), weight = ctx.saved_tensors, ctx.weight
        if weight.requires_grad:
            ctx.sums.add_rows_(weight, (grad * x_hat).reshape(-1, *weight.shape))
        return (grad * weight).to(x_hat.dtype), None, None


class _ExactEmbedding(torch.autograd.Function):
    """``F.embedding``; backward: each token's output gradient into its row of the sums."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, sums):
        ctx.save_for_backward(ids)
        ctx.sums, ctx.weight, ctx.padding_idx = sums, weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        ids, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # as F.embedding: the padding row receives no gradient
            keep = ids != (ctx.padding_idx % ctx.weight.shape[0])
            ids, rows = ids[keep], rows[keep]
        ctx.sums.add_rows_(ctx.weight, rows, ids)
        return None, None, None, None


