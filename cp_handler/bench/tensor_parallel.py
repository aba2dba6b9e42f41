"""``cp-bench --modes tp``: tensor parallelism x context parallelism, timed on this machine: a ``cp-train`` run of
the e2e mode's reference GPT (:data:`~.e2e.MODEL`) at every TP x CP layout of ``--tp-world`` ranks (each ``tp``
dividing the world and the model's heads, ``cp = world / tp``), with and without sequence parallelism for ``tp``
above 1: mean tokens/s after the first step and peak RSS per rank, from the run's metrics; the equivalent ``cp-train``
command is recorded with each row.

What the figures are: the ranks share this machine's cores (4 ranks on 2 cores by default) and talk over gloo on
loopback, so a layout's time is its total work plus its collectives' cost on this machine, not a GPU's: TP adds an
all-reduce of the activations per block in each direction (or an all-gather and a reduce-scatter with sequence
parallelism; :mod:`cp_handler.training.tensor_parallel`), CP its pattern's K / V traffic. No GPU has run TP x CP
(pending).
"""

from __future__ import annotations

from ..cli.args import parse
from ..training.run import run_training
from .case_progress import each_case
from .e2e import MODEL


def layouts(world: int) -> list[tuple[int, int, bool]]:
    """``(tp, cp, sequence_parallel)`` for every ``tp`` dividing ``world`` and the model's query and key-value heads
    (or divided by the key-value heads: replicated), ``cp = world / tp``; sequence parallelism on and off above tp 1."""
    heads, kv = MODEL["num_attention_heads"], MODEL["num_query_groups"]
    tps = [tp for tp in range(1, world + 1) if world % tp == 0 and heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]
    return [(tp, world // tp, sp) for tp in tps for sp in ((False, True) if tp > 1 else (False,))]


def command(world: int, tp: int, cp: int, sequence_parallel: bool, seq_len: int, steps: int) -> list[str]:
    """The ``cp-train`` flags of one layout's run."""
    return ["--nproc", str(world), "--tp-size", str(tp), "--cp-size", str(cp), "--cp-comm-type", "p2p",
            "--seq-len", str(seq_len), "--batch-size", "1", "--steps", str(steps),
            "--hidden-size", str(MODEL["hidden_size"]), "--num-layers", str(MODEL["num_layers"]),
            "--num-heads", str(MODEL["num_attention_heads"]), "--num-kv-heads", str(MODEL["num_query_groups"]),
            "--ffn-hidden-size", str(MODEL["ffn_hidden_size"]), "--max-corpus-bytes", "2000000",
            *(["--sequence-parallel"] if sequence_parallel else [])]


def run(args) -> dict:
    """Every layout of :func:`layouts` at ``args.tp_world`` ranks, ``args.tp_seq_len`` tokens, ``args.tp_steps``
    steps; a progress line per run."""
    rows = []
    for tp, cp, sp in each_case(layouts(args.tp_world), "tp",
                                lambda c: f"tp {c[0]} x cp {c[1]}{' sequence parallel' if c[2] else ''}"):
        flags = command(args.tp_world, tp, cp, sp, args.tp_seq_len, args.tp_steps)
        config, _ = parse(flags)
        metrics = run_training(config)
        rows.append({"tp": tp, "cp": cp, "sequence_parallel": sp, "seq_len": args.tp_seq_len, "steps": args.tp_steps,
                     "command": "cp-train " + " ".join(flags), "tokens_per_s": metrics["tokens_per_s_mean"],
                     "memory_kind": metrics["memory_kind"],
                     "peak_memory_bytes_per_rank": metrics["peak_memory_bytes_per_rank"]})
    return {"model": MODEL, "world": args.tp_world, "rows": rows}
