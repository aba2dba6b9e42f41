"""What a ``cp-train`` checkpoint records (``cp_train.json``) and whether a run may resume from it.

``cp_train.json`` holds the completed step count (the data position: batches are drawn by step index), the
learning-rate scheduler's state, the sizes and sha256 of every file of the checkpoint (verified before a
resume), and what decides the computation: the model (the reference GPT's config, or the **whole** Hugging
Face config minus fields that cannot change it: :data:`HF_IGNORED`), the data (paths and a fingerprint of
the bytes read: :func:`~.data.data_fingerprint`), the tokens and the optimization. A resume compares them
with the run's and refuses every difference by name, before any rank starts; the layout (cp, dp, comm type,
ep, dynamic CP) may differ.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..launch import rank_env
from .config import TrainConfig
from .data import collect_files, data_fingerprint
from .save_folder import LATEST, META, SaveFolderError, verify_files
from .tokens import tokens_for

FORMAT = 2
"""2: the whole Hugging Face config, the data fingerprint and the files' checksums (1: none of them)."""

HF_IGNORED = frozenset({
    "_name_or_path", "name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict", "torchscript", "id2label", "label2id",
    "problem_type", "finetuning_task", "task_specific_params", "tokenizer_class", "prefix", "bos_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "_commit_hash", "_experts_implementation",
})
"""Hugging Face config fields that cannot change a training step from loaded weights: names, bookkeeping,
outputs requested, the initialisation, token ids used only by generation, the dtype (``--dtype`` is compared
on its own) and the attention implementation (cp-train sets it). Every other field is compared on resume."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from, or a save that failed (the message says which)."""


def global_batch(config: TrainConfig) -> int:
    """Sequences (static) or documents (dynamic CP) per optimizer step over all ranks."""
    if config.dynamic:
        return config.batch_size * config.world_size
    return config.batch_size * (config.world_size // config.cp.context_parallel_size)


def hf_config_identity(source: str) -> dict:
    """The Hugging Face config in ``source`` as JSON values (every field, those of :data:`HF_IGNORED` removed)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
    return json.loads(json.dumps({k: v for k, v in config.items() if k not in HF_IGNORED}, default=str))


def model_identity(config: TrainConfig) -> dict:
    """What decides the computation of the model: the GPT config, or the Hugging Face config."""
    if config.model is not None:  # as JSON has it (tuples as lists), so a saved one compares equal
        return {"kind": "gpt", **json.loads(json.dumps(asdict(config.model)))}
    return {"kind": "hf", "config": hf_config_identity(config.hf_source)}


def run_fingerprint(config: TrainConfig) -> str:
    """The run's data fingerprint (computed by ``cp-train`` once, else here)."""
    return config.data_fingerprint or data_fingerprint(collect_files(config.data), config.max_corpus_bytes)


def run_meta(config: TrainConfig, step: int, optimizer: str) -> dict:
    """``cp_train.json`` of a checkpoint after ``step`` completed steps (without its files' checksums)."""
    return {"format": FORMAT, "step": step, "world_size": config.world_size, "optimizer": optimizer,
            "model": model_identity(config),
            "training": {"lr": config.lr, "min_lr": config.min_lr, "lr_warmup_steps": config.lr_warmup_steps,
                         "lr_decay_style": config.lr_decay_style, "lr_decay_steps": config.lr_decay_steps,
                         "dtype": config.dtype, "seq_len": config.seq_len, "seed": config.seed,
                         "data": list(config.data) if config.data else None,
                         "data_fingerprint": run_fingerprint(config),
                         "max_corpus_bytes": config.max_corpus_bytes, "tokens": tokens_for(config.hf_source).identity,
                         "packing": config.packing,
                         "thd_max_doc_len": config.thd_max_doc_len, "dynamic": config.dynamic is not None,
                         "global_batch": global_batch(config)},
            "layout": {"cp_size": None if config.dynamic else config.cp.context_parallel_size,
                       "cp_comm_type": config.cp.cp_comm_type, "expert_parallel_size": config.expert_parallel_size}}


TRAINING_FLAGS = {"lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-steps",
                  "lr_decay_style": "--lr-decay-style", "lr_decay_steps": "--lr-decay-steps (default: --steps)",
                  "dtype": "--dtype", "seq_len": "--seq-len", "seed": "--seed", "data": "--data",
                  "data_fingerprint": "--data's contents (sha256 of the bytes read, in order)",
                  "max_corpus_bytes": "--max-corpus-bytes", "packing": "--packing",
                  "thd_max_doc_len": "--thd-max-doc-len",
                  "tokens": "the tokens (the model folder's tokenizer, else bytes)"}
DATA_FIELDS = ("data", "data_fingerprint", "max_corpus_bytes")
"""What ``--allow-data-change`` lets differ."""


def _model_mismatches(saved: dict, current: dict) -> list[str]:
    if saved.get("kind") != current.get("kind"):
        return [f"model: checkpoint of a {saved.get('kind')} model, this run a {current.get('kind')} model"]
    if current["kind"] == "hf":
        saved, current = saved["config"], current["config"]
    else:  # written before the GPT had a value head dim: it was kv_channels
        saved = {"v_head_dim": saved.get("kv_channels"), **saved}
    return [f"model {key}: checkpoint {saved.get(key)!r}, this run {current.get(key)!r}"
            for key in sorted(set(saved) | set(current)) if saved.get(key) != current.get(key)]


def mismatches(saved: dict, current: dict, allow_data_change: bool = False) -> list[str]:
    """What differs between a checkpoint's ``cp_train.json`` and this run, each named with its flag or field.
    The layout (cp, dp, comm type, ep, dynamic CP) may differ; the model, the data (unless
    ``allow_data_change``) and the optimization may not."""
    if saved.get("format") != FORMAT:
        return [f"checkpoint format {saved.get('format')!r}, this cp-train resumes format {FORMAT} (format 1, written "
                "before 2026-11-25, records neither the whole Hugging Face config, nor the data's contents, nor "
                "checksums: it cannot be checked against this run)"]
    problems = _model_mismatches(saved["model"], current["model"])
    same_mode = saved["training"]["dynamic"] == current["training"]["dynamic"]
    for key, flag in TRAINING_FLAGS.items():
        if key in ("packing", "thd_max_doc_len") and not same_mode:
            continue  # dynamic CP packs whole documents: its own data source, continued at the same step
        if key in DATA_FIELDS and allow_data_change:
            continue
        if saved["training"].get(key) != current["training"][key]:
            problems.append(f"{flag}: checkpoint {saved['training'].get(key)!r}, this run {current['training'][key]!r}"
                            + (" (--allow-data-change resumes on other data)" if key in DATA_FIELDS else ""))
    if same_mode and saved["training"]["global_batch"] != current["training"]["global_batch"]:
        problems.append(f"global batch: checkpoint {saved['training']['global_batch']}, this run "
                        f"{current['training']['global_batch']} (--batch-size x data-parallel ranks; the data "
                        "position is a step index into batches of that size)")
    if saved["optimizer"] != current["optimizer"]:
        problems.append(f"optimizer: checkpoint {saved['optimizer']}, this run {current['optimizer']}")
    return problems


def find_checkpoint(path: str, flag: str = "--resume") -> Path:
    """The complete checkpoint ``path`` (given as ``flag``) names: a checkpoint folder, or a ``--save``
    folder (its ``latest``).

    Raises:
        CheckpointError: nothing there, only a partial save, or ``latest`` naming a missing / incomplete one.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{flag} {path}: no such directory")
    if root.name.endswith(".partial"):
        raise CheckpointError(f"{flag} {path}: a partial checkpoint (a save that did not finish); resume from "
                              f"{root.parent} (its latest complete checkpoint)")
    if (root / META).is_file():
        candidate = root
    elif (root / LATEST).is_file():
        candidate = root / (root / LATEST).read_text().strip()
    else:
        partial = sorted(p.name for p in root.glob(".step-*.partial"))
        what = f"only partial checkpoints ({', '.join(partial)}: saves that did not finish)" if partial else \
            "no checkpoint"
        raise CheckpointError(f"{flag} {path}: {what}")
    if not ((candidate / META).is_file() and (candidate / ".metadata").is_file()):
        raise CheckpointError(f"{flag} {path}: {candidate.name} is missing or incomplete (no {META} or DCP "
                              ".metadata)")
    return candidate


def read_meta(checkpoint: Path, flag: str = "--resume") -> dict:
    try:
        return json.loads((checkpoint / META).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{flag} {checkpoint}: unreadable {META} ({err})") from None


def verify_checkpoint(checkpoint: Path, meta: dict, flag: str = "--resume") -> None:
    """Every file of ``checkpoint`` matches the sizes and sha256 its ``cp_train.json`` recorded (under
    torchrun each rank checks its share of the files).

    Raises:
        CheckpointError: a missing, truncated or changed file, named with its path.
    """
    env = rank_env()
    share = (env.rank, env.world_size) if env else (0, 1)
    try:
        verify_files(checkpoint, meta.get("files", {}), flag, share)
    except SaveFolderError as err:
        raise CheckpointError(str(err)) from None


def check_resume(config: TrainConfig, path: str, optimizer: str = "AdamW", verify: bool = True) -> tuple[Path, int]:
    """``(checkpoint folder, completed steps)`` to resume ``config`` from, checked before any rank starts
    (``verify``: the files' checksums too).

    Raises:
        CheckpointError: see :func:`find_checkpoint`; an incompatible checkpoint (:func:`mismatches`, every
            difference listed); ``--steps`` not beyond the checkpoint's step; a damaged file.
    """
    checkpoint = find_checkpoint(path)
    saved = read_meta(checkpoint)
    problems = mismatches(saved, run_meta(config, 0, optimizer), config.allow_data_change)
    if problems:
        raise CheckpointError(f"--resume {path}: {checkpoint.name} does not fit this run: " + "; ".join(problems))
    if saved["step"] >= config.steps:
        raise CheckpointError(f"--steps {config.steps}: {checkpoint.name} has already trained {saved['step']} steps "
                              "(--steps counts from the start of the run)")
    if verify:
        verify_checkpoint(checkpoint, saved)
    return checkpoint, saved["step"]
