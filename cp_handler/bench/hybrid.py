"""One hybrid layer under CP (``cp-bench --modes hybrid``): the reference model's Gated DeltaNet layer (its short
causal convolution and the gated delta rule, :class:`~cp_handler.models.gated_delta.GatedDeltaNet`), forward +
backward per rank at each CP size, beside the baseline every trainer can write without state passing: all-gather
the sequence, run the layer on the whole of it on every rank, keep this rank's rows (its backward a
reduce-scatter of the input's gradient; exact, ``cp`` times the compute).

Per CP size one launch of ``cp`` ranks with ``max(1, cores // cp)`` threads each; per sequence length one
untimed step, then the median of ``--reps`` steps between barriers (the slowest rank's median is reported: a
step waits for it). Bytes are what this rank sends, forward + backward, counted by ``count_comms`` (the CP
path: the convolution's halo and the delta rule's state summaries; the baseline: the gather and the
reduce-scatter of ``B x S x hidden``); the cross-rank agreement of the handler's checks is not counted.
``max |CP - baseline|`` holds the two outputs to each other (the combined CP output against the baseline's whole
one, float32).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..handlers.local import LocalContextParallelHandler
from ..ops.collectives import all_gather_summed, count_comms
from ..runtime.launch import launch, rank_session
from .case_progress import case_progress


def _layer(args):
    from ..models import GPTConfig
    from ..models.gated_delta import GatedDeltaNet

    torch.manual_seed(0)
    config = GPTConfig(hidden_size=args.hybrid_hidden_size, num_layers=1, num_attention_heads=args.hybrid_heads,
                       num_query_groups=args.hybrid_key_heads, kv_channels=args.hybrid_head_dim,
                       ffn_hidden_size=args.hybrid_hidden_size, layer_types=("linear_attention",))
    return GatedDeltaNet(config, layer_number=1)


def median_step_s(step, reps: int) -> float:
    """One untimed ``step()``, then the median seconds of ``reps`` steps, each started after a barrier of the
    default group."""
    step()  # warm-up
    times = []
    for _ in range(reps):
        dist.barrier()
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _measure(layer, x: torch.Tensor, group, reps: int) -> dict:
    """One sequence ``x (1, S, hidden)``: both paths' bytes sent and median step seconds at this rank, and the
    largest difference of their outputs."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    plain = LocalContextParallelHandler()
    handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", check_ranks=False)
    local = handler.dispatch(x, 1).detach().requires_grad_()
    shard = x[:, rank * x.shape[1] // cp:(rank + 1) * x.shape[1] // cp].clone().requires_grad_()

    def cp_step():
        layer(local, None, handler).sum().backward()

    def gather_step():
        whole = all_gather_summed(shard.transpose(0, 1), group).flatten(0, 1).transpose(0, 1) if cp > 1 else shard
        layer(whole, None, plain)[:, rank * shard.shape[1]:(rank + 1) * shard.shape[1]].sum().backward()

    row = {"cp_size": cp, "seq_len": x.shape[1]}
    for name, step in (("cp", cp_step), ("gather", gather_step)):
        with count_comms() as counter:
            step()
        row[f"{name}_bytes"] = counter.bytes_sent
        row[f"{name}_s"] = median_step_s(step, reps)
    with torch.no_grad():
        got = layer(local, None, handler)
        got = handler.combine(got, 1) if cp > 1 else got
        row["max_abs_diff"] = (got - layer(x, None, plain)).abs().max().item()
    return row


def hybrid_worker(args, threads: int) -> list[dict] | None:
    with rank_session("cp-bench", device_type="cpu", threads=threads):
        cp, rank = dist.get_world_size(), dist.get_rank()
        group = dist.group.WORLD if cp > 1 else None
        layer, rows = _layer(args), []
        bar = case_progress(len(args.hybrid_seq_lens), f"hybrid cp={cp}", enabled=rank == 0)
        for length in args.hybrid_seq_lens:
            bar.begin(S=length)
            x = torch.randn(1, length, args.hybrid_hidden_size, generator=torch.Generator().manual_seed(length))
            row = _measure(layer, x, group, args.reps)
            slowest = torch.tensor([row["cp_s"], row["gather_s"]])
            if group is not None:
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            row["cp_s"], row["gather_s"] = slowest.tolist()
            rows.append(row)
            bar.update(S=length)
        bar.close()
        return rows if rank == 0 else None


def run(args) -> dict:
    """``--modes hybrid``: every ``--hybrid-cp-sizes`` x ``--hybrid-seq-lens`` (launches of cp ranks)."""
    rows = []
    for cp in args.hybrid_cp_sizes:
        rows += launch(hybrid_worker, cp, args, max(1, args.cores // cp), program="cp-bench")[0]
    return {"layer": {"hidden_size": args.hybrid_hidden_size, "value_heads": args.hybrid_heads,
                      "key_heads": args.hybrid_key_heads, "head_dim": args.hybrid_head_dim, "conv_taps": 4},
            "cores": args.cores, "reps": args.reps, "rows": rows}
