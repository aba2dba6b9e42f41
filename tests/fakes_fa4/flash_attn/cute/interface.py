"""Contract fake of ``flash_attn.cute.interface`` of flash-attn-4 4.0.0b36 (wheel ``flash_attn_4-4.0.0b36``,
``flash_attn/cute/interface.py``: ``_flash_attn_fwd`` L678-906, ``_validate_head_dims`` L121-140,
``_flash_attn_bwd`` L2241-2560 and its return at the end of the function).

Mirrors the two private entry points cp_handler calls: their keyword names, the 5-tuple the forward returns
(``out, lse, p, row_max, o_lo``: the last three ``None`` here as in the real non-debug path), the shapes
``(B, S, H, D)`` / ``(T, H, D)`` with int32 contiguous ``cu_seqlens``, lse ``(B, H, Sq)`` / ``(H, Tq)`` float32
in natural-log units with the scale inside, bottom-right causal alignment per segment, local windows
(``window_size_left`` / ``right``, ``None`` unbounded, bottom-right aligned as the causal mask: query ``i`` sees
keys ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``causal`` sets ``right = 0``: ``mask.py`` L320-365,
``_resolve_causal_local_window`` L438-459), the soft-cap as a score modifier after the scale
(``softcap * tanh(s / softcap)``, ``utils.create_softcap_scoremod``, its backward ``1 - tanh^2``), ``-inf`` lse and
zero output for a row that sees no key, and the assertions the real code makes on what we pass (dtypes fp16 / bf16,
one dtype, ``num_head % num_head_kv``, the sm90 head-dim rule, the backward's exact lse shape and dtype, out /
dout in q's dtype). It computes on CPU in float32 (the real one asserts CUDA tensors; a test relabels the
kernel for the CPU), and records every call in :data:`CALLS` (argument types, shapes, strides, dtypes) so
tests can assert what cp_handler passes, e.g. Python ints for ``max_seqlen`` (a tensor recompiles per call).
"""

from __future__ import annotations

import math

import torch

CALLS: list[tuple[str, dict]] = []


def _describe(value):
    if isinstance(value, torch.Tensor):
        return {"shape": tuple(value.shape), "stride": value.stride(), "dtype": value.dtype,
                "contiguous": value.is_contiguous(), "data_ptr": value.data_ptr()}
    return {"type": type(value).__name__, "value": value}


def _validate_head_dims(head_dim: int, head_dim_v: int, alignment: int) -> None:
    assert 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256 and head_dim % alignment == 0 and \
        head_dim_v % alignment == 0, f"(head_dim, head_dim_v)=({head_dim}, {head_dim_v}) is not supported on SM90."


def _segments(cu, total):
    if cu is None:
        return None
    assert cu.dtype == torch.int32, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
    assert cu.stride(0) == 1, "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
    bounds = cu.tolist()
    assert bounds[-1] <= total
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _window(causal, left, right):
    """``(left, right)`` after the real ``_resolve_causal_local_window``; negative windows are not modelled (the
    real code reads ``-1`` with the other side set as a window of -1, not as unbounded)."""
    assert left is None or left >= 0, f"window_size_left={left}: the fake models windows >= 0 or None"
    assert right is None or right >= 0, f"window_size_right={right}: the fake models windows >= 0 or None"
    return left, 0 if causal else right


def _scores(q, k, scale, causal, softcap, left, right):
    """Scaled, soft-capped, masked scores ``(H, Sq, Sk)`` in float32 and the soft-cap's tanh (or None)."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    tanh = None
    if softcap:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
    left, right = _window(causal, left, right)
    sq, sk = q.shape[0], k.shape[0]
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right is not None:
        visible &= j <= i + (sk - sq) + right
    if left is not None:
        visible &= j >= i + (sk - sq) - left
    return scores.masked_fill(~visible, float("-inf")), tanh


def _attend(q, k, v, scale, causal, softcap=None, left=None, right=None):
    """One segment in float32: ``q (Sq, H, D)``, ``k, v (Sk, Hkv, D)`` -> out, lse ``(H, Sq)``, probabilities."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    scores, _ = _scores(q, k, scale, causal, softcap, left, right)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
    return torch.einsum("hqk,khd->qhd", probs, v), lse, probs, scores


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k):
    assert v.dtype in (torch.float16, torch.bfloat16), "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
    assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
    num_head, head_dim = q.shape[-2:]
    assert num_head % v.shape[-2] == 0, "num_head must be divisible by num_head_kv"
    _validate_head_dims(head_dim, v.shape[-1], 16 // v.element_size())
    if cu_seqlens_q is None:
        assert q.dim() == 4 and k.shape[0] == q.shape[0]
        return [(b, None) for b in range(q.shape[0])]
    assert q.dim() == 3 and cu_seqlens_k is not None
    segments = list(zip(_segments(cu_seqlens_q, q.shape[0]), _segments(cu_seqlens_k, k.shape[0]), strict=True))
    return segments


def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                    max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                    causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                    tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1,
                    pack_gqa=None, _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None,
                    return_lse=False, out=None, lse=None, **more):
    CALLS.append(("fwd", {name: _describe(value) for name, value in locals().items() if name != "more"}))
    assert not more, f"the fake does not model {sorted(more)}"
    segments = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is None:
        results = [_attend(q[b], k[b], v[b], scale, causal, softcap, window_size_left, window_size_right)
                   for b, _ in segments]
        out = torch.stack([r[0] for r in results]).to(q.dtype)
        lse = torch.stack([r[1] for r in results])  # (B, H, Sq)
    else:
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))  # (H, Tq): rows of no segment stay -inf
        for (qa, qb), (ka, kb) in segments:
            seg_out, seg_lse, _, _ = _attend(q[qa:qb], k[ka:kb], v[ka:kb], scale, causal, softcap, window_size_left,
                                             window_size_right)
            out[qa:qb], lse[:, qa:qb] = seg_out.to(q.dtype), seg_lse
    return out, (lse if return_lse else None), None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                    window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
                    cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None, dlse=None,
                    learnable_sink=None, **more):
    CALLS.append(("bwd", {name: _describe(value) for name, value in locals().items() if name != "more"}))
    assert not more, f"the fake does not model {sorted(more)}"
    segments = _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    assert q.dtype in (torch.float16, torch.bfloat16), "inputs must be float16 or bfloat16"
    assert q.dtype == k.dtype == v.dtype == out.dtype == dout.dtype, "inputs must have the same dtype"
    assert lse.dtype == torch.float32, "lse must be float32"
    if cu_seqlens_q is None:
        want = (q.shape[0], q.shape[2], q.shape[1])
        assert lse.shape == want, "lse must have shape (batch_size, num_head, seqlen_q)"
    else:
        assert lse.shape == (q.shape[1], q.shape[0]), "lse must have shape (num_head, total_q)"
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32) for t in (q, k, v))
    pieces = [((b, None), (b, None)) for b, _ in segments] if cu_seqlens_q is None else segments
    for qs, ks in pieces:
        def take(t, s):
            return t[s[0]] if s[1] is None else t[s[0]:s[1]]

        q_s, k_s, v_s, o_s, do_s = take(q, qs), take(k, ks), take(v, ks), take(out, qs), take(dout, qs)
        lse_s = lse[qs[0]] if qs[1] is None else lse[:, qs[0]:qs[1]]  # (H, Sq)
        grads = _segment_grads(q_s, k_s, v_s, o_s, do_s, lse_s, scale, causal, softcap, window_size_left,
                               window_size_right)
        for acc, s, grad in ((dq, qs, grads[0]), (dk, ks, grads[1]), (dv, ks, grads[2])):
            if s[1] is None:
                acc[s[0]] += grad
            else:
                acc[s[0]:s[1]] += grad
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _segment_grads(q, k, v, out, dout, lse, scale, causal, softcap=0.0, left=None, right=None):
    """FlashAttention-2's backward of one segment given the merged ``out`` and ``lse (H, Sq)`` (float32)."""
    groups = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    scores, tanh = _scores(q, kf, scale, causal, softcap, left, right)
    probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), float("inf")).unsqueeze(-1))
    do, o = dout.float(), out.float()
    dv = torch.einsum("hqk,qhd->khd", probs, do)
    dprobs = torch.einsum("qhd,khd->hqk", do, vf)
    delta = (do * o).sum(-1).transpose(0, 1)  # (H, Sq)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * scale
    if tanh is not None:
        dscores = dscores * (1 - tanh * tanh)
    dq = torch.einsum("hqk,khd->qhd", dscores, kf)
    dk = torch.einsum("hqk,qhd->khd", dscores, q.float())
    fold = lambda t: t.view(t.shape[0], k.shape[1], groups, t.shape[-1]).sum(2)  # noqa: E731 - GQA
    return dq, fold(dk), fold(dv)
