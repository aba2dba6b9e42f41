"""Runs of TRL's GRPO, RLOO and DPO trainers for tests/test_hf_rl_trainer.py: TRL's trainer on ``dp`` processes (the
reference: one process for cp 2 alone, two for dp 2 x cp 2), or ``dp x cp`` spawned gloo ranks with cp_handler's
(``CPGRPOTrainer``, ``CPRLOOTrainer``, ``CPDPOTrainer``), on the same prompts and the same completions, the same
per-device batch. Each run writes every logged figure of every step and the final parameters.

The completions are fixed: the model class's ``generate`` is replaced by :func:`scripted_generate`, a function of
the prompt and of its occurrence in the call (so a group of ``num_generations`` copies gets distinct completions of
varying lengths, some ended by EOS, some cut at ``max_completion_length``), which refuses to run on a rank other
than its CP group's first and advances the random state as sampling does. The reward is a rule on the decoded
completion. Tiny random-weight models, a word-level tokenizer built offline, SGD (its update is linear in the gradient).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 64
PAD, EOS = 0, 1
MAX_COMPLETION = 6
CASES = {
    # name: trainer, model (hf_trainer_cases.model), its config fields, the trainer's config fields, cp args
    "grpo_cp2": {"trainer": "grpo", "model": "llama", "args": {"beta": 0.1, "loss_type": "grpo"},
                 "cp": {"context_parallel_size": 2}},
    "grpo_dapo_sequence_a2a": {"trainer": "grpo", "model": "llama",
                               "args": {"beta": 0.1, "loss_type": "dapo", "importance_sampling_level": "sequence"},
                               "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "grpo_dp2_bnpo": {"trainer": "grpo", "model": "llama", "args": {"loss_type": "bnpo", "beta": 0.05},
                      "cp": {"context_parallel_size": 2}},
    "grpo_dr_grpo_hybrid": {"trainer": "grpo", "model": "qwen3_next",
                            "config": {"layer_types": ["linear_attention", "full_attention"]},
                            "args": {"loss_type": "dr_grpo", "beta": 0.1}, "cp": {"context_parallel_size": 2}},
    "grpo_mla": {"trainer": "grpo", "model": "deepseek_v3", "args": {"beta": 0.1},
                 "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "grpo_accumulate": {"trainer": "grpo", "model": "llama", "args": {"beta": 0.1, "gradient_accumulation_steps": 2},
                        "cp": {"context_parallel_size": 2, "cp_comm_type": "all_gather"}},
    "rloo_cp2": {"trainer": "rloo", "model": "llama", "args": {"beta": 0.1}, "cp": {"context_parallel_size": 2}},
    "dpo_cp2": {"trainer": "dpo", "model": "llama", "args": {}, "cp": {"context_parallel_size": 2}},
    "dpo_dp2_a2a": {"trainer": "dpo", "model": "llama", "args": {"loss_type": ["sigmoid"]},
                    "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    # the reference log-probs precomputed inside TRL's __init__ (before the loaders go over dp: deferred by the mixin)
    "dpo_precompute_cp2": {"trainer": "dpo", "model": "llama", "args": {"precompute_ref_log_probs": True},
                           "cp": {"context_parallel_size": 2}},
    "dpo_precompute_dp2": {"trainer": "dpo", "model": "llama", "args": {"precompute_ref_log_probs": True},
                           "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "grpo_labels_per_shard": {"trainer": "grpo", "model": "llama", "args": {"beta": 0.1},
                              "cp": {"context_parallel_size": 2}, "break": "labels_per_shard"},
}
"""Each case's reference is the same name run with TRL's trainer on dp processes (``break``: a negative control, the
labels shifted inside each rank's shard as TRL's head would without the global ``shift_labels``)."""
WORLD = {"grpo_dp2_bnpo": 4, "dpo_dp2_a2a": 4, "dpo_precompute_dp2": 4}
"""Ranks per case (default 2: cp 2 alone); dp = world / cp. TRL's losses at dp > 1 are its own (bnpo divides by each
process's token count, DDP averages): the reference runs the same dp."""
EVAL_UNCOMPARED = ("_runtime", "_samples_per_second", "_steps_per_second", "epoch")
"""Suffixes of ``evaluate()``'s keys that time the run (the precompute cases compare the rest: losses, rewards)."""
UNCOMPARED = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second",
              "total_flos", "epoch")
"""Logged keys that are times or counters of the run, not results."""


def tokenizer():
    """A word-level tokenizer over ``VOCAB`` ids (``w0`` padding, ``w1`` EOS), split on whitespace, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="w0", eos_token="w1")


def _words(generator, count: int) -> str:
    return " ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (count,), generator=generator))


def prompts(count: int, seed: int = 1):
    """``count`` prompts of 3 to 9 words (TRL left-pads them)."""
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt": _words(generator, 3 + (5 * i) % 7)} for i in range(count)]


def preference_pairs(count: int, seed: int = 2):
    """``count`` DPO examples: a prompt, a chosen and a rejected completion of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt": _words(generator, 2 + (3 * i) % 5), "chosen": _words(generator, 2 + i % 4),
             "rejected": _words(generator, 3 + (2 * i) % 5)} for i in range(count)]


def reward(completions, **kwargs):
    """A rule: multiples of 3 among the completion's word ids, and a little for its length."""
    return [float(sum(int(w[1:]) % 3 == 0 for w in c.split())) + 0.1 * len(c.split()) for c in completions]


def scripted_generate(cp: int):
    """A ``generate`` returning fixed completions (module doc); refuses a rank that is not its group's first."""

    def generate(self, input_ids=None, attention_mask=None, generation_config=None, **kwargs):
        if dist.is_initialized() and dist.get_rank() % cp:
            raise AssertionError(f"rank {dist.get_rank()} generated: only the first rank of a CP group generates")
        torch.rand(3)  # sampling advances the random state (of the generating rank only)
        seen, rows = Counter(), []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            prompt = tuple(t for t, m in zip(ids, mask, strict=True) if m)
            seed = sum((i + 1) * t for i, t in enumerate(prompt)) * 31 + seen[prompt]
            seen[prompt] += 1
            generator = torch.Generator().manual_seed(seed)
            length = int(torch.randint(2, MAX_COMPLETION + 1, (1,), generator=generator))
            tokens = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
            tokens = (tokens + [EOS] if length < MAX_COMPLETION else tokens)[:MAX_COMPLETION]
            rows.append(tokens + [PAD] * (MAX_COMPLETION - len(tokens)))
        return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], 1)

    return generate


def _arguments(case: dict, out: str, batch: int, cp_run: bool):
    common = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=batch, max_steps=3, learning_rate=0.05,
                  optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                  seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=False,
                  ddp_backend="gloo" if cp_run else None,
                  model_init_kwargs={"attn_implementation": "sdpa", "dtype": "float32"}, **case["args"])
    if case["trainer"] == "dpo":
        from trl import DPOConfig

        return DPOConfig(**common, max_length=None)
    from trl import GRPOConfig, RLOOConfig

    # one generation serves two steps (num_iterations 2): the old policy's log-probs are computed and clipped
    rl = dict(num_generations=2, max_completion_length=MAX_COMPLETION, temperature=0.7, num_iterations=2,
              shuffle_dataset=False)
    return (GRPOConfig if case["trainer"] == "grpo" else RLOOConfig)(**common, **rl)


def break_labels_per_shard() -> None:
    """The negative control, for the rest of this process (a spawn runs it last): the fused head given this rank's
    labels shifted inside its shard (as TRL's head shifts without the global ``shift_labels``)."""
    from cp_handler.integrations import hf_fused_head

    original = hf_fused_head.shard_batch

    def local_labels(batch, *args, **kwargs):
        sharded = original(batch, *args, **kwargs)
        ids = sharded.inputs["input_ids"]
        sharded.inputs["shift_labels"] = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
        return sharded

    hf_fused_head.shard_batch = local_labels


def run_case(name: str, out: str, cp_run: bool) -> None:
    """Train 3 steps; rank 0 writes ``out/result.pt``."""
    import hf_trainer_cases
    import transformers

    transformers.logging.set_verbosity_error()
    case = CASES[name]
    cp = case["cp"]["context_parallel_size"]
    dp = WORLD.get(name, 2) // cp
    model = hf_trainer_cases.model(case["model"], case.get("config"))
    type(model).generate = scripted_generate(cp if cp_run else 1)
    path = Path(out) / "model"  # TRL loads its reference model from a path
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    common = dict(model=str(path), args=_arguments(case, out, 2, dist.get_world_size() > 1),
                  processing_class=tokenizer())
    from datasets import Dataset

    if case["trainer"] == "dpo":
        common["train_dataset"] = Dataset.from_list(preference_pairs(12 * dp))
        if case["args"].get("precompute_ref_log_probs"):  # TRL's cache of the log-probs: written by the main process
            # beside a dataset on disk (an in-memory one's is in a per-process temp dir); evaluation data too, whose
            # log-probs TRL also precomputes in its __init__ (the mixin defers them with the training set's): one
            # dataset at dp 1, a dict of two (evaluated one by one) at dp 2
            evals = {"a": preference_pairs(4 * dp, seed=1), "b": preference_pairs(2 * dp, seed=3)}
            common["eval_dataset"] = _on_disk(Path(out) / "eval_a", Dataset.from_list(evals["a"])) if dp == 1 else {
                key: _on_disk(Path(out) / f"eval_{key}", Dataset.from_list(rows)) for key, rows in evals.items()}
            common["train_dataset"] = _on_disk(Path(out) / "pairs", common["train_dataset"])
    else:
        common.update(train_dataset=Dataset.from_list(prompts(8 * dp)), reward_funcs=reward)
    import trl

    from cp_handler.integrations import hf_rl_trainer

    base = {"grpo": "GRPOTrainer", "rloo": "RLOOTrainer", "dpo": "DPOTrainer"}[case["trainer"]]
    if cp_run:
        from cp_handler.integrations.hf_trainer import ContextParallelArguments

        cls, common["cp_args"] = getattr(hf_rl_trainer, f"CP{base}"), ContextParallelArguments(**case["cp"])
        if case.get("break"):
            break_labels_per_shard()
    else:
        cls = getattr(trl, base)
    trainer = cls(**common)
    trainer.train()
    logged = [{k: v for k, v in entry.items() if k not in UNCOMPARED} for entry in trainer.state.log_history
              if "loss" in entry]
    evaluated = {k: v for k, v in trainer.evaluate().items() if not k.endswith(EVAL_UNCOMPARED)} \
        if "eval_dataset" in common else {}
    if dist.get_rank() == 0:
        params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
        torch.save({"logged": logged, "evaluated": evaluated, "params": params}, Path(out) / "result.pt")


def _on_disk(folder: Path, dataset):
    """``dataset`` saved by rank 0 and loaded back on every rank (a dataset with cache files: TRL's precompute cache
    then sits beside it, where every rank reads it)."""
    from datasets import load_from_disk

    if dist.get_rank() == 0:
        dataset.save_to_disk(str(folder))
    dist.barrier()
    return load_from_disk(str(folder))


def compare(got: dict, want: dict) -> str | None:
    """The first difference between two runs' results, or ``None`` (tolerances: tests/test_hf_rl_trainer.py)."""
    if len(got["logged"]) != len(want["logged"]):
        return f"{len(got['logged'])} logged steps, expected {len(want['logged'])}"
    for step, (a, b) in enumerate(zip(got["logged"], want["logged"], strict=True)):
        if sorted(a) != sorted(b):
            return f"step {step + 1}: logged keys {sorted(a)} vs {sorted(b)}"
        for key in sorted(b, key=lambda k: k != "loss"):
            if not math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6):
                return f"step {step + 1}: {key} {a[key]} vs {b[key]}"
    for name, param in want["params"].items():
        if not torch.allclose(got["params"][name], param, atol=1e-6, rtol=1e-5):
            return f"parameter {name} differs by {(got['params'][name] - param).abs().max().item():.2e}"
    if sorted(got["evaluated"]) != sorted(want["evaluated"]):
        return f"evaluate(): keys {sorted(got['evaluated'])} vs {sorted(want['evaluated'])}"
    for key, value in want["evaluated"].items():
        if not math.isclose(got["evaluated"][key], value, rel_tol=1e-5, abs_tol=1e-6):
            return f"evaluate(): {key} {got['evaluated'][key]} vs {value}"
    return None


def run_all(out: Path) -> dict:
    """Every case: the references and the CP runs, one spawn per world size; ``{name: (cp, reference)}``."""
    from dist_utils import run_distributed

    for cp_run in (False, True):
        worlds = {name: WORLD.get(name, 2) // (1 if cp_run else CASES[name]["cp"]["context_parallel_size"])
                  for name in CASES}
        for world in sorted(set(worlds.values())):
            names = sorted((n for n in CASES if worlds[n] == world), key=lambda n: "break" in CASES[n])
            run_distributed(worker, world, names, str(out / ("cp" if cp_run else "reference")), cp_run)
    return {name: (torch.load(out / "cp" / name / "result.pt"), torch.load(out / "reference" / name / "result.pt"))
            for name in CASES}


def worker(rank: int, world: int, names: list[str], out: str, cp_run: bool = True) -> None:
    """A spawned rank (tests/dist_utils.py): the torchrun environment accelerate reads (more than one rank), then
    :func:`run_case` of every case of ``names`` into ``out/<name>``."""
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    for name in names:
        (Path(out) / name).mkdir(parents=True, exist_ok=True)
        run_case(name, str(Path(out) / name), cp_run=cp_run)
