"""Context parallelism inside TRL's RL and preference trainers (cp_handler.integrations.hf_rl_trainer): every figure
TRL logs at every step (loss, gradient norm, rewards and their spread, kl, entropy, clip ratios, completion lengths,
num_tokens; DPO's rewards, margins, accuracies, log-probs) and the final parameters of ``CPGRPOTrainer`` /
``CPRLOOTrainer`` / ``CPDPOTrainer`` on spawned gloo ranks equal TRL's trainer on the dp processes alone, on the same
prompts and completions (tests/hf_rl_cases.py: scripted completions, a rule reward, temperature 0.7, a reference model
(beta > 0), one generation reused for two steps so the old policy's log-probs and the clipping run): GRPO with the
grpo, dapo (sequence-level importance sampling, a2a), bnpo (dp 2 x cp 2) and dr_grpo (a hybrid: Qwen3-Next, its MoE
load-balancing loss on) losses, two accumulation steps (the generation batch split into micro-batches, all_gather)
and an MLA model (DeepSeek-V3), RLOO, DPO at cp 2 and dp 2 x cp 2 (a2a), each also with its reference log-probs
precomputed (``precompute_ref_log_probs=True``: TRL computes them inside its ``__init__``, for the evaluation data
too: one dataset at cp 2, a dict of two at dp 2 x cp 2, ``evaluate()`` compared). Generation runs
on the first rank of each CP group only (the scripted ``generate`` raises elsewhere). The negative control (labels
shifted inside each rank's shard) must fail the comparison. Settings the mixin does not implement are refused by name
from the constructor's arguments, before TRL's ``__init__`` acts on them (vLLM, tools, a custom rollout).

Tolerances (float32): every logged figure rel 1e-5, abs 1e-6 (a loss of a first on-policy step is ~1e-7: its value is
a sum that cancels); parameters after 3 SGD steps atol 1e-6 + rtol 1e-5 (tests/test_hf_trainer.py's).
"""

from __future__ import annotations

import hf_rl_cases as cases
import pytest
from dist_utils import run_distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return cases.run_all(tmp_path_factory.mktemp("hf_rl"))


@pytest.mark.parametrize("name", [n for n in cases.CASES if not cases.CASES[n].get("break")])
def test_rl_trainer_under_cp_equals_trl(results, name):
    got, want = results[name]
    assert len(want["logged"]) == 3 and len(want["logged"][0]) > 10  # the loss, the gradient norm and TRL's figures
    assert ("eval_loss" in want["evaluated"] or "eval_a_loss" in want["evaluated"]) == ("precompute" in name)
    assert cases.compare(got, want) is None, cases.compare(got, want)


def test_negative_control_fails(results):
    problem = cases.compare(*results["grpo_labels_per_shard"])
    assert problem is not None and "logged keys" not in problem, problem


def _refusals_worker(rank, world, out):
    import os

    from datasets import Dataset
    from trl import GRPOConfig

    from cp_handler.integrations.hf_rl_trainer import CPGRPOTrainer
    from cp_handler.integrations.hf_trainer import ContextParallelArguments
    from cp_handler.integrations.transformers import register

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import hf_trainer_cases

    def trainer(args=None, **changes):
        config = {**dict(output_dir=out, use_cpu=True, per_device_train_batch_size=2, num_generations=2,
                         max_completion_length=4, report_to=[], ddp_backend="gloo", bf16=False), **(args or {})}
        kwargs = dict(model=hf_trainer_cases.model("llama"), args=GRPOConfig(**config), reward_funcs=cases.reward,
                      train_dataset=Dataset.from_list(cases.prompts(4)), processing_class=cases.tokenizer(),
                      cp_args=ContextParallelArguments(context_parallel_size=2))
        return CPGRPOTrainer(**{**kwargs, **changes})

    registered = hf_trainer_cases.model("llama")
    register(registered)

    def a_tool(x: int) -> int:
        """Adds one.

        Args:
            x: a number.
        """
        return x + 1

    # refused from the constructor's arguments, before TRL's __init__ acts on them (it would import and set up vLLM:
    # ImportError here; demand a chat template for the tools: the tokenizer has none); TRL's __init__ made to fail
    # the test shows none reaches it, and a trainer the checks pass does (the control)
    import functools

    import trl

    original = trl.GRPOTrainer.__init__

    @functools.wraps(original)
    def acted(self, *args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ ran")

    trl.GRPOTrainer.__init__ = acted
    try:
        for changes, message in (
            ({"args": {"use_vllm": True}}, r"use_vllm=True \(vLLM's generation gathers prompts over every process"),
            ({"tools": [a_tool]}, r"tools / environment_factory \(each rank of a CP group would run the tools"),
            ({"rollout_func": lambda prompts, trainer: {}}, r"rollout_func \(a custom generation on every rank"),
            ({"cp_args": ContextParallelArguments(context_parallel_size=2, loss_normalization="micro_batch_mean")},
             r"ContextParallelArguments\.loss_normalization='micro_batch_mean' \(the RL trainers keep TRL's own"),
            ({"args": {"per_device_train_batch_size": 1}}, r"generation_batch_size = per_device_train_batch_size "
                                                           r"\(1\) x dp \(1\) x steps_per_generation \(1\) = 1, not "
                                                           r"a multiple of num_generations \(2\)"),
            ({"model": registered}, r"a model whose attn_implementation is 'cp_handler' already"),
        ):
            with pytest.raises(ValueError, match="CPGRPOTrainer: refused under context parallelism: " + message):
                trainer(**changes)
        os.environ["ACCELERATE_USE_FSDP"] = "true"  # as `accelerate launch` with an FSDP config sets it
        try:
            with pytest.raises(ValueError, match=r"CPGRPOTrainer: refused under context parallelism: FSDP / DeepSpeed "
                                                 r"\(sharded weights"):
                trainer()
        finally:
            del os.environ["ACCELERATE_USE_FSDP"]
        with pytest.raises(AssertionError, match="GRPOTrainer.__init__ ran"):
            trainer()
    finally:
        trl.GRPOTrainer.__init__ = original
    # DPO's precomputed reference log-probs of a dataset held in memory: TRL's cache file would be written by the main
    # process alone in a temporary folder of its own (the other ranks failed to read it); a dataset on disk runs
    # (hf_rl_cases.py's precompute cases)
    from trl import DPOConfig

    from cp_handler.integrations.hf_rl_trainer import CPDPOTrainer

    with pytest.raises(ValueError, match=r"CPDPOTrainer: refused under context parallelism: "
                                         r"precompute_ref_log_probs=True with train_dataset held in memory"):
        CPDPOTrainer(model=hf_trainer_cases.model("llama"), train_dataset=Dataset.from_list(cases.preference_pairs(4)),
                     args=DPOConfig(output_dir=out, use_cpu=True, report_to=[], bf16=False, ddp_backend="gloo",
                                    precompute_ref_log_probs=True, max_length=None),
                     processing_class=cases.tokenizer(), cp_args=ContextParallelArguments(context_parallel_size=2))


def test_refused_settings(tmp_path):
    run_distributed(_refusals_worker, 2, str(tmp_path))
