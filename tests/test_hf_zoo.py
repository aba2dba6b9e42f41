"""The Hugging Face zoo (issue 24): every causal-LM architecture of the installed transformers
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, not hand-picked), built from a tiny config and run through the
documented route at cp 2 (p2p and a2a) against the unmodified model (tests/hf_zoo.py). Each has its
expected outcome in :data:`ZOO`; an architecture missing from it fails the test until someone
classifies it, so a new transformers release cannot add an unchecked model. ``refused: X`` means the
guard's error contains X. A negative control shows the harness sees a wrong answer. docs/huggingface.md's
support matrix is checked against the table.
"""

import json
from pathlib import Path

import hf_vlm_zoo
import hf_zoo
import torch.distributed as dist
from dist_utils import run_distributed

ZOO = {
    "afmoe": "exact",
    "apertus": "exact",
    "apertus1p5_text": "exact",
    "arcee": "exact",
    "aria_text": "exact",
    "axk1": "exact",
    "axk2": "refused: config.layer_types has",
    "bailing_hybrid": "exact",
    "bamba": "exact",
    "bart": "refused: do not change when position_ids jump",
    "beam": "exact",
    "bert": "exact",
    "bert-generation": "exact",
    "big_bird": "refused: did not run cp_handler's attention",
    "bigbird_pegasus": "refused: do not change when position_ids jump",
    "biogpt": "exact",
    "bitnet": "exact",
    "blenderbot": "refused: do not change when position_ids jump",
    "blenderbot-small": "refused: do not change when position_ids jump",
    "bloom": "refused: did not run cp_handler's attention",
    "blt": "not attempted",
    "camembert": "refused: differ from its own defaults",
    "codegen": "exact",
    "cohere": "exact",
    "cohere2": "exact",
    "cohere2_moe": "exact",
    "cohere_compass_text": "not built",
    "cpmant": "refused: did not run cp_handler's attention",
    "ctrl": "exact",
    "cwm": "exact",
    "data2vec-text": "refused: differ from its own defaults",
    "dbrx": "not built",
    "deepseek_v2": "exact",
    "deepseek_v3": "exact",
    "deepseek_v32": "refused: config.layer_types has",
    "deepseek_v4": "refused: config.layer_types has",
    "diffllama": "exact",
    "doge": "refused: attention mask as a tensor",
    "dory": "exact",
    "dots1": "not built",
    "dots3_note": "not attempted",
    "dots3_note_text": "not built",
    "electra": "exact",
    "emu3": "not attempted",
    "ergo": "exact",
    "ernie": "exact",
    "ernie4_5": "exact",
    "ernie4_5_moe": "exact",
    "exaone": "exact",
    "exaone4": "exact",
    "exaone_moe": "exact",
    "falcon": "exact",
    "falcon_h1": "exact",
    "falcon_mamba": "exact",
    "flex_olmo": "exact",
    "flint": "exact",
    "fuyu": "not attempted",
    "gemma": "exact",
    "gemma2": "exact",
    "gemma3": "vision-language",
    "gemma3_text": "exact",
    "gemma3n": "not built",
    "gemma3n_text": "not built",
    "gemma4": "not attempted",
    "gemma4_assistant": "not built",
    "gemma4_text": "not built",
    "gemma4_unified": "not attempted",
    "gemma4_unified_assistant": "not built",
    "gemma4_unified_text": "not built",
    "git": "refused: attention mask as a tensor",
    "glm": "exact",
    "glm4": "exact",
    "glm4_moe": "exact",
    "glm4_moe_lite": "exact",
    "glm_moe_dsa": "refused: config.layer_types has",
    "got_ocr2": "vision-language",
    "gpt-sw3": "exact",
    "gpt2": "exact",
    "gpt_bigcode": "exact",
    "gpt_neo": "not built",
    "gpt_neox": "exact",
    "gpt_neox_japanese": "refused: did not run cp_handler's attention",
    "gpt_oss": "exact",
    "gptj": "exact",
    "granite": "exact",
    "granite_swa": "exact",
    "granitemoe": "exact",
    "granitemoe_swa": "exact",
    "granitemoehybrid": "exact",
    "granitemoeshared": "exact",
    "helium": "exact",
    "hrm_text": "refused: did not run cp_handler's attention",
    "hunyuan_v1_dense": "exact",
    "hunyuan_v1_moe": "exact",
    "hy_v3": "exact",
    "hy_v4": "refused: config.layer_types has",
    "hyperclovax": "exact",
    "inkling2_loop_text": "refused: config.layer_types has ['hybrid_sliding']",
    "inkling2_text": "refused: config.layer_types has ['hybrid_sliding']",
    "inkling_text": "refused: config.layer_types has ['hybrid_sliding']",
    "internlm3": "exact",
    "iquestcoder": "exact",
    "jais2": "exact",
    "jamba": "exact",
    "jetmoe": "exact",
    "kimi_linear": "exact",
    "kolibri1": "exact",
    "kolibri1_1": "not built",
    "laguna": "exact",
    "lara_mini": "exact",
    "lfm2": "exact",
    "lfm2_moe": "exact",
    "lfm3": "exact",
    "llama": "exact",
    "llama4": "vision-language",
    "llama4_text": "exact",
    "longcat_flash": "exact",
    "mamba": "exact",
    "mamba2": "exact",
    "marian": "refused: do not change when position_ids jump",
    "mbart": "refused: do not change when position_ids jump",
    "megatron-bert": "refused: did not run cp_handler's attention",
    "mellum": "exact",
    "mimo_v2_flash": "exact",
    "minicpm3": "exact",
    "minicpm5_moe": "exact",
    "minimax": "refused: config.layer_types has",
    "minimax_m2": "exact",
    "minimax_m3_vl_text": "exact",
    "ministral": "exact",
    "ministral3": "exact",
    "mistral": "exact",
    "mixtral": "exact",
    "mllama": "not attempted",
    "modernbert-decoder": "exact",
    "moshi": "exact",
    "moss_transcribe_diarize": "refused: convolution over the sequence",
    "mpt": "refused: did not run cp_handler's attention",
    "musicgen": "not built",
    "musicgen_melody": "not built",
    "mvp": "refused: did not run cp_handler's attention",
    "nanochat": "exact",
    "nemotron": "exact",
    "nemotron_h": "exact",
    "olmo": "exact",
    "olmo2": "exact",
    "olmo3": "exact",
    "olmo_hybrid": "exact",
    "olmoe": "exact",
    "openai-gpt": "refused: did not run cp_handler's attention",
    "opt": "exact",
    "param2moe": "exact",
    "pegasus": "refused: do not change when position_ids jump",
    "persimmon": "exact",
    "phi": "exact",
    "phi3": "exact",
    "phi4_multimodal": "refused: convolution over the sequence",
    "phimoe": "exact",
    "plbart": "refused: do not change when position_ids jump",
    "prophetnet": "not built",
    "qwen2": "exact",
    "qwen2_moe": "exact",
    "qwen3": "exact",
    "qwen3_5": "vision-language",
    "qwen3_5_moe": "vision-language",
    "qwen3_5_moe_text": "exact",
    "qwen3_5_text": "exact",
    "qwen3_moe": "exact",
    "qwen3_next": "exact",
    "qwen4_exp": "not attempted",
    "qwen4_exp_text": "exact",
    "recurrent_gemma": "refused: convolution over the sequence",
    "reformer": "not built",
    "rembert": "refused: did not run cp_handler's attention",
    "roberta": "refused: differ from its own defaults",
    "roberta-prelayernorm": "refused: differ from its own defaults",
    "roc_bert": "exact",
    "roformer": "refused: did not run cp_handler's attention",
    "rwkv": "refused: did not run cp_handler's attention",
    "sarvam_mla": "not built",
    "sarvam_moe": "exact",
    "seed_oss": "exact",
    "smollm3": "exact",
    "solar_open": "exact",
    "stablelm": "exact",
    "starcoder2": "exact",
    "trocr": "refused: did not run cp_handler's attention",
    "vaultgemma": "exact",
    "whisper": "exact",
    "xglm": "refused: did not run cp_handler's attention",
    "xlm": "refused: did not run cp_handler's attention",
    "xlm-roberta": "refused: differ from its own defaults",
    "xlm-roberta-xl": "refused: differ from its own defaults",
    "xlnet": "not built",
    "xlstm": "refused: did not run cp_handler's attention",
    "xmod": "not built",
    "youtu": "exact",
    "zamba": "exact",
    "zamba2": "exact",
    "zaya": "not built",
}
"""Expected outcome per model type (tests/hf_zoo.py defines them). ``not built``: the generic tiny
config does not build or run the unmodified model (the test checks that it still does not);
``not attempted``: see :data:`NOT_ATTEMPTED`; ``vision-language``: run with images on a tiny vision config by
tests/test_hf_vlm.py (tests/hf_vlm_zoo.py's table)."""
ZOO_RELEASE = "5.25.0"
"""The transformers release :data:`ZOO` records (the newest on the index when it was classified: CI's)."""

HYBRIDS = ("bailing_hybrid", "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear",
           "lara_mini", "lfm2", "lfm2_moe", "lfm3", "mamba", "mamba2", "nemotron_h", "olmo_hybrid", "qwen3_5_moe_text",
           "qwen3_5_text", "qwen3_next", "qwen4_exp_text", "zamba", "zamba2")
"""Hybrid architectures (token mixers other than attention, routed through the handler's mixer methods)."""
GENERATION_REFUSED = {**dict.fromkeys(("bert", "bert-generation", "electra", "ernie", "roc_bert"),
                                     "refused: not a causal language model"),
                      **dict.fromkeys(HYBRIDS, "refused: generation of hybrid models is not implemented")}
"""Generation outcomes other than ``exact`` among the architectures whose training is exact: encoders run
as causal LMs with bidirectional attention (``CPCausalLM`` refuses them: a KV cache needs causal attention, and a
next-token loss would see its labels); hybrids (the cache holds no recurrent state)."""

NOT_ATTEMPTED = ("the default config builds a full-size vision or audio tower (GBs, minutes on CPU); its text model "
                 "is the *_text entry")


def _zoo_worker(rank, world, names, out):
    import warnings

    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    group = dist.new_group(list(range(world)))
    outcomes = {name: hf_zoo.run_case(name, group) for name in names}
    generation = {name: hf_zoo.run_generation_case(name, group) for name, got in outcomes.items() if got == "exact"}
    if rank == 0:
        Path(out).write_text(json.dumps([outcomes, generation]))


def _outcomes(tmp_path, names):
    out = tmp_path / "zoo.json"
    run_distributed(_zoo_worker, 2, names, str(out))
    return json.loads(out.read_text())


def _agrees(expected: str, got: str) -> bool:
    if expected.startswith("refused: "):
        return got.startswith("refused: ") and expected.removeprefix("refused: ") in got
    return got == expected or (expected == "not built" and got.startswith("not built: "))


def _on_table_release() -> bool:
    import transformers

    return transformers.__version__ == ZOO_RELEASE


def test_every_architecture_is_exact_or_refused(tmp_path):
    """On :data:`ZOO_RELEASE` every shipped architecture has its recorded outcome (a new one fails until classified);
    on another release (the oldest supported, a newer one) every architecture still ends exact, refused by name or not
    built, never a mismatch or an unclear error: the guard's probes, not the table, make that hold."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    shipped = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    on_release = _on_table_release()
    unclassified = [name for name in shipped if name not in ZOO]
    assert not (on_release and unclassified), f"architectures not in the zoo table (classify them): {unclassified}"
    vision = {n for n in shipped if ZOO.get(n) == "vision-language"}
    assert vision <= set(hf_vlm_zoo.MODELS), f"vision-language entries without a tiny vision config: {vision}"
    outcomes, generation = _outcomes(tmp_path, [n for n in shipped if ZOO.get(n) not in ("not attempted",
                                                                                       "vision-language")])
    if on_release:
        wrong = {n: (ZOO[n], got) for n, got in outcomes.items() if not _agrees(ZOO[n], got)}
        wrong.update({f"{n} (generation)": (GENERATION_REFUSED.get(n, "exact"), got) for n, got in generation.items()
                      if not _agrees(GENERATION_REFUSED.get(n, "exact"), got)})
        assert not wrong, "\n".join(f"{n}: expected {e!r}, got {g[:300]!r}" for n, (e, g) in wrong.items())
        assert set(GENERATION_REFUSED) <= set(generation), "GENERATION_REFUSED lists a model not exact in training"
    unclear = {n: g for n, g in [*outcomes.items(), *generation.items()]
               if not g.startswith(("exact", "refused: ", "not built"))}
    assert not unclear, "\n".join(f"{n}: {g[:300]}" for n, g in unclear.items())
    assert sum(g == "exact" for g in outcomes.values()) >= 100, "the route stopped running most architectures"


def _negative_control_worker(rank, world, out):
    group = dist.new_group(list(range(world)))

    def off_by_one(handler, input_ids):  # rank 1's positions one too far: a real CP bug
        inputs = hf_zoo.cp_model_inputs(handler, input_ids)
        if handler.cp_rank == 1:
            inputs["position_ids"] = inputs["position_ids"] + 1
        return inputs

    outcome = hf_zoo.run_case("llama", group, model_inputs=off_by_one)
    if rank == 0:
        Path(out).write_text(outcome)


def test_negative_control_the_harness_sees_a_wrong_answer(tmp_path):
    out = tmp_path / "control.txt"
    run_distributed(_negative_control_worker, 2, str(out))
    assert out.read_text().startswith("mismatch: p2p: logits differ"), out.read_text()


def test_docs_support_matrix_is_the_table():
    docs = (Path(__file__).parents[1] / "docs" / "huggingface.md").read_text()
    matrix = hf_zoo.support_matrix(ZOO, NOT_ATTEMPTED, GENERATION_REFUSED, ZOO_RELEASE)
    assert matrix in docs, "regenerate the matrix: hf_zoo.support_matrix(ZOO, NOT_ATTEMPTED, GENERATION_REFUSED)"
