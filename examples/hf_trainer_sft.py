"""Supervised fine-tuning with TRL's SFTTrainer, context-parallel: two lines change (the import, ``cp_args``).

    torchrun --nproc-per-node 2 examples/hf_trainer_sft.py            # cp 2 on CPU (gloo), under a minute
    torchrun --nproc-per-node 8 examples/hf_trainer_sft.py --cp 4     # dp 2 x cp 4 on 8 GPUs, unchanged

Packed documents (``padding_free=True``: each document attends only to itself, RoPE restarts per document) and a
model with a sliding window shorter than the sequence (Mistral), which accelerate's own CP refuses. A tiny
random-weight model and a byte tokenizer built offline keep it self-contained; use your model and dataset.
"""

import argparse

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig

from cp_handler.integrations.hf_trainer import ContextParallelArguments, CPSFTTrainer  # 1. instead of SFTTrainer


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"<{i}>": i for i in range(256)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0>")),
                                        pad_token="<0>", eos_token="<1>")
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2, help="context_parallel_size (dp = ranks / cp)")
    parser.add_argument("--comm-type", default="p2p", help="cp_comm_type: p2p, all_gather, a2a (a2a+p2p needs sizes)")
    options = parser.parse_args()
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             sliding_window=64, attn_implementation="sdpa"))
    text = open(__file__, "rb").read()  # documents: this file's lines, as bytes
    rows = [{"input_ids": list(line)} for line in text.splitlines() if len(line) > 8]
    args = SFTConfig(output_dir="runs/hf_trainer_sft", padding_free=True, per_device_train_batch_size=8,
                     max_steps=20, learning_rate=3e-3, logging_steps=5, save_strategy="no", report_to=[],
                     use_cpu=not torch.cuda.is_available(), bf16=torch.cuda.is_available(), max_length=None)
    trainer = CPSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                           processing_class=byte_tokenizer(),
                           cp_args=ContextParallelArguments(context_parallel_size=options.cp,  # 2. the CP settings
                                                            cp_comm_type=options.comm_type))
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print("losses", " ".join(f"{loss:.3f}" for loss in losses))


if __name__ == "__main__":
    main()
