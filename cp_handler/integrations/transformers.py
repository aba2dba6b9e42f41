"""Context parallelism for unmodified Hugging Face causal LMs, through transformers' attention registry.

``register()`` adds an attention function ``"cp_handler"`` to ``transformers.AttentionInterface``
(no monkeypatching); a model whose ``attn_implementation`` is ``"cp_handler"`` then runs every
attention layer through the active handler's ``core_attn``. The handler reaches it per batch: the
``cp_handler=`` keyword of the model's forward (transformers passes forward kwargs down to the
attention function), or ``with cp_attention(handler):`` (a context variable, reset on exit, so
nothing leaks from one batch to the next). No handler active is an error, never plain attention.

The rest of the model is untouched: the tokens and ``position_ids`` are dispatched by the handler
(:func:`local_position_ids` gives every local token its global position, restarting per document
for thd), so the model's own rotary code rotates at the right positions; labels come from
``handler.roll_tensor`` and the loss is token-weighted over the CP group
(:mod:`cp_handler.training`). :class:`CPCausalLM` wraps a model so that
``model(input_ids, cp_handler=h)`` does all of it and returns local logits (what cp-train uses)::

    model = AutoModelForCausalLM.from_config(config, attn_implementation=register())
    h = get_cp_handler_cls("local", "p2p")(cp_group=group)
    input_ids, labels, loss_mask = next_token_batch(h, tokens)
    logits = model(input_ids, position_ids=local_position_ids(h, input_ids), cp_handler=h).logits
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)

Mapping to the handler: q/k/v ``(B, H, S, D)`` -> bshd (thd: a batch of one pack); the module's
``scaling`` is the softmax scale, ``layer_idx + 1`` the layer number (a per-layer ``cp_comm_type``),
``is_causal`` the mask type. A sliding window (Mistral, Qwen2 sliding layers: keys within the last
``W`` positions) is passed as ``window_size = (W - 1, 0)``; the local backend refuses windows shorter
than the sequence with a ValueError (Transformer Engine takes them with a2a / all_gather). Attention
dropout is refused; generation with a KV cache is not supported (a decoding step's q and k lengths
differ: the handler's check raises). Tested transformers releases: :data:`SUPPORTED`.
"""

from __future__ import annotations

import contextlib
import contextvars
from types import SimpleNamespace

import torch

from ..handlers.base import ContextParallelHandler
from ..handlers.requirements import release

ATTN_IMPLEMENTATION = "cp_handler"
SUPPORTED = ((4, 57), (5, 23))
"""First and last transformers releases (major, minor) the integration was tested with (inclusive)."""

_active: contextvars.ContextVar[ContextParallelHandler | None] = contextvars.ContextVar("cp_handler", default=None)


def check_transformers_version(version: str | None = None) -> None:
    """Raises ImportError when transformers is missing or outside :data:`SUPPORTED`."""
    if version is None:
        try:
            import transformers
        except ImportError as err:
            raise ImportError("cp_handler.integrations.transformers needs transformers: pip install "
                              f"'transformers>={SUPPORTED[0][0]}.{SUPPORTED[0][1]}'") from err
        version = transformers.__version__
    low, high = SUPPORTED
    if not low <= release(version)[:2] <= high:
        raise ImportError(f"transformers {version} is installed; cp_handler's integration was tested with "
                          f"{low[0]}.{low[1]} to {high[0]}.{high[1]} (docs/huggingface.md)")


def register() -> str:
    """Register the attention function (idempotent); returns its name for ``attn_implementation``.

    Raises:
        ImportError: transformers missing or outside the tested releases.
    """
    check_transformers_version()
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cp_attention_forward)
    return ATTN_IMPLEMENTATION


@contextlib.contextmanager
def cp_attention(handler: ContextParallelHandler):
    """Route the attention of ``"cp_handler"`` models through ``handler`` inside the block."""
    token = _active.set(handler)
    try:
        yield handler
    finally:
        _active.reset(token)


def local_position_ids(handler: ContextParallelHandler, input_ids: torch.Tensor) -> torch.Tensor:
    """Global position of every local token (``(B, S_local)`` int64; thd: restarting per document),
    as the model's rotary embedding takes them."""
    local_len = input_ids.shape[1]
    positions = torch.arange(handler.get_rotary_seq_len(local_len), device=input_ids.device)
    return handler.get_emb_on_this_cp_rank(positions).view(1, -1).expand(input_ids.shape[0], -1)


def cp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, sliding_window=None, cp_handler=None, **kwargs):
    """transformers attention function: ``query (B, H, S_local, D)``, ``key``/``value`` with the KV
    heads -> ``(B, S_local, H, D)`` from ``handler.core_attn`` (the mask comes from the handler's
    layout, not ``attention_mask``).

    Raises:
        RuntimeError: no handler active. ValueError: attention dropout, (local backend) a sliding
            window shorter than the sequence; q and k of different lengths (a decoding step with a cache).
    """
    handler = cp_handler or _active.get()
    if handler is None:
        raise RuntimeError("attn_implementation='cp_handler' needs a handler: pass cp_handler=handler to the "
                           "model's forward or run it inside `with cp_attention(handler):`")
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported under context parallelism; set the "
                         "config's attention_dropout to 0")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    longest = handler.get_rotary_seq_len(q.shape[1])
    attn = SimpleNamespace(softmax_scale=scaling, layer_number=getattr(module, "layer_idx", 0) + 1,
                           window_size=(window - 1, 0) if window and window < longest else None)
    out = handler.core_attn(attn, q, k, v, attn_mask_type="causal" if causal else "no_mask")
    return out, None


class CPCausalLM(torch.nn.Module):
    """A Hugging Face causal LM driven by a CP handler: ``forward(input_ids (B, S_local), cp_handler,
    moe_handler=None) -> logits (B, S_local, V)`` (the interface of :class:`models.GPTModel`, so
    cp-train, evaluation and dynamic CP run it unchanged). Sets the model's attention to
    ``"cp_handler"``; parameters and ``state_dict`` are the wrapped model's (``self.model``).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        model.config._attn_implementation = register()
        self.model = model

    def forward(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler | None = None,
                moe_handler=None) -> torch.Tensor:
        if moe_handler is not None:
            raise ValueError("CPCausalLM: Hugging Face models route their own experts; moe_handler is not used")
        if cp_handler is None:
            from ..handlers.local import LocalContextParallelHandler

            cp_handler = LocalContextParallelHandler(cp_group=None)
        with cp_attention(cp_handler):
            return self.model(input_ids=input_ids, position_ids=local_position_ids(cp_handler, input_ids),
                              use_cache=False).logits
