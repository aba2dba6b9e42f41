"""The deterministic mode (``LocalContextParallelHandler(deterministic=True)``, issue 73's first step): attention's
output and the gradients of q, k and v are ``torch.equal`` at cp 2, 3, 4, 6 and 8 to cp 1 on the same global inputs:
fp32 and bf16, MHA and GQA, causal and full, a sliding window (bshd); and the reference GPT's logits (so its per-token
losses) at cp 2, 3, 4 and 6. The negative control: the default ring (p2p) on
the same inputs differs in at least one bit at cp 2, so the comparison can fail. Its refusals by name: another comm
type, one query-head slot per rank, key-value heads the CP size does not divide, thd packs, another kernel.

Tolerances: none (bitwise).
"""

import pytest
import torch
from dist_utils import new_cp_group, run_distributed

from cp_handler import LocalContextParallelHandler

S, D = 384, 16  # 384 tokens: a multiple of 2 x cp for every cp of the file (zigzag chunks)
CASES = [  # (name, query heads, key-value heads, dtype, attn_mask_type, window, qkv_format)
    ("mha-fp32", 8, 8, torch.float32, "causal", None, "bshd"),
    ("gqa-bf16", 8, 4, torch.bfloat16, "causal", None, "bshd"),
    ("full-fp32", 8, 8, torch.float32, "no_mask", None, "bshd"),
    ("window-fp32", 8, 8, torch.float32, "causal", (37, 0), "bshd"),
]


def _case_runs(name: str, cp: int) -> bool:
    _, heads, kv_heads, *_ = next(c for c in CASES if c[0] == name)
    return heads > cp and (heads == kv_heads or kv_heads % cp == 0)


def _results(handler, case) -> list[torch.Tensor]:
    """The global output and the gradients of q, k and v of one call (combined over the group)."""
    _, heads, kv_heads, dtype, mask_type, window, _ = case
    g = torch.Generator().manual_seed(0)
    shape = (1, S)
    q, dout = (torch.randn(*shape, heads, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(*shape, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    module = torch.nn.Module()
    module.softmax_scale, module.window_size = 0.25, window
    local = [handler.dispatch(t, 1).detach().requires_grad_() for t in (q, k, v)]
    out = handler.core_attn(module, *local, attn_mask_type=mask_type)
    out.backward(handler.dispatch(dout, 1))
    return [handler.combine(t, 1) for t in (out.detach(), *(t.grad for t in local))]


def _gpt_logits(handler) -> torch.Tensor:
    """The reference GPT's global logits (8 heads, 2 layers, fp32) of 384 tokens."""
    from cp_handler.models import GPTConfig, GPTModel

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=8,
                               num_query_groups=8, ffn_hidden_size=128))
    tokens = torch.randint(0, 256, (1, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return handler.combine(model(handler.dispatch(tokens, 1), cp_handler=handler), 1)


def _handler(group, comm_type="a2a", deterministic=True):
    return LocalContextParallelHandler(cp_group=group, cp_comm_type=comm_type, deterministic=deterministic)


def _worker(rank, world):
    torch.manual_seed(0)
    group = new_cp_group()
    for case in CASES:
        if not _case_runs(case[0], world):
            continue
        want = _results(_handler(None), case)  # one process, on every rank: the same inputs
        got = _results(_handler(group), case)
        for what, a, b in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
            assert torch.equal(a, b), f"{case[0]} cp {world} {what}: max difference {(a - b).abs().max().item():.3e}"
    if world < 8:  # the reference GPT (8 heads): its logits, so its per-token losses, bitwise cp 1's
        want = _gpt_logits(_handler(None))
        got = _gpt_logits(_handler(group))
        assert torch.equal(got, want), f"GPT logits cp {world}: max difference {(got - want).abs().max().item():.3e}"
    if world == 2:  # the negative control: the default ring on the same inputs is not bitwise one process's
        case = CASES[0]
        want = _results(_handler(None), case)
        got = _results(_handler(group, "p2p", deterministic=False), case)
        assert not all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("world", [2, 3, 4, 6, 8])
def test_attention_is_bitwise_the_same_at_every_cp_degree(world):
    run_distributed(_worker, world)


def _refusal_worker(rank, world):
    group = new_cp_group()
    with pytest.raises(ValueError, match=r"runs the Ulysses all-to-all \('a2a'\) only, not \['p2p'\]"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", deterministic=True)
    for heads, kv_heads, rule in ((4, 4, "each rank needs at least 2 query head slots"),
                                  (8, 2, "a key-value head's query heads would sit on several ranks")):
        handler = LocalContextParallelHandler(cp_group=group, cp_comm_type="a2a", deterministic=True)
        q = torch.zeros(1, 2 * S // world, heads, D)
        kv = torch.zeros(1, 2 * S // world, kv_heads, D)
        module = torch.nn.Module()
        module.softmax_scale = 0.25
        with pytest.raises(ValueError, match=rule):
            handler.core_attn(module, q, kv, kv, attn_mask_type="causal")


def test_what_the_mode_does_not_make_bitwise_is_refused_by_name():
    run_distributed(_refusal_worker, 4)
    with pytest.raises(ValueError, match="pins the block kernel to 'cpu_flash'"):
        LocalContextParallelHandler(cp_group=None, deterministic=True, attn_kernel="flash")
    with pytest.raises(ValueError, match="deterministic=True with qkv_format='thd': packed documents are padded"):
        LocalContextParallelHandler(cp_group=None, deterministic=True, qkv_format="thd",
                                    cu_seqlens=torch.tensor([0, 5, 12], dtype=torch.int32))
