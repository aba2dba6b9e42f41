"""Backends for the conformance kit's own tests (tests/test_conformance.py): correct ones written as a backend
author would from docs/backends.md (the example's all-gather + SDPA, a blockwise ring emulation with a
log-sum-exp merge, a backend with its own contiguous layout), and realistic bugs planted one each into them
(``PLANTED``: the class, what it breaks, and the words the kit's failure must name).

Importable by the kit's ranks (they unpickle the classes by module name): the examples folder goes on the path.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from custom_backend import GatherSDPAHandler  # noqa: E402

from cp_handler import ContextParallelHandler, LocalContextParallelHandler  # noqa: E402
from cp_handler.handlers import TokenLayout  # noqa: E402
from cp_handler.handlers.zigzag import ZigzagLayout  # noqa: E402
from cp_handler.ops.collectives import all_gather_summed  # noqa: E402
from cp_handler.ops.seq_gather import all_gather_seq  # noqa: E402
from cp_handler.runtime.rope import apply_rotary  # noqa: E402


# -- a blockwise ring emulation: K/V gathered, one key block per source rank, merged by log-sum-exp ---------------
class BlockwiseRing(GatherSDPAHandler):
    """The example's layout and masks, attention computed per (query tile, source rank's key block) and merged
    with the log-sum-exp rule (as a ring does, one block per step); query tiles of :attr:`tile` rows."""

    tile = 64
    floor = -1e30  # the log-sum-exp of a block no row of the tile sees (finite: the merge stays finite)

    def _tile_rows(self, start: int, stop: int) -> slice:
        return slice(start, stop)

    def _keys_read(self, visible):
        """The (query, key) pairs the kernel reads (all of them: a planted bug reads fewer)."""
        return visible

    def _block(self, scores, v):
        """One key block: its softmax-weighted values and its log-sum-exp (the running maximum inside logsumexp)."""
        block_lse = torch.logsumexp(scores, -1).clamp(min=self.floor)
        return torch.exp(scores - block_lse[..., None]) @ v, block_lse

    def attend(self, call):
        q, k, v, layout = call.q, call.k, call.v, call.layout
        d, heads = k.shape[-1], q.shape[1]
        if self.cp_size > 1:
            kv = all_gather_summed(torch.cat([k, v], dim=-1).movedim(2, 0), self.cp_group)
            k, v = kv.flatten(0, 1).movedim(0, 2)[..., :d], kv.flatten(0, 1).movedim(0, 2)[..., d:]
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        q_doc, q_pos, q_real = self._slots(layout, self.cp_rank)
        keys = [self._slots(layout, r) for r in range(self.cp_size)]
        k_doc, k_pos, k_real = (torch.cat(parts) for parts in zip(*keys, strict=True))
        visible = (q_doc[:, None] == k_doc[None, :]) & k_real[None, :] & q_real[:, None]
        visible = self._keys_read(visible & call.mask.visible(q_pos[:, None], k_pos[None, :]))
        block = k.shape[2] // self.cp_size
        tiles = []
        for start in range(0, q.shape[2], self.tile):
            stop = min(start + self.tile, q.shape[2])
            rows = self._tile_rows(start, stop)
            qt = q[:, :, start:stop].float()
            out = torch.zeros(*qt.shape[:-1], v.shape[-1])
            lse = torch.full(qt.shape[:-1], self.floor)
            for r in range(self.cp_size):
                keys_r = slice(r * block, (r + 1) * block)
                scores = qt @ k[:, :, keys_r].float().transpose(-1, -2) * call.scale
                scores = scores.masked_fill(~visible[rows, keys_r], float("-inf"))
                block_out, block_lse = self._block(scores, v[:, :, keys_r].float())
                new = torch.logaddexp(lse, block_lse)
                out = out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None]
                lse = new
            tiles.append(out)
        return call.restore(torch.cat(tiles, dim=2).to(q.dtype))


# -- a backend with its own contiguous layout (bshd / sbhd: rank r holds the r-th block of every row) -------------
class ContiguousLayout(TokenLayout):
    def dispatch(self, tensor, seq_dim):
        local = tensor.shape[seq_dim] // self.handler.cp_size
        return tensor.narrow(seq_dim, self.handler.cp_rank * local, local)

    def combine(self, tensor, seq_dim):
        return tensor if self.handler.cp_size == 1 else all_gather_seq(tensor, seq_dim, self.handler.cp_group)

    def roll_tensor(self, tensor, shifts, dims):
        # every rank's gradient reaches the rank whose tokens moved: a gather whose backward sums (not combine's)
        full = tensor if self.handler.cp_size == 1 else \
            all_gather_summed(tensor.movedim(dims, 0), self.handler.cp_group).flatten(0, 1).movedim(0, dims)
        full = torch.roll(full, shifts, dims)
        n = full.shape[dims]
        full = full.index_fill(dims % full.dim(), torch.arange(n + shifts, n) if shifts < 0 else torch.arange(shifts),
                               0.0)
        rolled = self.dispatch(full, dims)
        return rolled, rolled.sum()

    def get_rotary_seq_len(self, local_seq_len):
        return local_seq_len * self.handler.cp_size

    def get_emb_on_this_cp_rank(self, emb):
        return self.dispatch(emb, 0)

    def apply_rotary_pos_emb(self, t, freqs):
        return apply_rotary(t, freqs, self.handler.qkv_format)


class Contiguous(ContextParallelHandler):
    """Its own layout; K/V all-gathered, one SDPA call with the variant's mask at global positions; bshd / sbhd
    (thd refused at construction); causal, full, windows and chunks."""

    token_layout_cls = ContiguousLayout
    cp_comm_types = ("all_gather",)

    def __init__(self, **kwargs):
        if kwargs.get("qkv_format") == "thd":
            raise NotImplementedError("Contiguous: packed documents (thd) are not supported")
        super().__init__(**kwargs)

    def unsupported_variant(self, comm_type, mask, sinks):
        return "soft-capping and sinks" if mask.softcap is not None or sinks is not None else None

    def attend(self, call):
        q, k, v = call.q, call.k, call.v
        if self.cp_size > 1:
            k, v = (all_gather_summed(t.movedim(2, 0), self.cp_group).flatten(0, 1).movedim(0, 2) for t in (k, v))
        q_pos = torch.arange(self.cp_rank * q.shape[2], (self.cp_rank + 1) * q.shape[2])
        visible = call.mask.visible(q_pos[:, None], torch.arange(k.shape[2])[None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=call.scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return call.restore(out)


# -- the planted bugs -----------------------------------------------------------------------------------------
class GQATrueDivide(GatherSDPAHandler):
    """``/`` for ``//`` in the GQA repeat: a TypeError for every GQA / MQA case (a crash, not a refusal)."""

    def attend(self, call):
        ratio = call.q.shape[1] / call.k.shape[1]
        k, v = (t.repeat_interleave(ratio, dim=1) if ratio != 1 else t for t in (call.k, call.v))
        return super().attend(dataclasses.replace(call, k=k, v=v))


class RefusesInsideAttend(GatherSDPAHandler):
    """Raises a ValueError for GQA from inside ``attend`` (after its collectives could have run): not a refusal."""

    def attend(self, call):
        if call.q.shape[1] != call.k.shape[1]:
            raise ValueError("GQA is not supported")
        return super().attend(call)


class RefusesEverything(GatherSDPAHandler):
    """Declares every variant unsupported: it passes nothing, so it does not pass."""

    def unsupported_variant(self, comm_type, mask, sinks):
        return "nothing is supported yet"


class CheckCallUnpacksMQA(GatherSDPAHandler):
    """Its ``check_call`` unpacks the key and value heads of MQA with a bug: one KV head unbinds to one tensor, and
    Python raises ``ValueError: not enough values to unpack`` (a crash, not a refusal: no ``raise`` of the backend)."""

    def check_call(self, call):
        if call.k.shape[1] == 1:  # MQA (k is (B, Hkv, S, D)): the one key head is checked against the value's
            key, value = call.k.unbind(1)
        return super().check_call(call)


class RefusesOnOneRank(GatherSDPAHandler):
    """Its constructor refuses on the CP group's rank 0 only (a rule that reads a per-rank value): the other ranks go
    on; the kit must fail the case by name, not fall out of step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if torch.distributed.get_rank(self.cp_group) == 0:
            raise ValueError("this rank's memory is too small for the case")


class UpcastOutput(GatherSDPAHandler):
    """Computes in float32 and returns float32 for bf16 / fp16 inputs."""

    def attend(self, call):
        return super().attend(dataclasses.replace(call, q=call.q.float(), k=call.k.float(), v=call.v.float()))


class TileOffByOne(BlockwiseRing):
    """Query tiles past the first 64 rows read the mask one row off (right at 24 and 64 tokens, wrong at 200)."""

    def _tile_rows(self, start, stop):
        return slice(start - 1, stop - 1) if start else slice(start, stop)


class OneKeyTile(BlockwiseRing):
    """Reads the first 512 keys of the gathered sequence only (a kernel whose key loop assumed one tile of 512): right
    while a row holds 512 tokens or fewer (404 at cp 2 with the kit's former long rows), wrong past them."""

    def _keys_read(self, visible):
        visible = visible.clone()
        visible[:, 512:] = False
        return visible


class MergeWithoutEmptyBlocks(BlockwiseRing):
    """The log-sum-exp merge of a block no query row sees (lse -inf on both sides) gives NaN."""

    floor = float("-inf")


class SoftmaxWithoutMaximum(BlockwiseRing):
    """Each block's softmax as ``exp(scores) / sum`` without subtracting the maximum: right while the logits stay
    under ~88, inf / NaN past (float32's ``exp`` overflows)."""

    def _block(self, scores, v):
        weights = torch.exp(scores)
        total = weights.sum(-1)
        return (weights / total.clamp(min=1e-30)[..., None]) @ v, torch.log(total).clamp(min=self.floor)


class NaNAtPadding(BlockwiseRing):
    """Its output starts as NaN (as an uninitialised buffer) and only the real rows are written: thd's padding
    slots hold NaN."""

    def attend(self, call):
        out = super().attend(call)
        if self.qkv_format != "thd":
            return out
        real = self._slots(call.layout, self.cp_rank)[2].view(-1, 1, 1)
        return torch.where(real, out, torch.full_like(out, float("nan")))


class CachesKV(GatherSDPAHandler):
    """Keeps the first call's gathered K/V on the handler and reuses it (a second call attends to stale keys)."""

    def attend(self, call):
        cached = getattr(self, "_kv", None)
        if cached is None or cached[0].shape != call.k.shape:
            self._kv = (call.k.detach(), call.v.detach())
            return super().attend(call)
        return super().attend(dataclasses.replace(call, k=cached[0], v=cached[1]))


class IgnoresScale(GatherSDPAHandler):
    """Uses ``1 / sqrt(D)`` instead of the module's softmax scale."""

    def attend(self, call):
        return super().attend(dataclasses.replace(call, scale=call.q.shape[-1] ** -0.5))


class SeesPaddingKeys(GatherSDPAHandler):
    """Forgets that thd documents are padded: padding keys (zeros, after each document's last token) take part in
    the softmax (seen by full attention; a causal mask hides them)."""

    def _slots(self, layout, rank):
        doc, pos, _ = super()._slots(layout, rank)
        return doc, pos, torch.ones_like(doc, dtype=torch.bool)


class _SummingCombineLayout(ZigzagLayout):
    def combine(self, tensor, seq_dim):
        if self.cp_size == 1:
            return tensor
        layout = self.layout(tensor.shape[seq_dim])
        gathered = all_gather_summed(tensor.movedim(seq_dim, 0), self.cp_group).flatten(0, 1).movedim(0, seq_dim)
        return gathered.index_select(seq_dim, layout.gathered_index(real_only=True))


class CombineSumsGradients(GatherSDPAHandler):
    """``combine`` on an all-gather whose backward sums the ranks' gradients: cp x the gradient."""

    token_layout_cls = _SummingCombineLayout


class RollOnlyByOne(GatherSDPAHandler):
    """``roll_tensor`` right for shifts of 1 only (rolls by the sign of any larger shift)."""

    def roll_tensor(self, tensor, shifts=-1, dims=-1):
        return super().roll_tensor(tensor, max(-1, min(1, shifts)), dims)


class RollSumOfInput(GatherSDPAHandler):
    """``roll_tensor`` returns the input's sum instead of the rolled tensor's."""

    def roll_tensor(self, tensor, shifts=-1, dims=-1):
        rolled, _ = super().roll_tensor(tensor, shifts, dims)
        return rolled, tensor.sum()


class EmbAtLocalPositions(GatherSDPAHandler):
    """``get_emb_on_this_cp_rank`` takes the first local-length rows (local positions, not global ones)."""

    def get_emb_on_this_cp_rank(self, emb):
        return emb[: super().get_emb_on_this_cp_rank(emb).shape[0]]


class RotaryWrongWay(GatherSDPAHandler):
    """``apply_rotary_pos_emb`` rotates by the negated angles."""

    def apply_rotary_pos_emb(self, t, freqs):
        return super().apply_rotary_pos_emb(t, -freqs)


class ContiguousShortTable(Contiguous):
    """Its own layout asks for a rotary table of the local length only."""

    def get_rotary_seq_len(self, local_seq_len):
        return local_seq_len


class LocalIgnoringWindows(LocalContextParallelHandler):
    """Drops the sliding window (attends to every earlier key)."""

    def attend(self, call):
        return super().attend(dataclasses.replace(call, mask=dataclasses.replace(call.mask, window=None,
                                                                                 window_right=None)))


class LocalWithoutAgreement(LocalContextParallelHandler):
    """Never compares the ranks' calls."""

    def __init__(self, **kwargs):
        super().__init__(check_ranks=False, **kwargs)


class LocalRollWithoutHalo(LocalContextParallelHandler):
    """Rolls each rank's shard alone (the token that crosses a rank boundary is lost)."""

    def roll_tensor(self, tensor, shifts=-1, dims=-1):
        rolled = torch.roll(tensor, shifts, dims)
        return rolled, rolled.sum()


PLANTED = {  # class: (what the kit must name in a failure, the kit's arguments that reach the bug quickly)
    GQATrueDivide: ("TypeError", dict(variants=["causal"], checks=["attention"])),
    CheckCallUnpacksMQA: ("ValueError that no raise statement of the backend raised",
                          dict(variants=["mqa"], checks=["attention"])),
    RefusesOnOneRank: ("some ranks refused the case and others built or ran it",
                       dict(variants=["causal"], checks=["attention"])),
    RefusesInsideAttend: ("inside the backend's attend", dict(variants=["causal"], checks=["attention"])),
    RefusesEverything: ("no causal attention case passed", dict(checks=["attention"], variants=["causal", "mha"])),
    UpcastOutput: ("dtype torch.float32, expected torch.bfloat16",
                   dict(dtypes=[torch.bfloat16], variants=["causal"], checks=["attention"])),
    TileOffByOne: ("core_attn output: wrong", dict(variants=["causal"], checks=["attention"])),
    OneKeyTile: ("core_attn output: wrong", dict(formats=["bshd"], variants=["causal"], checks=["attention"])),
    MergeWithoutEmptyBlocks: ("core_attn output: wrong", dict(variants=["causal"], checks=["attention"])),
    SoftmaxWithoutMaximum: ("core_attn output: wrong", dict(variants=["large_logits"], checks=["attention"])),
    NaNAtPadding: ("inf or NaN at", dict(formats=["thd"], variants=["causal"], checks=["attention"])),
    CachesKV: ("a second call on the same handler", dict(variants=["causal"], checks=["attention"])),
    IgnoresScale: ("core_attn output: wrong", dict(variants=["causal"], checks=["attention"])),
    SeesPaddingKeys: ("core_attn output: wrong", dict(formats=["thd"], variants=["no_mask"], checks=["attention"])),
    CombineSumsGradients: ("combine backward", dict(checks=["layout"])),
    RollOnlyByOne: ("roll_tensor(shifts=-2)", dict(checks=["roll"])),
    RollSumOfInput: ("returned sum", dict(checks=["roll"])),
    EmbAtLocalPositions: ("get_emb_on_this_cp_rank", dict(checks=["rope"])),
    RotaryWrongWay: ("apply_rotary_pos_emb", dict(checks=["rope"])),
    ContiguousShortTable: ("get_rotary_seq_len", dict(formats=["bshd"], checks=["rope"])),
    LocalIgnoringWindows: ("core_attn output: wrong", dict(comm_types=["p2p"], variants=["window_two_sided"],
                                                           checks=["attention"])),
    LocalWithoutAgreement: ("ran without a refusal", dict(comm_types=["all_gather"], checks=["disagreement"])),
    LocalRollWithoutHalo: ("roll_tensor(shifts=-1)", dict(comm_types=["p2p"], checks=["roll"])),
}
"""Each planted bug: the words its failure must contain, and narrowing arguments for the test (cases the kit's defaults
run too, so the same bug fails the defaults)."""
CULPRITS = {  # class: (words every failure line names: the rank, the place, the method; words no line may name)
    TileOffByOne: (("rank 0: core_attn output: wrong", "row 0 positions 64-130", "heads 0-3 of 4",
                    "rank 0: core_attn dq", "rank 0: core_attn dk", "rank 0: core_attn dv",
                    "rank 1: core_attn output: wrong"), ()),
    EmbAtLocalPositions: (("rank 1: get_emb_on_this_cp_rank (rows at the local tokens' positions): wrong",
                           "get_emb_on_this_cp_rank backward (the table's gradient)"), ("apply_rotary_pos_emb",)),
    RotaryWrongWay: (("apply_rotary_pos_emb",), ("get_emb_on_this_cp_rank",)),
}
"""Where the failure points for some planted bugs (tests/test_conformance.py): the rank, the token positions and heads
of a wrong tensor, every wrong tensor of a call listed, and the culprit method alone (a wrong rotary table is not
blamed on ``apply_rotary_pos_emb``, nor the reverse)."""
