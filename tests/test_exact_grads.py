"""Exact parameter gradients (``cp_handler/runtime/exact_grads.py``, the deterministic mode's): the reference GPT's
every parameter gradient ``torch.equal`` at cp 2, 3, 4, 6 and 8 to one process's (a deterministic a2a handler, the
limbs all-reduced over the group), bshd and a thd pack of five documents; the fixed-point sums give the same bits in
any order and grouping (hypothesis); against autograd's float32 gradients within float32 reordering. Negative
control: the default reduction (autograd's sums, a float32 all-reduce) at cp 2 differs from one process's in at least
one bit on the same inputs.

Tolerances: none (bitwise), except against autograd (relative 1e-5 of each tensor's largest element: two float32 sums
over the same terms in different orders, ~1e-7 relative per add over a few hundred terms) and the fixed-point sum
against a float64 one (the float32 rounding of the result: 2**-23 relative, plus 2**-56 per term)."""

import pytest
import torch
from dist_utils import fails_fast, new_cp_group, run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_handler import LocalContextParallelHandler
from cp_handler.models import GPTConfig, GPTModel
from cp_handler.runtime import fixed_point
from cp_handler.runtime.exact_grads import (
    ExactGradients,
    is_scaled_norm,
    uncovered,
    unit_lengths,
    units_refusal,
)
from cp_handler.runtime.fixed_point import from_fixed, to_fixed

S = 384  # a multiple of 48: units of 8 tokens inside every zigzag chunk at cp 1, 2, 3, 4, 6 and 8


def _model() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=8,
                              num_query_groups=8, ffn_hidden_size=128, tie_word_embeddings=True))


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, S + 1), generator=torch.Generator().manual_seed(1))


def _grads(handler, exact: bool) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the summed next-token loss of :func:`_tokens` under ``handler`` (its real tokens:
    a thd pack's padding left out): the exact sums all-reduced over its group (``exact``), else autograd's,
    all-reduced in float32 (as DDP's sum)."""
    model, tokens = _model(), _tokens()
    tokens = tokens[:1] if handler.qkv_format == "thd" else tokens  # a pack is one row
    inputs, labels = (handler.dispatch(t, 1) for t in (tokens[:, :-1], tokens[:, 1:]))
    real = handler.token_layout.real_token_mask()
    weights = torch.ones(inputs.shape[1]) if real is None else real.float()
    sums = ExactGradients(model) if exact else None
    if exact:
        sums.units = unit_lengths(handler, inputs.shape[1])
    with sums if exact else torch.enable_grad():
        logits = model(inputs, cp_handler=handler)
        losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        (losses * weights.repeat(inputs.shape[0])).sum().backward()
    if exact:
        sums.all_reduce_(handler.cp_group)
    elif handler.cp_size > 1:
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad, group=handler.cp_group)
    return {name: p.grad for name, p in model.named_parameters()}


PACK = (100, 37, 1, 180, 66)
"""A thd pack of :data:`S` tokens (its documents padded to multiples of 48 in the mode: 528 slots)."""


def _handler(group, thd: bool = False):
    if not thd:
        return LocalContextParallelHandler(cp_group=group, cp_comm_type="a2a", deterministic=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(PACK).cumsum(0).tolist()], dtype=torch.int32)
    return LocalContextParallelHandler(cp_group=group, cp_comm_type="a2a", deterministic=True, qkv_format="thd",
                                       cu_seqlens=cu_seqlens)


@fails_fast
def _worker(rank, world):
    group = new_cp_group()
    for thd in (False, True):
        want = _grads(_handler(None, thd), exact=True)  # one process, on every rank
        got = _grads(_handler(group, thd), exact=True)
        for name, grad in want.items():
            assert torch.equal(got[name], grad), \
                f"{name} cp {world} thd {thd}: {(got[name] - grad).abs().max().item():.3e}"
    if world == 2:  # the negative control: autograd's sums and a float32 all-reduce are not one process's bits
        plain_one, plain = _grads(_handler(None), exact=False), _grads(_handler(group), exact=False)
        assert not all(torch.equal(plain[n], plain_one[n]) for n in plain)


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_parameter_gradients_are_bitwise_the_same_at_every_cp_degree(world):
    run_distributed(_worker, world)


def test_exact_gradients_match_autograd_and_leave_the_forward_unchanged():
    """One process: the exact sums against autograd's float32 gradients (relative 1e-5, module doc); the model's
    output the same bits inside the scope as outside; ``.grad`` untouched until :meth:`all_reduce_`; a tied weight
    summed once for both uses."""
    handler = _handler(None)
    model, tokens = _model(), _tokens()[:, :-1]
    plain = model(tokens, cp_handler=handler)
    plain.pow(2).mean().backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    sums = ExactGradients(model)
    sums.units = unit_lengths(handler, S)
    with sums:
        out = model(tokens, cp_handler=handler)
        out.pow(2).mean().backward()
    assert torch.equal(out, plain)
    assert all(p.grad is None for p in model.parameters())
    sums.all_reduce_()
    assert len(sums.params) == len(list(model.parameters()))  # lm_head.weight is embed_tokens.weight
    for name, p in model.named_parameters():
        scale = want[name].abs().max()
        assert (p.grad - want[name]).abs().max() <= 1e-5 * scale, name
    assert "forward" not in vars(model.lm_head)  # the scope's layers are the model's own again


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 200), st.integers(0, 2**32 - 1), st.floats(-30, 14))
def test_fixed_point_sums_are_the_same_bits_in_any_order_and_grouping(terms, seed, log_scale):
    """Terms of one magnitude (``2**log_scale``, |x| < 2**15): the limbs summed in a random order and in random
    groups give the same float32; against a float64 sum within float32's rounding plus 2**-56 per term."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(terms, 3, generator=g) * 2.0**log_scale
    x = x.clamp(-(2.0**15) + 1, 2.0**15 - 1)
    hi, lo = to_fixed(x)
    whole = from_fixed(hi.sum(0), lo.sum(0))
    perm = torch.randperm(terms, generator=g)
    cuts = sorted(torch.randint(0, terms + 1, (3,), generator=g).tolist())
    groups = [perm[a:b] for a, b in zip([0, *cuts], [*cuts, terms], strict=True)]
    grouped = [sum(part[idx].sum(0) for idx in groups) for part in (hi, lo)]
    assert torch.equal(from_fixed(*grouped), whole)
    exact = x.double().sum(0)
    assert ((whole.double() - exact).abs() <= exact.abs() * 2.0**-23 + terms * 2.0**-56 + 1e-300).all()


def test_the_compiled_sums_are_the_eager_integers():
    """Large pieces are summed by a compiled kernel (``fixed_sums``, Inductor on the CPU): the same integers as the
    eager operations on pieces of every magnitude the range allows (subnormals, tiny negatives whose floor crosses a
    limb, values next to the range's edge), a length whose vectorised loop has a tail, and the same count of elements
    out of range (NaN, infinities, the edge itself), whose limbs are not compared (they are refused)."""
    g = torch.Generator().manual_seed(0)
    n = fixed_point.COMPILE_MIN_ELEMENTS + 7
    pieces = (torch.randn(3, n, generator=g) * 2.0 ** torch.randint(-40, 14, (3, n), generator=g)).clamp(-3e4, 3e4)
    pieces[0, :6] = torch.tensor([-1.5e-8, 1e-30, -1e-30, -1e-45, 2.0**15 - 2.0**-8, -(2.0**15) + 2.0**-8])
    assert pieces.dtype == torch.float32 and pieces.abs().max() < fixed_point.MAX_PIECE
    got, want = fixed_point.fixed_sums(pieces), fixed_point._fixed_sums(pieces)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert fixed_point._compiled_fixed_sums.cache_info().currsize == 1  # the compiled path ran
    bad = pieces.clone()
    bad[1, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), fixed_point.MAX_PIECE])
    assert fixed_point.fixed_sums(bad)[2].item() == fixed_point._fixed_sums(bad)[2].item() == 4


def test_out_of_range_pieces_are_refused_on_every_rank_after_the_sum():
    """A gradient piece that is not finite, or as large as the fixed-point range, raises FloatingPointError naming
    the range at :meth:`all_reduce_` (after the collective: every rank raises, none hangs)."""
    model = _model()
    sums = ExactGradients(model)
    sums.add_(model.norm.weight, torch.full_like(model.norm.weight, float("nan")))
    with pytest.raises(FloatingPointError, match="fixed-point range"):
        sums.all_reduce_()


def test_uncovered_modules_and_units_are_named():
    """A module holding parameters that the exact sums do not cover is named; a sequence without units inside the
    zigzag chunks is refused with the rule."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert uncovered(model) == ["1 (LayerNorm)"]
    with pytest.raises(ValueError, match="LayerNorm"):
        ExactGradients(model)
    patched = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    patched[1].forward = lambda x: x  # someone else's per-instance forward: refused, and the scope leaves none behind
    with pytest.raises(ValueError, match="already has a forward of its own"), ExactGradients(patched):
        pass
    assert "forward" not in vars(patched[0])
    assert units_refusal(384, 3, "bshd") is None and units_refusal(128, 4, "bshd") is None
    assert "not at cp 3 with bshd sequences of 128 tokens" in units_refusal(128, 3, "bshd")
    assert "not at cp 5" in units_refusal(480, 5, "thd")


def test_scaled_norms_are_recognised_by_behaviour():
    """:func:`is_scaled_norm`: transformers' Qwen2 RMSNorm (``weight * x_hat``) is covered, whatever its weight's
    values (ones at init); Gemma's ``(1 + weight) * x_hat`` and a LayerNorm with a bias are not (named by
    :func:`uncovered`)."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    assert is_scaled_norm(Qwen2RMSNorm(16))
    assert not is_scaled_norm(GemmaRMSNorm(16))
    assert not is_scaled_norm(torch.nn.LayerNorm(16))
    assert uncovered(torch.nn.Sequential(Qwen2RMSNorm(16), GemmaRMSNorm(16))) == ["1 (GemmaRMSNorm)"]


def test_embedding_padding_row_receives_no_gradient():
    """An ``nn.Embedding`` with ``padding_idx`` (Hugging Face models set it): as autograd's, its padding row's gradient
    is zero and the other rows' equal autograd's (one piece per token: float32 sums of a few terms, 1e-6 relative)."""
    emb = torch.nn.Embedding(10, 4, padding_idx=3)
    ids = torch.tensor([[1, 3, 3, 5, 1, 0, 3, 9]])
    grad = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(0))
    emb(ids).backward(grad)
    want = emb.weight.grad.clone()
    emb.weight.grad = None
    sums = ExactGradients(emb)
    sums.units = (8,)
    with sums:
        emb(ids).backward(grad)
    sums.all_reduce_()
    assert torch.equal(emb.weight.grad[3], torch.zeros(4))
    torch.testing.assert_close(emb.weight.grad, want, rtol=1e-6, atol=0)


def test_a_gradient_outside_the_pieces_is_named_not_dropped():
    """A parameter whose weight a computation used outside the covered forwards (TRL's fused LM head reads
    ``lm_head.weight`` itself) gets autograd's gradient, which the exact sums would overwrite: :meth:`all_reduce_`
    raises naming it (after the collective); a forward replaced inside the scope (transformers' ``kernelize`` at
    ``train()``) is left to its owner, and the gradient it produces is named the same way."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    sums = ExactGradients(model)
    sums.units = (3,)
    x = torch.randn(1, 3, 4)
    with sums:
        (model(x).sum() + (x @ model[1].weight).sum()).backward()  # model[1]'s weight used outside its forward too
    with pytest.raises(RuntimeError, match=r"\['1.weight'\]"):
        sums.all_reduce_()
    model.zero_grad(set_to_none=True)
    sums = ExactGradients(model)
    sums.units = (3,)
    with sums:
        del model[0].forward  # what kernelize does to a layer that has no hub kernel
        model(x).sum().backward()
    assert "forward" not in vars(model[0]) and "forward" not in vars(model[1])
    with pytest.raises(RuntimeError, match=r"\['0.weight', '0.bias'\]"):
        sums.all_reduce_()


def test_hugging_face_trainers_say_where_they_cannot_sum_exactly():
    """:func:`~cp_handler.integrations.hf_exact_grads.refusal`: a world that is not a power of two (Trainer scales
    each rank's loss by it for DDP's mean; the RL trainers do not, any world), FSDP / DeepSpeed, ``torch_compile``,
    ``mlp_chunk_tokens`` and uncovered modules are named; a dense model on 2 ranks is summed exactly."""
    from types import SimpleNamespace

    from cp_handler.integrations.hf_exact_grads import refusal

    def trainer(world=2, fsdp=False, compile=False, chunk=None, divides_world=True):
        return SimpleNamespace(accelerator=SimpleNamespace(num_processes=world), is_fsdp_enabled=fsdp,
                               is_deepspeed_enabled=False, args=SimpleNamespace(torch_compile=compile),
                               cp_args=SimpleNamespace(mlp_chunk_tokens=chunk), exact_divides_world=divides_world)

    assert refusal(trainer(), _model()) is None
    assert "a world of 6 ranks" in refusal(trainer(6), _model())
    assert refusal(trainer(6, divides_world=False), _model()) is None  # the RL trainers: any world
    assert "FSDP" in refusal(trainer(fsdp=True), _model())
    assert "torch_compile" in refusal(trainer(compile=True), _model())
    assert "mlp_chunk_tokens=5" in refusal(trainer(chunk=5), _model())
    assert "LayerNorm" in refusal(trainer(), torch.nn.Sequential(torch.nn.LayerNorm(4)))


def test_parameters_are_aligned_so_one_row_matmuls_do_not_follow_the_file_layout():
    """A weight 4 bytes off the allocator's alignment (as a memory-mapped checkpoint can leave it) gave a one-row
    matmul other bits on this project's CPU (AVX-512, 2026-12-06; not asserted: it is the CPU's, not ours);
    :func:`align_parameters` moves it to aligned memory, keeping the parameter object and its values, and the one-row
    product is then the aligned weight's on any CPU."""
    from cp_handler.integrations.hf_exact_grads import ALIGNMENT, align_parameters

    torch.manual_seed(0)
    weight = torch.randn(64, 32) * 0.3
    rows = torch.randn(16, 32)
    head = torch.nn.Linear(32, 64, bias=False)
    buffer = torch.empty(1 + weight.numel())
    head.weight.data = buffer[1:].view(64, 32)  # 4 bytes off
    head.weight.data.copy_(weight)
    param = head.weight
    want = torch.cat([rows[i:i + 1] @ weight.t() for i in range(16)])
    assert head.weight.data_ptr() % ALIGNMENT
    assert align_parameters(head) == ["weight"] and head.weight is param and torch.equal(head.weight, weight)
    assert head.weight.data_ptr() % ALIGNMENT == 0 and align_parameters(head) == []
    assert torch.equal(torch.cat([rows[i:i + 1] @ head.weight.t() for i in range(16)]), want)
