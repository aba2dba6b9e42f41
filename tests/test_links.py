"""``cp-bench --modes links``: the emulated-link shim holds each collective back without changing what it computes,
charges the bytes count_comms counts, and the model's exposure follows the pricing rule of ``predict``.

Exactness: every pattern's output and gradients with the shim on equal the same code's without it (the shim only
delays completions). No wall-clock bound is asserted: a held collective returns no sooner than its deadline, a
lower bound the shim guarantees by waiting for it.
"""

import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import new_cp_group, run_distributed

from cp_handler import ContextParallelConfig
from cp_handler.auto import AttnCase, CostProfile, GroupProfile, LinkFit, pattern_work, predict
from cp_handler.auto.profile import ComputeFit
from cp_handler.bench.links import EmulatedLinks, LinkCase, predicted_exposed_ms
from cp_handler.core.masks import CAUSAL
from cp_handler.handlers import build_cp_handler
from cp_handler.ops.collectives import count_comms


class _Layer(torch.nn.Module):
    layer_number = 1


def _shim_worker(rank, world):
    group = new_cp_group()
    for comm_type in ("p2p", "all_gather", "a2a"):
        handler = build_cp_handler(ContextParallelConfig(context_parallel_size=world, cp_comm_type=comm_type),
                                   group)
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (handler.dispatch(torch.randn(1, 64, h, 8, generator=g), 1) for h in (4, 2, 2, 4))
        results = []
        for emulate in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            links = EmulatedLinks(1e-4, 0.5)
            with count_comms() as counter:
                if emulate:
                    with links:
                        out = handler.core_attn(_Layer(), *leaves)
                        out.backward(dout)
                else:
                    out = handler.core_attn(_Layer(), *leaves)
                    out.backward(dout)
            results.append([out.detach(), *(t.grad for t in leaves)])
            if emulate:
                assert sum(nbytes for _, nbytes, _ in links.transfers) == counter.bytes_sent, comm_type
                assert {kind for kind, _, _ in links.transfers} <= {"p2p", "all_gather", "reduce_scatter",
                                                                      "all_to_all"}
        for plain, emulated in zip(*results, strict=True):
            assert torch.equal(plain, emulated), comm_type
    links = EmulatedLinks(0.05, 1e6)
    with links:
        buffer = torch.zeros(2 * 4)
        work = dist.all_gather_into_tensor(buffer, torch.ones(4), group=group, async_op=True)
        waited_from = time.perf_counter()
        work.wait()
        assert time.perf_counter() >= links.busy_until  # held until its deadline (a lower bound, no upper one)
        assert links.stalled_s >= links.busy_until - waited_from  # the blocked time counted, all of it


def test_emulated_links_change_no_result_and_charge_the_counted_bytes():
    run_distributed(_shim_worker, 2)


def test_the_emulator_restores_torch_distributed():
    saved = dist.batch_isend_irecv
    with EmulatedLinks(0.0, 1.0):
        assert dist.batch_isend_irecv is not saved
    assert dist.batch_isend_irecv is saved


def test_the_ring_s_transfers_run_under_the_slots_of_its_schedule():
    """The ring's schedule (ops/ring.py): forward, step s + 1's K/V under step s; backward, step 1's K/V under the
    head of the local step, step s + 1's K/V and step s - 1's partial under step s, the last partial under the tail.
    predict with overlap 1 hides each slot's transfers up to its compute; an all-to-all hides under nothing."""
    compute = ComputeFit((1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    links = {k: LinkFit(0.0, 0.05) for k in ("p2p", "all_gather", "reduce_scatter", "all_to_all")}
    profile = CostProfile("toy", "test", "cpu", 1.0, {2: GroupProfile({"bfloat16": compute}, links)})
    case = AttnCase((256,), 1, 4, 4, 16, 16, 2, CAUSAL, 2)  # bf16: the fp32 partials are twice the K/V
    work = pattern_work("p2p", case)
    kv, partial = (links["p2p"].ms(n) for n in sorted({t.nbytes for t in work.transfers}))
    slots = {(t.backward, t.nbytes == work.transfers[0].nbytes): work.slots[t.slot] for t in work.transfers}
    forward, head, tail = slots[False, True], slots[True, True], slots[True, False]
    assert not forward.backward and head.backward and tail.backward
    assert tail.share > 0 and head.share > tail.share  # the tail: the second chunk's diagonal only
    total = sum(compute.ms(step) for step in work.steps)
    hidden = min(kv, forward.share * total) + min(kv, head.share * total) + min(partial, tail.share * total)
    plain = CostProfile("toy0", "test", "cpu", 0.0, profile.groups)
    assert predict("p2p", case, plain, "bfloat16").total_ms - predict("p2p", case, profile, "bfloat16").total_ms == \
        pytest.approx(hidden)
    assert all(t.slot is None for t in pattern_work("a2a", case).transfers)
    gather = pattern_work("all_gather", AttnCase((4096,), 1, 8, 8, 64, 64, 4, CAUSAL, 2))  # 2 chunks (>= 4 MiB)
    exposed = [(t.kind, t.backward) for t in gather.transfers if t.slot is None]
    assert exposed == [("all_gather", False), ("all_gather", True), ("reduce_scatter", True)]


def test_predicted_exposure_of_a_measured_row():
    """predicted_exposed_ms: an a2a's transfer is exposed in full; a long compute hides the ring's."""
    row = {"pattern": "a2a", "cp": 2, "tokens": 256, "heads": 4, "kv_heads": 4, "head_dim": 16, "pass": "forward",
           "gbps": 1.0, "compute_ms": 1e6}
    transfer, exposed = predicted_exposed_ms(row)
    assert transfer > 0 and exposed == pytest.approx(transfer)  # the a2a's all-to-alls: nothing hides them
    row.update(pattern="p2p")
    assert predicted_exposed_ms(row)[1] == pytest.approx(0.0)  # a long compute hides the ring's step
    assert LinkCase("p2p", 2, 256, 4, 4, 16).attn_case(backward=False).backward is False
