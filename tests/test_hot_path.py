"""The hot path of a ``core_attn`` call stays short: from the model's attention call to the kernel call.

Traced with ``sys.setprofile`` on 2 gloo ranks, the forward of the reference GPT's attention with the local
handler's ``p2p`` ring: at the kernel's call, the Python frames strictly between the model's
``SelfAttention.forward`` and the kernel's function are counted. Before the one pre-flight (issue 40) they
were 10 (the guard wrapper, the handler, a registry lambda, ``ring_attn`` and its checks, ``attention_function``,
``Function.apply``, the autograd forward, the ring step, ``blocks_forward_``, ``block_attn_forward`` with its
checks and work counter); the bound is 7. Also: the kernel is chosen once per call (not per ring step), and
the work counter costs nothing when no one counts; and a training forward of a 2-layer GPT at cp 2 enters at most
:data:`PYTHON_CALLS_PER_FORWARD` Python functions of cp_handler (issue 52, part 3).
"""

import sys

import pytest
import torch
from dist_utils import new_cp_group, run_distributed

from cp_handler.handlers.local import LocalContextParallelHandler
from cp_handler.models.gpt import GPTConfig, SelfAttention
from cp_handler.ops import spec as spec_module
from cp_handler.ops.kernels import cpu_flash, work

MAX_FRAMES = 7


def frames_between(outer_code, inner_code, run) -> list[list[str]]:
    """For every call of ``inner_code`` while ``run()`` runs: the functions of the frames between it and the
    nearest frame of ``outer_code`` (innermost first)."""
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is inner_code:
            names, caller = [], frame.f_back
            while caller is not None and caller.f_code is not outer_code:
                names.append(caller.f_code.co_qualname)
                caller = caller.f_back
            if caller is not None:
                seen.append(names)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return seen


def _trace_worker(rank, world):
    torch.manual_seed(0)
    config = GPTConfig(hidden_size=32, num_layers=1, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64)
    attn = SelfAttention(config, layer_number=1)
    handler = LocalContextParallelHandler(cp_group=new_cp_group(), cp_comm_type="p2p")
    x = handler.dispatch(torch.randn(1, 32, 32), 1)
    freqs = handler.get_emb_on_this_cp_rank(torch.zeros(32, 8))
    selections = []
    original = spec_module.KernelChoice.select
    spec_module.KernelChoice.select = lambda self, *args: selections.append(1) or original(self, *args)
    try:
        stacks = frames_between(SelfAttention.forward.__code__, cpu_flash.forward.__code__,
                                lambda: attn(x, freqs, handler))
    finally:
        spec_module.KernelChoice.select = original
    assert len(stacks) >= world, stacks  # one kernel call per ring step at least
    assert max(len(s) for s in stacks) <= MAX_FRAMES, stacks[0]
    assert len(selections) == 1  # the kernel chosen once for the call, not once per ring step (2 steps here)


def test_a_ring_core_attn_reaches_the_kernel_within_7_frames_and_chooses_it_once():
    run_distributed(_trace_worker, 2)


def test_the_work_counter_is_not_read_per_kernel_call():
    """Without a ``count_attn_work`` block, a plan's forward never records (the check is one bool per plan)."""
    calls = []
    original = work.record_attn_pairs
    work.record_attn_pairs = lambda *args: calls.append(args)
    try:
        from cp_handler.ops import blocks

        blocks.record_attn_pairs, saved = work.record_attn_pairs, blocks.record_attn_pairs
        handler = LocalContextParallelHandler(attn_kernel="cpu_flash")
        q = torch.randn(1, 16, 2, 8)
        handler.core_attn(SelfAttentionStub(), q, q, q)
        assert not calls
        with work.count_attn_work() as counted:
            blocks.record_attn_pairs = original
            handler.core_attn(SelfAttentionStub(), q, q, q)
        assert counted.pairs == 2 * 16 * 17 // 2  # heads x the causal triangle with its diagonal
    finally:
        work.record_attn_pairs = original
        blocks.record_attn_pairs = saved


class SelfAttentionStub:
    softmax_scale = None
    layer_number = 1


PYTHON_CALLS_PER_FORWARD = {"p2p": 91, "a2a": 97, "all_gather": 87}
"""The ceilings of :func:`test_python_calls_per_forward` (issue 52's target: 100, 40 per attention layer; measured
2026-11-28: 278 / 390 before the pre-flight cache and the hot-loop work, 100 / 114 after, 90 / 96 after the a2a
all-to-all, the resolved call's views and the local handler's output inline; 91 / 97 with the model protocol's
``hidden`` a method of its own, issue 70). all_gather: 164 on 2026-12-01, 113 after its gathered index and head
chunks were memoised and the collectives' counting skipped when nothing counts, 87 with one gather below
``PIPELINE_MIN_BYTES`` (issue 72: each further KV-head chunk of a pipelined gather costs about 12 calls; at this
size the two chunks' overlap saved nothing)."""


def _python_calls_worker(rank, world, comm_type):
    from cp_handler.bench.compiled import python_calls
    from cp_handler.models import GPTModel

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64, kv_channels=8)
    model = GPTModel(config)
    handler = LocalContextParallelHandler(cp_group=new_cp_group(), cp_comm_type=comm_type)
    tokens = handler.dispatch(torch.randint(0, 64, (1, 256), generator=torch.Generator().manual_seed(0)), 1)
    model(tokens, cp_handler=handler)  # the first forward resolves and agrees once per layer
    calls = sum(python_calls(lambda: model(tokens, cp_handler=handler)).values())
    assert calls <= PYTHON_CALLS_PER_FORWARD[comm_type], \
        f"{comm_type}: {calls} cp_handler Python calls per forward (ceiling {PYTHON_CALLS_PER_FORWARD[comm_type]})"


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "all_gather"])
def test_python_calls_per_forward(comm_type):
    """A training forward of a 2-layer reference GPT at 256 tokens, cp 2, steady state (the handler's second
    forward): the Python functions of cp_handler entered (``sys.setprofile``, as ``cp-bench --modes compile``
    counts them), the model's own code included, stay under :data:`PYTHON_CALLS_PER_FORWARD`."""
    run_distributed(_python_calls_worker, 2, comm_type)


def test_all_gather_pipelines_its_kv_heads_only_above_the_threshold():
    """Two KV-head chunks (one per head when fewer than 2 heads per chunk) from ``PIPELINE_MIN_BYTES`` of gathered
    K/V, one gather below it; an explicit ``kv_heads_per_chunk`` is kept at any size."""
    from cp_handler.ops.all_gather import PIPELINE_MIN_BYTES, kv_head_chunks

    assert kv_head_chunks(8, None, PIPELINE_MIN_BYTES - 1) == (slice(0, 8),)
    assert kv_head_chunks(8, None, PIPELINE_MIN_BYTES) == (slice(0, 4), slice(4, 8))
    assert kv_head_chunks(3, None, PIPELINE_MIN_BYTES) == (slice(0, 2), slice(2, 3))
    assert kv_head_chunks(1, None, PIPELINE_MIN_BYTES) == (slice(0, 1),)
    assert kv_head_chunks(4, 1, 0) == tuple(slice(h, h + 1) for h in range(4))
