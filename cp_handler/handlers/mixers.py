"""The handler's mixer methods: token mixers other than attention over the whole sequence, from local inputs.

Model code calls them as it calls ``core_attn``, with its own kernel (or the plain one here), and stays
one-device code: at cp = 1 (bshd) each method is the kernel itself; under CP it is exact by a halo of left
context (the causal convolution) or by state passing (the linear recurrences), docs/hybrid.md:

* :meth:`~ZigzagMixers.causal_conv1d`: a causal depthwise convolution ``(B, C, S)``;
* :meth:`~ZigzagMixers.gated_delta_rule`: Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid) and Kimi delta
  attention (its per-channel decay), FLA's ``chunk_gated_delta_rule`` API;
* :meth:`~ZigzagMixers.ssd_scan`: Mamba2's scan (``mamba_chunk_scan_combined`` API);
* :meth:`~ZigzagMixers.selective_scan`: Mamba's scan (``selective_scan_fn`` API).

State arguments (an initial state, a final state asked for, packed-sequence metadata such as ``cu_seqlens`` or
``seq_idx``: the handler's layout is the truth) and any other argument a method does not implement are
refused by name. On CUDA tensors the methods are opt-in (``CP_HANDLER_CUDA_MIXERS=1``) until a GPU run. Layouts
other than the zigzag one (MagiAttention's, the decode step's) refuse every
method by name (:class:`Mixers`): generation for models with these mixers is not implemented.
"""

from __future__ import annotations

import os

import torch

from ..ops.mixers import conv, delta_rule, selective, ssd

MIXERS = ("causal_conv1d", "gated_delta_rule", "ssd_scan", "selective_scan")
"""The mixer methods of the contract."""


class Mixers:
    """The mixer component of a handler whose layout does not run token mixers other than attention: each method
    raises ``ValueError`` by name. A handler holds one (``handler.mixers``, the class its token layout names:
    :attr:`~.token_layout.TokenLayout.mixers_cls`) and its mixer methods call it under the call guard.

    Args:
        handler: the :class:`~.base.ContextParallelHandler` it belongs to.
    """

    runs_mixers = False
    """Whether the mixer methods run (checked before spawning a model with such layers)."""

    def __init__(self, handler):
        self.handler = handler
        self.calls: dict[str, int] = {}

    def refusal(self, name: str) -> str:
        return (f"{type(self.handler).__name__}.{name}: this backend does not run token mixers other than attention "
                "under context parallelism (they need the zigzag layout of backend='local' or 'transformer_engine')")

    def causal_conv1d(self, x, weight, bias=None, activation=None, *, conv_fn=None, **conv_kwargs):
        raise ValueError(self.refusal("causal_conv1d"))

    def gated_delta_rule(self, query, key, value, g, beta, *, kernel=None, **kernel_kwargs):
        raise ValueError(self.refusal("gated_delta_rule"))

    def ssd_scan(self, x, dt, A, B, C, chunk_size, *, kernel, **kernel_kwargs):
        raise ValueError(self.refusal("ssd_scan"))

    def selective_scan(self, u, delta, A, B, C, *, kernel, **kernel_kwargs):
        raise ValueError(self.refusal("selective_scan"))


STATE_ARGUMENTS = {"initial_state": None, "initial_states": None, "output_final_state": False,
                   "return_final_states": False, "return_last_state": False, "cu_seqlens": None, "seq_idx": None,
                   "cu_seq_lens_q": None, "cu_seq_lens_k": None, "conv_state": None, "cache_params": None}
"""Arguments a mixer method takes only at these values (a state passed in or out, packed-sequence metadata)."""
CACHE_ARGUMENTS = frozenset({"output_final_state", "return_final_states", "return_last_state", "conv_state",
                             "cache_params", "initial_state", "initial_states"})
"""Of those, the ones a forward with a cache (``use_cache=True``) passes."""


CUDA_OPT_IN = "CP_HANDLER_CUDA_MIXERS"
"""Environment variable that opts in to the mixer methods on CUDA tensors (``1``): no GPU has run them yet."""


def check_device(name: str, x: torch.Tensor) -> None:
    """Raises ValueError for a CUDA tensor unless :data:`CUDA_OPT_IN` is ``1``: the mixer methods are exact on CPU
    (tests/test_hybrid.py) but have not been run on a GPU (docs/hybrid.md, docs/testing.md: pending)."""
    if x.device.type == "cuda" and os.environ.get(CUDA_OPT_IN) != "1":
        raise ValueError(f"{name}: the mixer methods have not yet been run on a GPU (docs/hybrid.md); opt in with "
                         f"{CUDA_OPT_IN}=1 to run them on CUDA tensors")


def check_arguments(name: str, kwargs: dict, passed_on: tuple[str, ...], neutral: dict | None = None) -> dict:
    """The kernel keywords of a mixer call: ``passed_on`` are given to the kernel, :data:`STATE_ARGUMENTS` (and
    ``neutral``) at their neutral value dropped (they say nothing), anything else refused by name (ValueError)."""
    neutral = {**STATE_ARGUMENTS, **(neutral or {})}
    refused = {k: v for k, v in kwargs.items() if k not in passed_on and not (
        k in neutral and (v is None or v is neutral[k]))}
    if refused:
        shown = ", ".join(f"{k}=" + (f"tensor {tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v))
                          for k, v in refused.items())
        cache = set(refused) & CACHE_ARGUMENTS
        remedy = (f" {sorted(cache)} come from a forward that keeps a cache (a config's use_cache=True): pass "
                  "use_cache=False to the model's forward for training; generation: cp-generate" if cache else "")
        raise ValueError(f"{name}: arguments not implemented under context parallelism: {shown} (a recurrent or "
                         "convolution state passed in or out, packed-sequence metadata: the handler's layout is the "
                         "documents, and the state passes between ranks inside the method); refused instead of "
                         f"dropped.{remedy}")
    return {k: v for k, v in kwargs.items() if k in passed_on}


class ZigzagMixers(Mixers):
    """The mixer component of the zigzag layout (module doc)."""

    runs_mixers = True

    def _mixer_call(self, name: str, local_len: int, tensors: tuple, kwargs: dict, passed_on: tuple[str, ...],
                    neutral: dict | None = None):
        """The checks of a mixer call, the ranks agreeing once per call site (no KV cache, the arguments, the local
        length): ``(layout, the keywords passed on to the kernel)``."""
        options = {}

        def local_checks():
            if self.handler.deterministic:
                raise ValueError(f"{name}: deterministic=True: token mixers other than attention are not bitwise the "
                                 "same at every CP degree (the halo convolution and the state passing compute in "
                                 "pieces that follow the CP group: 1e-7 to 4e-6 apart at cp 2 and 4, measured); "
                                 "refused (docs/deterministic.md)")
            if getattr(self.handler, "kv_cache", None) is not None:
                raise ValueError(f"{name}: generation (a KV cache) of a model with token mixers other than attention "
                                 "is not implemented: a decode step would need each sequence's convolution and "
                                 "recurrent state where its last token is; refused")
            check_device(name, tensors[0])
            options.update(check_arguments(name, kwargs, passed_on, neutral))
            self.handler.token_layout.layout(local_len)
            shapes = [(tuple(t.shape), str(t.dtype)) for t in tensors if t is not None]
            passed = sorted((k, repr(v)) for k, v in options.items() if not isinstance(v, torch.Tensor))
            return {"local_len": local_len, "shapes": f"{shapes}, options {passed}"}

        self.calls[name] = self.calls.get(name, 0) + 1
        self.handler.agreement.checked(f"{name} (call {self.calls[name]})", tensors[0].device, ("local_len", "shapes"),
                                       local_checks)
        return self.handler.token_layout.layout(local_len), options

    def causal_conv1d(self, x, weight, bias=None, activation=None, *, conv_fn=None, **conv_kwargs):
        """A causal depthwise convolution of the whole sequence at this rank's rows.

        Args:
            x: ``(B, C, S_local)``; weight: ``(C, K)``; bias: ``(C,)`` or ``None``; activation: ``"silu"`` or
                ``None``. conv_fn: the kernel (default :func:`~cp_handler.ops.mixers.conv.depthwise_causal_conv1d`).

        Returns:
            ``(B, C, S_local)`` (zero at thd padding rows). Raises ValueError: see the module doc.
        """
        layout, _ = self._mixer_call("causal_conv1d", x.shape[2], (x, weight, bias), conv_kwargs, ())
        return conv.causal_conv1d(conv_fn or conv.depthwise_causal_conv1d, x, weight, bias, activation,
                                  layout=layout, rank=self.handler.cp_rank, group=self.handler.cp_group)

    def gated_delta_rule(self, query, key, value, g, beta, *, kernel=None, **kernel_kwargs):
        """The gated delta rule over the whole sequence (:func:`~cp_handler.ops.mixers.delta_rule.gated_delta_rule`).

        Args:
            query, key: ``(B, S_local, Hk, Dk)``; value: ``(B, S_local, Hv, Dv)``; g: ``(B, S_local, Hv)`` (KDA:
                ``(B, S_local, H, Dk)``); beta: ``(B, S_local, Hv)``. kernel: FLA's ``chunk_gated_delta_rule`` API
                (default :func:`~cp_handler.ops.mixers.delta_rule.chunk_gated_delta_rule`); ``chunk_size``,
                ``use_qk_l2norm_in_kernel``, ``scale`` passed on.

        Returns:
            ``(B, S_local, Hv, Dv)``. Raises ValueError: see the module doc.
        """
        layout, options = self._mixer_call("gated_delta_rule", query.shape[1], (query, key, value, g, beta),
                                           kernel_kwargs, ("chunk_size", "use_qk_l2norm_in_kernel", "scale"))
        return delta_rule.gated_delta_rule(kernel or delta_rule.chunk_gated_delta_rule, query, key, value, g, beta,
                                           layout=layout, rank=self.handler.cp_rank, group=self.handler.cp_group,
                                           **options)

    def ssd_scan(self, x, dt, A, B, C, chunk_size, *, kernel, **kernel_kwargs):
        """Mamba2's scan over the whole sequence (:func:`~cp_handler.ops.mixers.ssd.ssd_scan`); ``D``,
        ``dt_bias``, ``dt_softplus``, ``dt_limit`` passed on, ``z`` (a gate inside the scan) refused unless ``None``.

        Returns:
            ``(B, S_local, H, P)``. Raises ValueError: see the module doc.
        """
        layout, options = self._mixer_call("ssd_scan", x.shape[1], (x, dt, A, B, C),
                                           {"chunk_size": chunk_size, **kernel_kwargs},
                                           ("chunk_size", "D", "dt_bias", "dt_softplus", "dt_limit"), {"z": None})
        options.pop("chunk_size")
        return ssd.ssd_scan(kernel, x, dt, A, B, C, chunk_size, layout=layout, rank=self.handler.cp_rank,
                            group=self.handler.cp_group, **options)

    def selective_scan(self, u, delta, A, B, C, *, kernel, **kernel_kwargs):
        """Mamba's selective scan over the whole sequence (:func:`~cp_handler.ops.mixers.selective.selective_scan`);
        ``D``, ``z``, ``delta_bias``, ``delta_softplus`` passed on (and transformers' ``use_mambapy`` /
        ``use_associative_scan``, which choose how its torch kernel scans).

        Returns:
            ``(B, D_inner, S_local)``. Raises ValueError: see the module doc.
        """
        layout, options = self._mixer_call("selective_scan", u.shape[2], (u, delta, A, B, C), kernel_kwargs,
                                           ("D", "z", "delta_bias", "delta_softplus", "use_mambapy",
                                            "use_associative_scan"))
        return selective.selective_scan(kernel, u, delta, A, B, C, layout=layout,
                                        rank=self.handler.cp_rank, group=self.handler.cp_group, **options)
