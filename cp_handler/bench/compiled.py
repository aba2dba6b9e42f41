"""Compiled vs eager under CP (``cp-bench --modes compile``): the reference GPT's training step (forward +
backward of one sequence's shard) with every layer compiled (:func:`~cp_handler.training.compile.compile_layers`:
Inductor, ``fullgraph=True``, per block) beside the same step eager, at ``--compile-cp-size`` ranks, per comm
type; plus what the compiled forward is made of and what the eager one costs in Python.

Per comm type: one untimed step each way (the compiled one compiles: its seconds are reported), then the median of
``--reps`` steps between barriers (the slowest rank's median: a step waits for it). ``graphs`` / ``breaks``:
``torch._dynamo.explain`` of the whole model's forward (1 / 0: the CP attention is one operator,
:mod:`cp_handler.handlers.opaque`). ``python_calls``: the Python functions of cp_handler entered during one eager
training forward at this rank, steady state (``sys.setprofile``; :func:`python_calls`), per forward and per
attention layer.
``max_abs_diff``: the compiled forward's logits against the eager ones (float32: Inductor reorders sums).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from ..handlers.local import LocalContextParallelHandler
from ..models import GPTConfig, GPTModel
from ..runtime.launch import launch, rank_session
from ..training import masked_token_loss_sum, next_token_batch
from ..training.compile import compile_layers
from .case_progress import case_progress
from .e2e import MODEL
from .hybrid import median_step_s

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_calls(run) -> dict[tuple[str, str], int]:
    """``{(file under cp_handler/, function): calls}`` while ``run()`` runs (``sys.setprofile``: every Python
    function entered, C functions not counted)."""
    calls: dict[tuple[str, str], int] = {}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(_PACKAGE):
            key = (os.path.relpath(frame.f_code.co_filename, _PACKAGE), frame.f_code.co_qualname)
            calls[key] = calls.get(key, 0) + 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return calls


def _case(comm_type: str, seq_len: int, reps: int, group) -> dict:
    config = GPTConfig(**MODEL)
    tokens = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    handler = LocalContextParallelHandler(cp_group=group, cp_comm_type=comm_type)
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    torch.manual_seed(0)
    model = GPTModel(config)

    def step():
        model.zero_grad(set_to_none=True)
        masked_token_loss_sum(model(input_ids, cp_handler=handler), labels, loss_mask).backward()

    row = {"comm_type": comm_type, "seq_len": seq_len, "cp_size": dist.get_world_size()}
    row["eager_s"] = median_step_s(step, reps)
    calls = python_calls(lambda: model(input_ids, cp_handler=handler))  # a training forward, as tests/test_hot_path.py
    with torch.no_grad():
        eager_logits = model(input_ids, cp_handler=handler)
    row["python_calls"] = sum(calls.values())
    row["python_calls_per_layer"] = row["python_calls"] / config.num_layers
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids, cp_handler=handler)
    row["graphs"], row["breaks"] = explained.graph_count, explained.graph_break_count
    torch._dynamo.reset()
    compile_layers(model)
    began = time.perf_counter()
    step()  # compiles
    row["compile_s"] = time.perf_counter() - began
    row["compiled_s"] = median_step_s(step, reps)
    with torch.no_grad():
        row["max_abs_diff"] = (model(input_ids, cp_handler=handler) - eager_logits).abs().max().item()
    return row


def compile_worker(args, threads: int) -> list[dict] | None:
    with rank_session("cp-bench", device_type="cpu", threads=threads):
        cp, rank = dist.get_world_size(), dist.get_rank()
        group = dist.group.WORLD if cp > 1 else None
        rows = []
        bar = case_progress(len(args.compile_comm_types), f"compile cp={cp}", enabled=rank == 0)
        for comm_type in args.compile_comm_types:
            bar.begin(comm=comm_type)
            row = _case(comm_type, args.compile_seq_len, args.reps, group)
            slowest = torch.tensor([row["eager_s"], row["compiled_s"], row["compile_s"]], dtype=torch.float64)
            if group is not None:
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            row["eager_s"], row["compiled_s"], row["compile_s"] = slowest.tolist()
            rows.append(row)
            bar.update(comm=comm_type)
        bar.close()
        return rows if rank == 0 else None


def run(args) -> dict:
    """``--modes compile``: one launch of ``--compile-cp-size`` ranks, every ``--compile-comm-types``."""
    cp = args.compile_cp_size
    rows = launch(compile_worker, cp, args, max(1, args.cores // cp), program="cp-bench")[0]
    return {"model": MODEL, "cores": args.cores, "reps": args.reps, "backend": "inductor", "rows": rows}
