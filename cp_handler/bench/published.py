"""Published GPU results that compare context-parallel patterns or degrees: the table ``cp-bench --modes
backtest`` feeds to the cost model (:mod:`.backtest`).

A :class:`PublishedGroup` holds rows that share everything but the pattern, the CP degree or the sequence (so
each pair of rows gives a published ratio to compare with the model's); each names its source (repository, file
or thread, commit) and how its numbers were read: ``read`` (the source text itself), ``read-img`` (transcribed
from the source's benchmark image), ``excerpt`` (a search excerpt of the thread). Only attention-only benchmarks
whose shapes are stated (or read from the benchmark's own script) enter; whole-model and diffusion-pipeline
results, TPU results and rows whose GPU or shape is not stated are listed in docs/performance.md as not used.

Patterns are this library's names: ``p2p`` (a load-balanced zigzag ring), ``all_gather`` (K/V all-gathered;
Llama 3's CP splits the pack in contiguous slices: ``contiguous``), ``a2a`` (Ulysses), ``a2a+p2p`` (Ulysses
inside, the ring across; ``levels`` = (Ulysses degree, ring degree), as USP's ``ulysses_degree x
ring_degree``). ``cp`` 1 is one GPU attending its whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRow:
    """One measured configuration: ``cp`` GPUs running ``pattern`` (``levels`` for ``a2a+p2p``) over ``packs``
    (each a tuple of document lengths in tokens, global; a benchmark cycling through several packs: their mean
    time), ``value`` in the group's ``metric``."""

    pattern: str
    cp: int
    packs: tuple[tuple[int, ...], ...]
    value: float
    levels: tuple[int, int] | None = None
    contiguous: bool = False
    """The ranks hold contiguous slices of the pack instead of zigzag chunks (Llama 3's all-gather CP as
    ring-flash-attention's ``llama3_flash_attn_varlen_func`` runs it: causal work not balanced)."""


@dataclass(frozen=True)
class PublishedGroup:
    """Rows that differ only in pattern, degree or sequence (module doc).

    Attributes:
        key: a short name. source: the URL. where: file and commit (or thread). tag: ``read``, ``read-img``,
        ``excerpt``. profile: the named cost profile of the hardware. heads, kv_heads, head_dim: the attention;
        batch: sequences per call; causal; backward: forward + backward (else forward only); metric: ``iter/s``
        (higher is better) or ``ms`` (lower is better); note: what the rows mean.
    """

    key: str
    source: str
    where: str
    tag: str
    profile: str
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    causal: bool
    backward: bool
    metric: str
    rows: tuple[PublishedRow, ...]
    note: str = ""


RING_FLASH = "https://github.com/zhuzilin/ring-flash-attention"
RING_FLASH_WHERE = ("README.md 'Performance Summary' (HEAD 8996282; numbers from commits 556ddaa, 1342b84, "
                    "2024-10-30); shapes from benchmark/benchmark_kvpacked_func.py and "
                    "benchmark_varlen_kvpacked_func.py at those commits")
RING_FLASH_NOTE = ("8 GPUs of one NVLink node, bf16, causal, Llama-3-8B attention (32 / 8 heads of 128), 8,192 "
                   "tokens per GPU (65,536 in all); cp 1 is flash_attn on one GPU's 8,192 tokens (the README's "
                   "'theoretic' column is it / 8); varlen cycles through 4 packs per rank, x 8 globally")
ONE = ((8192,),)
WHOLE = ((65536,),)
VARLEN_ONE = ((8192,), (256, 7392, 544), (4096, 4096), (3104, 3200, 1600, 160, 128))
VARLEN = tuple(tuple(8 * n for n in pack) for pack in VARLEN_ONE)


def _ring_flash(gpu: str, profile: str, backward: bool, values: tuple[float, float, float], varlen: bool):
    """One row of the README's table: flash_attn on one GPU, zigzag ring and (varlen) Llama 3's all-gather."""
    whole, zigzag, other = values
    rows = [PublishedRow("p2p", 1, VARLEN_ONE if varlen else ONE, whole),
            PublishedRow("p2p", 8, VARLEN if varlen else WHOLE, zigzag)]
    if varlen:
        rows.append(PublishedRow("all_gather", 8, VARLEN, other, contiguous=True))
    api, passes = ("varlen" if varlen else "batch"), ("fwd+bwd" if backward else "fwd")
    return PublishedGroup(f"ring-flash-attn {gpu} {api} {passes}", RING_FLASH, RING_FLASH_WHERE, "read", profile,
                          32, 8, 128, 1, True, backward, "iter/s", tuple(rows), RING_FLASH_NOTE)


USP = "https://github.com/feifeibear/long-context-attention"
USP_WHERE = ("media/benchmark_results.png (commit b93c30e, 2024-04-18, 'update comprehensive benchmark results "
             "(#48)'), zigzag ring, no_packed column; shapes from scripts/run_qkvpack_compare.sh and "
             "benchmark/benchmark_longctx.py at that commit")
USP_NOTE = ("8 x A100-SXM4-80GB NVLink, bf16, causal, forward only, batch 2, Ulysses degree x ring degree = 8; "
            "the length is global (the script's local --seq_len x 8, inferred from the script)")
U_LEVELS = {8: ("a2a", None), 4: ("a2a+p2p", (4, 2)), 2: ("a2a+p2p", (2, 4)), 1: ("p2p", None)}


def _usp(seq: int, heads: int, kv_heads: int, head_dim: int, by_ulysses: dict[int, float]) -> PublishedGroup:
    rows = tuple(PublishedRow(U_LEVELS[u][0], 8, ((seq,),), value, U_LEVELS[u][1]) for u, value in by_ulysses.items())
    return PublishedGroup(f"USP A100 {seq // 1024}K H{heads}/{kv_heads} D{head_dim}", USP, USP_WHERE, "read-img",
                          "a100-nvlink", heads, kv_heads, head_dim, 2, True, False, "iter/s", rows, USP_NOTE)


USP_TRAIN_NOTE = ("8 x A100 NVLink, bf16, causal, forward + backward (and forward alone), batch 2, "
                  "ring degree x Ulysses degree = 8, 8,192 tokens per GPU (4,096 for the GQA chart)")


def _usp_train(key: str, where: str, seq: int, heads: int, kv_heads: int, backward: bool,
               by_ulysses: dict[int, float]) -> PublishedGroup:
    rows = tuple(PublishedRow(U_LEVELS[u][0], 8, ((seq,),), value, U_LEVELS[u][1]) for u, value in by_ulysses.items())
    tag = "read" if where.startswith("README") else "read-img"
    return PublishedGroup(f"USP A100 {key} {'fwd+bwd' if backward else 'fwd'}", USP, where, tag, "a100-nvlink",
                          heads, kv_heads, 128, 2, True, backward, "iter/s", rows, USP_TRAIN_NOTE)


K128 = 131072
GROUPS: tuple[PublishedGroup, ...] = (
    _ring_flash("8xH800", "h800-nvlink", False, (591.5, 63.0, 0.0), False),
    _ring_flash("8xH800", "h800-nvlink", True, (154.7, 17.4, 0.0), False),
    _ring_flash("8xA100", "a100-nvlink", False, (373.4, 38.2, 0.0), False),
    _ring_flash("8xA100", "a100-nvlink", True, (94.7, 10.6, 0.0), False),
    _ring_flash("8xH800", "h800-nvlink", False, (852.4, 74.8, 60.8), True),
    _ring_flash("8xH800", "h800-nvlink", True, (225.4, 21.4, 16.4), True),
    _ring_flash("8xA100", "a100-nvlink", False, (532.3, 47.9, 34.3), True),
    _ring_flash("8xA100", "a100-nvlink", True, (133.8, 13.4, 9.7), True),
    _usp(32768, 32, 32, 32, {8: 76.908, 4: 81.58, 2: 76.818, 1: 46.605}),
    _usp(K128, 32, 32, 32, {8: 15.829, 4: 15.699, 2: 15.244, 1: 12.445}),
    _usp(K128, 8, 8, 32, {8: 57.9, 4: 57.362, 2: 57.404, 1: 50.126}),
    _usp(K128, 64, 8, 32, {8: 8.37, 4: 8.054, 2: 8.038, 1: 7.819}),
    _usp(K128, 4, 4, 32, {4: 97.969, 2: 96.333, 1: 94.25}),
    _usp(K128, 2, 2, 32, {2: 159.078, 1: 151.82}),
    _usp(K128, 8, 8, 128, {8: 21.002, 4: 21.464, 2: 21.201, 1: 17.778}),
    _usp_train("64K H8/8 D128", "README.md at 8aaf163 (2024-04-01), zigzag row, ring_degree x ulysses_degree",
               65536, 8, 8, True, {1: 8.211, 2: 11.024, 4: 12.864, 8: 10.679}),
    _usp_train("64K H2/2 D128", "media/long_ctx_h2.png (2024-03-29), longctx. zigzag_ring bars", 65536, 2, 2, True,
               {1: 32.095, 2: 38.337}),
    _usp_train("64K H2/2 D128", "media/long_ctx_h2.png (2024-03-29), longctx. zigzag_ring bars", 65536, 2, 2, False,
               {1: 113.71, 2: 149.973}),
    _usp_train("32K H64/8 D128", "media/gqa.png (commit 80c8b46, 2024-04-11), long-zigzag(u) bars", 32768, 64, 8, True,
               {1: 9.64, 2: 10.638, 4: 11.299, 8: 11.428}),
    _usp_train("32K H64/8 D128", "media/gqa.png (commit 80c8b46, 2024-04-11), long-zigzag(u) bars", 32768, 64, 8,
               False, {1: 34.063, 2: 39.275, 4: 41.053, 8: 40.436}),
)
"""The published groups (module doc; sources and what was left out: docs/performance.md)."""
