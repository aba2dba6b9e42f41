"""What a ``cp-train`` run reads and writes on disk, beside the training itself: ``--resume``, the
checkpoint callback of ``--save`` / ``--save-every``, the ``--save`` folder's lock, ``--export-hf``, and the
``cp-generate`` command that continues a prompt from what the run saved."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time

import torch.distributed as dist

from ..launch import is_first_rank
from .checkpoint import CheckpointWriter, load_checkpoint
from .checkpoint_meta import CheckpointError, check_resume, run_meta
from .config import TrainConfig
from .file_modes import new_folder_mode
from .fsdp import full_state, is_sharded
from .parity import unwrap
from .save_folder import SaveLock
from .tokens import has_tokenizer, tokens_for


def say(text: str) -> None:
    """``cp-train: text`` on stderr, from rank 0 only."""
    if dist.get_rank() == 0:
        print(f"cp-train: {text}", file=sys.stderr)


def checkpointing(config: TrainConfig, trained, optim, scheduler) -> tuple[int, object]:
    """``(steps already done, checkpoint callback for train_steps)``: loads ``--resume`` into ``trained`` /
    ``optim`` / the learning-rate ``scheduler`` (every rank), and saves after every ``--save-every`` steps
    and after the last one."""
    start = 0
    if config.resume:
        checkpoint, _ = check_resume(config, config.resume, type(optim).__name__, verify=False)  # verified at launch
        began = time.perf_counter()
        start = load_checkpoint(checkpoint, trained, optim, scheduler)
        say(f"resumed from {checkpoint} after step {start} (loaded in {time.perf_counter() - began:.2f} s)")
    if not config.save_dir:
        return start, None
    meta = run_meta(config, 0, type(optim).__name__)  # read once (a Hugging Face config from disk)
    writer = CheckpointWriter(config.save_dir, config.save_keep)

    def save(done: int) -> None:
        if done == config.steps or (config.save_every and done % config.save_every == 0):
            began = time.perf_counter()
            path = writer.save(done, trained, optim, {**meta, "step": done, "lr_scheduler": scheduler.state_dict()})
            size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
            say(f"saved {path} ({size:.1f} MiB) in {time.perf_counter() - began:.2f} s")
    return start, save


def export_hf(config: TrainConfig, trained) -> None:
    """``--export-hf``: rank 0 writes the Hugging Face model (and the tokenizer it was trained with, if
    any) with ``save_pretrained`` into a new temporary folder beside the target, renamed onto the target
    (new or empty: :func:`~.save_folder.check_export_target`, checked before the ranks started) when
    complete; plain transformers loads it. Nothing the export did not write is deleted.

    Raises:
        CheckpointError: the target received files since the launch (the export is left unpublished).
    """
    if not config.export_hf:
        return
    state = full_state(trained) if is_sharded(trained) else None  # FSDP: every rank sends its shards
    if dist.get_rank() != 0:
        return
    target = os.path.abspath(config.export_hf)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=os.path.dirname(target))
    try:
        os.chmod(partial, new_folder_mode())  # mkdtemp's 0700 would stay after the rename: the umask's mode
        unwrap(trained).model.save_pretrained(
            partial, state_dict=None if state is None else {k.removeprefix("model."): v for k, v in state.items()})
        if has_tokenizer(config.hf_source):  # the tokens it was trained on go with it (cp-generate reads them)
            tokens_for(config.hf_source).tokenizer.save_pretrained(partial)
        os.rename(partial, target)  # onto a missing or empty folder only
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"--export-hf {config.export_hf}: could not publish the export ({err.strerror or err}); "
                              "the folder was left as it was") from None
    say(f"exported the Hugging Face model to {target}")


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
    return shlex.join([*command_of("cp-generate", "cp_handler.cli.generate"), *source, "--prompt", GENERATE_PROMPT,
                       "--max-new-tokens", "64"])


def save_lock(config: TrainConfig) -> SaveLock | None:
    """The ``--save`` folder's lock (:class:`~.save_folder.SaveLock`) taken for the run by the launcher (under
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
