"""Generation under CP: a prefill over the prompts dispatched across the group, then decode steps.

:func:`generate` runs any model with the reference GPT's interface (``model(input_ids, cp_handler=h)
-> logits``; :class:`~cp_handler.integrations.transformers.CPCausalLM` too): the prompts are one thd
batch (each prompt a document, padded by the handler to multiples of ``2 * cp``) through a
:class:`~cp_handler.handlers.local.LocalContextParallelHandler` that fills a :class:`.KVCache`; each
sequence's last-token logits come from the rank holding that token (one all-reduce of ``B x V``);
then each decode step is one forward of the ``B`` new tokens under a :class:`.DecodeHandler`. A step
whose position tables differ from the prefill's (:class:`.PositionTablesChanged`: RoPE that depends on
the sequence length) is replaced by a prefill of the whole sequence so far, so the cached keys are
always those the whole sequence gives; and prompts whose own lengths would give other tables than
the batch's run one at a time, so that no prompt's result depends on the others. The next token is the
argmax, or a sample (:class:`.Sampling`: temperature, top-k, top-p; drawn on the group's rank 0).
:func:`reference_generate` is the check: the model alone, the whole sequence re-run for every token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..handlers.local import LocalContextParallelHandler
from ..models.loss import LogitsAt
from ..runtime.rope import PositionTablesChanged
from .cache import KVCache
from .decode import DecodeHandler
from .sampling import Sampling


@dataclass
class Generation:
    """What :func:`generate` returns (the same on every rank).

    Attributes:
        tokens: each sequence's new tokens.
        logits: per step, ``(B, V)`` float32 logits the tokens were picked from (step 0: the prefill's).
        prefill_s / decode_s: wall-clock seconds of the prefill and of all decode steps.
        kv_cache_bytes: K/V bytes this rank holds at the end.
        prefills: prefills run: 1, plus one per decode step replaced after :class:`.PositionTablesChanged`
            (or one per prompt and replaced step, when the prompts ran one at a time).
    """

    tokens: list[list[int]]
    logits: list[torch.Tensor] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_cache_bytes: int = 0
    prefills: int = 0

    @classmethod
    def concat(cls, parts: list[Generation]) -> Generation:
        """The generations of prompts run one batch after another, as one (times and prefills summed; the
        KV bytes are the largest part's: the parts' caches are not held together)."""
        return cls([t for p in parts for t in p.tokens],
                   [torch.cat(step) for step in zip(*(p.logits for p in parts), strict=True)],
                   sum(p.prefill_s for p in parts), sum(p.decode_s for p in parts),
                   max(p.kv_cache_bytes for p in parts), sum(p.prefills for p in parts))


def check_prompts(prompts: list[torch.Tensor], max_new_tokens: int, max_positions: int | None) -> None:
    """Raises ValueError for no prompt, an empty or non-1-D prompt, ``max_new_tokens < 1``, or a prompt
    plus its new tokens beyond the model's position limit (before any collective)."""
    if not prompts:
        raise ValueError("generate: no prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    for i, prompt in enumerate(prompts):
        if prompt.dim() != 1 or prompt.numel() < 1:
            raise ValueError(f"prompt {i} must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt.shape)}")
        if max_positions is not None and prompt.numel() + max_new_tokens > max_positions:
            raise ValueError(f"prompt {i} has {prompt.numel()} tokens; with max_new_tokens={max_new_tokens} it would "
                             f"reach position {prompt.numel() + max_new_tokens - 1}, beyond the model's limit of "
                             f"{max_positions} positions")


def check_mixers(model: torch.nn.Module) -> None:
    """Raises ValueError naming the first token mixer other than attention (a module marked ``_cp_mixer``: the
    reference GPT's Gated DeltaNet, a routed Hugging Face mixer): the cache holds keys and values only, and a
    decode step would need each sequence's convolution and recurrent state where its last token is (not
    implemented). Called before any collective."""
    name = next((n for n, m in model.named_modules() if getattr(m, "_cp_mixer", False)), None)
    if name is not None:
        raise ValueError(f"generate: module {name!r} ({type(model.get_submodule(name)).__name__}) is a token mixer "
                         "other than attention: generation of hybrid models is not implemented (a decode step would "
                         "need each sequence's convolution and recurrent state where its last token is); refused")


def check_hf_generation(config) -> None:
    """The generation guard on a config, before any rank starts: the model (on the ``meta`` device) with its
    mixers routed must have no token mixer other than attention (:func:`check_mixers`).

    Raises:
        ValueError: naming the first such mixer.
    """
    from transformers import AutoModelForCausalLM

    from ..integrations.hf_mixers import instrument_model  # imports transformers: Hugging Face models only

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    instrument_model(model)
    check_mixers(model)


def _last_token_logits(handler: LocalContextParallelHandler, model, local: torch.Tensor) -> torch.Tensor:
    """``(B, V)`` float32 logits of every prompt's last token, on every rank: the forward of the local tokens
    computes logits only at the last tokens this rank holds (``output=LogitsAt(rows)``), which it fills in."""
    layout = handler.token_layout
    index = layout.token_index(local.shape[1])
    last = torch.tensor(layout.document_lengths).cumsum(0) - 1
    held = [(i, int(rows[0])) for i, position in enumerate(last.tolist())
            if (rows := (index == position).nonzero().flatten()).numel()]
    rows = torch.tensor([row for _, row in held], dtype=torch.long, device=local.device)
    logits = model(local, cp_handler=handler, output=LogitsAt(rows))  # (1, len(held), V)
    out = logits.new_zeros((len(layout.document_lengths), logits.shape[-1]), dtype=torch.float32)
    for j, (i, _) in enumerate(held):
        out[i] = logits[0, j].float()
    if handler.cp_size > 1:
        dist.all_reduce(out, group=handler.cp_group)
    return out


@torch.no_grad()
def generate(model, prompts: list[torch.Tensor], max_new_tokens: int, *, cp_group=None, cp_comm_type="p2p",
             hierarchical_cp_groups=None, num_layers: int, max_positions: int | None = None,
             sampling: Sampling | None = None, stop_token: int | None = None) -> Generation:
    """Continuation of every prompt (every rank of ``cp_group`` calls it with the same arguments): greedy,
    or sampled as ``sampling`` says; ``max_new_tokens`` tokens per prompt, fewer with ``stop_token``.

    Args:
        model: the model protocol, ``model(input_ids (1, T), cp_handler=h) -> logits (1, T, V)``, and with
            ``output=LogitsAt(rows)`` (:class:`~cp_handler.models.loss.LogitsAt`, a 1-D index of local rows) the
            logits of those rows only, ``(1, len(rows), V)``: the prefill asks for the prompts' last tokens only,
            never holding the prompt's whole logits.
        prompts: 1-D int64 token tensors (any lengths).
        max_new_tokens: tokens generated per prompt (>= 1).
        cp_group / cp_comm_type / hierarchical_cp_groups: the prefill's CP layout (any comm type; decode
            uses the group's all-gather).
        num_layers: attention layers of the model (the cache checks every one was filled).
        max_positions: the model's position limit (``None``: none, RoPE).
        sampling: how each token is chosen (``None``: greedy).
        stop_token: end-of-sequence id: generation stops after the step at which every sequence has
            produced it (sequences that ended earlier keep decoding until then, as a batch does; every
            sequence gets the same number of tokens, cut them at the first stop token). The decision is
            the same on every rank (the chosen tokens are). Prompts run one at a time (length-dependent
            RoPE, below) each stop on their own and are then continued to the longest's step count.

    Raises:
        ValueError: :func:`check_prompts`; a model with token mixers other than attention (:func:`check_mixers`);
            the cache's checks (:class:`.KVCache`, :class:`.DecodeHandler`).
    """
    check_prompts(prompts, max_new_tokens, max_positions)
    check_mixers(model)
    sampling = sampling or Sampling()
    layout = {"cp_group": cp_group, "cp_comm_type": cp_comm_type, "hierarchical_cp_groups": hierarchical_cp_groups}
    try:
        return _generate(model, prompts, max_new_tokens, num_layers, layout, sampling, stop_token)
    except PositionTablesChanged:  # the batch would set each sequence's RoPE frequencies: one prompt at a time
        if len(prompts) == 1:
            raise
        parts = [_generate(model, [p], max_new_tokens, num_layers, layout, sampling, stop_token) for p in prompts]
        steps = max(len(part.logits) for part in parts)  # a batch's step count: run the others on to it
        return Generation.concat([part if len(part.logits) == steps else
                                  _generate(model, [p], steps, num_layers, layout, sampling)
                                  for p, part in zip(prompts, parts, strict=True)])


def _generate(model, prompts: list[torch.Tensor], max_new_tokens: int, num_layers: int, layout: dict,
              sampling: Sampling, stop_token: int | None = None) -> Generation:
    """:func:`generate` of one batch of prompts; a decode step whose position tables changed runs as a prefill
    of the whole sequence so far. Raises PositionTablesChanged when the prompts' own lengths disagree."""
    device = next(model.parameters()).device
    started = time.perf_counter()
    generator = sampling.generator(device)
    cache, logits = _prefill(model, prompts, num_layers, device, layout)
    result = Generation([[] for _ in prompts], [logits], prefill_s=time.perf_counter() - started, prefills=1)
    started = time.perf_counter()
    for step in range(max_new_tokens):
        chosen = sampling.choose(logits, generator, layout["cp_group"])
        for i, token in enumerate(chosen.tolist()):
            result.tokens[i].append(token)
        ended = stop_token is not None and all(stop_token in tokens for tokens in result.tokens)
        if step + 1 == max_new_tokens or ended:
            break
        handler = DecodeHandler(cache, cp_group=layout["cp_group"])
        try:
            logits = model(chosen.view(1, -1).to(device), cp_handler=handler)[0].float()
        except PositionTablesChanged:  # on every rank alike, before this step's first collective
            so_far = [torch.cat([p, p.new_tensor(t)]) for p, t in zip(prompts, result.tokens, strict=True)]
            cache, logits = _prefill(model, so_far, num_layers, device, layout)
            result.prefills += 1
        result.logits.append(logits)
    result.decode_s = time.perf_counter() - started
    cache.check_step()
    result.kv_cache_bytes = cache.nbytes()
    return result


def _prefill(model, prompts: list[torch.Tensor], num_layers: int, device, layout: dict):
    """``(filled KVCache, (B, V) float32 logits of each prompt's last token)``."""
    cache = KVCache(layout["cp_group"], num_layers)
    cu = torch.tensor([0, *torch.tensor([p.numel() for p in prompts]).cumsum(0).tolist()], dtype=torch.int32)
    prefill = LocalContextParallelHandler(qkv_format="thd", cu_seqlens=cu, kv_cache=cache, **layout)
    local = prefill.dispatch(torch.cat(prompts).view(1, -1).to(device), 1)
    logits = _last_token_logits(prefill, model, local)
    cache.finish_prefill()
    return cache, logits


@torch.no_grad()
def reference_generate(model, prompts: list[torch.Tensor], max_new_tokens: int,
                       follow: list[list[int]] | None = None, logits_of=None) -> Generation:
    """The same greedy generation on this process alone, without a cache: each step re-runs the model on the
    whole sequence so far and takes the last position's logits.

    ``follow``: each prompt's tokens to continue with instead of the reference's own choice (teacher
    forcing: the logits and choices of every step are then those after the tokens another run chose, so a
    near-tie at one step does not change every later one; :func:`compare_generations`).
    ``logits_of``: ``(model, ids (1, T)) -> logits (1, T, V)``; default ``model(ids)`` (no handler). A parity
    check passes a reference independent of the code under test (cp-generate: the unmodified Hugging Face
    model, or the reference GPT with plain attention), so that a defect shared by CP and cp=1 still shows."""
    logits_of = logits_of or (lambda m, ids: m(ids))
    device = next(model.parameters()).device
    result = Generation([[] for _ in prompts], [[] for _ in range(max_new_tokens)])
    for i, prompt in enumerate(prompts):
        sequence = prompt.to(device)
        for step in range(max_new_tokens):
            logits = logits_of(model, sequence.view(1, -1))[0, -1].float()
            result.logits[step].append(logits)
            token = int(logits.argmax())
            result.tokens[i].append(token)
            sequence = torch.cat([sequence, sequence.new_tensor([follow[i][step] if follow else token])])
    result.logits = [torch.stack(step) for step in result.logits]
    return result


def compare_generations(got: Generation, want: Generation, tol: float, greedy: bool = True) -> dict:
    """Parity of a CP generation ``got`` with ``want`` = :func:`reference_generate` ``(..., follow=got.tokens)``.

    Passed when every step's logits agree (``allclose``, atol = rtol = ``tol``) and, for a ``greedy``
    generation, every token ``got`` chose is the reference's choice, or a near-tie: its reference logit
    within the tolerance of the reference's largest (in bfloat16 two logits one rounding apart may swap;
    ``got`` is then still a greedy choice of the reference). A sampled generation is checked by its logits
    only (the reference followed its tokens). Returns ``passed``, ``same_tokens``, ``near_ties`` (count),
    ``max_logit_diff`` (inf when a value is not finite) and ``tolerance``."""
    close, diff, ties, wrong = True, 0.0, 0, 0
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        close &= torch.allclose(a, b, rtol=tol, atol=tol)
        gap = (a - b).abs().max().item()
        diff = max(diff, gap if gap == gap else float("inf"))  # NaN: inf
        for i, (mine, theirs) in enumerate(zip(got.tokens, want.tokens, strict=True)):
            if greedy and mine[step] != theirs[step]:
                top = b[i].max()
                near = bool(b[i, mine[step]] >= top - (tol + tol * top.abs()))
                ties, wrong = ties + near, wrong + (not near)
    return {"passed": bool(close) and wrong == 0, "same_tokens": got.tokens == want.tokens, "near_ties": ties,
            "max_logit_diff": diff, "tolerance": tol}
