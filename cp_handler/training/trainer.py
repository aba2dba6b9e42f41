"""One rank of a ``cp-train`` run as a Trainer with phases:

    trainer = Trainer(config, device, optimizer)
    trainer.build()                        # layout, groups, model and its wrapping, evaluators, optimizer, resume
    for step in trainer.steps():           # the steps still to run (after a resumed checkpoint's)
        record = trainer.step(step)        # shard, forward / backward, reduce, parity, optimizer step
        trainer.after_step(step, record)   # evaluation, progress, checkpoint
    metrics = trainer.finish()             # export, the eval-CP check, memory, rank 0's metrics

(:meth:`Trainer.fit` runs exactly that.) A run at a fixed CP layout (world = dp x cp: CP groups on adjacent ranks;
gradients reduced by torch DDP, FSDP2 or, for sharded experts, :class:`~.experts.ExpertGroups`) and a dynamic-CP run
(documents scheduled onto CP groups of the sizes they need, gradients all-reduced once per global batch) differ only
in :meth:`Trainer.build`: where a step's micro-batches come from (:class:`~.steps.StaticBatches`,
:class:`~.steps.DynamicBatches`) and how the gradients are reduced. The parity reference (``--check-parity``) runs
inside :meth:`Trainer.step`, before the optimizer step: it compares the gradients, which the optimizer step
consumes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from ..dynamic import GroupPool
from ..integrations.hf_tensor_parallel import apply_hf_tensor_parallel
from ..runtime.exact_grads import ExactGradients, units_refusal
from ..runtime.exact_grads import uncovered as exact_uncovered
from ..runtime.groups import data_context_parallel_groups
from ..runtime.launch import heartbeat
from ..runtime.parallel_layout import ParallelLayout
from ..runtime.reductions import all_reduce_grads
from . import tensor_parallel
from .build import build_model, checkpointing, export_hf, peak_memory_bytes, say, step_reference
from .config import TrainConfig
from .evaluation import build_evaluators, check_eval_cp, report_eval_check
from .experts import ExpertGroups, expert_parameters
from .fsdp import shard_model, state_bytes
from .loop import NonFiniteLoss, StepProgress, default_optimizer, local_grad_norm
from .parity import parity_result
from .steps import (
    DynamicBatches,
    StaticBatches,
    forward_backward,
    handler_inputs,
    load_batches,
    load_documents,
    loss_chunks,
)


class Trainer:
    """``cp-train``'s work on one rank, in phases (module doc).

    Args:
        config: the run (:class:`~.config.TrainConfig`, checked before the ranks started).
        device: this rank's device.
        optimizer: ``params -> torch.optim.Optimizer`` (picklable); default AdamW at ``config.lr``.
    """

    def __init__(self, config: TrainConfig, device: torch.device, optimizer=None):
        self.config, self.device = config, device
        self.optimizer = optimizer or default_optimizer(config.lr)
        self.records: list[dict] = []
        self.progress: StepProgress | None = None

    # --- build ---------------------------------------------------------------------------------------------------

    def build(self) -> Trainer:
        """Layout and groups, the model and its wrapping, the micro-batches, the evaluators, the parity reference,
        the optimizer and learning-rate schedule, and the resumed checkpoint (every rank; collectives)."""
        config, device = self.config, self.device
        tensor_parallel.check_train_config(config)  # before any collective
        self.model = build_model(config, device)
        self._build_dynamic() if config.dynamic else self._build_static()
        twin = config.check_parity and self.exact is not None and self.layout_metrics["dp_size"] == 1
        if config.check_parity and config.cp.deterministic and not twin:
            say("--check-parity: no bitwise check against cp 1 in the mode (it needs the gradients summed exactly and "
                f"dp 1: {self.exact_refusal or 'dp ' + str(self.layout_metrics['dp_size'])})")
        self.reference = step_reference(config, device, self.reference_batch, self.experts is not None, twin) \
            if config.check_parity else None
        self.optim = self.optimizer(self.trained.parameters())
        self.scheduler = config.lr_schedule.scheduler(self.optim)
        self.start, self.checkpoint = checkpointing(config, self.trained, self.optim, self.scheduler)
        if config.compile:
            say("the first step compiles every layer (torch.compile: up to a minute or two on CPU); later steps run "
                "compiled")
        self.start_progress()
        return self

    def _build_static(self) -> None:
        config, device, world = self.config, self.device, dist.get_world_size()
        tp = config.tensor_parallel_size
        layout = ParallelLayout(world, tensor_model_parallel_size=tp,
                                context_parallel_size=config.cp.context_parallel_size,
                                expert_model_parallel_size=config.expert_parallel_size,
                                hierarchical_context_parallel_sizes=config.cp.hierarchical_context_parallel_sizes)
        if config.print_layout:
            say(layout.describe())
        built = layout.build(device.type)  # one DeviceMesh for the CP and the expert groups
        groups = data_context_parallel_groups(built)
        model = self.model
        self.experts = ExpertGroups(config.moe_experts, built) if config.moe_experts else None
        self.count_group, self.tp_reduce = dist.group.WORLD, None
        self.exact = self._exact_gradients(model)
        if tp > 1:
            self._split_tensor_parallel(model, built)
        elif self.experts:  # each rank holds its experts: gradients reduced by ExpertGroups, not DDP
            model.shard_experts(self.experts.handler().local_expert_ids)
            self.trained, self.grad_scale, self.grad_norm = model, 1.0, self.experts.grad_norm
            if self.exact is not None:  # the sums of this rank's parameters (its experts' only)
                self.exact = ExactGradients(model)
        elif config.fsdp:  # FSDP2 averages gradients over the world too, sharding them (and parameters, states)
            self.trained, self.grad_scale, self.grad_norm = shard_model(model), float(world), None
        elif self.exact is not None:  # the deterministic mode: gradients summed exactly over the world, no DDP
            self.trained, self.grad_scale, self.grad_norm = model, 1.0, None
        else:  # DDP averages gradients over the world; the loss is already normalised by the global token count
            self.trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            self.grad_scale, self.grad_norm = float(world), None
        extra = f", {config.moe_experts} experts over ep {config.expert_parallel_size}" if self.experts else ""
        if config.fsdp:
            extra += f", FSDP2 over the {world // tp} dp x cp ranks of each TP position" if tp > 1 else \
                f", FSDP2 over all {world} ranks"
        extra += ", sequence parallel over the TP group" if config.sequence_parallel else ""
        extra += ", every layer recomputed in the backward" if config.recompute else ""
        if config.cp.deterministic and self.exact is not None:
            extra += ", parameter gradients summed exactly (the same bits at every CP degree)"
        elif config.cp.deterministic:
            extra += (", parameter gradients all-reduced (float32, not the same bits at every CP degree: "
                      f"{self.exact_refusal})")
        sizes = f"{f'tp {tp} x ' if tp > 1 else ''}dp {groups.dp_size} x cp {groups.cp_size}"
        say(f"world {world} = {sizes}, backend {config.cp.backend}, cp_comm_type "
            f"{config.cp.cp_comm_type}, packing {config.packing}, device {device.type}{extra}")
        global_batch = config.batch_size * groups.dp_size
        batches = load_batches(config)
        if config.packing == "thd":
            say(f"thd packs {batches.documents_per_sequence(global_batch, config.steps)}")
        self.batches = StaticBatches(config, batches, groups, global_batch, self.count_group, device)
        self.reference_batch = global_batch
        self.layout_metrics = {"dp_size": groups.dp_size, "cp_size": groups.cp_size, "tp_size": tp,
                               "exact_grads": self.exact is not None}
        self.at_train, self.at_eval = build_evaluators(config, groups, device.type)
        evaluating = config.eval_every or config.check_eval_cp
        self.heldout = batches.heldout_batches(config.eval_batches, config.batch_size * self.at_eval.groups.dp_size) \
            if evaluating else []
        self.eval_chunks = loss_chunks(self.trained, config)  # evaluation's loss in chunks as training's

    def _exact_gradients(self, model) -> ExactGradients | None:
        """The deterministic mode's exact parameter gradients (:mod:`~cp_handler.runtime.exact_grads`) where the run
        allows them, else ``None`` with the reason in ``self.exact_refusal`` (said in the start line; ``None`` outside
        the mode)."""
        config = self.config
        self.exact_refusal = None
        if not config.cp.deterministic:
            return None
        others = [name for name, on in (("tensor parallelism", config.tensor_parallel_size > 1),
                                         ("FSDP2", config.fsdp), ("torch.compile", config.compile),
                                         ("--mlp-chunk-tokens (MLPs on chunks that need not be whole units)",
                                          bool(config.mlp_chunk_tokens))) if on]
        if others:
            self.exact_refusal = f"{', '.join(others)}: gradients reduced their own way (exact sums not built there)"
        else:
            self.exact_refusal = units_refusal(config.seq_len, config.cp.context_parallel_size, config.packing)
        if self.exact_refusal is None and (missing := exact_uncovered(model)):
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            self.exact_refusal = f"{missing[:3]}{more} hold parameters that the exact sums do not cover"
        if self.exact_refusal is not None:
            return None
        return ExactGradients(model)

    def _split_tensor_parallel(self, model, built) -> None:
        """``--tp-size``: the model split over the TP group (the reference GPT's plan, or transformers' own), the
        loss's tokens counted over the dp x cp ranks of each TP position, and its gradients summed there: by one
        flat all-reduce, or with ``--fsdp`` by FSDP2 over those ranks, on a 2-D mesh ``(dp_cp, tp)`` of the same
        ranks (its reduce-scatter averages: the loss scaled by their number, as DDP's)."""
        config, world, tp = self.config, dist.get_world_size(), self.config.tensor_parallel_size
        mesh = init_device_mesh(self.device.type, (world // tp, tp), mesh_dim_names=("dp_cp", "tp")) \
            if config.fsdp else None
        tp_mesh = mesh["tp"] if mesh is not None else built.meshes["attention"]["tp"]
        # the deterministic mode above 2 TP ranks: row-wise sums in TP-rank order, the same bits at every CP degree
        # (an all-reduce of two is a + b whatever its algorithm)
        ordered = config.cp.deterministic and tp > 2
        if config.hf_source is None:
            plan = tensor_parallel.gpt_tp_plan(model, tp, config.sequence_parallel, ordered)
            summed = tensor_parallel.apply_tensor_parallel(model, tp_mesh, plan)
        else:  # transformers' own plan; replicated weights applied per head summed over the TP group
            summed = apply_hf_tensor_parallel(model, tp_mesh, ordered)
        experts = set()
        if self.experts:  # each TP rank runs its expert shard whole (tensor_parallel's module doc)
            model.shard_experts(self.experts.handler().local_expert_ids)
            experts = expert_parameters(model)
        self.count_group = built.groups["dp_cp"]
        self.grad_norm = functools.partial(tensor_parallel.grad_norm, experts=experts, ep_group=built.groups["ep"])
        if mesh is not None:
            self.trained, self.grad_scale = shard_model(model, mesh["dp_cp"]), float(world // tp)
        else:
            self.trained, self.grad_scale = model, 1.0
        dp_cp = None if mesh is not None else built.groups["dp_cp"]  # FSDP2 reduces over them itself
        self.tp_reduce = functools.partial(tensor_parallel.all_reduce_local_grads, self.trained, dp_cp,
                                           tp_mesh.get_group(), summed, experts, built.groups["edp"])

    def _build_dynamic(self) -> None:
        config, device = self.config, self.device
        if config.eval_every or config.check_eval_cp:
            raise ValueError(f"TrainConfig.dynamic with eval_every={config.eval_every} / check_eval_cp="
                             f"{config.check_eval_cp}: dynamic CP does not run evaluation (cp-train refuses "
                             "--eval-every / --check-eval-cp with --dynamic-cp)")
        say(f"dynamic CP over {dist.get_world_size()} ranks, max_seqlen_per_rank {config.dynamic.max_seqlen_per_rank}, "
            f"min CP size {config.dynamic.min_cp_size}, documents capped at {config.seq_len} tokens, backend "
            f"{config.cp.backend}, device {device.type}"
            f"{', every layer recomputed in the backward' if config.recompute else ''}")
        self.trained, self.experts, self.grad_scale, self.grad_norm = self.model, None, 1.0, None
        self.exact = None  # the deterministic mode refuses dynamic CP
        self.count_group, self.tp_reduce = dist.group.WORLD, None
        self.batches = DynamicBatches(config, load_documents(config), GroupPool(), device)
        self.reference_batch, self.layout_metrics = None, {"dp_size": None, "cp_size": "dynamic"}
        self.at_train = self.at_eval = None
        self.heldout = []

    # --- step ----------------------------------------------------------------------------------------------------

    def steps(self) -> range:
        """The steps this run still makes: from the resumed checkpoint's (0 without one) to ``config.steps``."""
        return range(self.start, self.config.steps)

    def eval_inputs(self, batch):
        """A held-out batch's global tokens and handler metadata (:func:`~.steps.handler_inputs`)."""
        return handler_inputs(batch, self.config.packing, self.device)

    def step(self, step: int) -> dict:
        """Optimizer step ``step``: shard global batch ``step``, forward / backward its micro-batches, reduce the
        gradients, compare with the parity reference (``--check-parity``), clip (``--clip-grad``), step the
        optimizer and the learning-rate schedule. Returns the step's record: loss (token-weighted over the global
        batch), global gradient norm (before clipping), learning rate, time, tokens/s (and the reference's values).

        Raises:
            NonFiniteLoss: the step's loss is not finite (on every rank: the reduced loss is the same), before the
                optimizer step.
        """
        began = time.perf_counter()
        parts, total, tokens = self.batches.parts(step)
        with self.exact if self.exact is not None else contextlib.nullcontext():
            loss = forward_backward(self.trained, parts, total, self.config, self.device, self.grad_scale,
                                    self.experts, self.exact)
        if self.exact is not None and self.experts:  # expert gradients over the ranks holding the same experts
            self.exact.all_reduce_(self.count_group, expert_parameters(self.trained), self.experts.groups.groups["edp"])
        elif self.exact is not None:
            self.exact.all_reduce_(self.count_group)
        elif self.tp_reduce:
            self.tp_reduce()
        elif self.experts:
            self.experts.reduce_gradients(self.trained)
        elif self.config.dynamic:
            all_reduce_grads(list(self.trained.parameters()))
        dist.all_reduce(loss, group=self.count_group)  # every share of one TP position: the global batch's loss
        if self.config.cp.deterministic:  # each CP rank held its group's whole loss: cp equal terms, exact in float64
            loss = loss / self.config.cp.context_parallel_size
        if not math.isfinite(loss.item()):
            raise NonFiniteLoss(f"step {step + 1}: the loss is {loss.item()}; the run stops before the optimizer "
                                "step (lower --lr, check the data or the model)")
        grad_norm = (self.grad_norm or local_grad_norm)(self.trained)
        checked = self.reference(step, self.trained) if self.reference else {}
        if self.config.clip_grad and self.tp_reduce:
            tensor_parallel.clip_grads(self.trained, self.config.clip_grad, grad_norm)
        elif self.config.clip_grad:
            torch.nn.utils.clip_grads_with_norm_(self.trained.parameters(), self.config.clip_grad,
                                                 torch.tensor(grad_norm))
        lr = self.optim.param_groups[0]["lr"]
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.scheduler.step()
        elapsed = time.perf_counter() - began
        return {"step": step + 1, "loss": loss.item(), "grad_norm": grad_norm, "lr": lr, "step_time_s": elapsed,
                "tokens_per_s": tokens / elapsed, **checked}

    # --- after a step --------------------------------------------------------------------------------------------

    def after_step(self, step: int, record: dict) -> None:
        """The held-out loss every ``--eval-every`` steps (added to ``record``), the record kept, the progress line,
        the launcher's heartbeat, and the checkpoint (``--save-every``, and after the last step)."""
        config = self.config
        if config.eval_every and (step + 1) % config.eval_every == 0:
            record["eval_loss"] = self.at_eval.evaluate(self.trained, self.heldout, self.eval_inputs, self.eval_chunks)
            record["eval_cp_size"] = self.at_eval.config.context_parallel_size
        self.records.append(record)
        heartbeat()
        self.progress.update(record)
        if self.checkpoint is not None:
            self.checkpoint(step + 1)
            heartbeat()

    def start_progress(self) -> None:
        """The progress lines (rank 0, :class:`~.loop.StepProgress`), from the end of :meth:`build` to
        :meth:`finish`."""
        self.progress = StepProgress(self.config.steps, dist.get_rank() == 0, self.config.log_every, self.start)

    def close_progress(self) -> None:
        """The progress lines ended (at :meth:`finish`, or when a step raised; once)."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    # --- finish --------------------------------------------------------------------------------------------------

    def finish(self) -> dict | None:
        """Export (``--export-hf``), the eval-CP check (``--check-eval-cp``), peak memory over the ranks, and
        rank 0's metrics (``None`` on the other ranks) with the parity verdict (``--check-parity``)."""
        config = self.config
        self.close_progress()
        export_hf(config, self.trained)
        eval_check = None
        if config.check_eval_cp:
            eval_check = check_eval_cp(config, self.at_train, self.at_eval, self.trained, self.heldout[0],
                                       self.eval_inputs, self.eval_chunks)
        state = None if config.dynamic else state_bytes(self.trained, self.optim)
        memory_kind, peak = peak_memory_bytes(self.device)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (peak, state))
        if dist.get_rank() != 0:
            return None
        records = self.records
        timed = records[1:] or records  # the first step includes warm-up
        metrics = {"config": asdict(config), "world_size": dist.get_world_size(), **self.layout_metrics,
                   "device": self.device.type, "steps": records,
                   "tokens_per_s_mean": sum(r["tokens_per_s"] for r in timed) / len(timed),
                   "memory_kind": memory_kind, "peak_memory_bytes_per_rank": [p for p, _ in gathered]}
        if state is not None:  # parameters, gradients, optimizer states per rank (FSDP: this rank's shards)
            metrics["state_bytes_per_rank"] = [s for _, s in gathered]
        if eval_check is not None:
            metrics["eval_cp_check"] = eval_check
            report_eval_check(eval_check)
        if config.check_parity:
            metrics["parity"] = parity_result(records, config.dtype)
        return metrics

    def fit(self) -> dict | None:
        """The whole run: :meth:`build`, then :meth:`step` and :meth:`after_step` for every step, then
        :meth:`finish`."""
        self.build()
        try:
            for step in self.steps():
                self.after_step(step, self.step(step))
        finally:
            self.close_progress()
        return self.finish()
