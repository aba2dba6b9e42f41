"""Memory per rank (``cp-bench --modes memory``): measured, and projected from what was measured.

* **Saved activations** (:func:`saved_bytes`): one training step of the reference GPT under
  ``torch.autograd.graph.saved_tensors_hooks``, every tensor saved for the backward counted once per storage
  (parameters excluded) and attributed to the transformer layer running when it was saved, else to the
  embedding / output head / loss: bytes per token per layer, and the head's and loss's bytes per token. Exact and
  machine-independent (what autograd keeps, not what an allocator reports). Measured at the Llama-3-8B layer
  shape (one layer, bfloat16) with the whole loss and the chunked one, with and without recomputation, with
  whole and tiled MLPs (:func:`~cp_handler.tiling.tile_mlps`), and at this machine's model shape through spawned
  CP ranks.
* **Training state per rank**: parameters, gradients and optimizer states of a ``cp-train`` run (its
  ``state_bytes_per_rank``), DDP vs ``--fsdp``, against the ideal ``whole / world``; and its peak RSS per rank.
* **Projection** (:func:`project`): the longest sequence per rank a GPU of 80 GB holds for the Llama-3-8B shape
  at cp 1 / 8 / 32 (FSDP over the cp ranks), from the measured bytes per token and stated assumptions; a
  projection, not a run.
"""

from __future__ import annotations

import contextlib

import torch

from ..config import AttentionShape, ContextParallelConfig
from ..handlers.local import LocalContextParallelHandler
from ..models import GPTConfig, GPTModel
from ..tiling import tile_mlps
from ..training.config import TrainConfig
from ..training.run import run_training
from ..training.tokens import BYTE_VOCAB_SIZE

LLAMA3_8B = {"hidden_size": 4096, "num_layers": 32, "num_attention_heads": 32, "num_query_groups": 8,
             "ffn_hidden_size": 14336, "vocab_size": 128256}
"""The Llama-3-8B shape (8.03B parameters)."""
PROJECTION = {"gpu_bytes": 80e9, "usable": 0.9, "bytes_per_parameter": 16, "chunk_tokens": 4096}
"""Projection assumptions: 80 GB per GPU, 10% of it left to the allocator, workspaces and communication buffers;
mixed precision (bf16 parameters and gradients, fp32 master weights and AdamW states: 2 + 2 + 4 + 4 + 4 bytes per
parameter, as Megatron-LM and DeepSpeed); the chunked loss's chunk."""
LOCAL_MODEL = {"hidden_size": 512, "num_layers": 4, "num_attention_heads": 8, "num_query_groups": 4,
               "ffn_hidden_size": 1408}
"""The model of the measured runs on this machine (byte vocabulary)."""


@contextlib.contextmanager
def _attributed(model: GPTModel, bins: dict):
    """Saved tensors' bytes into ``bins[key]`` (``mlp`` while a layer's feed-forward runs, ``layer`` while the
    rest of a transformer layer runs, else ``other``), once per storage, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, where = set(), ["other"]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            bins[where[-1]] = bins.get(where[-1], 0) + t.untyped_storage().nbytes()
        return t

    handles = [h for layer in model.layers for module, name in ((layer, "layer"), (layer.mlp, "mlp")) for h in (
        module.register_forward_pre_hook(lambda *_, n=name: where.append(n)),
        module.register_forward_hook(lambda *_: where.pop() and None))]  # None: the output stays
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()


def saved_bytes(model: GPTModel, tokens: torch.Tensor, handler=None, chunk: int | None = None) -> dict:
    """Bytes saved for the backward by one step of ``model`` on ``tokens (B, S_local)`` (module doc): per token
    per layer, and per token outside the layers (embedding, output head, loss)."""
    handler = handler or LocalContextParallelHandler()
    labels, mask = tokens.roll(-1, 1), torch.ones(tokens.shape, dtype=torch.float32)
    bins = {}
    with _attributed(model, bins):
        loss = model(tokens, cp_handler=handler, labels=labels, loss_mask=mask, loss_chunk_tokens=chunk)
    loss.backward()
    n, layers = tokens.numel(), len(model.layers)
    return {"tokens": n, "layer_bytes_per_token": (bins.get("layer", 0) + bins.get("mlp", 0)) / n / layers,
            "mlp_bytes_per_token": bins.get("mlp", 0) / n / layers, "other_bytes_per_token": bins.get("other", 0) / n}


def one_layer(shape: dict, recompute: bool) -> GPTModel:
    """One layer of ``shape`` with its embedding and output head, bfloat16, random weights (std 0.02)."""
    config = GPTConfig(**{**shape, "num_layers": 1})
    with torch.device("meta"):
        model = GPTModel(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
    if recompute:
        model.gradient_checkpointing_enable()
    return model


def measure_layer(tokens: int, shape: dict = LLAMA3_8B, chunk: int = 16) -> list[dict]:
    """Saved bytes of one layer of ``shape`` (bfloat16, cp 1) on ``tokens`` tokens: the whole loss vs chunks of
    ``chunk`` tokens, recomputation off / on; then with the chunked loss and the MLP tiled in chunks of ``chunk``."""
    rows = []
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))
    for recompute in (False, True):
        model = one_layer(shape, recompute)
        for tokens_per_chunk, mlp_chunk in ((None, None), (chunk, None), (chunk, chunk)):
            if mlp_chunk:
                tile_mlps(model, mlp_chunk)
            rows.append({"recompute": recompute, "loss_chunk_tokens": tokens_per_chunk, "mlp_chunk_tokens": mlp_chunk,
                         **saved_bytes(model, ids, chunk=tokens_per_chunk)})
            model.zero_grad(set_to_none=True)
    return rows


def local_runs(args) -> list[dict]:
    """``cp-train`` runs of :data:`LOCAL_MODEL` on this machine: DDP vs FSDP (cp 2, dp 2), state bytes and peak
    RSS per rank."""
    rows = []
    model = GPTConfig(vocab_size=BYTE_VOCAB_SIZE, **args.mem_local_model)
    shape = AttentionShape(model.num_attention_heads, model.num_query_groups, model.kv_channels, model.v_head_dim)
    cp = ContextParallelConfig(context_parallel_size=2, num_layers=model.num_layers)
    for fsdp in (False, True):
        for recompute in (False, True):
            config = TrainConfig(world_size=4, cp=cp, eval_cp=cp, model=model, attn_shape=shape,
                                 seq_len=args.mem_seq_len, batch_size=1, steps=2, fsdp=fsdp, recompute=recompute)
            metrics = run_training(config)
            state = metrics["state_bytes_per_rank"][0]
            rows.append({"fsdp": fsdp, "recompute": recompute, "world": 4, "cp_size": 2, "seq_len": args.mem_seq_len,
                         "state_bytes_per_rank": sum(state.values()), "state": state,
                         "peak_rss_bytes_per_rank": max(metrics["peak_memory_bytes_per_rank"])})
    whole = next(r["state_bytes_per_rank"] for r in rows if not r["fsdp"])
    for r in rows:
        r["state_vs_ideal"] = r["state_bytes_per_rank"] / (whole / (r["world"] if r["fsdp"] else 1))
    return rows


def parameters(shape: dict) -> int:
    """Parameters of a GPT of ``shape`` (untied embedding and head, SwiGLU, RMSNorm, no biases)."""
    h, kv_dim = shape["hidden_size"], shape["hidden_size"] // shape["num_attention_heads"] * shape["num_query_groups"]
    layer = 2 * h * h + 2 * h * kv_dim + 3 * h * shape["ffn_hidden_size"] + 2 * h
    return shape["num_layers"] * layer + 2 * shape["vocab_size"] * h + h


def project(measured: list[dict], cp_sizes=(1, 8, 32), shape: dict = LLAMA3_8B) -> list[dict]:
    """Longest tokens per rank (and sequence = tokens x cp) on one 80 GB GPU for the Llama-3-8B shape, per
    configuration, from ``measured`` (:func:`measure_llama`: one layer) and :data:`PROJECTION`'s assumptions.

    Per token: without recomputation every layer's saved bytes; with it, what a checkpointed layer keeps (its
    input: measured as the growth of the bytes saved outside the layers when recomputation is on) for every
    layer, plus one layer's saved bytes while it is recomputed; plus the embedding, head and loss. With offload
    every saved tensor is in host memory (``host_bytes_per_token``) and the GPU holds the recomputed layer's. A tiled
    MLP (with recomputation and the chunked loss) keeps its input instead of its intermediates."""
    by = {(r["recompute"], r["loss_chunk_tokens"] is not None, bool(r.get("mlp_chunk_tokens"))): r for r in measured}
    params, layers = parameters(shape), shape["num_layers"]
    layer_params = parameters({**shape, "num_layers": 1}) - parameters({**shape, "num_layers": 0})
    rows = []
    for cp in cp_sizes:
        for recompute in (False, True):
            for chunked in (False, True):
                for offload, tiled in ((False, False), (True, False), (False, True), (True, True)) \
                        if recompute and chunked else ((False, False),):
                    full, kept = by[False, chunked, tiled], by[True, chunked, tiled]
                    layer, outside = full["layer_bytes_per_token"], full["other_bytes_per_token"]
                    kept_per_layer = kept["other_bytes_per_token"] - outside
                    if not recompute:
                        saved = layers * layer + outside
                    else:
                        saved = layers * kept_per_layer + layer + outside
                    gpu = layer if offload else saved
                    static = PROJECTION["bytes_per_parameter"] * params / cp + 2 * 2 * layer_params  # + 2 gathered
                    loss = PROJECTION["chunk_tokens"] * shape["vocab_size"] * (2 + 4 + 4) if chunked else 0
                    free = PROJECTION["usable"] * PROJECTION["gpu_bytes"] - static - loss
                    tokens = int(free / gpu) if free > 0 else 0
                    rows.append({"cp_size": cp, "recompute": recompute, "chunked_loss": chunked, "offload": offload,
                                 "tiled_mlp": tiled,
                                 "state_gb": static / 1e9, "gpu_bytes_per_token": gpu, "tokens_per_rank": tokens,
                                 "sequence": tokens * cp, "host_bytes_per_token": saved if offload else 0})
    return rows


def run(args) -> dict:
    """``--modes memory``: the Llama-3-8B layer's saved bytes, the local runs, the projection."""
    local = local_runs(args)  # first: ranks started later would inherit the Llama layer's pages in their RSS
    measured = measure_layer(args.mem_layer_tokens)
    return {"llama_shape": LLAMA3_8B, "layer_tokens": args.mem_layer_tokens, "measured": measured,
            "local_model": args.mem_local_model, "local": local, "assumptions": PROJECTION,
            "projection": project(measured)}
