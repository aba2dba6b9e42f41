"""Llama-style GPT (RMSNorm, RoPE, GQA, SwiGLU) written for one device.

Context parallelism enters only through the ``cp_handler`` argument of ``forward``: the model
calls its methods for RoPE and attention and never imports ``torch.distributed`` or reads a CP
size. Without a handler it builds a cp=1 one and runs alone. Linear-attention layers (``layer_types``: a
hybrid model) go through the handler's mixer methods. MoE layers (``num_moe_experts``)
exchange tokens the same way, through a ``moe_handler`` (:mod:`cp_handler.models.moe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch import nn

from ..handlers.base import ContextParallelHandler
from ..handlers.local import LocalContextParallelHandler
from ..runtime.moe import ExpertParallelHandler
from ..runtime.rope import rotary_freqs
from .gated_delta import GatedDeltaNet
from .moe import MoEFeedForward, SwiGLU

LAYER_TYPES = ("full_attention", "linear_attention")
"""The token mixers of :attr:`GPTConfig.layer_types`."""


@dataclass
class GPTConfig:
    """Model shape (field names as in Megatron-LM where it has one)."""

    vocab_size: int = 256
    hidden_size: int = 128
    num_layers: int = 2
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """Number of KV heads (GQA); equal to ``num_attention_heads`` for MHA."""
    ffn_hidden_size: int = 352
    kv_channels: int | None = None
    """Head dim of queries and keys; default ``hidden_size // num_attention_heads``."""
    v_head_dim: int | None = None
    """Head dim of values (Megatron-LM's MLA ``v_head_dim``: multi-head latent attention's value width, e.g.
    DeepSeek-V3's 128 against 192 for q/k); default ``kv_channels``. The softmax scale stays
    ``kv_channels ** -0.5``."""
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    num_moe_experts: int = 0
    """Experts per MoE layer; 0 builds dense SwiGLU layers."""
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    """FFN size of one expert; default ``ffn_hidden_size``."""
    moe_aux_loss_coeff: float = 1e-2
    layer_types: tuple[str, ...] | None = None
    """Each layer's token mixer, transformers' names: ``"full_attention"`` or ``"linear_attention"`` (Gated
    DeltaNet, :mod:`cp_handler.models.gated_delta`); ``None``: every layer attention. A hybrid as Qwen3-Next:
    three linear layers to one attention layer."""
    linear_conv_kernel_dim: int = 4
    """Taps of the linear layers' short causal convolution (Qwen3-Next's ``linear_conv_kernel_dim``)."""

    def __post_init__(self) -> None:
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                    f"{self.num_attention_heads} (or set kv_channels)"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.v_head_dim is None:
            self.v_head_dim = self.kv_channels
        for name in ("kv_channels", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown or len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types={list(self.layer_types)}: one of {list(LAYER_TYPES)} per layer "
                                 f"(num_layers={self.num_layers})")
        if self.num_moe_experts and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} must lie in [1, num_moe_experts="
                             f"{self.num_moe_experts}]")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups} (GQA)"
            )


class SelfAttention(nn.Module):
    """Causal self-attention; ``core_attn`` of the handler does the (context-parallel) attention."""

    def __init__(self, config: GPTConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number  # 1-based, selects a per-layer cp_comm_type
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_query_groups
        self.head_dim, self.v_head_dim = config.kv_channels, config.v_head_dim
        self.softmax_scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.v_head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, cp_handler: ContextParallelHandler) -> torch.Tensor:
        b, s, _ = x.shape
        # the heads this process computes: all of them, or a tensor-parallel rank's share (training/tensor_parallel.py)
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (B, S, H, D)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (B, S, Hkv, D)
        v = self.v_proj(x).view(b, s, -1, self.v_head_dim)  # (B, S, Hkv, Dv)
        q = cp_handler.apply_rotary_pos_emb(q, freqs)
        k = cp_handler.apply_rotary_pos_emb(k, freqs)
        out = cp_handler.core_attn(self, q, k, v, attn_mask_type="causal")  # (B, S, H, Dv)
        return self.o_proj(out.flatten(2))


class TransformerLayer(nn.Module):
    def __init__(self, config: GPTConfig, layer_number: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon)
        if config.layer_types is not None and config.layer_types[layer_number - 1] == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_number)
        else:
            self.self_attn = SelfAttention(config, layer_number)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon)
        if config.num_moe_experts:
            self.mlp = MoEFeedForward(config.hidden_size, config.moe_ffn_hidden_size or config.ffn_hidden_size,
                                      config.num_moe_experts, config.moe_router_topk, config.moe_aux_loss_coeff)
        else:
            self.mlp = SwiGLU(config.hidden_size, config.ffn_hidden_size)

    def forward(self, x, freqs, cp_handler, moe_handler):
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        x = x + mixer(self.input_layernorm(x), freqs, cp_handler)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, moe_handler) if isinstance(self.mlp, MoEFeedForward) else self.mlp(h))


class GPTModel(nn.Module):
    """Decoder-only LM. ``forward(input_ids (B, S_local) int64, cp_handler) -> logits (B, S_local, V)``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(config, i + 1) for i in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_epsilon)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.gradient_checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        """Recompute every layer's activations in the backward instead of keeping them (non-reentrant
        ``torch.utils.checkpoint``; Megatron-LM's full recompute, one layer per checkpoint): the recompute
        runs the layer's attention again, its CP communication included, on every rank in the same order.
        Named as transformers' method, so cp-train enables it the same way for both kinds of model."""
        self.gradient_checkpointing = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_method_std)

    def hidden(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler | None = None,
               moe_handler: ExpertParallelHandler | None = None) -> torch.Tensor:
        """The last hidden states ``(B, S_local, hidden)`` of ``input_ids (B, S_local)`` int64 (before the output
        norm: :meth:`head` applies it). MoE models take ``moe_handler`` (default: every expert on this process);
        its ``aux_losses`` receive each MoE layer's load-balancing loss for the caller to add."""
        handler = cp_handler if cp_handler is not None else LocalContextParallelHandler(cp_group=None)
        if self.config.num_moe_experts and moe_handler is None:
            moe_handler = ExpertParallelHandler(num_experts=self.config.num_moe_experts, cp_handler=handler)
        rotary_len = handler.get_rotary_seq_len(input_ids.shape[1])
        freqs = rotary_freqs(rotary_len, self.config.kv_channels, self.config.rotary_base, input_ids.device)
        freqs = handler.get_emb_on_this_cp_rank(freqs)  # (S_local, D) angles of the local tokens
        x = self.embed_tokens(input_ids)  # (B, S_local, hidden)
        for layer in self.layers:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, freqs, handler, moe_handler, use_reentrant=False)
            else:
                x = layer(x, freqs, handler, moe_handler)
        return x

    def forward(self, input_ids: torch.Tensor, cp_handler: ContextParallelHandler | None = None,
                moe_handler: ExpertParallelHandler | None = None, output=None) -> torch.Tensor:
        """The model protocol: ``output(head, hidden)`` of :meth:`head` and :meth:`hidden`'s last hidden states
        (``output=None``: the logits ``(B, S_local, V)``; :class:`~cp_handler.models.loss.TokenLoss`: the masked
        loss sum, chunked or whole; :class:`~cp_handler.models.loss.LogitsAt`: some rows' logits). The output runs
        inside the forward so that a wrapper's hooks (DDP's reducer, FSDP2's gather of the root's parameters: the
        head and, when tied, the embedding) cover the head."""
        hidden = self.hidden(input_ids, cp_handler, moe_handler)
        return self.head(hidden) if output is None else output(self.head, hidden)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The output norm and projection: ``(..., hidden) -> (..., V)`` logits."""
        return self.lm_head(self.norm(x))

    def shard_experts(self, expert_ids: range) -> None:
        """Keep only the experts ``expert_ids`` in every MoE layer (``moe_handler.local_expert_ids``)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoEFeedForward):
                layer.mlp.shard_experts(expert_ids)
