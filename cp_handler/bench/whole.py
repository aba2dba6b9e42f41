"""The whole-sequence references of ``cp-bench --modes plan`` (``--whole-kernels``): one device computing the
whole sequence, forward + backward, against which a rank's plan is an efficiency.

* ``sdpa``: ``F.scaled_dot_product_attention`` (PyTorch picks cuDNN or FlashAttention-2 on CUDA); for packed
  documents one call per document (what a single process without a varlen kernel does);
* ``flex``: FlexAttention with a document-causal block mask (CUDA: FlexAttention has no CPU backward);
* ``fa4``: FlashAttention-4, one block over the sequence (bshd) or one varlen call over the whole pack (thd)
  (:mod:`cp_handler.ops.kernels.fa4`; needs the ``fa4`` extra on sm90+).

``auto`` (the default) is ``sdpa`` for bshd and, for thd, ``flex`` on CUDA and ``sdpa`` on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.kernels import KERNELS

WHOLE_KERNELS = ("auto", "sdpa", "flex", "fa4")


def resolve(name: str, qkv_format: str, device: str) -> str:
    """The reference ``name`` stands for in ``qkv_format`` on ``device`` (``auto`` resolved)."""
    if name != "auto":
        return name
    return "sdpa" if qkv_format == "bshd" or device != "cuda" else "flex"


def cannot_run(name: str, device: str, dtype: torch.dtype) -> str | None:
    """Why reference ``name`` cannot run on ``device`` in ``dtype`` (``None``: it can)."""
    if name == "flex" and device != "cuda":
        return "FlexAttention has no CPU backward: --whole-kernels flex needs --device cuda"
    if name == "fa4":
        probe = torch.empty(1, 8, 1, 64, device=device if device == "cuda" else "meta", dtype=dtype)
        return KERNELS["fa4"].cannot_run(probe) if device == "cuda" else "FlashAttention-4 runs on CUDA only"
    return None


def whole_step(name: str, q, k, v, lengths: list[int] | None):
    """A function running reference ``name`` forward + backward once on ``q (1, H, S, D)``, ``k, v (1, Hkv, S,
    D)`` (``lengths``: the documents of a thd pack, ``None`` for bshd)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if name == "sdpa" and lengths is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    if name == "sdpa":
        bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]

        def per_document():
            sum(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                               enable_gqa=True).sum()
                for a, b in zip(bounds, bounds[1:], strict=False)).backward()
        return per_document
    if name == "flex":
        return _flex_step(q, k, v, lengths or [q.shape[2]])
    return _fa4_step(q, k, v, lengths)


def _flex_step(q, k, v, lengths):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), torch.tensor(lengths, device=q.device))
    # _compile: build the block mask blockwise; the eager form materialises an S x S bool mask (17 GB at 131072)
    mask = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None, q.shape[2], q.shape[2],
                             device=q.device, _compile=True)
    flex = torch.compile(flex_attention)
    return lambda: flex(q, k, v, block_mask=mask, enable_gqa=True).sum().backward()


def _fa4_step(q, k, v, lengths):
    scale = q.shape[-1] ** -0.5
    q, k, v = (t.detach() for t in (q, k, v))
    if lengths is None:
        kernel = KERNELS["fa4"]

        def block():
            out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
            kernel.backward(torch.ones_like(out), q, k, v, out, lse, causal=True, scale=scale)
        return block
    kernel = KERNELS["fa4_varlen"]
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # (T, H, D)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=q.device)

    def varlen():
        out, lse = kernel.forward(*packed, cu, cu, max(lengths), max(lengths), causal=True, scale=scale)
        kernel.backward(torch.ones_like(out), *packed, out, lse, cu, cu, max(lengths), max(lengths), causal=True,
                        scale=scale)
    return varlen
