"""What the commands (``cp-train``, ``cp-generate``) share: the rules checked before any rank starts (number
flags, the world size, folders that must take a new file; each error names the flag, its value and the rule)
and the atomic JSON output of their reports."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

from ..runtime.launch import rank_env
from ..training.file_modes import new_file_mode


def check_numbers(args: argparse.Namespace, positive=(), non_negative=(), positive_floats=(),
                  non_negative_floats=()) -> None:
    """Integer flags ``positive`` >= 1 when given (zero is never "the default"), ``non_negative`` >= 0; float
    flags ``positive_floats`` finite and > 0 (``--timeout nan`` would never fire, ``--lr nan`` trains on NaN),
    ``non_negative_floats`` finite and >= 0.

    Raises:
        ValueError: naming the first flag that breaks its rule.
    """
    def flag(name: str) -> str:
        return f"--{name.replace('_', '-')}"

    for name in positive:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"{flag(name)} {value} must be >= 1")
    for name in non_negative:
        if getattr(args, name) < 0:
            raise ValueError(f"{flag(name)} {getattr(args, name)} must be >= 0")
    for name in positive_floats:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag(name)} {value} must be a finite number > 0")
    for name in non_negative_floats:
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag(name)} {value} must be a finite number >= 0")


def world_size_from(args: argparse.Namespace) -> int:
    """The run's world size: ``WORLD_SIZE`` under torchrun, else ``--nproc`` (default 1)."""
    env = rank_env()
    if env is not None:
        return env.world_size
    return args.nproc if args.nproc is not None else 1


def check_writable(flag: str, path: str | None) -> None:
    """The file ``path`` (``flag``'s value) can be written: its folder exists or can be made, and takes a new
    file; checked before any rank starts instead of failing after the work. Raises ValueError."""
    if path is not None:
        check_folder(flag, path, os.path.dirname(os.path.abspath(path)))


def check_folder(flag: str, value: str, folder: str) -> None:
    """``folder`` exists or can be made, and takes a new file. Raises ValueError naming ``flag``."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".cp-check-"):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {value}: cannot write in {folder} ({err.strerror or err})") from None


def write_json_atomically(path: str, data: dict) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``: a reader (or a
    full disk) never sees a truncated file; the previous file stays until the new one is whole. The file gets
    the mode the umask gives a new file (:func:`~cp_handler.training.file_modes.new_file_mode`).

    Raises:
        OSError: with the path in the message (e.g. the disk is full); the previous file is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".metrics-", suffix=".json")
    try:
        os.fchmod(handle, new_file_mode())  # mkstemp's 0600 would stay after the rename: the umask's mode
        with os.fdopen(handle, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def write_output(program: str, flag: str, path: str, data: dict) -> bool:
    """Write a command's JSON output (:func:`write_json_atomically`); on failure print one line naming ``flag``,
    the file and the reason (the previous file is unchanged) and return False."""
    try:
        write_json_atomically(path, data)
    except OSError as err:
        print(f"{program}: error: could not write {flag} {os.path.abspath(path)}: {err.strerror or err}; the previous "
              "file there (if any) is unchanged", file=sys.stderr)
        return False
    return True
