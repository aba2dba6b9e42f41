"""Memory per rank (``cp-bench --modes memory``): measured, and projected from what was measured.

* **Saved activations** (:func:`saved_bytes`): one training step of the reference GPT under
  ``torch.autograd.graph.saved_tensors_hooks``, every tensor saved for the backward counted once per storage
  (parameters excluded) and attributed to the transformer layer running when it was saved, else to the
  embedding / output head / loss: bytes per token per layer, and the head's and loss's bytes per token. Exact and
  machine-independent (what autograd keeps, not what an allocator reports). Measured at the Llama-3-8B layer
  shape (one layer, bfloat16) with the whole loss and the chunked one, with and without recomputation, with
  whole and tiled MLPs (:func:`~cp_handler.models.tiling.tile_mlps`), and at this machine's model shape through spawned
  CP ranks. The Llama layer runs on fake tensors (``FakeTensorMode``: the same code, autograd graph, shapes and
  dtypes, no arithmetic; about a second on any CPU). On real tensors its 1.3B bfloat16 weights took 22-27 s to
  fill, and on a CPU without bfloat16 instructions (AVX2; here ``ATEN_CPU_CAPABILITY=avx2``) the first of its six
  steps had not finished after 5 minutes (issue 50: the mode past 13 minutes); the bytes are the same
  (tests/test_bench.py compares both at a small shape; the Llama rows equal those measured on real tensors,
  ``docs/benchmarks/results/memory.json``).
* **Training state per rank**: parameters, gradients and optimizer states of a ``cp-train`` run (its
  ``state_bytes_per_rank``), DDP vs ``--fsdp``, against the ideal ``whole / world``; and its peak RSS per rank.
* **Projection** (:func:`project`): the longest sequence per rank a GPU of 80 GB holds for the Llama-3-8B shape
  at cp 1 / 8 / 32 (FSDP over the cp ranks), from the measured bytes per token and stated assumptions; a
  projection, not a run.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..handlers.local import LocalContextParallelHandler
from ..models import GPTConfig, GPTModel
from ..models.loss import TokenLoss
from ..models.tiling import tile_mlps
from ..runtime.config import AttentionShape, ContextParallelConfig
from ..training.config import TrainConfig
from ..training.run import run_training
from ..training.tokens import BYTE_VOCAB_SIZE
from .case_progress import each_case

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


LLAMA3_70B = {"hidden_size": 8192, "num_layers": 80, "num_attention_heads": 64, "num_query_groups": 8,
              "ffn_hidden_size": 28672, "vocab_size": 128256}
"""The Llama-3-70B shape (70.55B parameters)."""
TP_LAYOUTS = {"one node of 8 GPUs": ((8, 1), (4, 2), (2, 4), (1, 8)),
              "4 nodes of 8 GPUs": ((8, 4), (4, 8), (2, 16), (1, 32))}
"""The ``(tp, cp)`` layouts the TP projection compares (TP inside a node, as Megatron-LM places it)."""
TP_SHAPES = {"Llama-3-8B": LLAMA3_8B, "Llama-3-70B": LLAMA3_70B}
"""The models the TP projection is made for."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage while it lives (its ``StorageImpl``; fake tensors have no data pointer; a
    DTensor's: its local shard's)."""
    return _local(t).untyped_storage()._cdata


@contextlib.contextmanager
def _attributed(model: GPTModel, bins: dict):
    """Saved tensors' bytes into ``bins[key]`` (``mlp`` while a layer's feed-forward runs, ``norm`` while one of its
    two norms runs, ``layer`` while the rest of a transformer layer runs, else ``other``), once per storage (a
    DTensor: its local shard), parameters excluded."""
    params = {_storage(p) for p in model.parameters()}
    seen, where = set(), ["other"]

    def pack(t):
        ptr = _storage(t)
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            bins[where[-1]] = bins.get(where[-1], 0) + _local(t).untyped_storage().nbytes()  # a DTensor: its shard
        return t

    handles = [h for layer in model.layers for module, name in (
        (layer, "layer"), (layer.mlp, "mlp"), (layer.input_layernorm, "norm"), (layer.post_attention_layernorm, "norm"))
        for h in (
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
    per layer (of which the MLP's and the two norms'), and per token outside the layers (embedding, output head,
    loss)."""
    handler = handler or LocalContextParallelHandler()
    labels, mask = tokens.roll(-1, 1), torch.ones(tokens.shape, dtype=torch.float32)
    bins = {}
    with _attributed(model, bins):
        loss = model(tokens, cp_handler=handler, output=TokenLoss(labels, mask, chunk))
    loss.backward()
    n, layers = tokens.numel(), len(model.layers)
    inside = bins.get("layer", 0) + bins.get("mlp", 0) + bins.get("norm", 0)
    return {"tokens": n, "layer_bytes_per_token": inside / n / layers, "mlp_bytes_per_token": bins.get("mlp", 0) / n /
            layers, "norm_bytes_per_token": bins.get("norm", 0) / n / layers,
            "other_bytes_per_token": bins.get("other", 0) / n}


def one_layer(shape: dict, recompute: bool, mlp_chunk: int | None = None,
              fake: FakeTensorMode | None = None) -> GPTModel:
    """One layer of ``shape`` with its embedding and output head, bfloat16, recomputation on / off, the MLP tiled in
    chunks of ``mlp_chunk`` tokens (``None``: whole): on fake tensors of ``fake`` (shapes and dtypes only), else real
    random weights (std 0.02)."""
    with torch.device("meta"):
        model = GPTModel(GPTConfig(**{**shape, "num_layers": 1}))
    if fake is not None:
        if mlp_chunk:
            tile_mlps(model, mlp_chunk)  # on meta weights (its probe needs data; the reference MLP is token-wise)
        with fake:
            for module in model.modules():
                for name, p in list(module.named_parameters(recurse=False)):
                    setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16)))
    else:
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
        if mlp_chunk:
            tile_mlps(model, mlp_chunk)
    if recompute:
        model.gradient_checkpointing_enable()
    return model


def measure_layer(tokens: int, shape: dict = LLAMA3_8B, chunk: int = 16, fake: bool = True) -> list[dict]:
    """Saved bytes of one layer of ``shape`` (bfloat16, cp 1) on ``tokens`` tokens: the whole loss vs chunks of
    ``chunk`` tokens, recomputation off / on; then with the chunked loss and the MLP tiled in chunks of ``chunk``.
    ``fake``: on fake tensors (module doc; the same bytes in a second), else on real ones."""
    mode = FakeTensorMode() if fake else None
    with mode or contextlib.nullcontext():
        ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=None if fake else
                            torch.Generator().manual_seed(0))
    rows = []
    for recompute in (False, True):
        for tokens_per_chunk, mlp_chunk in ((None, None), (chunk, None), (chunk, chunk)):
            model = one_layer(shape, recompute, mlp_chunk, mode)
            with mode or contextlib.nullcontext():
                rows.append({"recompute": recompute, "loss_chunk_tokens": tokens_per_chunk,
                             "mlp_chunk_tokens": mlp_chunk, **saved_bytes(model, ids, chunk=tokens_per_chunk)})
    return rows


def tp_local_shape(shape: dict, tp: int) -> dict:
    """The layer one TP rank computes (``cp_handler.training.tensor_parallel``'s plan): ``H / tp`` query heads, ``Hkv /
    tp`` key-value heads (one, replicated, below), ``FFN / tp``; the hidden width, vocabulary and head dim whole."""
    heads = shape["num_attention_heads"]
    return {**shape, "num_attention_heads": heads // tp, "num_query_groups": max(1, shape["num_query_groups"] // tp),
            "ffn_hidden_size": shape["ffn_hidden_size"] // tp, "kv_channels": shape["hidden_size"] // heads}


def measure_tp_layer(tokens: int, shape: dict = LLAMA3_70B, tps=(1, 2, 4, 8), chunk: int = 16) -> list[dict]:
    """Saved bytes per TP rank of one layer of ``shape`` (bfloat16, fake tensors, chunked loss), recomputation off /
    on, at each ``tp``: the layer one TP rank computes (:func:`tp_local_shape`;
    tests/test_tensor_parallel.py::test_a_tp_rank_saves_what_the_layer_of_its_share_saves checks on real ranks that a
    split layer saves exactly that, and with sequence parallelism that less by the norms' share and the checkpointed
    input's, :func:`project_tp`)."""
    mode = FakeTensorMode()
    with mode:
        ids = torch.randint(0, shape["vocab_size"], (1, tokens))
    rows = []
    for tp in tps:
        for recompute in (False, True):
            model = one_layer(tp_local_shape(shape, tp), recompute, None, mode)
            with mode:
                rows.append({"tp": tp, "recompute": recompute, **saved_bytes(model, ids, chunk=chunk)})
    return rows


def tp_bytes_per_token(measured: list[dict], tp: int, num_layers: int, hidden_size: int,
                       sequence_parallel: bool, dtype_bytes: int = 2) -> float:
    """Bytes per token one TP rank keeps for the backward with recomputation on (:func:`measure_tp_layer`'s rows):
    every checkpointed layer's kept inputs, one recomputed layer's saved bytes, the bytes outside the layers. With
    sequence parallelism each TP rank keeps ``1 / tp`` of a checkpointed layer's hidden-state input (``hidden_size``
    values of ``dtype_bytes``; the rotary table stays whole) and of the two norms' saved tensors; the rest of a layer
    saves what it saves without it (the attention and the MLP run on the gathered tokens). The rule is checked on
    real ranks (:func:`measure_tp_layer`'s test)."""
    by = {(r["tp"], r["recompute"]): r for r in measured}
    full, kept = by[tp, False], by[tp, True]
    outside = full["other_bytes_per_token"]
    kept_per_layer, layer = kept["other_bytes_per_token"] - outside, full["layer_bytes_per_token"]
    if sequence_parallel:
        kept_per_layer -= hidden_size * dtype_bytes * (1 - 1 / tp)
        layer -= full["norm_bytes_per_token"] * (1 - 1 / tp)
    return num_layers * kept_per_layer + layer + outside


def project_tp(measured: list[dict], shape: dict = LLAMA3_70B, layouts: dict = TP_LAYOUTS) -> list[dict]:
    """The longest sequence a TP x CP layout holds on 80 GB GPUs (:data:`PROJECTION`'s assumptions; recomputation
    and the chunked loss on; FSDP2 over the cp ranks of each TP position), without and with sequence parallelism
    (``tp`` above 1), from :func:`measure_tp_layer`'s bytes for ``shape``.

    Per rank: the split weights' state over ``tp x cp``, the replicated ones' (embedding, output head, norms) over
    ``cp``; one layer's bf16 weights gathered and the next one prefetched; per token :func:`tp_bytes_per_token`;
    the chunked loss's chunk. Tokens per rank = free bytes / bytes per token; sequence = tokens per rank x cp (the
    TP ranks hold the same tokens)."""
    layers, h, vocab = shape["num_layers"], shape["hidden_size"], shape["vocab_size"]
    replicated = 2 * vocab * h + h + 2 * h * layers  # embedding, head, final norm, the layers' two norms
    split = parameters(shape) - replicated
    rows = []
    for where, pairs in layouts.items():
        for tp, cp in pairs:
            for sequence_parallel in (False, True) if tp > 1 else (False,):
                per_token = tp_bytes_per_token(measured, tp, layers, h, sequence_parallel)
                state = PROJECTION["bytes_per_parameter"] * (split / tp + replicated) / cp
                gathered = 2 * 2 * split / layers / tp  # one layer's bf16 weights, and the next one prefetched
                loss = PROJECTION["chunk_tokens"] * vocab * (2 + 4 + 4)
                free = PROJECTION["usable"] * PROJECTION["gpu_bytes"] - state - gathered - loss
                tokens = int(free / per_token) if free > 0 else 0
                rows.append({"where": where, "tp": tp, "cp": cp, "sequence_parallel": sequence_parallel,
                             "state_gb": state / 1e9, "gpu_bytes_per_token": per_token, "tokens_per_rank": tokens,
                             "sequence": tokens * cp})
    return rows


LOCAL_CASES = ((False, False), (False, True), (True, False), (True, True))
"""``(fsdp, recompute)`` of the ``cp-train`` runs here."""


def local_run(args, fsdp: bool, recompute: bool) -> dict:
    """A ``cp-train`` run of ``args.mem_local_model`` on this machine (cp 2, dp 2, ``args.mem_seq_len`` tokens, 2
    steps): its state bytes and peak RSS per rank."""
    model = GPTConfig(vocab_size=BYTE_VOCAB_SIZE, **args.mem_local_model)
    shape = AttentionShape(model.num_attention_heads, model.num_query_groups, model.kv_channels, model.v_head_dim)
    cp = ContextParallelConfig(context_parallel_size=2, num_layers=model.num_layers)
    config = TrainConfig(world_size=4, cp=cp, eval_cp=cp, model=model, attn_shape=shape, seq_len=args.mem_seq_len,
                         batch_size=1, steps=2, fsdp=fsdp, recompute=recompute)
    metrics = run_training(config)
    state = metrics["state_bytes_per_rank"][0]
    return {"fsdp": fsdp, "recompute": recompute, "world": 4, "cp_size": 2, "seq_len": args.mem_seq_len,
            "state_bytes_per_rank": sum(state.values()), "state": state,
            "peak_rss_bytes_per_rank": max(metrics["peak_memory_bytes_per_rank"])}


def add_state_vs_ideal(rows: list[dict]) -> list[dict]:
    """Each run's state per rank over the ideal: DDP's whole state, divided by the world under FSDP."""
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


def _describe(case) -> str:
    if case == "layer":
        return "Llama-3-8B layer's saved bytes (fake tensors)"
    fsdp, recompute = case
    return f"cp-train {'FSDP' if fsdp else 'DDP'} recompute {'on' if recompute else 'off'}"


def run(args) -> dict:
    """``--modes memory``: the local runs (first: ranks started later would inherit the Llama layer's pages in their
    RSS), the Llama-3-8B layer's saved bytes, the projection; a progress line per run."""
    local, measured = [], []
    for case in each_case([*LOCAL_CASES, "layer"], "memory", _describe):
        if case == "layer":
            measured = measure_layer(args.mem_layer_tokens)
        else:
            local.append(local_run(args, *case))
    tp = {name: measure_tp_layer(args.mem_layer_tokens, shape) for name, shape in TP_SHAPES.items()}
    return {"llama_shape": LLAMA3_8B, "layer_tokens": args.mem_layer_tokens, "layer_tensors": "fake",
            "measured": measured, "local_model": args.mem_local_model, "local": add_state_vs_ideal(local),
            "assumptions": PROJECTION, "projection": project(measured),
            "tp": {name: {"shape": TP_SHAPES[name], "measured": tp[name],
                          "projection": project_tp(tp[name], TP_SHAPES[name])} for name in TP_SHAPES}}
