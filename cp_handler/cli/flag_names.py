"""Flags as the user sees them: library field names -> the cp-train flags a user typed, in one
place; the help formatter of cp-train and cp-bench (every default shown); their parser (:class:`FlagParser`: no
prefix matching, the closest flag suggested for an unknown one).

The library's errors name its fields (``hierarchical_context_parallel_sizes=[2, 3]``), as they
should: they are raised from the library. Under ``cp-train`` the user typed flags, so the CLI
rewrites every error it reports through :func:`to_flags`: ``field=value`` becomes ``--flag value``
(lists in the flag's own syntax, ``2 3``) and a bare field name becomes the flag.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import re
import sys

TRAIN_FLAGS = {
    "context_parallel_size": "--cp-size",
    "cp_comm_type": "--cp-comm-type",
    "cp_comm_profile": "--cp-comm-profile",
    "hierarchical_context_parallel_sizes": "--hierarchical-cp-sizes",
    "qkv_format": "--packing",
    "backend": "--backend",
    "seq_len": "--seq-len",
    "world_size": "--nproc",
    "world size": "--nproc",
    "num_ranks": "--nproc",
    "num_layers": "--num-layers",
    "hidden_size": "--hidden-size",
    "num_attention_heads": "--num-heads",
    "num_query_groups": "--num-kv-heads",
    "kv_channels": "--kv-channels",
    "v_head_dim": "--v-head-dim",
    "ffn_hidden_size": "--ffn-hidden-size",
    "num_moe_experts": "--moe-experts",
    "moe_router_topk": "--moe-top-k",
    "expert_model_parallel_size": "--expert-parallel-size",
    "tensor_model_parallel_size": "--tp-size",
    "tensor_parallel_size": "--tp-size",
    "max_seqlen_per_dp_cp_rank": "--max-seqlen-per-rank",
    "min_dynamic_context_parallel_size": "--min-cp-size",
    "max_dynamic_context_parallel_size": "--max-cp-size",
    "attn_kernel": "--attn-kernel",
    "mlp_chunk_tokens": "--mlp-chunk-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
}
"""Field (or phrase) of the library -> cp-train flag."""

ASSIGNED_ONLY = {"backend"}
"""Fields that are also plain words: rewritten only in the ``field=value`` form."""

EVAL_FLAGS = {"context_parallel_size": "--eval-cp-size",
              "hierarchical_context_parallel_sizes": "--eval-hierarchical-cp-sizes"}
"""The evaluation config's fields name the evaluation flags."""

_VALUE = r"(\[[^\]]*\]|'[^']*'|[^\s,;:)]+)"


def _flag_value(value: str) -> str:
    if value.startswith("["):
        return " ".join(part.strip().strip("'") for part in value[1:-1].split(",") if part.strip())
    return value.strip("'")


def to_flags(message: str, fields: dict[str, str] = TRAIN_FLAGS) -> str:
    """``message`` with every library field of ``fields`` written as its flag (see module doc)."""
    for field in sorted(fields, key=len, reverse=True):  # longest first: a name may contain another
        flag = fields[field]
        pattern = re.escape(field)
        message = re.sub(rf"(?<![\w-]){pattern}={_VALUE}", lambda m, f=flag: f"{f} {_flag_value(m[1])}",
                         message)
        if field not in ASSIGNED_ONLY:
            message = re.sub(rf"(?<![\w-]){pattern}(?![\w])", flag, message)
    return message


@contextlib.contextmanager
def flags_in_errors(fields: dict[str, str]):
    """Re-raise a ValueError / TypeError of the block with its fields written as ``fields``' flags."""
    try:
        yield
    except (ValueError, TypeError) as err:
        raise type(err)(to_flags(str(err), fields)) from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default shown, except where the help already says what the default is (or there
    is none: ``None`` / ``False``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def closest_flag(typed: str, known: list[str]) -> str | None:
    """The flag of ``known`` a user most likely meant by the unknown ``typed`` (``--step=5``: its name): the only
    flag it begins (``--step`` -> ``--steps``), else the closest spelling (difflib), else ``None``."""
    name = typed.split("=", 1)[0]
    longer = [flag for flag in known if flag.startswith(name)]
    if len(longer) == 1:
        return longer[0]
    close = difflib.get_close_matches(name, longer or known, n=1, cutoff=0.6)
    return close[0] if close else None


class FlagParser(argparse.ArgumentParser):
    """The parser of every command: a flag is taken only as spelled in full (``allow_abbrev=False``: with prefix
    matching ``--prompt`` silently became ``--prompt-file`` and ``--step`` was taken as ``--steps``), and an
    unknown flag is named with the closest known one: ``unrecognized arguments: --step (did you mean --steps?)``,
    before any other error (a mistyped required flag is named as mistyped, not as missing); an error prints its
    reason, not the whole usage (:meth:`error`).
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        # unknown flags first: argparse would report a missing required flag (the one mistyped) instead
        typos = [a for a in argv[:argv.index("--") if "--" in argv else len(argv)]
                 if a.startswith("--") and a.split("=", 1)[0] not in self._option_string_actions]
        parsed, unknown = self.parse_known_args(argv, namespace) if not typos else (None, typos)
        if unknown:
            self.error(self.unrecognized(unknown))
        return parsed

    def error(self, message: str):
        """The reason first, in one line, and where the flags are listed (argparse's default prints the whole usage,
        up to 45 lines, above the reason). Exits with status 2, as argparse does."""
        self.exit(2, f"{self.prog}: error: {message}\n({self.prog} --help lists every flag)\n")

    def unrecognized(self, unknown: list[str]) -> str:
        """The error for the ``unknown`` arguments, with a suggestion for each unknown flag that has one."""
        known = sorted(flag for flag in self._option_string_actions if flag.startswith("--"))
        guesses = [(typed, closest_flag(typed, known)) for typed in unknown if typed.startswith("--")]
        guesses = [(typed, guess) for typed, guess in guesses if guess]
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if len(guesses) == 1:
            return f"{message} (did you mean {guesses[0][1]}?)"
        if guesses:
            return f"{message} (did you mean {', '.join(f'{g} for {t}' for t, g in guesses)}?)"
        return message
