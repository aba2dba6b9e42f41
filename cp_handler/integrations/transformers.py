"""Context parallelism for unmodified Hugging Face causal LMs, through transformers' attention registry.

``register(model)`` adds an attention function and a mask function, ``"cp_handler"``, to
transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` (no monkeypatching), switches the
model to them, checks it and watches its forwards (:mod:`.hf_model`). Every attention layer then runs
through the forward's handler's ``core_attn``; the handler comes per batch, as the ``cp_handler=`` keyword of the
model's forward, its one channel (transformers passes it on to the attention function in the forward's keyword
arguments, :mod:`.hf_attention`). No handler is an error, never plain attention::

    model = AutoModelForCausalLM.from_config(config)
    register(model)
    h = get_cp_handler_cls("local", "p2p")(cp_group=group, cp_comm_type="p2p")
    input_ids, labels, loss_mask = next_token_batch(h, tokens)
    logits = model(input_ids, **cp_model_inputs(h, input_ids), cp_handler=h).logits
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, group)

``cp_model_inputs`` gives the model every local token's global position (``position_ids`` and
``cache_position``; thd: restarting per document), so the model's own RoPE and anything reading
positions are exact, and an all-ones ``attention_mask``, so transformers does not re-derive
documents from the zigzag's jumps in ``position_ids``. :class:`CPCausalLM` does all of it
(``model(input_ids, cp_handler=h)`` returns local logits: what cp-train uses).

**Exact or refused** (the guard; docs/huggingface.md): the attention function implements every
argument it accepts (soft-capping and learnable sinks included: :mod:`cp_handler.core.masks`), and refuses
the others by name (:mod:`.hf_attention`: ``HARMLESS``, ``check_arguments``): attention dropout, attention
weights output, cross-attention, a position bias, an unknown argument of a future release. The mask comes
from the model's own mask function, classified at global positions (:mod:`.hf_mask`): causal,
bidirectional, sliding windows and chunked attention run; padding, image-token blocks and anything
unrecognised are refused. The model
checks (:mod:`.hf_model`) refuse sequence convolutions and non-attention layers, and a forward in
which a decoder layer did not run cp_handler's attention. Releases: :data:`OLDEST` and newer, decided per model by
these probes rather than by a version number.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..handlers.base import ContextParallelHandler
from ..handlers.registry import build_cp_handler
from ..handlers.requirements import release
from ..runtime.config import ContextParallelConfig
from .hf_attention import cp_attention_forward
from .hf_causal import check_causal
from .hf_inputs import cp_model_inputs, text_config
from .hf_mask import cp_mask
from .hf_model import prepare_model
from .hf_vlm import is_vision_language, set_text_attention

ATTN_IMPLEMENTATION = "cp_handler"
OLDEST = (5, 23)
"""The oldest transformers release (major, minor) the integration supports and tests (docs/testing.md: the HF, VLM,
RL, compile and inference tests pass on it with torch 2.10). Newer
releases are not refused by their number: per model, the probes decide (the model ran cp_handler's attention in
every layer, its masks classify as planned at global positions, each routed mixer equals itself on documents apart,
the route's inputs change nothing at cp = 1); what a release breaks is refused by name there."""
REQUIRED_API = (("transformers", "AttentionInterface"), ("transformers.masking_utils", "AttentionMaskInterface"),
                ("transformers.modeling_layers", "GradientCheckpointingLayer"))
"""The public extension points the integration registers with or reads (module, name)."""


def check_transformers(version: str | None = None) -> None:
    """Raises ImportError when transformers is missing, older than :data:`OLDEST`, or lacks one of
    :data:`REQUIRED_API` (named, with the install hint)."""
    from ..core.install_hint import extra_hint

    if version is None:
        try:
            import transformers
        except ImportError as err:
            raise ImportError(f"cp_handler.integrations.transformers needs transformers: {extra_hint('hf')}") from err
        version = transformers.__version__
    if release(version)[:2] < OLDEST:
        raise ImportError(f"transformers {version} is installed; cp_handler's integration needs "
                          f"{OLDEST[0]}.{OLDEST[1]} or newer: {extra_hint('hf')}")
    import importlib

    for module, name in REQUIRED_API:
        if not hasattr(importlib.import_module(module), name):
            raise ImportError(f"transformers {version} has no {module}.{name}, which cp_handler's integration "
                              "registers with; this release is not supported (docs/huggingface.md)")


def register(model: torch.nn.Module | None = None) -> str:
    """Register the attention and mask functions (idempotent) and return their name. With ``model``:
    also switch it to them and check and watch it (:func:`.hf_model.prepare_model`).

    Raises:
        ImportError: transformers missing or outside the tested releases.
        ValueError: ``model`` has a token mixer that cannot run context-parallel (see :mod:`.hf_model`).
    """
    check_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, cp_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, cp_mask)
    if model is not None:
        if is_vision_language(model):  # the vision tower keeps its own attention (:mod:`.hf_vlm`)
            set_text_attention(model, ATTN_IMPLEMENTATION)
        elif hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            model.config._attn_implementation = ATTN_IMPLEMENTATION
        prepare_model(model)
    return ATTN_IMPLEMENTATION


def check_text_route(model: torch.nn.Module) -> None:
    """:class:`CPCausalLM` (cp-train, evaluation, generation) gives the model this rank's tokens; a vision-language
    model takes the whole batch instead (:mod:`.hf_vlm`). Raises ValueError for one, naming the route it takes."""
    if is_vision_language(model):
        raise ValueError(f"{type(model).__name__} is a vision-language model: under context parallelism it takes the "
                         "whole batch (its vision tower and merge run on the full sequence; docs/huggingface.md, "
                         "'Vision-language models'): call it under a handler, or train it with CPTrainer / "
                         "CPSFTTrainer; CPCausalLM, cp-train and generation take text models")


FULL_CHECK_PARAMETERS = 100_000_000
"""Largest model :func:`check_architecture` instantiates on CPU to run every check (larger: static only)."""


def check_architecture(config, model_class=None) -> torch.nn.Module | None:
    """The guard on a config alone, as ``cp-train --hf-config`` runs it before spawning and the trainers before the
    wrapped trainer's ``__init__``: the model is built on the ``meta`` device for the static checks
    (:func:`.hf_model.check_model`); when it has at most :data:`FULL_CHECK_PARAMETERS` parameters it is also built
    on CPU in float32 and given to :func:`register` (the cp=1 forward checks too) and :func:`.hf_model.check_causal`
    (every attention layer causal), so the error is the one every rank would raise. ``config`` is not changed (the
    copies are built from a copy of it).

    Args:
        config: a ``PretrainedConfig``.
        model_class: the class to build (a trainer's model's own: vision-language models included); default the
            causal LM class of ``config`` (``AutoModelForCausalLM``: text models only, :func:`check_text_route`).

    Returns:
        The registered float32 copy on CPU (random weights; for further cp=1 probes), or ``None`` when the model is
        larger than :data:`FULL_CHECK_PARAMETERS` (static checks only).

    Raises:
        ValueError: the guard's refusal.
    """
    from transformers import AutoModelForCausalLM

    register()
    if model_class is None:
        def build(dtype=None):
            return AutoModelForCausalLM.from_config(copy.deepcopy(config), **({"dtype": dtype} if dtype else {}))
    else:
        def build(dtype=None):
            return model_class._from_config(copy.deepcopy(config), **({"dtype": dtype} if dtype else {}))
    with torch.device("meta"):
        model = build()
    if model_class is None:
        check_text_route(model)
    prepare_model(model)  # weights on meta: static checks only
    check_causal(model)
    if sum(p.numel() for p in model.parameters()) > FULL_CHECK_PARAMETERS:
        return None
    model = build(torch.float32)
    register(model)
    check_causal(model)
    return model


@contextlib.contextmanager
def own_attention(model: torch.nn.Module, implementation: str):
    """Inside the block, ``model`` (registered) runs its own attention ``implementation`` (``"sdpa"``, ``"eager"``...)
    instead of cp_handler's: generation of an RL trainer's completions, outside CP. Switched back to
    ``"cp_handler"`` when the block ends, also on an error."""
    check_text_route(model)
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


class CPCausalLM(torch.nn.Module):
    """A Hugging Face causal LM driven by a CP handler: ``forward(input_ids (B, S_local), cp_handler,
    moe_handler=None) -> logits (B, S_local, V)`` (the interface of :class:`cp_handler.models.GPTModel`, so
    cp-train, evaluation and dynamic CP run it unchanged). ``register(model)`` is applied (checks and
    hooks); parameters and ``state_dict`` are the wrapped model's (``self.model``).

    Raises:
        ValueError: the model cannot run context-parallel (:func:`register`), or is not a causal language model
            (:func:`.hf_model.check_causal`).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        check_text_route(model)
        register(model)
        check_causal(model)
        self.model = model
        self.head_refusal = _probe_head(self)
        """Why the chunked loss is refused for this model (``None``: it runs), from a probe at cp = 1."""

    def gradient_checkpointing_enable(self) -> None:
        """transformers' gradient checkpointing (non-reentrant) of the wrapped model; it runs only in
        training mode (transformers' rule). Raises ValueError when the architecture does not support it."""
        if not getattr(self.model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(self.model).__name__} does not support gradient checkpointing "
                             "(supports_gradient_checkpointing is False in transformers)")
        enable = getattr(self.model, "activation_checkpointing_enable", None)  # its name since transformers 5.x
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def forward(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler | None = None,
                moe_handler=None, output=None) -> torch.Tensor:
        """The model protocol, as :class:`~cp_handler.models.GPTModel`: the model's own logits (``output=None``),
        else ``output(head, hidden)`` of :meth:`head` and :meth:`hidden`. A model whose logits are something other
        than :meth:`head` of its last hidden states (:attr:`head_refusal`) gives ``output`` its own logits with the
        identity as the head (the same result), and a chunked :class:`~cp_handler.models.loss.TokenLoss` is
        refused by name there (it would hold the whole logits it exists to avoid)."""
        if moe_handler is not None:
            raise ValueError("CPCausalLM: Hugging Face models route their own experts; moe_handler is not used")
        chunk_tokens = getattr(output, "chunk_tokens", None)
        if chunk_tokens is not None and self.head_refusal:
            raise ValueError(f"chunked loss (loss_chunk_tokens={chunk_tokens}): {self.head_refusal}")
        if cp_handler is None:
            cp_handler = build_cp_handler(ContextParallelConfig())
        if output is not None and not self.head_refusal:
            return output(self.head, self.hidden(input_ids, cp_handler))
        logits = self.model(input_ids=input_ids, **cp_model_inputs(cp_handler, input_ids), use_cache=False,
                            cp_handler=cp_handler).logits
        return logits if output is None else output(_identity, logits)

    @property
    def vocab_size(self) -> int:
        return text_config(self.model).vocab_size

    def hidden(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler) -> torch.Tensor:
        """``(B, S_local, hidden)``: what the model's forward gives its output projection (captured by a forward
        pre-hook, which hands the projection zero tokens instead: no logits are computed)."""
        captured = {}

        def take(module, args):
            captured["hidden"] = args[0]
            return (args[0][..., :0, :], *args[1:])

        handle = self.model.get_output_embeddings().register_forward_pre_hook(take)
        try:
            self.model(input_ids=input_ids, **cp_model_inputs(cp_handler, input_ids), use_cache=False,
                       cp_handler=cp_handler)
        finally:
            handle.remove()
        return captured["hidden"]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output projection and the logit transforms transformers' causal LMs apply after it (Gemma's
        ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``)."""
        logits, config = self.model.get_output_embeddings()(hidden), text_config(self.model)
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
            got = model.head(model.hidden(ids, handler))
    finally:
        model.train(was_training)
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
        return (f"{type(model.model).__name__}'s logits are not its output projection of the last hidden states "
                "(with the logit transforms cp_handler knows): a chunked loss would differ; use the whole loss")
    return None


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


class HFReference(torch.nn.Module):
    """The unmodified model under :class:`CPCausalLM`'s parameter names (``model.*``): the reference
    of ``cp-train --check-parity`` for Hugging Face models (their own attention implementation)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
