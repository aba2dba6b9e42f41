"""Tables of ``cp-bench`` results (markdown) and the ratios they print (plots: :mod:`.plots`)."""

from __future__ import annotations

import statistics

MIB = 1 << 20
NOISY_SPREAD = 0.10
"""A row whose repetitions spread more than this ((max - min) / median) gets no ratio verdict."""


def _key(row: dict, *fields: str) -> tuple:
    return tuple(row[f] for f in fields)


def spread(times_ms: list[float]) -> float:
    """``(max - min) / median`` of a row's repetitions."""
    return (max(times_ms) - min(times_ms)) / statistics.median(times_ms)


def add_efficiency(rows: list[dict]) -> list[dict]:
    """Add ``spread`` to every row, ``cp_efficiency`` (single-process median on the same total threads
    / this row's median) and, for ``torch_ring`` rows, ``ours_speedup`` (PyTorch's median / our p2p
    ring's median): each ratio from the medians the table prints beside it. A ratio involving a row
    whose spread exceeds :data:`NOISY_SPREAD` is ``None`` and the row is marked ``noisy`` (no
    verdict from a run that disagrees with itself). A ``single`` row's ``cp_size`` is the CP size
    whose launch (and total threads) it ran in."""
    for r in rows:
        r["spread"] = spread(r["times_ms"])
    single = {_key(r, "cp_size", "seq_len", "qkv_format", "pass_name"): r for r in rows if r["impl"] == "single"}
    ring = {_key(r, "cp_size", "seq_len", "qkv_format", "pass_name"): r
            for r in rows if r["impl"] == "local" and r["comm_type"] == "p2p"}
    for r in rows:
        if r["impl"] == "single":
            continue
        key = _key(r, "cp_size", "seq_len", "qkv_format", "pass_name")
        r["cp_efficiency"] = _ratio(single.get(key), r)
        if r["impl"] == "torch_ring":
            r["ours_speedup"] = _ratio(r, ring.get(key))
        r["noisy"] = any(other is not None and other["spread"] > NOISY_SPREAD
                         for other in (r, single.get(key), ring.get(key) if r["impl"] == "torch_ring" else None))
    return rows


def _ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    """``numerator median / denominator median``, ``None`` when a row is missing or noisy."""
    if numerator is None or denominator is None or max(numerator["spread"], denominator["spread"]) > NOISY_SPREAD:
        return None
    return numerator["median_ms"] / denominator["median_ms"]


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _spread_cell(row: dict) -> str:
    return f"{100 * row['spread']:.0f}%" + (" (noisy)" if row["spread"] > NOISY_SPREAD else "")


def _verdict(row: dict, key: str) -> str:
    """A ratio cell: the value, ``noisy`` when a row it needs spread over 10%, ``-`` when not applicable."""
    if key not in row:
        return "-"
    return "noisy" if row[key] is None and row.get("noisy") else _fmt(row[key], ".3f")


def attention_table(rows: list[dict]) -> str:
    head = ("| impl | comm | cp | S | format | pass | threads/rank | median ms | spread | CP eff. | vs ours p2p "
            "| peak MiB/rank | MiB sent/rank | load balance |\n|" + "---|" * 14)
    lines = [head]
    for r in sorted(rows, key=lambda r: _key(r, "pass_name", "qkv_format", "seq_len", "cp_size", "impl", "comm_type")):
        lines.append(
            f"| {r['impl']} | {r['comm_type']} | {r['cp_size']} | {r['seq_len']} | {r['qkv_format']} "
            f"| {r['pass_name']} "
            f"| {r['threads']} | {r['median_ms']:.1f} | {_spread_cell(r)} | {_verdict(r, 'cp_efficiency')} "
            f"| {_verdict(r, 'ours_speedup')} | {r['peak_memory_bytes'] / MIB:.1f} "
            f"| {r['bytes_sent'] / MIB:.1f} | {_fmt(r['load_balance'], '.4f')} |"
        )
    return "\n".join(lines)


def e2e_tables(e2e: dict) -> str:
    lines = ["| cp | S | tokens/s | peak RSS MiB/rank (max) |", "|---|---|---|---|"]
    for r in e2e["train"]:
        lines.append(f"| {r['cp_size']} | {r['seq_len']} | {r['tokens_per_s']:.0f} "
                     f"| {max(r['peak_memory_bytes_per_rank']) / MIB:.0f} |")
    lines += ["", "| cp | S | peak MiB/rank (max) | activation MiB/rank (max) | activation vs cp=1 |",
              "|---|---|---|---|---|"]
    by_cp: dict[int, list[dict]] = {}
    for r in e2e["memory"]:
        by_cp.setdefault(r["cp_size"], []).append(r)
    base = max(r["activation_bytes"] for r in by_cp.get(1, [{"activation_bytes": 0}])) or None
    for cp, ranks in sorted(by_cp.items()):
        act = max(r["activation_bytes"] for r in ranks)
        lines.append(f"| {cp} | {ranks[0]['seq_len']} | {max(r['peak_bytes'] for r in ranks) / MIB:.1f} "
                     f"| {act / MIB:.1f} | {_fmt(act / base if base else None, '.3f')} |")
    o = e2e["overhead"]
    lines += ["", "| S | cp=1 handler ms | plain SDPA ms | overhead |", "|---|---|---|---|",
              f"| {o['seq_len']} | {o['handler_cp1_ms']:.1f} | {o['plain_sdpa_ms']:.1f} "
              f"| {100 * o['overhead']:+.2f}% |"]
    return "\n".join(lines)


def tp_table(tp: dict) -> str:
    """Tokens/s and peak RSS per rank of each TP x CP layout (one cp-train run each)."""
    m, base = tp["model"], next((r["tokens_per_s"] for r in tp["rows"] if r["tp"] == 1), None)
    rows = [[r["tp"], r["cp"], "on" if r["sequence_parallel"] else "off", r["seq_len"], f"{r['tokens_per_s']:.0f}",
             _fmt(r["tokens_per_s"] / base if base else None, ".2f"),
             f"{max(r['peak_memory_bytes_per_rank']) / MIB:.0f}"] for r in tp["rows"]]
    return table(f"{tp['world']} ranks on this machine's cores, gloo; the reference GPT (hidden {m['hidden_size']}, "
                 f"{m['num_layers']} layers, {m['num_attention_heads']}/{m['num_query_groups']} heads, FFN "
                 f"{m['ffn_hidden_size']}), p2p, one sequence per step, mean tokens/s after the first step",
                 ["tp", "cp", "sequence parallel", "S", "tokens/s", "vs tp 1", "peak RSS MiB/rank (max)"], rows)


def markdown(results: dict) -> str:
    parts = [f"# cp-bench results\n\nCommand: `{results['command']}`  \nMachine: {results['machine']}\n"]
    if results.get("peer_unavailable"):
        parts.append(f"PyTorch ring peer not run: {results['peer_unavailable']}\n")
    for key, title, render in (
            ("attention", "Attention", attention_table),
            ("e2e", "End to end (reference GPT)", e2e_tables),
            ("plan", "Per-rank compute (plan mode)", plan_table),
            ("launches", "Kernel launches per rank-step (launches mode)", launches_table),
            ("masks", "Attention variants per rank (masks mode)", masks_table),
            ("generate", "Prefill and decode with a sharded KV cache (generate mode)", generate_table),
            ("memory", "Memory per rank (memory mode)", memory_tables),
            ("hybrid", "One hybrid layer per rank (hybrid mode)", hybrid_table),
            ("compile", "Compiled vs eager (compile mode)", compile_table),
            ("calibrate", "Cost profile (calibrate mode)", calibrate_table),
            ("auto", "Patterns measured vs the cost model, and auto's pick (auto mode)", auto_table),
            ("links", "Exposed communication on emulated links (links mode)", links_table),
            ("backtest", "The cost model against published GPU results (backtest mode)",
             backtest_table),
            ("tp", "Tensor parallelism x CP, cp-train per layout (tp mode)", tp_table)):
        if key in results:
            parts += [f"## {title}\n", render(results[key]), ""]
    return "\n".join(parts)


def links_table(lk: dict) -> str:
    """Per pattern, cp, link and pass: the compute, the emulated transfer, the exposure measured and modelled."""
    rows = [(r["pattern"], r["cp"], r["tokens"], r["ratio"], r["pass"], f"{r['compute_ms']:.1f}",
             f"{r['transfer_ms']:.1f}", f"{r['exposed_ms']:.1f}", f"{r['stalled_ms']:.1f}",
             f"{r['plain_stalled_ms']:.1f}", f"{r['model_exposed_ms']:.1f}", "yes" if r["agrees"] else "NO")
            for r in lk["rows"]]
    caption = (f"ms of the slowest rank, median; links held to latency {lk['latency_s'] * 1e6:.0f} us + bytes / a "
               "bandwidth set so that a ring step's compute is `ratio` x its K/V transfer; exposed = emulated - "
               "plain pass time; blocked = time the rank waits on its collectives, emulated and plain (gloo's own); "
               f"the model's agrees with the measurement in {100 * lk['agreeing']:.0f}% of the rows (within 5% of "
               "the transfer or 3% of the pass)")
    return table(caption, ["pattern", "cp", "S", "ratio", "pass", "compute", "transfer", "exposed", "blocked",
                           "blocked (plain)", "model exposed", "agrees"], rows)


def backtest_table(bt: dict) -> str:
    """One row per published configuration (published and predicted ms), then the summary of the pairs."""
    s = bt["summary"]
    pairs = {}
    for p in bt["pairs"]:
        pairs.setdefault(p["group"], []).append(p)
    rows = []
    for r in bt["rows"]:
        rows.append((r["group"], r["row"], f"{r['published_ms']:.3g}", f"{r['predicted_ms']:.3g}",
                     f"{r['predicted_ms'] / r['published_ms']:.2f}"))
    right = sum(1 for p in bt["pairs"] if p["winner_right"])
    judged = s["pairs"] - s["ties"]
    caption = (f"{s['rows']} published rows in {s['groups']} groups, {s['pairs']} pairs: the winner predicted in "
               f"{right} of {judged} ({100 * s['winner_right']:.0f}%; target {100 * s['targets']['winner']:.0f}%; "
               f"{s['ties']} ties within {100 * s['tie']:.0f}% left out), the ratio within "
               f"{100 * s['ratio_tolerance']:.0f}% in {100 * s['ratio_right']:.0f}% (target "
               f"{100 * s['targets']['ratio']:.0f}%). Sources: docs/performance.md; ms per call as published "
               "(iter/s inverted) and as predicted")
    table_rows = table(caption, ["group", "row", "published ms", "predicted ms", "predicted / published"], rows)
    missed = [(p["group"], p["pair"], f"{p['published_ratio']:.3f}", f"{p['predicted_ratio']:.3f}",
               "tie" if p["tie"] else ("right" if p["winner_right"] else "WRONG"),
               "right" if p["ratio_right"] else "WRONG") for p in bt["pairs"]
              if p["winner_right"] is False or not p["ratio_right"]]
    return table_rows + "\n\n" + table("The pairs the model misses (winner or ratio)",
                                         ["group", "pair", "published ratio", "predicted ratio", "winner", "ratio"],
                                         missed)


def calibrate_table(calibrated: dict) -> str:
    """Per group size: the compute fit's errors and every link's latency and bandwidth."""
    profile = calibrated["profile"]
    rows = []
    for size, group in profile["groups"].items():
        errors = [f"{d} median {100 * c['fit_error']['median_rel']:.0f}% max {100 * c['fit_error']['max_rel']:.0f}%"
                  for d, c in group["compute"].items() if c.get("fit_error")]
        links = ", ".join(f"{k} {v['latency_ms']:.3f} ms + {v['gbps']:.2f} GB/s" for k, v in group["links"].items())
        rows.append((size, "; ".join(errors), links))
    return table(f"{profile['name']}: {profile['source']} (written to {calibrated['path']})",
                 ["cp", "compute fit (relative error)", "links (latency + bandwidth)"], rows)


def auto_table(auto: dict) -> str:
    """One row per case: each pattern measured / predicted, the fastest, auto's pick and its ratio; the summary."""
    fields = ("tokens", "cp", "heads", "kv_heads", "head_dim", "kind", "levels")
    by_case: dict[tuple, dict] = {}
    for r in auto["rows"]:
        by_case.setdefault(tuple(r.get(k, True) for k in fields), {})[r["pattern"]] = r
    rows = []
    for c in auto["cases"]:
        key = tuple(c.get(k, True) for k in fields)
        cells = " / ".join(f"{p} {r['median_ms']:.0f} ({r['predicted_ms']:.0f})" for p, r in by_case[key].items())
        kind = c["kind"] + ("" if c.get("levels", True) or c["cp"] < 4 else ", flat")
        rows.append((c["tokens"], c["cp"], f"{c['heads']}/{c['kv_heads']}", c["head_dim"], kind, cells,
                     c["fastest"], c["auto"], f"{c['auto_over_fastest']:.2f}"))
    s = auto["summary"]
    regret = (f"regret (auto / fastest) mean {s['regret_mean']:.3f}, worst {s['regret_worst']:.2f}; "
              if "regret_mean" in s else "")
    caption = (f"fwd+bwd ms per layer, measured (predicted by {auto['profile']}); {regret}auto within 5% of the "
               f"fastest in "
               f"{100 * s['auto_within_5pct']:.0f}% of {s['cases']} cases, within 15% in "
               f"{100 * s['auto_within_15pct']:.0f}%, worst {s['auto_worst_ratio']:.2f}x; predictions within 25% "
               f"in {100 * s['prediction_within_25pct']:.0f}% of {s['pairs']} (case, pattern) pairs, median error "
               f"{100 * s['prediction_median_abs_error']:.0f}%")
    return table(caption, ["tokens", "cp", "H/Hkv", "D", "mask", "pattern measured (predicted)", "fastest", "auto",
                           "auto / fastest"], rows)


def table_head(caption: str, columns: list[str]) -> list[str]:
    """A Markdown table's first lines: the caption paragraph, the header row and its rule."""
    return [caption + "\n", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def table(caption: str, columns: list[str], rows) -> str:
    """A Markdown table: :func:`table_head`, then one line per row of ``rows`` (each a list of cells, shown as
    ``str``; ``None``: ``-``)."""
    lines = ["| " + " | ".join("-" if cell is None else str(cell) for cell in cells) + " |" for cells in rows]
    return "\n".join([*table_head(caption, columns), *lines])


def generate_table(gen: dict) -> str:
    """Prefill time, its CP efficiency, decode time per token (and vs cp=1), KV cache per rank."""
    m = gen["model"]
    rows = sorted(gen["rows"], key=lambda r: (r["prompt_len"], r["cp_size"]))
    return table(f"reference GPT hidden {m['hidden_size']}, {m['num_layers']} layers, {m['heads']}/{m['kv_heads']} "
                 f"heads, float32, one prompt, {gen['new_tokens']} new tokens, {gen['cores']} cores shared by the "
                 "ranks", ["prompt", "cp", "prefill s", "prefill CP eff. (same cores)", "decode ms/token",
                           "decode vs cp=1", "KV MiB/rank"],
                 [[r["prompt_len"], r["cp_size"], f"{r['prefill_s']:.2f}", _fmt(r.get("prefill_efficiency"), ".2f"),
                   f"{1e3 * r['decode_s_per_token']:.2f}", _fmt(r.get("decode_vs_cp1"), ".2f"),
                   f"{r['kv_bytes_per_rank_max'] / 2**20:.2f}"] for r in rows])


def memory_tables(mem: dict) -> str:
    """Saved bytes per token (measured), training state and RSS of the runs here, the 80 GB projection."""
    s, a = mem["llama_shape"], mem["assumptions"]
    measured = table(f"Saved for the backward, one Llama-3-8B layer (hidden {s['hidden_size']}, "
                     f"{s['num_attention_heads']}/{s['num_query_groups']} heads, FFN {s['ffn_hidden_size']}, "
                     f"vocabulary {s['vocab_size']}), bfloat16, {mem['layer_tokens']} tokens, cp 1 "
                     f"(saved-tensor hooks{', fake tensors' if mem.get('layer_tensors') == 'fake' else ''})",
                     ["recompute", "loss", "MLP", "layer bytes/token", "of which the MLP",
                      "outside the layers bytes/token"],
                     [["on" if r["recompute"] else "off",
                       f"chunks of {r['loss_chunk_tokens']}" if r["loss_chunk_tokens"] else "whole",
                       f"chunks of {r['mlp_chunk_tokens']}" if r.get("mlp_chunk_tokens") else "whole",
                       f"{r['layer_bytes_per_token']:,.0f}", f"{r['mlp_bytes_per_token']:,.0f}",
                       f"{r['other_bytes_per_token']:,.0f}"]
                      for r in mem["measured"]])
    local = table(f"cp-train here: reference GPT {mem['local_model']}, byte vocabulary, 4 ranks (dp 2 x cp 2), "
                  "float32, AdamW", ["sharding", "recompute", "sequence", "parameters + gradients + optimizer per rank "
                                     "(MiB)", "vs ideal", "peak RSS per rank (MiB)"],
                  [["FSDP2" if r["fsdp"] else "DDP", "on" if r["recompute"] else "off", r["seq_len"],
                    f"{r['state_bytes_per_rank'] / 2**20:.1f}", f"{r['state_vs_ideal']:.3f}",
                    f"{r['peak_rss_bytes_per_rank'] / 2**20:.0f}"] for r in mem["local"]])
    projection = table(f"PROJECTION (not a run): Llama-3-8B on {a['gpu_bytes'] / 1e9:.0f} GB GPUs, FSDP2 over the cp "
                       f"ranks, {a['bytes_per_parameter']} bytes per parameter, {100 * a['usable']:.0f}% usable, loss "
                       f"chunks of {a['chunk_tokens']}, from the measured bytes per token above",
                       ["cp", "recompute", "loss", "MLP", "activation offload", "state GB/rank", "GPU bytes/token",
                        "tokens/rank", "sequence", "host bytes/token"],
                       [[r["cp_size"], "on" if r["recompute"] else "off", "chunked" if r["chunked_loss"] else "whole",
                         "tiled" if r.get("tiled_mlp") else "whole", "on" if r["offload"] else "off",
                         f"{r['state_gb']:.1f}", f"{r['gpu_bytes_per_token']:,.0f}", f"{r['tokens_per_rank']:,}",
                         f"{r['sequence']:,}",
                         f"{r['host_bytes_per_token']:,.0f}" if r["offload"] else "-"] for r in mem["projection"]])
    parts = [measured, local, projection]
    for name, tp in mem.get("tp", {}).items():
        t = tp["shape"]
        parts.append(table(f"Saved for the backward per TP rank, one {name} layer (hidden {t['hidden_size']}, "
                           f"{t['num_attention_heads']}/{t['num_query_groups']} heads, FFN {t['ffn_hidden_size']}), "
                           "bfloat16, chunked loss, the layer one TP rank computes (fake tensors)",
                           ["tp", "recompute", "layer bytes/token", "of which the norms",
                            "outside the layers bytes/token"],
                           [[r["tp"], "on" if r["recompute"] else "off", f"{r['layer_bytes_per_token']:,.0f}",
                             f"{r['norm_bytes_per_token']:,.0f}", f"{r['other_bytes_per_token']:,.0f}"]
                            for r in tp["measured"]]))
        parts.append(table(f"PROJECTION (not a run): {name}, TP x CP on {a['gpu_bytes'] / 1e9:.0f} GB GPUs, "
                           "recomputation and the chunked loss on, FSDP2 over the cp ranks, TP inside a node",
                           ["GPUs", "tp", "cp", "sequence parallel", "state GB/rank", "GPU bytes/token",
                            "tokens/rank", "sequence"],
                           [[r["where"], r["tp"], r["cp"], "on" if r["sequence_parallel"] else "off",
                             f"{r['state_gb']:.1f}", f"{r['gpu_bytes_per_token']:,.0f}", f"{r['tokens_per_rank']:,}",
                             f"{r['sequence']:,}"] for r in tp["projection"]]))
    return "\n\n".join(parts)


def hybrid_table(hybrid: dict) -> str:
    """State passing vs all-gathering the sequence: the slowest rank's fwd+bwd and the bytes each rank sends."""
    m = hybrid["layer"]
    caption = (f"Gated DeltaNet layer, hidden {m['hidden_size']}, {m['value_heads']} value / {m['key_heads']} key "
               f"heads of {m['head_dim']}, conv {m['conv_taps']} taps, float32, batch 1, fwd+bwd, slowest rank's "
               f"median of {hybrid['reps']}, {hybrid['cores']} cores shared by the ranks")
    rows = sorted(hybrid["rows"], key=lambda r: (r["seq_len"], r["cp_size"]))
    return table(caption, ["S", "cp", "state passing s", "KiB sent/rank", "all-gather sequence s", "KiB sent/rank",
                           "time ratio", "max abs CP - gather"],
                 [[r["seq_len"], r["cp_size"], f"{r['cp_s']:.3f}", f"{r['cp_bytes'] / 2**10:.1f}",
                   f"{r['gather_s']:.3f}", f"{r['gather_bytes'] / 2**10:.1f}", f"{r['gather_s'] / r['cp_s']:.2f}",
                   f"{r['max_abs_diff']:.1e}"] for r in rows])


def masks_table(masks: dict) -> str:
    """Full causal vs window vs chunks: the slowest rank's fwd+bwd, score pairs and K/V sent per rank."""
    s = masks["shape"]
    caption = (f"{s['device']}, {s['dtype']}, H={s['num_heads']} Hkv={s['num_kv_heads']} D={s['head_dim']}, kernel "
               f"{masks['kernel']}, S={masks['seq_len']}, cp={masks['cp_size']} (p2p), fwd+bwd, slowest rank")
    places = list(masks["rows"][0].get("explicit_blocks", {}))
    columns = ["case", "exchange", "rank ms", "rank ms, masked blocks as explicit scores", "time vs full",
               "score pairs vs full", "K/V tokens sent per rank", "K/V MiB sent",
               *(f"explicit blocks per rank, {where}" for where in places)]
    return table(caption, columns, [[r["case"], "halo" if r["halo"] else "ring", f"{r['median_ms']:.1f}",
                                     _fmt(r.get("explicit_scores_ms"), ".1f"),
                                     f"{r['time_vs_full']:.3f}", f"{r['pairs_vs_full']:.3f}", r["kv_tokens_sent"],
                                     f"{r['kv_bytes_sent'] / 2**20:.2f}",
                                     *(r["explicit_blocks"][where] for where in places)] for r in masks["rows"]])


def plan_table(plan: dict) -> str:
    """Per-rank compute efficiency ``T(whole) / (cp * T(rank))`` of every pattern, against each whole-sequence
    reference (``--whole-kernels``)."""
    s = plan["shape"]
    whole = {(r["qkv_format"], r["seq_len"], r.get("reference", "sdpa")): r["median_ms"] for r in plan["rows"]
             if r["pattern"] == "whole"}
    rows = [r for r in plan["rows"] if r["pattern"] != "whole"]
    references = list(dict.fromkeys(name for r in rows for name in r.get("efficiency_vs", {"whole": 0})))
    return table(f"{plan['device_name']}, {s['dtype']}, H={s['num_heads']} Hkv={s['num_kv_heads']} D={s['head_dim']}, "
                 f"kernel {plan['kernel']}, causal fwd+bwd, thd mean document {s['thd_mean_doc']}",
                 ["format", "S", "pattern", "cp", "tokens/rank", "rank ms",
                  *(f"{name} ms" for name in references), *(f"efficiency vs {name}" for name in references)],
                 [[r["qkv_format"], r["seq_len"], r["pattern"], r["cp_size"], r["seq_len"] // r["cp_size"],
                   f"{r['median_ms']:.2f}",
                   *(_fmt(whole.get((r["qkv_format"], r["seq_len"], name)), ".2f") for name in references),
                   *(_fmt(r.get("efficiency_vs", {}).get(name, r["efficiency"] if name == "whole" else None), ".3f")
                     for name in references)] for r in rows])


def launches_table(launches: dict) -> str:
    """Operators (kernel launches, a lower bound) of one rank's fwd+bwd (the busier end of the ring, named), per
    CUDA kernel."""
    s, names = launches["shape"], launches["kernels"]
    caption = (f"meta tensors, {s['dtype']}, H={s['num_heads']} Hkv={s['num_kv_heads']} D={s['head_dim']}, causal "
               f"fwd+bwd, thd mean document {s['thd_mean_doc']}")
    return table(caption, ["format", "S", "pattern", "cp", "rank", "tokens/rank", "blocks", "tiles x cp / whole",
                           *names],
                 [[r["qkv_format"], r["seq_len"], r["pattern"], r["cp_size"], r.get("rank", 0),  # before: rank 0
                   r["seq_len"] // r["cp_size"], r["blocks"],
                   f"{r['tile_ratio']:.2f}", *("n/a" if r["ops"][n] is None else r["ops"][n] for n in names)]
                  for r in launches["rows"]]) + "\n\n" + launch_bytes_table(launches)


def launch_bytes_table(launches: dict) -> str:
    """MB moved outside the attention kernels per rank-step, per CUDA kernel, and thd over bshd at the same case."""
    names = launches["kernels"]
    bshd = {(r["seq_len"], r["pattern"], r["cp_size"]): r["bytes_outside"] for r in launches["rows"]
            if r["qkv_format"] == "bshd"}

    def cell(r, n):
        value = r["bytes_outside"][n]
        if value is None:
            return "n/a"
        base = bshd.get((r["seq_len"], r["pattern"], r["cp_size"]), {}).get(n) if r["qkv_format"] == "thd" else None
        return f"{value / 1e6:.0f}" + (f" ({value / base:.2f}x bshd)" if base else "")

    return table("MB moved outside the attention kernels per rank-step (every other operator's tensors read and "
                 "written), and thd over bshd at the same tokens",
                 ["format", "S", "pattern", "cp", *names],
                 [[r["qkv_format"], r["seq_len"], r["pattern"], r["cp_size"], *(cell(r, n) for n in names)]
                  for r in launches["rows"]])


def compile_table(compiled: dict) -> str:
    """Eager vs per-block compiled training step of the reference GPT, with the compiled forward's graphs and the
    eager forward's cp_handler Python calls."""
    m = compiled["model"]
    caption = (f"Reference GPT, hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_attention_heads']} / "
               f"{m['num_query_groups']} heads, float32, batch 1, fwd+bwd, every layer compiled "
               f"({compiled['backend']}, fullgraph), slowest rank's median of {compiled['reps']}, {compiled['cores']} "
               "cores shared by the ranks; graphs / breaks of the whole forward (torch._dynamo.explain); cp_handler "
               "Python calls of one eager forward")
    rows = sorted(compiled["rows"], key=lambda r: (r["seq_len"], r["comm_type"]))
    return table(caption, ["comm type", "S", "cp", "eager s", "compiled s", "speed-up", "compile s",
                           "graphs / breaks", "Python calls / forward (/ layer)", "max abs compiled - eager"],
                 [[r["comm_type"], r["seq_len"], r["cp_size"], f"{r['eager_s']:.3f}", f"{r['compiled_s']:.3f}",
                   f"{r['eager_s'] / r['compiled_s']:.2f}", f"{r['compile_s']:.1f}", f"{r['graphs']} / {r['breaks']}",
                   f"{r['python_calls']} ({r['python_calls_per_layer']:.0f})", f"{r['max_abs_diff']:.1e}"]
                  for r in rows])
