"""The deterministic mode in whole RL trainer runs (issue 73, part 3). ``CPGRPOTrainer`` with
``ContextParallelArguments(deterministic=True)`` trains a step at cp 1 and at cp 2 on the same prompts and scripted
completions (tests/hf_rl_cases.py), and every score TRL computes in it (the old policy's and the reference model's
per-token log-probabilities, the policy's log-probabilities and entropies in the loss: each call of TRL's
``_get_per_token_logps_and_entropies``) is ``torch.equal`` at the two degrees, and so is the step's loss. One step:
after the first update the parameters differ in their last bits (the gradient's sums over tokens are split over the
ranks and all-reduced, docs/deterministic.md), so later scores are equal within float32 reordering, not bitwise.
``CPDPOTrainer`` likewise, with a reference model other than the policy (so the first step's rewards and margins
are not zero): every figure TRL logs at its first step but the gradient norm (the chosen and rejected log-probs,
rewards, margins, accuracies, the loss) ``==`` at cp 1 and 2. Negative control: the default
mode (the ring, ``p2p``) at cp 2 gives other bits than cp 1's mode in some score, and in some DPO figure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed


def _grpo_scores(out: Path, world: int, deterministic: bool) -> dict:
    """One GRPO step of CPGRPOTrainer at cp ``world``: every call's log-probs and entropies, and the logged loss."""
    import hf_rl_cases as cases
    import hf_trainer_cases
    import torch.distributed as dist
    import transformers
    from datasets import Dataset

    from cp_handler.integrations.hf_rl_trainer import CPGRPOTrainer
    from cp_handler.integrations.hf_trainer import ContextParallelArguments

    transformers.logging.set_verbosity_error()
    model = hf_trainer_cases.model("llama")  # 4 query heads over 2 key-value heads: a2a's heads split at cp 2
    type(model).generate = cases.scripted_generate(world)
    path = out / "model"
    if dist.get_rank() == 0:
        model.save_pretrained(path)
    dist.barrier()
    args = cases._arguments({"trainer": "grpo", "args": {"beta": 0.1}}, str(out), 2, world > 1)
    args.max_steps = 1
    trainer = CPGRPOTrainer(model=str(path), args=args, reward_funcs=cases.reward,
                            train_dataset=Dataset.from_list(cases.prompts(8)), processing_class=cases.tokenizer(),
                            cp_args=ContextParallelArguments(context_parallel_size=world,
                                                             cp_comm_type="a2a" if deterministic else "p2p",
                                                             deterministic=deterministic))
    scores, score = [], trainer._get_per_token_logps_and_entropies

    def recorded(*args, **kwargs):
        result = score(*args, **kwargs)
        scores.append([t.detach().clone() if isinstance(t, torch.Tensor) else t for t in result[:2]])
        return result

    trainer._get_per_token_logps_and_entropies = recorded
    trainer.train()
    return {"scores": scores, "loss": [e["loss"] for e in trainer.state.log_history if "loss" in e]}


def _dpo_logged(out: Path, world: int, deterministic: bool) -> dict:
    """One DPO step of CPDPOTrainer at cp ``world``: the figures TRL logs (rewards, margins, accuracies and the
    chosen / rejected log-probs, all sums of the per-token log-probs of the policy and of the reference model; the
    loss), the gradient norm left out (the gradient is not bitwise, module doc)."""
    import hf_rl_cases as cases
    import hf_trainer_cases
    import torch.distributed as dist
    import transformers
    from datasets import Dataset

    from cp_handler.integrations.hf_rl_trainer import CPDPOTrainer
    from cp_handler.integrations.hf_trainer import ContextParallelArguments

    transformers.logging.set_verbosity_error()
    path, ref_path = out / "model", out / "reference"
    if dist.get_rank() == 0:
        hf_trainer_cases.model("llama").save_pretrained(path)
        torch.manual_seed(1)  # a reference other than the policy: nonzero rewards and margins at the first step
        reference = hf_trainer_cases.model("llama")
        with torch.no_grad():
            for param in reference.parameters():
                param.add_(0.05 * torch.randn_like(param))
        reference.save_pretrained(ref_path)
    dist.barrier()
    args = cases._arguments({"trainer": "dpo", "args": {}}, str(out), 2, world > 1)
    args.max_steps = 1
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_path, attn_implementation="sdpa")
    trainer = CPDPOTrainer(model=str(path), ref_model=reference, args=args,
                           train_dataset=Dataset.from_list(cases.preference_pairs(12)),
                           processing_class=cases.tokenizer(),
                           cp_args=ContextParallelArguments(context_parallel_size=world,
                                                            cp_comm_type="a2a" if deterministic else "p2p",
                                                            deterministic=deterministic))
    trainer.train()
    return {"logged": [{k: v for k, v in e.items() if k not in cases.UNCOMPARED and k != "grad_norm"}
                       for e in trainer.state.log_history if "loss" in e]}


def _worker(rank: int, world: int, out: str, modes: list[bool]) -> None:
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    for deterministic in modes:
        for name, run in (("grpo", _grpo_scores), ("dpo", _dpo_logged)):
            where = Path(out) / f"{name}_cp{world}_{deterministic}"
            where.mkdir(parents=True, exist_ok=True)
            result = run(where, world, deterministic)
            if rank == 0:
                torch.save(result, where / "result.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deterministic_rl")
    run_distributed(_worker, 1, str(out), [True])
    run_distributed(_worker, 2, str(out), [True, False])
    runs = ("cp1_True", "cp2_True", "cp2_False")
    return lambda name: [torch.load(out / f"{name}_{run}" / "result.pt") for run in runs]


def test_grpo_step_scores_are_bitwise_the_same_at_cp_1_and_2(runs):
    want, got, default = runs("grpo")
    # TRL's calls: the old policy's and the reference's log-probs (no entropies), the policy's with entropies
    assert len(want["scores"]) >= 3 and any(e is not None for _, e in want["scores"]), want["scores"]
    assert len(got["scores"]) == len(want["scores"]) and len(want["loss"]) == 1
    for i, (a, b) in enumerate(zip(got["scores"], want["scores"], strict=True)):
        for name, x, y in zip(("log-probs", "entropies"), a, b, strict=True):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), \
                (i, name, None if x is None else (x - y).abs().max().item())
    assert got["loss"] == want["loss"]
    assert not all(torch.equal(x, y) for a, b in zip(default["scores"], want["scores"], strict=True)
                   for x, y in zip(a, b, strict=True) if x is not None), "the control cannot fail"


def test_dpo_step_figures_are_bitwise_the_same_at_cp_1_and_2(runs):
    want, got, default = runs("dpo")
    (step,) = want["logged"]
    assert {"loss", "logps/chosen", "logps/rejected", "rewards/margins"} <= set(step), sorted(step)
    assert step["rewards/margins"] != 0.0  # the reference differs from the policy
    assert got["logged"] == want["logged"]  # every figure == (floats compared exactly)
    assert default["logged"] != want["logged"], "the control cannot fail"
