"""Fake ``transformer_engine.pytorch.DotProductAttention`` enforcing TE's documented CP contract.

Signatures follow TE's DotProductAttention (``__init__``, ``set_context_parallel_group`` with
``load_balancing_strategy``, ``forward``); restrictions follow TE's ``attn_forward_func_with_cp``
and its a2a helper. With ``cp_group=None`` it runs without CP, as TE does (silently).
"""

import torch
import torch.distributed as dist
from torch import nn

from cp_handler.layout import ZigzagDocs
from cp_handler.ops.all_gather import all_gather_attn
from cp_handler.ops.ring import ring_attn
from cp_handler.ops.ulysses import a2a_attn

from .constants import CPLoadBalancingStrategy

CALLS: list[dict] = []


class DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, bottom_right_diagonal=None,
                 sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None, layer_number=None,
                 attention_type="self", cp_group=None, cp_global_ranks=None, cp_stream=None, cp_comm_type="p2p",
                 softmax_scale=None, softmax_type="vanilla", return_max_logit=False, name=None):
        super().__init__()
        assert num_attention_heads % (num_gqa_groups or num_attention_heads) == 0
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.num_gqa_groups = num_gqa_groups or num_attention_heads
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.layer_number, self.softmax_scale = layer_number, softmax_scale or kv_channels**-0.5
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        CALLS.append({"call": "__init__", "qkv_format": qkv_format, "layer_number": layer_number,
                      "num_attention_heads": num_attention_heads, "num_gqa_groups": num_gqa_groups})

    def set_context_parallel_group(self, cp_group, cp_global_ranks, cp_stream, cp_comm_type="p2p",
                                   load_balancing_strategy=CPLoadBalancingStrategy.DUAL_CHUNK_SWAP):
        assert isinstance(load_balancing_strategy, CPLoadBalancingStrategy)
        self.cp_group, self.cp_global_ranks, self.cp_stream, self.cp_comm_type = (
            cp_group, cp_global_ranks, cp_stream, cp_comm_type)
        CALLS.append({"call": "set_context_parallel_group", "cp_group": cp_group, "cp_global_ranks": cp_global_ranks,
                      "cp_comm_type": cp_comm_type, "module": id(self)})

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None, cu_seqlens_q=None,
                cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None,
                max_seqlen_kv=None, attn_mask_type=None, window_size=None, checkpoint_core_attention=False,
                core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None,
                fast_zero_fill=True, inference_params=None, pad_between_seqs=None, fp8_output=False):
        qkv_format = qkv_format or self.qkv_format
        mask = attn_mask_type or self.attn_mask_type
        window = window_size or self.window_size
        CALLS.append({"call": "forward", "qkv_format": qkv_format, "attn_mask_type": mask, "cp_group": self.cp_group,
                      "cp_comm_type": self.cp_comm_type, "cu_seqlens_q": cu_seqlens_q,
                      "cu_seqlens_q_padded": cu_seqlens_q_padded, "max_seqlen_q": max_seqlen_q})
        if qkv_format == "thd":
            assert "padding" in mask, "thd needs a padding mask type"
            assert cu_seqlens_q is not None and cu_seqlens_kv is not None
        cp = self.cp_group is not None
        if cp:
            self._check_cp(qkv_format, window, query_layer, key_layer, cu_seqlens_q_padded)
        q, k, v = (self._to_bhsd(t, qkv_format) for t in (query_layer, key_layer, value_layer))
        layout = None
        if qkv_format == "thd":
            lengths = torch.diff(cu_seqlens_q.cpu()).tolist()
            size = self._cp_size() if cp else 1
            padded = torch.diff(cu_seqlens_q_padded.cpu()).tolist() if cp else lengths
            layout = ZigzagDocs(tuple(lengths), tuple(padded), size)
        kwargs = {"causal": "causal" in mask, "scale": self.softmax_scale, "layout": layout}
        comm = self.cp_comm_type if cp else "p2p"
        if not cp:
            out = ring_attn(q, k, v, group=None, **kwargs)[0]
        elif comm == "p2p":
            out = ring_attn(q, k, v, group=self.cp_group, **kwargs)[0]
        elif comm == "all_gather":
            out = all_gather_attn(q, k, v, group=self.cp_group, **kwargs)[0]
        elif comm == "a2a":
            out = a2a_attn(q, k, v, group=self.cp_group, **kwargs)[0]
        else:
            out = a2a_attn(q, k, v, group=self.cp_group[0], inner_group=self.cp_group[1], **kwargs)[0]
        return self._from_bhsd(out, qkv_format, query_layer).flatten(-2)

    def _cp_size(self):
        if isinstance(self.cp_group, list):
            return dist.get_world_size(self.cp_group[0]) * dist.get_world_size(self.cp_group[1])
        return dist.get_world_size(self.cp_group)

    def _check_cp(self, qkv_format, window, q, k, cu_seqlens_q_padded):
        comm = self.cp_comm_type
        if comm == "a2a+p2p":
            assert isinstance(self.cp_group, list) and len(self.cp_group) == 2, "needs multi-level CP groups"
            assert qkv_format != "thd", "thd is not supported with hierarchical CP"
        else:
            assert isinstance(self.cp_group, dist.ProcessGroup), f"unsupported group for {comm}"
        assert qkv_format != "thd" or cu_seqlens_q_padded is not None, "cu_seqlens_padded cannot be None with CP + thd"
        assert not (window not in (None, (-1, 0), (-1, -1)) and comm not in ("a2a", "all_gather")), "no SWA"
        if comm == "all_gather":
            assert qkv_format != "thd", "thd format is not supported!"
        if comm in ("a2a", "a2a+p2p"):
            group = self.cp_group if comm == "a2a" else self.cp_group[0]
            size = dist.get_world_size(group)
            assert q.shape[-2] % size == 0 and k.shape[-2] % size == 0, "heads must divide by CP size"
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
    def _from_bhsd(t, qkv_format, like):
        if qkv_format == "bshd":
            return t.transpose(1, 2)
        if qkv_format == "sbhd":
            return t.permute(2, 0, 1, 3)
        return t[0].transpose(0, 1)
