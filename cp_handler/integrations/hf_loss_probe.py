"""The model's own loss, probed once per model (issue 68): is it the token cross-entropy of its logits?

Under CP each rank holds a shard of the tokens. A loss computed by the model from its labels is exact only when it
is the cross-entropy of the logits against ``shift_labels`` (shifted in global order before dispatch), summed and
divided by ``num_items_in_batch`` (the global token count): the ranks' shares then add up to one process's loss. A
model whose loss is anything else gives each rank a wrong share, silently: a term of its own (Bamba's
``z_loss_coefficient``: a mean of ``logsumexp(logits)**2`` over the shard's slots, padding included), a loss that
ignores ``shift_labels`` (Whisper's decoder shifts nothing), a mean that ignores ``num_items_in_batch``.

:func:`loss_difference` runs the model once at cp = 1 (eval mode, no gradient, 8 tokens; ``output_router_logits``
off: a MoE model's load-balancing loss is computed from the whole sequence by :mod:`.hf_router_loss`) and names what
the loss is when it is not that. ``register(model)`` records it (:func:`record`); it is refused by name where the
model's loss is used: a forward given ``labels`` or ``shift_labels`` under a handler of cp > 1 (the hand-written
loop; :mod:`.hf_model`), the trainers' constructor (Trainer and TRL's SFT take the model's loss) and cp-train
(which trains the token cross-entropy of the logits: a model whose own objective has another term would train
something else than the user's config says). The logits stay exact, so a loop that computes the loss from them
(``masked_token_loss_sum``, docs/huggingface.md) runs any of these models.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..runtime.config import ContextParallelConfig
from .hf_inputs import text_config
from .hf_router_loss import router_loss_enabled

_DIFFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> what its loss is when it is not the token cross-entropy (``None``: it is; absent: not probed)."""


def loss_difference(model: nn.Module, tokens: int = 8) -> str | None:
    """``None`` when ``model``'s loss given ``shift_labels`` and ``num_items_in_batch`` is the token sum of the
    cross-entropy of its logits against ``shift_labels`` divided by ``num_items_in_batch`` (rtol 1e-5, atol 1e-6:
    float32 summation order), or when it cannot be probed without real weights (``meta``); else a sentence naming
    what the loss is. Runs one forward at cp = 1 (``model`` registered: it takes ``cp_handler=``)."""
    from ..handlers.registry import build_cp_handler

    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return None
    generator = torch.Generator().manual_seed(0)
    vocab = min(int(getattr(text_config(model), "vocab_size", 100) or 100), 100)
    ids = torch.randint(1, vocab, (1, tokens), generator=generator).to(weight.device)
    shift = torch.randint(0, vocab, (1, tokens), generator=generator).to(weight.device)
    shift[0, -1] = -100
    count = tokens + 5  # not the number of labels: a mean would not pass
    router_off = {"output_router_logits": False} if router_loss_enabled(model) else {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, shift_labels=shift, num_items_in_batch=count, use_cache=False,
                        cp_handler=build_cp_handler(ContextParallelConfig()), **router_off)
    except Exception as err:  # noqa: BLE001 - reported as what the loss is; refused where the loss is used
        return f"could not be computed from shift_labels and num_items_in_batch ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    loss = getattr(out, "loss", None)
    want = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), shift.flatten(), reduction="sum") / count
    if loss is None:
        return "is not computed (the forward returned no loss given labels)"
    if not torch.allclose(loss.float(), want, rtol=1e-5, atol=1e-6):
        return (f"given shift_labels and num_items_in_batch is {float(loss):.6g}, not the token sum of the "
                f"cross-entropy of its logits over the count ({float(want):.6g}): a term of its own (a z-loss), "
                "labels it shifts itself, or a mean")
    return None


def record(model: nn.Module) -> None:
    """Probe ``model`` once (:func:`loss_difference`) and keep the answer for :func:`difference`."""
    _DIFFERENCES[model] = loss_difference(model)


def difference(model: nn.Module) -> str | None:
    """What ``model``'s loss is when it is not the token cross-entropy (probed now when not yet)."""
    if model not in _DIFFERENCES:
        record(model)
    return _DIFFERENCES[model]


def check_model_loss(model: nn.Module, user: str) -> None:
    """Refuse ``model`` for ``user`` (what takes its loss: "CPTrainer takes the model's loss") when its loss is not
    the token cross-entropy (module doc).

    Raises:
        ValueError: naming the model, what its loss is and the way out.
    """
    found = difference(model)
    if found is not None:
        raise ValueError(f"{type(model).__name__}'s own loss {found}; {user}, and under context parallelism each "
                         "rank's share of such a loss would be wrong: refused (turn the term off in its config, e.g. "
                         "z_loss_coefficient=0, or compute the loss from the logits: docs/huggingface.md)")
