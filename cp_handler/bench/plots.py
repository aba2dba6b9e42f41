"""Plots of ``cp-bench`` results (matplotlib PNGs, one style per implementation).

matplotlib is an optional dependency (the ``bench`` extra; the ``test`` extra has it too):
:func:`require_matplotlib` checks for it before a benchmark runs, so ``cp-bench`` without it stops at once
with an ``ImportError`` naming the extra (or runs with ``--no-plots``), never after the measurements.
"""

from __future__ import annotations

import os

from ..core.install_hint import extra_hint

IMPLEMENTATIONS = ("local p2p", "local all_gather", "local a2a", "local a2a+p2p", "torch_ring allgather",
                   "torch_ring alltoall", "single none")
"""Every implementation a plot can show, in the order of their fixed styles."""
_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def require_matplotlib():
    """``matplotlib.pyplot`` with the non-interactive backend.

    Raises:
        ImportError: matplotlib is not installed, naming the extra that brings it.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"cp-bench plots need matplotlib, an optional dependency: {extra_hint('bench')} (or run "
                          "cp-bench --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def style(name: str) -> dict:
    """The colour and marker of implementation ``name`` (``"local p2p"``, ``"torch_ring allgather"``; a
    plan pattern ``"p2p"`` is ``"local p2p"``): the same in every panel and every figure."""
    if name in ("p2p", "all_gather", "a2a", "a2a+p2p"):
        name = f"local {name}"
    i = IMPLEMENTATIONS.index(name) if name in IMPLEMENTATIONS else len(IMPLEMENTATIONS)
    return {"color": _COLOURS[i % len(_COLOURS)] if i < len(IMPLEMENTATIONS) else "black",
            "marker": _MARKERS[i % len(_MARKERS)] if i < len(IMPLEMENTATIONS) else "*"}


def plain_log_axis(ax, values) -> None:
    """A log-scale x axis with a plain tick label at each value (2048, 4096, ... not 2x10^3)."""
    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(v) for v in ticks])
    ax.minorticks_off()


def generate_plot(gen: dict, out_dir: str) -> str:
    """Prefill time and decode time per token against prompt length, one line per CP size."""
    fig, axes = require_matplotlib().subplots(1, 2, figsize=(10, 4))
    for cp in sorted({r["cp_size"] for r in gen["rows"]}):
        points = sorted((r["prompt_len"], r) for r in gen["rows"] if r["cp_size"] == cp)
        xs = [x for x, _ in points]
        axes[0].plot(xs, [r["prefill_s"] for _, r in points], marker="o", label=f"cp={cp}")
        axes[1].plot(xs, [1e3 * r["decode_s_per_token"] for _, r in points], marker="o", label=f"cp={cp}")
    axes[0].set(title="prefill", xlabel="prompt tokens", ylabel="s", yscale="log")
    axes[1].set(title="decode", xlabel="prompt tokens", ylabel="ms per token")
    for ax in axes:
        plain_log_axis(ax, [r["prompt_len"] for r in gen["rows"]])
        ax.legend(fontsize=7)
    return save_figure(fig, out_dir, "generate.png")


def memory_plot(mem: dict, out_dir: str) -> str:
    """The projection: the longest sequence per configuration at each CP size (log scale), labelled as such."""
    rows = mem["projection"]
    labels = sorted({_memory_label(r) for r in rows}, key=lambda s: [_memory_label(r) for r in rows].index(s))
    cps = sorted({r["cp_size"] for r in rows})
    fig, ax = require_matplotlib().subplots(figsize=(9, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [next((r["sequence"] for r in rows if r["cp_size"] == cp and _memory_label(r) == label), 0)
                  for cp in cps]
        ax.bar([c + i * width for c in range(len(cps))], values, width, label=label)
    for c, cp in enumerate(cps):  # a configuration whose state alone exceeds the GPU holds no token
        if not any(r["sequence"] for r in rows if r["cp_size"] == cp):
            ax.text(c + 0.4 - width / 2, 2e4, "the training state alone\nexceeds the GPU", ha="center", fontsize=8)
    ax.set(ylim=(1e4, None), xticks=[c + 0.4 - width / 2 for c in range(len(cps))],
           xticklabels=[f"cp {cp}" for cp in cps], yscale="log", ylabel="longest sequence (tokens)",
           title="PROJECTION from measured bytes per token: Llama-3-8B, 80 GB GPUs, FSDP2 over the cp ranks")
    ax.axhline(1_000_000, color="gray", linestyle="--", linewidth=1)
    ax.legend(fontsize=7)
    return save_figure(fig, out_dir, "memory_projection.png")


def _memory_label(row: dict) -> str:
    parts = ["recompute" if row["recompute"] else "no recompute",
             "chunked loss" if row["chunked_loss"] else "whole loss"]
    return ", ".join(parts + (["tiled MLP"] if row.get("tiled_mlp") else []) + (["offload"] if row["offload"] else []))


def masks_plot(masks: dict, out_dir: str) -> str:
    """Two bar panels: the slowest rank's time and the K/V tokens sent per rank, per case."""
    names = [r["case"] for r in masks["rows"]]
    fig, axes = require_matplotlib().subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [r["median_ms"] for r in masks["rows"]], color="tab:blue")
    axes[0].set(title=f"fwd+bwd per rank, S={masks['seq_len']} cp={masks['cp_size']}", ylabel="ms (slowest rank)")
    axes[1].bar(names, [r["kv_tokens_sent"] for r in masks["rows"]], color="tab:orange")
    axes[1].set(title="K/V sent per rank per layer (forward)", ylabel="tokens")
    return save_figure(fig, out_dir, "masks.png")


def save_figure(fig, out_dir: str, name: str) -> str:
    """Lay out, write ``out_dir/name`` (PNG, 90 dpi), close; the path."""
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=90)
    require_matplotlib().close(fig)
    return path


def plan_plot(plan: dict, out_dir: str) -> str:
    """Efficiency against tokens per rank, one panel per format, one line per pattern."""
    formats = sorted({r["qkv_format"] for r in plan["rows"]})
    fig, axes = require_matplotlib().subplots(1, len(formats), figsize=(6 * len(formats), 4.5), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        for pattern in sorted({r["pattern"] for r in plan["rows"]} - {"whole"}):
            points = sorted((r["seq_len"] // r["cp_size"], r["efficiency"]) for r in plan["rows"]
                            if r["qkv_format"] == fmt and r["pattern"] == pattern)
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], linestyle="", label=pattern, **style(pattern))
        ax.set(title=f"{fmt}: per-rank compute efficiency", xlabel="tokens per rank",
               ylabel="T(whole) / (cp T(rank))")
        plain_log_axis(ax, [r["seq_len"] // r["cp_size"] for r in plan["rows"] if r["pattern"] != "whole"])
        ax.legend(fontsize=7)
    return save_figure(fig, out_dir, "plan_efficiency.png")


def _series(rows: list[dict], pass_name: str, fmt: str, cp: int) -> dict[str, list[tuple[int, dict]]]:
    series: dict[str, list[tuple[int, dict]]] = {}
    for r in rows:
        if r["pass_name"] == pass_name and r["qkv_format"] == fmt and r["cp_size"] == cp and r["impl"] != "single":
            series.setdefault(f"{r['impl']} {r['comm_type']}", []).append((r["seq_len"], r))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in series.items()}


def plots(results: dict, out_dir: str) -> list[str]:
    """One PNG per (pass, format): time and CP efficiency against sequence length, one panel per cp."""
    rows = results.get("attention", [])
    written = []
    for pass_name in sorted({r["pass_name"] for r in rows}):
        for fmt in sorted({r["qkv_format"] for r in rows}):
            cps = sorted({r["cp_size"] for r in rows if r["cp_size"] > 1})
            if not cps:
                continue
            fig, axes = require_matplotlib().subplots(2, len(cps), figsize=(5 * len(cps), 7), squeeze=False)
            for col, cp in enumerate(cps):
                for name, points in _series(rows, pass_name, fmt, cp).items():
                    xs = [s for s, _ in points]
                    axes[0][col].plot(xs, [r["median_ms"] for _, r in points], label=name, **style(name))
                    axes[1][col].plot(xs, [r.get("cp_efficiency") or float("nan") for _, r in points], label=name,
                                      **style(name))
                axes[0][col].set(title=f"{pass_name} {fmt} cp={cp}", yscale="log", ylabel="median ms")
                axes[1][col].set(xlabel="sequence length (tokens)", ylabel="CP efficiency (noisy rows: gaps)")
                for ax in axes[:, col]:
                    plain_log_axis(ax, [r["seq_len"] for r in rows])
                    if ax.lines:
                        ax.legend(fontsize=7)
            written.append(save_figure(fig, out_dir, f"attn_{pass_name}_{fmt}.png"))
    if "plan" in results:
        written.append(plan_plot(results["plan"], out_dir))
    if "masks" in results:
        written.append(masks_plot(results["masks"], out_dir))
    if "generate" in results:
        written.append(generate_plot(results["generate"], out_dir))
    if "memory" in results:
        written.append(memory_plot(results["memory"], out_dir))
    if "auto" in results:
        written.append(auto_plot(results["auto"], out_dir))
    return written


def auto_plot(auto: dict, out_dir: str) -> str:
    """Predicted against measured milliseconds of every (case, pattern) pair, log-log, the 25% band shaded."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6, 5.5))
    for pattern in sorted({r["pattern"] for r in auto["rows"]}):
        rows = [r for r in auto["rows"] if r["pattern"] == pattern]
        ax.scatter([r["median_ms"] for r in rows], [r["predicted_ms"] for r in rows], label=pattern, s=18)
    values = [v for r in auto["rows"] for v in (r["median_ms"], r["predicted_ms"])]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey", alpha=0.2,
                    label="within 25%")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms (fwd+bwd, slowest rank)",
           ylabel=f"predicted ms ({auto['profile']})", title="cost model vs measurement, every pattern")
    ax.legend(fontsize=7)
    return save_figure(fig, out_dir, "auto_predicted_vs_measured.png")
