"""The deterministic mode on canonical tiles (``cp_handler/ops/canonical.py``, issue 73): every pattern (the KV
all-gather, the ring (``p2p``), and where their all-to-all's ranks divide the key-value heads ``a2a`` and
``a2a+p2p``) gives one process's canonical tiles' bits at cp 2, 3, 4, 6 and 8, so the same bits as each other.

bshd (zigzag chunks of one tile and of three): fp32 MHA, bf16 GQA 8 / 2, full attention, a window, chunks, a
soft-cap, MLA's widths, sinks; sbhd (bf16 GQA, a window); thd packs (the pack ``[100, 37, 1, 180, 66]`` with bf16
GQA, chunks, sinks, MLA's widths, a window; one document of 150 with a soft-cap; hypothesis over document lengths and
splits at every degree): the output, dq, dk, dv (dsinks) and the forward's log-sum-exp ``torch.equal``. The
reference GPT's logits and per-token losses in fp32 and bf16 through each pattern. The negative controls: the
default all-gather and ring differ at cp 2. Refused by name: lengths whose zigzag chunks are not whole tiles.

Tolerances: none (bitwise).
"""

import functools

import pytest
import torch
from deterministic_cases import (
    GPT_OUTPUTS,
    D,
    assert_equal,
    case_handler,
    case_runs_heads,
    gpt_outputs,
    results,
    results_with_lse,
)
from dist_utils import computed_once, fails_fast, new_cp_group, run_distributed
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

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
SBHD_CASES = ("ag-gqa-bf16", "ag-window-fp32")
"""The cases also run in sbhd (one tile per zigzag chunk)."""
PACK = (100, 37, 1, 180, 66)
THD_CASES = [  # packed documents on tiles (a 48th of each padded document per tile), AG_CASES' form with the pack last
    ("thd-gqa-bf16", 8, 2, torch.bfloat16, "causal", None, PACK),
    ("thd-window-fp32", 4, 4, torch.float32, "causal", (37, 0), PACK),
    ("chunks-fp32", 4, 4, torch.float32, "causal", None, PACK),
    ("softcap-fp32", 4, 4, torch.float32, "causal", None, (150,)),  # one document: every pair a masked block call
    ("sinks-fp32", 4, 4, torch.float32, "causal", None, PACK),
    ("mla-fp32", 4, 4, torch.float32, "causal", None, PACK),
]


def _tiled_handlers(world: int, heads: int, kv_heads: int, group, levels, fmt="bshd"):
    """``(name, handler factory)`` of every pattern in the mode that runs these heads at ``world`` in ``fmt``:
    all_gather and p2p; auto (bshd, at cp 2 and 4: what the CPU's cost profile prices); a2a (not thd: it runs packed
    documents with its blockwise plan, other bits, the same at every degree) and a2a+p2p (2 ranks in the all-to-all,
    the rest in the ring) where the all-to-all's ranks divide the key-value heads."""
    names = ["all_gather", "p2p"]
    if world in (2, 4) and fmt == "bshd":  # the CPU's cost profile covers groups of 2 and 4
        names.append("auto")
    if case_runs_heads(heads, kv_heads, world) and not isinstance(fmt, tuple):
        names.append("a2a")
    if levels is not None and case_runs_heads(heads, kv_heads, 2):
        names.append("a2a+p2p")
    return [(name, functools.partial(case_handler, group, fmt, name, levels if name == "a2a+p2p" else None))
            for name in names]


def _check(case, seq_len, group, levels, world) -> None:
    """``case`` (``AG_CASES``' form with its format last) through every pattern of :func:`_tiled_handlers` against
    one process's canonical tiles: output, gradients and the forward's log-sum-exp."""
    name, heads, kv_heads, dtype, *_, fmt = case
    want = computed_once(results_with_lse, functools.partial(case_handler, None, fmt, "all_gather"), case, seq_len)
    for pattern, handler in _tiled_handlers(world, heads, kv_heads, group, levels, fmt):
        if (pattern == "auto" and dtype != torch.float32) or (pattern == "a2a" and name.startswith("sinks")):
            continue  # a2a runs sinks with its blockwise plan (other bits, the same at every degree)
        what = f"{name} {pattern} cp {world} {fmt if isinstance(fmt, str) else 'thd'} S {seq_len}"
        assert_equal(results_with_lse(handler, case, seq_len), want, what, lse=True)


def _canonical_worker(rank, world):
    from cp_handler import build_dp_cp_groups

    group = new_cp_group()
    levels = build_dp_cp_groups(world, "cpu", [2, world // 2]) if world % 2 == 0 and world > 2 else None
    for tiles_per_chunk in (1, 3):  # 3: a tree over tiles that reach each rank in runs, not one by one
        seq_len = 2 * world * 64 * tiles_per_chunk  # zigzag chunks of whole canonical tiles (64 tokens here)
        for case in AG_CASES:
            _check((*case, "bshd"), seq_len, group, levels, world)
    for case in AG_CASES:
        if case[0] in SBHD_CASES:
            _check((*case, "sbhd"), 2 * world * 64, group, levels, world)
    for case in THD_CASES:
        _check(case, None, group, levels, world)

    @settings(max_examples=2, derandomize=True, deadline=None,  # every rank draws the same cases
              phases=[Phase.explicit, Phase.generate])
    @given(lengths=st.lists(st.one_of(st.just(0), st.integers(1, 5), st.integers(6, 200)), min_size=1, max_size=4)
           .filter(lambda lengths: sum(lengths) > 0))
    @example(lengths=[300, 7])
    @fails_fast  # a rank's failure ends the run with its message (no replay the other ranks do not make)
    def thd(lengths):
        _check(("thd-gqa-fp32", 8, 4, torch.float32, "causal", None, tuple(lengths)), None, group, levels, world)

    thd()
    # the reference GPT through every pattern, fp32 and bf16: its logits and per-token losses, bitwise one process's
    seq_len = 2 * world * 64
    for dtype in (torch.float32, torch.bfloat16):
        want = computed_once(gpt_outputs, case_handler(None, "bshd", "all_gather"), seq_len, dtype)
        for pattern, handler in _tiled_handlers(world, 8, 8, group, levels):
            if pattern == "auto" and dtype != torch.float32:
                continue
            assert_equal(gpt_outputs(handler(), seq_len, dtype), want, f"GPT {dtype} {pattern} cp {world}",
                         names=GPT_OUTPUTS)
    if world == 2:  # the negative controls: the default all-gather and ring on the same inputs are not cp 1's bits
        case = (*AG_CASES[0], "bshd")
        want = computed_once(results, case_handler(None, "bshd", "all_gather"), case, seq_len)
        for comm_type in ("all_gather", "p2p"):
            got = results(case_handler(group, "bshd", comm_type, deterministic=False), case, seq_len)
            assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), comm_type
    module = torch.nn.Module()  # refused by name: chunks that are not whole tiles, a window
    module.softmax_scale = 0.25
    q = torch.zeros(1, 2 * 13, 8, D)  # 2 x cp x 13 tokens: neither a multiple of 64 nor of 48 at cp 2 to 8
    for comm_type in ("all_gather", "p2p"):
        with pytest.raises(ValueError, match=rf"cp_comm_type='{comm_type}': documents of \[{2 * world * 13}\] tokens; "
                                             r"the mode.s tiles need a sequence of a multiple of 64 tokens"):
            case_handler(group, "bshd", comm_type).core_attn(module, q, q, q, attn_mask_type="causal")
    if world == 2:  # 2 x cp x 96 tokens: a multiple of 64, whose zigzag chunks are not
        q = torch.zeros(1, 2 * 96, 8, D)
        with pytest.raises(ValueError, match=r"a sequence of 384 tokens over 2 ranks has zigzag chunks of 96 tokens; "
                                             r"the mode.s tiles \(64 tokens for this length\) need chunks"):
            case_handler(group, "bshd", "p2p").core_attn(module, q, q, q, attn_mask_type="causal")


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_every_pattern_is_bitwise_the_same_at_every_cp_degree(world):
    """Every pattern on canonical tiles at cp 2, 3, 4, 6 and 8 (the module doc's cases: bshd, sbhd, thd packs, the
    GPT in fp32 and bf16; ``auto`` at cp 2 and 4 in fp32; ``a2a+p2p`` as 2 x cp / 2 at cp 4, 6 and 8): output, dq,
    dk, dv (dsinks) and the forward's log-sum-exp ``torch.equal`` to one process's canonical tiles; the controls and
    refusals."""
    run_distributed(_canonical_worker, world)
