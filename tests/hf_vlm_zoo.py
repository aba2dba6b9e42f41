"""Tiny vision-language models (VLMs) and batches with images, for tests/test_hf_vlm.py and the trainer cases.

Each model is built from a small config of its transformers class (random weights, seed 0, about 0.2 M parameters,
a few seconds on CPU); the configs follow the sizes ../shared/notes/vlm_rl.md measured to build (transformers 5.23).
:func:`batch` gives a global batch of two rows with one image each, at different places and (Qwen) of different
grids, so that image tokens straddle the CP shards; row 1 is right-padded. :func:`run_case` compares a model under a
handler with the unmodified model on the whole batch: logits, the loss and every parameter's gradient (the vision
tower's included).

Tolerances (float32; CP only reorders sums): logits atol = rtol = 1e-5; loss rtol 1e-6; each gradient, summed over
the ranks, within 1e-5 of its norm + 1e-6 (Frobenius norms, as PyTorch's CP tests compare): an element's gradient
can be a small sum of large terms (GOT-OCR2's projector bias: -0.44 from terms up to 330 at cp 4, all_gather, off by
5.5e-5 = 1.2e-4 of itself, 1.7e-7 of the tensor's norm), which an elementwise rtol wrongly fails, while a lost or
misplaced token moves a gradient by a visible share of its norm.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB = 256
IMAGE, VIDEO, START, END = 250, 251, 252, 253
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
QWEN_IDS = {"image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": START,
            "vision_end_token_id": END}
QWEN_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
               "spatial_merge_size": 2, "temporal_patch_size": 2}
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
SEQ_LEN = 32
"""Tokens per row of :func:`batch`: a multiple of 2 * cp for cp 1, 2, 4."""
MODELS = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "gemma3", "llava", "llama4", "idefics3", "smolvlm",
          "got_ocr2")
OUTCOMES = {**dict.fromkeys(MODELS, "exact"),
            "gemma3": "refused: token_type_ids mark image tokens, which attend bidirectionally within each image"}
"""What each model gives under CP (tests/test_hf_vlm.py holds every run to it)."""


BROKEN_UPSTREAM = {("llama4", "5.24.0"): "'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'"}
"""(model, transformers release) -> the error the *unmodified* model raises on every forward there (a bug of that
release: Llama 4's vision-language forward in 5.24.0, fixed in 5.25.0). :func:`run_case` then checks that the
unmodified model still raises it and reports ``broken upstream: ...`` instead of comparing."""


def broken_upstream(name: str) -> str | None:
    """The error :data:`BROKEN_UPSTREAM` names for ``name`` on the installed transformers, else ``None``."""
    import transformers

    return BROKEN_UPSTREAM.get((name, transformers.__version__))


VARIANTS = {"qwen2_5_vl_dynamic_rope": ("qwen2_5_vl", {"max_position_embeddings": 12, "rope_parameters": {
    **MROPE, "rope_type": "dynamic", "factor": 2.0}}),
    "qwen3_5_moe_router_loss": ("qwen3_5_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.5})}
"""Variants of a model's text config (name: (model, fields)): dynamic NTK RoPE reads the largest position, which
mRoPE's gaps put below ``S - 1``; a MoE model's load-balancing loss on (weighted to move the router gates visibly),
its padding rows excluded from the router statistics as one process excludes them (tests/test_hf_vlm.py at cp 2)."""


def _base(name: str) -> str:
    return VARIANTS[name][0] if name in VARIANTS else name


def _config(name: str):
    import transformers as tf

    if name in VARIANTS:
        config = _config(VARIANTS[name][0])
        for field, value in VARIANTS[name][1].items():
            setattr(config.text_config, field, value)
        return config
    if name == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(vision_config={**QWEN_VISION, "patch_size": 14, "window_size": 56,
                                                  "fullatt_block_indexes": [1]},
                                   text_config={**TEXT, "rope_parameters": MROPE}, **QWEN_IDS)
    if name in ("qwen3_vl", "qwen3_5", "qwen3_5_moe"):
        vision = {**QWEN_VISION, "patch_size": 16, "num_position_embeddings": 64}
        rope = {**MROPE, "mrope_interleaved": True}
        if name == "qwen3_vl":
            return tf.Qwen3VLConfig(vision_config={**vision, "deepstack_visual_indexes": [0]},
                                    text_config={**TEXT, "head_dim": 16, "rope_parameters": rope}, **QWEN_IDS)
        hybrid = {"head_dim": 32, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                  "linear_num_value_heads": 4, "layer_types": ["linear_attention", "full_attention"]}
        text = {**TEXT, **hybrid, "rope_parameters": {**rope, "partial_rotary_factor": 0.5}}
        if name == "qwen3_5":
            return tf.Qwen3_5Config(vision_config=vision, text_config=text, **QWEN_IDS)
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}
        return tf.Qwen3_5MoeConfig(vision_config=vision, text_config={**text, **experts}, **QWEN_IDS)
    siglip = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "patch_size": 14}
    if name == "gemma3":
        return tf.Gemma3Config(vision_config={**siglip, "image_size": 28},
                               text_config={**TEXT, "head_dim": 16, "sliding_window": 8,
                                            "layer_types": ["sliding_attention", "full_attention"]},
                               mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START,
                               eoi_token_index=END)
    if name == "llava":
        return tf.LlavaConfig(vision_config={**siglip, "model_type": "clip_vision_model", "num_hidden_layers": 2,
                                             "image_size": 28, "projection_dim": 32},
                              text_config={**TEXT, "model_type": "llama"}, image_token_index=IMAGE,
                              image_seq_length=4, vision_feature_layer=-1)
    if name == "llama4":
        return tf.Llama4Config(
            vision_config={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "intermediate_size": 128, "vision_output_dim": 32, "image_size": 56, "patch_size": 14,
                           "pixel_shuffle_ratio": 0.5, "projector_input_dim": 32, "projector_output_dim": 32},
            text_config={**TEXT, "intermediate_size": 64, "intermediate_size_mlp": 128, "head_dim": 16,
                         "num_local_experts": 2, "attention_chunk_size": 16, "no_rope_layers": [1, 0],
                         "attn_temperature_tuning": False},
            image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END)
    if name == "got_ocr2":  # a SAM-style vision tower (ViTDet windows); 128-pixel images: 4 tokens after two convs
        return tf.GotOcr2Config(vision_config={"hidden_size": 32, "output_channels": 16, "num_hidden_layers": 2,
                                               "num_attention_heads": 2, "image_size": 128, "patch_size": 16,
                                               "window_size": 4, "global_attn_indexes": [1], "mlp_dim": 64},
                                text_config={**TEXT, "model_type": "qwen2"}, image_token_index=IMAGE)
    config = tf.Idefics3Config if name == "idefics3" else tf.SmolVLMConfig
    return config(vision_config={**siglip, "image_size": 56}, text_config={**TEXT, "model_type": "llama"},
                  scale_factor=2, image_token_id=IMAGE)


def build(name: str) -> torch.nn.Module:
    """The unmodified model (its default attention), eval mode, seed 0; its config's ``use_cache`` off, except for
    Qwen3.5 and Qwen3.5-MoE, which keep their release's default (``True``, as a user's config has: the docs' loop and
    the trainers run them under a handler without a cache, issue 68)."""
    import transformers as tf

    classes = {"qwen2_5_vl": tf.Qwen2_5_VLForConditionalGeneration, "qwen3_vl": tf.Qwen3VLForConditionalGeneration,
               "qwen3_5": tf.Qwen3_5ForConditionalGeneration,
               "qwen3_5_moe": tf.Qwen3_5MoeForConditionalGeneration, "gemma3": tf.Gemma3ForConditionalGeneration,
               "llava": tf.LlavaForConditionalGeneration, "llama4": tf.Llama4ForConditionalGeneration,
               "idefics3": tf.Idefics3ForConditionalGeneration, "smolvlm": tf.SmolVLMForConditionalGeneration,
               "got_ocr2": tf.GotOcr2ForConditionalGeneration}
    torch.manual_seed(0)
    model = classes[_base(name)](_config(name)).eval()
    model.config.use_cache = model.config.get_text_config().use_cache = _base(name) in ("qwen3_5", "qwen3_5_moe")
    return model


def _image_tokens(name: str, grid: tuple[int, int, int]) -> int:
    """Placeholder tokens of one image: Qwen merges 2 x 2 patches of its grid; the others give 4 per image here."""
    return grid[0] * grid[1] * grid[2] // 4 if name.startswith("qwen") else 4


def _pixels(name: str, grids: list, generator: torch.Generator) -> dict:
    count, name = len(grids), _base(name)
    if name.startswith("qwen"):
        patch = 14 if name == "qwen2_5_vl" else 16
        rows = sum(t * h * w for t, h, w in grids)
        return {"pixel_values": torch.randn(rows, 3 * 2 * patch * patch, generator=generator),
                "image_grid_thw": torch.tensor(grids)}
    size = {"gemma3": 28, "llava": 28, "llama4": 56, "got_ocr2": 128}.get(name, 56)
    pixels = torch.randn(count, 3, size, size, generator=generator)
    return {"pixel_values": pixels.unsqueeze(1) if name in ("idefics3", "smolvlm") else pixels}


def batch(name: str, seed: int = 0, seq_len: int = SEQ_LEN, rows: int = 2, video: bool = False) -> dict:
    """A global batch: ``rows`` rows of ``seq_len`` tokens, one image each (row r: after ``3 + 5 r`` text tokens;
    Qwen: grids 1x4x4 and 1x4x8, so 4 and 8 image tokens), text after it, row 1 right-padded by 3 tokens
    (``attention_mask``); per-token types where the model takes them (``mm_token_type_ids`` for Qwen,
    ``token_type_ids`` for Gemma 3); ``labels`` = ``input_ids`` with -100 on the padding. ``video`` (Qwen2.5-VL):
    row 0 also holds a video of grid 2x4x4 (8 tokens, two frames a second apart) after its image."""
    generator, name = torch.Generator().manual_seed(seed), _base(name)
    grids = [(1, 4, 4 * (1 + r % 2)) for r in range(rows)]
    framed = name not in ("llava",)  # a start and an end token around the image
    ids = torch.randint(1, IMAGE - 10, (rows, seq_len), generator=generator)
    mask = torch.ones(rows, seq_len, dtype=torch.long)
    for r, grid in enumerate(grids):
        at, n = 3 + 5 * r, _image_tokens(name, grid)
        ids[r, at:at + n + 2 * framed] = torch.tensor(([START] if framed else []) + [IMAGE] * n +
                                                      ([END] if framed else []))
        if r == 1:
            mask[r, -3:] = 0
    out = {"input_ids": ids, "attention_mask": mask, **_pixels(name, grids, generator)}
    if video:
        if name != "qwen2_5_vl":
            raise ValueError(f"video batches are built for qwen2_5_vl only, not {name}")
        ids[0, 14:24] = torch.tensor([START] + [VIDEO] * 8 + [END])
        out.update(pixel_values_videos=torch.randn(32, 3 * 2 * 14 * 14, generator=generator),
                   video_grid_thw=torch.tensor([[2, 4, 4]]), second_per_grid_ts=torch.tensor([1.0]))
    if name.startswith("qwen"):
        out["mm_token_type_ids"] = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    if name == "gemma3":
        out["token_type_ids"] = (ids == IMAGE).long()
    out["labels"] = ids.masked_fill(mask == 0, -100)
    return out


def next_token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of ``logits (B, S, V)`` against labels already shifted (-100: no loss)."""
    return F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), reduction="sum", ignore_index=-100)


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def reference(name: str, inputs: dict):
    """The unmodified model (train mode: its default attention) on the whole batch: ``(model, logits, loss)``, the
    loss's gradients in ``model``'s parameters."""
    model = build(name).train()
    forward = {k: v for k, v in inputs.items() if k != "labels"}
    out = model(**forward, use_cache=False, **router_loss_on(model))
    loss = next_token_loss_sum(out.logits, shifted(inputs["labels"])) + weighted_router_loss(model, out)
    loss.backward()
    return model, out.logits.detach(), loss.detach()


def router_loss_on(model) -> dict:
    """The forward argument that turns a MoE model's load-balancing loss on where its config does (the
    vision-language classes read it from the forward's arguments)."""
    return {"output_router_logits": True} if getattr(model.config.get_text_config(), "output_router_logits",
                                                      False) else {}


def weighted_router_loss(model, out):
    """``router_aux_loss_coef x aux_loss`` of a forward with the router loss on, else 0 (what a hand-written loop adds
    to its token loss; under a handler each rank's ``aux_loss`` is its share: the shares sum to the batch's)."""
    if not router_loss_on(model):
        return 0
    return model.config.get_text_config().router_aux_loss_coef * out.aux_loss


def compare(model, ref_model, logits, ref_logits, loss, ref_loss, real, group=None) -> str:
    """``"exact"`` or what differs beyond the module's tolerances (gradients summed over ``group`` first; logits at
    the ``real`` tokens, bool ``(B, S)``: a padding row's logits are not defined by right padding)."""
    logits, ref_logits = logits[real], ref_logits[real]
    if logits.shape != ref_logits.shape or not torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5):
        worst = (logits - ref_logits).abs().max().item() if logits.shape == ref_logits.shape else logits.shape
        return f"mismatch: logits differ by {worst}"
    if not torch.allclose(loss, ref_loss, rtol=1e-6, atol=0):
        return f"mismatch: loss {loss.item()} != {ref_loss.item()}"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        if group is not None:
            dist.all_reduce(grad, group=group)
        want = torch.zeros_like(q) if q.grad is None else q.grad
        error = (grad - want).norm().item() / max(want.norm().item(), 1e-6)
        if (grad - want).norm().item() > 1e-5 * want.norm().item() + 1e-6:
            return f"mismatch: gradient of {name} differs by {(grad - want).abs().max().item():.3g} ({error:.2g} " \
                   "relative to its norm)"
    return "exact"


def upstream_outcome(name: str, inputs: dict) -> str:
    """``broken upstream: <error>`` when the unmodified model raises the error :data:`BROKEN_UPSTREAM` names (else
    what it did instead, which fails the test: the entry is stale)."""
    try:
        reference(name, inputs)
    except Exception as err:  # noqa: BLE001 - whatever the release's bug raises is compared below
        if broken_upstream(name) in str(err):
            return f"broken upstream: {type(err).__name__}: {err}"
        return f"error: the unmodified model raised another error than BROKEN_UPSTREAM's: {err}"
    return "error: the unmodified model ran: BROKEN_UPSTREAM's entry is stale"


def run_case(name: str, comm_type: str, group=None, inputs: dict | None = None, ref=None, model=None,
             positions: str = "model", router_tokens: str = "real") -> str:
    """``name`` under a local handler of ``comm_type`` on ``group`` (``None``: cp = 1) against the unmodified model,
    on :func:`batch` (or ``inputs``): ``"exact"``, ``"refused: <message>"`` or ``"mismatch: <what>"``. ``ref``: a
    :func:`reference` result to reuse; ``model``: a registered model to reuse (its gradients are reset).
    ``positions="arange"``: the negative control, positions ``0..S-1`` passed instead of the model's own;
    ``router_tokens="all"``: the negative control of the router loss, every slot of the shard counted as a real token
    (the padding rows too: how the load-balancing loss was computed before its mask came from the forward)."""
    from cp_handler import get_cp_handler_cls
    from cp_handler.integrations.transformers import register

    inputs = batch(name) if inputs is None else inputs
    if broken_upstream(name):
        return upstream_outcome(name, inputs)
    ref_model, ref_logits, ref_loss = reference(name, inputs) if ref is None else ref
    try:
        if model is None:
            model = build(name)
            model.load_state_dict(ref_model.state_dict())
            register(model)
        model.train().zero_grad(set_to_none=True)
        handler = get_cp_handler_cls("local", comm_type)(cp_group=group, cp_comm_type=comm_type)
        forward = {k: v for k, v in inputs.items() if k not in ("labels", "attention_mask")}
        if positions == "arange":
            forward["position_ids"] = torch.arange(inputs["input_ids"].shape[1]).expand_as(inputs["input_ids"])
        with contextlib.ExitStack() as stack:
            if router_tokens == "all":
                from cp_handler.integrations.hf_router_loss import RouterLossScope, router_loss_scope

                every = torch.ones(inputs["input_ids"].shape[0], inputs["input_ids"].shape[1] // handler.cp_size,
                                   dtype=torch.bool)
                stack.enter_context(router_loss_scope(RouterLossScope(token_mask=every)))
            out = model(**forward, attention_mask=inputs["attention_mask"], cp_handler=handler,  # as the docs' loop
                        **router_loss_on(model))
        assert getattr(out, "past_key_values", None) is None, f"{name}: a cache came back under the handler"
        local = out.logits
        loss = next_token_loss_sum(local, handler.dispatch(shifted(inputs["labels"]), 1)) + \
            weighted_router_loss(model, out)
        loss.backward()
        total = loss.detach().clone()
        if group is not None:
            dist.all_reduce(total, group=group)
    except ValueError as err:
        return f"refused: {err}"
    logits = handler.combine(local.detach(), 1)
    return compare(model, ref_model, logits, ref_logits, total, ref_loss, inputs["attention_mask"].bool(), group)


RELEASES = "5.23.0 and 5.25.0"
"""The transformers releases the table was recorded on (the oldest supported and CI's)."""


def support_matrix() -> str:
    """docs/huggingface.md's vision-language table: one row per model of :data:`MODELS` with its outcome (the same on
    every release of :data:`RELEASES`: tests/test_hf_vlm.py asserts :data:`OUTCOMES` on whichever runs)."""
    rows = [f"Generated from tests/hf_vlm_zoo.py's table (transformers {RELEASES}): exact = with images, the "
            "logits of the real tokens, the loss and every gradient (the vision tower's included) equal the unmodified "
            "model in one process at cp 1, 2 and 4 with p2p, a2a and all_gather; refused = the error names the reason.",
            "", "| model type | class | under CP |", "|---|---|---|"]
    for name in MODELS:
        rows.append(f"| {name} | {type(build(name)).__name__} | {OUTCOMES[name]} |")
    return "\n".join(rows)
