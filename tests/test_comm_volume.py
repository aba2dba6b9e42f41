"""Communication per pattern: collective counts and bytes sent by one rank for one attention
forward + backward, at cp=4, against the formulas of docs/communication.md (also with a value head dim other
than the q/k one, MLA: K and V each travel with their own width; and with heads the a2a size does not split, which
travel padded: 6 query / 3 KV heads as 8 / 4 at a2a sizes 2 and 4, ``cp_handler.ops.ulysses.a2a_head_plan``).

Counted by cp_handler.ops.collectives.count_comms (every collective of the algorithms goes through
it). Exact integers: a regression in communication (an extra gather, a fp32 tensor where bf16 was
sent, a lost overlap chunking) changes them.
"""

import torch
from attn_reference import run_pattern
from dist_utils import run_distributed

from cp_handler import build_dp_cp_groups
from cp_handler.ops.collectives import count_comms

B, H, HKV, S_LOCAL, D = 2, 8, 2, 16, 32
DV = 48  # multi-head latent attention: values wider than queries and keys
ELEM, ACC = 2, 4  # bf16 inputs, float32 dK/dV accumulators


def expected(pattern: str, cp: int, a2a: int = 1, dv: int = D, heads: tuple[int, int, int, int] = (H, HKV, H, HKV)
             ) -> tuple[dict, int]:
    """(collective counts, bytes sent) for one forward + backward on one rank, values of head dim ``dv``; ``heads``:
    query and KV heads, then the query heads and the KV heads (before replication) the all-to-all moves (padded)."""
    h, hkv, h_a2a, hkv_a2a = heads
    kv = B * hkv * S_LOCAL * (D + dv)  # K and V elements held locally, each its own width
    q = B * h_a2a * S_LOCAL * (D + dv) // 2  # 2q: q and the output (forward), dout and dq (backward)
    if pattern == "p2p":
        return {"send": 3 * (cp - 1), "recv": 3 * (cp - 1)}, (cp - 1) * kv * ELEM * 2 + (cp - 1) * kv * ACC
    if pattern == "all_gather":
        chunks = hkv  # kv_heads_per_chunk=1 in run_pattern
        return ({"all_gather": 2 * chunks, "reduce_scatter": chunks},
                2 * (cp - 1) * kv * ELEM + (cp - 1) * kv * ACC)
    kv_a2a = B * max(hkv_a2a, a2a) * S_LOCAL * (D + dv)  # KV heads (padded) replicated up to the a2a size
    a2a_bytes = 2 * (a2a - 1) * (2 * q + kv_a2a) * ELEM // a2a  # q, k, v, out forward; dout, dq, dk, dv back
    # 4 all-to-alls: q, k and v packed in one, out (forward); dout, and dq, dk, dv packed in one (backward)
    if pattern == "a2a":
        return {"all_to_all": 4}, a2a_bytes
    p2p = cp // a2a
    ring_bytes = (p2p - 1) * kv_a2a * ELEM * 2 + (p2p - 1) * kv_a2a * ACC
    return {"all_to_all": 4, "send": 3 * (p2p - 1), "recv": 3 * (p2p - 1)}, a2a_bytes + ring_bytes


UNEVEN = (6, 3, 8, 4)
"""6 query / 3 KV heads, moved by the a2a as 8 / 4 at a2a size 4 ((Hkv, g) = (3, 2) -> (4, 2)) and at 2 (the same)."""


def _volume_worker(rank, world):
    cases = [("p2p", None, 1, (H, HKV, H, HKV)), ("all_gather", None, 1, (H, HKV, H, HKV)),
             ("a2a", None, world, (H, HKV, H, HKV)), ("a2a+p2p", [2, 2], 2, (H, HKV, H, HKV)),
             ("a2a", None, world, UNEVEN), ("a2a+p2p", [2, 2], 2, UNEVEN)]
    for (pattern, sizes, a2a, heads), dv in ((case, dv) for case in cases for dv in (D, DV)):
        groups = build_dp_cp_groups(world, "cpu", sizes)
        torch.manual_seed(rank)
        q = torch.randn(B, heads[0], S_LOCAL, D, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, heads[1], S_LOCAL, D, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, heads[1], S_LOCAL, dv, dtype=torch.bfloat16, requires_grad=True)
        with count_comms() as counter:
            out, _ = run_pattern(pattern, q, k, v, groups, causal=True, scale=D**-0.5)
            out.float().sum().backward()
        ops, nbytes = expected(pattern, world, a2a, dv, heads)
        if pattern in ("a2a", "a2a+p2p"):  # run_pattern also brings the lse back (padded heads): one small a2a
            ops["all_to_all"] += 1
            nbytes += (a2a - 1) * B * heads[2] * S_LOCAL * 4 // a2a
        where = (pattern, heads, dv, dict(counter.ops), ops, counter.bytes_sent, nbytes)
        assert dict(counter.ops) == ops, where
        assert counter.bytes_sent == nbytes, where


def test_collective_counts_and_bytes_per_pattern():
    run_distributed(_volume_worker, 4)
