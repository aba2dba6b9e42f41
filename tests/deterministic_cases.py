"""The cases of the deterministic-mode tests (tests/test_deterministic.py: ``a2a``; tests/test_deterministic_tiles.py:
the patterns on canonical tiles) and what runs one: an attention call's global results (output, log-sum-exp, the
gradients), the reference GPT's logits and per-token losses, the handler of a case. Every rank calls them with the
same inputs; the reference is the same call with no group (cp 1)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from cp_handler import LocalContextParallelHandler

S, D = 384, 16  # 384 tokens: a multiple of 2 x cp for every cp of the files (zigzag chunks)
CASES = [  # (name, query heads, key-value heads, dtype, attn_mask_type, window, qkv_format)
    ("mha-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("gqa-bf16", 8, 4, torch.bfloat16, "causal", None, "bshd"),
    ("full-fp32", 8, 8, torch.float32, "no_mask", None, "bshd"),
    ("window-fp32", 8, 8, torch.float32, "causal", (37, 0), "bshd"),
    ("four-heads-fp32", 4, 4, torch.float32, "causal", None, "bshd"),  # one head per rank at cp 4, padded at 6 and 8
    ("thd-fp32", 8, 8, torch.float32, "causal", None, (100, 37, 1, 180, 66)),
    ("thd-gqa-bf16", 8, 4, torch.bfloat16, "causal", None, (5, 290, 89)),
    ("chunks-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("softcap-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("sinks-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("mla-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("sbhd-fp32", 8, 8, torch.float32, "causal", None, "sbhd"),
    ("thd-chunks-fp32", 8, 8, torch.float32, "causal", None, (100, 37, 1, 180, 66)),
    ("thd-softcap-fp32", 8, 8, torch.float32, "causal", None, (100, 37, 1, 180, 66)),
    ("thd-sinks-fp32", 8, 8, torch.float32, "causal", None, (100, 37, 1, 180, 66)),
    ("thd-mla-fp32", 8, 8, torch.float32, "causal", None, (100, 37, 1, 180, 66)),
    ("thd-window-fp32", 8, 8, torch.float32, "causal", (37, 0), (100, 37, 1, 180, 66)),
]
"""``qkv_format``: a tuple is a thd pack of those document lengths; a ``thd-`` case is its variant on a pack."""
VARIANTS = {"chunks-fp32": {"attention_chunk_size": 48}, "softcap-fp32": {"softcap": 2.0},
            "sinks-fp32": {"sinks": 0.5}}
"""Attributes of the attention module per case (Llama 4's chunks, Gemma 2's soft-cap, gpt-oss's sinks: a learnable
logit per query head, its gradient compared too); ``mla``: a value head dim of 24 against 16 (multi-head latent
attention's widths)."""
RESULTS = ("output", "dq", "dk", "dv", "dsinks")
"""What :func:`results` returns, in order (``dsinks`` only with sinks)."""


def case_runs_heads(heads: int, kv_heads: int, cp: int) -> bool:
    """Whether the mode's ``a2a`` runs these heads at ``cp`` (a key-value head's query heads on one rank)."""
    return heads == kv_heads or kv_heads % cp == 0


def results(handler, case, seq_len: int = S, device: str = "cpu") -> list[torch.Tensor]:
    """The global output and the gradients of q, k and v of one call of ``case`` (``CASES``' form) through
    ``handler`` (combined over the group) on ``device`` (the inputs drawn on the CPU); with sinks, their gradient too
    (summed over the group: each rank's heads' share)."""
    name, heads, kv_heads, dtype, mask_type, window, fmt = case
    g = torch.Generator().manual_seed(0)
    shape, dim = (((sum(fmt),), 0) if isinstance(fmt, tuple) else ((seq_len, 1), 0) if fmt == "sbhd" else
                  ((1, seq_len), 1))
    variant = name.removeprefix("thd-")
    dv = 24 if variant.startswith("mla") else D
    q = torch.randn(*shape, heads, D, generator=g).to(device, dtype)
    dout = torch.randn(*shape, heads, dv, generator=g).to(device, dtype)
    k = torch.randn(*shape, kv_heads, D, generator=g).to(device, dtype)
    v = torch.randn(*shape, kv_heads, dv, generator=g).to(device, dtype)
    module = torch.nn.Module()
    module.softmax_scale, module.window_size = 0.25, window
    for attr, value in VARIANTS.get(variant, {}).items():
        setattr(module, attr, torch.nn.Parameter((torch.full((heads,), value) + torch.arange(heads) / heads).to(device))
                if attr == "sinks" else value)
    local = [handler.dispatch(t, dim).detach().requires_grad_() for t in (q, k, v)]
    out = handler.core_attn(module, *local, attn_mask_type=mask_type)
    out.backward(handler.dispatch(dout, dim))
    got = [handler.combine(t, dim) for t in (out.detach(), *(t.grad for t in local))]
    if hasattr(module, "sinks"):
        grad = module.sinks.grad.clone()
        if handler.cp_size > 1:
            torch.distributed.all_reduce(grad, group=handler.cp_group)
        got.append(grad)
    return got


@contextlib.contextmanager
def captured_lse():
    """Within it, every attention call a handler makes (the canonical tiles' ``canonical_attention``, what ``p2p`` and
    ``all_gather`` run in the mode, and each pattern's blockwise ``attention``; ``a2a`` and ``a2a+p2p`` asked for
    theirs) appends its forward's log-sum-exp (float32 ``(B, H, S_local)``, the token dim last, in the rank's
    sequence layout) to the list it yields. Handlers built inside it see the wrapped patterns."""
    import dataclasses

    import cp_handler.handlers.local as local
    from cp_handler.ops.patterns import PATTERNS

    seen, real, patterns = [], local.canonical_attention, dict(PATTERNS)

    def recorded(attention, lse_arg: bool):
        def wrapped(*args, **kwargs):
            out, lse = attention(*args, **kwargs, **({"return_lse": True} if lse_arg else {}))
            seen.append(lse.detach())
            return out, lse
        return wrapped

    local.canonical_attention = recorded(real, False)
    for name, pattern in patterns.items():
        PATTERNS[name] = dataclasses.replace(pattern, attention=recorded(pattern.attention, pattern.splits_heads))
    try:
        yield seen
    finally:
        local.canonical_attention = real
        PATTERNS.update(patterns)


def results_with_lse(make_handler, case, seq_len: int = S) -> list[torch.Tensor]:
    """:func:`results` of one call through the handler ``make_handler()`` builds (inside :func:`captured_lse`, so its
    pattern is the wrapped one), then the call's log-sum-exp combined into global order."""
    with captured_lse() as seen:
        handler = make_handler()
        got = results(handler, case, seq_len)
    lse, = seen  # one forward call
    return [*got, handler.combine(lse, lse.dim() - 1)]


def case_handler(group, fmt="bshd", comm_type: str = "a2a", levels=None, deterministic: bool = True):
    """The handler of a case's ``fmt`` (``CASES``' last field; thd: built for its pack) on ``comm_type``; ``levels``
    (a2a+p2p's groups from ``build_dp_cp_groups``) used when ``group`` is not ``None``."""
    kwargs = {}
    if isinstance(fmt, tuple):
        kwargs = {"qkv_format": "thd", "cu_seqlens": torch.tensor([0, *torch.tensor(fmt).cumsum(0).tolist()],
                                                                   dtype=torch.int32)}
    elif fmt == "sbhd":
        kwargs = {"qkv_format": "sbhd"}
    if levels is not None and group is not None:
        group, kwargs["hierarchical_cp_groups"] = levels.cp_group, list(levels.hierarchical_cp_groups)
    return LocalContextParallelHandler(cp_group=group, cp_comm_type=comm_type, deterministic=deterministic, **kwargs)


def gpt_outputs(handler, seq_len: int = S, dtype: torch.dtype = torch.float32, device: str = "cpu"
                ) -> list[torch.Tensor]:
    """The reference GPT's (8 heads, 2 layers, in ``dtype`` on ``device``) global logits of ``seq_len`` tokens and its
    per-token losses, each computed on the rank's own tokens (its shard of the logits against its shard of the labels)
    and combined into global order."""
    from cp_handler.models import GPTConfig, GPTModel

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=8,
                               num_query_groups=8, ffn_hidden_size=128)).to(device, dtype)
    tokens = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(1)).to(device)
    inputs, labels = (handler.dispatch(t, 1) for t in (tokens[:, :-1], tokens[:, 1:]))
    with torch.no_grad():
        logits = model(inputs, cp_handler=handler)
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    return [handler.combine(logits, 1), handler.combine(losses, 1)]


GPT_OUTPUTS = ("logits", "losses")
"""What :func:`gpt_outputs` returns, in order."""


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor], what: str, lse: bool = False,
                 names: tuple[str, ...] = RESULTS) -> None:
    """``torch.equal`` of each result (``names`` in order: :data:`RESULTS`, or :data:`GPT_OUTPUTS`; with ``lse``,
    :func:`results_with_lse`'s, the log-sum-exp last), the first difference named with ``what`` and its largest
    magnitude."""
    names = (*names[:len(got) - 1], "lse") if lse else names[:len(got)]
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b), f"{what} {name}: max difference {(a.float() - b.float()).abs().max().item():.3e}"
