"""Vision-language model (VLM) runs of Hugging Face Trainer / TRL SFTTrainer for tests/test_hf_vlm_trainer.py: one
process with the plain trainer (the reference) or spawned gloo ranks with ``CPTrainer`` / ``CPSFTTrainer``, on the
same global batches; each run writes the result file of tests/hf_trainer_cases.py (the loss and gradient norm of
every logged step, the final parameters, ``evaluate()``'s loss, ``predict()``'s logits), compared there.

Data, one image per example (tests/hf_vlm_zoo.py's tiny models and token ids):

* ``"zoo"``: examples cut from :func:`hf_vlm_zoo.batch` (pixels, Qwen's ``image_grid_thw`` and ``mm_token_type_ids``,
  labels = ``input_ids``) of varying lengths, collated by :func:`collate` (right padding: ``attention_mask``, labels
  -100 on the padding);
* ``"messages"`` / ``"prompt_completion"``: TRL's own vision path, rows with ``images`` (PIL) and conversational
  ``messages`` or plain ``prompt`` / ``completion`` text, collated by TRL's ``DataCollatorForVisionLanguageModeling``
  through a Qwen2.5-VL processor built offline (:func:`processor`): a PIL image processor with 14-pixel patches and a
  word-level tokenizer holding Qwen's vision tokens at the zoo's ids.
"""

from __future__ import annotations

import contextlib

import hf_trainer_cases as text_cases
import hf_vlm_zoo as zoo
import numpy as np
import torch
import torch.distributed as dist

CASES = {
    # name: zoo model, data (module doc), trainer ("sft": TRL's), cp args
    "qwen2_5_vl_p2p": {"model": "qwen2_5_vl", "data": "zoo", "cp": {"context_parallel_size": 2}},
    "llava_all_gather": {"model": "llava", "data": "zoo", "cp": {"context_parallel_size": 2,
                                                                  "cp_comm_type": "all_gather"}},
    "sft_qwen2_5_vl_messages": {"model": "qwen2_5_vl", "data": "messages", "trainer": "sft",
                                "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    # prompts left-padded by the processor, then flushed left by TRL: right padding; completion-only labels
    "sft_qwen2_5_vl_prompt_completion": {"model": "qwen2_5_vl", "data": "prompt_completion", "trainer": "sft",
                                         "cp": {"context_parallel_size": 2}},
    # dp 2 x cp 2: the loss normalised by the token count of both dp ranks' batches (loss_normalization, the plain
    # trainer at dp 2 averages each rank's mean: this harness's reference is one process), as one process's mean. Eval
    # examples of one length: at dp > 1 Trainer's eval loss (with or without CP) is the token-weighted mean over the
    # dp ranks' concurrent batches (num_items_in_batch gathered over every process), one process's the mean of
    # per-batch means
    "sft_qwen2_5_vl_dp2": {"model": "qwen2_5_vl", "data": "messages", "trainer": "sft",
                           "cp": {"context_parallel_size": 2, "cp_comm_type": "p2p",
                                  "loss_normalization": "global_token_count"}},
    # gradient accumulation: Qwen2.5-VL's class sets accepts_loss_kwargs=False, so the plain trainers average each
    # micro-batch's mean: so does the CP run by default (loss_normalization=None); with
    # loss_normalization="global_token_count" it normalises by the step's global token count, as for every text model,
    # and equals the plain Trainer told the model takes the loss arguments (docs/huggingface.md)
    "qwen2_5_vl_accumulate": {"model": "qwen2_5_vl", "data": "zoo", "cp": {"context_parallel_size": 2,
                                                                          "cp_comm_type": "a2a"}, "accumulate": 2},
    # at dp 2 x cp 2 the default (each micro-batch's mean) equals the plain Trainer on the 2 dp processes (DDP averages
    # their micro-batch means: not one process's mean of the joined batch), REFERENCE_WORLD
    "qwen2_5_vl_dp2_accumulate": {"model": "qwen2_5_vl", "data": "zoo", "accumulate": 2,
                                  "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "qwen2_5_vl_accumulate_global": {"model": "qwen2_5_vl", "data": "zoo", "accumulate": 2,
                                     "cp": {"context_parallel_size": 2, "loss_normalization": "global_token_count"},
                                     "reference_loss_kwargs": True},
    "sft_qwen2_5_vl_accumulate": {"model": "qwen2_5_vl", "data": "messages", "trainer": "sft", "accumulate": 2,
                                  "cp": {"context_parallel_size": 2}},
    # a MoE vision-language model with its load-balancing loss on (hf_vlm_zoo's variant: coefficient 0.5), right
    # padding (excluded from the router statistics as one process excludes it), gradient accumulation
    "qwen3_5_moe_router_loss": {"model": "qwen3_5_moe_router_loss", "data": "zoo", "accumulate": 2,
                                "cp": {"context_parallel_size": 2}},
    "sft_qwen3_5_moe_router_loss": {"model": "qwen3_5_moe_router_loss", "data": "messages", "trainer": "sft",
                                    "accumulate": 2, "cp": {"context_parallel_size": 2, "cp_comm_type": "a2a"}},
    "qwen2_5_vl_text_positions": {"model": "qwen2_5_vl", "data": "zoo", "cp": {"context_parallel_size": 2},
                                  "break": "positions"},
    "qwen3_5_moe_router_padding": {"model": "qwen3_5_moe_router_loss", "data": "zoo", "accumulate": 2,
                                   "cp": {"context_parallel_size": 2}, "break": "router_tokens"},
}
"""Each case's reference is the same name run alone (``break``: a negative control, the language model given positions
``0..S-1`` instead of the model's 3-D mRoPE positions, which place the image tokens on a 2-D grid, or Qwen3.5-MoE's
router loss counting the shard's padding as tokens)."""
WORLD = {"sft_qwen2_5_vl_dp2": 4, "qwen2_5_vl_dp2_accumulate": 4}
"""Ranks per case (default 2: cp 2 alone); dp = world / cp."""
REFERENCE_WORLD = {"qwen2_5_vl_dp2_accumulate": 2}
"""Cases whose reference is the plain trainer on dp processes (DDP, batch 2 each) instead of one process on the dp
ranks' batches joined (default 1)."""
LENGTHS = (24, 30, 26, 22)
"""Tokens per :func:`hf_vlm_zoo.batch` row before its row 1 loses 3 to padding: examples of 19 to 30 tokens."""
WORDS = 240
"""The tokenizer's words ``w2 .. w239`` have ids 2 .. 239 (0: padding, 1: end of sequence); Qwen's vision tokens
keep the zoo's ids (image 250, video 251, start 252, end 253)."""
CHAT_TEMPLATE = ("{%- for m in messages -%}{%- for c in m['content'] -%}{%- if c['type'] == 'image' -%}"
                 "<|vision_start|><|image_pad|><|vision_end|> {% else %}{{ c['text'] }} {% endif -%}{%- endfor -%}"
                 "{%- endfor -%}")
"""Every message's text in turn, an image as Qwen's start, placeholder and end tokens."""


def zoo_examples(name: str, count: int, seed: int) -> list[dict]:
    """``count`` examples cut from :func:`hf_vlm_zoo.batch` rows (without their padding): ``input_ids``, ``labels``
    (lists), the image's pixels, Qwen's grid and ``mm_token_type_ids``."""
    examples = []
    for i in range(0, count, 2):
        full = zoo.batch(name, seed=seed + i, seq_len=LENGTHS[(i // 2) % len(LENGTHS)])
        first = 0
        for row in range(2):
            real = full["attention_mask"][row].bool()
            example = {"input_ids": full["input_ids"][row][real].tolist(), "labels": full["labels"][row][real].tolist()}
            if "image_grid_thw" in full:
                grid = full["image_grid_thw"][row]
                rows = int(grid.prod())
                example.update(pixel_values=full["pixel_values"][first:first + rows], image_grid_thw=grid,
                               mm_token_type_ids=full["mm_token_type_ids"][row][real].tolist())
                first += rows
            else:
                example["pixel_values"] = full["pixel_values"][row]
            examples.append(example)
    return examples[:count]


def collate(features: list[dict]) -> dict:
    """Right padding (:func:`hf_trainer_cases.pad_right`), ``mm_token_type_ids`` padded with 0; Qwen's patch rows
    concatenated, other models' images stacked; grids stacked."""
    out = text_cases.pad_right(features)
    if "mm_token_type_ids" in features[0]:
        types = torch.zeros_like(out["input_ids"])
        for row, f in enumerate(features):
            types[row, :len(f["mm_token_type_ids"])] = torch.tensor(f["mm_token_type_ids"])
        out["mm_token_type_ids"] = types
    if "image_grid_thw" in features[0]:
        out["pixel_values"] = torch.cat([f["pixel_values"] for f in features])
        out["image_grid_thw"] = torch.stack([f["image_grid_thw"] for f in features])
    else:
        out["pixel_values"] = torch.stack([f["pixel_values"] for f in features])
    return out


def processor(patch: int = 14):
    """A Qwen2.5-VL processor built offline (module doc): images of 56 x 56 pixels give a 1 x 4 x 4 grid (4 image
    tokens), 56 x 112 a 1 x 4 x 8 one (8); ``patch=16`` for Qwen3.5's vision tower (the images resized to 64 x 64
    and 64 x 128: the same grids). It holds no video processor (transformers' needs torchvision)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = {"<|image_pad|>": zoo.IMAGE, "<|video_pad|>": zoo.VIDEO, "<|vision_start|>": zoo.START,
              "<|vision_end|>": zoo.END}
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, WORDS)}, **vision}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>",
                                        additional_special_tokens=list(vision))
    side = 4 * patch
    images = Qwen2VLImageProcessorPil(size={"shortest_edge": side * side, "longest_edge": side * 2 * side},
                                      patch_size=patch, temporal_patch_size=2, merge_size=2)

    class ImageProcessorOnly(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageProcessorOnly(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def trl_rows(kind: str, count: int, seed: int, uniform: bool = False) -> list[dict]:
    """``count`` rows for TRL's vision collator (module doc): one random image each (56 x 56 or 56 x 112 pixels),
    text of random words of varying lengths (``uniform``: every row as row 0); ``"messages"``: a system turn before
    the user's (so the image lands after it), an assistant answer."""
    from PIL import Image

    generator = np.random.default_rng(seed)

    def text(n: int) -> str:
        return " ".join(f"w{i}" for i in generator.integers(2, WORDS, n))

    rows = []
    for row_index in range(count):
        i = 0 if uniform else row_index
        pixels = generator.integers(0, 256, (56, 56 * (1 + i % 2), 3), dtype=np.uint8)
        row = {"images": [Image.fromarray(pixels)]}
        if kind == "messages":
            row["messages"] = [{"role": "system", "content": text(3 + i % 4)},
                               {"role": "user", "content": text(4 + i % 3)},
                               {"role": "assistant", "content": text(5 + i % 5)}]
        else:
            row.update(prompt=text(3 + i % 4) + " <|vision_start|><|image_pad|><|vision_end|> " + text(2 + i % 3),
                       completion=text(5 + i % 5))
        rows.append(row)
    return rows


@contextlib.contextmanager
def _broken(kind: str | None):
    """The negative control (module's ``CASES``), undone after the block. ``"positions"``: the language model's
    pre-hook (:mod:`cp_handler.integrations.hf_vlm`, registered when the trainer registers the model) called without
    the model's ``position_ids``, so it dispatches ``0..S-1``; armed by setting the yielded dict's ``"on"`` once the
    trainer is built (register's own probe, at cp 1, would refuse a model whose positions change nothing).
    ``"router_tokens"``: the trainer's router-loss scope told every slot of the shard is a real token (the right
    padding counted, the defect of issue 68)."""
    from cp_handler.integrations import hf_trainer, hf_vlm
    from cp_handler.integrations.hf_router_loss import RouterLossScope, router_loss_scope

    original, state = hf_vlm._language_model_pre_hook, {"on": False}
    under = hf_trainer.ContextParallelMixin._under

    def every_slot(self, sharded):
        return router_loss_scope(RouterLossScope(self.cp_groups.cp_group, torch.ones_like(sharded.token_mask),
                                                 self.router_loss_convention))

    def text_positions(lm, args, kwargs):
        if state["on"]:
            kwargs = {k: v for k, v in kwargs.items() if k != "position_ids"}
        return original(lm, args, kwargs)

    if kind == "positions":
        hf_vlm._language_model_pre_hook = text_positions
    elif kind == "router_tokens":
        hf_trainer.ContextParallelMixin._under = every_slot
    try:
        yield state
    finally:
        hf_vlm._language_model_pre_hook = original
        hf_trainer.ContextParallelMixin._under = under


def run_case(name: str, out: str, cp_run: bool) -> None:
    """Train 3 steps, evaluate and predict (:func:`hf_trainer_cases.run_case`'s settings: SGD, batch 2 per dp rank,
    eval batch 1, 2 eval examples per dp rank); rank 0 writes ``out/result.pt``."""
    import transformers
    from transformers import Trainer

    transformers.logging.set_verbosity_error()
    case = CASES[name]
    dp = (dist.get_world_size() if cp_run else WORLD.get(name, 2)) // case["cp"]["context_parallel_size"]
    ranks = cp_run or REFERENCE_WORLD.get(name, 1) > 1
    batch = 2 if ranks else 2 * dp  # a one-process reference runs the dp ranks' batches as one
    args = text_cases._arguments({**case, "padding_free": False}, out, batch=batch, cp_run=ranks)
    common = dict(model=zoo.build(case["model"]).train(), args=args)
    if case.get("trainer") == "sft":
        from datasets import Dataset
        from trl import SFTTrainer

        from cp_handler.integrations.hf_trainer import CPSFTTrainer as CP

        common.update(train_dataset=Dataset.from_list(trl_rows(case["data"], 12, 1)),
                      eval_dataset=Dataset.from_list(trl_rows(case["data"], 2 * dp, 2, uniform=dp > 1)),
                      processing_class=processor(16 if case["model"].startswith("qwen3") else 14))
        cls = CP if cp_run else SFTTrainer
    else:
        from cp_handler.integrations.hf_trainer import CPTrainer as CP

        common.update(train_dataset=zoo_examples(case["model"], 12, 1),
                      eval_dataset=zoo_examples(case["model"], 2 * dp, 2), data_collator=collate)
        cls = CP if cp_run else Trainer
    if cp_run:
        from cp_handler.integrations.hf_trainer import ContextParallelArguments

        common["cp_args"] = ContextParallelArguments(**case["cp"])
    with _broken(case.get("break") if cp_run else None) as broken:
        trainer = cls(**common)
        if case.get("reference_loss_kwargs") and not cp_run:
            trainer.model_accepts_loss_kwargs = True  # Trainer counts and passes num_items_in_batch, as CPTrainer
        broken["on"] = True
        text_cases.record(trainer, common["eval_dataset"], out, cp_run)


def worker(rank: int, world: int, names: list[str], out: str, cp_run: bool = True) -> None:
    """A spawned rank (tests/dist_utils.py; :func:`hf_trainer_cases.worker`'s environment): :func:`run_case` of every
    case of ``names`` into ``out/<name>``."""
    import os
    from pathlib import Path

    if cp_run or world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    for name in names:
        (Path(out) / name).mkdir(parents=True, exist_ok=True)
        run_case(name, str(Path(out) / name), cp_run=cp_run)
