"""Checkpoints of ``cp-train`` (``--save`` / ``--resume``): one concept, in three parts that call each other.

**Writing and reading** (:func:`save_checkpoint`, :class:`CheckpointWriter`, :func:`load_checkpoint`), with
``torch.distributed.checkpoint`` (DCP). A checkpoint holds the model, the optimizer state (AdamW's moments, its
step count and learning rate), every rank's RNG state, and ``cp_train.json``. DCP writes each tensor once
(parameters replicated over dp x cp are deduplicated; each expert shard is written by a rank that holds it),
and reads back at any layout: another CP size, data-parallel size, comm type, expert-parallel size, or
dynamic CP.

Layout of ``--save DIR``: ``DIR/step-00000010/`` (one complete checkpoint each), ``DIR/latest`` (the
name of the newest complete one). A save writes ``DIR/.step-00000010.partial/`` first; every rank hashes
its share of the files, then rank 0 adds ``cp_train.json`` and renames the folder into place (an atomic
rename onto a name that does not exist: a run never re-saves a step), and only then points ``latest`` at it
(a temporary file renamed). A rank killed during a save leaves a ``.partial`` folder, which nothing reads;
``latest`` still names the previous checkpoint.

**What a checkpoint records** (``cp_train.json``, :func:`run_meta`) **and whether a run may resume from it**
(:func:`check_resume`): the completed step count (the data position: batches are drawn by step index), the
learning-rate scheduler's state, the sizes and sha256 of every file of the checkpoint (verified before a
resume), and what decides the computation: the model (the reference GPT's config, or the **whole** Hugging
Face config minus fields that cannot change it: :data:`HF_IGNORED`), the data (paths and a fingerprint of
the bytes read: :func:`~.data.data_fingerprint`), the tokens and the optimization. A resume compares them
with the run's and refuses every difference by name, before any rank starts; the layout (cp, dp, comm type,
ep, dynamic CP) may differ.

**The ``--save`` folder's rules**: one writer at a time, a run owns what it writes, checksums of every file.

* **One writer** (:class:`SaveLock`): a run that saves holds ``DIR/.cp-train.lock`` (its pid, host and the
  process's start time) from before its ranks start to its end. A second run with the same ``--save`` is
  refused naming the owner; a lock whose process is gone (same host: the pid is not running, or runs another
  program started at another time) is stale: it is taken over and named.
* **A run owns what it writes**: a run starts only when the folder holds no complete checkpoint past the step
  it starts from (:func:`check_save_folder`; another run's later checkpoints are refused by name, never
  replaced), and it prunes only checkpoints it wrote itself (:class:`CheckpointWriter`).
* **Checksums** (:func:`file_digests`, :func:`verify_files`): the sha256 and size of every file of a
  checkpoint are recorded in its ``cp_train.json``; a resume verifies them first and names the damaged file.
* **Export targets** (:func:`check_export_target`): ``--export-hf`` writes a new or empty folder only; never
  one that is or holds a checkpoint, never a folder with files it did not write.

Errors: :class:`CheckpointError` (a ``ValueError``): ``--resume`` of a missing, partial, damaged or
incompatible checkpoint, checked before any rank starts; a save that fails (disk full: named as such) on
every rank, with the previous checkpoint intact; a step that already exists (never replaced).
:class:`SaveFolderError` (a ``ValueError``): a ``--save`` / ``--export-hf`` folder this run may not write.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime.launch import rank_env
from .config import TrainConfig
from .data import collect_files, data_fingerprint
from .tokens import tokens_for

# torch.distributed.checkpoint is imported inside the functions that save and load: imported here it
# would cost every launch and rank 0.5 s of start-up.

LOCK = ".cp-train.lock"
META = "cp_train.json"
LATEST = "latest"
CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from, or a save that failed (the message says which)."""


class SaveFolderError(ValueError):
    """A ``--save`` / ``--export-hf`` folder this run may not write (the message names it and why)."""


# The --save folder's rules.


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder name ``step-00000010`` (``None``: not one)."""
    prefix, _, digits = name.partition("-")
    return int(digits) if prefix == "step" and digits.isdigit() else None


def complete_checkpoints(root: Path) -> dict[int, Path]:
    """``{step: folder}`` of the complete checkpoints in a ``--save`` folder."""
    if not root.is_dir():
        return {}
    found = {step_of(p.name): p for p in root.iterdir() if (p / META).is_file()}
    return {step: path for step, path in found.items() if step is not None}


def check_save_folder(save_dir: str, start_step: int, resumed_from: Path | None = None) -> None:
    """A run starting after ``start_step`` completed steps may save into ``save_dir``: it holds no complete
    checkpoint past ``start_step`` (those belong to another run; this one would replace or bury them).

    Raises:
        SaveFolderError: naming the checkpoints and what to do.
    """
    later = sorted(path.name for step, path in complete_checkpoints(Path(save_dir)).items() if step > start_step)
    if later:
        origin = f"--resume {resumed_from}" if resumed_from else "no --resume"
        raise SaveFolderError(f"--save {save_dir} holds checkpoints past step {start_step}, where this run starts "
                              f"({origin}): {', '.join(later)}, written by another run; a run never replaces "
                              f"another's checkpoints nor mixes its own with them: resume from the newest (--resume "
                              f"{save_dir}) or save into another folder")


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux ``/proc``, clock ticks since boot), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict) -> bool | None:
    """Whether the lock's owner still runs (``None``: another host, cannot tell from here)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", -1))
    if os.path.exists("/proc/self/stat"):
        return _process_start(pid) is not None and _process_start(pid) == owner.get("start")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SaveLock:
    """``DIR/.cp-train.lock`` held by one run (see module doc). Use as a context manager around the run.

    Args:
        save_dir: the ``--save`` folder (made if missing).
        program: names the command in messages.

    Raises:
        SaveFolderError: another live run (or one on another host) holds the lock, naming its pid and host.
    """

    def __init__(self, save_dir: str, program: str = "cp-train"):
        self.path = Path(save_dir) / LOCK
        self.program = program
        self.took_over: dict | None = None

    def owner(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}

    def acquire(self) -> SaveLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The lock appears with its content at once (a link of a written file): never empty to a reader.
        staged = self.path.with_name(f"{LOCK}.{os.getpid()}")
        staged.write_text(json.dumps(self.owner()))
        try:
            for _ in range(2):
                try:
                    os.link(staged, self.path)
                    return self
                except FileExistsError:
                    self._refuse_or_clear()
        finally:
            staged.unlink(missing_ok=True)
        raise SaveFolderError(f"--save {self.path.parent}: could not take the lock {self.path} (another run took it "
                              "at the same moment)")

    def _refuse_or_clear(self) -> None:
        try:
            owner = json.loads(self.path.read_text() or "{}")
        except (OSError, json.JSONDecodeError):
            owner = {}
        alive = _alive(owner) if owner else False
        who = f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} since {owner.get('since', '?')}"
        if alive is False:
            self.took_over = owner
            self.path.unlink(missing_ok=True)
            return
        where = "on another host: its liveness cannot be checked from here" if alive is None else "still running"
        raise SaveFolderError(f"--save {self.path.parent} is being written by another {self.program} run ({who}, "
                              f"{where}; lock {self.path}): one writer per folder. Wait for it, save into another "
                              "folder, or delete the lock file if that run is over")

    def __enter__(self) -> SaveLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        try:
            if json.loads(self.path.read_text()).get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, json.JSONDecodeError):
            pass


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(folder: Path) -> list[str]:
    """The files of a checkpoint folder that its checksums cover (every file but ``cp_train.json``), sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != META)


def file_digests(folder: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": hex}}`` of the files ``names`` of ``folder``."""
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)} for name in names}


def verify_files(folder: Path, recorded: dict[str, dict], flag: str, share: tuple[int, int] = (0, 1)) -> None:
    """The files of checkpoint ``folder`` match the ``recorded`` sizes and sha256 (``share = (i, n)``: only
    every n-th file from the i-th, so that n processes split the work).

    Raises:
        SaveFolderError: a missing, truncated or changed file, naming its path and ``flag``.
    """
    for name in sorted(recorded)[share[0]::share[1]]:
        path, want = folder / name, recorded[name]
        if not path.is_file():
            raise SaveFolderError(f"{flag} {folder}: {path} is missing (the checkpoint recorded it)")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise SaveFolderError(f"{flag} {folder}: {path} has {size} bytes, the checkpoint recorded {want['bytes']} "
                                  "(truncated or replaced): the checkpoint is damaged")
        if sha256_of(path) != want["sha256"]:
            raise SaveFolderError(f"{flag} {folder}: {path} does not match its recorded sha256 (its bytes changed "
                                  "after the save): the checkpoint is damaged")


def is_checkpoint_folder(path: Path) -> bool:
    """A checkpoint (``cp_train.json``) or a ``--save`` folder (``latest``, or a checkpoint inside)."""
    return (path / META).is_file() or (path / LATEST).is_file() or (path / LOCK).is_file() or \
        bool(complete_checkpoints(path))


def check_export_target(target: str, save_dir: str | None) -> None:
    """``--export-hf`` may write ``target``: not the ``--save`` folder nor inside or around it, not a
    checkpoint or ``--save`` folder, and new or empty (the export never deletes files it did not write).

    Raises:
        SaveFolderError: naming the folder and the rule.
    """
    path = Path(os.path.abspath(target))
    if save_dir is not None:
        save = Path(os.path.abspath(save_dir))
        if path == save or save in path.parents or path in save.parents:
            raise SaveFolderError(f"--export-hf {target} is, or is inside or around, --save {save_dir}: the export "
                                  "and the checkpoints need folders of their own")
    if not path.exists():
        return
    if not path.is_dir():
        raise SaveFolderError(f"--export-hf {target} is a file: the export writes a folder")
    if is_checkpoint_folder(path):
        raise SaveFolderError(f"--export-hf {target} holds cp-train checkpoints: the export needs a new or empty "
                              "folder")
    held = sorted(p.name for p in path.iterdir())
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise SaveFolderError(f"--export-hf {target} already holds files ({shown}) that this export did not write: "
                              "give a new or empty folder")

# What a checkpoint records (cp_train.json), and resuming from one.


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


def global_batch(config: TrainConfig) -> int:
    """Sequences (static) or documents (dynamic CP) per optimizer step over all ranks."""
    if config.dynamic:
        return config.batch_size * config.world_size
    return config.batch_size * config.data_parallel_size


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
                       "cp_comm_type": config.cp.cp_comm_type, "expert_parallel_size": config.expert_parallel_size,
                       "tp_size": config.tensor_parallel_size}}


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

# Writing and reading a checkpoint with DCP.


def step_name(step: int) -> str:
    return f"step-{step:08d}"


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


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file beside it, fsynced and renamed over it."""
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


def _digests(partial: Path) -> dict[str, dict]:
    """Every file's size and sha256, each rank hashing its share (one object all-gather)."""
    names = [checkpoint_files(partial) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    shares = [None] * world
    dist.all_gather_object(shares, file_digests(partial, names[0][rank::world]))
    return {name: entry for share in shares for name, entry in share.items()}


def save_checkpoint(root: str, step: int, trained, optim, meta: dict) -> Path:
    """Save after ``step`` completed steps (every rank calls it) and publish it atomically (module doc).

    Raises:
        CheckpointError: on every rank when the save failed (the previous checkpoint is untouched), or when
            ``root`` already holds this step (a checkpoint is never replaced).
    """
    root_path, rank = Path(root), dist.get_rank()
    final, partial = root_path / step_name(step), root_path / f".{step_name(step)}.partial"
    error = None
    if rank == 0:
        try:
            root_path.mkdir(parents=True, exist_ok=True)
            if final.exists():
                error = f"--save {root}: {final.name} exists already; a checkpoint is never replaced"
            shutil.rmtree(partial, ignore_errors=True)  # a save of this step that did not finish before
        except OSError as err:
            error = f"--save {root}: cannot write there ({err.strerror or err})"
    _agreed(error)
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(_state(trained, optim, True), storage_writer=dcp.FileSystemWriter(partial))
        files = _digests(partial)
    except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - DCP's (a BaseException) on every rank: one line
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"saving step {step} to {root} failed ({_failure(err)}); the previous checkpoint is "
                              "intact") from None
    error = None
    if rank == 0:
        try:
            write_atomic(partial / META, json.dumps({**meta, "files": files}, indent=1))
            os.rename(partial, final)
            write_atomic(root_path / LATEST, final.name)
        except OSError as err:
            shutil.rmtree(partial, ignore_errors=True)
            error = f"publishing step {step} in {root} failed ({_failure(err)}); the previous checkpoint is intact"
    _agreed(error)
    return final


class CheckpointWriter:
    """The checkpoints of one run in ``root``: saves them and keeps the newest ``keep`` of those **this run
    wrote** (a checkpoint of an earlier run in the folder, the one resumed from included, is never deleted;
    ``latest`` names this run's newest, which is always kept)."""

    def __init__(self, root: str, keep: int):
        self.root, self.keep = root, keep
        self.written: list[Path] = []

    def save(self, step: int, trained, optim, meta: dict) -> Path:
        """:func:`save_checkpoint`, then the pruning of this run's older checkpoints (rank 0)."""
        path = save_checkpoint(self.root, step, trained, optim, meta)
        self.written.append(path)
        stale, self.written = self.written[:-self.keep], self.written[-self.keep:]
        if dist.get_rank() == 0:
            for old in stale:
                shutil.rmtree(old, ignore_errors=True)
        return path


def load_checkpoint(checkpoint: Path, trained, optim, scheduler=None) -> int:
    """Load model and optimizer (and the RNG state, when the world size is the checkpoint's; the
    learning-rate ``scheduler``'s position, when given) into this rank's ``trained`` / ``optim`` (every rank
    calls it; ``scheduler`` built on ``optim`` before); returns the completed step count.

    Raises:
        CheckpointError: a file DCP cannot read, naming the checkpoint (its checksums were verified before
            the ranks started: this is a file changed since, or read failing).
    """
    meta = read_meta(checkpoint)
    same_world = meta["world_size"] == dist.get_world_size()
    state = _state(trained, optim, same_world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint))
    except (Exception, dcp.api.CheckpointException) as err:  # noqa: BLE001 - one line naming the folder
        raise CheckpointError(f"--resume {checkpoint}: reading the checkpoint failed ({_failure(err)})") from None
    set_state_dict(trained, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if same_world:
        torch.set_rng_state(state["rng"][f"rank{dist.get_rank()}"])
    if scheduler is not None and "lr_scheduler" in meta:  # else saved at a constant rate: nothing to restore
        scheduler.load_state_dict(meta["lr_scheduler"])
    return meta["step"]
