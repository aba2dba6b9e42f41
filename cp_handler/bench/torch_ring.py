"""PyTorch's own context-parallel ring attention, driven on the same shards as ours (the benchmark peer).

``torch.distributed.tensor.experimental.context_parallel`` dispatches SDPA to
``_templated_ring_attention`` / ``_templated_ring_attention_backward``, which take the attention op
as an argument. Its public path only maps the CUDA flash / efficient / cuDNN ops, so on CPU we pass
the CPU flash op (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) to the same
templates: PyTorch's ring schedule, load balancing, merge and rotation, with the kernel our local
backend also uses. Its load-balanced layout is the round-robin split of 2*cp chunks (rank ``r``
holds chunks ``r`` and ``2cp-1-r``), the same as our zigzag, so both take identical shards.

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


def forward_op(query, key, value, *, is_causal, **kwargs):
    """The CPU flash forward, with its work recorded as ours is (:func:`count_attn_work`)."""
    record_attn_work(query, key, is_causal)
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, is_causal=is_causal, **kwargs)


backward_op = aten._scaled_dot_product_flash_attention_for_cpu_backward


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
            out, lse, *_ = mod._templated_ring_attention(
                group, 2, forward_op, query=q, key=k, value=v, is_causal=causal, dropout_p=0.0, scale=scale
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, scale, rotate_method)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale, rotate_method = ctx.args
        with _options(causal, rotate_method) as mod:
            dq, dk, dv = mod._templated_ring_attention_backward(
                group, 2, backward_op, grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v,
                out=out, logsumexp=lse, is_causal=causal, dropout_p=0.0, scale=scale,
            )[:3]
        return dq, dk, dv, None, None, None, None


def torch_ring_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup, causal: bool, scale: float,
    rotate_method: str = "allgather",
) -> torch.Tensor:
    """PyTorch's ring attention on local zigzag shards ``q (B,H,S_local,D)``, ``k, v (B,Hkv,S_local,D)``.

    ``rotate_method``: ``"allgather"`` (PyTorch's default: one all-gather of K/V) or ``"alltoall"``
    (K/V passed along a ring with permutes). Load balancing is on for causal attention (PyTorch
    refuses it otherwise). CPU only (on CUDA PyTorch's public ``context_parallel`` runs as is).
    Returns ``out (B,H,S_local,D)``.

    Raises:
        ValueError: unknown ``rotate_method`` or a non-CPU tensor.
        RuntimeError: the templates are missing in this torch (:func:`check_available`).
    """
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method={rotate_method!r} is not one of {ROTATE_METHODS}")
    if q.device.type != "cpu":
        raise ValueError(f"torch_ring_attn drives PyTorch's ring with the CPU flash op; got device {q.device}")
    reason = check_available()
    if reason:
        raise RuntimeError(reason)
    return _TorchRing.apply(q, k, v, group, causal, scale, rotate_method)
