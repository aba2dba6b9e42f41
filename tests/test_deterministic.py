"""The deterministic mode (``LocalContextParallelHandler(deterministic=True)``, issue 73): attention's output and the
gradients of q, k and v are ``torch.equal`` at cp 2, 3, 4, 6 and 8 to cp 1 on the same global inputs. ``a2a``: fp32
and bf16, MHA and GQA, causal and full, a sliding window, chunks, a soft-cap, sinks (their gradient too), multi-head
latent attention's widths, one query head per rank and fewer (bshd), sbhd, thd packs. Every pattern (p2p,
all_gather, a2a, a2a+p2p) on canonical tiles: the same bits as each other. The reference GPT's logits (so its
per-token losses) at cp 2, 3, 4, 6 and 8 through each. The negative controls: the default ring (p2p) and all-gather
on the same inputs differ in at least one bit at cp 2, so the comparison can fail. Its refusals by name: chunks
that are not whole tiles, ``"auto"`` where no pattern runs the call, key-value heads the all-to-all's ranks do not
divide (fewer than the query heads), another kernel.

Tolerances: none (bitwise).
"""

import pytest
import torch
from dist_utils import computed_once, fails_fast, new_cp_group, run_distributed
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from cp_handler import ContextParallelConfig, LocalContextParallelHandler

S, D = 384, 16  # 384 tokens: a multiple of 2 x cp for every cp of the file (zigzag chunks)
CASES = [  # (name, query heads, key-value heads, dtype, attn_mask_type, window, qkv_format)
    ("mha-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("gqa-bf16", 8, 4, torch.bfloat16, "causal", None, "bshd"),
    ("full-fp32", 8, 8, torch.float32, "no_mask", None, "bshd"),
    ("window-fp32", 8, 8, torch.float32, "causal", (37, 0), "bshd"),
    ("four-heads-fp32", 4, 4, torch.float32, "causal", None, "bshd"),  # one head per rank at cp 4, padded at 6 and 8
    ("thd-fp32", 8, 8, torch.float32, "causal", None, (100, 37, 1, 180, 66)),
    ("thd-gqa-bf16", 8, 4, torch.bfloat16, "causal", None, (5, 290, 89)),
    ("chunks-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("softcap-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("sinks-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("mla-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("sbhd-fp32", 8, 8, torch.float32, "causal", None, "sbhd"),
]
"""``qkv_format``: a tuple is a thd pack of those document lengths."""
VARIANTS = {"chunks-fp32": {"attention_chunk_size": 48}, "softcap-fp32": {"softcap": 2.0},
            "sinks-fp32": {"sinks": 0.5}}
"""Attributes of the attention module per case (Llama 4's chunks, Gemma 2's soft-cap, gpt-oss's sinks: a learnable
logit per query head, its gradient compared too); ``mla``: a value head dim of 24 against 16 (multi-head latent
attention's widths)."""


def _case_runs(name: str, cp: int) -> bool:
    _, heads, kv_heads, *_ = next(c for c in CASES if c[0] == name)
    return _case_runs_heads(heads, kv_heads, cp)


def _case_runs_heads(heads: int, kv_heads: int, cp: int) -> bool:
    """Whether the mode's ``a2a`` runs these heads at ``cp`` (a key-value head's query heads on one rank)."""
    return heads == kv_heads or kv_heads % cp == 0


def _results(handler, case, seq_len: int = S) -> list[torch.Tensor]:
    """The global output and the gradients of q, k and v of one call (combined over the group); with sinks, their
    gradient too (summed over the group: each rank's heads' share)."""
    name, heads, kv_heads, dtype, mask_type, window, fmt = case
    g = torch.Generator().manual_seed(0)
    shape, dim = (((sum(fmt),), 0) if isinstance(fmt, tuple) else ((seq_len, 1), 0) if fmt == "sbhd" else
                  ((1, seq_len), 1))
    dv = 24 if name.startswith("mla") else D
    q = torch.randn(*shape, heads, D, generator=g).to(dtype)
    dout = torch.randn(*shape, heads, dv, generator=g).to(dtype)
    k = torch.randn(*shape, kv_heads, D, generator=g).to(dtype)
    v = torch.randn(*shape, kv_heads, dv, generator=g).to(dtype)
    module = torch.nn.Module()
    module.softmax_scale, module.window_size = 0.25, window
    for attr, value in VARIANTS.get(name, {}).items():
        setattr(module, attr, torch.nn.Parameter(torch.full((heads,), value) + torch.arange(heads) / heads)
                if attr == "sinks" else value)
    local = [handler.dispatch(t, dim).detach().requires_grad_() for t in (q, k, v)]
    out = handler.core_attn(module, *local, attn_mask_type=mask_type)
    out.backward(handler.dispatch(dout, dim))
    got = [handler.combine(t, dim) for t in (out.detach(), *(t.grad for t in local))]
    if hasattr(module, "sinks"):
        grad = module.sinks.grad.clone()
        if handler.cp_size > 1:
            torch.distributed.all_reduce(grad, group=handler.cp_group)
        got.append(grad)
    return got


def _case_handler(group, case, comm_type="a2a", levels=None):
    """The deterministic handler of ``case`` (thd: built for its pack) on ``comm_type`` (``levels``: a2a+p2p's
    groups, when ``group`` is not ``None``)."""
    fmt = case[-1]
    if fmt == "sbhd":
        return LocalContextParallelHandler(cp_group=group, cp_comm_type="a2a", deterministic=True, qkv_format="sbhd")
    if not isinstance(fmt, tuple):
        return _handler(group)
    cu_seqlens = torch.tensor([0, *torch.tensor(fmt).cumsum(0).tolist()], dtype=torch.int32)
    hierarchy = {"hierarchical_cp_groups": list(levels.hierarchical_cp_groups)} if levels and group else {}
    return LocalContextParallelHandler(cp_group=levels.cp_group if hierarchy else group, cp_comm_type=comm_type,
                                       deterministic=True, qkv_format="thd", cu_seqlens=cu_seqlens, **hierarchy)


def _gpt_logits(handler, seq_len: int = S) -> torch.Tensor:
    """The reference GPT's global logits (8 heads, 2 layers, fp32) of ``seq_len`` tokens."""
    from cp_handler.models import GPTConfig, GPTModel

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=8,
                               num_query_groups=8, ffn_hidden_size=128))
    tokens = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return handler.combine(model(handler.dispatch(tokens, 1), cp_handler=handler), 1)


def _handler(group, comm_type="a2a", deterministic=True):
    return LocalContextParallelHandler(cp_group=group, cp_comm_type=comm_type, deterministic=deterministic)


def _worker(rank, world):
    torch.manual_seed(0)
    group = new_cp_group()
    plain = computed_once(_results, _handler(None), CASES[0])[0]
    for case in CASES:
        if case[0] in VARIANTS:  # the variant's attribute took effect (else its case would test the plain mask)
            assert not torch.equal(computed_once(_results, _handler(None), case)[0], plain), case[0]
        if not _case_runs(case[0], world):
            continue
        want = computed_once(_results, _case_handler(None, case), case)  # one process (rank 0's, sent to all)
        got = _results(_case_handler(group, case), case)
        for what, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
            assert torch.equal(a, b), f"{case[0]} cp {world} {what}: max difference {(a - b).abs().max().item():.3e}"
    # the reference GPT (8 heads; one per rank at cp 8): its logits, so its per-token losses, bitwise cp 1's
    want = computed_once(_gpt_logits, _handler(None))
    got = _gpt_logits(_handler(group))
    assert torch.equal(got, want), f"GPT logits cp {world}: max difference {(got - want).abs().max().item():.3e}"
    if world == 2:  # the negative control: the default ring on the same inputs is not bitwise one process's
        case = CASES[0]
        want = computed_once(_results, _handler(None), case)
        got = _results(_handler(group, "p2p", deterministic=False), case)
        assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_attention_is_bitwise_the_same_at_every_cp_degree(world):
    run_distributed(_worker, world)


AG_CASES = [  # (name, query heads, key-value heads, dtype, attn_mask_type, window): on canonical tiles
    ("ag-mha-fp32", 8, 8, torch.float32, "causal", None),
    ("ag-gqa-bf16", 8, 2, torch.bfloat16, "causal", None),  # fewer key-value heads than ranks from cp 3: heads whole
    ("ag-full-fp32", 4, 4, torch.float32, "no_mask", None),
    ("ag-window-fp32", 8, 4, torch.float32, "causal", (37, 0)),  # pairs cut by the window's edge, pairs skipped
    ("chunks-fp32", 8, 8, torch.float32, "causal", None),  # chunks of 48 across tiles of 64 (VARIANTS)
    ("softcap-fp32", 4, 4, torch.float32, "causal", None),  # every pair a masked block (VARIANTS)
    ("mla-fp32", 4, 4, torch.float32, "causal", None),  # value heads of 24 against 16: dk and dv nodes of two widths
    ("sinks-fp32", 8, 8, torch.float32, "causal", None),  # folded per tile, their gradient summed in tile order
]


def _ag_results(handler, case, seq_len: int) -> list[torch.Tensor]:
    name, heads, kv_heads, dtype, mask_type, window = case
    return _results(handler, (name, heads, kv_heads, dtype, mask_type, window, "bshd"), seq_len)


def _with_lse(handler, case, seq_len: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`_ag_results` of a call on canonical tiles and its log-sum-exp (the forward's ``lse``, float32
    ``(B, H, S_local)``, captured from ``canonical_attention`` and combined into global order ``(B, H, S)``)."""
    import cp_handler.handlers.local as local

    seen, real = [], local.canonical_attention

    def captured(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        seen.append(lse.detach())
        return out, lse

    local.canonical_attention = captured
    try:
        results = _ag_results(handler, case, seq_len)
    finally:
        local.canonical_attention = real
    lse, = seen  # one forward call
    return results, handler.combine(lse, 2)


def _ag_handler(group, deterministic=True, comm_type="all_gather"):
    return LocalContextParallelHandler(cp_group=group, cp_comm_type=comm_type, deterministic=deterministic)


def _tiled_handlers(world: int, heads: int, kv_heads: int, group, levels):
    """``(name, handler)`` of every pattern in the mode that runs these heads at ``world``: all_gather, p2p and auto
    (heads whole, so some pattern runs them; at cp 2 and 4 in float32: what the CPU's cost profile prices), a2a and
    a2a+p2p (2 ranks in the all-to-all, the rest in the ring) where the all-to-all's ranks divide the key-value
    heads."""
    handlers = [("all_gather", _ag_handler(group)), ("p2p", _ag_handler(group, comm_type="p2p"))]
    if world in (2, 4):  # the CPU's cost profile covers groups of 2 and 4 (and prices float32 calls)
        handlers.append(("auto", _ag_handler(group, comm_type="auto")))
    if _case_runs_heads(heads, kv_heads, world):
        handlers.append(("a2a", _handler(group)))
    if levels is not None and _case_runs_heads(heads, kv_heads, 2):
        handlers.append(("a2a+p2p", LocalContextParallelHandler(
            cp_group=levels.cp_group, cp_comm_type="a2a+p2p", deterministic=True,
            hierarchical_cp_groups=list(levels.hierarchical_cp_groups))))
    return handlers


def _canonical_worker(rank, world):
    from cp_handler import build_dp_cp_groups

    group = new_cp_group()
    levels = build_dp_cp_groups(world, "cpu", [2, world // 2]) if world % 2 == 0 and world > 2 else None
    for tiles_per_chunk in (1, 3):  # 3: a tree over tiles that reach each rank in runs, not one by one
        seq_len = 2 * world * 64 * tiles_per_chunk  # zigzag chunks of whole canonical tiles (64 tokens here)
        for case in AG_CASES:
            # one process's canonical tiles, and their log-sum-exp (what the ring and the all-gather compare too)
            want, want_lse = computed_once(_with_lse, _ag_handler(None), case, seq_len)
            for name, handler in _tiled_handlers(world, case[1], case[2], group, levels):
                if (name == "auto" and case[3] != torch.float32) or (name == "a2a" and case[0].startswith("sinks")):
                    continue  # a2a runs sinks with its blockwise plan (other bits, the same at every degree)
                if name in ("all_gather", "p2p"):
                    got, lse = _with_lse(handler, case, seq_len)
                    assert torch.equal(lse, want_lse), (f"{case[0]} {name} cp {world} S {seq_len} lse: max difference "
                                                        f"{(lse - want_lse).abs().max().item():.3e}")
                else:
                    got = _ag_results(handler, case, seq_len)
                for what, a, b in zip(("output", "dq", "dk", "dv", "dsinks"), got, want, strict=False):
                    assert torch.equal(a, b), (f"{case[0]} {name} cp {world} S {seq_len} {what}: max difference "
                                               f"{(a - b).abs().max().item():.3e}")
    # the reference GPT through every pattern: its logits, so its per-token losses, bitwise one process's
    seq_len = 2 * world * 64
    want = computed_once(_gpt_logits, _handler(None), seq_len)
    for name, handler in _tiled_handlers(world, 8, 8, group, levels):
        got = _gpt_logits(handler, seq_len)
        assert torch.equal(got, want), f"GPT logits {name} cp {world}: {(got - want).abs().max().item():.3e}"
    if world == 2:  # the negative controls: the default all-gather and ring on the same inputs are not cp 1's bits
        want = computed_once(_ag_results, _ag_handler(None), AG_CASES[0], seq_len)
        for comm_type in ("all_gather", "p2p"):
            got = _ag_results(_ag_handler(group, False, comm_type), AG_CASES[0], seq_len)
            assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), comm_type
    module = torch.nn.Module()  # refused by name: chunks that are not whole tiles, a window
    module.softmax_scale = 0.25
    q = torch.zeros(1, 2 * 13, 8, D)  # 2 x cp x 13 tokens: neither a multiple of 64 nor of 48 at cp 2 to 8
    for comm_type in ("all_gather", "p2p"):
        with pytest.raises(ValueError, match=rf"cp_comm_type='{comm_type}': documents of \[{2 * world * 13}\] tokens; "
                                             r"the mode.s tiles need a sequence of a multiple of 64 tokens"):
            _ag_handler(group, comm_type=comm_type).core_attn(module, q, q, q, attn_mask_type="causal")
    if world == 2:  # 2 x cp x 96 tokens: a multiple of 64, whose zigzag chunks are not
        q = torch.zeros(1, 2 * 96, 8, D)
        with pytest.raises(ValueError, match=r"a sequence of 384 tokens over 2 ranks has zigzag chunks of 96 tokens; "
                                             r"the mode.s tiles \(64 tokens for this length\) need chunks"):
            _ag_handler(group, comm_type="p2p").core_attn(module, q, q, q, attn_mask_type="causal")


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_every_pattern_is_bitwise_the_same_at_every_cp_degree(world):
    """Every pattern on canonical tiles (ops/canonical.py): the KV all-gather, the ring (p2p) and, where their
    all-to-all's ranks divide the key-value heads, a2a and a2a+p2p (2 x cp / 2 levels at cp 4, 6 and 8): output, dq,
    dk, dv (and the log-sum-exp of the all-gather and the ring, what their forward returns) ``torch.equal`` to one
    process's canonical tiles at cp 2, 3, 4, 6 and 8 (fp32 MHA, bf16 GQA with 2
    key-value heads, full attention, GQA 8 / 4 with a sliding window, chunks, a soft-cap, MLA's widths), zigzag
    chunks of one tile and of three (the tree receiving runs of tiles), so the same bits across patterns, and the
    reference GPT's logits through each; the default all-gather and ring differ (the controls); chunks that are not
    whole tiles refused by name."""
    run_distributed(_canonical_worker, world)


def _thd_worker(rank, world):
    group = new_cp_group()

    @settings(max_examples=6, derandomize=True, deadline=None,  # every rank draws the same cases
              phases=[Phase.explicit, Phase.generate])
    @given(lengths=st.lists(st.one_of(st.just(0), st.integers(1, 5), st.integers(6, 70), st.integers(71, 200)),
                            min_size=1, max_size=7).filter(lambda lengths: sum(lengths) > 0))
    @example(lengths=[100, 37, 1, 180, 66])
    @fails_fast  # a rank's failure ends the run with its message (no replay the other ranks do not make)
    def run(lengths):
        heads = (6, 6) if world == 3 else (8, 4)  # a key-value head's query heads on one rank (the mode's rule)
        case = ("thd", *heads, torch.float32, "causal", None, tuple(lengths))
        want = computed_once(_results, _case_handler(None, case), case)
        got = _results(_case_handler(group, case), case)
        for what, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
            assert torch.equal(a, b), f"{lengths} cp {world} {what}: max difference {(a - b).abs().max().item():.3e}"

    run()


def _thd_tiles_worker(rank, world):
    from cp_handler import build_dp_cp_groups

    group = new_cp_group()
    levels = build_dp_cp_groups(world, "cpu", [2, world // 2]) if world == 4 else None

    @settings(max_examples=2, derandomize=True, deadline=None, phases=[Phase.explicit, Phase.generate])
    @given(lengths=st.lists(st.one_of(st.just(0), st.integers(1, 5), st.integers(6, 200)), min_size=1, max_size=4)
           .filter(lambda lengths: sum(lengths) > 0))
    @example(lengths=[100, 37, 1, 180, 66])
    @fails_fast
    def run(lengths):
        for name, heads, window in (("thd", (8, 4), None), ("thd-window", (4, 4), (37, 0))):
            case = (name, *heads, torch.float32, "causal", window, tuple(lengths))
            for comm_type in ("p2p", "all_gather", *(("a2a+p2p",) if levels else ())):
                want = computed_once(_results, _case_handler(None, case, comm_type), case)  # cp 1, same pattern
                got = _results(_case_handler(group, case, comm_type, levels), case)
                for what, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
                    assert torch.equal(a, b), (f"{lengths} {name} {comm_type} cp {world} {what}: max difference "
                                               f"{(a - b).abs().max().item():.3e}")

    run()


@pytest.mark.parametrize("world", [3, 4])
def test_thd_packs_on_canonical_tiles_are_bitwise_the_same_at_every_cp_degree(world):
    """Packed documents on canonical tiles (a 48th of each padded document per tile): p2p and all_gather at cp 3
    and 4, a2a+p2p (2 x 2) at cp 4, 8 / 4 heads causal and 4 / 4 heads with a window of 38: the output and dq, dk,
    dv ``torch.equal`` to one process on the same pattern (hypothesis: zero-length, tiny and longer documents)."""
    run_distributed(_thd_tiles_worker, world)


@pytest.mark.parametrize("world", [3, 4])
def test_thd_packs_are_bitwise_the_same_at_every_cp_degree(world):
    """Packed documents of any lengths (hypothesis: zero-length, tiny and long documents, any split), fp32, 6 / 6 heads
    at cp 3 and GQA 8 / 4 at cp 4: the output and dq, dk, dv ``torch.equal`` to cp 1 (every document padded to a
    multiple of 48 at every degree, :data:`~cp_handler.core.layout.DETERMINISTIC_MULTIPLE`)."""
    run_distributed(_thd_worker, world)


def _refusal_worker(rank, world):
    group = new_cp_group()
    handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", deterministic=True, qkv_format="thd",
                                          cu_seqlens=torch.tensor([0, 64, 100], dtype=torch.int32))
    q = handler.dispatch(torch.zeros(100, 4, D), 0)
    with pytest.raises(ValueError, match=r"its canonical tiles run causal masks on padded documents"):
        handler.core_attn(torch.nn.Module(), q, q, q, attn_mask_type="no_mask")
    for heads, kv_heads, rule in ((8, 2, "a key-value head's query heads would sit on several ranks"),):
        handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="a2a", deterministic=True)
        q = torch.zeros(1, 2 * S // world, heads, D)
        kv = torch.zeros(1, 2 * S // world, kv_heads, D)
        module = torch.nn.Module()
        module.softmax_scale = 0.25
        with pytest.raises(ValueError, match=rule):
            handler.core_attn(module, q, kv, kv, attn_mask_type="causal")
        # auto: canonical tiles refuse a full mask on padded documents, a2a the heads
        handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="auto", deterministic=True,
                                              qkv_format="thd", cu_seqlens=torch.tensor([0, 100], dtype=torch.int32))
        q, kv = (handler.dispatch(torch.zeros(100, h, D), 0) for h in (heads, kv_heads))
        with pytest.raises(ValueError, match=r"'auto' with deterministic=True: no pattern runs this call in the mode: "
                                             r"p2p: .*causal masks on padded documents.*; a2a: .*query heads"):
            handler.core_attn(module, q, kv, kv, attn_mask_type="no_mask")


def test_what_the_mode_does_not_make_bitwise_is_refused_by_name():
    run_distributed(_refusal_worker, 4)
    with pytest.raises(ValueError, match="pins the block kernel to 'cpu_flash'"):
        LocalContextParallelHandler(cp_group=None, deterministic=True, attn_kernel="flash")


def test_the_config_field_builds_the_mode_and_refuses_what_it_does_not_run():
    """``ContextParallelConfig(deterministic=True)``: the local handler in the mode (thd too); another comm type at
    cp > 1, a value that is not a bool and a backend without the mode refused by name."""
    from cp_handler import build_cp_handler
    from cp_handler.handlers.base import ContextParallelHandler

    assert build_cp_handler(ContextParallelConfig(deterministic=True)).deterministic
    assert not build_cp_handler(ContextParallelConfig()).deterministic
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="auto", deterministic=True)
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="p2p", qkv_format="thd", deterministic=True)
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="p2p", deterministic=True)
    assert ContextParallelConfig(context_parallel_size=2, cp_comm_type="a2a", qkv_format="thd", deterministic=True)
    with pytest.raises(ValueError, match=r"deterministic=1 must be True or False"):
        ContextParallelConfig(deterministic=1)

    class WithoutTheMode(ContextParallelHandler):
        def attend(self, call):
            raise AssertionError("never reached")

    with pytest.raises(ValueError, match=r"backend 'local' \(WithoutTheMode\) does not implement the deterministic"):
        WithoutTheMode.from_config(ContextParallelConfig(deterministic=True))


def _rl_model():
    """A tiny Llama (8 query, 4 key-value heads: 2 and 1 per rank at cp 4) with TRL's fused LM head."""
    import transformers
    from hf_trainer_cases import VOCAB
    from trl.trainer.utils import add_fused_lm_head

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                                      max_position_embeddings=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    return model


def _rl_log_probs(cp: int, group, deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's per-token log-probs and entropies of GRPO's layout (tests/test_hf_fused_head.py's batch) through the
    fused head under CP (what CPGRPOTrainer / CPRLOOTrainer / CPDPOTrainer score with), in the deterministic mode
    (else the default ring)."""
    from test_hf_fused_head import batch

    from cp_handler.integrations.hf_fused_head import install_cp_fused_head
    from cp_handler.integrations.transformers import register

    model = _rl_model()
    register(model)
    install_cp_fused_head(model, ContextParallelConfig(context_parallel_size=cp, cp_comm_type="a2a" if deterministic
                                                       else "p2p", deterministic=deterministic), group)
    ids, mask, labels = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs, out.entropy


def _rl_worker(rank, world, out):
    import torch.distributed as dist

    got = [_rl_log_probs(world, dist.group.WORLD), _rl_log_probs(world, dist.group.WORLD, deterministic=False)]
    if rank == 0:
        torch.save(got, out)


def test_rl_log_probs_and_entropies_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """The RL trainers' scores (TRL's fused head on shards, left-padded prompts and right-padded completions) in the
    deterministic mode: ``torch.equal`` to cp 1 at cp 2 and 4 (rows padded to one length at every degree,
    ``core.layout.DETERMINISTIC_MULTIPLE``: without it cp 4's padded rows gave results 2e-7 apart, measured). Negative
    control: the default ring at cp 4 differs from cp 1 in at least one bit."""
    want = _rl_log_probs(1, None)
    for world in (2, 4):
        run_distributed(_rl_worker, world, str(tmp_path / f"{world}.pt"))
        got, default = torch.load(tmp_path / f"{world}.pt")
        for name, a, b in zip(("log_probs", "entropy"), got, want, strict=True):
            assert torch.equal(a, b), (world, name, (a - b).abs().max().item())
    assert not all(torch.equal(a, b) for a, b in zip(default, want, strict=True))
