"""Checkpoints of ``cp-train`` (``--save`` / ``--resume``) with ``torch.distributed.checkpoint`` (DCP).

A checkpoint holds the model, the optimizer state (AdamW's moments, its step count and learning
rate), every rank's RNG state, and ``cp_train.json`` (:mod:`.checkpoint_meta`: the step, the scheduler, what
the model and data were, every file's size and sha256). DCP writes each tensor once (parameters replicated
over dp x cp are deduplicated; each expert shard is written by a rank that holds it), and reads back at any
layout: another CP size, data-parallel size, comm type, expert-parallel size, or dynamic CP.

Layout of ``--save DIR``: ``DIR/step-00000010/`` (one complete checkpoint each), ``DIR/latest`` (the
name of the newest complete one). A save writes ``DIR/.step-00000010.partial/`` first; every rank hashes
its share of the files, then rank 0 adds ``cp_train.json`` and renames the folder into place (an atomic
rename onto a name that does not exist: a run never re-saves a step), and only then points ``latest`` at it
(a temporary file renamed). A rank killed during a save leaves a ``.partial`` folder, which nothing reads;
``latest`` still names the previous checkpoint. :class:`CheckpointWriter` prunes only checkpoints its own
run wrote (:mod:`.save_folder` has the folder's rules: one writer, a run owns what it writes).

Errors (:class:`CheckpointError`, a ``ValueError``): ``--resume`` of a missing, partial, damaged or
incompatible checkpoint, checked before any rank starts (:func:`~.checkpoint_meta.check_resume`); a save
that fails (disk full: named as such) on every rank, with the previous checkpoint intact; a step that
already exists (never replaced).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint_meta import CheckpointError, read_meta
from .save_folder import LATEST, META, checkpoint_files, file_digests

# torch.distributed.checkpoint is imported inside the functions that save and load: imported here it
# would cost every launch and rank 0.5 s of start-up.


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
