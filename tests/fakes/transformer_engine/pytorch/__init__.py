"""Fake ``transformer_engine.pytorch.DotProductAttention``: TE's signatures and its rules under CP.

Mirrors, in NVIDIA/TransformerEngine main at 2.20.0.dev0 (commit d0067d0d):

* ``attention/dot_product_attention/dot_product_attention.py``: ``__init__`` (lines 670-694: the
  argument list; ``kv_channels`` an int or a ``(k, v)`` pair, 731-760, and the head dims asserted in
  ``forward``, 1717-1725; ``window_size`` checked by ``check_set_window_size``, utils.py 2642-2690),
  ``set_context_parallel_group`` (876-915: four arguments, no load-balancing option: the zigzag,
  DualChunkSwap, is TE PyTorch's only layout), ``forward`` (1380-1412), and the error raised when
  no backend is left (2160-2165);
* ``context_parallel.py`` ``attn_forward_func_with_cp`` (5019-5075): a2a+p2p needs two groups,
  cu_seqlens_padded for thd, sliding window only with a2a / all_gather; the a2a helper's
  ``num_heads % cp_size`` rule (4246);
* ``utils.py`` ``get_attention_backend``: fp16/bf16 only for FlashAttention / FusedAttention
  (599-641), UnfusedDotProductAttention disabled under CP (1169-1173), FusedAttention disabled
  for FP8 + thd and for odd head counts with a2a (1216-1280);
* thd with all_gather: refused ("No support for cp_comm_type='all_gather' and qkv_format='thd'")
  up to v2.17.1, accepted from v2.18; thd with a2a+p2p asserted ("thd format is not supported with
  hierarchical CP implementation yet!") up to v2.18, accepted from 2.19 (commit 8ff60f8de, #3290);
  FP8 attention with thd under CP: no backend before 2.19; from 2.19 (release notes v2.19, PR #2994's
  matrix) DelayedScaling / Float8CurrentScaling on SM100+, DelayedScaling also on SM90 (forward only),
  MXFP8BlockScaling never, cuDNN 9.23+ (``utils.py`` fake: capability and cuDNN). The release is
  ``transformer_engine.__version__``.

It has no parameters, as the real module (its FP8 metadata is extra state). It computes with
cp_handler's local algorithms, and sliding-window attention with a dense masked attention over
the gathered sequence (bshd), so a window that is not passed gives a different result.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import GatherSumGrad  # tests/ helper: the fake is only imported inside test ranks
from torch import nn

import transformer_engine
from cp_handler.core.layout import ZigzagDocs
from cp_handler.ops.all_gather import all_gather_attn
from cp_handler.ops.ring import ring_attn
from cp_handler.ops.ulysses import a2a_attn

from . import fp8, utils

CALLS: list[dict] = []
NO_BACKEND = ("No dot product attention backend is available for the provided inputs. Please run with "
              "NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2 to find out the reasons for disabling all backends.")


def _version() -> tuple[int, ...]:
    return tuple(int(p) for p in transformer_engine.__version__.split(".")[:2])


def check_set_window_size(attn_mask_type, window_size):
    """utils.py 2642-2690 (the warnings left out)."""
    if "causal" in attn_mask_type:
        if window_size is None or window_size == (-1, -1):
            return (-1, 0)
        assert window_size == (-1, 0) or (window_size[0] >= 0 and window_size[1] == 0), "bad causal window_size"
        return tuple(window_size)
    if window_size is None or window_size == (-1, 0):
        return (-1, -1)
    return tuple(window_size)


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, bottom_right_diagonal=None,
                 sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p",
                 softmax_scale=None, softmax_type="vanilla", return_max_logit=False, name=None):
        super().__init__()
        assert num_attention_heads % (num_gqa_groups or num_attention_heads) == 0
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        # dot_product_attention.py 731-760: an int, or (k, v) head sizes (MLA); the default scale from the keys'
        self.head_dim_k, self.head_dim_v = (kv_channels, kv_channels) if isinstance(kv_channels, int) else kv_channels
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.qkv_format, self.attn_mask_type = qkv_format, attn_mask_type
        self.window_size = check_set_window_size(attn_mask_type, window_size)
        self.layer_number, self.softmax_scale = layer_number, softmax_scale or self.head_dim_k**-0.5
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        CALLS.append({"call": "__init__", "qkv_format": qkv_format, "layer_number": layer_number,
                      "num_attention_heads": num_attention_heads, "num_gqa_groups": num_gqa_groups,
                      "window_size": window_size, "kv_channels": kv_channels})

    def get_extra_state(self):
        """TE modules keep FP8 metadata as extra state (``TransformerEngineBaseModule.get_extra_state``)."""
        return {"fp8_meta": None}

    def set_extra_state(self, state):
        assert "fp8_meta" in state

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p"):
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        CALLS.append({"call": "set_context_parallel_group", "cp_group": cp_group, "cp_global_ranks": cp_global_ranks,
                      "cp_comm_type": cp_comm_type, "module": id(self)})

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                bottom_right_diagonal=None, checkpoint_core_attention=False, core_attention_bias_type="no_bias",
                core_attention_bias=None, alibi_slopes=None, fast_zero_fill=True, inference_params=None,
                pad_between_seqs=None, fp8_output=False, bf16_backward=False, num_splits=1, score_mod=None,
                score_mod_bprop=None, score_mod_tensors=None, score_mod_bprop_tensors=None, qkv_layer=None,
                kv_layer=None, qkv_interleave_dim=-3):
        qkv_format = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        assert query_layer.shape[-1] == self.head_dim_k, \
            f"Queries have head_dim = {query_layer.shape[-1]}, but expected head_dim = {self.head_dim_k}!"
        assert value_layer.shape[-1] == self.head_dim_v, \
            f"Values have head_dim = {value_layer.shape[-1]}, but expected head_dim = {self.head_dim_v}!"
        window = check_set_window_size(mask, window_size if window_size is not None else self.window_size)
        CALLS.append({"call": "forward", "qkv_format": qkv_format, "attn_mask_type": mask, "cp_group": self.cp_group,
                      "cp_comm_type": self.cp_comm_type, "cu_seqlens_q": cu_seqlens_q, "window_size": window,
                      "cu_seqlens_q_padded": cu_seqlens_q_padded, "max_seqlen_q": max_seqlen_q,
                      "training": self.training})
        if qkv_format == "thd":
            assert "padding" in mask, "thd needs a padding mask type"
            assert cu_seqlens_q is not None and cu_seqlens_kv is not None
        cp = self.cp_group is not None and self._cp_size() > 1
        if cp:
            self._check_cp(qkv_format, window, query_layer, key_layer, cu_seqlens_q_padded)
        q, k, v = (self._to_bhsd(t, qkv_format) for t in (query_layer, key_layer, value_layer))
        if window not in ((-1, 0), (-1, -1)):
            out = self._sliding_window(q, k, v, window, cp, qkv_format)
        else:
            out = self._cp_attention(q, k, v, "causal" in mask, cp, qkv_format, cu_seqlens_q, cu_seqlens_q_padded)
        return self._from_bhsd(out, qkv_format).flatten(-2)

    def _cp_attention(self, q, k, v, causal, cp, qkv_format, cu_seqlens_q, cu_seqlens_q_padded):
        layout = None
        if qkv_format == "thd":
            lengths = torch.diff(cu_seqlens_q.cpu()).tolist()
            padded = torch.diff(cu_seqlens_q_padded.cpu()).tolist() if cp else lengths
            layout = ZigzagDocs(tuple(lengths), tuple(padded), self._cp_size() if cp else 1)
        kwargs = {"causal": causal, "scale": self.softmax_scale, "layout": layout}
        comm = self.cp_comm_type if cp else None
        if comm is None:
            return ring_attn(q, k, v, group=None, **kwargs)[0]
        if comm == "p2p":
            return ring_attn(q, k, v, group=self.cp_group, **kwargs)[0]
        if comm == "all_gather":
            return all_gather_attn(q, k, v, group=self.cp_group, **kwargs)[0]
        if comm == "a2a":
            return a2a_attn(q, k, v, a2a_group=self.cp_group, **kwargs)[0]
        return a2a_attn(q, k, v, a2a_group=self.cp_group[0], p2p_group=self.cp_group[1], **kwargs)[0]

    def _sliding_window(self, q, k, v, window, cp, qkv_format):
        """Query at global position i attends keys in [i - left, i + right] (TE's convention, sq == sk)."""
        assert qkv_format != "thd", "this fake models sliding windows for bshd/sbhd only"
        size, rank = (self._cp_size(), dist.get_rank(self.cp_group)) if cp else (1, 0)
        layout = ZigzagDocs.uniform(q.shape[2] * size, size)
        if cp:  # global K/V in global order
            order = torch.argsort(torch.cat([layout.dispatch_index(r) for r in range(size)]))
            k, v = (GatherSumGrad.apply(t.transpose(0, 2).contiguous(), self.cp_group).index_select(0, order)
                    .transpose(0, 2) for t in (k, v))
        qpos = layout.dispatch_index(rank).to(q.device)[:, None]
        kpos = torch.arange(k.shape[2], device=q.device)[None, :]
        left, right = window
        allowed = (kpos >= qpos - left if left >= 0 else True) & (kpos <= qpos + right if right >= 0 else True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=True)

    def _cp_size(self):
        if isinstance(self.cp_group, list):
            return dist.get_world_size(self.cp_group[0]) * dist.get_world_size(self.cp_group[1])
        return dist.get_world_size(self.cp_group)

    def _check_cp(self, qkv_format, window, q, k, cu_seqlens_q_padded):
        comm = self.cp_comm_type
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(NO_BACKEND)  # no fp32 backend under CP
        if comm == "a2a+p2p":
            assert isinstance(self.cp_group, list) and len(self.cp_group) == 2, \
                "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!"
        else:
            assert isinstance(self.cp_group, dist.ProcessGroup), f"cp_group must be ProcessGroup for {comm=}!"
        assert qkv_format != "thd" or cu_seqlens_q_padded is not None, \
            "cu_seqlens_padded can not be None for context parallelism and qkv_format = 'thd'!"
        sliding = window not in (None, (-1, 0), (-1, -1))
        assert not sliding or comm in ("a2a", "all_gather"), \
            f"Context parallelism does not support sliding window attention with {comm=}!"
        if comm == "all_gather" and _version() < (2, 18):
            assert qkv_format != "thd", f"No support for cp_comm_type='all_gather' and {qkv_format=}."
        if comm == "a2a+p2p" and _version() < (2, 19):
            assert qkv_format != "thd", f"{qkv_format} format is not supported with hierarchical CP implementation yet!"
        recipe = fp8.FP8GlobalStateManager.get_fp8_recipe()
        if qkv_format == "thd" and fp8.FP8GlobalStateManager.is_fp8_enabled() and recipe.fp8_dpa:
            name, sm100 = type(recipe).__name__, utils.CAPABILITY >= (10, 0)
            supported = name == "Float8CurrentScaling" and sm100 or name == "DelayedScaling"
            if _version() < (2, 19) or not supported or utils.CUDNN < (9, 23, 0):
                raise ValueError(NO_BACKEND)
        if comm in ("a2a", "a2a+p2p"):
            group = self.cp_group if comm == "a2a" else self.cp_group[0]
            size = dist.get_world_size(group)
            assert q.shape[-2] % size == 0 and k.shape[-2] % size == 0, \
                "cp_comm_type='a2a' requires num_heads % cp_size == 0 for Q, K, V."
        if qkv_format == "thd":
            assert torch.all(cu_seqlens_q_padded % (2 * self._cp_size()) == 0)

    @staticmethod
    def _to_bhsd(t, qkv_format):
        if qkv_format == "bshd":
            return t.transpose(1, 2)
        if qkv_format == "sbhd":
            return t.permute(1, 2, 0, 3)
        return t.transpose(0, 1).unsqueeze(0)

    @staticmethod
    def _from_bhsd(t, qkv_format):
        if qkv_format == "bshd":
            return t.transpose(1, 2)
        if qkv_format == "sbhd":
            return t.permute(2, 0, 1, 3)
        return t[0].transpose(0, 1)
