"""``cp-train``: train the reference GPT context-parallel on real text.

World = dp x cp (CP groups on adjacent ranks). Each step every DP replica takes its slice of the
global batch, shards it over its CP group with the handler, and the loss is token-weighted over
all ranks; gradients are reduced over all dp x cp ranks by torch DDP.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import resource
import signal
import sys
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from models import GPTModel

from ..config import ContextParallelConfig
from ..dynamic import GroupPool
from ..groups import data_context_parallel_groups, destroy_process_groups
from ..handlers import MagiAttnContextParallelHandler, get_cp_handler_cls
from ..integrations.transformers import CPCausalLM
from ..training import global_token_count, masked_token_loss_sum, next_token_batch
from .args import attention_shape, hf_config, model_config, parallel_layout, parse, world_size_from
from .data import Batch, SequenceBatches, collect_files, read_token_stream
from .dynamic_train import dynamic_step, load_documents, reference_dynamic_step
from .evaluation import build_evaluators, check_eval_cp, periodic_eval, report_eval_check
from .launch import heartbeat, launch
from .moe_train import ExpertGroups
from .parity import StepReference, parity_result
from .progress import Progress


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The reference GPT, or a Hugging Face causal LM (``--hf-config`` / ``--hf-model``) wrapped in
    :class:`~cp_handler.integrations.transformers.CPCausalLM`: the same on every rank (seeded)."""
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    if args.hf_model or args.hf_config:
        from transformers import AutoModelForCausalLM

        if args.hf_model:
            model = AutoModelForCausalLM.from_pretrained(args.hf_model, local_files_only=True, torch_dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(hf_config(args), torch_dtype=dtype)
        return CPCausalLM(model).to(device=device, dtype=dtype)
    return GPTModel(model_config(args)).to(device=device, dtype=dtype)


def load_batches(args: argparse.Namespace) -> SequenceBatches:
    stream, doc_starts = read_token_stream(collect_files(args.data), args.max_corpus_bytes)
    max_doc_len = (args.thd_max_doc_len or max(1, args.seq_len // 4)) if args.packing == "thd" else None
    return SequenceBatches(stream, doc_starts, args.seq_len, args.seed, max_doc_len=max_doc_len)


def documents_per_sequence(batches: SequenceBatches, global_batch: int, steps: int) -> str:
    """Documents per sequence over the first (up to 10) global batches, for the thd log line."""
    counts = [cu.numel() - 1 for step in range(min(steps, 10)) for cu in batches.global_batch(step, global_batch)
              .cu_seqlens]
    return f"{sum(counts) / len(counts):.1f} documents per sequence (min {min(counts)}, max {max(counts)})"


def handler_inputs(batch: Batch, packing: str, device) -> tuple[torch.Tensor, dict]:
    """Global tokens of this rank's rows and the handler's batch metadata (thd: ``cu_seqlens``)."""
    if packing == "thd":
        tokens, cu_seqlens = batch.packed()
        return tokens.to(device), {"qkv_format": "thd", "cu_seqlens": cu_seqlens.to(device)}
    return batch.tokens.to(device), {"qkv_format": "bshd"}


def static_step(model, args, batches, make_handler, global_batch: int, rows: slice, count_group, grad_scale: float,
                device, experts: ExpertGroups | None = None):
    """One step's forward/backward at a fixed CP layout: this DP replica's ``rows`` of the global batch.
    MoE models add their load-balancing loss and reduce gradients with ``experts``.
    Returns ``(local loss share, global tokens)``."""
    def run(step: int):
        tokens, metadata = handler_inputs(batches.global_batch(step, global_batch).rows(rows), args.packing, device)
        handler = make_handler(**metadata)
        moe = experts.handler() if experts else None
        input_ids, labels, loss_mask = next_token_batch(handler, tokens)
        loss_sum = masked_token_loss_sum(model(input_ids, cp_handler=handler, moe_handler=moe), labels, loss_mask)
        loss = loss_sum / global_token_count(loss_mask, count_group) + (sum(moe.aux_losses) if moe else 0.0)
        (loss * grad_scale).backward()
        if experts:
            experts.reduce_gradients(model)
        return loss.detach(), global_batch * args.seq_len
    return run


def local_grad_norm(model) -> float:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()


def train_steps(model, args, run_step, count_group, progress: bool, after_step=None, grad_norm_fn=None,
                reference=None) -> list[dict]:
    """Run ``args.steps`` optimizer steps; ``run_step(step)`` does the forward/backward (gradients
    reduced when it returns) and returns ``(this rank's share of the loss, global tokens)``.
    Records per step: loss (token-weighted over the global batch), global gradient norm, time.
    ``after_step(step)`` may return a dict merged into the step's record (evaluation); ``grad_norm_fn(model)``
    replaces the local gradient norm (sharded experts); ``reference(step, model)`` (``--check-parity``,
    :class:`.parity.StepReference`) runs before the optimizer step and its dict is merged too.
    Each step ends with a heartbeat for the launcher's watchdog (:func:`.launch.heartbeat`)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    records = []
    bar = Progress(args.steps, "cp-train: step", enabled=progress, every=args.log_every)
    for step in range(args.steps):
        start = time.perf_counter()
        loss, tokens = run_step(step)
        grad_norm = (grad_norm_fn or local_grad_norm)(model)
        checked = reference(step, model) if reference else {}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.double()
        if count_group is not None:
            dist.all_reduce(reported, group=count_group)
        elapsed = time.perf_counter() - start
        records.append({"step": step, "loss": reported.item(), "grad_norm": grad_norm, "step_time_s": elapsed,
                        "tokens_per_s": tokens / elapsed})
        records[-1].update(checked)
        records[-1].update((after_step and after_step(step)) or {})
        heartbeat()
        shown = {"loss": f"{reported.item():.4f}", "tok_s": f"{records[-1]['tokens_per_s']:.0f}",
                 **({"eval": f"{records[-1]['eval_loss']:.4f}"} if "eval_loss" in records[-1] else {})}
        bar.update(**shown)
    bar.close()
    return records


def model_shape_kwargs(handler_cls, config) -> dict:
    """Backends that plan with the attention shape (MagiAttention) get it at construction."""
    if issubclass(handler_cls, MagiAttnContextParallelHandler):
        return {"num_heads_q": config.num_attention_heads, "num_heads_kv": config.num_query_groups,
                "head_dim": config.kv_channels}
    return {}


def peak_memory_bytes(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "cuda_max_memory_allocated", torch.cuda.max_memory_allocated(device)
    return "cpu_peak_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def step_reference(args, global_batch: int | None, device, handler_cls, sharded_experts: bool) -> StepReference:
    """``--check-parity``: the single-process reference of every step (a full model on rank 0)."""
    model = build_model(args, device) if dist.get_rank() == 0 else None
    if model is None:
        run = None
    elif args.dynamic_cp:
        run = reference_dynamic_step(model, args, load_documents(args), handler_cls, device)
    else:
        experts = ExpertGroups.local(args.moe_experts) if args.moe_experts else None
        run = static_step(model, args, load_batches(args), lambda **meta: handler_cls(cp_group=None, **meta),
                          global_batch, slice(None), None, 1.0, device, experts)
    return StepReference(model, run, local_grad_norm, sharded_experts)


def _log_to_stderr() -> None:
    """Show cp_handler's INFO logs (group layouts) on stderr."""
    log = logging.getLogger("cp_handler")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def _inject_failure(rank: int) -> None:
    """Fault injection for tests: CP_TRAIN_FAIL_RANK=r makes rank r raise before training;
    CP_TRAIN_FREEZE_RANK=r stops rank r (SIGSTOP) before training, as a hung process would."""
    if os.environ.get("CP_TRAIN_FAIL_RANK") == str(rank):
        raise RuntimeError(f"injected failure on rank {rank} (CP_TRAIN_FAIL_RANK)")
    if os.environ.get("CP_TRAIN_FREEZE_RANK") == str(rank):
        os.kill(os.getpid(), signal.SIGSTOP)


def _inject_rope_bug(handler_cls, rank: int):
    """Bug injection for tests of --check-parity: CP_TRAIN_ROPE_BUG_RANK=r gives rank r's tokens RoPE
    positions shifted by one (a real off-by-one a CP implementation can make)."""
    if os.environ.get("CP_TRAIN_ROPE_BUG_RANK") != str(rank):
        return handler_cls

    class OffByOne(handler_cls):
        def get_emb_on_this_cp_rank(self, emb):
            return super().get_emb_on_this_cp_rank(torch.roll(emb, 1, 0))
    return OffByOne


@record
def worker(args: argparse.Namespace, cp_config: ContextParallelConfig) -> dict | None:
    """One rank of ``cp-train``. Returns the metrics on rank 0, ``None`` elsewhere."""
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    _log_to_stderr()
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None,
                            timeout=datetime.timedelta(seconds=args.timeout))
    heartbeat()
    try:
        return _train_rank(args, cp_config, device)
    finally:
        destroy_process_groups()


def _train_rank_dynamic(args, cp_config: ContextParallelConfig, device: torch.device) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    pool = GroupPool(device.type)
    model = build_model(args, device)
    handler_cls = get_cp_handler_cls(cp_config.backend, cp_config.cp_comm_type)
    if rank == 0:
        print(f"cp-train: dynamic CP over {world} ranks, max_seqlen_per_rank {args.max_seqlen_per_rank}, "
              f"min CP size {args.min_cp_size}, documents capped at {args.seq_len} tokens, backend "
              f"{cp_config.backend}, device {device.type}", file=sys.stderr)
    run = dynamic_step(model, args, load_documents(args), pool, handler_cls, cp_config.cp_comm_type, device)
    reference = step_reference(args, None, device, handler_cls, False) if args.check_parity else None
    records = train_steps(model, args, run, dist.group.WORLD, progress=rank == 0, reference=reference)
    return _finish(args, cp_config, records, None, world, device, None, {"dp_size": None, "cp_size": "dynamic"})


def _train_rank(args, cp_config: ContextParallelConfig, device: torch.device) -> dict | None:
    if args.dynamic_cp:
        return _train_rank_dynamic(args, cp_config, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = parallel_layout(args, world, cp_config.context_parallel_size)
    if args.print_layout and rank == 0:
        print(layout.describe(), file=sys.stderr)
    built = layout.build(device.type)  # one DeviceMesh for the CP and the expert groups
    groups = data_context_parallel_groups(built)
    _inject_failure(rank)
    model = build_model(args, device)
    experts = ExpertGroups(args.moe_experts, built) if args.moe_experts else None
    if experts:  # each rank holds its experts: gradients reduced by ExpertGroups, not DDP
        model.shard_experts(experts.handler().local_expert_ids)
        ddp, grad_scale, grad_norm_fn = model, 1.0, experts.grad_norm
    else:  # DDP averages gradients over the world; the loss is already normalised by the global token count
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        grad_scale, grad_norm_fn = float(world), None
    handler_cls = _inject_rope_bug(get_cp_handler_cls(cp_config.backend, cp_config.cp_comm_type), rank)
    extra = model_shape_kwargs(handler_cls, attention_shape(args))
    make_handler = lambda **meta: handler_cls(cp_group=groups.cp_group, cp_comm_type=cp_config.cp_comm_type,
                                              hierarchical_cp_groups=groups.hierarchical_cp_groups, **extra, **meta)
    rows = slice(groups.dp_rank * args.batch_size, (groups.dp_rank + 1) * args.batch_size)
    if rank == 0:
        moe = f", {args.moe_experts} experts over ep {args.expert_parallel_size}" if experts else ""
        print(f"cp-train: world {world} = dp {groups.dp_size} x cp {groups.cp_size}, backend {cp_config.backend}, "
              f"cp_comm_type {cp_config.cp_comm_type}, packing {args.packing}, device {device.type}{moe}",
              file=sys.stderr)
    global_batch = args.batch_size * groups.dp_size
    batches = load_batches(args)
    if rank == 0 and args.packing == "thd":
        print(f"cp-train: thd packs {documents_per_sequence(batches, global_batch, args.steps)}", file=sys.stderr)
    at_train, at_eval = build_evaluators(args, cp_config, groups, device.type)
    evaluating = args.eval_every or args.check_eval_cp
    heldout = batches.heldout_batches(args.eval_batches, args.batch_size * at_eval.groups.dp_size) if evaluating else []

    def eval_inputs(batch):
        tokens, metadata = handler_inputs(batch, args.packing, device)
        return tokens, {**extra, **metadata}

    after_step = periodic_eval(args, at_eval, ddp, heldout, eval_inputs)
    run = static_step(ddp, args, batches, make_handler, global_batch, rows, dist.group.WORLD, grad_scale, device,
                      experts)
    plain_cls = get_cp_handler_cls(cp_config.backend, cp_config.cp_comm_type)
    reference = step_reference(args, global_batch, device, plain_cls, experts is not None) \
        if args.check_parity else None
    records = train_steps(ddp, args, run, dist.group.WORLD, progress=rank == 0, after_step=after_step,
                          grad_norm_fn=grad_norm_fn, reference=reference)
    eval_check = check_eval_cp(args, at_train, at_eval, ddp, heldout[0], eval_inputs) if args.check_eval_cp else None
    return _finish(args, cp_config, records, eval_check, world, device, global_batch,
                   {"dp_size": groups.dp_size, "cp_size": groups.cp_size})


def _finish(args, cp_config, records, eval_check, world, device, global_batch, layout: dict) -> dict | None:
    """Gather memory, assemble rank 0's metrics, run the requested checks."""
    memory_kind, peak = peak_memory_bytes(device)
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() != 0:
        return None
    metrics = {"config": vars(args), "cp_config": asdict(cp_config), "world_size": world, **layout,
               "device": device.type, "steps": records, "tokens_per_s_mean": _mean_tokens_per_s(records),
               "memory_kind": memory_kind, "peak_memory_bytes_per_rank": peaks}
    if eval_check is not None:
        metrics["eval_cp_check"] = eval_check
        report_eval_check(eval_check)
    if args.check_parity:
        metrics["parity"] = parity_result(records, args.dtype)
    return metrics


def write_json_atomically(path: str, data: dict) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``: a reader (or a
    full disk) never sees a truncated file; the previous file stays until the new one is whole."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".metrics-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(data, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _mean_tokens_per_s(records: list[dict]) -> float:
    timed = records[1:] or records  # the first step includes warm-up
    return sum(r["tokens_per_s"] for r in timed) / len(timed)


def main(argv: list[str] | None = None) -> int:
    args, cp_config = parse(argv)
    results = launch(worker, world_size_from(args), args, cp_config, timeout=args.timeout)
    metrics = results.get(0)
    if metrics is None:  # a non-zero rank under torchrun
        return 0
    first, last = metrics["steps"][0]["loss"], metrics["steps"][-1]["loss"]
    print(f"cp-train: loss {first:.4f} -> {last:.4f} over {len(metrics['steps'])} steps, "
          f"{metrics['tokens_per_s_mean']:.0f} tokens/s", file=sys.stderr)
    if args.metrics_out:
        write_json_atomically(args.metrics_out, metrics)
        print(f"cp-train: metrics written to {os.path.abspath(args.metrics_out)}", file=sys.stderr)
    checks = [metrics.get(name, {"passed": True})["passed"] for name in ("parity", "eval_cp_check")]
    return 0 if all(checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
