"""Prefill and decode under CP (``cp-bench --modes generate``): time to prefill one prompt and time per
decoded token against prompt length, at each CP size, with the KV cache each rank holds.

Each CP size is its own launch of ``cp`` ranks with ``max(1, cores // cp)`` threads each (as the
attention mode). Per prompt length: one untimed generation of a short prompt (warm-up), then
:func:`~cp_handler.inference.generate` of a random prompt with ``--gen-new-tokens`` new tokens,
between barriers (the slowest rank sets the time). The ranks of every launch share the same
``--cores``, so the prefill's CP efficiency is ``T_prefill(cp=1) / T_prefill(cp)`` on the same cores
(1.0: splitting costs nothing). With one device per rank (a GPU each) the same quantity is
``T(cp=1) / (cp * T(cp))`` per device, the usual definition; here each rank has ``1 / cp`` of the
machine, so that formula would halve at cp 2 whatever the algorithm. Decode is reported per token.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..inference import generate
from ..runtime.launch import launch, rank_session
from .case_progress import case_progress


def _model(args):
    from ..models import GPTConfig, GPTModel

    torch.manual_seed(0)
    return GPTModel(GPTConfig(hidden_size=args.gen_hidden_size, num_layers=args.gen_layers,
                              num_attention_heads=args.gen_heads, num_query_groups=args.gen_kv_heads,
                              ffn_hidden_size=2 * args.gen_hidden_size)).eval()


def gen_worker(args, threads: int) -> list[dict] | None:
    with rank_session("cp-bench", device_type="cpu", threads=threads):
        cp = dist.get_world_size()
        group = dist.group.WORLD if cp > 1 else None
        model = _model(args)
        rows, rank0 = [], dist.get_rank() == 0
        bar = case_progress(len(args.gen_prompt_lens), f"generate cp={cp}", enabled=rank0)
        for length in args.gen_prompt_lens:
            bar.begin(prompt=length)
            warm = [torch.randint(0, 256, (64,))]
            generate(model, warm, 2, cp_group=group, num_layers=args.gen_layers)
            prompt = [torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))]
            dist.barrier()
            began = time.perf_counter()
            result = generate(model, prompt, args.gen_new_tokens, cp_group=group, num_layers=args.gen_layers)
            dist.barrier()
            total = time.perf_counter() - began
            times = torch.tensor([result.prefill_s, result.decode_s, float(result.kv_cache_bytes)])
            gathered = [torch.zeros_like(times) for _ in range(cp)]
            dist.all_gather(gathered, times)
            slowest = torch.stack(gathered).max(0).values
            rows.append({"cp_size": cp, "prompt_len": length, "prefill_s": slowest[0].item(),
                         "decode_s_per_token": slowest[1].item() / max(1, args.gen_new_tokens - 1),
                         "kv_bytes_per_rank_max": int(slowest[2].item()), "total_s": total})
            bar.update(prompt=length)
        bar.close()
        return rows if rank0 else None


def run(args) -> dict:
    """``--modes generate``: every CP size x prompt length (launches of cp ranks)."""
    rows = []
    for cp in args.gen_cp_sizes:
        rows += launch(gen_worker, cp, args, max(1, args.cores // cp), program="cp-bench")[0]
    single = {r["prompt_len"]: r for r in rows if r["cp_size"] == 1}
    for r in rows:
        if r["prompt_len"] in single:
            base = single[r["prompt_len"]]
            r["prefill_efficiency"] = base["prefill_s"] / r["prefill_s"]  # same cores (module doc)
            r["decode_vs_cp1"] = r["decode_s_per_token"] / base["decode_s_per_token"]
    return {"model": {"hidden_size": args.gen_hidden_size, "num_layers": args.gen_layers, "heads": args.gen_heads,
                      "kv_heads": args.gen_kv_heads}, "new_tokens": args.gen_new_tokens, "cores": args.cores,
            "rows": rows}
