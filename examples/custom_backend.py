"""A complete third-party backend in one file: K/V all-gathered, one SDPA call per layer, the mask from the layout.

The handler subclasses ``ContextParallelHandler``, whose composed parts give it the token layout (dispatch,
combine, roll_tensor, RoPE: the default zigzag split, thd documents padded per document), the call guard and the
pre-flight of every ``core_attn`` (checks, cross-rank agreement, the attention variant as an ``AttentionMask``), and
the comm type as data on the instance. It writes the attention step only:
gather every rank's K/V (``all_gather_summed``: its backward reduce-scatters the K/V gradients back to their
ranks), build the boolean mask of each local query against every gathered key from the
layout (same document, the variant's causal / window / chunk rule, real tokens only) and run
``F.scaled_dot_product_attention`` once. It declares what it does not run by refusing it by name: comm types other
than ``all_gather``, soft-capping and sinks (SDPA takes neither). Memory: the whole sequence's K/V and a
``(S_local, S)`` mask per rank; a sketch of the contract, not a fast path.

Run it (CPU, under 30 s on 2 cores): ``python examples/custom_backend.py``: it registers the backend, builds a
handler from a config and runs the conformance kit (cp_handler.testing) at cp 2 and 4 with its defaults (float32,
bfloat16, float16; short and long sequences); exit status 1 if it does not pass. The same from a shell:
``python -m cp_handler.testing examples/custom_backend.py:GatherSDPAHandler``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from cp_handler import ContextParallelConfig, ContextParallelHandler, get_cp_handler_cls, register_cp_handler
from cp_handler.ops.collectives import all_gather_summed
from cp_handler.testing import check_handler


class GatherSDPAHandler(ContextParallelHandler):
    """KV all-gather + one SDPA call (``cp_comm_type="all_gather"``), every format of the zigzag layout."""

    cp_comm_types = ("all_gather",)  # the comm types it runs: a handler built with another is refused by name

    def unsupported_variant(self, comm_type, mask, sinks):
        if mask.softcap is not None or sinks is not None:
            return "soft-capping and sinks: F.scaled_dot_product_attention takes neither"
        return None  # causal, full, windows (one- and two-sided) and chunks are masks

    def _slots(self, layout, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per local slot of ``rank``: document id, position in it, whether it holds a real token."""
        per_doc = torch.tensor(layout.padded_lengths) // layout.size
        doc = torch.repeat_interleave(torch.arange(layout.num_docs), per_doc)
        return doc, layout.positions(rank), layout.real_mask(rank)

    def attend(self, call):
        q, k, v, layout = call.q, call.k, call.v, call.layout  # (B, H, S_local, D); layout: ZigzagDocs
        if self.cp_size > 1:  # K and V in one gather; torch.distributed.nn.functional.all_gather (deprecated in
            d = k.shape[-1]  # torch 2.13) gave wrong dK / dV on gloo here: the kit's attention cases caught it
            kv = all_gather_summed(torch.cat([k, v], dim=-1).movedim(2, 0), self.cp_group)  # (cp, S_local, ...)
            kv = kv.flatten(0, 1).movedim(0, 2)  # (B, Hkv, S, D + Dv), the ranks' rows one after another
            k, v = kv[..., :d], kv[..., d:]
        q_doc, q_pos, q_real = self._slots(layout, self.cp_rank)
        keys = [self._slots(layout, r) for r in range(self.cp_size)]  # the gathered keys, rank after rank
        k_doc, k_pos, k_real = (torch.cat(parts) for parts in zip(*keys, strict=True))
        visible = (q_doc[:, None] == k_doc[None, :]) & k_real[None, :] & q_real[:, None]
        visible &= call.mask.visible(q_pos[:, None], k_pos[None, :])
        visible = visible.to(q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=call.scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return call.restore(torch.where(visible.any(-1)[:, None], out, 0.0))  # rows that see no key: zero


register_cp_handler("gather_sdpa", GatherSDPAHandler)  # for its cp_comm_types


def main() -> int:
    config = ContextParallelConfig(backend="gather_sdpa", cp_comm_type="all_gather")
    cls = get_cp_handler_cls(config.backend, config.cp_comm_type)  # selected by config, as any backend
    assert cls is GatherSDPAHandler, cls
    report = check_handler(GatherSDPAHandler, world_sizes=(2, 4))  # the comm types it declares
    print(report.table())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
