"""TrainConfig: everything one context-parallel training run needs, validated and frozen.

``cp-train`` (:mod:`cp_handler.cli.args`) builds it from its flags after checking every rule; the
ranks receive it as is (it is pickled to spawned ranks) and never change it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models import GPTConfig
from ..runtime.config import AttentionShape, ContextParallelConfig
from .schedule import LRSchedule


@dataclass(frozen=True)
class DynamicCP:
    """Dynamic CP: every document on the smallest CP group that fits it (docs/dynamic_cp.md)."""

    max_seqlen_per_rank: int
    """Token budget of one rank in one micro-batch (``max_seqlen_per_dp_cp_rank``)."""
    min_cp_size: int = 1
    max_cp_size: int | None = None
    """Largest group (a divisor of the world or a power of two, as ``min_cp_size``); ``None``: the world."""


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Sizes are in tokens (``seq_len``, ``max_corpus_bytes`` bytes = byte tokens)."""

    world_size: int
    cp: ContextParallelConfig
    """Training's CP settings (size, comm type, hierarchical sizes, backend, qkv_format = packing)."""
    eval_cp: ContextParallelConfig
    """Evaluation's CP settings (another degree or the same)."""
    attn_shape: AttentionShape | None
    model: GPTConfig | None = None
    """The reference GPT's shape; ``None`` with a Hugging Face model."""
    hf_source: str | None = None
    """A Hugging Face model directory (config.json; with the weights when ``hf_weights``)."""
    hf_weights: bool = False
    dynamic: DynamicCP | None = None
    expert_parallel_size: int = 1
    tensor_parallel_size: int = 1
    """Ranks one layer's heads and MLP are split over (:mod:`cp_handler.training.tensor_parallel`); ``attn_shape`` is
    then one TP rank's (``H / tp`` heads)."""
    sequence_parallel: bool = False
    """With ``tensor_parallel_size`` above 1: Megatron-LM's sequence parallelism for the reference GPT (norms and
    residuals on each TP rank's share of the tokens; :mod:`cp_handler.training.tensor_parallel`)."""
    print_layout: bool = False
    timeout: float = 300.0
    """Seconds a rank may go without progress (and the process groups' collective timeout)."""
    data: tuple[str, ...] | None = None
    """Text files or folders; ``None``: the Python standard library's sources."""
    max_corpus_bytes: int = 32 << 20
    data_fingerprint: str | None = None
    """sha256 of the bytes the run reads (:func:`~.data.data_fingerprint`; ``cp-train`` computes it once);
    ``None``: computed where a checkpoint needs it."""
    seq_len: int = 512
    batch_size: int = 2
    """Sequences per data-parallel rank and step (dynamic CP: documents per rank and step)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward (static layouts): the step accumulates gradients over
    ``batch_size / micro_batch_size`` micro-batches; ``None``: ``batch_size`` (one)."""
    thd_max_doc_len: int | None = None
    dtype: str = "float32"
    seed: int = 0
    steps: int = 50
    lr: float = 3e-3
    """The peak learning rate (of AdamW unless another optimizer is passed to the run)."""
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    lr_decay_steps: int | None = None
    """Where the decay ends (``linear`` / ``cosine``; ``cp-train`` resolves its default, ``steps``)."""
    clip_grad: float = 0.0
    """Clip the global gradient norm to this (0: no clipping)."""
    recompute: bool = False
    """Recompute every layer's activations in the backward (``gradient_checkpointing_enable``)."""
    compile: bool = False
    """Compile every layer with torch.compile (``fullgraph=True``, Inductor; :mod:`.compile`)."""
    offload_activations: bool = False
    """Keep saved activations in pinned host memory (``torch.autograd.graph.save_on_cpu``; CUDA)."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer states over every rank (FSDP2, :mod:`.fsdp`) instead of DDP."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the loss (:func:`~cp_handler.models.loss.loss_chunk_tokens`): ``None`` automatic, 0 whole."""
    mlp_chunk_tokens: int | None = None
    """Tokens per chunk of every feed-forward block (:func:`~cp_handler.models.tiling.tile_mlps`); ``None``: whole."""
    check_parity: bool = False
    eval_every: int = 0
    eval_batches: int = 2
    check_eval_cp: bool = False
    log_every: int | None = None
    save_dir: str | None = None
    """``--save``: where checkpoints go (:mod:`.checkpoint`); ``None``: none are written."""
    save_every: int = 0
    """Save after every N steps (0: only after the last step)."""
    save_keep: int = 2
    """Complete checkpoints kept in ``save_dir`` (the newest)."""
    resume: str | None = None
    """``--resume``: a checkpoint (or a ``--save`` folder) to continue from; ``steps`` counts from the run's start."""
    allow_data_change: bool = False
    """``--allow-data-change``: resume on other data (paths, contents, ``max_corpus_bytes``) than the checkpoint's."""
    export_hf: str | None = None
    """A Hugging Face model's trained weights, written with ``save_pretrained`` after the last step."""

    @property
    def lr_schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.min_lr, self.lr_warmup_steps, self.lr_decay_style, self.lr_decay_steps)

    @property
    def micro_batches(self) -> int:
        """Forward/backward passes per step and data-parallel rank (gradient accumulation)."""
        return self.batch_size // (self.micro_batch_size or self.batch_size)

    @property
    def packing(self) -> str:
        """``"bshd"`` (fixed-length sequences) or ``"thd"`` (documents packed with cu_seqlens)."""
        return self.cp.qkv_format

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas of a static layout: ``world / (tp x cp)``."""
        return self.world_size // (self.tensor_parallel_size * self.cp.context_parallel_size)

    @property
    def moe_experts(self) -> int:
        return self.model.num_moe_experts if self.model is not None else 0
