"""Checkpoints of ``cp-train`` (``--save`` / ``--resume``) with ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the model, the optimizer state (AdamW's moments, its step count and learning
rate), every rank's RNG state, and ``cp_train.json``: the learning-rate scheduler's state, the
completed step count (the data position: batches are drawn by step index, :mod:`.data`), and what the
run's data and model were. DCP writes
each tensor once (parameters replicated over dp x cp are deduplicated; each expert shard is written
by a rank that holds it), and reads back at any layout: another CP size, data-parallel size, comm
type, expert-parallel size, or dynamic CP.

Layout of ``--save DIR``: ``DIR/step-00000010/`` (one complete checkpoint each), ``DIR/latest`` (the
name of the newest complete one). A save writes ``DIR/.step-00000010.partial/`` first, then rank 0
adds ``cp_train.json`` and renames the folder into place (an atomic rename), and only then points
``latest`` at it (written to a temporary file and renamed). A rank killed during a save leaves a
``.partial`` folder, which nothing reads; ``latest`` still names the previous checkpoint. The newest
``keep`` complete checkpoints are kept.

Errors (:class:`CheckpointError`, a ``ValueError``): ``--resume`` of a missing, partial or incompatible
checkpoint (another model shape or vocabulary, another expert count, other data or tokens, another global
batch, learning rate or schedule, or dtype: each named with its flag), checked before any rank starts; a save that
fails (disk full: named as such) on every rank, with the previous checkpoint intact.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from .config import TrainConfig
from .tokens import ByteTokens, tokens_for

# torch.distributed.checkpoint is imported inside the functions that save and load: imported here it
# would cost every launch and rank 0.5 s of start-up.

META = "cp_train.json"
LATEST = "latest"
FORMAT = 1
HF_SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts",
                 "n_routed_experts", "tie_word_embeddings")
"""Fields of a Hugging Face config that decide the shape of its parameters (compared on resume)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from, or a save that failed (the message says which)."""


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def global_batch(config: TrainConfig) -> int:
    """Sequences (static) or documents (dynamic CP) per optimizer step over all ranks."""
    if config.dynamic:
        return config.batch_size * config.world_size
    return config.batch_size * (config.world_size // config.cp.context_parallel_size)


def model_identity(config: TrainConfig) -> dict:
    """What decides the parameters' names and shapes: the GPT config, or the Hugging Face config's shape fields."""
    if config.model is not None:
        return {"kind": "gpt", **asdict(config.model)}
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(config.hf_source, local_files_only=True).to_dict()
    return {"kind": "hf", **{k: hf[k] for k in HF_SHAPE_KEYS if k in hf}}


def run_meta(config: TrainConfig, step: int, optimizer: str) -> dict:
    """``cp_train.json`` of a checkpoint after ``step`` completed steps."""
    return {"format": FORMAT, "step": step, "world_size": config.world_size, "optimizer": optimizer,
            "model": model_identity(config),
            "training": {"lr": config.lr, "min_lr": config.min_lr, "lr_warmup_steps": config.lr_warmup_steps,
                         "lr_decay_style": config.lr_decay_style, "lr_decay_steps": config.lr_decay_steps,
                         "dtype": config.dtype, "seq_len": config.seq_len, "seed": config.seed,
                         "data": list(config.data) if config.data else None,
                         "max_corpus_bytes": config.max_corpus_bytes, "tokens": tokens_for(config.hf_source).identity,
                         "packing": config.packing,
                         "thd_max_doc_len": config.thd_max_doc_len, "dynamic": config.dynamic is not None,
                         "global_batch": global_batch(config)},
            "layout": {"cp_size": None if config.dynamic else config.cp.context_parallel_size,
                       "cp_comm_type": config.cp.cp_comm_type, "expert_parallel_size": config.expert_parallel_size}}


TRAINING_FLAGS = {"lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-steps",
                  "lr_decay_style": "--lr-decay-style", "lr_decay_steps": "--lr-decay-steps (default: --steps)",
                  "dtype": "--dtype", "seq_len": "--seq-len", "seed": "--seed", "data": "--data",
                  "max_corpus_bytes": "--max-corpus-bytes", "packing": "--packing",
                  "thd_max_doc_len": "--thd-max-doc-len",
                  "tokens": "the tokens (the model folder's tokenizer, else bytes)"}
SAVED_BEFORE = {"tokens": ByteTokens.identity, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_style": "constant",
                "lr_decay_steps": None}
"""Values of fields that checkpoints written before the fields existed lack (they were all byte-level, at a
constant learning rate)."""


def mismatches(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's ``cp_train.json`` and this run, each named with its flag or field.
    The layout (cp, dp, comm type, ep, dynamic CP) may differ; the model, the data and the optimization may not."""
    problems = []
    if saved.get("format") != FORMAT:
        return [f"checkpoint format {saved.get('format')!r}, this cp-train reads format {FORMAT}"]
    for key in sorted(set(saved["model"]) | set(current["model"])):
        if saved["model"].get(key) != current["model"].get(key):
            problems.append(f"model {key}: checkpoint {saved['model'].get(key)!r}, this run "
                            f"{current['model'].get(key)!r}")
    same_mode = saved["training"]["dynamic"] == current["training"]["dynamic"]
    for key, flag in TRAINING_FLAGS.items():
        if key in ("packing", "thd_max_doc_len") and not same_mode:
            continue  # dynamic CP packs whole documents: its own data source, continued at the same step
        was = saved["training"].get(key, SAVED_BEFORE.get(key))
        if was != current["training"][key]:
            problems.append(f"{flag}: checkpoint {was!r}, this run {current['training'][key]!r}")
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


def read_meta(checkpoint: Path) -> dict:
    try:
        return json.loads((checkpoint / META).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"--resume {checkpoint}: unreadable {META} ({err})") from None


def check_resume(config: TrainConfig, path: str, optimizer: str = "AdamW") -> tuple[Path, int]:
    """``(checkpoint folder, completed steps)`` to resume ``config`` from, checked before any rank starts.

    Raises:
        CheckpointError: see :func:`find_checkpoint`; an incompatible checkpoint (:func:`mismatches`, every
            difference listed); ``--steps`` not beyond the checkpoint's step.
    """
    checkpoint = find_checkpoint(path)
    saved = read_meta(checkpoint)
    problems = mismatches(saved, run_meta(config, 0, optimizer))
    if problems:
        raise CheckpointError(f"--resume {path}: {checkpoint.name} does not fit this run: " + "; ".join(problems))
    if saved["step"] >= config.steps:
        raise CheckpointError(f"--steps {config.steps}: {checkpoint.name} has already trained {saved['step']} steps "
                              "(--steps counts from the start of the run)")
    return checkpoint, saved["step"]


def _state(trained, optim, with_rng: bool) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(trained, optim)
    state = {"model": model_state, "optim": optim_state}
    if with_rng:
        state["rng"] = {f"rank{dist.get_rank()}": torch.get_rng_state()}
    return state


def _agreed(error: str | None) -> None:
    """Raise ``error`` (rank 0's) on every rank."""
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise CheckpointError(box[0])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _failure(err: BaseException) -> str:
    """One line for a failed save: disk full named as such (DCP's CheckpointException carries every rank's
    failure, ``failures: {rank: exception}``)."""
    causes = [err, err.__cause__, err.__context__, *getattr(err, "failures", {}).values()]
    full = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in causes) or \
        "No space left on device" in str(err)
    if full:
        return "the disk is full"
    inner = [e for e in getattr(err, "failures", {}).values() if isinstance(e, BaseException)]
    shown = inner[0] if inner else err
    return f"{type(shown).__name__}: {str(shown).splitlines()[0] if str(shown) else ''}"


def save_checkpoint(root: str, step: int, trained, optim, meta: dict, keep: int = 2) -> Path:
    """Save after ``step`` completed steps (every rank calls it) and publish it atomically (module doc).

    Raises:
        CheckpointError: on every rank when the save failed; the previous checkpoint is untouched.
    """
    root_path, rank = Path(root), dist.get_rank()
    final, partial = root_path / step_name(step), root_path / f".{step_name(step)}.partial"
    error = None
    if rank == 0:
        try:
            root_path.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save of this step that did not finish before
        except OSError as err:
            error = f"--save {root}: cannot write there ({err.strerror or err})"
    _agreed(error)
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(_state(trained, optim, True), storage_writer=dcp.FileSystemWriter(partial))
    except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's (a BaseException) on every rank: one line
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"saving step {step} to {root} failed ({_failure(err)}); the previous checkpoint is "
                              "intact") from None
    error = None
    if rank == 0:
        try:
            _publish(root_path, partial, final, meta, keep)
        except OSError as err:
            shutil.rmtree(partial, ignore_errors=True)
            error = f"publishing step {step} in {root} failed ({_failure(err)}); the previous checkpoint is intact"
    _agreed(error)
    return final


def _publish(root: Path, partial: Path, final: Path, meta: dict, keep: int) -> None:
    _write_atomic(partial / META, json.dumps(meta, indent=1))
    if final.exists():  # the same step saved by an earlier run: replaced only once the new one is complete
        old = root / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    _write_atomic(root / LATEST, final.name)
    complete = sorted(p for p in root.glob("step-*") if (p / META).is_file())
    for stale in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(checkpoint: Path, trained, optim, scheduler=None) -> int:
    """Load model and optimizer (and the RNG state, when the world size is the checkpoint's; the
    learning-rate ``scheduler``'s position, when given) into this rank's ``trained`` / ``optim`` (every rank
    calls it; ``scheduler`` built on ``optim`` before); returns the completed step count."""
    meta = read_meta(checkpoint)
    same_world = meta["world_size"] == dist.get_world_size()
    state = _state(trained, optim, same_world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint))
    set_state_dict(trained, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if same_world:
        torch.set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    if scheduler is not None and "lr_scheduler" in meta:  # else saved at a constant rate: nothing to restore
        scheduler.load_state_dict(meta["lr_scheduler"])
    return meta["step"]
