"""TRL's fused LM head under context parallelism (cp_handler.integrations.hf_fused_head): the per-token log-probs,
entropies, label mask and loss of a left-padded, right-padded batch (TRL's GRPO layout: prompts left-padded,
completions right-padded, prompt labels -100; temperature 0.7), and every parameter's gradient of a loss built from
them, on spawned gloo ranks equal TRL's head run on the whole batch in one process: Llama at cp 2 (p2p, a2a,
all_gather) and cp 4, a hybrid (Qwen3-Next: gated delta rule + attention, with its MoE load-balancing loss on), an
MLA model (DeepSeek-V3), and OPT (positions from the attention mask). The negative control (each rank's labels
shifted inside its shard) must differ. Refusals: a mask with holes, a label predicted from padding, an unknown
input, ranks of a group holding different batches.

Tolerances (float32): outputs atol = rtol = 1e-5 (tests/test_hf_integration.py's: CP only reorders the sums of
attention); gradients (summed over the group, divided by the ``cp`` the head multiplies them by) atol = rtol = 1e-5:
they are sums over the batch's tokens, not divided by a count, of order 1 to 10 (a tied embedding's adds the head's),
so float32 reordering reaches 2e-6 (OPT's tied embedding at cp 2); tests/test_hf_trainer.py's parameters, which
move by lr 0.05 times such gradients, keep atol 1e-6.
"""

from __future__ import annotations

import hf_rl_cases
import hf_trainer_cases
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from cp_handler.integrations import hf_fused_head
from cp_handler.integrations.hf_fused_head import fused_forward_on_shards, install_cp_fused_head
from cp_handler.integrations.transformers import register
from cp_handler.runtime.config import ContextParallelConfig

MODELS = {"llama": ("llama", None), "hybrid": ("qwen3_next", {"layer_types": ["linear_attention", "full_attention"],
                                                              "output_router_logits": True,
                                                              "router_aux_loss_coef": 0.5}),
          "mla": ("deepseek_v3", None), "opt": ("opt", None)}
RUNS = [("llama", "p2p", 2), ("llama", "a2a", 2), ("llama", "all_gather", 2), ("hybrid", "a2a", 2), ("mla", "p2p", 2),
        ("opt", "p2p", 2), ("llama", "p2p", 4)]


def batch():
    """TRL's GRPO layout: 3 rows of 11 slots, left padding 0/3/1, completions of 4/2/3 tokens then padding."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(2, hf_trainer_cases.VOCAB, (3, 11), generator=generator)
    mask = torch.zeros(3, 11, dtype=torch.long)
    for row, (left, prompt, completion) in enumerate(((0, 5, 4), (3, 4, 2), (1, 6, 3))):
        mask[row, left:left + prompt + completion] = 1
    prompt_end = torch.tensor([5, 7, 7])
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(11)[None] < prompt_end[:, None]] = -100
    return ids.masked_fill(mask == 0, 0), mask, labels


def build(name: str):
    from trl.trainer.utils import add_fused_lm_head

    kind, fields = MODELS[name]
    model = hf_trainer_cases.model(kind, fields)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def score(model, **kwargs):
    """The head's outputs and a loss mixing them (weights that differ per token, so every position matters)."""
    ids, mask, labels = batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **kwargs)
    weights = torch.linspace(0.5, 1.5, out.log_probs.numel()).view_as(out.log_probs)
    loss = (out.log_probs * weights).sum() + 0.1 * (out.entropy * weights.flip(-1)).sum() + out.loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"log_probs": out.log_probs.detach(), "entropy": out.entropy.detach(), "label_mask": out.label_mask,
            "loss": out.loss.detach(), "grads": grads}


def _worker(rank, world, out, runs, broken):
    from transformers.models.opt.modeling_opt import OPTForCausalLM

    results = {}
    for name, comm, cp in runs:
        if cp != world:
            continue
        model = build(name)
        row_positions = not isinstance(model, OPTForCausalLM)
        register(model)
        assert hf_fused_head.left_padding_positions(model, "sdpa") is row_positions
        install_cp_fused_head(model, ContextParallelConfig(context_parallel_size=cp, cp_comm_type=comm),
                              dist.group.WORLD, row_positions=row_positions)
        got = score(model, output_router_logits=True if name == "hybrid" else None)
        for grad in got["grads"].values():
            dist.all_reduce(grad)
            grad /= cp
        results[(name, comm, cp)] = got
    if broken:
        hf_rl_cases.break_labels_per_shard()
        model = build("llama")
        register(model)
        install_cp_fused_head(model, ContextParallelConfig(context_parallel_size=world), dist.group.WORLD)
        results["broken"] = score(model)
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The CP runs (one spawn per world size) and the references (TRL's head on the whole batch, this process)."""
    tmp = tmp_path_factory.mktemp("fused_head")
    got = {}
    for world in sorted({cp for _, _, cp in RUNS}):
        run_distributed(_worker, world, str(tmp / f"{world}.pt"), RUNS, world == 2)
        got.update(torch.load(tmp / f"{world}.pt"))
    want = {name: score(build(name), output_router_logits=True if name == "hybrid" else None)
            for name in MODELS}
    return got, want


def _difference(got: dict, want: dict) -> str | None:
    for key in ("log_probs", "entropy", "loss"):
        if not torch.allclose(got[key], want[key], atol=1e-5, rtol=1e-5):
            return f"{key} differs by {(got[key] - want[key]).abs().max().item():.2e}"
    if not torch.equal(got["label_mask"], want["label_mask"]):
        return "label_mask differs"
    if sorted(got["grads"]) != sorted(want["grads"]):
        return f"gradients of {sorted(set(got['grads']) ^ set(want['grads']))} on one side only"
    for name, grad in want["grads"].items():
        if not torch.allclose(got["grads"][name], grad, atol=1e-5, rtol=1e-5):
            return f"gradient of {name} differs by {(got['grads'][name] - grad).abs().max().item():.2e}"
    return None


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "-".join(map(str, r)))
def test_fused_head_on_shards_equals_one_process(results, run):
    got, want = results
    out = got[run]
    assert out["log_probs"].shape == (3, 10) and int(out["label_mask"].sum()) == 9
    assert _difference(out, want[run[0]]) is None, _difference(out, want[run[0]])


def test_labels_shifted_per_shard_differ(results):
    got, want = results
    problem = _difference(got["broken"], want["llama"])
    assert problem is not None and problem.startswith("log_probs"), problem


def _call(**changes):
    ids, mask, labels = batch()
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels, **changes}
    return fused_forward_on_shards(build("llama"), ContextParallelConfig(), None, None, (), kwargs)


@pytest.mark.parametrize("changes, message", [
    ({"attention_mask": torch.tensor([[1] * 5 + [0] + [1] * 5] * 3)}, r"rows \[0, 1, 2\] have padding between real"),
    ({"labels": torch.full((3, 11), 5)}, "a label is predicted from a padding position"),
    ({"pixel_values": torch.zeros(1, 3, 4, 4)}, r"fused-head inputs \['pixel_values'\] are not implemented"),
    ({"shift_labels": torch.zeros(3, 11, dtype=torch.long)}, "exactly one of labels and shift_labels"),
    ({"attention_mask": torch.full((3, 11), 2)}, "values other than 0 and 1"),
])
def test_refused_inputs(changes, message):
    with pytest.raises(ValueError, match=message):
        _call(**changes)


def _different_batches_worker(rank, world):
    model = build("llama")
    register(model)
    install_cp_fused_head(model, ContextParallelConfig(context_parallel_size=world), dist.group.WORLD)
    ids, mask, labels = batch()
    ids[0, 5] += rank  # rank 1 sampled another token
    with pytest.raises(ValueError, match=r"group ranks \[1\] differ from rank 0"):
        model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


def test_different_batches_on_a_group_refused():
    run_distributed(_different_batches_worker, 2)


def _memory_worker(rank, world, out):
    from cp_handler.bench.rl_logprobs import SHAPE, measure

    rows = measure(256, {**SHAPE, "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64})
    if rank == 0:
        torch.save(rows, out)


def test_fused_head_saves_no_logits(tmp_path):
    """cp-bench's measurement of the log-prob path (cp_handler.bench.rl_logprobs) at a small shape: TRL's head on the
    shard saves no tensor near this rank's (S / cp) x V logits; the plain path (the negative control) saves them."""
    run_distributed(_memory_worker, 2, str(tmp_path / "rows.pt"))
    fused, plain = torch.load(tmp_path / "rows.pt")
    logits = fused["logits_bytes_per_rank"]
    assert logits == 128 * 4096 * 4
    assert plain["largest"] >= logits and plain["total"] > logits, plain
    assert fused["largest"] * 16 <= logits and fused["total"] < logits / 2, fused
