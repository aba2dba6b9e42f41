"""``cp-generate``: continuation of prompts (inline or files) under CP (greedy, or sampled), from a ``cp-train
--save`` checkpoint or a Hugging Face model folder (docs/inference.md).

Parses and checks the flags before any rank starts (into a frozen
:class:`~cp_handler.cli.generate_rank.GenerateConfig`), starts the ranks
(:func:`~cp_handler.cli.generate_rank.run_generation`; spawned, or one rank under torchrun) and prints each prompt
followed by its continuation on stdout (up to its first end-of-sequence token; unprintable characters and bytes
that are not UTF-8 shown escaped: :func:`printable`), and on stderr the prefill and decode throughput, the KV cache
per rank and, with ``--check-parity``, the comparison with one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import unicodedata

from ..handlers import get_cp_handler_cls
from ..handlers.registry import load_plugins
from ..inference.generate import check_hf_generation
from ..inference.sampling import Sampling
from ..runtime.config import CP_COMM_TYPES, AttentionShape, ContextParallelConfig
from ..runtime.forking import fresh_process
from ..training.checkpoint import find_checkpoint, read_meta, verify_checkpoint
from ..training.data import text_file_problem
from ..training.tokens import ByteTokens, HFTokens, has_tokenizer, tokens_for
from .common import check_numbers, check_writable, world_size_from, write_output
from .flag_names import FlagParser, HelpFormatter, to_flags
from .generate_rank import PARITY_TOL, GenerateConfig, run_generation
from .model_args import check_hf_architecture, hf_attention_shape

DTYPES = tuple(PARITY_TOL)


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="cp-generate", formatter_class=HelpFormatter, description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("layout")
    g.add_argument("--nproc", type=int, default=None,
                   help="ranks to spawn, all one CP group (default 1; under torchrun: its WORLD_SIZE)")
    g.add_argument("--cp-size", type=int, default=None, help="CP size: the number of ranks (default --nproc)")
    g.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default="p2p", help="the prefill's communication pattern")
    g.add_argument("--hierarchical-cp-sizes", type=int, nargs=2, default=None, metavar=("A2A", "P2P"),
                   help="a2a+p2p: inner a2a size, then the ring size")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds a rank may go without progress")
    g = p.add_argument_group("model (one of)")
    g.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a cp-train --save folder (its latest) or one step-N folder: the reference GPT")
    g.add_argument("--hf-model", default=None, metavar="DIR", help="a Hugging Face model folder (save_pretrained)")
    g = p.add_argument_group("generation")
    prompts = g.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT",
                         help="a prompt given inline (repeat the flag for several); read as --prompt-file reads a "
                              "file's text")
    prompts.add_argument("--prompt-file", nargs="+", metavar="FILE",
                         help="UTF-8 text files, one prompt each: tokens from --hf-model's tokenizer when it has one, "
                              "else the bytes")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (the most likely token); > 0: sample from softmax(logits / temperature)")
    g.add_argument("--top-k", type=int, default=0, help="sampling: only the K most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sampling: only the most likely tokens whose probabilities first reach P (nucleus; 1: all)")
    g.add_argument("--seed", type=int, default=0, help="sampling: the generator's seed (drawn on rank 0)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate and print all --max-new-tokens tokens; without it generation stops once every "
                        "prompt has produced the end-of-sequence token (the tokenizer's eos token; bytes: NUL, "
                        "which ends every document cp-train reads) and each is printed up to it")
    g.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="the model's dtype; auto: the one it was saved in (--hf-model: its config's dtype, "
                        "float32 when it has none; --checkpoint: cp-train's --dtype); --check-parity's tolerance "
                        "follows it")
    g.add_argument("--check-parity", action="store_true",
                   help="also run rank 0 alone (the whole sequence re-run per token, no cache, after the same "
                        "tokens) and fail unless every step's logits agree (atol = rtol = 1e-5 in float32, 2e-2 "
                        "in bfloat16, 5e-3 in float16) and, greedy, each token is its greedy choice (or a "
                        "near-tie within that tolerance)")
    g.add_argument("--report-out", default=None, metavar="FILE", help="write the report as JSON")
    return p


def read_prompts(paths: list[str], tokens: ByteTokens | HFTokens) -> tuple[tuple[int, ...], ...]:
    """Each prompt file's token ids. Raises ValueError naming a file that is empty or not UTF-8 text."""
    texts = []
    for path in paths:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise ValueError(f"--prompt-file {path}: not a non-empty file")
        with open(path, "rb") as f:
            texts.append((f"--prompt-file {path}", f.read()))
    return encode_prompts(texts, tokens)


def inline_prompts(texts: list[str], tokens: ByteTokens | HFTokens) -> tuple[tuple[int, ...], ...]:
    """Each ``--prompt TEXT``'s token ids (bytes the shell passed that are not UTF-8 are refused).
    Raises ValueError naming the prompt that is empty or not UTF-8 text."""
    named = [(inline_name(text), text.encode("utf-8", errors="surrogateescape")) for text in texts]
    for name, text in named:
        if not text:
            raise ValueError(f"{name}: an empty prompt; a prompt is UTF-8 text of at least one character")
    return encode_prompts(named, tokens)


def inline_name(text: str) -> str:
    """``--prompt 'TEXT'`` as an error names it (a long text cut to 40 characters)."""
    return f"--prompt {(text if len(text) <= 40 else text[:37] + '...')!r}"


def encode_prompts(named: list[tuple[str, bytes]], tokens: ByteTokens | HFTokens) -> tuple[tuple[int, ...], ...]:
    """The token ids of each ``(flag and value, text)``. Raises ValueError naming a text that is not UTF-8 or
    gives no token."""
    prompts = []
    for name, text in named:
        problem = text_file_problem(text, truncated=False)
        if problem:
            raise ValueError(f"{name} is not text: {problem}; a prompt is UTF-8 text")
        prompts.append(tuple(tokens.encode(text)))
        if not prompts[-1]:
            raise ValueError(f"{name}: its tokenizer gives no token")
    return tuple(prompts)


def printable(text: str) -> str:
    """``text`` as it is safe to print: newlines and tabs kept, every other control or format character
    (carriage return, escape sequences, bidirectional overrides, ...) and every lone surrogate written as its
    Python escape (``\\x1b``, ``\\r``, ``\\u202e``); a backslash in the text itself is left as it is."""
    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) not in UNPRINTABLE
                   else ch.encode("unicode_escape", errors="backslashreplace").decode("ascii") for ch in text)


UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn"})
"""Unicode categories :func:`printable` escapes: control, format, surrogate, private use, unassigned."""


def shown(tokens: ByteTokens | HFTokens, ids: list[int]) -> str:
    """The text of ``ids`` as cp-generate prints it: bytes that are not UTF-8 as ``\\xNN`` (byte tokens), then
    :func:`printable`."""
    if isinstance(tokens, ByteTokens) and not tokens.not_bytes(ids):
        return printable(bytes(ids).decode("utf-8", errors="backslashreplace"))
    return printable(tokens.decode(ids))


def validate(args: argparse.Namespace) -> GenerateConfig:
    """Every rule before any rank starts. Raises ValueError naming the flag."""
    check_numbers(args, positive=("nproc", "cp_size", "max_new_tokens"), non_negative=("top_k",),
                  positive_floats=("timeout",), non_negative_floats=("temperature",))
    world = world_size_from(args)
    if args.nproc is not None and args.nproc != world:
        raise ValueError(f"--nproc {args.nproc} differs from torchrun's WORLD_SIZE={world}")
    check_writable("--report-out", args.report_out)
    if args.cp_size is not None and args.cp_size != world:
        raise ValueError(f"--cp-size {args.cp_size}: cp-generate runs one CP group over all {world} ranks (--nproc)")
    if bool(args.checkpoint) == bool(args.hf_model):
        raise ValueError("give exactly one of --checkpoint (a cp-train --save folder) and --hf-model")
    if args.checkpoint:
        checkpoint = find_checkpoint(args.checkpoint, "--checkpoint")
        meta = read_meta(checkpoint, "--checkpoint")
        verify_checkpoint(checkpoint, meta, "--checkpoint")  # format 1 recorded no checksums: nothing to verify
        if meta["model"]["kind"] != "gpt":
            raise ValueError(f"--checkpoint {args.checkpoint}: a Hugging Face model's checkpoint; export it with "
                             "cp-train --export-hf DIR and pass --hf-model DIR")
        if "linear_attention" in (meta["model"].get("layer_types") or ()):
            raise ValueError(f"--checkpoint {args.checkpoint}: a hybrid model (linear-attention layers); generation "
                             "of models with token mixers other than attention is not implemented (a decode step "
                             "would need each sequence's recurrent state where its last token is)")
        heads = AttentionShape(meta["model"]["num_attention_heads"], meta["model"]["num_query_groups"],
                               meta["model"]["kv_channels"], meta["model"].get("v_head_dim"))
        model_source = {"checkpoint": str(checkpoint)}
        saved_dtype = meta["training"]["dtype"]
    else:  # the config, the tokenizer, the guard and the heads (cp-train's checks), before any rank starts
        hf = check_hf_architecture(argparse.Namespace(hf_model=args.hf_model, hf_config=None))
        try:
            check_hf_generation(hf)
        except ValueError as err:
            raise ValueError(f"--hf-model {args.hf_model}: {err}") from None
        heads = hf_attention_shape(hf)
        model_source = {"hf_model": args.hf_model}
        saved_dtype = None
    tokens = tokens_for(args.hf_model)
    if args.prompt:
        names, prompts = [inline_name(text) for text in args.prompt], inline_prompts(args.prompt, tokens)
    else:
        names, prompts = [f"--prompt-file {path}" for path in args.prompt_file], read_prompts(args.prompt_file, tokens)
    if args.hf_model:  # the position limit, checked here with the words of the flags
        text = hf.get_text_config()
        limit = getattr(text, "max_position_embeddings", None)
        for name, prompt in zip(names, prompts, strict=True):
            if limit is not None and len(prompt) + args.max_new_tokens > limit:
                raise ValueError(f"{name}: {len(prompt)} tokens + --max-new-tokens "
                                 f"{args.max_new_tokens} exceed the model's {limit} positions "
                                 "(max_position_embeddings)")
        saved_dtype = str(getattr(text, "dtype", None) or "float32").removeprefix("torch.")
        vocab = getattr(text, "vocab_size", None)
        top = max(max(p) for p in prompts)
        if vocab is not None and top >= vocab:
            raise ValueError(f"--hf-model {args.hf_model}: vocab_size={vocab}, but the prompts hold token {top} "
                             f"({'its tokenizer' if has_tokenizer(args.hf_model) else 'bytes: no tokenizer in it'})")
    dtype = saved_dtype if args.dtype == "auto" else args.dtype
    if dtype not in DTYPES:
        raise ValueError(f"--dtype auto: the model was saved in {dtype}; cp-generate runs {', '.join(DTYPES)}: "
                         "pass --dtype")
    sizes = tuple(args.hierarchical_cp_sizes) if args.hierarchical_cp_sizes else None
    cp_config = ContextParallelConfig(context_parallel_size=world, cp_comm_type=args.cp_comm_type,
                                      hierarchical_context_parallel_sizes=list(sizes) if sizes else None,
                                      qkv_format="thd")
    try:
        get_cp_handler_cls("local", args.cp_comm_type).check_config(cp_config, heads)
    except ValueError as err:
        source = f"--checkpoint {args.checkpoint}" if args.checkpoint else f"--hf-model {args.hf_model}"
        raise ValueError(f"{heads.num_heads} query heads / {heads.num_kv_heads} KV heads of {source} with --nproc "
                         f"{world} and --cp-comm-type {args.cp_comm_type}: {err}") from None
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    return GenerateConfig(world_size=world, cp_comm_type=args.cp_comm_type, hierarchical_cp_sizes=sizes,
                          prompts=prompts, max_new_tokens=args.max_new_tokens, dtype=dtype,
                          check_parity=args.check_parity, timeout=args.timeout, sampling=sampling,
                          stop_token=None if args.ignore_eos else tokens.end_of_document, **model_source)


def parse(argv: list[str] | None = None) -> tuple[GenerateConfig, str | None, bool]:
    """``(the run's config, --report-out, --ignore-eos)``; exits with the error naming the flag."""
    args = build_parser().parse_args(argv)
    try:
        load_plugins()
        return validate(args), args.report_out, args.ignore_eos
    except (ValueError, TypeError, ImportError, RuntimeError) as err:
        raise SystemExit(f"cp-generate: error: {to_flags(str(err))}") from None


def until_end(ids: list[int], end: int) -> list[int]:
    """``ids`` up to (without) the first ``end`` token."""
    return ids[:ids.index(end)] if end in ids else ids


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as the command: nothing computed in this process yet (runtime/launch.py)
        fresh_process()
    config, report_out, ignore_eos = parse(argv)
    report = run_generation(config)
    if report is None:  # a non-zero rank under torchrun
        return 0
    tokens = tokens_for(config.hf_model)
    for prompt, ids in zip(config.prompts, report["tokens"], strict=True):  # the prompt, then its continuation
        continuation = ids if ignore_eos else until_end(ids, tokens.end_of_document)
        print(shown(tokens, list(prompt)) + shown(tokens, continuation))
    outside = sum(tokens.not_bytes(ids) for ids in report["tokens"])
    if outside:
        print(f"cp-generate: {outside} generated ids are not bytes (the model's vocabulary is larger and it has no "
              "tokenizer): shown as U+FFFD; the ids are in --report-out", file=sys.stderr)
    kv = report["kv_cache_bytes_per_rank"]
    print(f"cp-generate: cp {report['cp_size']}: prefill {sum(report['prompt_tokens'])} tokens in "
          f"{report['prefill_s']:.2f} s ({report['prefill_tokens_per_s']:.0f} tokens/s), decode "
          f"{report['decode_tokens_per_s']:.1f} tokens/s; KV cache per rank {[round(b / 2**20, 2) for b in kv]} MiB",
          file=sys.stderr)
    if report["prefills"] > 1:
        print(f"cp-generate: {report['prefills'] - 1} decode step(s) ran as a prefill of the whole sequence: the "
              "model's rotary frequencies depend on the sequence length (dynamic NTK, LongRoPE), so the cached keys "
              "had to be rotated again", file=sys.stderr)
    if report_out and not write_output("cp-generate", "--report-out", report_out, report):
        return 1
    parity = report.get("parity")
    if parity is not None:
        verdict = "passed" if parity["passed"] else "FAILED"
        tokens_checked = f"same tokens {parity['same_tokens']} ({parity['near_ties']} near-ties)" \
            if config.sampling.greedy else "sampled tokens followed by the reference"
        print(f"cp-generate: parity {verdict} ({report['dtype']}): {tokens_checked}, max logit difference "
              f"{parity['max_logit_diff']:.2e} (atol = rtol = {parity['tolerance']})", file=sys.stderr)
        return 0 if parity["passed"] else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
