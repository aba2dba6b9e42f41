"""GRPO with TRL, context-parallel: two lines change (the import, ``cp_args``).

    torchrun --nproc-per-node 2 examples/grpo_cp.py             # cp 2 on CPU (gloo), under two minutes
    torchrun --nproc-per-node 4 examples/grpo_cp.py --cp 2      # dp 2 x cp 2

The ranks of a CP group read the same prompts; the group's first rank samples the completions (HF ``generate`` with
the model's own attention) and shares them; the log-probabilities of the policy (and of the reference model, with
``beta > 0``) run on each rank's shard of prompt + completion, the loss and every logged figure as TRL's with the dp
ranks alone (cp_handler.integrations.hf_rl_trainer).

A tiny random-weight Llama and a word-level tokenizer built offline keep it self-contained; use your model and
tokenizer. The task: a rule reward, the share of ``w5`` among the completion's words; the mean reward rises.
"""

import argparse

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

from cp_handler.integrations.hf_rl_trainer import CPGRPOTrainer  # 1. instead of GRPOTrainer
from cp_handler.integrations.hf_trainer import ContextParallelArguments

VOCAB = 32


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="w0", eos_token="w1")


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        pad_token_id=0, eos_token_id=1, bos_token_id=None,
                                        attn_implementation="sdpa"))


def prompts(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    return [{"prompt": " ".join(f"w{int(t)}" for t in torch.randint(3, VOCAB, (3 + i % 6,), generator=generator))}
            for i in range(count)]


def share_of_w5(completions, **kwargs) -> list[float]:
    return [sum(w == "w5" for w in c.split()) / max(len(c.split()), 1) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2, help="context_parallel_size (dp = ranks / cp)")
    parser.add_argument("--comm-type", default="p2p", help="cp_comm_type: p2p, all_gather, a2a (a2a+p2p needs sizes)")
    options = parser.parse_args()
    args = GRPOConfig(output_dir="runs/grpo_cp", per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=24, learning_rate=2e-2, logging_steps=6,
                      save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                      bf16=torch.cuda.is_available(), gradient_checkpointing=False)
    trainer = CPGRPOTrainer(model=tiny_model(), reward_funcs=share_of_w5, args=args,
                            train_dataset=Dataset.from_list(prompts(256)), processing_class=tiny_tokenizer(),
                            cp_args=ContextParallelArguments(context_parallel_size=options.cp,  # 2. the CP settings
                                                             cp_comm_type=options.comm_type))
    trainer.train()
    if trainer.is_world_process_zero():
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        print("rewards", " ".join(f"{reward:.3f}" for reward in rewards))


if __name__ == "__main__":
    main()
