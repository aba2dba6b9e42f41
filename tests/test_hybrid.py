"""Token mixers other than attention under CP, through the handler's mixer methods: the causal convolution
(halo), the gated delta rule (Gated DeltaNet, and Kimi delta attention's per-channel decay), Mamba2's scan and
Mamba's selective scan (state passing), at cp 1, 2, 4, bshd and thd (zero-length documents, documents shorter
than a zigzag chunk and than the convolution's left context), against each kernel run on every document alone
in one process: the outputs, every input gradient and every parameter gradient (summed over the ranks).

Kernels: the token-by-token float64 definitions (tests/mixer_reference.py) and cp_handler's own chunked gated
delta rule and depthwise convolution in float64, where a state passing error would show at 1e-3 and more while
the arithmetic gives ~1e-15: atol = rtol = 1e-10; and the installed transformers kernels (float32 inside):
atol 2e-5, rtol 1e-4 (measured differences ~1e-6: the same sums in another order). A negative control runs the
ranks without passing states and must differ. The reference GPT with Gated DeltaNet layers is in
tests/test_gpt_hybrid.py; unmodified Hugging Face hybrids in tests/test_hf_hybrid.py. GPU mode (``-m gpu``): the
same cases with the ranks on CUDA against the CPU reference.
"""

import os

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from mixer_reference import gated_delta_recurrent, selective_recurrent, ssd_recurrent

from cp_handler import LocalContextParallelHandler
from cp_handler.handlers.mixers import CUDA_OPT_IN
from cp_handler.ops.mixers import delta_rule
from cp_handler.ops.mixers.conv import depthwise_causal_conv1d
from cp_handler.ops.mixers.delta_rule import chunk_gated_delta_rule

THD_LENGTHS = [37, 0, 9, 21, 3]
TOLERANCE = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 1e-4)}


def transformers_kernels():
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn, torch_chunk_gated_delta_rule
    def gdn(q, k, v, g, beta, **options):
        # each q/k head serves v.shape[2] // k.shape[2] value heads: transformers 5.23's kernel repeats them
        # itself, 5.17's (the GPU machine's) expects them repeated, as its model does before the call
        repeats = v.shape[2] // k.shape[2]
        return torch_chunk_gated_delta_rule(q.repeat_interleave(repeats, 2), k.repeat_interleave(repeats, 2), v, g,
                                            beta, **options)

    gdn.__name__ = "torch_chunk_gated_delta_rule"  # transformers 5.25's kernels are hub modules without a __name__
    return {"conv": causal_conv1d_fn, "gdn": gdn, "kda": chunk_kimi_delta_attention,
            "ssd": mamba2_chunk_scan, "selective": mamba_selective_scan}


def reference_kernels():
    return {"conv": depthwise_causal_conv1d, "gdn": chunk_gated_delta_rule, "gdn_recurrent": gated_delta_recurrent,
            "kda": gated_delta_recurrent, "ssd": ssd_recurrent, "selective": selective_recurrent}


def mixer_case(name, kernel, rows, length, dtype, place=lambda t: t):
    """``(inputs {name: (tensor, seq_dim)}, parameters, call(handler or None, **inputs))`` of one mixer; the
    call runs the handler's method, or the kernel itself without a handler. Every tensor is drawn on the CPU
    (the same values for the same seed) and then passed through ``place`` (to a device)."""
    def randn(*shape):
        return place(torch.randn(*shape, dtype=dtype))

    def rand(*shape):
        return place(torch.rand(*shape, dtype=dtype))

    if name == "conv":
        weight, bias = randn(6, 4), randn(6)
        inputs = {"x": (randn(rows, 6, length), 2)}

        def call(h, x):
            return kernel(x, weight, bias, "silu") if h is None else h.causal_conv1d(x, weight, bias, "silu",
                                                                                   conv_fn=kernel)
        return inputs, [weight, bias], call
    if name.startswith(("gdn", "kda")):
        kda = name == "kda"  # per-channel decay, as many key heads as value heads; GDN: 2 value heads per key head
        heads_k, heads_v = (3, 3) if kda else (2, 4)
        inputs = {"q": (randn(rows, length, heads_k, 5), 1), "k": (randn(rows, length, heads_k, 5), 1),
                  "v": (randn(rows, length, heads_v, 4), 1),
                  "beta": (rand(rows, length, heads_v), 1),
                  "g": (-rand(rows, length, heads_v, *([5] if kda else [])), 1)}

        def call(h, q, k, v, g, beta):
            options = {"use_qk_l2norm_in_kernel": True, "chunk_size": 8}
            if h is None:
                return kernel(q, k, v, g, beta, **options)[0]
            return h.gated_delta_rule(q, k, v, g, beta, kernel=kernel, **options)
        return inputs, [], call
    if name == "ssd":
        A, D, dt_bias = -rand(4) - 0.5, randn(4), randn(4)
        inputs = {"x": (randn(rows, length, 4, 3), 1), "dt": (randn(rows, length, 4), 1),
                  "B": (randn(rows, length, 2, 5), 1), "C": (randn(rows, length, 2, 5), 1)}

        def call(h, x, dt, B, C):
            options = {"D": D, "dt_bias": dt_bias, "dt_softplus": True, "dt_limit": (0.0, 4.0)}
            if h is None:
                return kernel(x, dt, A, B, C, 8, **options)
            return h.ssd_scan(x, dt, A, B, C, 8, kernel=kernel, **options)
        return inputs, [A, D, dt_bias], call
    A, D, delta_bias = -rand(4, 3) - 0.5, randn(4), randn(4)
    inputs = {"u": (randn(rows, 4, length), 2), "delta": (randn(rows, 4, length), 2), "B": (randn(rows, 3, length), 2),
              "C": (randn(rows, 3, length), 2), "z": (randn(rows, 4, length), 2)}

    def call(h, u, delta, B, C, z):
        options = {"D": D, "z": z, "delta_bias": delta_bias, "delta_softplus": True}
        if h is None:
            return kernel(u, delta, A, B, C, **options)
        return h.selective_scan(u, delta, A, B, C, kernel=kernel, **options)
    return inputs, [A, D, delta_bias], call


def _with_grads(inputs, params):
    """The inputs' tensors and the parameters, every one requiring its gradient."""
    return {k: t.requires_grad_() for k, (t, _) in inputs.items()}, [p.requires_grad_() for p in params]


def _grads(tensors, params):
    return {k: t.grad.clone() for k, t in tensors.items()} | {f"param {i}": p.grad.clone() for i, p in
                                                               enumerate(params)}


def check_mixer(rank, world, groups, name, kernel, dtype, fmt, negative=False, device="cpu"):
    """One mixer through the handler vs the kernel on every document alone (module doc). The ranks run on
    ``device``, the reference on the CPU, from the same values in the same dtype."""
    lengths = THD_LENGTHS if fmt == "thd" else [16 * world]
    rows = 1 if fmt == "thd" else 2
    torch.manual_seed(0)
    inputs, params, call = mixer_case(name, kernel, rows, sum(lengths), dtype)
    tensors, params = _with_grads(inputs, params)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    outs = [call(None, **{k: t.narrow(inputs[k][1], s, n) for k, t in tensors.items()})
            for s, n in zip(starts, lengths, strict=True) if n]
    out_dim = 2 if name in ("conv", "selective") else 1
    want = torch.cat(outs, dim=out_dim)
    grad_out = torch.randn(want.shape, dtype=want.dtype)
    want.backward(grad_out)
    wanted = _grads(tensors, params)
    torch.manual_seed(0)  # the same values again, on the ranks' device
    inputs, params, call = mixer_case(name, kernel, rows, sum(lengths), dtype, place=lambda t: t.to(device))
    tensors, params = _with_grads(inputs, params)
    extra = {} if fmt != "thd" else {"qkv_format": "thd", "cu_seqlens": torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)}
    handler = LocalContextParallelHandler(cp_group=groups.cp_group if world > 1 else None, cp_comm_type="p2p", **extra)
    local = {k: handler.dispatch(t, inputs[k][1]) for k, t in tensors.items()}
    got = call(handler, **local)
    got.backward(handler.dispatch(grad_out.to(device), out_dim))
    got = handler.combine(got.detach(), out_dim).cpu()
    grads = _grads(tensors, params)
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g, group=groups.cp_group)
    grads = {k: g.cpu() for k, g in grads.items()}
    atol, rtol = TOLERANCE[torch.promote_types(dtype, want.dtype)]
    where = f"{name} ({getattr(kernel, '__name__', kernel)}) cp={world} {fmt}"
    if negative:
        return (got - want).abs().max().item()
    torch.testing.assert_close(got, want.detach(), atol=atol, rtol=rtol, msg=lambda m: f"out {where}: {m}")
    for key, g in grads.items():
        torch.testing.assert_close(g, wanted[key], atol=atol, rtol=rtol, msg=lambda m, x=key: f"d{x} {where}: {m}")


def _worker(rank, world, fmt, device="cpu"):
    from cp_handler import build_dp_cp_groups

    if device == "cuda":
        os.environ[CUDA_OPT_IN] = "1"  # the mixer methods on CUDA tensors (opt-in until this test passes there)
        torch.backends.cudnn.allow_tf32 = False  # convolutions in float32, as on the CPU reference
    groups = build_dp_cp_groups(world, device, None)
    for name, kernel in reference_kernels().items():
        check_mixer(rank, world, groups, name.removesuffix("_recurrent"), kernel, torch.float64, fmt, device=device)
    for name, kernel in transformers_kernels().items():
        check_mixer(rank, world, groups, name, kernel, torch.float32, fmt, device=device)


@pytest.mark.parametrize("world, fmt", [(1, "thd"), (2, "bshd"), (2, "thd"), (4, "bshd"), (4, "thd")])
def test_mixers_match_each_document_alone(world, fmt):
    run_distributed(_worker, world, fmt)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("world, fmt", [(2, "bshd"), (4, "thd")])
def test_mixers_on_gpu_match_the_cpu(world, fmt):
    """The same cases with the ranks on CUDA (collectives staged through host memory when ranks share a GPU),
    against the CPU reference in the same dtype: float64 kernels atol = rtol = 1e-10, transformers' float32
    kernels as on the CPU (2e-5 / 1e-4; TF32 off, so only the summation order differs)."""
    run_distributed(_worker, world, fmt, "cuda", device="cuda")


def _negative_worker(rank, world):
    from cp_handler import build_dp_cp_groups
    from cp_handler.ops.mixers import state

    groups = build_dp_cp_groups(world, "cpu", None)
    real = state.entry_states

    def zero_entries(*args, **kwargs):  # the chunks' summaries gathered, but every chunk starts from zero
        entries, gathered = real(*args, **kwargs)
        return [None] * len(entries), gathered

    state.entry_states = zero_entries
    try:
        error = check_mixer(rank, world, groups, "gdn", delta_rule.chunk_gated_delta_rule, torch.float64, "bshd",
                            negative=True)
    finally:
        state.entry_states = real
    assert error > 1e-3, error  # without state passing the result is wrong: the harness sees it


def test_without_state_passing_the_result_differs():
    run_distributed(_negative_worker, 2)


def _bytes_worker(rank, world):
    """Per rank and layer: the convolution's halo is ``2 (K - 1)`` rows each way; the recurrences' summaries are
    ``2 * docs`` per rank, independent of the sequence length (float32; gathered forward, reduce-scattered back)."""
    from cp_handler.ops.collectives import count_comms

    group, sent = dist.group.WORLD, {}
    for length in (16 * world, 64 * world):
        # no agreement all-gather counted
        handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", check_ranks=False)
        x = handler.dispatch(torch.randn(2, 6, length, requires_grad=True), 2)
        q, k = (handler.dispatch(torch.randn(2, length, 2, 5, requires_grad=True), 1) for _ in range(2))
        v = handler.dispatch(torch.randn(2, length, 4, 3, requires_grad=True), 1)
        g, beta = (handler.dispatch(-torch.rand(2, length, 4, requires_grad=True), 1) for _ in range(2))
        with count_comms() as conv_count:
            handler.causal_conv1d(x, torch.randn(6, 4), None, "silu").sum().backward()
        with count_comms() as gdn_count:
            handler.gated_delta_rule(q, k, v, g, beta).sum().backward()
        sent[length] = conv_count.bytes_sent, gdn_count.bytes_sent, dict(gdn_count.ops)
    (conv_short, gdn_short, ops), (conv_long, gdn_long, _) = sent.values()
    assert conv_short == conv_long and 0 < conv_short <= 2 * 2 * (4 - 1) * 2 * 6 * 4, sent  # fwd + bwd, rows x B x C
    summaries = 2 * (2 * 4 * 5 * (3 + 5) * 4)  # 2 chunks x batch x Hv x Dk x (Dv + Dk), float32
    assert gdn_short == gdn_long == 2 * summaries * (world - 1), sent  # all-gather forward, reduce-scatter back
    assert ops == {"all_gather": 1, "reduce_scatter": 1}, ops


def test_mixer_bytes_do_not_grow_with_the_sequence():
    run_distributed(_bytes_worker, 4)
