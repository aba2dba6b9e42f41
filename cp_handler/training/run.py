"""Starting a training run: the ranks (:func:`run_training`, spawned or under torchrun), each running a
:class:`~.trainer.Trainer` (:func:`train_rank`); the ``--save`` folder's lock (:func:`save_lock`); and the
``cp-generate`` command that continues a prompt from what the run saved (:func:`generate_command`).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ..handlers.registry import load_plugins
from ..runtime.forking import HF_RANK_IMPORTS, RANK_IMPORTS
from ..runtime.launch import is_first_rank, launch, rank_session, under_torchrun
from .build import say
from .checkpoint import SaveLock
from .config import TrainConfig
from .trainer import Trainer


def command_of(script: str, module: str) -> list[str]:
    """How to run this installation's console ``script``: its name when the PATH finds this Python's, its path
    beside this Python when the PATH finds another (or none), else ``python -m module``."""
    beside = os.path.join(os.path.dirname(sys.executable), script)
    found = shutil.which(script)
    if os.path.isfile(beside):
        return [script] if found and os.path.samefile(found, beside) else [beside]
    return [script] if found else [sys.executable, "-m", module]


GENERATE_PROMPT = "def main():"
"""The prompt of the printed cp-generate command (the default corpus is the Python stdlib's sources)."""


def generate_command(config: TrainConfig) -> str | None:
    """The ``cp-generate`` command that continues a prompt from the run's final checkpoint (``--save``: the
    reference GPT; ``--export-hf``: a Hugging Face model), or ``None`` when the run saved nothing it reads
    (cp-generate does not decode the GPT's linear-attention layers)."""
    if config.save_dir and config.model is not None and "linear_attention" not in (config.model.layer_types or ()):
        source = ["--checkpoint", config.save_dir]
    elif config.export_hf:
        source = ["--hf-model", config.export_hf]
    else:
        return None
    return shlex.join([*command_of("cp-generate", "cp_handler.cli.generate"), *source, "--nproc",
                       str(config.world_size), "--prompt", GENERATE_PROMPT, "--max-new-tokens", "64",
                       *GENERATE_SAMPLING])


GENERATE_SAMPLING = ("--temperature", "0.7", "--top-k", "20", "--seed", "0")
"""Sampling in the printed command: greedy decoding of a briefly trained byte-level model repeats its most likely
byte, a space (indentation, the most frequent byte of Python sources), and printed a blank continuation."""
GENERATE_NOTE = ("a model trained briefly continues mostly with spaces and fragments (the most frequent bytes of "
                 "Python sources); more --steps teach it more")


def save_lock(config: TrainConfig) -> SaveLock | None:
    """The ``--save`` folder's lock (:class:`~.checkpoint.SaveLock`) taken for the run by the launcher (under
    torchrun: by rank 0); a stale lock taken over is named on stderr.

    Raises:
        SystemExit: another run writes the folder (named).
    """
    if not config.save_dir or not is_first_rank():
        return None
    lock = SaveLock(config.save_dir)
    try:
        lock.acquire()
    except ValueError as err:
        raise SystemExit(f"cp-train: error: {err}") from None
    if lock.took_over:
        owner = lock.took_over
        print(f"cp-train: --save {config.save_dir}: took over a stale lock (pid {owner.get('pid')} on "
              f"{owner.get('host')} since {owner.get('since')} is no longer running)", file=sys.stderr)
    return lock


def _log_to_stderr() -> None:
    """Show cp_handler's INFO logs (group layouts) on stderr."""
    log = logging.getLogger("cp_handler")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


@record
def train_rank(config: TrainConfig, optimizer=None) -> dict | None:
    """One rank of a run (spawned, or started by torchrun): the metrics on rank 0, ``None`` elsewhere.

    Args:
        optimizer: ``params -> torch.optim.Optimizer`` (picklable); default AdamW at ``config.lr``.
    """
    load_plugins()
    _log_to_stderr()
    # the deterministic mode: one thread per CPU rank at every degree (some CPU kernels' bits follow the thread count:
    # the flash kernel at head dim 8 on thd packs, measured 2026-12-06)
    with rank_session("cp-train", config.timeout, threads=1 if config.cp.deterministic else None) as device:
        metrics = Trainer(config, device, optimizer).fit()
        say("the ranks stop")  # releasing the process groups and the launcher's exit take a few seconds
        return metrics


def run_training(config: TrainConfig, optimizer=None) -> dict | None:
    """Start the run's ranks (spawned, or this process as one rank under torchrun) and return rank
    0's metrics (``None`` on the other ranks under torchrun); with ``--save`` (or ``--export-hf``) rank 0 then
    prints the ``cp-generate`` command that continues a prompt from the final checkpoint.

    Raises:
        SystemExit: a rank failed or stalled (:func:`~cp_handler.runtime.launch.launch`).
    """
    lock = save_lock(config)
    if is_first_rank() and not under_torchrun():
        print(f"cp-train: starting {config.world_size} rank{'s' * (config.world_size > 1)}", file=sys.stderr,
              flush=True)
    preload = RANK_IMPORTS + (HF_RANK_IMPORTS if config.hf_source else ())
    try:
        metrics = launch(train_rank, config.world_size, config, optimizer, timeout=config.timeout,
                         preload=preload).get(0)
    finally:
        if lock is not None:
            lock.release()
    command = generate_command(config) if metrics is not None else None
    if command:
        print(f"cp-train: continue a prompt from the final checkpoint: {command}", file=sys.stderr)
        if config.model is not None:
            print(f"cp-train: ({GENERATE_NOTE})", file=sys.stderr)
    return metrics
