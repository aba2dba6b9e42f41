"""cp-train's checkpoint flags (``--save``, ``--save-every``, ``--save-keep``, ``--resume``,
``--allow-data-change``, ``--export-hf``) and their rules, checked before any rank starts
(:mod:`cp_handler.training.checkpoint`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from ..training import TrainConfig
from ..training.checkpoint import check_export_target, check_resume, check_save_folder, find_checkpoint
from ..training.data import collect_files, data_fingerprint
from .common import check_folder


def add_checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints (torch.distributed.checkpoint; docs/cp-train.md)")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save model, optimizer, step and RNG state to DIR/step-N (published atomically; DIR/latest "
                        "names the newest) after the last step and every --save-every steps; one run writes DIR at "
                        "a time (DIR/.cp-train.lock), and DIR may hold no checkpoint past the step the run starts from")
    g.add_argument("--save-every", type=int, default=0, metavar="N", help="also save after every N steps (0: only "
                                                                           "after the last one)")
    g.add_argument("--save-keep", type=int, default=2, metavar="K",
                   help="checkpoints of this run kept in DIR (the newest; earlier runs' are never deleted)")
    g.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from a checkpoint (a --save DIR: its latest; or one step-N folder), at any layout "
                        "(cp, dp, comm type, ep, dynamic CP); --steps counts from the start of the run; its files' "
                        "checksums are verified first")
    g.add_argument("--allow-data-change", action="store_true",
                   help="--resume on other data than the checkpoint's (other --data paths or contents, another "
                        "--max-corpus-bytes): the data position (a step index) continues on the new data")
    g.add_argument("--export-hf", default=None, metavar="DIR",
                   help="after training, write the Hugging Face model (and its tokenizer, if any) with "
                        "save_pretrained into DIR, a new or empty folder (plain transformers loads it); needs "
                        "--hf-config or --hf-model")


def check_resume_folder(args: argparse.Namespace) -> None:
    """``--resume`` names a complete checkpoint (a folder that exists and holds one, or a ``--save`` folder whose
    ``latest`` does); checked before the data is read (its fingerprint takes seconds) and before any rank starts.
    The checkpoint's fit with the run is :func:`check_checkpoints`'. Raises CheckpointError (a ValueError)."""
    if args.resume:
        find_checkpoint(args.resume)


def check_checkpoint_flags(args: argparse.Namespace) -> None:
    """``--save-every`` needs ``--save``; ``--export-hf`` a Hugging Face model and a folder of its own;
    ``--allow-data-change`` a ``--resume``; the folders can be written. Raises ValueError naming the flag."""
    if args.save_every and not args.save:
        raise ValueError(f"--save-every {args.save_every} needs --save DIR")
    if args.allow_data_change and not args.resume:
        raise ValueError("--allow-data-change lets a --resume continue on other data: it needs --resume")
    if args.export_hf and not (args.hf_config or args.hf_model):
        raise ValueError("--export-hf writes a Hugging Face model: it needs --hf-config or --hf-model (the reference "
                         "GPT is saved with --save)")
    if args.save:
        check_folder("--save", args.save, args.save)
    if args.export_hf:
        check_export_target(args.export_hf, args.save)
        check_folder("--export-hf", args.export_hf, os.path.dirname(os.path.abspath(args.export_hf)))


def check_checkpoints(args: argparse.Namespace, config: TrainConfig) -> TrainConfig:
    """The run's data fingerprint (when a checkpoint is read or written), ``--resume`` fits the run (its files
    verified), and the ``--save`` folder holds nothing past the step the run starts from. Returns ``config``
    with the fingerprint. Raises ValueError naming the flag."""
    if not (args.save or args.resume):
        return config
    config = replace(config, data_fingerprint=data_fingerprint(collect_files(args.data), args.max_corpus_bytes))
    checkpoint, start = check_resume(config, args.resume) if args.resume else (None, 0)
    if args.save:
        check_save_folder(args.save, start, checkpoint)
    return config
