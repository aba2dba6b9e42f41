"""FlashAttention-4 (``flash-attn-4==4.0.0b36``, the CuTe-DSL FlashAttention for sm90 / sm100): ``fa4`` blocks
and ``fa4_varlen`` packed calls. ``fa4`` is automatic for bshd / sbhd in fp16 / bf16 at head dims 64 and 128
where it runs (run H200-2026-11-27b verified it); thd and ``fa4_varlen`` stay opt-in until a GPU run verifies them
(``verified_on``, ``verified_thd``); docs/backends.md.

Entry points (``flash_attn.cute.interface`` of that release, private, hence the exact pin):

* forward ``_flash_attn_fwd(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
  softmax_scale=, causal=, return_lse=True)`` -> ``(out, lse, *more)``: q ``(B, Sq, H, D)`` / k, v
  ``(B, Sk, Hkv, D)`` (blocks) or ``(T, H, D)`` with int32 ``cu_seqlens`` (packed); ``lse`` float32 in natural
  log units with the scale inside, ``(B, H, Sq)`` or ``(H, Tq)``, ``-inf`` (and ``out = 0``) for a row that
  sees no key: the layouts and conventions of the kernel contract (:mod:`.base`) and of ``flash_varlen``;
* backward ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=, cu_seqlens_q=, ...)`` with the
  **merged** out / lse of the ring (its order differs from FlashAttention-2's ``dout`` first), lse float32 in
  exactly the forward's shape; ``(dq, dk, dv)`` in q's dtype, dk / dv with ``Hkv`` heads (GQA native in both
  passes: K/V are never expanded).

The block tensors of the plans are ``(B, H, S, D)`` views of sequence-major memory: passed as their
``(B, S, H, D)`` transposes, no copy (FA4 copies only what is not 16-byte aligned). ``max_seqlen_q/k`` are
Python ints: a tensor there enters FA4's compile key by identity and recompiles every call. FA4 compiles a
kernel per variant (dtype, head dims, GQA ratio, causal, varlen, ...), not per sequence length, so packed
documents (thd) whose block shapes change every step reuse its kernels; the compiled kernels are kept on disk
(``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``, set here unless the environment says otherwise; the folder is
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``, FA4's default ``/tmp/$USER/flash_attention_cute_dsl_cache``) so the
ranks of a node and later runs share them.

Limits (:attr:`~.base.AttnKernel.cannot_run`, so the automatic choice moves on and a forced kernel fails with
a clear error): CUDA compute capability 9.0 or newer (FA4 has no sm80 backward), fp16 / bf16, head dims
multiples of 8 up to 256 (verified per head dim by a GPU run: 64 and 128), and the package importable at the
pinned release. Sinks are folded after the merge (not FA4's ``learnable_sink``).

Masked blocks (``fa4`` only): the causal edge and both window edges as FA4's own ``window_size_left`` /
``window_size_right`` (the bottom-right-aligned convention of FlashAttention-2, ``None`` unbounded: ``mask.py``
L320-365, ``_resolve_causal_local_window`` L438-459; the block cut as :func:`.flash_window.band` does) and the
soft-cap as its ``softcap`` (a score modifier after the scale, ``softcap * tanh(s / softcap)``, backward
``1 - tanh^2``: ``utils.create_softcap_scoremod`` / ``_bwd``; FA4's tanh is the fast approximate one). Not yet run on
a GPU: opt-in through ``CP_HANDLER_MASKED_KERNEL=fa4`` until a run verifies it (``verified_masks`` empty).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os

import torch

from ...core.install_hint import extra_hint
from ...core.masks import BlockMask
from .base import H200_RUN_B, AttnKernel
from .flash_window import band, whole_grads, whole_rows

FA4_RELEASE = "4.0.0b36"
"""The only release whose private entry points this module is written against (the ``fa4`` extra:
``pip install -e '.[fa4]'`` from the checkout)."""
FA4_HINT = extra_hint("fa4") + ", on sm90 / sm100"
CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
MIN_CAPABILITY = (9, 0)
HEAD_DIMS = {"max_head_dim": 256, "head_dim_multiple": ((torch.float16, 8), (torch.bfloat16, 8))}


def missing_package() -> str | None:
    """Why FA4 cannot be imported here (not installed, another release), or ``None``; cheap: no import."""
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return f"flash-attn-4 is not installed ({FA4_HINT})"
    try:
        release = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return f"flash_attn.cute is importable but no flash-attn-4 distribution is installed ({FA4_HINT})"
    if release != FA4_RELEASE:
        return f"flash-attn-4 {release} is installed; cp_handler calls the private entry points of {FA4_RELEASE}"
    return None


@functools.cache
def interface():
    """``flash_attn.cute.interface`` (imported on first use: it loads the CUTLASS DSL, seconds and ~200 MB),
    with FA4's compile cache on disk unless the environment chose otherwise.

    Raises:
        ImportError: FA4 missing or of another release, or failing to import (e.g. no CUDA toolkit flavour
            its driver supports), with the install hint.
    """
    reason = missing_package()
    if reason:
        raise ImportError(reason)
    os.environ.setdefault(CACHE_ENV, "1")
    try:
        from flash_attn.cute import interface as module
    except (ImportError, RuntimeError) as err:
        raise ImportError(f"flash_attn.cute.interface failed to import ({err}); {FA4_HINT}") from None
    return module


def cannot_run_here(q: torch.Tensor) -> str | None:
    """FA4's needs of this machine for ``q``: the package at the pinned release, compute capability >= 9.0."""
    if reason := missing_package():
        return reason
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(q.device)
        return f"it needs compute capability 9.0 or newer (sm90 / sm100), {q.device} is {major}.{minor}"
    return None


def _seq(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # (B, H, S, D) <-> (B, S, H, D), a view


def forward(q, k, v, *, causal: bool, scale: float):
    out, lse, *_ = interface()._flash_attn_fwd(_seq(q), _seq(k), _seq(v), softmax_scale=scale, causal=causal,
                                                return_lse=True)
    return _seq(out), lse


def backward(dout, q, k, v, out, lse, *, causal: bool, scale: float):
    dq, dk, dv = interface()._flash_attn_bwd(_seq(q), _seq(k), _seq(v), _seq(out), _seq(dout), lse.contiguous(),
                                             softmax_scale=scale, causal=causal)
    return _seq(dq), _seq(dk), _seq(dv)


def _windows(block: BlockMask, nq: int, nk: int) -> tuple[int, int, dict]:
    queries, keys, left, right = band(block, nq, nk)
    return queries, keys, {"window_size_left": None if left < 0 else left,
                           "window_size_right": None if right < 0 else right}


def masked_forward(q, k, v, block: BlockMask, *, scale: float):
    queries, keys, windows = _windows(block, q.shape[-2], k.shape[-2])
    out, lse, *_ = interface()._flash_attn_fwd(_seq(q)[:, :queries], _seq(k)[:, :keys], _seq(v)[:, :keys],
                                                softmax_scale=scale, causal=False, softcap=block.mask.softcap,
                                                return_lse=True, **windows)
    return whole_rows(out, lse, q.shape[-2])


def masked_backward(dout, q, k, v, out, lse, block: BlockMask, *, scale: float):
    queries, keys, windows = _windows(block, q.shape[-2], k.shape[-2])
    grads = interface()._flash_attn_bwd(_seq(q)[:, :queries], _seq(k)[:, :keys], _seq(v)[:, :keys],
                                        _seq(out)[:, :queries], _seq(dout)[:, :queries],
                                        lse[..., :queries].contiguous(), softmax_scale=scale, causal=False,
                                        softcap=block.mask.softcap or 0.0, **windows)
    return whole_grads(grads, q, k)


MASKS = frozenset({"causal", "window", "window_right", "softcap"})
"""What FA4's masked calls compute: a band (:mod:`.flash_window`) with or without the soft-cap."""


def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float):
    out, lse, *_ = interface()._flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                                                max_seqlen_k=int(max_k), softmax_scale=scale, causal=causal,
                                                return_lse=True)
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, *, causal: bool, scale: float):
    return interface()._flash_attn_bwd(q, k, v, out, dout, lse.contiguous(), softmax_scale=scale, causal=causal,
                                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                                       max_seqlen_k=int(max_k))


KERNEL = AttnKernel("fa4", "cuda", (torch.float16, torch.bfloat16), forward, backward,
                    verified_on=f"{H200_RUN_B}: blocks vs float64 (bf16/fp16, head dims 64/128, GQA 4:1 and 1:1), "
                                "every bshd pattern at cp 2 and 4 in bf16 and fp16",
                    requirement=cannot_run_here, verified_head_dims=(64, 128), verified_thd=False, **HEAD_DIMS,
                    masks=MASKS, masked_forward=masked_forward, masked_backward=masked_backward)
VARLEN_KERNEL = AttnKernel("fa4_varlen", "cuda", (torch.float16, torch.bfloat16), varlen_forward, varlen_backward,
                           verified_on=None, packed=True, requirement=cannot_run_here, verified_head_dims=(),
                           **HEAD_DIMS)
