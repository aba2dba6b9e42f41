"""TRL's fused LM head under context parallelism: a whole batch in, TRL's per-token outputs out, the forward on this
rank's shard.

TRL's RL and preference trainers (GRPO, RLOO, DPO) score sequences with ``model(input_ids, attention_mask,
labels=labels, fused_lm_head=True)`` (``trl.trainer.utils.add_fused_lm_head``): the log-probability of every next-token
label ``(B, S - 1)`` (and its entropy), computed by TRL's ``ChunkedLogProbFunction`` in tiles of 4096 tokens x 32768
vocabulary entries, recomputed in the backward: the ``(B, S, V)`` logits never exist. :func:`install_cp_fused_head`
wraps that forward so that the same call, made with the same batch on every rank of a CP group:

1. checks the batch: only the keys below (others are refused by name), each row's real tokens contiguous (TRL's
   prompts are left-padded, its completions right-padded), no label predicted from a padding position; and that every
   rank of the group holds the same batch (a fingerprint all-gathered: ranks that sampled different completions are
   refused, never mixed);
2. flushes each row left: the labels are shifted in the row's global order first, then the row's real tokens moved
   to slots ``0..n-1``, so right padding is all that remains (exact under causal attention and causal mixers);
3. shards the rows (:func:`.hf_batch.shard_batch`, bshd) and runs TRL's fused forward on the shard with the global
   ``shift_labels`` (TRL scores pre-shifted labels without shifting again), the positions TRL's own forward gives
   each token (its index in the left-padded row, the row's left padding added to the layout's positions; or, for a
   model that derives positions from the mask, from 0 at the first real token: :func:`left_padding_positions` finds
   which on the model, once), and the largest position of TRL's forward for RoPE that reads the length
   (:meth:`~cp_handler.handlers.token_layout.TokenLayout.set_max_position`);
4. combines the per-token outputs over the CP group (an all-gather) and puts them back in the rows' original places,
   zero where TRL's are; ``loss`` is TRL's formula over the whole rows.

**Gradients.** The loss a trainer builds from the combined outputs is the same on every rank of the group; each
rank's backward keeps the gradient of its own tokens (the all-gather's adjoint), multiplied by ``cp``: the
gradients of a group then sum to ``cp`` times one process's, and DDP's average over the dp x cp ranks is the
average over dp, as without CP (with the deterministic mode's exact sums the gradient is left unscaled and the sums
are divided by dp: :mod:`.hf_exact_grads`). The MoE load-balancing loss (which TRL's head adds from the router
logits) takes the same convention: the batch's value on every rank, ``cp`` times this rank's share as gradient
(:mod:`.hf_router_loss`, ``"replicated"``).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime.config import ContextParallelConfig
from .hf_active import forward_scope, forward_state
from .hf_batch import IGNORE_INDEX, shard_batch
from .hf_inputs import text_config
from .hf_router_loss import RouterLossScope
from .transformers import own_attention

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""TRL's per-token outputs (``FusedCausalLMOutput``) combined over the CP group (those TRL computed)."""
ACCEPTED = frozenset(("input_ids", "attention_mask", "labels", "shift_labels", "num_items_in_batch", "use_cache",
                      "output_router_logits"))
"""The keyword arguments of a fused-head call under CP; any other (a vision input, ``position_ids``) is refused."""


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``scale`` (module doc, Gradients)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def install_cp_fused_head(model: torch.nn.Module, config: ContextParallelConfig, cp_group=None,
                          hierarchical_cp_groups=None, row_positions: bool = True, exact=None) -> None:
    """Wrap the fused LM head TRL added to ``model`` (idempotent): a call with ``fused_lm_head=True`` runs on this
    rank's shard (module doc); any other call (generation, a plain forward) is TRL's unchanged. ``row_positions``:
    how the model's own forward places left-padded tokens (:func:`left_padding_positions`). ``exact``: the trainer's
    exact gradients of ``model`` (:class:`~.hf_exact_grads.TrainerExactGradients`), told each shard's units.

    Raises:
        ValueError: ``model`` has no TRL fused LM head (``trl.trainer.utils.add_fused_lm_head`` was not applied).
    """
    forward = model.forward
    function = getattr(forward, "__func__", None)
    if getattr(function, "_cp_fused_head", False):
        return
    if function is None or "fused_lm_head" not in function.__code__.co_varnames:
        raise ValueError(f"{type(model).__name__}.forward is not TRL's fused LM head (add_fused_lm_head): nothing to "
                         "run under context parallelism")

    @functools.wraps(function)
    def cp_fused_forward(self, *args, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return forward(*args, **kwargs)
        if forward_state().fused_head_on_shard:  # the shard's call, through the model's hooks (guard, recomputation)
            return forward(*args, fused_lm_head=True, **kwargs)
        return fused_forward_on_shards(self, config, cp_group, hierarchical_cp_groups, args, kwargs, row_positions,
                                       exact)

    cp_fused_forward._cp_fused_head = True
    model.forward = types.MethodType(cp_fused_forward, model)


def row_extents(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, length)`` int64 ``(B,)``: each row's first real token and its number of real tokens.

    Raises:
        ValueError: a mask value other than 0 / 1, or a row whose real tokens are not contiguous (padding between
            them: only left and right padding are exact here).
    """
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask holds values other than 0 and 1; refused under context parallelism")
    mask = attention_mask.long()
    length = mask.sum(1)
    first = torch.where(length > 0, mask.argmax(1), 0)
    span = torch.arange(mask.shape[1], device=mask.device)
    inside = (span >= first[:, None]) & (span < (first + length)[:, None])
    if not torch.equal(inside.long(), mask):
        rows = (inside.long() != mask).any(1).nonzero().flatten().tolist()
        raise ValueError(f"attention_mask rows {rows} have padding between real tokens: only left and right padding "
                         "are implemented under context parallelism")
    return first, length


def check_same_batch(group, *tensors: torch.Tensor) -> None:
    """Every rank of ``group`` holds the same ``tensors`` (a fingerprint: shapes, sums and position-weighted sums,
    all-gathered). Raises ValueError naming the ranks that differ."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1).long()
        weights = torch.arange(1, flat.numel() + 1, device=flat.device) % 1009
        parts += [torch.tensor(list(t.shape) + [0] * (3 - t.dim()), device=flat.device), flat.sum()[None],
                  (flat * weights).sum()[None]]
    mine = torch.cat(parts)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    differ = [i for i, other in enumerate(every) if not torch.equal(other, every[0])]
    if differ:
        raise ValueError(f"the ranks of the CP group hold different batches (group ranks {differ} differ from rank 0): "
                         "each rank of a CP group must score the same sequences (one generation per group; the same "
                         "data order and random state)")


def fused_forward_on_shards(model: torch.nn.Module, config: ContextParallelConfig, cp_group, hierarchical_cp_groups,
                            args, kwargs: dict, row_positions: bool = True, exact=None):
    """TRL's fused forward of a whole batch run on this rank's shard (module doc, steps 1-4).

    Args:
        model: a model with TRL's fused head wrapped by :func:`install_cp_fused_head`.
        kwargs: ``input_ids (B, S)``, ``attention_mask (B, S)`` (optional), ``labels (B, S)`` or ``shift_labels
            (B, S)``, and optionally ``num_items_in_batch``, ``use_cache``, ``output_router_logits``.
        row_positions: a token's position is its index in the left-padded row (``True``: the model's forward uses
            ``0..S-1``) or counts from the row's first real token (``False``: it derives positions from the mask);
            :func:`left_padding_positions`.
        exact: :class:`~.hf_exact_grads.TrainerExactGradients` of ``model`` (the deterministic mode's exact
            gradients), or ``None``.

    Returns:
        TRL's ``FusedCausalLMOutput``: per-token fields ``(B, S - 1)`` (``labels``) or ``(B, S)`` (``shift_labels``),
        float32 as TRL's; ``loss`` over the whole batch.

    Raises:
        ValueError: positional arguments, a keyword outside :data:`ACCEPTED`, neither or both of ``labels`` and
            ``shift_labels``, a mask :func:`row_extents` refuses, a label predicted from a padding position, ranks
            of the group with different batches (:func:`check_same_batch`).
    """
    if args:
        raise ValueError(f"a fused-head call with {len(args)} positional arguments: pass input_ids and the rest as "
                         "keywords under context parallelism")
    unknown = sorted(k for k, v in kwargs.items() if k not in ACCEPTED and v is not None)
    if unknown:
        raise ValueError(f"fused-head inputs {unknown} are not implemented under context parallelism (each would be "
                         f"passed on unsharded; vision-language inputs are not supported in RL trainers); accepted: "
                         f"{sorted(ACCEPTED)}")
    input_ids = kwargs["input_ids"]
    length = input_ids.shape[1]
    mask = kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
    if (labels is None) == (shift_labels is None):
        raise ValueError("a fused-head call needs exactly one of labels and shift_labels under context parallelism")
    shifted = shift_labels if labels is None else F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    width_out = length if labels is None else length - 1
    first, real_len = row_extents(mask)
    if bool(((shifted != IGNORE_INDEX) & (mask == 0)).any()):
        raise ValueError("a label is predicted from a padding position (its previous token is padding); refused "
                         "under context parallelism (one process would score a padding token's output)")
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        check_same_batch(cp_group, input_ids, mask, shifted)
    # step 2: each row flushed left (the labels were shifted in the row's own order above)
    width = max(int(real_len.max()), 1)
    slots = torch.arange(width, device=input_ids.device)
    source = (slots[None] + first[:, None]).clamp(max=length - 1)
    real = slots[None] < real_len[:, None]
    flushed = {"input_ids": input_ids.gather(1, source).masked_fill(~real, 0), "attention_mask": real.long(),
               "shift_labels": shifted.gather(1, source).masked_fill(~real, IGNORE_INDEX)}
    # step 3: the shard, at TRL's positions
    sharded = shard_batch(flushed, config, cp_group, hierarchical_cp_groups)
    handler, inputs = sharded.handler, sharded.inputs
    offset = first[:, None] if row_positions else 0
    positions = torch.where(sharded.token_mask, inputs["position_ids"] + offset, 0)
    handler.token_layout.set_max_position(length - 1 if row_positions else width - 1)
    model_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                    "position_ids": positions, "cache_position": inputs["cache_position"],
                    "shift_labels": inputs["shift_labels"],
                    **{k: kwargs[k] for k in ("use_cache", "output_router_logits") if kwargs.get(k) is not None}}
    scope = RouterLossScope(cp_group, sharded.token_mask, "replicated")
    if exact is not None:
        exact.set_units(handler, inputs["input_ids"].shape[1])
    with forward_scope(router_loss=scope, fused_head_on_shard=True):
        out = model(fused_lm_head=True, cp_handler=handler, **model_kwargs)
    # step 4: combined, back in the rows' places
    cp = handler.cp_size
    back = torch.arange(width_out, device=input_ids.device)[None] - first[:, None]
    back = torch.where((back >= 0) & (back < width), back, width)

    def whole(local: torch.Tensor) -> torch.Tensor:
        is_bool = local.dtype == torch.bool
        x = local.to(torch.uint8) if is_bool else local
        if x.requires_grad and cp > 1 and exact is None:  # the exact sums divide by dp instead (hf_exact_grads)
            x = _ScaleGrad.apply(x, cp)
        x = handler.combine(x, 1)[:, :width]
        x = F.pad(x, (0, 1)).gather(1, back)
        return x.bool() if is_bool else x

    fields = {name: whole(getattr(out, name)) for name in FIELDS if getattr(out, name, None) is not None}
    label_mask = shifted[:, :width_out] != IGNORE_INDEX
    count = kwargs.get("num_items_in_batch")
    loss = -fields["log_probs"].sum() / (label_mask.sum().clamp(min=1) if count is None else count)
    if out.aux_loss is not None:
        loss = loss + getattr(text_config(model), "router_aux_loss_coef", 0.0) * out.aux_loss
    return type(out)(loss=loss, label_mask=label_mask, aux_loss=out.aux_loss, **fields)


def left_padding_positions(model: torch.nn.Module, implementation: str, pad: int = 3, tokens: int = 8) -> bool:
    """How ``model``'s own forward places a left-padded row's real tokens: ``True`` at their index in the row (the
    positions ``0..S-1`` of the whole row: Llama and most RoPE models), ``False`` from 0 at the first real token
    (positions from the attention mask: OPT). Found at cp = 1, in eval mode, with its own attention
    ``implementation``, on ``pad`` padding slots and ``tokens`` tokens: the left-padded row's logits against those of
    its real tokens alone at either positions (the closer one; both agree up to rounding for RoPE, which is
    relative). ``True`` for weights on the ``meta`` device (nothing to run).

    Raises:
        ValueError: neither reproduces the left-padded forward (padding that reaches real tokens): TRL's forward
            could not be reproduced on shards.
    """
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return True
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, text_config(model).vocab_size, (1, pad + tokens), generator=generator).to(weight.device)
    mask = (torch.arange(pad + tokens) >= pad).long()[None].to(weight.device)
    was_training = model.training
    model.eval()
    try:
        with own_attention(model, implementation), torch.no_grad():
            padded = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, pad:]
            alone = {offset: model(input_ids=ids[:, pad:], use_cache=False,
                                   position_ids=torch.arange(tokens, device=weight.device)[None] + offset * pad).logits
                     for offset in (True, False)}
    finally:
        model.train(was_training)
    errors = {offset: (logits - padded).abs().max().item() for offset, logits in alone.items()}
    best = min(errors, key=lambda offset: (errors[offset], not offset))
    try:
        torch.testing.assert_close(alone[best], padded)
    except AssertionError:
        raise ValueError(f"{type(model).__name__}: its forward of a left-padded row is not the forward of the real "
                         f"tokens alone at the row's positions (max difference {errors[True]:.2e}) nor from 0 "
                         f"({errors[False]:.2e}): padding reaches real tokens; TRL's forward cannot be reproduced on "
                         "shards") from None
    return best
