"""One ``cp-generate`` run: every rank's work (:func:`generate_rank`) and starting the ranks (:func:`run_generation`).

The model comes from a ``cp-train --save`` checkpoint (the reference GPT: its shape from
``cp_train.json``, its weights read with DCP) or a Hugging Face model folder (``save_pretrained``, e.g.
``cp-train --export-hf``); the prompts come as token ids (:mod:`cp_handler.cli.generate` reads them
with the model folder's tokenizer, else as bytes). All ranks form one CP group; rank 0 reports the
continuation, the prefill and decode throughput, the KV cache per rank and, with ``check_parity``, the
comparison with one process re-running the whole sequence per token without cp_handler
(:func:`reference_model`).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from ..handlers.registry import load_plugins
from ..inference.generate import compare_generations, generate, reference_generate
from ..inference.sampling import Sampling
from ..models import GPTConfig, GPTModel
from ..runtime.forking import HF_RANK_IMPORTS, RANK_IMPORTS
from ..runtime.groups import build_dp_cp_groups
from ..runtime.launch import heartbeat, is_first_rank, launch, rank_session, under_torchrun
from ..training.checkpoint import read_meta
from ..training.reference import hf_logits
from ..training.steps import gpt_logits

PARITY_TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
"""atol = rtol on a step's logits, CP vs one process, by the model's dtype (the attention sums are
reordered). float32: measured <= 3.4e-6 absolute on logits up to ~10 after 30 training steps.
bfloat16 / float16: each product rounds to 8 / 11 significant bits (a relative step of 3.9e-3 /
4.9e-4); the measured differences are a few such steps (docs/inference.md)."""


@dataclass(frozen=True)
class GenerateConfig:
    """One generation run (``cp-generate``), validated by :mod:`cp_handler.cli.generate`."""

    world_size: int
    cp_comm_type: str = "p2p"
    hierarchical_cp_sizes: tuple[int, ...] | None = None
    checkpoint: str | None = None
    """A complete ``cp-train --save`` checkpoint folder (:func:`~cp_handler.training.checkpoint.find_checkpoint`)."""
    hf_model: str | None = None
    prompts: tuple[tuple[int, ...], ...] = ()
    """Each prompt's token ids (``cp-generate`` reads them from the prompt files)."""
    max_new_tokens: int = 64
    dtype: str = "float32"
    """The model's dtype (``cp-generate --dtype``; ``auto`` resolved there to the dtype it was saved in)."""
    check_parity: bool = False
    timeout: float = 300.0
    sampling: Sampling = Sampling()
    """Greedy by default; ``cp-generate --temperature / --top-k / --top-p / --seed``."""
    stop_token: int | None = None
    """Stop once every prompt has produced this id (``cp-generate``: the end-of-sequence token, unless
    ``--ignore-eos``); :func:`~cp_handler.inference.generate.generate`."""


def load_model(config: GenerateConfig, device: torch.device):
    """``(model, attention layers, position limit or None)`` on every rank, in ``config.dtype``."""
    dtype = getattr(torch, config.dtype)
    if config.hf_model:
        from transformers import AutoModelForCausalLM

        from ..integrations.transformers import CPCausalLM

        hf = AutoModelForCausalLM.from_pretrained(config.hf_model, local_files_only=True, dtype=dtype,
                                                  attn_implementation="eager")
        text = hf.config.get_text_config()
        return CPCausalLM(hf).to(device).eval(), text.num_hidden_layers, getattr(text, "max_position_embeddings", None)
    checkpoint = Path(config.checkpoint)
    fields = {k: v for k, v in read_meta(checkpoint)["model"].items() if k != "kind"}
    model = GPTModel(GPTConfig(**fields)).to(device=device, dtype=dtype)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint))
    set_model_state_dict(model, state["model"])
    return model.eval(), model.config.num_layers, None


def reference_model(config: GenerateConfig, model, device: torch.device):
    """``(model, logits_of)`` of ``--check-parity``'s one-process reference, independent of the code under
    test, as cp-train's: the unmodified Hugging Face model (loaded again, transformers' ``eager``
    attention with every variant, no cp_handler hook), or the reference GPT with
    :class:`~cp_handler.training.reference.PlainAttention` instead of a handler."""
    if config.hf_model is None:
        return model, lambda m, ids: gpt_logits(m, ids, None, None)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(config.hf_model, local_files_only=True,
                                              dtype=getattr(torch, config.dtype), attn_implementation="eager")
    return hf.to(device).eval(), lambda m, ids: hf_logits(m, ids)


def generate_rank(config: GenerateConfig) -> dict | None:
    """One rank of the run: the report on rank 0, ``None`` elsewhere."""
    load_plugins()
    with rank_session("cp-generate", config.timeout) as device:
        world = dist.get_world_size()
        groups = build_dp_cp_groups(world, device.type, list(config.hierarchical_cp_sizes or []) or None)
        model, layers, limit = load_model(config, device)
        prompts = [torch.tensor(p, dtype=torch.long) for p in config.prompts]
        result = generate(model, prompts, config.max_new_tokens, cp_group=groups.cp_group if world > 1 else None,
                          cp_comm_type=config.cp_comm_type, hierarchical_cp_groups=groups.hierarchical_cp_groups,
                          num_layers=layers, max_positions=limit, sampling=config.sampling,
                          stop_token=config.stop_token)
        heartbeat()
        kv_bytes = [None] * world
        dist.all_gather_object(kv_bytes, result.kv_cache_bytes)
        if dist.get_rank() != 0:
            return None
        report = {"tokens": result.tokens, "prompt_tokens": [p.numel() for p in prompts],
                  "prefill_s": result.prefill_s, "decode_s": result.decode_s,
                  "prefill_tokens_per_s": sum(p.numel() for p in prompts) / result.prefill_s,
                  "decode_tokens_per_s": len(prompts) * (len(result.logits) - 1) / max(result.decode_s, 1e-9),
                  "kv_cache_bytes_per_rank": kv_bytes, "cp_size": world, "prefills": result.prefills,
                  "dtype": config.dtype, "sampling": asdict(config.sampling)}
        if config.check_parity:
            reference, logits_of = reference_model(config, model, device)
            want = reference_generate(reference, prompts, len(result.logits), follow=result.tokens,
                                      logits_of=logits_of)
            report["parity"] = compare_generations(result, want, PARITY_TOL[config.dtype], config.sampling.greedy)
        return report


def run_generation(config: GenerateConfig) -> dict | None:
    """Start the ranks (spawned, or this process under torchrun); rank 0's report.

    Raises:
        SystemExit: a rank failed or stalled (:func:`~cp_handler.runtime.launch.launch`).
    """
    if is_first_rank() and not under_torchrun():
        print(f"cp-generate: starting {config.world_size} rank{'s' * (config.world_size > 1)}", file=sys.stderr,
              flush=True)
    preload = RANK_IMPORTS + (HF_RANK_IMPORTS if config.hf_model else ())
    return launch(generate_rank, config.world_size, config, program="cp-generate", timeout=config.timeout,
                  preload=preload).get(0)
