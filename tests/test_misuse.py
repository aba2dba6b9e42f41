"""Misuse of the handler API (issue 25): each case that used to give a silent wrong answer, an abort or an
unclear error now ends as a clear error on every rank, or an exact result.

Cases: a tensor dispatched twice, a combine of a tensor never dispatched, a sequence of 0 tokens, a
reused handler given another length by one rank (every rank raises: dispatch, combine and roll_tensor agree at
every call; a shift that differs by rank too), hierarchical
levels passed in the wrong order,
``softmax_scale = 0.0`` (it ran at ``D ** -0.5``: now refused, as PyTorch's causal kernels give NaN at 0;
another explicit scale is exact against the single process), ``window_size = 8``,
one rank failing its input check while the caller catches the error and goes on (every rank raises the
same error, the next batch is exact, the failed handler refuses further calls). The handler serial of
the agreement check catches ranks whose handlers pair with another batch's.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import new_cp_group, run_distributed

from cp_handler import HierarchicalContextParallelHandler, LocalContextParallelHandler, build_dp_cp_groups
from cp_handler.handlers.agreement import RanksRefused


class Attn:
    softmax_scale = None
    layer_number = 1


def _qkv(seed: int, length: int = 16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, length, 4, 8, generator=g) for _ in range(3))


def _dispatch_combine_worker(rank, world):
    group = new_cp_group()
    x = torch.randn(1, 16, 4)
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    local = h.dispatch(x, 1)
    with pytest.raises(ValueError, match=r"dispatch: a tensor of 8 tokens along dim 1, but this handler dispatched "
                                         r"sequences of 16 tokens: it is a shard already"):
        h.dispatch(local, 1)
    with pytest.raises(ValueError, match=r"combine: .*this handler dispatched nothing, so a tensor \(1, 8, 4\) cannot "
                                         r"be known to be a shard"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").combine(local, 1)  # all ranks, no collective
    with pytest.raises(ValueError, match=r"dispatch: a sequence of 0 tokens along dim 1"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").dispatch(torch.zeros(1, 0, 4), 1)
    with pytest.raises(ValueError, match=r"a local sequence of 0 tokens"):
        empty = torch.zeros(1, 0, 4, 8)
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").core_attn(Attn(), empty, empty, empty)
    reused = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    reused.dispatch(x, 1)
    # rank 1's second batch is longer: every rank raises the named error (dispatch agrees at every call), so rank 0
    # does not go on into its next collective alone (it got gloo's "Connection closed by peer" when only the first
    # dispatch of a handler agreed)
    with pytest.raises(RanksRefused, match=r"dispatch: the inputs of some ranks of the CP group were refused \(rank 1: "
                                           r"ValueError: dispatch: a tensor of 24 tokens along dim 1, but this handler "
                                           r"dispatched sequences of 16 tokens"):
        reused.dispatch(torch.randn(1, 24 if rank == 1 else 16, 4), 1)
    # combine and roll_tensor agree at every call too: a shard of another length on rank 1, a shift that differs by
    # rank (each rank alone would combine or roll, then wait in the all-gather or the ring for a partner)
    with pytest.raises(RanksRefused, match=r"combine: the inputs of some ranks of the CP group were refused \(rank 1: "
                                           r"ValueError"):
        reused.combine(torch.randn(1, 12 if rank == 1 else 8, 4), 1)
    with pytest.raises(RanksRefused, match=r"roll_tensor: the inputs of some ranks of the CP group were refused "
                                           r"\(rank 1: ValueError"):
        reused.roll_tensor(torch.randn(1, 12 if rank == 1 else 8, 4), -1, 1)
    with pytest.raises(RanksRefused, match=r"roll_tensor: the ranks of the CP group disagree on shifts \(rank 0: -1; "
                                           r"rank 1: -2\)"):
        reused.roll_tensor(local, -1 - rank, 1)
    torch.testing.assert_close(reused.combine(local, 1), x, rtol=0, atol=0)  # after the refusals: the handler works


def test_dispatch_and_combine_refuse_what_cannot_be_a_batch_or_a_shard():
    run_distributed(_dispatch_combine_worker, 2)


def _levels_worker(rank, world):
    groups = build_dp_cp_groups(world, "cpu", [2, 2])
    a2a, p2p = groups.hierarchical_cp_groups
    with pytest.raises(ValueError, match=r"expected the a2a level on adjacent ranks \[\d, \d\] first and the p2p "
                                         r"level \[\d, \d\] second \(were the levels passed in the wrong order"):
        HierarchicalContextParallelHandler(cp_group=groups.cp_group, cp_comm_type="a2a+p2p",
                                           hierarchical_cp_groups=[p2p, a2a])


def test_hierarchical_levels_in_the_wrong_order_are_refused():
    run_distributed(_levels_worker, 4)


def _scale_worker(rank, world):
    group = new_cp_group()
    q, k, v = _qkv(0)
    attn = Attn()
    attn.softmax_scale = 0.0  # falsy: it used to run at the default scale
    with pytest.raises(ValueError, match=r"attn_mod.softmax_scale=0.0 must be a finite number > 0"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").core_attn(attn, q[:, :8], k[:, :8], v[:, :8])
    attn.softmax_scale = 0.9  # not the default D ** -0.5 = 0.35
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=0.9)
    for comm in ("p2p", "all_gather", "a2a"):
        h = LocalContextParallelHandler(cp_group=group, cp_comm_type=comm)
        out = h.combine(h.core_attn(attn, *(h.dispatch(t, 1) for t in (q, k, v))), 1)
        torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-6)  # float32, reordered sums
    attn.softmax_scale, attn.window_size = None, 8
    with pytest.raises(TypeError, match=r"attn_mod.window_size=8 must be a \(left, right\) pair of ints"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p").core_attn(attn, q[:, :8], k[:, :8], v[:, :8])


def test_softmax_scale_is_used_as_given_and_bad_options_are_refused():
    run_distributed(_scale_worker, 2)


def _one_rank_fails_worker(rank, world):
    group = new_cp_group()
    q, k, v = _qkv(1)
    bad = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    local = [bad.dispatch(t, 1) for t in (q, k, v)]
    if rank == 1:
        local[0] = local[0].double()  # only this rank's inputs are wrong
    with pytest.raises(RanksRefused, match=r"core_attn \(layer_number 1\): the inputs of some ranks of the CP group "
                                           r"were refused \(rank 1: TypeError: core_attn q, k, v must share one dtype"):
        bad.core_attn(Attn(), *local)  # every rank raises the same error, no rank entered the ring
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")  # the caller goes on to the next batch
    out = h.combine(h.core_attn(Attn(), *(h.dispatch(t, 1) for t in (q, k, v))), 1)
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-6)
    broken = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    with pytest.raises(RanksRefused, match=r"dispatch: the inputs of some ranks of the CP group were refused \(rank 1: "
                                           r"ValueError: seq_len=7 is not divisible"):
        broken.dispatch(torch.zeros(1, 7 if rank == 1 else 8, 4), 1)  # one rank's length: every rank raises
    shard = broken.dispatch(q, 1)  # nothing was sharded: the handler goes on
    with pytest.raises(RanksRefused, match=r"this handler dispatched sequences of"):
        broken.dispatch(shard, 1)  # agreed at every dispatch: every rank raises, the ranks stay in step
    local = [broken.dispatch(t, 1) for t in (q, k, v)]
    broken.core_attn(Attn(), *local)
    with pytest.raises(TypeError, match=r"core_attn q, k, v must share one dtype"):
        broken.core_attn(Attn(), local[0].double(), *local[1:])  # a layer's later call: a local failure
    with pytest.raises(RuntimeError, match=r"an earlier call of this handler failed on this rank \(core_attn"):
        broken.dispatch(q, 1)  # this rank's handler is done


def test_one_rank_failing_is_every_ranks_error_and_the_next_batch_is_exact():
    run_distributed(_one_rank_fails_worker, 2)


def _serial_worker(rank, world):
    group = new_cp_group()
    if rank == 0:
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")  # rank 0 built one more (skipped a batch)
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    with pytest.raises(RanksRefused, match=r"dispatch: the ranks of the CP group disagree on handler serial \(rank 0: "
                                           r"(\d+); rank 1: (?!\1)\d+\); every rank"):
        h.dispatch(next(_qkv(2)), 1)  # the handler's first call
    dist.barrier()


def test_handlers_built_out_of_step_are_refused():
    run_distributed(_serial_worker, 2)


def _variant_worker(rank, world):
    """A window that differs between ranks hung p2p (the halo exchange) and returned an answer of neither
    window with a2a / all_gather; the second layer differs here, so a check of the first call only would miss it."""
    group = new_cp_group()
    q, k, v = _qkv(3, 32)
    for comm in ("p2p", "a2a", "all_gather"):
        h = LocalContextParallelHandler(cp_group=group, cp_comm_type=comm)
        local = [h.dispatch(t, 1) for t in (q, k, v)]
        first, second = Attn(), Attn()
        first.window_size, second.layer_number = (3, 0), 2
        second.window_size = (3, 0) if rank % 2 == 0 else (4, 0)
        h.core_attn(first, *local)
        with pytest.raises(RanksRefused) as caught:
            h.core_attn(second, *local)
        even, odd = ("rank 0", "rank 1") if world == 2 else ("ranks [0, 2]", "ranks [1, 3]")
        window = f"cp_comm_type={comm!r}, attn_mask_type='causal', attn_mod.window_size=(%d, 0) (sliding window), " \
                 f"softmax_scale={8 ** -0.5!r}"  # each distinct value once, with the ranks that hold it; no hash
        assert str(caught.value).startswith(
            f"core_attn (layer_number 2): the ranks of the CP group disagree on variant ({even}: {window % 3}; "
            f"{odd}: {window % 4}); every rank must pass"), str(caught.value)
    scaled = Attn()
    scaled.softmax_scale = 0.5 + rank  # another scale on each rank: another result
    h = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p")
    with pytest.raises(RanksRefused, match=r"disagree on variant \(rank 0: [^;]*, softmax_scale=0.5; rank 1: [^;]*, "
                                           r"softmax_scale=1.5[;)]"):
        h.core_attn(scaled, *(h.dispatch(t, 1) for t in (q, k, v)))
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_an_attention_variant_that_differs_between_ranks_is_every_ranks_error(world):
    run_distributed(_variant_worker, world)


def test_an_unbounded_left_window_without_a_causal_mask_is_refused():
    """``window_size=(-1, 0)`` with ``no_mask`` says "nothing to the right": it ran fully bidirectional (the 0
    was ignored). Transformer Engine refuses it; so do we, naming the causal mask it describes."""
    attn = Attn()
    attn.window_size = (-1, 0)
    q, k, v = _qkv(4, 8)
    with pytest.raises(ValueError, match=r"window_size=\(-1, 0\) with attn_mask_type='no_mask'.*\(-1, 0\) is the "
                                         r"causal mask: pass attn_mask_type='causal'"):
        LocalContextParallelHandler().core_attn(attn, q, k, v, attn_mask_type="no_mask")
    attn.window_size = (-1, -1)
    out = LocalContextParallelHandler().core_attn(attn, q, k, v, attn_mask_type="no_mask")
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-6)
