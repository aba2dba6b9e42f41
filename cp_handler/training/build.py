"""What :class:`~.trainer.Trainer` builds and finishes with: the model (the reference GPT or a Hugging Face causal LM),
the parity reference of ``--check-parity``, resuming and saving checkpoints (``--resume``, ``--save``, over
:mod:`.checkpoint`), the ``--export-hf`` export, the peak memory of a rank, and rank 0's ``cp-train:`` lines."""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ..models import GPTModel
from ..models.tiling import tile_mlps
from .checkpoint import CheckpointError, CheckpointWriter, check_resume, load_checkpoint, run_meta
from .compile import compile_layers
from .config import TrainConfig
from .file_modes import new_folder_mode
from .fsdp import full_state, is_sharded
from .loop import local_grad_norm
from .parity import StepReference, unwrap
from .reference import hf_logits
from .steps import gpt_logits, load_batches, load_documents, reference_step, twin_step
from .tokens import has_tokenizer, tokens_for


def say(text: str) -> None:
    """``cp-train: text`` on stderr, from rank 0 only."""
    if dist.get_rank() == 0:
        print(f"cp-train: {text}", file=sys.stderr)


def checkpointing(config: TrainConfig, trained, optim, scheduler) -> tuple[int, object]:
    """``(steps already done, checkpoint callback for Trainer.after_step)``: loads ``--resume`` into ``trained`` /
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

    from ..integrations.hf_loss_probe import check_model_loss
    from ..integrations.transformers import CPCausalLM, HFReference

    if config.hf_weights:
        model = AutoModelForCausalLM.from_pretrained(config.hf_source, local_files_only=True, dtype=dtype,
                                                     attn_implementation="eager")
    else:
        hf_config = AutoConfig.from_pretrained(config.hf_source, local_files_only=True)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="eager")
    if reference:
        return HFReference(model).to(device=device, dtype=dtype)
    wrapped = CPCausalLM(model)  # registered: its loss probed (integrations/hf_loss_probe.py)
    check_model_loss(model, "cp-train trains the token cross-entropy of the logits, not the model's own loss")
    return wrapped.to(device=device, dtype=dtype)


def step_reference(config: TrainConfig, device, global_batch: int | None, sharded_experts: bool,
                   twin: bool = False) -> StepReference:
    """``--check-parity``: the single-process reference of every step (a full model on rank 0); ``twin``: also the
    deterministic mode's own step at cp 1 (:func:`~.steps.twin_step`, a second full model), compared bitwise."""
    if dist.get_rank() != 0:
        return StepReference(None, None, local_grad_norm, sharded_experts)
    model = build_model(config, device, reference=True)
    logits_of = gpt_logits if config.hf_source is None else lambda m, tokens, cu, moe: hf_logits(m.model, tokens, cu)
    source = load_documents(config) if config.dynamic else load_batches(config)
    twin_model = build_model(config, device) if twin else None
    return StepReference(model, reference_step(model, config, logits_of, source, global_batch), local_grad_norm,
                         sharded_experts,
                         twin=(twin_model, twin_step(twin_model, config, source, global_batch)) if twin else None)


def peak_memory_bytes(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        return "cuda_max_memory_allocated", torch.cuda.max_memory_allocated(device)
    return "cpu_peak_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


