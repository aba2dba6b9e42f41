"""Vision-language models (VLMs) inside Hugging Face Trainer and TRL's SFTTrainer under CP
(cp_handler.integrations.hf_trainer, hf_batch's ``vision_language`` route, hf_vlm): the loss and gradient norm of every
logged step, the final parameters (vision tower included), ``evaluate()``'s loss and ``predict()``'s logits of
``CPTrainer`` / ``CPSFTTrainer`` on spawned gloo ranks equal the plain trainer in one process on the same global
batches (tests/hf_trainer_vlm_cases.py): Qwen2.5-VL (3-D mRoPE positions, ``accepts_loss_kwargs=False``) under Trainer
with p2p, LLaVA under Trainer with all_gather, and Qwen2.5-VL under TRL's own vision path (a processor built offline,
``DataCollatorForVisionLanguageModeling``): conversational ``messages`` with a2a, prompt-completion (completion-only
labels) with p2p, and dp 2 x cp 2; Qwen2.5-VL at dp 2 x cp 2 with accumulation under the default micro-batch mean
against the plain Trainer on 2 DDP processes (``REFERENCE_WORLD``: its numbers, not one process's); TRL's logged
``num_tokens``, entropy and token accuracy compared too. cp 2 in every
case. The negative controls (the language model given positions 0..S-1 instead of the model's mRoPE positions;
Qwen3.5-MoE's router loss counting the shard's padding rows) must fail the same comparison. Then the refusals of
this route, by name, before any step or at the first one.

Tolerances (float32, tests/test_hf_trainer.py's, :func:`hf_trainer_cases.compare`): losses, gradient norms, TRL's
logged figures and the eval loss rtol 1e-5; parameters after 3 SGD steps atol 1e-6 + rtol 1e-5; logits atol = rtol =
1e-5 (eval batches of one example: no padding, whose logits right padding leaves undefined). CP only reorders the
sums of attention and of the loss; the vision tower runs on the whole batch on every rank (measured: parameters within
1e-8, logits within 3e-7).
"""

import hf_trainer_cases as cases
import hf_trainer_vlm_cases as vlm_cases
import hf_vlm_zoo as zoo
import pytest
import torch

from cp_handler.integrations.hf_batch import shard_batch
from cp_handler.runtime.config import ContextParallelConfig


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case: the reference (one spawn of one process) and the CP runs (one spawn per world size)."""
    return cases.run_all(vlm_cases, tmp_path_factory.mktemp("hf_vlm_trainer"))


@pytest.mark.parametrize("name", [n for n in vlm_cases.CASES if not vlm_cases.CASES[n].get("break")])
def test_vlm_trainer_under_cp_equals_one_process(results, name):
    got, want = results[name]
    assert len(want["losses"]) == 3
    assert cases.compare(got, want) is None, cases.compare(got, want)


@pytest.mark.parametrize("name", [n for n in vlm_cases.CASES if vlm_cases.CASES[n].get("break")])
def test_negative_control_fails(results, name):
    problem = cases.compare(*results[name])
    assert problem is not None and problem.startswith("step 1: loss"), problem


def test_the_two_normalisations_differ_with_accumulation(results):
    """The control of the accumulation cases: the same CP training under the default (each micro-batch's mean, the
    plain trainer's for Qwen2.5-VL) and under ``loss_normalization="global_token_count"`` logs other losses (the
    comparison with the plain trainer, at rtol 1e-5, can tell which one a run used: up to 8.7e-4 apart here, held to
    more than ten times that tolerance)."""
    mean, count = (results[name][0]["losses"] for name in ("qwen2_5_vl_accumulate", "qwen2_5_vl_accumulate_global"))
    assert max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(mean, count, strict=True)) > 1e-4, (mean, count)


def test_what_is_compared(results):
    """TRL's runs log the loss, the gradient norm, num_tokens, entropy and token accuracy at every step; the
    predictions hold every eval example's logits (``(2 dp, S, V)``) and the vision tower's parameters are compared."""
    for name, case in vlm_cases.CASES.items():
        got, want = results[name]
        sft = case.get("trainer") == "sft"
        width = (5 if sft else 2) + (sft and "router_loss" in case["model"])  # + TRL's logged aux_loss
        dp = vlm_cases.WORLD.get(name, 2) // 2
        assert all(len(row) == width for row in want["losses"] + got["losses"]), (name, want["losses"])
        assert want["predictions"].shape[0] == 2 * dp and want["predictions"].shape[2] == zoo.VOCAB, name
        assert any(key.startswith(("model.visual.", "model.vision_tower.")) for key in want["params"]), name


@pytest.mark.parametrize("extra, vision_language, message", [
    ({}, False, r"batch keys \['image_grid_thw', 'mm_token_type_ids', 'pixel_values'\] are not implemented under "
                r"context parallelism \(each would be passed on unsharded\) \(\['image_grid_thw', 'mm_token_type_ids', "
                r"'pixel_values'\]: vision inputs, for a vision-language model\)"),
    ({"position_ids": torch.arange(zoo.SEQ_LEN).expand(2, -1)}, True,
     "a vision-language model's batch with position_ids: not implemented under context parallelism"),
    ({"cu_seq_lens_q": torch.tensor([0, 10, zoo.SEQ_LEN])}, True,
     "a vision-language model's batch with packed documents: not implemented under context parallelism"),
])
def test_vision_batches_that_would_be_wrong_are_refused_by_name(extra, vision_language, message):
    batch = {**zoo.batch("qwen2_5_vl"), **extra}
    if "cu_seq_lens_q" in extra:  # a packed batch has one row
        batch = {k: v[:1] if k in ("input_ids", "labels", "mm_token_type_ids") else v for k, v in batch.items()
                 if k != "attention_mask"}
    with pytest.raises(ValueError, match=message):
        shard_batch(batch, ContextParallelConfig(), vision_language=vision_language)


def test_vision_batch_keeps_the_sequence_whole_and_shards_the_labels():
    """cp 1 in one process, 31 tokens: ``input_ids``, ``mm_token_type_ids`` and the right-padding ``attention_mask``
    (for the model's own positions) padded on the right to 32 (a multiple of 2 * cp; the padded slot: token 0, type 0,
    mask 0, label -100), pixels and grids passed as they are, the labels shifted."""
    batch = zoo.batch("qwen2_5_vl", seq_len=31)
    inputs = shard_batch(batch, ContextParallelConfig(), vision_language=True).inputs
    assert inputs["input_ids"].shape == inputs["mm_token_type_ids"].shape == (2, 32)
    assert torch.equal(inputs["input_ids"][:, :31], batch["input_ids"]) and not inputs["input_ids"][:, 31].any()
    assert torch.equal(inputs["mm_token_type_ids"][:, :31], batch["mm_token_type_ids"])
    assert not inputs["mm_token_type_ids"][:, 31].any()
    assert batch["attention_mask"][1].sum() == 28  # row 1: 3 padding tokens of the batch's own
    assert torch.equal(inputs["attention_mask"][:, :31], batch["attention_mask"])
    assert not inputs["attention_mask"][:, 31].any()
    assert inputs["pixel_values"] is batch["pixel_values"] and inputs["image_grid_thw"] is batch["image_grid_thw"]
    assert torch.equal(inputs["shift_labels"][:, :30], batch["labels"][:, 1:])
    assert (inputs["shift_labels"][:, 30:] == -100).all()


def _cp1_trainer(tmp_path, name: str, examples: list[dict]):
    """``CPTrainer`` at cp 1 in this process (no process group) on ``examples``, collated as the trainer cases are."""
    from transformers import TrainingArguments

    from cp_handler.integrations.hf_trainer import ContextParallelArguments, CPTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                             per_device_train_batch_size=2, optim="sgd", save_strategy="no", disable_tqdm=True)
    return CPTrainer(model=zoo.build(name), args=args, train_dataset=examples, data_collator=vlm_cases.collate,
                     cp_args=ContextParallelArguments())


def test_gemma3_image_blocks_are_refused_by_name_at_the_first_step(tmp_path):
    """Gemma 3's ``token_type_ids`` marking images (bidirectional attention within each image) reach the model with
    the batch; refused by hf_vlm's message at the first step, before any parameter moves."""
    full = zoo.batch("gemma3")
    examples = [{"input_ids": full["input_ids"][r].tolist(), "labels": full["labels"][r].tolist(),
                 "token_type_ids": full["token_type_ids"][r].tolist(), "pixel_values": full["pixel_values"][r]}
                for r in range(2)]

    def collate(features):
        out = vlm_cases.collate([{k: v for k, v in f.items() if k != "token_type_ids"} for f in features])
        out["token_type_ids"] = torch.tensor([f["token_type_ids"] for f in features])
        return out

    trainer = _cp1_trainer(tmp_path, "gemma3", examples)
    trainer.data_collator = collate
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration: token_type_ids mark image tokens, which "
                                         r"attend bidirectionally within each image \(Gemma 3's image blocks\)"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_qwen_images_without_token_types_are_refused_by_name(tmp_path):
    """Qwen2.5-VL given images without ``mm_token_type_ids`` (transformers would fall back to positions 0..S-1):
    refused at the first step."""
    examples = [{k: v for k, v in e.items() if k != "mm_token_type_ids"}
                for e in vlm_cases.zoo_examples("qwen2_5_vl", 2, 0)]
    trainer = _cp1_trainer(tmp_path, "qwen2_5_vl", examples)
    with pytest.raises(ValueError, match="Qwen2_5_VLForConditionalGeneration: images or videos without "
                                         "mm_token_type_ids"):
        trainer.train()


def test_a_vlm_loss_that_ignores_the_token_count_is_refused_before_the_first_step(tmp_path):
    """Qwen2.5-VL sets ``accepts_loss_kwargs=False``; the trainer probes that its loss takes ``shift_labels`` and
    ``num_items_in_batch`` (integrations/hf_loss_probe.py). A loss that takes each batch's own mean instead is refused
    when the trainer is built."""
    import torch.nn.functional as F

    from cp_handler.integrations.hf_trainer import ContextParallelArguments, CPTrainer

    model = zoo.build("qwen2_5_vl")
    model.loss_function = lambda logits, labels, vocab_size, shift_labels=None, **_: F.cross_entropy(
        logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match="Qwen2_5_VLForConditionalGeneration's own loss given shift_labels and "
                                         "num_items_in_batch is .* or a mean; CPTrainer takes the model's loss"):
        CPTrainer(model=model, args=args, train_dataset=[], data_collator=vlm_cases.collate,
                  cp_args=ContextParallelArguments())
