"""Context parallelism for unmodified Hugging Face causal LMs, through transformers' attention registry.

``register(model)`` adds an attention function and a mask function, ``"cp_handler"``, to
transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` (no monkeypatching), switches the
model to them, checks it and watches its forwards (:mod:`.hf_model`). Every attention layer then runs
through the active handler's ``core_attn``; the handler reaches it per batch: the ``cp_handler=``
keyword of the model's forward, or ``with cp_attention(handler):``. No handler is an error, never
plain attention::

    model = AutoModelForCausalLM.from_config(config)
    register(model)
    h = get_cp_handler_cls("local", "p2p")(cp_group=group)
    input_ids, labels, loss_mask = next_token_batch(h, tokens)
    logits = model(input_ids, **cp_model_inputs(h, input_ids), cp_handler=h).logits
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)

``cp_model_inputs`` gives the model every local token's global position (``position_ids`` and
``cache_position``; thd: restarting per document), so the model's own RoPE and anything reading
positions are exact, and an all-ones ``attention_mask``, so transformers does not re-derive
documents from the zigzag's jumps in ``position_ids``. :class:`CPCausalLM` does all of it
(``model(input_ids, cp_handler=h)`` returns local logits: what cp-train uses).

**Exact or refused** (the guard; docs/huggingface.md): the attention function implements every
argument it accepts (soft-capping and learnable sinks included: :mod:`cp_handler.masks`), and refuses
the others by name (:data:`HARMLESS`, :func:`check_arguments`): attention dropout, attention weights
output, cross-attention, a position bias, an unknown argument of a future release. The mask comes
from the model's own mask function, classified at global positions (:mod:`.hf_mask`): causal,
bidirectional, sliding windows and chunked attention run; padding, image-token blocks and anything
unrecognised are refused. The model
checks (:mod:`.hf_model`) refuse sequence convolutions and non-attention layers, and a forward in
which a decoder layer did not run cp_handler's attention. Tested transformers releases: :data:`SUPPORTED`.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from ..config import ContextParallelConfig
from ..handlers.base import ContextParallelHandler
from ..handlers.registry import build_cp_handler
from ..handlers.requirements import release
from ..loss import masked_token_loss_sum, token_loss_sum
from .hf_active import active_handler, handler_context, record_attention_call
from .hf_mask import CPMask, cp_mask
from .hf_model import cp_model_inputs, local_position_ids, prepare_model, text_config

ATTN_IMPLEMENTATION = "cp_handler"
SUPPORTED = ((4, 57), (5, 23))
"""First and last transformers releases (major, minor) the integration was tested with (inclusive)."""

HARMLESS = {
    "position_ids": lambda v: True,  # the handler's layout has the positions
    "cache_position": lambda v: True,
    "use_cache": lambda v: True,  # the cache update happens before attention; q/k lengths are checked
    "output_router_logits": lambda v: True,  # MoE routing, not attention
    "logits_to_keep": lambda v: True,  # the LM head's slice, not attention
    "shift_labels": lambda v: True,  # the loss's arguments, passed down every layer (Trainer, TRL); not attention
    "num_items_in_batch": lambda v: True,
    "output_attentions": lambda v: not v,
    "encoder_hidden_states": lambda v: v is None,
    "past_key_values": lambda v: v is None,
    "past_key_value": lambda v: v is None,
    "head_mask": lambda v: v is None,
    "block_indices": lambda v: v is None,
    "position_bias": lambda v: v is None,
    "cu_seq_lens_q": lambda v: v is None,
    "cu_seq_lens_k": lambda v: v is None,
    "max_length_q": lambda v: v is None,
    "max_length_k": lambda v: v is None,
}
"""Keyword arguments transformers passes to attention functions that change nothing here when their
value passes the test; any other value, and any other argument, is refused by name."""


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


def register(model: torch.nn.Module | None = None) -> str:
    """Register the attention and mask functions (idempotent) and return their name. With ``model``:
    also switch it to them and check and watch it (:func:`.hf_model.prepare_model`).

    Raises:
        ImportError: transformers missing or outside the tested releases.
        ValueError: ``model`` has a token mixer that cannot run context-parallel (see :mod:`.hf_model`).
    """
    check_transformers_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cp_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cp_mask)
    if model is not None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            model.config._attn_implementation = ATTN_IMPLEMENTATION
        prepare_model(model)
    return ATTN_IMPLEMENTATION


FULL_CHECK_PARAMETERS = 100_000_000
"""Largest model :func:`check_architecture` instantiates on CPU to run every check (larger: static only)."""


def check_architecture(config) -> None:
    """The guard on a config alone, as ``cp-train --hf-config`` runs it before spawning: the model is
    built on the ``meta`` device for the static checks (:func:`.hf_model.check_model`); when it has at
    most :data:`FULL_CHECK_PARAMETERS` parameters it is also built on CPU and given to
    :func:`register` (the cp=1 forward checks too), so the error is the one every rank would raise.

    Raises:
        ValueError: the guard's refusal.
    """
    from transformers import AutoModelForCausalLM

    register()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    prepare_model(model)  # weights on meta: static checks only
    if sum(p.numel() for p in model.parameters()) <= FULL_CHECK_PARAMETERS:
        register(AutoModelForCausalLM.from_config(config))


def check_generation(config) -> None:
    """The generation guard on a config, before any rank starts: the model (on the ``meta`` device) with its
    mixers routed must have no token mixer other than attention (:func:`~cp_handler.inference.generate.check_mixers`).

    Raises:
        ValueError: naming the first such mixer.
    """
    from transformers import AutoModelForCausalLM

    from ..inference.generate import check_mixers
    from .hf_mixers import instrument_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    instrument_model(model)
    check_mixers(model)


@contextlib.contextmanager
def cp_attention(handler: ContextParallelHandler):
    """Route the attention of ``"cp_handler"`` models through ``handler`` inside the block."""
    with handler_context(handler):
        yield handler


def check_arguments(kwargs: dict) -> None:
    """Raises ValueError naming every argument that is not :data:`HARMLESS` with its value."""
    refused = {k: v for k, v in kwargs.items() if k not in HARMLESS or not HARMLESS[k](v)}
    if refused:
        shown = ", ".join(f"{k}={v if not isinstance(v, torch.Tensor) else 'tensor ' + str(tuple(v.shape))}"
                          for k, v in refused.items())
        raise ValueError(f"the model passed attention arguments cp_handler does not implement: {shown}; they are "
                         "refused instead of dropped (docs/huggingface.md lists what runs under CP)")


def check_local_index_scaling(module, handler: ContextParallelHandler, local_len: int) -> None:
    """Llama 4's attention temperature tuning scales the queries of its NoPE layers by
    ``log1p(floor((i + 1) / floor_scale))`` of each token's *index* ``i`` in the forward's input
    (transformers 5: ``torch.arange(length)``; 4.57: ``cache_position``, an index too by default), not of
    ``position_ids``. Exact when every real local token's index gives the scale of its global position;
    otherwise (a CP shard, a decode step of one token per sequence, documents packed after the first,
    once positions reach ``floor_scale - 1``) refused (ValueError), naming a row whose scale would differ."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    positions = local_position_ids(handler, torch.zeros((1, local_len), dtype=torch.long))[0]
    index = torch.arange(local_len)
    layout = getattr(handler, "thd_layout", None)
    real = layout.real_mask(handler.cp_rank) if layout is not None else torch.ones(local_len, dtype=torch.bool)
    scale = module.floor_scale
    differs = (real & ((index + 1) // scale != (positions.cpu() + 1) // scale)).nonzero()
    if differs.numel():
        row = int(differs[0])
        raise ValueError(f"layer {module.layer_idx}: Llama 4's attention temperature tuning (NoPE layer, floor_scale="
                         f"{module.floor_scale}) scales each query by a function of its index in the model's input, "
                         f"not of its position: here input row {row} is at position {int(positions[row])}, whose "
                         "scale differs (a context-parallel shard, a decode step or a packed document reaching "
                         "floor_scale - 1); refused")


def _mask_type(module, attention_mask, is_causal, handler, local_len: int) -> tuple[str, str | None, int | None]:
    """``(attn_mask_type, "sliding" / "chunked" / None, size)`` of this layer from its mask (see :mod:`.hf_mask`)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None:
        return ("causal" if causal else "no_mask"), None, None
    if not isinstance(attention_mask, CPMask):
        raise ValueError(f"a materialised attention mask ({type(attention_mask).__name__} "
                         f"{tuple(getattr(attention_mask, 'shape', ()))}) reached cp_handler's attention: under CP the "
                         "handler's layout is the mask; pass attention_mask from cp_model_inputs (2-D ones) instead")
    longest = getattr(handler, "max_seqlen", None) or handler.get_rotary_seq_len(local_len)
    spec = attention_mask.spec(longest)
    if spec.kind in ("causal", "bidirectional"):
        return ("causal" if spec.kind == "causal" else "no_mask"), None, None
    if spec.kind in ("sliding", "chunked"):
        return "causal", spec.kind, spec.size
    raise ValueError(f"layer {getattr(module, 'layer_idx', '?')} asks for {spec.describe()}: not supported under "
                     "context parallelism by cp_handler")


def cp_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         is_causal=None, sliding_window=None, softcap=None, s_aux=None, cp_handler=None, **kwargs):
    """transformers attention function: ``query (B, H, S_local, D)``, ``key``/``value`` with the KV
    heads -> ``(B, S_local, H, D)`` from ``handler.core_attn``. The mask is the model's own mask
    function classified at global positions (``attention_mask`` is a :class:`~.hf_mask.CPMask`):
    causal, bidirectional, a sliding window or chunks; ``softcap`` (Gemma 2) and ``s_aux`` (GPT-OSS's
    learnable sinks, one logit per query head) go to the handler as ``attn_mod.softcap`` / ``attn_mod.sinks``.

    Raises:
        RuntimeError: no handler active. ValueError: an argument or a mask cp_handler does not
            implement (see the module doc); q and k of different lengths (a decoding step with a cache);
            a ``sliding_window`` argument that disagrees with the mask.
    """
    handler = cp_handler or active_handler()
    if handler is None:
        raise RuntimeError("attn_implementation='cp_handler' needs a handler: pass cp_handler=handler to the "
                           "model's forward or run it inside `with cp_attention(handler):`")
    if not getattr(module, "_cp_handler_prepared", False):
        raise ValueError(f"{type(module).__name__}: this model was not checked for context parallelism: call "
                         "cp_handler.integrations.transformers.register(model) once before running it")
    check_arguments(kwargs)
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported under context parallelism; set the "
                         "config's attention_dropout to 0 (or put the model in eval mode)")
    record_attention_call(module)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D)
    if torch.is_autocast_enabled(q.device.type):  # mixed precision (Trainer's bf16 / fp16): as autocast casts SDPA
        q, k, v = (t.to(torch.get_autocast_dtype(q.device.type)) for t in (q, k, v))
    check_local_index_scaling(module, handler, q.shape[1])
    mask_type, kind, size = _mask_type(module, attention_mask, is_causal, handler, q.shape[1])
    longest = getattr(handler, "max_seqlen", None) or handler.get_rotary_seq_len(q.shape[1])
    if kind is None and sliding_window is not None and sliding_window < longest and mask_type == "causal":
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: sliding_window={sliding_window} was passed to "
                         "attention, but the layer's mask is a plain causal one; refused (which one is meant?)")
    layer_idx = getattr(module, "layer_idx", None)  # None: an attention block shared by several layers (Zamba)
    attn = SimpleNamespace(softmax_scale=scaling, layer_number=None if layer_idx is None else layer_idx + 1,
                           window_size=(size - 1, 0) if kind == "sliding" else None,
                           attention_chunk_size=size if kind == "chunked" else None,
                           softcap=softcap, sinks=s_aux)
    out = handler.core_attn(attn, q, k, v, attn_mask_type=mask_type)
    return out.contiguous(), None  # (B, S, H, D) as transformers' own attention functions return it


class CPCausalLM(torch.nn.Module):
    """A Hugging Face causal LM driven by a CP handler: ``forward(input_ids (B, S_local), cp_handler,
    moe_handler=None) -> logits (B, S_local, V)`` (the interface of :class:`cp_handler.models.GPTModel`, so
    cp-train, evaluation and dynamic CP run it unchanged). ``register(model)`` is applied (checks and
    hooks); parameters and ``state_dict`` are the wrapped model's (``self.model``).

    Raises:
        ValueError: the model cannot run context-parallel (:func:`register`).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        register(model)
        self.model = model
        self.head_refusal = _probe_head(self)
        """Why the chunked loss is refused for this model (``None``: it runs), from a probe at cp = 1."""

    def gradient_checkpointing_enable(self) -> None:
        """transformers' gradient checkpointing (non-reentrant) of the wrapped model; it runs only in
        training mode (transformers' rule). Raises ValueError when the architecture does not support it."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(self.model).__name__} does not support gradient checkpointing "
                             "(supports_gradient_checkpointing is False in transformers)")
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler | None = None,
                moe_handler=None, labels: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None,
                loss_chunk_tokens: int | None = None, logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or with ``labels`` the masked loss sum (as :class:`~cp_handler.models.GPTModel`): with
        ``loss_chunk_tokens`` the last hidden states go through :meth:`head` in chunks (the model's own output
        projection; a model whose logits are something else is refused by name, :attr:`head_refusal`). With
        ``logits_rows`` the logits of those local rows only, through :meth:`head` (all rows' logits, then those,
        when the head is refused)."""
        if moe_handler is not None:
            raise ValueError("CPCausalLM: Hugging Face models route their own experts; moe_handler is not used")
        if labels is not None and loss_chunk_tokens is not None and self.head_refusal:
            raise ValueError(f"chunked loss (loss_chunk_tokens={loss_chunk_tokens}): {self.head_refusal}")
        if cp_handler is None:
            cp_handler = build_cp_handler(ContextParallelConfig())
        if logits_rows is not None and not self.head_refusal:
            return self.head(self.last_hidden_states(input_ids, cp_handler)[:, logits_rows])
        if logits_rows is not None:
            return self(input_ids, cp_handler)[:, logits_rows]
        if labels is None or loss_chunk_tokens is None:
            with cp_attention(cp_handler):
                logits = self.model(input_ids=input_ids, **cp_model_inputs(cp_handler, input_ids),
                                    use_cache=False).logits
            return logits if labels is None else masked_token_loss_sum(logits, labels, loss_mask)
        hidden = self.last_hidden_states(input_ids, cp_handler)
        return token_loss_sum(hidden, self.head, labels, loss_mask, loss_chunk_tokens)

    @property
    def vocab_size(self) -> int:
        return text_config(self.model).vocab_size

    def last_hidden_states(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler) -> torch.Tensor:
        """``(B, S_local, hidden)``: what the model's forward gives its output projection (captured by a forward
        pre-hook, which hands the projection zero tokens instead: no logits are computed)."""
        captured = {}

        def take(module, args):
            captured["hidden"] = args[0]
            return (args[0][..., :0, :], *args[1:])

        handle = self.model.get_output_embeddings().register_forward_pre_hook(take)
        try:
            with cp_attention(cp_handler):
                self.model(input_ids=input_ids, **cp_model_inputs(cp_handler, input_ids), use_cache=False)
        finally:
            handle.remove()
        return captured["hidden"]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection and the logit transforms transformers' causal LMs apply after it (Gemma's
        ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``)."""
        logits = self.model.get_output_embeddings()(hidden)
        config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else \
            self.model.config
        if getattr(config, "logit_scale", None) is not None:
            logits = logits * config.logit_scale
        if getattr(config, "logits_scaling", None) is not None:
            logits = logits / config.logits_scaling
        cap = getattr(config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _probe_head(model: CPCausalLM, tokens: int = 12) -> str | None:
    """At cp = 1, in eval mode: whether :meth:`CPCausalLM.head` of the captured hidden states gives the model's
    own logits (``None``), else why not. Skipped (``None``) for weights on the ``meta`` device."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type == "meta":
        return None
    if model.model.get_output_embeddings() is None:
        return f"{type(model.model).__name__} has no output embeddings (get_output_embeddings() is None)"
    ids = torch.randint(0, text_config(model.model).vocab_size, (1, tokens),
                        generator=torch.Generator().manual_seed(0)).to(weight.device)
    handler, was_training = build_cp_handler(ContextParallelConfig()), model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(ids, cp_handler=handler)
            got = model.head(model.last_hidden_states(ids, handler))
    finally:
        model.train(was_training)
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
        return (f"{type(model.model).__name__}'s logits are not its output projection of the last hidden states "
                "(with the logit transforms cp_handler knows): a chunked loss would differ; use the whole loss")
    return None


class HFReference(torch.nn.Module):
    """The unmodified model under :class:`CPCausalLM`'s parameter names (``model.*``): the reference
    of ``cp-train --check-parity`` for Hugging Face models (their own attention implementation)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
