"""How the conformance kit compares a handler's tensor with the reference and says where it is wrong.

A rank compares its own local tensors (what ``dispatch`` gave it, what its ``core_attn`` returned) with the
reference at the same tokens, so a failure names the rank, the method, the tokens (document or batch row and
positions) and the heads where the error is. Which global token sits in which local slot is asked of the handler
itself (:class:`TokenMap`: ``dispatch`` of the token indices); that the placement is a partition of the tokens is
the layout check's business.

Tolerances: ``|got - want| <= tol * max(1, max |want|) + tol * |want|`` per element, ``tol`` per dtype
(:data:`TOLERANCES`: float64 1e-10; float32 2e-5, the merge order of blockwise softmax; float16 5e-3 and bfloat16
2.5e-2, Transformer Engine's context-parallel attention tests, tests/pytorch/attention/test_attention_with_cp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCES = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2.5e-2}
"""Per dtype: the relative and absolute tolerance of every comparison (module doc)."""
MAX_RANGES = 4


@dataclass(frozen=True)
class TokenMap:
    """Which global token each local slot of one rank holds.

    Attributes:
        ids: int64, the token dims of a local tensor (bshd ``(B, S_local)``, sbhd ``(S_local, B)``, thd
            ``(T_local,)``, or whatever a backend's own layout gives): the packed index of the global token in
            the slot, ``-1`` where the layout holds padding.
        lengths: the documents (bshd / sbhd: the batch rows) the packed indices run over.
        row_word: ``"row"`` or ``"document"`` (how failures name a document).
    """

    ids: torch.Tensor
    lengths: list[int]
    row_word: str

    @property
    def real(self) -> torch.Tensor:
        return self.ids >= 0

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with the token dims flattened: ``(N, rest)`` (rest at least one dim)."""
        n = self.ids.numel()
        return t.reshape(n, -1) if t.numel() else t.reshape(n, 0)

    def describe(self, ids: torch.Tensor) -> str:
        """Packed token indices as ``row 1 positions 3-9, 20`` (at most :data:`MAX_RANGES` ranges)."""
        starts = torch.tensor([0, *self.lengths]).cumsum(0)
        ranges: list[tuple[int, int, int]] = []  # (document, first position, last position)
        for i in sorted(set(ids.tolist())):
            doc = int(torch.searchsorted(starts, i, right=True)) - 1
            pos = i - int(starts[doc])
            if ranges and ranges[-1][0] == doc and ranges[-1][2] == pos - 1:
                ranges[-1] = (doc, ranges[-1][1], pos)
            else:
                ranges.append((doc, pos, pos))
        text = [(f"{self.row_word} {d} " if len(self.lengths) > 1 else "") + f"position{'s' if a != b else ''} {a}"
                + (f"-{b}" if a != b else "") for d, a, b in ranges[:MAX_RANGES]]
        more = f" (+{len(ranges) - MAX_RANGES} more ranges)" if len(ranges) > MAX_RANGES else ""
        return ", ".join(text) + more


def _spans(values: list[int]) -> str:
    spans: list[list[int]] = []
    for v in values:
        if spans and spans[-1][1] == v - 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


def mismatch(what: str, got: torch.Tensor, want: torch.Tensor, tokens: TokenMap, dtype: torch.dtype,
             heads: bool = False, unit: str = "tokens", factor: float = 1.0) -> str | None:
    """``None`` when ``got`` (a local tensor of this rank) equals ``want`` (the reference at the same slots, float64)
    at every real token within the tolerance of ``dtype``; else what is wrong: the shape, or how many tokens are
    wrong, which (:meth:`TokenMap.describe`), which heads (``heads``: the dim after the token dims is the head
    dim; ``unit``: what the rows are) and the largest error against the tolerance."""
    if got.shape != want.shape:
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = tokens.flat(got.detach().double().cpu()), tokens.flat(want.detach().double().cpu())
    real = tokens.real.reshape(-1)
    if g.shape[1] == 0:
        return None
    padding = (~torch.isfinite(g)).any(1) & ~real
    tol = TOLERANCES.get(dtype, 2.5e-2) * factor
    scale = max(1.0, w[real].abs().max().item()) if real.any() else 1.0
    bad = ((g - w).abs() > tol * scale + tol * w.abs()) | ~torch.isfinite(g)
    bad &= real[:, None]
    if not bad.any():
        if padding.any():  # a slot that holds no token: any finite value, never inf / NaN (they reach every sum)
            return f"{what}: inf or NaN at {int(padding.sum())} padding slots (slots of this rank that hold no " \
                   "token: any finite value is right there, inf / NaN poisons every sum over the sequence)"
        return None
    err = (g - w).abs().nan_to_num(float("inf"))[bad].max().item()
    wrong = bad.any(1)
    where = tokens.describe(tokens.ids.reshape(-1)[wrong])
    text = f"{what}: wrong at {int(wrong.sum())} of {int(real.sum())} {unit} ({where})"
    if heads:
        per_head = bad.view(bad.shape[0], got.shape[tokens.ids.dim()], -1).any(-1).any(0)
        text += f", heads {_spans(per_head.nonzero().flatten().tolist())} of {per_head.numel()}"
    return text + f"; max error {err:.3g} > {tol * scale:.3g}"


def tensor_rule(what: str, got, like: torch.Tensor, shape: tuple[int, ...] | None = None) -> str | None:
    """The contract's rule for a returned tensor: a tensor of ``like``'s dtype and device (and ``shape``)."""
    if not isinstance(got, torch.Tensor):
        return f"{what}: returned {type(got).__name__}, expected a tensor"
    if got.dtype != like.dtype:
        return f"{what}: dtype {got.dtype}, expected {like.dtype} (the input's: a backend computes in any precision " \
               "and returns the input's dtype)"
    if got.device != like.device:
        return f"{what}: device {got.device}, expected {like.device} (the input's)"
    if shape is not None and tuple(got.shape) != tuple(shape):
        return f"{what}: shape {tuple(got.shape)}, expected {tuple(shape)}"
    return None
