"""Runs of Hugging Face Trainer / TRL SFTTrainer for tests/test_hf_trainer.py: one process with the plain trainer
(the reference), or spawned gloo ranks with cp_handler's (``CPTrainer`` / ``CPSFTTrainer``), on the same global
batches. Each run writes what the comparison needs: the loss of every logged step, the final parameters,
``evaluate()``'s loss and ``predict()``'s logits.

Tiny random-weight models from configs (no hub), in-memory datasets, SGD (its update is linear in the gradient,
so the parameters' tolerance follows the gradients'; Adam would turn a 1e-7 gradient into a full step).
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 64
_AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
"""A load-balancing loss weighted enough to move every parameter it reaches."""
CASES = {
    # name: model, its config fields, collator ("pad": right padding; "flatten": packed documents), trainer, cp args
    "llama_pad": {"model": "llama", "collator": "pad", "cp": {"context_parallel_size": 2, "mlp_chunk_tokens": 5},
                  "accumulate": 2},
    "llama_dp2": {"model": "llama", "collator": "pad", "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "mistral_window_packed": {"model": "mistral", "config": {"sliding_window": 6}, "collator": "flatten",
                              "cp": {"context_parallel_size": 2, "cp_comm_type": "all_gather"}},
    "gemma2_softcap": {"model": "gemma2", "config": {"attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0,
                                                     "sliding_window": 8}, "collator": "pad",
                       "cp": {"context_parallel_size": 2}},
    # a hybrid (gated delta rule, short convolution, attention); padded rows: transformers refuses packed documents
    # for its own one-process run of this mixer without flash-linear-attention
    "qwen3_next_hybrid": {"model": "qwen3_next", "config": {"layer_types": ["linear_attention", "full_attention"]},
                          "collator": "pad", "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "sft_padding_free": {"model": "llama", "collator": "trl", "trainer": "sft", "cp": {"context_parallel_size": 2}},
    # MoE load-balancing loss on (tests/test_hf_trainer.py's docstring): Trainer adds the model's own (packed
    # documents: the handler's padding slots masked out); TRL turns it on from router_aux_loss_coef and logs it
    "moe_aux_loss_packed": {"model": "qwen3_moe", "config": _AUX, "collator": "flatten",
                            "cp": {"context_parallel_size": 2}},
    "sft_hybrid_moe_aux_loss": {"model": "qwen3_next", "config": {**_AUX, "layer_types": ["linear_attention",
                                                                                          "full_attention"]},
                                "collator": "trl", "trainer": "sft", "padding_free": False,
                                "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    # TrainingArguments(torch_compile=True): accelerate compiles the model (here with the aot_eager backend: the
    # graphs and the attention operator Inductor would get, without its CPU code generation); the reference eager
    "llama_compiled": {"model": "llama", "collator": "flatten", "cp": {"context_parallel_size": 2},
                       "compile": "aot_eager"},
    "sft_compiled": {"model": "qwen3", "collator": "trl", "trainer": "sft", "cp": {"context_parallel_size": 2,
                                                                                  "cp_comm_type": "a2a"},
                     "compile": "aot_eager"},
    "local_positions": {"model": "llama", "collator": "pad", "cp": {"context_parallel_size": 2}, "break": "positions"},
    "router_loss_per_shard": {"model": "qwen3_moe", "config": _AUX, "collator": "flatten",
                              "cp": {"context_parallel_size": 2}, "break": "router_loss"},
}
"""Each case's reference is the same name run alone (``break``: a negative control, positions left local or the
router loss computed on each rank's shard as transformers would)."""
LOGGED = ("aux_loss", "num_tokens", "entropy", "mean_token_accuracy")
"""TRL's logged figures compared beside the loss and the gradient norm, where a run logs them."""
WORLD = {"llama_dp2": 4}
"""Ranks per case (default 2: cp 2 alone); dp = world / cp."""


def model(name: str, fields: dict | None = None):
    import transformers

    shape = {**dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=128), **(fields or {})}
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "gemma2": "Gemma2Config"}
    if name in classes:
        config = getattr(transformers, classes[name])(**shape)
    else:  # a hybrid: the zoo's tiny config (tests/hf_zoo.py)
        import hf_zoo

        config = hf_zoo.tiny_config(name, {**(fields or {}), "vocab_size": VOCAB})
    config._attn_implementation = "eager" if name == "gemma2" else "sdpa"  # SDPA has no soft-cap
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def dataset(count: int, seed: int, lengths=(9, 14, 20, 6, 17, 11)):
    """``count`` examples of varying lengths: ``input_ids``, ``labels`` (the same ids: the model shifts)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids = torch.randint(1, VOCAB, (lengths[i % len(lengths)],), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def pad_right(features):
    """Right padding: ``input_ids`` with 0, ``labels`` with -100, an ``attention_mask``."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full((len(features), longest), -100)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _collator(kind: str):
    from transformers import DataCollatorWithFlattening

    return {"pad": pad_right, "flatten": DataCollatorWithFlattening(return_flash_attn_kwargs=True),
            "trl": None}[kind]


def _arguments(case: dict, out: str, batch: int, cp_run: bool):
    from transformers import TrainingArguments

    fields = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=batch, per_device_eval_batch_size=1,
                  gradient_accumulation_steps=case.get("accumulate", 1), max_steps=3, learning_rate=0.05,
                  optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                  seed=0, train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
                  ddp_backend="gloo" if cp_run else None)
    if case.get("compile") and cp_run:
        fields.update(torch_compile=True, torch_compile_backend=case["compile"])
    if case.get("trainer") == "sft":
        from trl import SFTConfig

        return SFTConfig(**fields, padding_free=case.get("padding_free", True), max_length=None,
                         bf16=False)  # TRL's default: bf16 autocast
    return TrainingArguments(**fields)


@contextlib.contextmanager
def _broken(kind: str | None):
    """A negative control for the block (undone after it: the spawn runs the next cases): ``"positions"``, every
    rank's positions local (0..S_local-1); ``"router_loss"``, transformers' own load-balancing loss on each rank's
    shard."""
    from cp_handler.integrations import hf_active, hf_batch, hf_router_loss

    target, name, original = {None: (None, None, None), "positions": (hf_batch, "cp_model_inputs", None),
                              "router_loss": (hf_router_loss, "cp_load_balancing_loss", None)}[kind]
    if target is not None:
        original = getattr(target, name)

    def local(handler, input_ids):
        inputs = original(handler, input_ids)
        inputs["position_ids"] = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        inputs["cache_position"] = inputs["position_ids"][0]
        return inputs

    def per_shard(gate_logits, num_experts, top_k=2, attention_mask=None):
        hf_active.record_router_loss()
        return hf_router_loss._reference()(gate_logits, num_experts, top_k, None)

    if target is not None:
        setattr(target, name, local if kind == "positions" else per_shard)
    try:
        yield
    finally:
        if target is not None:
            setattr(target, name, original)


def run_case(name: str, out: str, cp_run: bool) -> None:
    """Train 3 steps, evaluate and predict; rank 0 writes ``out/result.pt``."""
    import transformers
    from transformers import Trainer

    transformers.logging.set_verbosity_error()
    case = CASES[name]
    world = dist.get_world_size() if cp_run else 1
    cp = case["cp"]["context_parallel_size"]
    dp = world // cp if cp_run else WORLD.get(name, 2) // cp
    batch = 2 if cp_run else 2 * dp  # the reference runs the dp ranks' batches as one
    args = _arguments(case, out, batch, cp_run)
    common = dict(model=model(case["model"], case.get("config")), args=args,
                  train_dataset=dataset(16, 1), eval_dataset=dataset(2 * dp, 2, lengths=(12,)))
    if case.get("trainer") == "sft":  # pre-tokenized: TRL's collator makes the labels from input_ids
        from datasets import Dataset
        from trl import SFTTrainer

        for key in ("train_dataset", "eval_dataset"):
            common[key] = Dataset.from_list([{"input_ids": row["input_ids"]} for row in common[key]])

        from cp_handler.integrations.hf_trainer import CPSFTTrainer as CP
        cls, common["processing_class"] = (CP if cp_run else SFTTrainer), tokenizer()
    else:
        from cp_handler.integrations.hf_trainer import CPTrainer as CP
        cls, common["data_collator"] = (CP if cp_run else Trainer), _collator(case["collator"])
    if cp_run:
        from cp_handler.integrations.hf_trainer import ContextParallelArguments

        common["cp_args"] = ContextParallelArguments(**case["cp"])
    with _broken(case.get("break") if cp_run else None):
        record(cls(**common), common["eval_dataset"], out, cp_run)


def record(trainer, eval_dataset, out: str, cp_run: bool) -> None:
    """Train, evaluate and predict with ``trainer``; rank 0 (or the one process) writes ``out/result.pt``: the loss,
    gradient norm and :data:`LOGGED` figures of every logged step, the final parameters, the eval loss, the logits."""
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    losses = [[entry["loss"], entry["grad_norm"], *(entry[key] for key in LOGGED if key in entry)] for entry in logged]
    evaluation = trainer.evaluate()
    # transformers 5.24+ returns a VLM's image_outputs beside the logits, and Trainer.predict of the unmodified LLaVA
    # then fails upstream in accelerate's pad_across_processes (None entries among them): predictions are the logits
    # (a given ignore_keys replaces Trainer's default, which drops the model's cache)
    prediction = trainer.predict(eval_dataset, ignore_keys=["image_outputs", "cache", "past_key_values"])
    if dist.get_rank() == 0:
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        torch.save({"losses": losses, "params": params, "eval_loss": evaluation["eval_loss"],
                    "predictions": torch.as_tensor(_logits(prediction.predictions))}, Path(out) / "result.pt")


def run_all(module, out: Path) -> dict:
    """Every case of ``module`` (this one, or tests/hf_trainer_vlm_cases.py: its ``CASES``, ``WORLD``, ``worker``, and
    ``REFERENCE_WORLD`` where the plain trainer runs on dp processes): the references (one spawn of one process, one
    per other reference world) and the CP runs (one spawn per world size); ``{name: (cp, reference)}``."""
    from dist_utils import run_distributed

    reference_world = getattr(module, "REFERENCE_WORLD", {})
    for world in sorted({reference_world.get(name, 1) for name in module.CASES}):
        names = [name for name in module.CASES if reference_world.get(name, 1) == world]
        run_distributed(module.worker, world, names, str(out / "reference"), False)
    for world in sorted({module.WORLD.get(name, 2) for name in module.CASES}):
        names = [name for name in module.CASES if module.WORLD.get(name, 2) == world]
        run_distributed(module.worker, world, names, str(out / "cp"))
    return {name: (torch.load(out / "cp" / name / "result.pt"), torch.load(out / "reference" / name / "result.pt"))
            for name in module.CASES}


def compare(got: dict, want: dict) -> str | None:
    """The first difference between two runs' results (:func:`run_case`'s), or ``None`` (the tolerances:
    tests/test_hf_trainer.py's docstring)."""
    if len(got["losses"]) != len(want["losses"]):
        return f"{len(got['losses'])} logged steps, expected {len(want['losses'])}"
    for step, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        if len(a) != len(b) or not all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a, b, strict=True)):
            return f"step {step + 1}: loss, grad norm (aux loss, num_tokens) {a} vs {b}"
    for name, param in want["params"].items():
        if not torch.allclose(got["params"][name], param, atol=1e-6, rtol=1e-5):
            return f"parameter {name} differs by {(got['params'][name] - param).abs().max().item():.2e}"
    if not math.isclose(got["eval_loss"], want["eval_loss"], rel_tol=1e-5):
        return f"eval_loss {got['eval_loss']} vs {want['eval_loss']}"
    if got["predictions"].shape != want["predictions"].shape:
        return f"predictions of shape {tuple(got['predictions'].shape)} vs {tuple(want['predictions'].shape)}"
    if not torch.allclose(got["predictions"], want["predictions"], atol=1e-5, rtol=1e-5):
        return f"predictions differ by {(got['predictions'] - want['predictions']).abs().max().item():.2e}"
    return None


def _logits(predictions):
    """``predict()``'s logits (a MoE model's plain run returns its aux loss and router logits beside them)."""
    return next(p for p in predictions if p.ndim == 3) if isinstance(predictions, tuple) else predictions


def tokenizer():
    """A word-level tokenizer over ``VOCAB`` ids, built offline (TRL's SFTTrainer wants a processing class)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(VOCAB)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w1")),
                                   pad_token="w0", eos_token="w1")
    return fast


def worker(rank: int, world: int, names: list[str], out: str, cp_run: bool = True) -> None:
    """A spawned rank (tests/dist_utils.py): the torchrun environment accelerate reads (for CP runs), then
    :func:`run_case` of every case of ``names`` into ``out/<name>``."""
    if cp_run:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    for name in names:
        (Path(out) / name).mkdir(parents=True, exist_ok=True)
        run_case(name, str(Path(out) / name), cp_run=cp_run)
