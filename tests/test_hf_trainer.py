"""Context parallelism inside Hugging Face Trainer and TRL's SFTTrainer (cp_handler.integrations.hf_trainer): the loss
and gradient norm of every logged step, the final parameters, ``evaluate()``'s loss and ``predict()``'s logits of
``CPTrainer`` / ``CPSFTTrainer`` on spawned gloo ranks equal the plain trainer in one process on the same global
batches (tests/hf_trainer_cases.py): Llama right-padded with gradient accumulation and tiled MLPs (chunks of 5
tokens), dp 2 x cp 2 with a2a, Mistral with a window shorter than the sequence on packed documents
(``DataCollatorWithFlattening``), Gemma 2 with soft-caps, Qwen3-Next (a hybrid), TRL's padding-free SFT, and a MoE
model's load-balancing loss turned on (Qwen3-MoE on packed documents under Trainer; Qwen3-Next under TRL, which logs
it, ``num_tokens``, entropy and token accuracy: all compared), and ``torch_compile=True`` (Llama on packed documents
under Trainer, Qwen3 padding-free under TRL with a2a; the reference eager). The negative controls (positions left
local; the router loss computed on each rank's shard, as transformers would) must fail the same comparison. The
router loss is compared at dp 1: with dp > 1 transformers adds each dp rank's own batch's loss (DDP semantics, with
or without CP), not the global batch's.

Tolerances (float32): losses, gradient norms, TRL's logged figures and the eval loss rtol 1e-5; parameters after 3
SGD steps (the update is linear in the gradient) atol 1e-6 + rtol 1e-5; logits atol = rtol = 1e-5
(tests/test_hf_integration.py's): CP only reorders the sums of attention and of the loss.
"""

import hf_trainer_cases as cases
import pytest
import torch

from cp_handler.integrations.hf_batch import shard_batch
from cp_handler.runtime.config import ContextParallelConfig


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case: the reference (one spawn of one process) and the CP runs (one spawn per world size)."""
    return cases.run_all(cases, tmp_path_factory.mktemp("hf_trainer"))


@pytest.mark.parametrize("name", [n for n in cases.CASES if not cases.CASES[n].get("break")])
def test_trainer_under_cp_equals_one_process(results, name):
    got, want = results[name]
    assert len(want["losses"]) == 3
    assert cases.compare(got, want) is None, cases.compare(got, want)


@pytest.mark.parametrize("name", [n for n in cases.CASES if cases.CASES[n].get("break")])
def test_negative_controls_fail(results, name):
    problem = cases.compare(*results[name])
    assert problem is not None and problem.startswith("step 1: loss"), problem


def test_trl_logs_what_is_compared(results):
    """TRL's figures are in the comparison: every step logs the loss, the gradient norm, the aux loss (when the
    router loss is on), num_tokens, entropy and mean_token_accuracy."""
    for name, width in (("sft_hybrid_moe_aux_loss", 6), ("sft_padding_free", 5)):
        got, want = results[name]
        assert all(len(row) == width for row in want["losses"] + got["losses"]), (name, want["losses"])


@pytest.mark.parametrize("batch, message", [
    ({"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]] * 2)},
     "attention_mask has padding before real tokens (left padding, or holes)"),
    ({"input_ids": torch.ones(1, 8, dtype=torch.long), "token_type_ids": torch.zeros(1, 8)},
     "batch keys ['token_type_ids'] are not implemented under context parallelism"),
    ({"input_ids": torch.ones(2, 8, dtype=torch.long), "position_ids": torch.arange(8).roll(1).expand(2, 8)},
     "position_ids of padded rows must be 0..S-1"),
    ({"input_ids": torch.ones(1, 8, dtype=torch.long), "cu_seq_lens_q": torch.tensor([0, 3, 8]),
      "position_ids": torch.arange(8)[None]}, "do not restart at 0 at each document"),
])
def test_batches_that_would_be_wrong_are_refused_by_name(batch, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        shard_batch(batch, ContextParallelConfig())


def _cp_trainer(tmp_path, model, trainer_fields=None, **fields):
    from transformers import TrainingArguments

    from cp_handler.integrations.hf_trainer import ContextParallelArguments, CPTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, **fields)
    return CPTrainer(model=model, args=args, train_dataset=cases.dataset(4, 0), data_collator=cases.pad_right,
                     cp_args=ContextParallelArguments(), **(trainer_fields or {}))


@pytest.fixture
def wrapped_init_fails(monkeypatch):
    """``Trainer.__init__`` replaced by one that fails the test (its signature kept: the mixin binds the
    constructor's arguments to it): a refusal that comes before it never reaches it."""
    import functools

    import transformers

    @functools.wraps(transformers.Trainer.__init__)
    def acted(self, *args, **kwargs):
        raise AssertionError("Trainer.__init__ ran")

    monkeypatch.setattr(transformers.Trainer, "__init__", acted)


def _no_loss_kwargs():
    model = cases.model("llama")
    model.accepts_loss_kwargs = False  # as a forward without **kwargs: Trainer would pass no num_items_in_batch
    return model


def _encoder_decoder():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))


@pytest.mark.parametrize("build, message", [
    (lambda: __import__("hf_zoo").build("bloom"), "BloomForCausalLM: of its 2 layers, .* did not run cp_handler's "
                                                  "attention"),
    (_encoder_decoder, "T5ForConditionalGeneration is an encoder-decoder model, not a causal language model"),
    (lambda: _bamba(0.1), "BambaForCausalLM's own loss .* CPTrainer takes the model's loss"),
    (_no_loss_kwargs, r"CPTrainer: refused under context parallelism: a model whose forward takes no "
                      r"num_items_in_batch \(LlamaForCausalLM"),
])
def test_the_model_guard_refuses_before_the_wrapped_trainer_acts(tmp_path, wrapped_init_fails, build, message):
    """The model's guard (an architecture that would be wrong, an encoder-decoder, a loss of its own, a loss without
    the token count) runs before ``Trainer.__init__`` (which would tokenise a dataset, move the model, build
    accelerate's state first): each refusal comes with ``Trainer.__init__`` made to fail the test. The control: a
    model the guard passes reaches it."""
    with pytest.raises(ValueError, match=message):
        _cp_trainer(tmp_path, build())
    with pytest.raises(AssertionError, match="Trainer.__init__ ran"):
        _cp_trainer(tmp_path, cases.model("llama"))


@pytest.mark.parametrize("fields, message", [
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor=0.1 (its smoother shifts the labels"),
    ({"average_tokens_across_devices": False}, "average_tokens_across_devices=False"),
    ({"train_sampling_strategy": "batch_rebalance"}, "train_sampling_strategy='batch_rebalance'"),
])
def test_settings_that_would_be_wrong_are_refused_by_name(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _cp_trainer(tmp_path, cases.model("llama"), **fields)


def test_a_custom_loss_function_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="compute_loss_func \\(it would receive this rank's shard of the labels"):
        _cp_trainer(tmp_path, cases.model("llama"), {"compute_loss_func": lambda outputs, labels, **_: 0.0})


def test_arguments_are_checked_as_the_config_is():
    from cp_handler.integrations.hf_trainer import ContextParallelArguments

    assert ContextParallelArguments(2, "p2p,a2a").config().cp_comm_type == ["p2p", "a2a"]
    with pytest.raises(ValueError, match="cp_comm_type='a2a\\+p2p' needs hierarchical_context_parallel_sizes"):
        ContextParallelArguments(4, "a2a+p2p").config()


def test_a_trainer_that_counts_tokens_otherwise_is_refused(tmp_path, monkeypatch):
    """The release is judged by behaviour: a Trainer counting unshifted labels (as transformers 4.57 did) would
    scale the loss wrong under CP; the probe of its count refuses it, naming both counts."""
    import transformers

    def unshifted(self, batches, device):
        return sum((batch["labels"] != -100).sum() for batch in batches)

    monkeypatch.setattr(transformers.Trainer, "_get_num_items_in_batch", unshifted)
    with pytest.raises(ValueError, match="Trainer counts 5.0 tokens for a probe batch whose next-token labels "
                                         "number 4"):
        _cp_trainer(tmp_path, cases.model("llama"))


def test_attention_under_autocast_runs_in_the_autocast_dtype():
    """Trainer's bf16=True runs the forward under autocast, where q / k come out of RoPE in float32 and v in
    bfloat16; the attention function casts them as autocast casts SDPA: the logits equal the unmodified model's
    under the same autocast (bfloat16 tolerance: 1.6e-2 relative, torch.testing's)."""
    from cp_handler.handlers.local import LocalContextParallelHandler
    from cp_handler.integrations.transformers import cp_model_inputs, register

    plain, routed = cases.model("llama"), cases.model("llama")
    register(routed)
    handler, ids = LocalContextParallelHandler(), torch.randint(0, cases.VOCAB, (1, 16))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(ids).logits
        got = routed(ids, **cp_model_inputs(handler, ids), cp_handler=handler).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


def _bamba(z_loss: float):
    import hf_zoo

    return hf_zoo.build(hf_zoo.tiny_config("bamba", {"z_loss_coefficient": z_loss, "vocab_size": 256}))


def _labels_worker(rank, world):
    """A forward given labels at cp 2: refused for a model whose own loss has a term of its own (its share of it
    would be a mean over this rank's shard), run for the same model without it."""
    from cp_handler import get_cp_handler_cls
    from cp_handler.integrations.transformers import cp_model_inputs, register
    from cp_handler.models.loss import next_token_batch

    tokens = torch.randint(1, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    for z_loss in (0.1, 0.0):
        model = _bamba(z_loss)
        register(model)
        handler = get_cp_handler_cls("local", "p2p")(cp_group=torch.distributed.group.WORLD, cp_comm_type="p2p")
        input_ids, labels, _ = next_token_batch(handler, tokens)
        inputs = {"labels": input_ids, "shift_labels": labels, "num_items_in_batch": 15, "cp_handler": handler,
                  **cp_model_inputs(handler, input_ids)}
        if z_loss:
            with pytest.raises(ValueError, match="BambaForCausalLM's own loss given shift_labels and "
                                                 "num_items_in_batch is .* a term of its own \\(a z-loss\\)"):
                model(input_ids, **inputs)
        else:
            assert model(input_ids, **inputs).loss is not None


def test_a_model_whose_own_loss_is_not_the_token_cross_entropy_is_refused_where_its_loss_is_used(tmp_path):
    """Bamba with ``z_loss_coefficient=0.1`` (its forward adds a mean of ``logsumexp(logits)**2`` over the tokens it
    holds: under CP each rank's share would be a mean over its shard, handler padding included): CPTrainer refuses it
    in its constructor, a forward given labels at cp 2 refuses it, cp-train refuses it (it trains the token
    cross-entropy, not the model's own objective); the logits stay exact, so a loop computing the loss from them runs
    it. The control: the same model with ``z_loss_coefficient=0`` passes the probe and runs."""
    from dist_utils import run_distributed
    from test_cli import cp_train

    from cp_handler.integrations.hf_loss_probe import loss_difference
    from cp_handler.integrations.transformers import register

    plain = _bamba(0.0)
    register(plain)
    assert loss_difference(plain) is None
    with pytest.raises(ValueError, match="BambaForCausalLM's own loss .* CPTrainer takes the model's loss"):
        _cp_trainer(tmp_path, _bamba(0.1))
    run_distributed(_labels_worker, 2)
    folder = tmp_path / "bamba"
    _bamba(0.1).config.save_pretrained(folder)
    result = cp_train("--nproc", "1", "--cp-size", "1", "--hf-config", str(folder), "--steps", "1", "--seq-len", "32",
                      "--max-corpus-bytes", "100000")
    assert result.returncode != 0 and "BambaForCausalLM's own loss" in result.stderr and \
        "cp-train trains the token cross-entropy of the logits" in result.stderr, result.stderr[-2000:]
