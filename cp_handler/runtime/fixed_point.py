"""Fixed-point limbs: float pieces put on a grid of ``2**-FRACTION_BITS`` as two int64 limbs, so sums of them are
integer sums (exact, in any order and grouping) and one rounding at the end gives the same float whatever the order:
what the deterministic mode's exact parameter gradients (:mod:`.exact_grads`) add up.

:func:`to_fixed` rounds each element down to the grid (every step exact for float32: ``x * 2**56`` is exact in
float64, its floor too, and the limbs its integer split, so any implementation of these operations gives the same
integers); :func:`fixed_sums` sums a stack of pieces (compiled on the CPU for large pieces: one fused pass);
:func:`from_fixed` rounds a sum back once.
"""

from __future__ import annotations

import functools

import torch

FRACTION_BITS = 56
"""Bits of the fixed-point grid below the unit: a piece is rounded down to a multiple of ``2**-56``."""
LIMB_BITS = 32
"""Bits of the lower limb: up to ``2**31`` lower limbs add without overflowing an int64."""
MAX_PIECE = 2.0**15
"""The largest magnitude a piece may have: with at most ``2**24`` pieces per element the upper limbs' sum stays below
``2**63`` (``2**15 * 2**(56 - 32) * 2**24 = 2**63``)."""


def to_fixed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32 or float64, ``|x| < MAX_PIECE``) on the grid ``2**-FRACTION_BITS``: ``(hi, lo)`` int64 with
    ``x ~= (hi * 2**32 + lo) * 2**-56``, ``0 <= lo < 2**32``, rounded down. A function of each element alone, and
    every step exact for float32 ``x`` (``x * 2**56`` is exact in float64, its floor too, and the limbs are its
    integer split), so any implementation of these operations (a compiled one: :func:`fixed_sums`) gives the same
    integers."""
    scaled = torch.floor(x.double() * 2.0**FRACTION_BITS)
    hi = torch.floor(scaled * 2.0**-LIMB_BITS)
    return hi.long(), (scaled - hi * 2.0**LIMB_BITS).long()


def _fixed_sums(pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hi, lo = to_fixed(pieces)
    return hi.sum(0), lo.sum(0), (~(pieces.abs() < MAX_PIECE)).sum()


COMPILE_MIN_ELEMENTS = 1 << 16
"""Pieces of at least this many elements per call are summed by the compiled :func:`fixed_sums` on the CPU (one fused
pass instead of about ten: 13 -> 1 ms for a 1M-element piece, one thread; compiled once per process, shapes dynamic);
smaller ones eagerly (no compile for a small model)."""


@functools.cache
def _compiled_fixed_sums():
    return torch.compile(_fixed_sums, dynamic=True)


def fixed_sums(pieces: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pieces (N, *row)`` on the fixed-point grid (:func:`to_fixed`), summed over ``N``: ``(hi, lo)`` int64 ``row``,
    and the count of elements out of range (not finite or ``|x| >= MAX_PIECE``), an int64 0-d tensor. On the CPU,
    pieces of :data:`COMPILE_MIN_ELEMENTS` or more go through ``torch.compile`` (Inductor); its integers are the eager
    ones (every step exact; ``tests/test_exact_grads.py`` compares them)."""
    if pieces.device.type == "cpu" and pieces.numel() >= COMPILE_MIN_ELEMENTS:
        return _compiled_fixed_sums()(pieces)
    return _fixed_sums(pieces)


def from_fixed(hi: torch.Tensor, lo: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The value of summed limbs ``(hi, lo)`` (``lo >= 0``, any size) in ``dtype``: the carry moved up first, so
    equal sums give equal bits."""
    carry = lo >> LIMB_BITS
    hi, lo = hi + carry, lo - (carry << LIMB_BITS)
    return (hi.double() * 2.0 ** (LIMB_BITS - FRACTION_BITS) + lo.double() * 2.0**-FRACTION_BITS).to(dtype)
