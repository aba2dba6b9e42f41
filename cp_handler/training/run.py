"""One training run: every rank's work (:func:`train_rank`) and starting the ranks (:func:`run_training`).

World = dp x cp (CP groups on adjacent ranks). Each step every DP replica takes its slice of the
global batch, shards it over its CP group with a handler (:func:`~cp_handler.handlers.build_cp_handler`),
and the loss is token-weighted over all ranks; gradients are reduced over all dp x cp ranks by torch
DDP (MoE: by :class:`~.experts.ExpertGroups`; dynamic CP: one all-reduce per global batch).
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from ..dynamic import GroupPool
from ..groups import data_context_parallel_groups
from ..handlers.registry import load_plugins
from ..launch import launch, rank_session
from ..models import GPTModel
from ..parallel_layout import ParallelLayout
from ..tiling import tile_mlps
from .config import TrainConfig
from .evaluation import build_evaluators, check_eval_cp, periodic_eval, report_eval_check
from .experts import ExpertGroups
from .fsdp import shard_model, state_bytes
from .loop import default_optimizer, local_grad_norm, train_steps
from .parity import StepReference, parity_result
from .reference import hf_logits
from .run_files import checkpointing, export_hf, generate_command, save_lock, say
from .steps import (
    dynamic_step,
    gpt_logits,
    handler_inputs,
    load_batches,
    load_documents,
    loss_chunks,
    reference_step,
    static_step,
)


def build_model(config: TrainConfig, device: torch.device, reference: bool = False) -> torch.nn.Module:
    """The reference GPT, or a Hugging Face causal LM: wrapped in
    :class:`~cp_handler.integrations.transformers.CPCausalLM` (the guard and CP attention), or for
    the parity ``reference`` the unmodified model under the same parameter names, with transformers'
    ``eager`` attention (the one implementation every architecture has, with every variant: sdpa
    refuses soft-capping, and several models do not offer it). The same on every rank (seeded)."""
    torch.manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    if config.hf_source is None:
        model = GPTModel(config.model).to(device=device, dtype=dtype)
    else:
        model = _hf_model(config, device, dtype, reference)
    model.train()  # from_pretrained gives eval mode; training randomness is refused before spawn (cli/model_args.py)
    if config.recompute and not reference:
        model.gradient_checkpointing_enable()
    if config.mlp_chunk_tokens and not reference:  # the parity reference keeps whole MLPs
        tile_mlps(model, config.mlp_chunk_tokens)
    return model


def _hf_model(config: TrainConfig, device: torch.device, dtype: torch.dtype, reference: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..integrations.transformers import CPCausalLM, HFReference

    if config.hf_weights:
        model = AutoModelForCausalLM.from_pretrained(config.hf_source, local_files_only=True, dtype=dtype,
                                                     attn_implementation="eager")
    else:
        hf_config = AutoConfig.from_pretrained(config.hf_source, local_files_only=True)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="eager")
    return (HFReference(model) if reference else CPCausalLM(model)).to(device=device, dtype=dtype)


def step_reference(config: TrainConfig, device, global_batch: int | None, sharded_experts: bool) -> StepReference:
    """``--check-parity``: the single-process reference of every step (a full model on rank 0)."""
    if dist.get_rank() != 0:
        return StepReference(None, None, local_grad_norm, sharded_experts)
    model = build_model(config, device, reference=True)
    logits_of = gpt_logits if config.hf_source is None else lambda m, tokens, cu, moe: hf_logits(m.model, tokens, cu)
    source = load_documents(config) if config.dynamic else load_batches(config)
    return StepReference(model, reference_step(model, config, logits_of, source, global_batch), local_grad_norm,
                         sharded_experts)


def peak_memory_bytes(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "cuda_max_memory_allocated", torch.cuda.max_memory_allocated(device)
    return "cpu_peak_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    with rank_session("cp-train", config.timeout) as device:
        run = _dynamic if config.dynamic else _static
        return run(config, device, optimizer or default_optimizer(config.lr))


def _dynamic(config: TrainConfig, device: torch.device, optimizer) -> dict | None:
    world = dist.get_world_size()
    model = build_model(config, device)
    say(f"dynamic CP over {world} ranks, max_seqlen_per_rank {config.dynamic.max_seqlen_per_rank}, min CP size "
         f"{config.dynamic.min_cp_size}, documents capped at {config.seq_len} tokens, backend {config.cp.backend}, "
         f"device {device.type}{', every layer recomputed in the backward' if config.recompute else ''}")
    run = dynamic_step(model, config, load_documents(config), GroupPool(device.type), device)
    reference = step_reference(config, device, None, False) if config.check_parity else None
    optim = optimizer(model.parameters())
    scheduler = config.lr_schedule.scheduler(optim)
    start, checkpoint = checkpointing(config, model, optim, scheduler)
    records = train_steps(model, config.steps, run, optim, dist.group.WORLD, dist.get_rank() == 0,
                          config.log_every, reference=reference, start=start, checkpoint=checkpoint,
                          scheduler=scheduler, clip_grad=config.clip_grad)
    export_hf(config, model)
    return _finish(config, records, None, device, {"dp_size": None, "cp_size": "dynamic"})


def _static(config: TrainConfig, device: torch.device, optimizer) -> dict | None:
    world = dist.get_world_size()
    layout = ParallelLayout(world, context_parallel_size=config.cp.context_parallel_size,
                            expert_model_parallel_size=config.expert_parallel_size,
                            hierarchical_context_parallel_sizes=config.cp.hierarchical_context_parallel_sizes)
    if config.print_layout:
        say(layout.describe())
    built = layout.build(device.type)  # one DeviceMesh for the CP and the expert groups
    groups = data_context_parallel_groups(built)
    model = build_model(config, device)
    experts = ExpertGroups(config.moe_experts, built) if config.moe_experts else None
    if experts:  # each rank holds its experts: gradients reduced by ExpertGroups, not DDP
        model.shard_experts(experts.handler().local_expert_ids)
        trained, grad_scale, grad_norm_fn = model, 1.0, experts.grad_norm
    elif config.fsdp:  # FSDP2 averages gradients over the world too, sharding them (and parameters, states)
        trained, grad_scale, grad_norm_fn = shard_model(model, device.type), float(world), None
    else:  # DDP averages gradients over the world; the loss is already normalised by the global token count
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        grad_scale, grad_norm_fn = float(world), None
    moe = f", {config.moe_experts} experts over ep {config.expert_parallel_size}" if experts else ""
    moe += f", FSDP2 over all {world} ranks" if config.fsdp else ""
    moe += ", every layer recomputed in the backward" if config.recompute else ""
    say(f"world {world} = dp {groups.dp_size} x cp {groups.cp_size}, backend {config.cp.backend}, cp_comm_type "
         f"{config.cp.cp_comm_type}, packing {config.packing}, device {device.type}{moe}")
    global_batch = config.batch_size * groups.dp_size
    batches = load_batches(config)
    if config.packing == "thd":
        say(f"thd packs {batches.documents_per_sequence(global_batch, config.steps)}")
    at_train, at_eval = build_evaluators(config, groups, device.type)
    evaluating = config.eval_every or config.check_eval_cp
    heldout = batches.heldout_batches(config.eval_batches, config.batch_size * at_eval.groups.dp_size) \
        if evaluating else []

    def eval_inputs(batch):
        return handler_inputs(batch, config.packing, device)

    eval_chunks = loss_chunks(trained, config)  # evaluation's loss in chunks as training's: no whole logits

    run = static_step(trained, config, batches, groups, global_batch, dist.group.WORLD, grad_scale, device, experts)
    reference = step_reference(config, device, global_batch, experts is not None) if config.check_parity else None
    optim = optimizer(trained.parameters())
    scheduler = config.lr_schedule.scheduler(optim)
    start, checkpoint = checkpointing(config, trained, optim, scheduler)
    records = train_steps(trained, config.steps, run, optim, dist.group.WORLD, dist.get_rank() == 0,
                          config.log_every, after_step=periodic_eval(config, at_eval, trained, heldout, eval_inputs,
                                                                      eval_chunks),
                          grad_norm_fn=grad_norm_fn, reference=reference, start=start, checkpoint=checkpoint,
                          scheduler=scheduler, clip_grad=config.clip_grad)
    export_hf(config, trained)
    eval_check = check_eval_cp(config, at_train, at_eval, trained, heldout[0], eval_inputs, eval_chunks) \
        if config.check_eval_cp else None
    return _finish(config, records, eval_check, device, {"dp_size": groups.dp_size, "cp_size": groups.cp_size},
                   state_bytes(trained, optim))


def _finish(config: TrainConfig, records, eval_check, device, layout: dict, state: dict | None = None) -> dict | None:
    """Gather memory, assemble rank 0's metrics, run the requested checks."""
    memory_kind, peak = peak_memory_bytes(device)
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (peak, state))
    peaks, states = [p for p, _ in peaks], [s for _, s in peaks]
    if dist.get_rank() != 0:
        return None
    timed = records[1:] or records  # the first step includes warm-up
    metrics = {"config": asdict(config), "world_size": dist.get_world_size(), **layout, "device": device.type,
               "steps": records, "tokens_per_s_mean": sum(r["tokens_per_s"] for r in timed) / len(timed),
               "memory_kind": memory_kind, "peak_memory_bytes_per_rank": peaks}
    if state is not None:  # parameters, gradients, optimizer states per rank (FSDP: this rank's shards)
        metrics["state_bytes_per_rank"] = states
    if eval_check is not None:
        metrics["eval_cp_check"] = eval_check
        report_eval_check(eval_check)
    if config.check_parity:
        metrics["parity"] = parity_result(records, config.dtype)
    return metrics


def run_training(config: TrainConfig, optimizer=None) -> dict | None:
    """Start the run's ranks (spawned, or this process as one rank under torchrun) and return rank
    0's metrics (``None`` on the other ranks under torchrun); with ``--save`` (or ``--export-hf``) rank 0 then
    prints the ``cp-generate`` command that continues a prompt from the final checkpoint.

    Raises:
        SystemExit: a rank failed or stalled (:func:`~cp_handler.launch.launch`).
    """
    lock = save_lock(config)
    try:
        metrics = launch(train_rank, config.world_size, config, optimizer, timeout=config.timeout).get(0)
    finally:
        if lock is not None:
            lock.release()
    command = generate_command(config) if metrics is not None else None
    if command:
        print(f"cp-train: continue a prompt from the final checkpoint: {command}", file=sys.stderr)
    return metrics
