"""Supervised fine-tuning of a vision-language model with TRL's SFTTrainer, context-parallel: two lines change (the
import, ``cp_args``).

    torchrun --nproc-per-node 2 examples/hf_vlm_sft.py            # cp 2 on CPU (gloo), under a minute
    torchrun --nproc-per-node 4 examples/hf_vlm_sft.py --cp 2     # dp 2 x cp 2

TRL's own vision path: rows with ``images`` and a prompt / completion, collated per batch by its
``DataCollatorForVisionLanguageModeling`` through the processor (``pixel_values``, ``image_grid_thw``,
``mm_token_type_ids``). Under CP every rank of a group takes the whole batch and runs the vision tower on every image;
the language model runs on this rank's shard of the merged sequence, at Qwen's 3-D mRoPE positions
(cp_handler.integrations.hf_vlm). Right padding only; no packing (TRL refuses it for images anyway).

A tiny random-weight Qwen2.5-VL and a processor built offline (word-level tokenizer, 56-pixel images: 4 image tokens
each) keep it self-contained; use your model and ``AutoProcessor.from_pretrained(...)``. The task: name the colour of
a noisy solid-colour image.
"""

import argparse

import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from trl import SFTConfig

from cp_handler.integrations.hf_trainer import ContextParallelArguments, CPSFTTrainer  # 1. instead of SFTTrainer

VISION_TOKENS = {"<|image_pad|>": 250, "<|video_pad|>": 251, "<|vision_start|>": 252, "<|vision_end|>": 253}
COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 50)}


class ImageProcessor(Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor (transformers builds that only with torchvision)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def tiny_processor() -> ImageProcessor:
    words = ["<pad>", "<eos>", *COLOURS, *(f"w{i}" for i in range(2, 200))]
    vocab = {**{word: i for i, word in enumerate(words)}, **VISION_TOKENS}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                        additional_special_tokens=list(VISION_TOKENS))
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}, patch_size=14,
                                      temporal_patch_size=2, merge_size=2)
    return ImageProcessor(image_processor=images, tokenizer=tokenizer)


def tiny_model() -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(0)
    ids = {"image_token_id": 250, "video_token_id": 251, "vision_start_token_id": 252, "vision_end_token_id": 253}
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 14, "window_size": 56,
                       "fullatt_block_indexes": [1]},
        text_config={"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                     "bos_token_id": None, "eos_token_id": 1, "pad_token_id": 0},
        **ids))


def rows(count: int, seed: int) -> list[dict]:
    """A noisy solid-colour image, a prompt of a few random words around it, the colour's name as the completion."""
    generator = np.random.default_rng(seed)
    out = []
    for i in range(count):
        name, rgb = list(COLOURS.items())[i % len(COLOURS)]
        pixels = np.clip(np.array(rgb) + generator.normal(0, 20, (56, 56, 3)), 0, 255).astype(np.uint8)
        words = " ".join(f"w{w}" for w in generator.integers(2, 200, 2 + i % 5))
        out.append({"images": [Image.fromarray(pixels)], "completion": f"{name} <eos>",
                    "prompt": f"{words} <|vision_start|><|image_pad|><|vision_end|> w7 w8"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp", type=int, default=2, help="context_parallel_size (dp = ranks / cp)")
    parser.add_argument("--comm-type", default="a2a", help="cp_comm_type: p2p, all_gather, a2a (a2a+p2p needs sizes)")
    options = parser.parse_args()
    args = SFTConfig(output_dir="runs/hf_vlm_sft", per_device_train_batch_size=8, max_steps=20, learning_rate=3e-3,
                     logging_steps=5, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
                     bf16=torch.cuda.is_available(), max_length=None)
    trainer = CPSFTTrainer(model=tiny_model(), args=args, train_dataset=Dataset.from_list(rows(64, 0)),
                           processing_class=tiny_processor(),
                           cp_args=ContextParallelArguments(context_parallel_size=options.cp,  # 2. the CP settings
                                                            cp_comm_type=options.comm_type))
    trainer.train()
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print("losses", " ".join(f"{loss:.3f}" for loss in losses))


if __name__ == "__main__":
    main()
