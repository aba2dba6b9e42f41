"""The loss without the rank's whole logits (cp_handler.models.loss.token_loss_sum, ``--loss-chunk-tokens``): chunked
equals whole in value and in every gradient, for the reference GPT and for Hugging Face models through their own
output head and logit transforms (Llama; Gemma 2's final soft-cap; Cohere's logit scale; Granite's logits
scaling); no tensor of a chunk's logits is kept for the backward (saved-tensor hooks: machine-independent); a model
whose logits are not its head of the last hidden states is refused by name; cp-train's training and evaluation
losses with chunks equal those without.

Tolerances: float64 1e-12 (only the order of the chunk sums changes); float32 models: loss rtol 1e-6, gradients
atol 1e-6 + rtol 1e-5 (the chunked head recomputes the same float32 products; sums in another order).
"""

import json

import pytest
import torch
from test_cli import SMALL, cp_train

from cp_handler.models import GPTConfig, GPTModel
from cp_handler.models.loss import LogitsAt, TokenLoss, loss_chunk_tokens, masked_token_loss_sum, token_loss_sum


def _inputs(rows=2, length=23, hidden=8, vocab=40, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, length, hidden, generator=g, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(hidden, vocab, dtype=dtype)
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    mask = (torch.rand(rows, length, generator=g) > 0.2).to(dtype)
    return h, head, labels, mask


@pytest.mark.parametrize("chunk", [1, 7, 23, 46, 100])
def test_chunks_equal_the_whole_loss_and_gradients(chunk):
    h, head, labels, mask = _inputs()
    whole = masked_token_loss_sum(head(h), labels, mask)
    grads = torch.autograd.grad(whole, [h, head.weight, head.bias])
    chunked = token_loss_sum(h, head, labels, mask, chunk)
    for got, want in zip(torch.autograd.grad(chunked, [h, head.weight, head.bias]), grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=1e-12)


def _largest_saved(fn) -> int:
    largest = [0]

    def pack(t):
        largest[0] = max(largest[0], t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return largest[0]


def test_no_chunk_logits_are_kept_for_the_backward():
    h, head, labels, mask = _inputs(rows=1, length=64, vocab=200)
    whole = _largest_saved(lambda: masked_token_loss_sum(head(h), labels, mask))
    chunked = _largest_saved(lambda: token_loss_sum(h, head, labels, mask, 8))
    assert whole >= 64 * 200 and chunked < 8 * 200, (whole, chunked)  # the whole keeps (S, V); chunks keep inputs


def test_automatic_chunks_engage_where_the_logits_dominate():
    assert loss_chunk_tokens(None, 65536, 128256) == 4096  # 32 GiB of float32 logits: chunked
    assert loss_chunk_tokens(None, 65536, 256) is None  # 64 MiB: the whole loss
    assert loss_chunk_tokens(0, 65536, 128256) is None and loss_chunk_tokens(100, 50, 10) is None
    assert loss_chunk_tokens(100, 500, 10) == 100


def _compare(model, ids, chunk):
    labels, mask = ids.roll(-1, 1), torch.ones(ids.shape)
    whole = model(ids, output=TokenLoss(labels, mask))
    want = torch.autograd.grad(whole, list(model.parameters()), allow_unused=True)
    chunked = model(ids, output=TokenLoss(labels, mask, chunk))
    got = torch.autograd.grad(chunked, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    for (name, _), a, b in zip(model.named_parameters(), got, want, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_reference_gpt_chunked_equals_whole():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64))
    _compare(model, torch.randint(0, 256, (2, 24)), 5)


@pytest.mark.parametrize("model_type, fields", [
    ("llama", {}), ("gemma2", {"final_logit_softcapping": 2.0}), ("cohere", {"logit_scale": 0.5}),
    ("granite", {"logits_scaling": 3.0}),
])
def test_hugging_face_chunked_equals_whole_through_the_models_head(model_type, fields):
    import hf_zoo

    from cp_handler.integrations.transformers import CPCausalLM

    model = CPCausalLM(hf_zoo.build(hf_zoo.tiny_config(model_type, fields)))
    assert model.head_refusal is None
    _compare(model, torch.randint(0, hf_zoo.VOCAB, (1, 24), generator=torch.Generator().manual_seed(1)), 7)


def test_a_head_cp_handler_does_not_know_is_refused(monkeypatch):
    import hf_zoo

    from cp_handler.integrations.transformers import CPCausalLM

    monkeypatch.setattr(CPCausalLM, "head", lambda self, hidden: self.model.get_output_embeddings()(hidden))
    model = CPCausalLM(hf_zoo.build(hf_zoo.tiny_config("gemma2", {"final_logit_softcapping": 2.0})))
    ids = torch.randint(0, hf_zoo.VOCAB, (1, 8))
    with pytest.raises(ValueError, match="Gemma2ForCausalLM's logits are not its output projection"):
        model(ids, output=TokenLoss(ids, torch.ones(ids.shape), 4))


def test_logits_of_chosen_rows_only_equal_the_whole_logits_rows():
    """Generation's prefill asks for the last tokens' logits only (``LogitsAt``): the same values as those rows
    of the whole logits, for the reference GPT and a Hugging Face model (through its head)."""
    import hf_zoo

    from cp_handler.integrations.transformers import CPCausalLM

    torch.manual_seed(0)
    gpt = GPTModel(GPTConfig(hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=64))
    hf = CPCausalLM(hf_zoo.build(hf_zoo.tiny_config("gemma2", {"final_logit_softcapping": 2.0})))
    rows = torch.tensor([3, 0, 9])
    for model, vocab in ((gpt, 256), (hf, hf_zoo.VOCAB)):
        ids = torch.randint(0, vocab, (1, 12), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            got = model(ids, output=LogitsAt(rows))
            torch.testing.assert_close(got, model(ids)[:, rows], atol=1e-6, rtol=1e-6)
        assert got.shape[1] == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_activations_give_the_same_gradients_on_cuda():
    """``--offload-activations`` (``save_on_cpu`` around the step, training/steps.py): the reference GPT's loss and
    every gradient bitwise those of the step without it (copies to pinned host memory and back)."""
    from types import SimpleNamespace

    from cp_handler.training.steps import activations_kept

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=128)).cuda()
    ids = torch.randint(0, 256, (1, 256), device="cuda")
    results = []
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        with activations_kept(SimpleNamespace(offload_activations=offload)):
            loss = model(ids, output=TokenLoss(ids.roll(-1, 1), torch.ones(ids.shape, device="cuda")))
            loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_chunked_loss_parity_and_evaluation(tmp_path):
    """--loss-chunk-tokens 50: the loss over chunks of 50 of a rank's 2 x 64 tokens, against one process's whole
    loss; the held-out evaluation (--eval-every, at another CP degree) in chunks too, equal to the same run's with
    the whole loss (0), step by step (rtol 1e-6, as tests/test_eval_cp.py)."""
    runs = {}
    for chunks, parity in (("50", ["--check-parity"]), ("0", [])):
        out = tmp_path / f"chunks_{chunks}.json"
        result = cp_train("--nproc", "2", "--loss-chunk-tokens", chunks, *SMALL[:1], "3", *SMALL[2:], "--eval-every",
                          "1", "--eval-cp-size", "1", *parity, "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        assert "parity passed" in result.stderr or not parity
        runs[chunks] = json.loads(out.read_text())["steps"]
    for key in ("loss", "eval_loss"):
        chunked, whole = (torch.tensor([r[key] for r in runs[c]]) for c in ("50", "0"))
        torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0, msg=lambda m, k=key: f"{k}: {m}")
