"""Generation under CP (cp_handler/inference): a prefill over prompts dispatched across the group fills a
KV cache sharded over it, then decode steps attend each new token to every shard and merge exactly.

Checked against the model alone re-run on the whole sequence for every token (``reference_generate``,
no cache, no handler): the same greedy tokens, and every step's logits within 1e-5 (float32: the
attention sums are reordered by the shards and merges; measured <= 2.1e-7 on logits of order 1), at
cp 1, 2, 4 with p2p, all_gather, a2a and a2a+p2p prefills, prompts whose lengths are not multiples of
2 * cp; the reference GPT and a Hugging Face Llama through the documented route. KV bytes per rank:
the shards sum to the whole cache and each holds at most its fair share plus one token per sequence.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from cp_handler import build_dp_cp_groups
from cp_handler.inference import DecodeHandler, KVCache, Sampling, generate, reference_generate
from cp_handler.models import GPTConfig, GPTModel

TOL = 1e-5
PROMPT_LENGTHS = (13, 30, 5)  # none a multiple of 2 * cp at cp 2 or 4
NEW_TOKENS = 6


def gpt(v_head_dim=None):
    torch.manual_seed(0)
    return GPTModel(GPTConfig(hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=128, v_head_dim=v_head_dim)).eval()


def gpt_mla():
    """Multi-head latent attention: values 24 wide, queries and keys 16 (the cache holds each width)."""
    return gpt(v_head_dim=24)


def llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from cp_handler.integrations.transformers import CPCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return CPCausalLM(AutoModelForCausalLM.from_config(copy.deepcopy(config))).eval()


def prompts():
    return [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in PROMPT_LENGTHS]


def _worker(rank, world, comm_types, build):
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2] if world >= 4 else None)
    model = build()
    want = reference_generate(model, prompts(), NEW_TOKENS)
    whole = sum(PROMPT_LENGTHS) + len(PROMPT_LENGTHS) * (NEW_TOKENS - 1)  # cached tokens per layer at the end
    for comm in comm_types:
        got = generate(model, prompts(), NEW_TOKENS, cp_group=groups.cp_group if world > 1 else None,
                       cp_comm_type=comm, hierarchical_cp_groups=groups.hierarchical_cp_groups, num_layers=2)
        label = f"{build.__name__} {comm} cp={world}"
        assert got.tokens == want.tokens, (label, got.tokens, want.tokens)
        for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m, s=step, x=label: f"{x} step {s}: {m}")
        total = torch.tensor([got.kv_cache_bytes])
        if world > 1:
            dist.all_reduce(total)
        v_head_dim = getattr(getattr(model, "config", None), "v_head_dim", 16)
        per_token = 2 * 2 * (16 + v_head_dim) * 4  # 2 layers, 2 KV heads, K (16) and V (v_head_dim), float32
        assert total.item() == whole * per_token, (label, total.item(), whole * per_token)
        fair = -(-whole // world) + 2 * world * len(PROMPT_LENGTHS)  # zigzag padding of each prompt, per rank
        assert got.kv_cache_bytes <= fair * per_token, (label, got.kv_cache_bytes, fair * per_token)
    # stop_token: generation ends after the step at which every prompt has produced it (a token the first prompt
    # produces at step 2; the others may never: then the batch runs to NEW_TOKENS), with the same tokens and logits
    for prompt_ids in ([0], range(len(PROMPT_LENGTHS))):
        stop = want.tokens[0][2]
        ends = [w.index(stop) if stop in w else NEW_TOKENS - 1 for w in (want.tokens[i] for i in prompt_ids)]
        got = generate(model, [prompts()[i] for i in prompt_ids], NEW_TOKENS, cp_group=groups.cp_group if world > 1
                       else None, num_layers=2, stop_token=stop)
        assert got.tokens == [want.tokens[i][:max(ends) + 1] for i in prompt_ids], (got.tokens, want.tokens, stop)
        assert len(got.logits) == max(ends) + 1 and (len(ends) > 1 or max(ends) <= 2), (ends, len(got.logits))
        for a, b in zip(got.logits, want.logits, strict=False):
            torch.testing.assert_close(a, b[list(prompt_ids)], atol=TOL, rtol=TOL)
    # sampled: the same tokens on every rank as one process drawing with the same seed, and every step's logits
    # those of the model alone after these tokens
    sampling = Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=1)
    group = groups.cp_group if world > 1 else None
    got = generate(model, prompts(), NEW_TOKENS, cp_group=group, num_layers=2, sampling=sampling)
    alone = generate(model, prompts(), NEW_TOKENS, num_layers=2, sampling=sampling)
    assert got.tokens == alone.tokens and got.tokens != want.tokens, (got.tokens, alone.tokens, want.tokens)
    followed = reference_generate(model, prompts(), NEW_TOKENS, follow=got.tokens)
    for step, (a, b) in enumerate(zip(got.logits, followed.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m, s=step: f"sampled step {s}: {m}")


@pytest.mark.parametrize("world, comm_types", [(1, ["p2p"]), (2, ["p2p", "all_gather", "a2a"]),
                                               (4, ["p2p", "all_gather", "a2a", "a2a+p2p"])])
def test_greedy_generation_matches_one_process(world, comm_types):
    run_distributed(_worker, world, comm_types, gpt)


def test_mla_generation_matches_one_process():
    run_distributed(_worker, 2, ["p2p", "a2a"], gpt_mla)


def test_hugging_face_llama_generates_the_same_tokens():
    run_distributed(_worker, 2, ["p2p", "a2a"], llama)


VARIANTS = {"mistral": {"sliding_window": 5}, "gemma2": {"sliding_window": 6, "attn_logit_softcapping": 0.5},
            "gpt_oss": {"sliding_window": 6}, "llama4_text": {"attention_chunk_size": 8}, "diffllama": {}}
"""Decode with each attention variant (:mod:`cp_handler.core.masks`), small enough to matter at these lengths:
sliding windows of 5-6 tokens, a soft-cap of 0.5 (the scores of this tiny model reach ~1; Gemma 2's 50
would change nothing), GPT-OSS's learnable sinks (set to N(0, 1): their default init is ~0), chunks of 8;
and DiffLlama, whose layers call attention twice per forward (one cache shard per call; no variant, so
no negative control)."""


def _variant_models(model_type):
    """``(CPCausalLM, the unmodified model)`` of ``model_type`` with :data:`VARIANTS`, same weights."""
    from hf_zoo import tiny_config
    from transformers import AutoModelForCausalLM

    from cp_handler.integrations.transformers import CPCausalLM

    config = tiny_config(model_type)
    for name, value in {**VARIANTS[model_type], "vocab_size": 256}.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    for name, param in model.named_parameters():
        if name.endswith(".sinks"):
            param.data.normal_()
    return CPCausalLM(copy.deepcopy(model)).eval(), model


def _variants_worker(rank, world, model_types, first=3):  # the first `first` prompts
    from cp_handler.core.masks import CAUSAL
    from cp_handler.training.reference import hf_logits

    group = dist.group.WORLD
    for model_type in model_types:
        model, unmodified = _variant_models(model_type)
        layers = unmodified.config.num_hidden_layers
        got = generate(model, prompts()[:first], NEW_TOKENS, cp_group=group, num_layers=layers)
        want = reference_generate(unmodified, prompts()[:first], NEW_TOKENS, follow=got.tokens,
                                  logits_of=lambda m, ids: hf_logits(m, ids))
        assert got.tokens == want.tokens, (model_type, got.tokens, want.tokens)
        for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(a, b, atol=TOL, rtol=TOL,
                                       msg=lambda m, s=step, x=model_type: f"{x} step {s}: {m}")
        if model_type == "mistral":  # every layer windowed: W - 1 rows per sequence and layer stay cached
            total = torch.tensor([got.kv_cache_bytes])
            dist.all_reduce(total)
            window, config = VARIANTS["mistral"]["sliding_window"], unmodified.config
            rows = layers * sum(min(n + NEW_TOKENS - 1, window - 1) for n in PROMPT_LENGTHS[:first])
            assert total.item() == rows * 2 * config.num_key_value_heads * config.head_dim * 4, total.item()
        if not VARIANTS[model_type]:
            continue
        # negative control: decode without the variant (plain causal, no sinks) differs beyond the tolerance
        plain = DecodeHandler.attention_variant
        DecodeHandler.attention_variant = lambda self, *args: (CAUSAL, None)
        try:
            dropped = generate(model, prompts()[:first], NEW_TOKENS, cp_group=group, num_layers=layers)
        finally:
            DecodeHandler.attention_variant = plain
        worst = max((a - b).abs().max().item() for a, b in zip(dropped.logits[1:], want.logits[1:], strict=True))
        assert worst > 100 * TOL, (model_type, "the variant does not change decode at these sizes", worst)


def test_decode_runs_every_attention_variant_exactly():
    """Sliding window (Mistral), soft-cap + window (Gemma 2), learnable sinks + window (GPT-OSS), chunks
    (Llama 4) at cp 2: the same tokens and logits within 1e-5 as the unmodified model (transformers'
    eager attention, the whole sequence per token); without the variant, decode would differ. A windowed
    layer's cache keeps only the rows later queries may see (at cp 4 some ranks keep none)."""
    run_distributed(_variants_worker, 2, list(VARIANTS))
    run_distributed(_variants_worker, 4, ["mistral"], 1)  # one prompt: 4 rows left over 4 ranks


def _longrope_models():
    """Phi-3 with LongRoPE switching to its long factors past 32 tokens: the 30-token prompt crosses it while
    decoding. ``(CPCausalLM, the unmodified model)``, same weights."""
    from transformers import AutoModelForCausalLM, Phi3Config

    from cp_handler.integrations.transformers import CPCausalLM

    config = Phi3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        original_max_position_embeddings=32, pad_token_id=0,
                        rope_scaling={"type": "longrope", "short_factor": [1.0] * 4,
                                      "long_factor": [4.0, 5.0, 6.0, 7.0]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return CPCausalLM(copy.deepcopy(model)).eval(), model


def _longrope_worker(rank, world):
    from cp_handler.integrations import hf_rotary
    from cp_handler.training.reference import hf_logits

    group = dist.group.WORLD
    model, unmodified = _longrope_models()
    got = generate(model, prompts(), NEW_TOKENS, cp_group=group, num_layers=2)
    want = reference_generate(unmodified, prompts(), NEW_TOKENS, follow=got.tokens,
                              logits_of=lambda m, ids: hf_logits(m, ids))
    # the step to 33 tokens switches the 30-token prompt to the long factors, which its batch-mates must not
    # follow: the prompts run one at a time (3 prefills), and that one's step to 33 tokens as a prefill (1)
    assert got.prefills == 4, got.prefills
    assert got.tokens == want.tokens, (got.tokens, want.tokens)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, atol=TOL, rtol=TOL, msg=lambda m, s=step: f"step {s}: {m}")
    # prompts run one at a time with a stop token: each stops on its own, the batch has the longest's steps
    stop = got.tokens[0][1]
    steps = max(t.index(stop) if stop in t else NEW_TOKENS - 1 for t in got.tokens) + 1
    stopped = generate(model, prompts(), NEW_TOKENS, cp_group=group, num_layers=2, stop_token=stop)
    assert stopped.tokens == [t[:steps] for t in got.tokens] and len(stopped.logits) == steps, (stopped.tokens, stop)
    # negative control: without the check, the batch and the keys cached with the short factors make decode differ
    check = hf_rotary._check_position_tables
    hf_rotary._check_position_tables = lambda *args: None
    try:
        stale = generate(model, prompts(), NEW_TOKENS, cp_group=group, num_layers=2)
    finally:
        hf_rotary._check_position_tables = check
    assert stale.prefills == 1
    worst = max((a - b).abs().max().item() for a, b in zip(stale.logits[1:], want.logits[1:], strict=True))
    assert worst > 100 * TOL, worst


def test_decode_follows_rope_that_depends_on_the_length():
    """LongRoPE (Phi-3) crossing its original length during decode: the step whose rotary tables change
    is run as a prefill of the whole sequence (the cached keys were rotated with the short factors), and
    prompts whose own lengths disagree with the batch's tables run one at a time, so every step equals
    the unmodified model on each prompt alone within 1e-5, at cp 2."""
    run_distributed(_longrope_worker, 2)


def test_decode_refuses_a_scale_the_model_takes_from_the_input_index():
    """Llama 4's temperature tuning scales NoPE queries by the token's index in the model's input: a decode
    step (index 0, position 13 here, floor_scale 4) would get the wrong scale even at cp 1 (measured 1.5e-4
    in logits before the guard): refused, naming the row and its position; the prefill of one prompt at
    cp 1 (index = position) runs."""
    from hf_zoo import tiny_config
    from transformers import AutoModelForCausalLM

    from cp_handler.integrations.transformers import CPCausalLM

    config = tiny_config("llama4_text")
    for name, value in {"vocab_size": 256, "floor_scale": 4, "attn_temperature_tuning": True,
                        "no_rope_layers": [1, 0]}.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = CPCausalLM(AutoModelForCausalLM.from_config(config, attn_implementation="eager")).eval()
    assert len(generate(model, prompts()[:1], 1, num_layers=2).tokens[0]) == 1  # the prefill alone
    with pytest.raises(ValueError, match=r"layer 1: Llama 4's attention temperature tuning \(NoPE layer, "
                                         r"floor_scale=4\) .* input row 0 is at position 13, whose scale differs"):
        generate(model, prompts()[:1], 2, num_layers=2)


def _errors_worker(rank, world):
    group = dist.group.WORLD
    cache = KVCache(group, 2)
    with pytest.raises(ValueError, match=r"decode before prefill"):
        DecodeHandler(cache, cp_group=group)
    other = dist.new_group([0])
    if rank == 0:
        with pytest.raises(ValueError, match=r"this KV cache belongs to the CP group of global ranks \(0, 1\)"):
            DecodeHandler(cache, cp_group=other)
    model = gpt()
    with pytest.raises(ValueError, match=r"prompt 1 has 30 tokens; with max_new_tokens=8 it would reach position 37, "
                                         r"beyond the model's limit of 32 positions"):
        generate(model, prompts(), 8, cp_group=group, num_layers=2, max_positions=32)
    with pytest.raises(ValueError, match=r"max_new_tokens=0 must be >= 1"):
        generate(model, prompts(), 0, cp_group=group, num_layers=2)
    filled = KVCache(group, 2)
    generate_into = generate(model, prompts()[:1], 1, cp_group=group, num_layers=2)  # a working run first
    assert len(generate_into.tokens[0]) == 1
    from cp_handler.handlers.local import LocalContextParallelHandler

    cu = torch.tensor([0, 13], dtype=torch.int32)
    prefill = LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="thd", cu_seqlens=cu,
                                          kv_cache=filled)
    model(prefill.dispatch(prompts()[0].view(1, -1), 1), cp_handler=prefill)
    filled.finish_prefill()
    step = DecodeHandler(filled, cp_group=group)
    with pytest.raises(ValueError, match=r"a decode step takes one new token per sequence \(1\), got 2"):
        step.dispatch(torch.zeros(1, 2, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"the last decode step made other attention calls than the prefill "
                                         r"\(layer: \(step, prefill\) calls\) \{1: \(0, 1\), 2: \(0, 1\)\}"):
        DecodeHandler(filled, cp_group=group)  # the step above never ran the model
    with pytest.raises(ValueError, match=r"kv_cache: a prefill runs prompts as thd documents"):
        LocalContextParallelHandler(cp_group=group, cp_comm_type="p2p", qkv_format="bshd", kv_cache=KVCache(group, 2))


def test_bad_use_is_a_clear_error():
    run_distributed(_errors_worker, 2)


def test_sampling_distribution_restrictions_and_rules():
    """Sampling's distribution at hand-computed points (temperature, top-k, top-p: the smallest most-likely set
    reaching p), draws only inside it and repeatable from the seed; greedy is the argmax; bad values name
    the field."""
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log()
    probs = Sampling(temperature=1.0).probabilities(logits)
    torch.testing.assert_close(probs, torch.tensor([[0.6, 0.3, 0.1]]))
    hot = Sampling(temperature=2.0).probabilities(logits)
    torch.testing.assert_close(hot, torch.tensor([[0.6, 0.3, 0.1]]).sqrt() / torch.tensor([0.6, 0.3, 0.1]).sqrt().sum())
    for rule, want in ((Sampling(1.0, top_p=0.5), [1.0, 0.0, 0.0]), (Sampling(1.0, top_p=0.8), [2 / 3, 1 / 3, 0.0]),
                       (Sampling(1.0, top_p=0.9), [2 / 3, 1 / 3, 0.0]), (Sampling(1.0, top_p=0.95), [0.6, 0.3, 0.1]),
                       (Sampling(1.0, top_k=2), [2 / 3, 1 / 3, 0.0]), (Sampling(1.0, top_k=1), [1.0, 0.0, 0.0])):
        torch.testing.assert_close(rule.probabilities(logits), torch.tensor([want]), msg=str(rule))
    rule = Sampling(1.0, top_k=2, seed=5)
    many = logits.expand(400, -1)
    draws = rule.choose(many, rule.generator(torch.device("cpu")))
    assert set(draws.tolist()) == {0, 1} and torch.equal(draws, rule.choose(many, rule.generator(torch.device("cpu"))))
    assert torch.equal(Sampling().choose(torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]]), None), torch.tensor([1, 0]))
    ruled_out = torch.tensor([[0.0, -float("inf"), 1.0]])  # -inf: a token the model rules out
    assert Sampling().choose(ruled_out, None).item() == 2 and rule.choose(ruled_out, rule.generator("cpu")).item() != 1
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="the logits of sequence 1 hold NaN or \\+inf"):
            Sampling().choose(torch.tensor([[0.0, 1.0], [bad, 0.0]]), None)
    for kwargs, message in (({"temperature": -1.0}, "temperature=-1.0 must be a finite number >= 0"),
                            ({"temperature": float("nan")}, "temperature=nan must be"),
                            ({"temperature": 1.0, "top_k": -1}, "top_k=-1 must be >= 0"),
                            ({"temperature": 1.0, "top_p": 0.0}, r"top_p=0.0 must lie in \(0, 1\]"),
                            ({"top_k": 5}, "top_k=5 restrict sampling: they need temperature > 0")):
        with pytest.raises(ValueError, match=message):
            Sampling(**kwargs)


def test_generation_parity_accepts_near_ties_and_nothing_else():
    """compare_generations (cp-generate --check-parity): a CP token that is not the reference's greedy choice
    passes only as a near-tie (its reference logit within the tolerance of the largest); logits beyond the
    tolerance or not finite fail."""
    from cp_handler.inference import Generation, compare_generations

    want = Generation([[2, 0]], [torch.tensor([[0.0, 1.0, 3.0]]), torch.tensor([[2.0, 1.0, 0.5]])])
    same = compare_generations(Generation([[2, 0]], [t.clone() for t in want.logits]), want, 1e-2)
    assert same["passed"] and same["same_tokens"] and same["near_ties"] == 0
    tie = Generation([[2, 0]], [want.logits[0], torch.tensor([[2.0, 1.995, 0.5]])])  # close to tie_want's logits
    tie_want = Generation([[2, 1]], [want.logits[0], torch.tensor([[2.0, 2.01, 0.5]])])  # 2.0: within 0.03 of 2.01
    tied = compare_generations(tie, tie_want, 1e-2)
    assert tied["passed"] and not tied["same_tokens"] and tied["near_ties"] == 1
    wrong = compare_generations(Generation([[1, 0]], want.logits), want, 1e-2)  # 1.0 is far from 3.0
    assert not wrong["passed"] and wrong["near_ties"] == 0
    off = compare_generations(Generation([[2, 0]], [want.logits[0] + 0.1, want.logits[1]]), want, 1e-2)
    assert not off["passed"] and abs(off["max_logit_diff"] - 0.1) < 1e-6
    nan = compare_generations(Generation([[2, 0]], [want.logits[0], want.logits[1] * float("nan")]), want, 1e-2)
    assert not nan["passed"] and nan["max_logit_diff"] == float("inf")
