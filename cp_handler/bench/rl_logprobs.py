"""Memory per rank of an RL trainer's log-probability path under CP (``python -m cp_handler.bench.rl_logprobs``).

What GRPO / RLOO / DPO run on every step (:mod:`cp_handler.integrations.hf_fused_head`): a batch of prompt +
completion rows, this rank's shard through the model, TRL's fused LM head scoring the completion tokens (log-probs
and entropies), the per-token outputs combined over the CP group. Measured on spawned gloo ranks with
``torch.autograd.graph.saved_tensors_hooks`` as ``cp-bench --modes memory`` measures (every tensor saved for the
backward counted once per storage, parameters excluded): the total saved and the largest saved tensor, beside the
bytes of this rank's ``(S / cp) x V`` float32 logits. Two paths on the same shard: TRL's fused head (tiles of 4096
tokens x 32768 vocabulary entries, recomputed in the backward) and the plain one (the model's logits, then
``log_softmax``), which saves the logits.

A tiny Llama body (hidden 128, 2 layers) with a 32768-word vocabulary, so that the head dominates as it does at scale
(Llama-3's 128256 words over a 4096-wide model); one row of ``--tokens`` tokens (a quarter prompt). Prints a table and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

SHAPE = {"vocab_size": 32768, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 65536}
"""The model of the measurement (module doc)."""


def saved(model: torch.nn.Module, step) -> dict:
    """``step()`` (a forward returning a loss) and its backward under saved-tensor hooks: ``{"total": bytes,
    "largest": bytes, "largest_shape": shape}`` of the non-parameter tensors saved, once per storage."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, largest = {}, [0, ()]

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            if seen[key] > largest[0]:
                largest[:] = [seen[key], tuple(t.shape)]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return {"total": sum(seen.values()), "largest": largest[0], "largest_shape": list(largest[1])}


def measure(tokens: int, shape: dict = SHAPE) -> list[dict]:
    """On this rank of an initialized group (the CP group: every rank): both paths' saved bytes (module doc)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from ..integrations.hf_batch import shard_batch
    from ..integrations.hf_fused_head import install_cp_fused_head
    from ..integrations.transformers import register
    from ..runtime.config import ContextParallelConfig

    cp = dist.get_world_size()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="sdpa"))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    register(model)
    config = ContextParallelConfig(context_parallel_size=cp)
    install_cp_fused_head(model, config, dist.group.WORLD)
    ids = torch.randint(2, shape["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :tokens // 4] = -100

    def fused():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
        return -out.log_probs.sum() - 0.01 * out.entropy.sum()

    def plain():
        sharded = shard_batch({"input_ids": ids, "labels": labels}, config, dist.group.WORLD)
        inputs = {k: v for k, v in sharded.inputs.items() if k not in ("labels", "shift_labels")}
        logits = model(**inputs, use_cache=False, cp_handler=sharded.handler).logits.float()
        local = sharded.inputs["shift_labels"]
        logp = torch.log_softmax(logits, -1).gather(-1, local.clamp(min=0)[..., None])[..., 0]
        return -(logp * (local != -100)).sum()

    local_tokens = tokens // cp
    logits_bytes = local_tokens * shape["vocab_size"] * 4
    return [{"path": name, "cp": cp, "tokens": tokens, "tokens_per_rank": local_tokens,
             "logits_bytes_per_rank": logits_bytes, **saved(model, step)}
            for name, step in (("fused head (TRL)", fused), ("logits + log_softmax", plain))]


def _rank(tokens: int) -> list[dict]:
    from ..runtime.launch import rank_session

    with rank_session("rl-logprobs", device_type="cpu"):
        return measure(tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cp", type=int, default=2, help="CP ranks (spawned, gloo)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the row (prompt + completion)")
    parser.add_argument("--out", type=Path, default=Path("rl_logprobs.json"), help="the JSON written")
    args = parser.parse_args(argv)
    from ..runtime.launch import launch

    rows = launch(_rank, args.cp, args.tokens, program="rl-logprobs")[0]
    mib = 2 ** 20
    print(f"{'path':22} {'cp':>3} {'tokens/rank':>12} {'logits MiB':>11} {'saved MiB':>10} {'largest MiB':>12}  shape")
    for row in rows:
        print(f"{row['path']:22} {row['cp']:3d} {row['tokens_per_rank']:12d} "
              f"{row['logits_bytes_per_rank'] / mib:11.1f} {row['total'] / mib:10.1f} {row['largest'] / mib:12.1f}  "
              f"{tuple(row['largest_shape'])}")
    args.out.write_text(json.dumps({"shape": SHAPE, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
