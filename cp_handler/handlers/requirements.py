"""Checks for optional backends: the package is importable, CUDA and NCCL are there.

Each raises before any collective, with the install hint or the reason, so selecting a backend
that cannot run here never falls back to something else silently.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist


def release(version: str) -> tuple[int, ...]:
    """The leading integers of a version string: ``"2.20.0.dev0"`` -> ``(2, 20, 0)``, ``"5.23.0"`` -> ``(5, 23, 0)``."""
    parts = []
    for part in str(version).split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def import_backend(module: str, package: str, hint: str):
    """Import ``module`` or raise ImportError naming ``package`` and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"backend needs the '{package}' package ({module} failed to import: {err}); {hint}") from err


def require_cuda(backend: str) -> None:
    """Raises RuntimeError when CUDA is not available."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"backend={backend!r} runs on CUDA GPUs only and no CUDA device is available here; "
                           "use backend='local' on CPU")


def require_nccl(backend: str, group: dist.ProcessGroup | None) -> None:
    """Raises RuntimeError when ``group`` is not an NCCL process group."""
    if group is not None and dist.get_backend(group) != "nccl":
        raise RuntimeError(f"backend={backend!r} needs an NCCL process group, got {dist.get_backend(group)!r}")
