"""What the conformance kit runs: the attention variants, the lengths, one case's handler (built as the library
builds one) and its global inputs in the handler's format.

A case is one handler: a comm type, a format, a dtype and a length profile on ``world`` ranks. Every rank draws
the same global inputs from one seed; :mod:`.checks` compares the handler with :mod:`.reference` on them.
"""

from __future__ import annotations

import linecache
import os
import re
import sysconfig
import traceback
from dataclasses import dataclass

import torch

from ..core.masks import AttentionMask
from ..runtime.config import AttentionShape, ContextParallelConfig

REFUSALS = (ValueError, NotImplementedError)
"""The errors a refusal may be (module doc of :mod:`.kit`): raised at a refusal point, on every rank, by a ``raise``
statement (:func:`is_refusal`)."""
_NOT_THE_BACKEND = tuple(os.path.realpath(p) + os.sep for p in (os.path.dirname(torch.__file__),
                                                                 sysconfig.get_paths()["stdlib"]))
_RAISE = re.compile(r"raise\b")


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` is a refusal: a :data:`REFUSALS` error raised by a ``raise`` statement outside torch and
    Python's standard library (the innermost frame of its traceback, read from the source). A ValueError that Python
    raises from a bug (a tuple unpacking, ``int("x")``) or that torch raises from a wrong call is a crash, whatever
    its type; so is one whose source the kit cannot read (code without a file)."""
    if not isinstance(err, REFUSALS):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return False
    frame = frames[-1]
    line = (frame.line or linecache.getline(frame.filename, frame.lineno)).lstrip()
    return bool(_RAISE.match(line)) and not os.path.realpath(frame.filename).startswith(_NOT_THE_BACKEND)
SCALE = 0.3
"""The softmax scale of every attention case (not ``1 / sqrt(D)``: a backend that ignores the module's fails)."""


@dataclass(frozen=True)
class Variant:
    """One attention case: what the attention module carries and the mask it means."""

    name: str
    mask: AttentionMask
    attn_mask_type: str = "causal"
    window_size: tuple[int, int] | None = None
    chunk: int | None = None
    softcap: float | None = None
    sinks: bool = False
    heads: tuple[int, int] = (4, 2)  # (H, Hkv)
    head_dims: tuple[int, int] = (8, 8)  # (D of q / k, Dv)
    q_scale: float = 1.0  # q drawn from N(0, q_scale^2): large logits
    tolerance_factor: float = 1.0  # x the dtype's tolerance (large logits: a rounding scales with the logit)


VARIANTS = {v.name: v for v in (
    Variant("causal", AttentionMask()),
    Variant("no_mask", AttentionMask(causal=False), attn_mask_type="no_mask"),
    Variant("mha", AttentionMask(), heads=(4, 4)),
    Variant("mqa", AttentionMask(), heads=(4, 1)),
    Variant("window", AttentionMask(window=5), window_size=(4, 0)),
    Variant("window_two_sided", AttentionMask(causal=False, window=4, window_right=3), attn_mask_type="no_mask",
            window_size=(3, 3)),
    Variant("chunk", AttentionMask(chunk=6), chunk=6),
    Variant("softcap", AttentionMask(softcap=2.0), softcap=2.0),
    Variant("sinks", AttentionMask(), sinks=True),
    Variant("mla", AttentionMask(), head_dims=(8, 12)),
    Variant("large_logits", AttentionMask(), q_scale=60.0, tolerance_factor=16.0),
)}
"""The attention variants the kit runs by default (``check_handler(variants=...)`` picks among them): causal with
GQA 2:1 (as the others unless named), full, MHA, MQA, a causal window of 5, a two-sided window (3 left, 3 right),
chunks of 6, soft-cap 2, sinks (gpt-oss), MLA (value head dim 12, q / k 8), large logits (q x 60: logits past
100, where ``exp`` overflows float32; a softmax or a log-sum-exp merge without the running maximum gives inf / NaN;
at 16 x the dtype's tolerance: the softmax's sensitivity to a rounding grows with the logits, ~100 here against ~3
in the other variants, and dk carries q's x 60)."""


LENGTHS = ("short", "long")
"""The length profiles (:meth:`Case.lengths`). ``short``: two rows of ``8 * cp`` tokens (bshd / sbhd; zigzag chunks
of 4) or documents of 13, 0, 6 and 21 tokens (thd: uneven, one empty, one shorter than ``2 * cp``). ``long``: two
rows of ``2 * cp * 131`` tokens (262 per rank and row, odd zigzag chunks of 131), or documents of ``260 * cp + 7``,
0, ``6 * cp + 5`` and ``100 * cp + 1`` tokens (several hundred per rank, every zigzag chunk of 3 or more:
``roll_tensor`` runs shifts up to 3 there). Past the planners' tiles at every CP size: a rank's queries and a
step's keys past 64 rows (the query tile), and a whole row or document past 512 keys (the masked kernel's key tile:
524 and 527 tokens at cp 2, which an all-gather's or an all-to-all's attention sees whole; a ring step's keys are
one rank's, 262 at cp 2)."""
LONG_CHUNK = 131
ROLL_SHIFTS = {"short": (-1, 1), "long": (-1, 1, -2, 2, -3, 3)}
"""``roll_tensor``'s shifts per length profile (short: a zigzag chunk of a thd document may hold one token)."""


@dataclass(frozen=True)
class Case:
    """What one handler is built for: its comm type, format, dtype and length profile, on ``world`` ranks."""

    comm_type: str
    qkv_format: str
    dtype: torch.dtype
    world: int
    length: str = "short"

    @property
    def levels(self) -> tuple[int, ...] | None:
        """``"a2a+p2p"``'s hierarchical sizes (a2a inner: ``[2, world / 2]``); ``None`` for the flat patterns."""
        return (2, self.world // 2) if self.comm_type == "a2a+p2p" else None

    @property
    def lengths(self) -> list[int]:
        """The documents: one per batch row (bshd / sbhd, two rows) or packed (thd); :data:`LENGTHS`."""
        w = self.world
        if self.qkv_format == "thd":
            return [13, 0, 6, 21] if self.length == "short" else [260 * w + 7, 0, 6 * w + 5, 100 * w + 1]
        return [8 * w] * 2 if self.length == "short" else [2 * w * LONG_CHUNK] * 2

    @property
    def seq_dim(self) -> int:
        return 1 if self.qkv_format == "bshd" else 0

    @property
    def row_word(self) -> str:
        """What a document is called in failures: a batch row (bshd / sbhd) or a packed document (thd)."""
        return "document" if self.qkv_format == "thd" else "row"

    def to_format(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed ``(T, ...)`` rows -> the handler's global layout (bshd / sbhd: documents are batch rows)."""
        if self.qkv_format == "thd":
            return packed
        rows = packed.view(2, -1, *packed.shape[1:])
        return rows if self.qkv_format == "bshd" else rows.transpose(0, 1).contiguous()

    def from_format(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`to_format`."""
        if self.qkv_format == "thd":
            return t
        rows = t if self.qkv_format == "bshd" else t.transpose(0, 1)
        return rows.reshape(-1, *rows.shape[2:])


def build(handler_cls, case: Case, groups, variant: Variant) -> object:
    """The handler of ``case`` on this rank, as the library builds one (``build_cp_handler``): the class's
    ``check_config`` (its rules before a run starts) and ``from_config`` with the CP groups, the attention shape
    of ``variant`` and, for thd, the batch's ``cu_seqlens``."""
    levels = list(case.levels) if case.levels else None
    config = ContextParallelConfig(context_parallel_size=case.world, cp_comm_type=case.comm_type,
                                   hierarchical_context_parallel_sizes=levels, qkv_format=case.qkv_format)
    (heads, kv_heads), (d, dv) = variant.heads, variant.head_dims
    shape = AttentionShape(heads, kv_heads, d, dv if dv != d else None)
    handler_cls.check_config(config, shape, case.dtype)
    batch = {}
    if case.qkv_format == "thd":
        batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    return handler_cls.from_config(config, cp_group=groups.cp_group,
                                   hierarchical_cp_groups=groups.hierarchical_cp_groups or None, attn_shape=shape,
                                   **batch)


def attn_module(variant: Variant, sinks, layer_number: int | None = None) -> torch.nn.Module:
    """A model's attention module for ``variant``: an ``nn.Module`` (a backend may register children on it, as
    Transformer Engine's does) carrying what ``core_attn`` reads."""
    module = torch.nn.Module()
    for name, value in (("window_size", variant.window_size), ("attention_chunk_size", variant.chunk),
                        ("softcap", variant.softcap), ("sinks", sinks), ("softmax_scale", SCALE),
                        ("layer_number", layer_number)):
        object.__setattr__(module, name, value)  # plain attributes (sinks: the caller's leaf, not a parameter)
    return module
