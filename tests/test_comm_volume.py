"""Communication per pattern: collective counts and bytes sent by one rank for one attention
forward + backward, at cp=4, against the formulas of docs/communication.md (also with a value head dim other
than the q/k one, MLA: K and V each travel with their own width).

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


def expected(pattern: str, cp: int, a2a: int = 1, dv: int = D) -> tuple[dict, int]:
    """(collective counts, bytes sent) for one forward + backward on one rank, values of head dim ``dv``."""
    kv = B * HKV * S_LOCAL * (D + dv)  # K and V elements held locally, each its own width
    q = B * H * S_LOCAL * (D + dv) // 2  # 2q: q and the output (forward), dout and dq (backward)
    if pattern == "p2p":
        return {"send": 3 * (cp - 1), "recv": 3 * (cp - 1)}, (cp - 1) * kv * ELEM * 2 + (cp - 1) * kv * ACC
    if pattern == "all_gather":
        chunks = HKV  # kv_heads_per_chunk=1 in run_pattern
        return ({"all_gather": 2 * chunks, "reduce_scatter": chunks},
                2 * (cp - 1) * kv * ELEM + (cp - 1) * kv * ACC)
    kv_a2a = kv * max(1, a2a // HKV)  # KV heads replicated up to the a2a size
    a2a_bytes = 2 * (a2a - 1) * (2 * q + kv_a2a) * ELEM // a2a  # q, k, v, out forward; dout, dq, dk, dv back
    # 4 all-to-alls: q, k and v packed in one, out (forward); dout, and dq, dk, dv packed in one (backward)
    if pattern == "a2a":
        return {"all_to_all": 4}, a2a_bytes
    p2p = cp // a2a
    ring_bytes = (p2p - 1) * kv_a2a * ELEM * 2 + (p2p - 1) * kv_a2a * ACC
    return {"all_to_all": 4, "send": 3 * (p2p - 1), "recv": 3 * (p2p - 1)}, a2a_bytes + ring_bytes


def _volume_worker(rank, world):
    cases = [("p2p", None, 1), ("all_gather", None, 1), ("a2a", None, world), ("a2a+p2p", [2, 2], 2)]
    for (pattern, sizes, a2a), dv in ((case, dv) for case in cases for dv in (D, DV)):
        groups = build_dp_cp_groups(world, "cpu", sizes)
        torch.manual_seed(rank)
        q = torch.randn(B, H, S_LOCAL, D, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(B, HKV, S_LOCAL, D, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(B, HKV, S_LOCAL, dv, dtype=torch.bfloat16, requires_grad=True)
        with count_comms() as counter:
            out, _ = run_pattern(pattern, q, k, v, groups, causal=True, scale=D**-0.5)
            out.float().sum().backward()
        ops, nbytes = expected(pattern, world, a2a, dv)
        if pattern in ("a2a", "a2a+p2p"):  # run_pattern also brings the lse back: one small a2a
            ops["all_to_all"] += 1
            nbytes += (a2a - 1) * B * H * S_LOCAL * 4 // a2a
        assert dict(counter.ops) == ops, (pattern, dv, dict(counter.ops), ops)
        assert counter.bytes_sent == nbytes, (pattern, dv, counter.bytes_sent, nbytes)


def test_collective_counts_and_bytes_per_pattern():
    run_distributed(_volume_worker, 4)
