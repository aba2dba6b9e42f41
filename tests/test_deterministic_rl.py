"""The deterministic mode in whole Hugging Face trainer runs (issue 73, part 3): three steps of ``CPGRPOTrainer``,
``CPRLOOTrainer``, ``CPDPOTrainer``, ``CPTrainer`` (right-padded rows and packed documents) and ``CPSFTTrainer``
with ``ContextParallelArguments(deterministic=True)`` at cp 1, 2 and 4 on the same data (tests/hf_rl_cases.py:
prompts and scripted completions; tests/hf_trainer_cases.py: the SFT rows), tiny Llamas in float32.

What is bitwise (``torch.equal`` / ``==``) at cp 2 (4 query over 2 key-value heads), cp 3 (GRPO; 6 over 3) and cp 4
(4 over 4: ``a2a`` splits heads, so each degree needs its key-value heads divisible; against cp 1 with the same
model) against cp 1:

* GRPO (cp 2, 3 and 4: the RL trainers' sums are divided by dp, so any world): every score TRL computes in the three
  steps (each call of ``_get_per_token_logps_and_entropies``: the old policy's and the reference model's log-probs,
  the policy's log-probs and entropies in the loss), every logged figure (loss, gradient norm, KL, clip ratios, ...)
  and every parameter after the run;
* RLOO: the same at cp 2;
* DPO (cp 2 and 4; a reference model other than the policy): the per-token log-probs of every row from each call of
  the reference model and of the policy, every logged figure of the three steps (chosen and rejected
  log-probs, rewards, margins, accuracies, the loss, the gradient norm) and every parameter;
* Trainer and TRL's SFTTrainer (its fused LM head, packed documents; cp 2): the gradient norm of every step and every
  parameter (the logged loss is each rank's share averaged by Trainer in float32: within an ulp, not compared
  bitwise).

Each run checks that the trainer summed its gradients exactly (``trainer.exact_grads``: docs/deterministic.md).
Negative controls: the default mode (the ring) at cp 2 gives other bits than cp 1's mode in some first-step GRPO
score and DPO figure; the deterministic mode with the exact sums turned off (DDP's float32 all-reduce) gives other
parameters after three steps in each trainer, so the parameter comparison can fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed

STEPS = 3
SHAPES = {"gqa": None, "mha": {"num_key_value_heads": 4},
          "six": {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 48}}
"""The model's heads: 4 query over 2 key-value heads (cp 2), 4 over 4 (cp 4), 6 over 3 (cp 3): ``a2a`` in the mode
needs the key-value heads split over the ranks; each compared with cp 1 on the same model."""


def _trained(trainer, scores: list) -> dict:
    """What a run is compared by: the scores, the logged figures (counters and times left out), the parameters, and
    whether the gradients were summed exactly."""
    import hf_rl_cases as cases

    logged = [{k: v for k, v in e.items() if k not in cases.UNCOMPARED} for e in trainer.state.log_history
              if "loss" in e]
    params = {n: p.detach().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    return {"scores": scores, "logged": logged, "params": params, "exact": trainer.exact_grads is not None}


def _cp_args(world: int, mode: str):
    from cp_handler.integrations.hf_trainer import ContextParallelArguments

    deterministic = mode != "default"
    return ContextParallelArguments(context_parallel_size=world, cp_comm_type="a2a" if deterministic else "p2p",
                                    deterministic=deterministic)


def _grpo(out: Path, world: int, mode: str, fields: dict | None, trainer_name: str = "grpo") -> dict:
    """Three GRPO (or RLOO) steps of CPGRPOTrainer (CPRLOOTrainer) at cp ``world``, every call's log-probs and
    entropies recorded."""
    import hf_rl_cases as cases
    import hf_trainer_cases
    import torch.distributed as dist
    from datasets import Dataset

    from cp_handler.integrations.hf_rl_trainer import CPGRPOTrainer, CPRLOOTrainer

    model = hf_trainer_cases.model("llama", fields)
    type(model).generate = cases.scripted_generate(world)
    path = out / "model"
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    args = cases._arguments({"trainer": trainer_name, "args": {"beta": 0.1}}, str(out), 2, world > 1)
    args.max_steps = STEPS
    cls = CPGRPOTrainer if trainer_name == "grpo" else CPRLOOTrainer
    trainer = cls(model=str(path), args=args, reward_funcs=cases.reward,
                  train_dataset=Dataset.from_list(cases.prompts(8)), processing_class=cases.tokenizer(),
                  cp_args=_cp_args(world, mode))
    scores, score = [], trainer._get_per_token_logps_and_entropies

    def recorded(*args, **kwargs):
        result = score(*args, **kwargs)
        scores.append([t.detach().clone() if isinstance(t, torch.Tensor) else t for t in result[:2]])
        return result

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    return _trained(trainer, scores)


def _dpo(out: Path, world: int, mode: str, fields: dict | None) -> dict:
    """Three DPO steps of CPDPOTrainer at cp ``world``, with a reference model other than the policy (nonzero
    rewards and margins from the first step)."""
    import hf_rl_cases as cases
    import hf_trainer_cases
    import torch.distributed as dist
    import transformers
    from datasets import Dataset

    from cp_handler.integrations.hf_rl_trainer import CPDPOTrainer

    path, ref_path = out / "model", out / "reference"
    if dist.get_rank() == 0:
        hf_trainer_cases.model("llama", fields).save_pretrained(path)
        torch.manual_seed(1)
        reference = hf_trainer_cases.model("llama", fields)
        with torch.no_grad():
            for param in reference.parameters():
                param.add_(0.05 * torch.randn_like(param))
        reference.save_pretrained(ref_path)
    dist.barrier()
    args = cases._arguments({"trainer": "dpo", "args": {}}, str(out), 2, world > 1)
    args.max_steps = STEPS
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_path, attn_implementation="sdpa")
    trainer = CPDPOTrainer(model=str(path), ref_model=reference, args=args,
                           train_dataset=Dataset.from_list(cases.preference_pairs(12)),
                           processing_class=cases.tokenizer(), cp_args=_cp_args(world, mode))
    scores, depth = [], [0]

    def entered(module, args, kwargs):
        depth[0] += 1

    def left(module, args, kwargs, output):  # the outermost call's per-token log-probs of every row (under CP the
        depth[0] -= 1                        # model's forward runs again inside, on the rank's shard)
        if depth[0] == 0 and kwargs.get("fused_lm_head"):
            scores.append([output.log_probs.detach().clone()])

    for model in (trainer.accelerator.unwrap_model(trainer.model), reference):  # the policy's, the reference's
        model.register_forward_pre_hook(entered, with_kwargs=True, prepend=True)
        model.register_forward_hook(left, with_kwargs=True)
    trainer.train()
    return _trained(trainer, scores)


def _sft(out: Path, world: int, mode: str, fields: dict | None, collator: str = "pad") -> dict:
    """Three steps of CPTrainer (``collator``: right-padded rows, or ``"flatten"``: packed documents)."""
    import hf_trainer_cases as cases

    from cp_handler.integrations.hf_trainer import CPTrainer

    args = cases._arguments({"collator": collator}, str(out), 2, world > 1)
    trainer = CPTrainer(model=cases.model("llama", fields), args=args, train_dataset=cases.dataset(16, 1),
                        data_collator=cases._collator(collator), cp_args=_cp_args(world, mode))
    trainer.train()
    return _trained(trainer, [])


def _trl_sft(out: Path, world: int, mode: str, fields: dict | None) -> dict:
    """Three steps of CPSFTTrainer (TRL's SFT: its fused LM head, padding-free packed documents)."""
    import hf_trainer_cases as cases
    from datasets import Dataset

    from cp_handler.integrations.hf_trainer import CPSFTTrainer

    args = cases._arguments({"collator": "trl", "trainer": "sft"}, str(out), 2, world > 1)
    data = Dataset.from_list([{"input_ids": row["input_ids"]} for row in cases.dataset(16, 1)])
    trainer = CPSFTTrainer(model=cases.model("llama", fields), args=args, train_dataset=data,
                           processing_class=cases.tokenizer(), cp_args=_cp_args(world, mode))
    trainer.train()
    return _trained(trainer, [])


RUNS = {"grpo": _grpo, "rloo": lambda *a: _grpo(*a, trainer_name="rloo"), "dpo": _dpo, "sft": _sft,
        "sft_packed": lambda *a: _sft(*a, collator="flatten"), "sft_trl": _trl_sft}


def _worker(rank: int, world: int, out: str, plan: list[tuple[str, str, str]]) -> None:
    """Each ``(name, mode, shape)`` of ``plan`` at cp ``world``; mode ``"exact"`` (the deterministic mode),
    ``"float_sums"`` (the mode with the exact sums turned off) or ``"default"``; shape a key of :data:`SHAPES`."""
    import transformers

    from cp_handler.integrations import hf_exact_grads

    transformers.logging.set_verbosity_error()
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    refusal = hf_exact_grads.refusal
    for name, mode, shape in plan:
        where = Path(out) / f"{name}_cp{world}_{mode}_{shape}"
        where.mkdir(parents=True, exist_ok=True)
        if mode == "float_sums":  # the control: the trainer all-reduces in float32, as without exact sums
            hf_exact_grads.refusal = lambda trainer, model: "turned off (the test's control)"
        try:
            result = RUNS[name](where, world, mode, SHAPES[shape])
        finally:
            hf_exact_grads.refusal = refusal
        if rank == 0:
            torch.save(result, where / "result.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deterministic_rl")
    names = tuple(RUNS)
    run_distributed(_worker, 1, str(out), [(n, "exact", "gqa") for n in names] +
                    [(n, "exact", "mha") for n in ("grpo", "sft", "dpo")] + [("grpo", "exact", "six")])
    run_distributed(_worker, 2, str(out), [(n, "exact", "gqa") for n in names] +
                    [(n, "float_sums", "gqa") for n in names] + [(n, "default", "gqa") for n in ("grpo", "dpo")])
    run_distributed(_worker, 3, str(out), [("grpo", "exact", "six")])
    run_distributed(_worker, 4, str(out), [(n, "exact", "mha") for n in ("grpo", "sft", "dpo")])
    return lambda name, world, mode="exact", shape="gqa": torch.load(
        out / f"{name}_cp{world}_{mode}_{shape}" / "result.pt")


def _same_scores(a: dict, b: dict) -> bool:
    assert len(a["scores"]) == len(b["scores"])
    return all((x is None) == (y is None) and (x is None or torch.equal(x, y))
               for one, other in zip(a["scores"], b["scores"], strict=True) for x, y in zip(one, other, strict=True))


def _same_params(a: dict, b: dict) -> bool:
    assert a["params"].keys() == b["params"].keys()
    return all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def _check_bitwise(want: dict, got: dict, figures: bool = True) -> None:
    assert want["exact"] and got["exact"], "the runs did not sum their gradients exactly"
    assert len(want["logged"]) == STEPS and len(got["logged"]) == STEPS
    assert _same_scores(got, want)
    if figures:
        assert got["logged"] == want["logged"]  # every figure == (floats compared exactly)
    else:
        assert [e.get("grad_norm") for e in got["logged"]] == [e.get("grad_norm") for e in want["logged"]]
    bad = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
    assert not bad, bad


@pytest.mark.parametrize("world, shape", [(2, "gqa"), (3, "six"), (4, "mha")])
def test_grpo_runs_are_bitwise_the_same_at_every_degree(runs, world, shape):
    """cp 3 too: the RL trainers' sums are divided by dp, not by the world (any world, ``hf_exact_grads``). Before
    the parameters were aligned (``align_parameters``), cp 3 differed from one process in the first step's loss
    forward: TRL's one-row head calls follow the weight's alignment, which the checkpoint's layout set."""
    want, got = runs("grpo", 1, shape=shape), runs("grpo", world, shape=shape)
    # TRL's calls per step: the old policy's and the reference's log-probs (no entropies), the policy's with entropies
    assert len(want["scores"]) >= 3 * STEPS - 2 and any(e is not None for _, e in want["scores"]), want["scores"]
    _check_bitwise(want, got)


def test_rloo_runs_are_bitwise_the_same_at_cp_1_and_2(runs):
    _check_bitwise(runs("rloo", 1), runs("rloo", 2))


@pytest.mark.parametrize("world, shape", [(2, "gqa"), (4, "mha")])
def test_dpo_runs_are_bitwise_the_same_at_every_degree(runs, world, shape):
    """DPO at cp 2 and 4: the per-token log-probs of every row from each call of the reference model and of the
    policy, every logged figure and every parameter."""
    want, got = runs("dpo", 1, shape=shape), runs("dpo", world, shape=shape)
    assert want["logged"][0]["rewards/margins"] != 0.0  # the reference differs from the policy
    assert {"loss", "grad_norm", "logps/chosen", "logps/rejected", "rewards/margins"} <= set(want["logged"][0])
    assert len(want["scores"]) >= 2 * STEPS, len(want["scores"])  # the reference's calls and the policy's
    _check_bitwise(want, got)


@pytest.mark.parametrize("name, world, shape", [("sft", 2, "gqa"), ("sft", 4, "mha"), ("sft_packed", 2, "gqa"),
                                                ("sft_trl", 2, "gqa")])
def test_trainer_runs_have_bitwise_the_same_parameters(runs, name, world, shape):
    """Trainer and TRL's SFTTrainer: every parameter and gradient norm (module doc)."""
    _check_bitwise(runs(name, 1, shape=shape), runs(name, world, shape=shape), figures=False)


def test_controls_differ(runs):
    """Without the exact sums (float32 all-reduce, the mode otherwise on) every trainer's parameters differ after
    three steps; the default mode differs from the first step's scores on."""
    for name in RUNS:
        control = runs(name, 2, "float_sums")
        assert not control["exact"]
        assert not _same_params(control, runs(name, 1)), f"{name}: the control cannot fail"
    default, want = runs("grpo", 2, "default"), runs("grpo", 1)
    assert not all(torch.equal(x, y) for a, b in zip(default["scores"][:3], want["scores"][:3], strict=True)
                   for x, y in zip(a, b, strict=True) if x is not None), "the control cannot fail"
    assert runs("dpo", 2, "default")["logged"][0] != runs("dpo", 1)["logged"][0], "the control cannot fail"
    assert not _same_scores(runs("dpo", 2, "default"), runs("dpo", 1)), "the control cannot fail"
