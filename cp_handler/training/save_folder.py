"""The ``--save`` folder's rules: one writer at a time, a run owns what it writes, checksums of every file.

* **One writer** (:class:`SaveLock`): a run that saves holds ``DIR/.cp-train.lock`` (its pid, host and the
  process's start time) from before its ranks start to its end. A second run with the same ``--save`` is
  refused naming the owner; a lock whose process is gone (same host: the pid is not running, or runs another
  program started at another time) is stale: it is taken over and named.
* **A run owns what it writes**: a run starts only when the folder holds no complete checkpoint past the step
  it starts from (:func:`check_save_folder`; another run's later checkpoints are refused by name, never
  replaced), and it prunes only checkpoints it wrote itself (:class:`~.checkpoint.CheckpointWriter`).
* **Checksums** (:func:`file_digests`, :func:`verify_files`): the sha256 and size of every file of a
  checkpoint are recorded in its ``cp_train.json``; a resume verifies them first and names the damaged file.
* **Export targets** (:func:`check_export_target`): ``--export-hf`` writes a new or empty folder only; never
  one that is or holds a checkpoint, never a folder with files it did not write.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".cp-train.lock"
META = "cp_train.json"
LATEST = "latest"
CHUNK = 8 << 20


class SaveFolderError(ValueError):
    """A ``--save`` / ``--export-hf`` folder this run may not write (the message names it and why)."""


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
