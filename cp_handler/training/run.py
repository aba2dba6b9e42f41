"""One training run: every rank's work (:func:`train_rank`) and starting the ranks (:func:`run_training`).

World = dp x cp (CP groups on adjacent ranks). Each step every DP replica takes its slice of the
global batch, shards it over its CP group with a handler (:func:`~cp_handler.handlers.build_cp_handler`),
and the loss is token-weighted over all ranks; gradients are reduced over all dp x cp ranks by torch
DDP (MoE: by :class:`~.experts.ExpertGroups`; dynamic CP: one all-reduce per global batch).

What a run reads and writes on disk beside the training: ``--resume`` and the checkpoint callback of
``--save`` / ``--save-every`` (:func:`checkpointing`, over :mod:`.checkpoint`), the ``--save`` folder's lock
(:func:`save_lock`), ``--export-hf`` (:func:`export_hf`), and the ``cp-generate`` command that continues a
prompt from what the run saved (:func:`generate_command`).
"""

from __future__ import annotations

import logging
import os
import resource
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

from ..dynamic import GroupPool
from ..handlers.registry import load_plugins
from ..models import GPTModel
from ..models.tiling import tile_mlps
from ..runtime.groups import data_context_parallel_groups
from ..runtime.launch import is_first_rank, launch, rank_session, under_torchrun
from ..runtime.parallel_layout import ParallelLayout
from .checkpoint import CheckpointError, CheckpointWriter, SaveLock, check_resume, load_checkpoint, run_meta
from .compile import compile_layers
from .config import TrainConfig
from .evaluation import build_evaluators, check_eval_cp, periodic_eval, report_eval_check
from .experts import ExpertGroups
from .file_modes import new_folder_mode
from .fsdp import full_state, is_sharded, shard_model, state_bytes
from .loop import default_optimizer, local_grad_norm, train_steps
from .parity import StepReference, parity_result, unwrap
from .reference import hf_logits
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
    (new or empty: :func:`~.checkpoint.check_export_target`, checked before the ranks started) when
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
    if config.compile and not reference:  # the parity reference runs eager
        compile_layers(model)
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
        metrics = run(config, device, optimizer or default_optimizer(config.lr))
        say("the ranks stop")  # releasing the process groups and the launcher's exit take a few seconds
        return metrics


def _say_compiling(config: TrainConfig) -> None:
    if config.compile:
        say("the first step compiles every layer (torch.compile: up to a minute or two on CPU); later steps run "
            "compiled")


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
    _say_compiling(config)
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
    _say_compiling(config)
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
        SystemExit: a rank failed or stalled (:func:`~cp_handler.runtime.launch.launch`).
    """
    lock = save_lock(config)
    if is_first_rank() and not under_torchrun():
        print(f"cp-train: starting {config.world_size} rank{'s' * (config.world_size > 1)}", file=sys.stderr,
              flush=True)
    preload = ("transformers", "cp_handler.integrations.transformers") if config.hf_source else ()
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
