"""Test harness only: run gloo collectives on device tensors by staging them through host memory.

Several ranks on one GPU cannot use NCCL ("Duplicate GPU detected") and gloo aborts on CUDA tensors,
so for the GPU test mode each rank patches ``torch.distributed``'s collectives in its own process:
the wrapper copies the tensors a collective reads to host memory, runs the real gloo collective on
the copies, and copies what it wrote back into the caller's (device) tensors, after ``wait()`` for
async calls. The library is unchanged: it calls ``torch.distributed`` as on any machine.

``install(force=True)`` stages CPU tensors too (into fresh host copies): the CPU self-test of this
harness (tests/test_attn_patterns.py::test_host_staging_harness_on_cpu), which would catch a missing
copy-back.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

# collective -> (arguments it writes, arguments it reads); a name in both is read and written.
_SPECS = {
    "all_gather_into_tensor": (("output_tensor",), ("input_tensor",)),
    "all_gather_single": (("output_tensor",), ("input_tensor",)),
    "reduce_scatter_tensor": (("output",), ("input",)),
    "reduce_scatter_single": (("output",), ("input",)),
    "all_to_all_single": (("output",), ("input",)),
    "all_reduce": (("tensor",), ("tensor",)),
    "broadcast": (("tensor",), ("tensor",)),
    "all_gather": (("tensor_list",), ("tensor",)),
    "reduce_scatter": (("output",), ("input_list",)),
}
_installed: dict[str, object] = {}


def _needs_staging(t: torch.Tensor, force: bool) -> bool:
    return force or t.device.type != "cpu"


def _to_host(value, read: bool):
    """Host copy of a tensor or list of tensors (contents copied only where the collective reads them)."""
    if isinstance(value, (list, tuple)):
        return [_to_host(t, read) for t in value]
    host = torch.empty(value.shape, dtype=value.dtype)
    if read:
        host.copy_(value.detach())
    return host


def _copy_back(device_value, host_value) -> None:
    if isinstance(device_value, (list, tuple)):
        for d, h in zip(device_value, host_value, strict=True):
            _copy_back(d, h)
    else:
        with torch.no_grad():
            device_value.copy_(host_value)


class _StagedWork:
    """A collective's work handle whose ``wait()`` also copies the results back to the device."""

    def __init__(self, works: list, finish):
        self.works, self.finish, self.done = works, finish, False

    def wait(self, timeout=None) -> bool:
        if not self.done:  # once: a second wait on a finished gloo send blocks until it times out
            for work in self.works:
                work.wait()
            self.finish()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def _staged_collective(name: str, original, force: bool):
    writes, reads = _SPECS[name]
    signature = inspect.signature(original)
    missing = {*writes, *reads} - set(signature.parameters)
    if missing:
        raise RuntimeError(f"host staging: torch.distributed.{name} has no parameter {sorted(missing)} on this torch")

    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        staged = [n for n in {*writes, *reads} if n in bound.arguments and any(
            _needs_staging(t, force) for t in _flat(bound.arguments[n]))]
        if not staged:
            return original(*args, **kwargs)
        device_values = {n: bound.arguments[n] for n in staged}
        host_values = {n: _to_host(device_values[n], n in reads) for n in staged}
        bound.arguments.update(host_values)
        work = original(*bound.args, **bound.kwargs)

        def finish():
            for n in staged:
                if n in writes:
                    _copy_back(device_values[n], host_values[n])

        if bound.arguments.get("async_op"):
            return _StagedWork([work], finish)
        finish()
        return work

    wrapper.__wrapped__ = original
    return wrapper


def _flat(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _staged_batch_isend_irecv(original, force: bool):
    def wrapper(p2p_op_list):
        host_ops, receives = [], []
        for op in p2p_op_list:
            if not _needs_staging(op.tensor, force):
                host_ops.append(op)
                continue
            is_send = op.op in (dist.isend, dist.send)
            host = _to_host(op.tensor, read=is_send)
            if not is_send:
                receives.append((op.tensor, host))
            host_ops.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        works = original(host_ops)
        if not receives:
            return works
        staged = _StagedWork(works, lambda: [_copy_back(d, h) for d, h in receives])
        return [staged] * max(1, len(works))

    wrapper.__wrapped__ = original
    return wrapper


def install(force: bool = False) -> None:
    """Patch this process's ``torch.distributed`` collectives to stage through host memory."""
    if _installed:
        return
    for name in _SPECS:
        original = getattr(dist, name, None)
        if original is not None:
            _installed[name] = original
            setattr(dist, name, _staged_collective(name, original, force))
    _installed["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = _staged_batch_isend_irecv(dist.batch_isend_irecv, force)
