"""The conformance checks, run inside each rank: every public method of the handler contract, forward and backward,
against the single-process reference (:mod:`.reference`) on the same global inputs (every rank draws them from one
seed). Each check returns the list of what is wrong on this rank (empty: it passed), every wrong tensor named by
the method that produced it (:mod:`.compare`), or raises :class:`Refused` when the handler refused the call at a
refusal point.

The methods and what is checked:

* ``dispatch``: the tokens of every rank together are each global token once; the values in each slot are the
  token's; dtype and device kept; backward: the gradient in the global layout (summed over the group).
* ``combine``: ``combine(dispatch(x)) == x``; backward: each rank keeps its own tokens' slice of the gradient (the
  combined tensor feeds the same computation on every rank: no sum over the group).
* ``roll_tensor``: values in global order within each document, zero where the source leaves it, for shifts of
  1 (and 2 and 3 at long lengths) both ways; the returned sum is the local ``rolled.sum()``; backward.
* ``get_rotary_seq_len``: enough rows for every position; ``get_emb_on_this_cp_rank``: the table's rows at each
  local token's position (thd: inside its document), and the table's gradient; ``apply_rotary_pos_emb``: RoPE with
  the reference's rows at the local positions, and its gradient (each method alone: a failure names the culprit).
* ``core_attn``: output (dtype, shape, device, values) and the gradients of q, k, v (and the sinks), twice on the
  same handler with other inputs (a handler caching what it should recompute fails the second call; the second
  call's inputs and exact reference come from the first's: :func:`_second_call`).
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from ..handlers.agreement import RanksRefused
from ..runtime.rope import rotary_freqs
from . import reference
from .cases import REFUSALS, ROLL_SHIFTS, SCALE, VARIANTS, Case, Variant, attn_module, is_refusal
from .compare import TokenMap, mismatch, tensor_rule


class Refused(Exception):  # noqa: N818 - what happened, not an error of the kit
    """The handler refused the case at a refusal point (before its ``attend`` ran): ``reason`` is its error (this
    rank's own, not the agreement's :class:`~cp_handler.handlers.agreement.RanksRefused` that carries it)."""

    def __init__(self, reason: Exception):
        super().__init__(f"{type(reason).__name__}: {reason}")


def _own_error(err: Exception) -> Exception:
    """The error this rank raised itself: the agreement re-raises every rank's refusal on every rank as
    ``RanksRefused`` from the rank's own error (``None`` on a rank that passed: another rank refused)."""
    return err.__cause__ if isinstance(err, RanksRefused) and err.__cause__ is not None else err


def token_map(h, case: Case) -> TokenMap:
    """Where this rank's handler put each global token (its own ``dispatch`` of the token indices, float64)."""
    total = sum(case.lengths)
    ids = h.dispatch(case.to_format(torch.arange(1, total + 1, dtype=torch.float64)), case.seq_dim)
    return TokenMap(ids.round().long() - 1, case.lengths, case.row_word)


def at_slots(tokens: TokenMap, packed: torch.Tensor) -> torch.Tensor:
    """The reference ``packed (T, ...)`` at this rank's slots (zero at padding), shaped like a local tensor."""
    index = tokens.ids.clamp(min=0)
    out = packed[index.reshape(-1)].reshape(*index.shape, *packed.shape[1:])
    return out * tokens.real.reshape(*index.shape, *[1] * (packed.dim() - 1)).to(out.dtype)


def _group_sum(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def check_layout(h, case: Case, group) -> list[str]:
    """``dispatch`` and ``combine``, forward and backward (module doc)."""
    torch.manual_seed(1)
    total, failures = sum(case.lengths), []
    x, w = torch.randn(total, 3, 5, dtype=torch.float64), torch.randn(total, 3, 5, dtype=torch.float64)
    g = case.to_format(x).to(case.dtype).requires_grad_()
    local = h.dispatch(g, case.seq_dim)
    err = tensor_rule("dispatch", local, g)
    if any_rank(err is not None, group):  # a local verdict: every rank stops together (the rest communicates)
        return [err] if err else []
    tokens = token_map(h, case)
    held = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, tokens.ids[tokens.real].tolist(), group=group)
    count = torch.bincount(torch.tensor(sum(held, []), dtype=torch.int64), minlength=total)[:total]
    if (count != 1).any():
        lost, twice = (count == 0).nonzero().flatten(), (count > 1).nonzero().flatten()
        return ["dispatch: the ranks' tokens are not the sequence once: " +
                (f"on no rank: {tokens.describe(lost)}" if lost.numel() else "") +
                ("; " if lost.numel() and twice.numel() else "") +
                (f"on several: {tokens.describe(twice)}" if twice.numel() else "")]
    rounded = case.from_format(g.detach()).double()
    if err := mismatch("dispatch", local, at_slots(tokens, rounded), tokens, case.dtype):
        failures.append(err)
    combined = h.combine(local.detach(), case.seq_dim)
    everything = TokenMap(case.to_format(torch.arange(total)), case.lengths, case.row_word)
    if err := tensor_rule("combine", combined, g) or mismatch("combine(dispatch(x))", combined, g, everything,
                                                              torch.float64):
        failures.append(err)
    leaf = local.detach().requires_grad_()
    wf = case.to_format(w).to(case.dtype)
    (h.combine(leaf, case.seq_dim) * wf).sum().backward()
    if err := mismatch("combine backward (each rank keeps its own tokens' gradient, no sum over the group)",
                       leaf.grad, at_slots(tokens, case.from_format(wf).double()), tokens, case.dtype):
        failures.append(err)
    (local * h.dispatch(wf, case.seq_dim)).sum().backward()
    if err := mismatch("dispatch backward (summed over the group)", _group_sum(g.grad, group), wf.double(),
                       everything, case.dtype):
        failures.append(err)
    return failures


def check_roll(h, case: Case, group) -> list[str]:
    """``roll_tensor`` by each shift of :data:`~.cases.ROLL_SHIFTS`: values, the returned sum, the gradient."""
    torch.manual_seed(2)
    tokens, failures = None, []
    for shift in ROLL_SHIFTS[case.length]:
        x = torch.randn(sum(case.lengths), 3, dtype=torch.float64, requires_grad=True)
        w = torch.randn_like(x)
        xr = x.detach().to(case.dtype).double().requires_grad_()
        want = reference.roll(xr, shift, case.lengths)
        (want * w.to(case.dtype).double()).sum().backward()
        local = h.dispatch(case.to_format(xr.detach()).to(case.dtype), case.seq_dim).detach().requires_grad_()
        tokens = tokens or token_map(h, case)
        rolled, total = h.roll_tensor(local, shifts=shift, dims=case.seq_dim)
        what = f"roll_tensor(shifts={shift})"
        err = tensor_rule(what, rolled, local, tuple(local.shape))
        if any_rank(err is not None, group):
            failures += [err] if err else []
            continue
        if err := mismatch(what, rolled, at_slots(tokens, want.detach()), tokens, case.dtype):
            failures.append(err)
        if err := mismatch(f"{what}'s returned sum (the local rolled.sum())", torch.as_tensor(total).reshape(1, 1),
                           rolled.detach().double().sum().reshape(1, 1), TokenMap(torch.zeros(1, dtype=torch.long),
                                                                                  [1], "sum"), case.dtype):
            failures.append(err)
        (rolled * h.dispatch(case.to_format(w).to(case.dtype), case.seq_dim)).sum().backward()
        if err := mismatch(f"{what} backward", local.grad, at_slots(tokens, xr.grad), tokens, case.dtype):
            failures.append(err)
    return failures


def _along_seq(case: Case, t: torch.Tensor) -> torch.Tensor:
    """A token-dims tensor reduced to the sequence dim (bshd / sbhd: the first batch row; rows share positions)."""
    return t if t.dim() == 1 else t.select(1 - case.seq_dim, 0)


def check_rope(h, case: Case, group) -> list[str]:
    """``get_rotary_seq_len``, ``get_emb_on_this_cp_rank`` and ``apply_rotary_pos_emb``, each alone (module doc)."""
    torch.manual_seed(3)
    failures, total = [], sum(case.lengths)
    positions = reference.positions(case.lengths)
    x = torch.randn(total, 2, 8, dtype=torch.float64)
    local_x = h.dispatch(case.to_format(x).to(case.dtype), case.seq_dim).detach().requires_grad_()
    tokens = token_map(h, case)
    local_pos = at_slots(tokens, positions)
    need = int(positions.max()) + 1 if total else 1
    rows = h.get_rotary_seq_len(local_x.shape[case.seq_dim])
    short = not isinstance(rows, int) or isinstance(rows, bool) or rows < need
    if any_rank(short, group):
        return [] if not short else [f"get_rotary_seq_len({local_x.shape[case.seq_dim]}) = {rows!r}: the batch has "
                                     f"positions up to {need - 1}, so the table needs at least {need} rows"]
    seq_pos, seq_real = _along_seq(case, local_pos), _along_seq(case, tokens.real)
    mixed = tokens.ids.dim() == 2 and not torch.equal(local_pos * tokens.real, seq_pos.unsqueeze(1 - case.seq_dim)
                                                      .expand_as(local_pos) * tokens.real)
    if any_rank(mixed, group):
        return [] if not mixed else ["dispatch: the batch rows' tokens of one local slot sit at different positions "
                                     f"({case.qkv_format})"]
    seq_tokens = TokenMap(torch.where(seq_real, seq_pos, -1), [rows], "table row")
    table = torch.randn(rows, 4, dtype=torch.float64, requires_grad=True)
    emb = h.get_emb_on_this_cp_rank(table)
    err = tensor_rule("get_emb_on_this_cp_rank", emb, table, (seq_pos.numel(), 4))
    if any_rank(err is not None, group):
        return [err] if err else []
    if err := mismatch("get_emb_on_this_cp_rank (rows at the local tokens' positions)", emb,
                       table.detach()[seq_pos], seq_tokens, torch.float64, unit="local rows"):
        failures.append(err)
    grad = torch.randn(seq_pos.numel(), 4, dtype=torch.float64) * seq_real[:, None]
    (emb * grad).sum().backward()
    want = torch.zeros(rows, 4, dtype=torch.float64).index_add_(0, seq_pos, grad)
    if err := mismatch("get_emb_on_this_cp_rank backward (the table's gradient)", table.grad, want,
                       TokenMap(torch.arange(rows), [rows], "table row"), torch.float64, unit="table rows"):
        failures.append(err)
    freqs = rotary_freqs(rows, 8)
    xr = x.to(case.dtype).double().requires_grad_()
    want = reference.rope(xr, freqs.double(), case.lengths)
    w = torch.randn_like(x).to(case.dtype)
    (want * w.double()).sum().backward()
    got = h.apply_rotary_pos_emb(local_x, freqs[seq_pos])
    err = tensor_rule("apply_rotary_pos_emb", got, local_x, tuple(local_x.shape))
    if any_rank(err is not None, group):
        return failures + ([err] if err else [])
    if err := mismatch("apply_rotary_pos_emb (given the reference's rows)", got, at_slots(tokens, want.detach()),
                       tokens, case.dtype, heads=True):
        failures.append(err)
    (got * h.dispatch(case.to_format(w), case.seq_dim)).sum().backward()
    if err := mismatch("apply_rotary_pos_emb backward", local_x.grad, at_slots(tokens, xr.grad), tokens, case.dtype,
                       heads=True):
        failures.append(err)
    return failures


class Crashed(Exception):  # noqa: N818 - what happened
    """``core_attn`` raised something other than a refusal (the message says what, where and why it counts as a
    failure)."""


CONTRACT = ("dispatch", "combine", "roll_tensor", "get_rotary_seq_len", "get_emb_on_this_cp_rank",
            "apply_rotary_pos_emb", "core_attn")


def error_text(err: BaseException) -> str:
    """``Type: first line of the message (in METHOD, file:line)``: the contract method the kit called (the outermost
    frame of that name) and the innermost frame."""
    tb = traceback.extract_tb(err.__traceback__)
    method = next((f.name for f in tb if f.name in CONTRACT), None)
    where = ", ".join(([f"in {method}"] if method else []) +
                      ([f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}"] if tb else []))
    message = (str(err).splitlines() or [""])[0][:300]
    return f"{type(err).__name__}: {message}" + (f" ({where})" if where else "")


def not_a_refusal(err: BaseException) -> str:
    """Why an error raised at a refusal point is not a refusal (:func:`~.cases.is_refusal`), as a parenthesis."""
    if not isinstance(err, REFUSALS):
        return " (a refusal is a ValueError or NotImplementedError)"
    return (f" (a {type(err).__name__} that no raise statement of the backend raised: Python or torch raised it from "
            "a bug)")


def _attend_once(h, module, local, attn_mask_type: str, first: bool):
    """``core_attn``, telling a refusal (a ValueError / NotImplementedError raised before the backend's ``attend``
    ran, at the first call: :class:`Refused`) from a crash (anything else: :class:`Crashed`)."""
    entered = []
    attend = h.attend
    h.attend = lambda call: (entered.append(True), attend(call))[1]
    try:
        return h.core_attn(module, *local, attn_mask_type=attn_mask_type)
    except Exception as err:
        own = _own_error(err)
        if is_refusal(own) and not entered:
            if first:
                raise Refused(own) from err
            raise Crashed(f"core_attn refused a second call on the same handler after running the first: "
                          f"{error_text(own)}") from err
        where = "inside the backend's attend" if entered else "in the pre-flight, before attend"
        raise Crashed(f"core_attn raised {error_text(own)} {where}: a crash, not a refusal"
                      f"{'' if entered else not_a_refusal(own)}") from err
    finally:
        del h.attend


_REFERENCES: dict = {}
"""One rank's inputs and float64 references per (variant, dtype, document lengths, group size): every comm type and
every format with the same documents (bshd and sbhd) compares with the same reference, computed once. The handler
never holds these tensors (:func:`_dispatch_together` hands it a copy), so none can alter them."""


def check_attention(h, case: Case, variant: Variant, group) -> list[str]:
    """``core_attn``'s output and the gradients of q, k, v (and the sinks) against the float64 reference, for two
    calls on the same handler with different inputs (the inputs and references of a case computed once per rank:
    :data:`_REFERENCES`; the second call's from the first's: :func:`_second_call`)."""
    failures, tokens = [], None
    (heads, kv_heads), (d, dv) = variant.heads, variant.head_dims
    total = sum(case.lengths)
    key = (variant, case.dtype, tuple(case.lengths), dist.get_world_size(group))
    if key not in _REFERENCES:  # the shared reference's collective before any handler call
        torch.manual_seed(4)
        q = torch.randn(total, heads, d, dtype=torch.float64) * variant.q_scale
        k = torch.randn(total, kv_heads, d, dtype=torch.float64)
        v = torch.randn(total, kv_heads, dv, dtype=torch.float64)
        dout = torch.randn(total, heads, dv, dtype=torch.float64).to(case.dtype)
        rounded = [t.to(case.dtype).double() for t in (q, k, v)]
        sinks = torch.randn(heads, dtype=torch.float64).to(case.dtype) if variant.sinks else None
        _REFERENCES[key] = (rounded, dout, sinks, _shared_reference(rounded, dout, sinks, variant, case.lengths, group))
    inputs = [_REFERENCES[key], _second_call(*_REFERENCES[key])]
    for call, (rounded, dout, sinks, (want, ref_grads, ref_dsinks)) in enumerate(inputs, start=1):
        local = [t.requires_grad_() for t in _dispatch_together(h, case, [*rounded, dout])]
        local_dout = local.pop().detach()
        tokens = tokens or token_map(h, case)
        local_sinks = sinks.clone().requires_grad_() if sinks is not None else None
        out = _attend_once(h, attn_module(variant, local_sinks), local, variant.attn_mask_type, first=call == 1)
        named = "core_attn" + (" (a second call on the same handler, other inputs)" if call == 2 else "")
        err = tensor_rule(f"{named} output", out, local[0], (*local[0].shape[:-1], dv))
        if any_rank(err is not None, group):  # every rank stops here together (its backward may communicate)
            return failures + [err] if err else failures
        out.backward(local_dout)
        for name, got, ref in (("output", out, want), *zip(("dq", "dk", "dv"), (t.grad for t in local),
                                                              ref_grads, strict=True)):
            if got is None:
                failures.append(f"{named} {name}: no gradient reached the input")
            elif err := mismatch(f"{named} {name}", got, at_slots(tokens, ref), tokens, case.dtype,
                                 heads=True, factor=variant.tolerance_factor):
                failures.append(err)
        if sinks is not None:
            got = _group_sum(local_sinks.grad, group) if local_sinks.grad is not None else None
            if got is None:
                failures.append(f"{named} dsinks: no gradient reached the sinks")
            elif err := mismatch(f"{named} dsinks (summed over the group)", got.reshape(1, -1),
                                 ref_dsinks.reshape(1, -1), TokenMap(torch.zeros(1, dtype=torch.long), [1],
                                                                         "sinks"), case.dtype):
                failures.append(err)
        if any_rank(bool(failures), group):  # the ranks go on to the second call together or not at all
            break
    return failures


def _second_call(rounded, dout, sinks, reference):
    """The second call's inputs and exact reference from the first's: the query heads (and dout, the sinks) rolled by
    one GQA group, the key / value heads by one, the values negated. Each query head still meets its own KV head,
    the probabilities are the first call's rolled, so the reference is the first's rolled with the output, dq, dk
    and dsinks negated (dv is not: it is the probabilities times dout); rolling and negating are exact in every
    dtype. A handler that reuses anything of the first call (K / V, the probabilities, the log-sum-exp of a head)
    gets a wrong output."""
    (q, k, v), (want, (dq, dk, dv), dsinks) = rounded, reference
    group_size = q.shape[1] // k.shape[1]

    def rolled(t, by, sign=1):
        return None if t is None else sign * torch.roll(t, by, dims=-1 if t.dim() == 1 else 1)

    return ([rolled(q, group_size), rolled(k, 1), rolled(v, 1, -1)], rolled(dout, group_size),
            rolled(sinks, group_size),
            (rolled(want, group_size, -1), (rolled(dq, group_size, -1), rolled(dk, 1, -1), rolled(dv, 1)),
             rolled(dsinks, group_size, -1)))


def any_rank(flag: bool, group) -> bool:
    """Whether ``flag`` holds on any rank (every rank gets the same answer: the ranks stay in step)."""
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, group=group)
    return bool(t.item())


def _shared_reference(rounded, dout, sinks, variant: Variant, lengths: list[int], group):
    """The float64 reference output and gradients ``(out, (dq, dk, dv), dsinks)`` of one call, the work shared over
    the group: the units (a document and one query head) are independent; each goes to the least loaded rank
    (longest first, cost ~ length squared, the same plan on every rank) and a sum over the group assembles them.
    Every rank ends with the whole reference."""
    q, k, v = rounded
    heads, kv_heads = q.shape[1], k.shape[1]
    group_size = heads // kv_heads
    out = q.new_zeros(q.shape[0], heads, v.shape[-1])
    grads = [torch.zeros_like(t) for t in rounded]
    dsinks = torch.zeros(heads, dtype=torch.float64)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    units = sorted(((start, n, head) for start, n in zip(starts, lengths, strict=True) if n for head in range(heads)),
                   key=lambda u: -u[1])
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    load = [0] * world
    for start, n, head in units:
        owner = load.index(min(load))
        load[owner] += n * n
        if owner != rank:
            continue
        rows, kv = slice(start, start + n), head // group_size
        cols = (slice(head, head + 1), slice(kv, kv + 1), slice(kv, kv + 1))
        leaves = [t[rows, c].clone().requires_grad_() for t, c in zip(rounded, cols, strict=True)]
        unit_sinks = sinks[head:head + 1].double().requires_grad_() if sinks is not None else None
        got = reference.attention(*leaves, variant.mask, SCALE, unit_sinks, [n])
        got.backward(dout[rows, head:head + 1].double())
        out[rows, head:head + 1] = got.detach()
        for grad, leaf, c in zip(grads, leaves, cols, strict=True):
            grad[rows, c] += leaf.grad
        if unit_sinks is not None:
            dsinks[head:head + 1] += unit_sinks.grad
    parts = (out, *grads, dsinks)
    summed = torch.cat([t.reshape(-1) for t in parts])
    dist.all_reduce(summed, group=group)
    out, dq, dk, dv, dsinks = (piece.view_as(t) for piece, t in zip(summed.split([t.numel() for t in parts]), parts,
                                                                    strict=True))
    return out, (dq, dk, dv), dsinks


def _dispatch_together(h, case: Case, packed: list[torch.Tensor]) -> list[torch.Tensor]:
    """``packed (T, heads, dim)`` tensors dispatched in one call (as ``(T, 1, sum of heads x dim)``, in the case's
    dtype) and split again: one dispatch (and one rank agreement) where there would be one per tensor."""
    widths = [t.shape[1] * t.shape[2] for t in packed]
    joined = torch.cat([t.reshape(t.shape[0], 1, -1) for t in packed], dim=-1)
    local = h.dispatch(case.to_format(joined).to(case.dtype), case.seq_dim).detach()
    return [piece.reshape(*piece.shape[:-2], t.shape[1], t.shape[2]).contiguous()
            for piece, t in zip(local.split(widths, dim=-1), packed, strict=True)]


def expect_refusal(h, case: Case, disagree: bool) -> list[str]:
    """A call the contract refuses, by name, before the backend's ``attend`` runs, on every rank
    (:func:`~.kit._agree` checks every rank did): ``disagree``: rank 0 passes a window of 4 and the others 5;
    else q has 4 heads and k / v 3."""
    variant = VARIANTS["window" if disagree else "causal"]
    if disagree and dist.get_rank() == 0:
        variant = Variant("window", variant.mask, window_size=(3, 0))
    heads = variant.heads if disagree else (4, 3)
    shape = {"bshd": (2, 8 * case.world), "sbhd": (8 * case.world, 2), "thd": (sum(case.lengths),)}[case.qkv_format]
    q, k, v = (torch.randn(*shape, n, 8, dtype=case.dtype) for n in (heads[0], heads[1], heads[1]))
    local = [h.dispatch(t, case.seq_dim) for t in (q, k, v)]
    try:
        _attend_once(h, attn_module(variant, None), local, "causal", first=True)
    except Refused:
        return []
    return ["ranks passing different windows ran without a refusal" if disagree else
            "q with 4 heads and k / v with 3 ran without a refusal"]
