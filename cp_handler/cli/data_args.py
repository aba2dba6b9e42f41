"""cp-train's data rules, checked before any rank starts: the corpus exists, is text, and holds the sequences
training and evaluation need. Each error names ``--data``, ``--seq-len`` or ``--eval-batches``."""

from __future__ import annotations

import argparse

from ..training.data import HOLDOUT_FRACTION, check_text_files, collect_files, read_token_stream
from ..training.tokens import has_tokenizer, tokens_for


def check_data(args: argparse.Namespace, eval_dp_size: int, dynamic: bool = False) -> None:
    """The corpus exists and holds enough sequences for training (and for evaluation when it is on).
    Raises ValueError naming --data / --seq-len / --eval-batches."""
    try:
        files = collect_files(args.data)
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None
    if args.data:
        check_text_files(files, args.max_corpus_bytes)
    source = f"--data {' '.join(args.data)}" if args.data else "the stdlib corpus"
    if dynamic:
        if len(files) < 2:
            raise ValueError(f"{source}: --dynamic-cp needs at least two documents (files), found {len(files)}")
        return
    folder = args.hf_model or args.hf_config
    if has_tokenizer(folder):  # the folder's tokenizer: count its tokens (a few seconds at 32 MiB)
        tokens = read_token_stream(files, args.max_corpus_bytes, tokens_for(folder))[0].numel()
    else:
        tokens = min(args.max_corpus_bytes, sum(p.stat().st_size + 1 for p in files))
    sequences = tokens // args.seq_len
    if sequences < 2:
        raise ValueError(f"{source} has {tokens} tokens (--max-corpus-bytes {args.max_corpus_bytes}): too few for two "
                         f"sequences of --seq-len {args.seq_len}")
    if args.eval_every or args.check_eval_cp:
        heldout = sequences - max(1, int(sequences * (1 - HOLDOUT_FRACTION)))
        needed = args.eval_batches * args.batch_size * eval_dp_size
        if needed > heldout:
            raise ValueError(f"--eval-batches {args.eval_batches} x {args.batch_size * eval_dp_size} sequences "
                             f"need {needed} held-out sequences; {source} holds out {heldout} (5% of {sequences}); "
                             "use fewer or a larger corpus")
