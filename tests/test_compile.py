"""torch.compile under CP: ``core_attn`` is one operator (cp_handler/handlers/opaque.py), so the reference GPT
traces as one graph (0 graph breaks) under every comm type, bshd and thd, each block compiles with
``fullgraph=True``, the compiled step equals the one-process step, and a handler built per batch recompiles
nothing.

Tolerances: the parity bounds of gpt_reference.py (loss rtol 1e-6; gradients atol 1e-6 + rtol 1e-4): a
compiled step reorders the same float32 sums as a CP step does (Inductor fuses and reorders reductions;
measured ~4e-6 absolute on logits-squared losses of size ~1e2, ~1e-8 on the normalised loss's gradients),
while a wrong position or token moves a gradient by >1e-3. The single-process checks of the operator compare
compiled with eager on the same process: ``aot_eager`` runs the same kernels, so they are equal to 1e-6.
"""

import pytest
import torch
from device_cases import GPU_CASES
from dist_utils import new_cp_group, run_distributed
from gpt_reference import CONFIG, GPT_GPU_TOLERANCE, assert_close_by_norm, assert_parity, loss_and_grads

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from cp_handler.handlers import opaque
from cp_handler.handlers.local import LocalContextParallelHandler
from cp_handler.models import GPTConfig, GPTModel
from cp_handler.training import next_token_batch
from cp_handler.training.compile import compile_layers

LENGTHS = (10, 22)  # two documents of a thd batch: padded to multiples of 2 * cp = 4 -> 12 + 24 = 36 tokens


def compile_blocks(backend: str):
    """Per-block compile, as torchtitan's ``--compile`` (and cp-train's): every layer, ``fullgraph=True``."""
    return lambda model: compile_layers(model, backend)


def _graphs_of(model, handler, tokens):
    """``torch._dynamo.explain`` of the whole model's forward, after one eager forward with that handler."""
    input_ids = next_token_batch(handler, tokens)[0]
    model(input_ids, cp_handler=handler)
    explained = torch._dynamo.explain(model)(input_ids, cp_handler=handler)
    return explained.graph_count, explained.graph_break_count, [b.reason for b in explained.break_reasons]


def _cases(world: int):
    """(label, handler class, handler kwargs, tokens, layer types) of every comm type (and one per-layer list) and
    format; at cp 2 p2p and a2a also with a Gated DeltaNet layer (its convolution and delta rule: two operators)."""
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2]) if world == 4 else None
    comm_types = ["a2a+p2p"] if world == 4 else ["p2p", "all_gather", "a2a", ["p2p", "a2a"]]
    bshd = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    thd = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(3))
    cu_seqlens = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    for comm_type in comm_types:
        cls = get_cp_handler_cls("local", comm_type)
        levels = {} if groups is None else {"hierarchical_cp_groups": groups.hierarchical_cp_groups}
        for fmt, tokens, batch in (("bshd", bshd, {}), ("thd", thd, {"qkv_format": "thd", "cu_seqlens": cu_seqlens})):
            kwargs = {"cp_comm_type": comm_type, **levels, **batch}
            yield f"{comm_type} {fmt}", cls, kwargs, tokens, None
            if comm_type in ("p2p", "a2a") and world == 2:
                yield f"{comm_type} {fmt}, hybrid", cls, kwargs, tokens, ("linear_attention", "full_attention")


def _whole_model_worker(rank, world):
    group = new_cp_group() if world == 2 else None
    for label, cls, kwargs, tokens, layer_types in _cases(world):
        cp_group = group if group is not None else build_dp_cp_groups(world, "cpu", [2, 2]).cp_group
        config = GPTConfig(**{**vars(CONFIG), "num_layers": 2, "layer_types": layer_types})
        torch._dynamo.reset()
        torch.manual_seed(0)
        graphs, breaks, reasons = _graphs_of(GPTModel(config), cls(cp_group=cp_group, **kwargs), tokens)
        assert (graphs, breaks) == (1, 0), f"{label}: {graphs} graphs, {breaks} breaks: {reasons}"
        reference = loss_and_grads(config, cls(cp_group=None, **{k: v for k, v in kwargs.items()
                                                                 if k != "hierarchical_cp_groups"}), tokens, None)
        torch._dynamo.reset()
        got = loss_and_grads(config, cls(cp_group=cp_group, **kwargs), tokens, cp_group,
                             prepare=compile_blocks("aot_eager"))
        assert_parity(got, reference, f"compiled blocks, {label}")
    assert not opaque._graphs, f"{len(opaque._graphs)} eager graphs outlived their backward"


@pytest.mark.parametrize("world", [2, 4])
def test_gpt_compiles_whole_and_matches_one_process(world):
    """0 graph breaks in the whole forward; per-block ``fullgraph=True`` compiles; the compiled step equals the
    one-process step (every comm type at cp 2, a2a+p2p [2, 2] at cp 4, a per-layer list; bshd and thd; a hybrid
    model's Gated DeltaNet layer beside an attention layer)."""
    run_distributed(_whole_model_worker, world)


def _gpu_worker(rank, world, case):
    """The compiled step on CUDA (Inductor, every layer fullgraph; p2p and a2a) vs a float64 CPU step, as
    tests/test_gpt_parity.py's GPU case (attention layers: the mixer methods are opt-in on CUDA)."""
    config = CONFIG
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(7))
    group = new_cp_group()
    for comm_type in ("p2p", "a2a"):
        cls = get_cp_handler_cls("local", comm_type)
        reference = loss_and_grads(config, cls(cp_group=None), tokens, None, dtype=torch.float64)
        torch._dynamo.reset()
        got = loss_and_grads(config, cls(cp_group=group, cp_comm_type=comm_type), tokens, group, case.device,
                             case.dtype, prepare=compile_blocks("inductor"))
        worst = assert_close_by_norm(got, reference, GPT_GPU_TOLERANCE[case.dtype], f"compiled {comm_type}")
        if rank == 0:
            print(f"compiled {comm_type} {case.dtype}: worst error / bound {worst[0]:.3g} ({worst[1]})")


@pytest.mark.parametrize("case", GPU_CASES)
def test_compiled_gpt_on_gpu(case):
    run_distributed(_gpu_worker, 2, case, device="cuda")


def _batches(count: int):
    """thd batches of two documents with changing lengths and one padded total (36 tokens at cp 2)."""
    generator = torch.Generator().manual_seed(11)
    for _ in range(count):
        first = 4 * int(torch.randint(1, 8, (1,), generator=generator)) - int(torch.randint(0, 3, (1,),
                                                                                                generator=generator))
        padded_first = -(-first // 4) * 4
        lengths = (first, 36 - padded_first - int(torch.randint(0, 3, (1,), generator=generator)))
        tokens = torch.randint(0, 256, (1, sum(lengths)), generator=generator)
        yield lengths, tokens, torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)


def _recompile_worker(rank, world):
    from torch._dynamo.utils import counters

    group = new_cp_group()
    cls = get_cp_handler_cls("local", "p2p")
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPTModel(CONFIG)
    compile_blocks("inductor")(model)
    compiled_after = []
    for i, (lengths, tokens, cu_seqlens) in enumerate(_batches(20)):
        handler = cls(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu_seqlens)
        got = loss_and_grads(CONFIG, handler, tokens, group, model=model)
        compiled_after.append(counters["stats"]["unique_graphs"])
        if i in (0, 19):  # parity with one process, first and last batch (every batch runs the same graphs)
            reference = loss_and_grads(CONFIG, cls(cp_group=None, qkv_format="thd", cu_seqlens=cu_seqlens),
                                       tokens, None)
            assert_parity(got, reference, f"batch {i} documents {lengths}")
    assert compiled_after[0] >= 1 and compiled_after[-1] == compiled_after[0], \
        f"graphs compiled after each of 20 batches: {compiled_after} (a handler per batch must not recompile)"
    assert not opaque._graphs, f"{len(opaque._graphs)} eager graphs outlived their backward"


def test_a_handler_per_batch_recompiles_nothing():
    """20 thd batches, documents of changing lengths in one padded-length bucket, a new handler each: the
    compiled blocks (Inductor, fullgraph) are compiled at the first batch only, and equal one process."""
    run_distributed(_recompile_worker, 2)


HF_MODELS = ("llama", "qwen3", "gemma3_text", "gpt_oss")
"""Llama, Qwen3 (q/k norms), Gemma 3 (sliding-window layers beside global ones), gpt-oss (learnable sinks, a
window, MoE): their decoder layers through transformers' attention interface."""


def _hf_worker(rank, world):
    import hf_zoo
    from test_hf_integration import DOCUMENTS, cp_step, reference_step

    from cp_handler.integrations.transformers import register

    group = new_cp_group()
    tokens = torch.randint(0, hf_zoo.VOCAB, (1, hf_zoo.SEQ_LEN), generator=torch.Generator().manual_seed(7))
    for name in HF_MODELS:
        want = hf_zoo.reference(hf_zoo.build(name), tokens)
        model = hf_zoo.build(name)
        register(model)
        torch._dynamo.reset()
        assert compile_layers(model, "aot_eager") == 2
        for comm_type in ("p2p", "a2a"):
            problem = hf_zoo._compare(hf_zoo.cp_run(model, tokens, comm_type, group), want)
            assert problem is None, f"{name} {comm_type}, compiled layers: {problem}"
    cu = torch.tensor([0, *torch.tensor(DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    packed = torch.randint(0, 256, (1, int(cu[-1])), generator=torch.Generator().manual_seed(4))
    want_logits, want = reference_step("llama", packed, cu)
    for comm_type in ("p2p", "all_gather", "a2a"):
        torch._dynamo.reset()
        handler = get_cp_handler_cls("local", comm_type)(cp_group=group, cp_comm_type=comm_type, qkv_format="thd",
                                                         cu_seqlens=cu)
        logits, got = cp_step("llama", handler, packed, group, prepare=compile_blocks("aot_eager"))
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
        assert_parity(got, want, f"llama thd {comm_type}, compiled layers")
    assert not opaque._graphs, f"{len(opaque._graphs)} eager graphs outlived their backward"


def test_hf_decoder_layers_compile_whole_and_match_one_process():
    """Each decoder layer of Llama, Qwen3, Gemma 3 and gpt-oss compiles with ``fullgraph=True`` (a graph break
    raises) and the step equals the unmodified model's (p2p and a2a; Llama thd in every comm type at cp 2)."""
    run_distributed(_hf_worker, 2)


class _Attention(torch.nn.Module):
    def __init__(self, heads: int):
        super().__init__()
        self.window_size, self.softcap = (2, 0), 5.0
        self.sinks = torch.nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(0)))


def test_operator_is_checked_exact_and_refuses_by_name():
    """One process (cp = 1 runs the blockwise algorithm for a variant): the operator passes torch.library's
    schema, fake-tensor and autograd-registration checks; compiled (``fullgraph``) equals eager, sinks' gradient
    included; no eager graph outlives its backward; an invalid attribute is refused at run time by name."""
    handler = LocalContextParallelHandler(cp_group=None)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 8, h, 4, generator=generator, requires_grad=True) for h in (2, 1, 1))
    attn = _Attention(2)
    names, values = opaque.variant_args(handler, attn)
    checks = torch.library.opcheck(
        torch.ops.cp_handler.handler_call.default,
        ([q, k, v, attn.sinks, torch.tensor(values, dtype=torch.float64)], handler.compile_handle, "core_attn",
         repr({"names": names, "attn_mask_type": "causal", "absent": []}), True),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(checks.values()) == {"SUCCESS"}, checks

    def run(fn):
        out = fn(q, k, v)
        out.square().sum().backward()
        grads = [t.grad.clone() for t in (q, k, v, attn.sinks)]
        for t in (q, k, v, attn.sinks):
            t.grad = None
        return out.detach(), grads

    def attention(q, k, v):
        return handler.core_attn(attn, q, k, v)

    eager = run(attention)
    torch._dynamo.reset()
    compiled = run(torch.compile(attention, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    for got, want, name in zip(compiled[1], eager[1], ("q", "k", "v", "sinks"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"d{n}: {m}")
    assert not opaque._graphs
    attn.softcap = -1.0
    with pytest.raises(ValueError, match=r"softcap=-1.0 must be a finite number > 0"):
        torch.compile(attention, backend="aot_eager", fullgraph=True)(q, k, v)


def test_cp_train_compile_matches_one_process_every_step():
    """``cp-train --compile``: every layer compiled (Inductor, fullgraph), thd packing at cp 2, each step's loss
    and whole gradient equal the eager one-process step (``--check-parity``, tolerance 1e-5 relative)."""
    from test_cli import SMALL, cp_train

    result = cp_train("--nproc", "2", "--packing", "thd", *SMALL[2:], "--steps", "3", "--check-parity", "--compile")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed: each of 3 steps" in result.stderr


@pytest.mark.parametrize("flags, rule", [
    (["--moe-experts", "2"], r"--compile with --moe-experts 2: the expert exchange is not one operator"),
    (["--backend", "transformer_engine"], r"--compile with --backend transformer_engine: its attention is not one"),
])
def test_cp_train_compile_refuses_layers_that_cannot_compile_whole(flags, rule, monkeypatch):
    from cp_handler.cli.args import parse
    from cp_handler.handlers.transformer_engine import TEContextParallelHandler

    if "transformer_engine" in flags:  # not installed here: its rule is checked before its availability matters
        monkeypatch.setattr(TEContextParallelHandler, "check_available", classmethod(lambda cls: None))
    with pytest.raises(SystemExit, match=rule):
        parse(["--compile", "--seq-len", "64", *flags])


def test_cp_train_compile_refuses_hf_mixers():
    """A Hugging Face hybrid's mixers reach the handler through a context variable Dynamo cannot trace: refused by
    name before any rank starts (Qwen3-Next's Gated DeltaNet)."""
    import hf_zoo

    from cp_handler.cli.training_args import check_compile_mixers

    with pytest.raises(ValueError, match=r"--compile: Qwen3NextGatedDeltaNet reach the handler through a context"):
        check_compile_mixers(hf_zoo.tiny_config("qwen3_next", hf_zoo.HYBRIDS["qwen3_next"]))
    # LFM2's short convolution reaches its kernel only through a helper since transformers 5.25
    with pytest.raises(ValueError, match=r"--compile: Lfm2ShortConv reach the handler through a context"):
        check_compile_mixers(hf_zoo.tiny_config("lfm2"))


def test_compiled_hf_forward_is_refused_unless_one_attention_call_per_layer():
    """Compiled decoder layers record no layer; the handler's count of calls stands in, and must equal the layer
    count: a model whose first layer runs its attention twice (and so could hide a layer that runs it not at all)
    is refused by name; the unchanged model runs (one process, cp = 1, the operator all the same)."""
    import hf_zoo

    from cp_handler.integrations.transformers import cp_model_inputs, register

    model = hf_zoo.build("llama")
    register(model)
    handler = get_cp_handler_cls("local", "p2p")(cp_group=None)
    tokens = torch.randint(0, hf_zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compile_layers(model, "aot_eager")
    want = hf_zoo.build("llama")(tokens).logits
    got = model(tokens, **cp_model_inputs(handler, tokens), cp_handler=handler).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    attn = model.model.layers[0].self_attn

    class Twice(type(attn)):  # a class, not an instance attribute: what Dynamo traces is the class's forward
        def forward(self, *args, **kwargs):  # both outputs used (an unused operator output is eliminated)
            first, second = super().forward(*args, **kwargs), super().forward(*args, **kwargs)
            return (first[0] + second[0]) / 2, second[1]

    attn.__class__ = Twice
    torch._dynamo.reset()
    with pytest.raises(ValueError, match=r"3 attention calls ran compiled .* for 2 layers: not one call per layer"):
        model(tokens, **cp_model_inputs(handler, tokens), cp_handler=get_cp_handler_cls("local", "p2p")(cp_group=None))
