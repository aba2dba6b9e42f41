"""PyTorch's own context-parallel ring attention, driven on the same shards as ours (the benchmark peer).

``torch.distributed.tensor.experimental.context_parallel`` dispatches SDPA to
``_templated_ring_attention`` / ``_templated_ring_attention_backward``, which take the attention op
as an argument. Its public path only maps the CUDA flash / efficient / cuDNN ops, so on CPU we pass
the CPU flash op (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) to the same
templates: PyTorch's ring schedule, load balancing, merge and rotation, with the kernel our local
backend also uses. On CUDA we pass the CUDA flash op with the arguments PyTorch's own ring-flash
wrappers pass (``cp-bench --device cuda``, several GPUs; not yet run on GPUs). Its load-balanced
layout is the round-robin split of 2*cp chunks (rank ``r`` holds chunks ``r`` and ``2cp-1-r``),
the same as our zigzag, so both take identical shards.

Private PyTorch API (checked against torch 2.13): :func:`check_available` says why it cannot run
instead of failing inside a timed loop.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.distributed as dist

from ..ops.collectives import record
from ..ops.kernels import record_attn_work

aten = torch.ops.aten
_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
ROTATE_METHODS = ("allgather", "alltoall")


def _module():
    return importlib.import_module(_MODULE)


def check_available() -> str | None:
    """``None`` when the ring templates exist in this torch, else the reason they do not."""
    try:
        mod = _module()
    except ImportError as err:
        return f"{_MODULE} not importable in torch {torch.__version__}: {err}"
    missing = [n for n in ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options")
               if not hasattr(mod, n)]
    return f"{_MODULE} lacks {missing} in torch {torch.__version__}" if missing else None


def flash_ops(device_type: str):
    """``(forward, backward)`` flash ops for ``device_type``: CPU's ``_for_cpu`` pair; on CUDA (and
    ``meta``, where their schemas are checked without a GPU) FlashAttention-2, the op PyTorch's own
    ``_scaled_dot_product_ring_flash_attention`` passes to its ring."""
    if device_type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward)
    return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward.default


def forward_op(query, key, value, *, is_causal, **kwargs):
    """The flash forward of the tensors' device, with its work recorded as ours is (:func:`count_attn_work`)."""
    record_attn_work(query, key, is_causal)
    return flash_ops(query.device.type)[0](query, key, value, is_causal=is_causal, **kwargs)


def backward_extras(device_type: str, forward_rest) -> dict:
    """What the backward takes beyond grad_out/q/k/v/out/lse, from the forward's outputs after
    ``(out, lse)``: nothing on CPU; on CUDA the offsets, lengths and rng state (as PyTorch's own
    ``_scaled_dot_product_ring_flash_attention_backward`` passes them)."""
    if device_type == "cpu":
        return {}
    names = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset")
    return dict(zip(names, forward_rest[:6], strict=True))


class _CountedRotater:
    """PyTorch's K/V (or dK/dV) rotater, with the bytes it sends recorded as ours are
    (:func:`~cp_handler.ops.collectives.count_comms`): the all-gather rotater gathers once, on
    its first exchange; the all-to-all rotater sends the whole buffer to the next rank each time."""

    def __init__(self, inner, group, gathers: bool):
        self.inner, self.size, self.gathers, self.gathered = inner, dist.get_world_size(group), gathers, False

    def exchange_buffers(self, buffer: torch.Tensor):
        if not self.gathers:
            record("send", buffer.nbytes)
        elif not self.gathered:
            record("all_gather", buffer.nbytes * (self.size - 1))
            self.gathered = True
        return self.inner.exchange_buffers(buffer)

    def next_buffer(self) -> torch.Tensor:
        return self.inner.next_buffer()


@contextlib.contextmanager
def _options(causal: bool, rotate_method: str):
    """PyTorch reads its ring options from module globals at every call: set them (and count the
    rotaters' traffic), then restore."""
    mod = _module()
    options, create = mod._cp_options, mod._create_rotater
    saved = (options.enable_load_balance, options.rotate_method)
    options.enable_load_balance = causal  # load balancing is PyTorch's zigzag; it refuses it without causal
    options.rotate_method = getattr(mod._RotateMethod, "ALL_GATHER" if rotate_method == "allgather" else "ALL_TO_ALL")

    def counted(pg, seq_dim, method=None):
        gathers = (method or options.rotate_method) == mod._RotateMethod.ALL_GATHER
        return _CountedRotater(create(pg, seq_dim, method), pg, gathers)

    mod._create_rotater = counted
    try:
        yield mod
    finally:
        options.enable_load_balance, options.rotate_method = saved
        mod._create_rotater = create


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, rotate_method):
        with _options(causal, rotate_method) as mod:
            out, lse, *rest = mod._templated_ring_attention(
                group, 2, forward_op, query=q, key=k, value=v, is_causal=causal, dropout_p=0.0, scale=scale
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.extra = backward_extras(q.device.type, rest)
        ctx.args = (group, causal, scale, rotate_method)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, rotate_method = ctx.args
        with _options(causal, rotate_method) as mod:
            dq, dk, dv = mod._templated_ring_attention_backward(
                group, 2, flash_ops(q.device.type)[1], grad_out=dout, grad_out_name="grad_out", query=q, key=k,
                value=v, out=out, logsumexp=lse, is_causal=causal, dropout_p=0.0, scale=scale, **ctx.extra,
            )[:3]
        return dq, dk, dv, None, None, None, None


def torch_ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup, causal: bool, scale: float,
    rotate_method: str = "allgather",
) -> torch.Tensor:
    """PyTorch's ring attention on local zigzag shards ``q (B,H,S_local,D)``, ``k, v (B,Hkv,S_local,D)``.

    ``rotate_method``: ``"allgather"`` (PyTorch's default: one all-gather of K/V) or ``"alltoall"``
    (K/V passed along a ring with permutes). Load balancing is on for causal attention (PyTorch
    refuses it otherwise). CPU: the CPU flash op; CUDA: FlashAttention-2 (fp16/bf16), the op and
    arguments of PyTorch's own ``_scaled_dot_product_ring_flash_attention`` (not yet run on GPUs).
    Returns ``out (B,H,S_local,D)``.

    Raises:
        ValueError: unknown ``rotate_method``; a device other than CPU and CUDA; float32 on CUDA.
        RuntimeError: the templates are missing in this torch (:func:`check_available`).
    """
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method={rotate_method!r} is not one of {ROTATE_METHODS}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"torch_ring_attn runs on CPU or CUDA; got device {q.device}")
    if q.device.type == "cuda" and q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"torch_ring_attn on CUDA runs FlashAttention-2: fp16/bf16, got {q.dtype}")
    reason = check_available()
    if reason:
        raise RuntimeError(reason)
    return _TorchRing.apply(q, k, v, group, causal, scale, rotate_method)
