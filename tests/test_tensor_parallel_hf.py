"""Tensor parallelism x context parallelism for Hugging Face models (integrations/hf_tensor_parallel.py): a model split
by transformers' own plan (``base_model_tp_plan``) with the CP handler on the TP rank's heads, against the unmodified
model in one process (logits, loss, every gradient; tests/hf_zoo.py's bounds); ``cp-train --hf-config --tp-size``
every step; plans with styles cp_handler does not apply refused by name, and the trainers' refusal of TP. The
reference GPT's tests: tests/test_tensor_parallel.py.
"""

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from test_cli import cp_train

from cp_handler import ParallelLayout
from cp_handler.models.loss import masked_token_loss_sum, next_token_batch
from cp_handler.runtime.groups import data_context_parallel_groups
from cp_handler.runtime.reductions import global_token_count


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def _distinct_sinks(model):
    """Attention sinks, zero at initialisation, set to a distinct logit per head (a head given another's sink, or
    the whole vector on every TP rank, changes the output)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.copy_(torch.linspace(-1.5, 2.0, p.numel()))


def _hf_worker(rank, world, model_type, comm_type, extra=None):
    """A Hugging Face model split by transformers' own plan (``base_model_tp_plan``) at tp 2 x cp 2 (x dp 2 on 8 ranks:
    one row per dp replica), its logits, loss and every gradient against the unmodified model on the whole batch in
    one process (tests/hf_zoo.py's bounds: logits 1e-5, loss rtol 1e-6, gradients atol 1e-6 + rtol 1e-4)."""
    import hf_zoo
    import torch.nn.functional as F

    from cp_handler import get_cp_handler_cls, register
    from cp_handler.integrations.hf_tensor_parallel import apply_hf_tensor_parallel
    from cp_handler.integrations.transformers import cp_model_inputs

    built = ParallelLayout(world, tensor_model_parallel_size=2, context_parallel_size=2).build("cpu")
    groups, dp_cp = data_context_parallel_groups(built), built.groups["dp_cp"]
    dp = world // 4
    tokens = torch.randint(0, hf_zoo.VOCAB, (dp, 32), generator=torch.Generator().manual_seed(5))
    config = hf_zoo.tiny_config(model_type, extra)
    reference = hf_zoo.build(config)
    _distinct_sinks(reference)
    whole = reference(tokens).logits
    F.cross_entropy(whole[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    want = (whole.detach()[groups.dp_rank:groups.dp_rank + 1], F.cross_entropy(
        whole.detach()[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten()),
            {n: p.grad for n, p in reference.named_parameters() if p.grad is not None})
    tokens = tokens[groups.dp_rank:groups.dp_rank + 1]
    model = hf_zoo.build(config)
    _distinct_sinks(model)
    register(model)
    summed = apply_hf_tensor_parallel(model, built.meshes["attention"]["tp"])
    handler = get_cp_handler_cls("local", comm_type)(cp_group=groups.cp_group, cp_comm_type=comm_type)
    input_ids, labels, loss_mask = next_token_batch(handler, tokens)
    logits = model(input_ids, **cp_model_inputs(handler, input_ids), cp_handler=handler).logits
    loss = masked_token_loss_sum(logits, labels, loss_mask) / global_token_count(loss_mask, dp_cp)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = _whole(p.grad).clone()
        if name in summed:  # a replicated weight applied to each TP rank's own heads
            dist.all_reduce(grads[name], group=built.groups["tp"])
    loss = loss.detach().float()
    for t in [loss, *grads.values()]:
        dist.all_reduce(t, group=dp_cp)
    problem = hf_zoo._compare((handler.combine(logits.detach(), 1), loss, grads), want)
    assert problem is None, f"{model_type} dp {dp} x tp 2 x cp 2 {comm_type} rank {rank}: {problem}"


@pytest.mark.parametrize("model_type,comm_type,extra", [
    ("llama", "p2p", {"num_key_value_heads": 1}), ("qwen3", "a2a", None), ("gemma2", "p2p", {"sliding_window": 8}),
    ("granite_swa", "a2a", {"sliding_window": 8}), ("deepseek_v3", "p2p", None)],
    ids=["llama-mqa-p2p", "qwen3-a2a", "gemma2-window-p2p", "granite_swa-sinks-window-a2a", "deepseek_v3-mla-p2p"])
def test_hf_model_by_transformers_plan_tp2_cp2_equals_one_process(model_type, comm_type, extra):
    """Llama with one key-value head (fewer than the TP ranks: replicated, Megatron-LM's rule; its GQA 4:2 split at
    dp 2 x tp 2 x cp 2 below), Qwen3 (per-head q / k norms summed over TP), Gemma 2 (a sliding window of 8 on every
    other layer, soft-capped scores), Granite-SWA (learnable sinks, one per head, split with the heads by the plan's
    ``colwise`` parameter and ``local_params`` module, a distinct value each; a window of 8 on every other layer;
    a2a splits the local heads again), DeepSeek-V3 (multi-head latent attention: ``mla_kv_a_proj``, value heads
    narrower than query / key heads; its MoE layer's experts whole on each TP rank) on the TP rank's heads. A release
    whose plan for the model has styles cp_handler does not apply (transformers 5.23's DeepSeek-V3 plan shards its
    experts: ``packed_colwise``, ``moe_tp_experts``) refuses it by name instead."""
    import hf_zoo

    from cp_handler.integrations.hf_tensor_parallel import STYLES, hf_tp_plan

    config = hf_zoo.tiny_config(model_type, extra)
    if set(config.base_model_tp_plan.values()) - set(STYLES):
        with pytest.raises(ValueError, match="tensor-parallel plan has styles cp_handler does not apply"):
            hf_tp_plan(hf_zoo.build(config), 2)
        return
    run_distributed(_hf_worker, 4, model_type, comm_type, extra)


def test_hf_llama_dp2_tp2_cp2_equals_one_process():
    """Llama (GQA) by transformers' plan on 8 ranks: dp 2 x tp 2 x cp 2, a row per dp replica, the loss counted and
    the gradients summed over the dp x cp ranks of each TP position."""
    run_distributed(_hf_worker, 8, "llama", "p2p")


def test_hf_plans_cp_handler_does_not_apply_are_refused():
    import hf_zoo

    from cp_handler.integrations.hf_tensor_parallel import hf_tp_plan

    with pytest.raises(ValueError, match=r"styles cp_handler does not apply: .*colwise_gather_output"):
        hf_tp_plan(hf_zoo.build("phi3"), 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=3 is not divisible by it nor divides it"):
        hf_tp_plan(hf_zoo.build(hf_zoo.tiny_config("llama", {"hidden_size": 48, "num_attention_heads": 6,
                                                                  "num_key_value_heads": 3})), 2)
    plan, summed = hf_tp_plan(hf_zoo.build("llama"), 4)  # 2 key-value heads over 4 ranks: replicated
    assert type(plan["model.layers.0.self_attn.k_proj"]).__name__ == "ReplicatedKVHeads", plan
    assert "model.layers.1.self_attn.v_proj.weight" in summed, summed
    config = hf_zoo.tiny_config("granite_swa")
    config.base_model_tp_plan = {k: v for k, v in config.base_model_tp_plan.items() if v != "local_params"}
    with pytest.raises(ValueError, match=r"splits the parameters \['layers.0.self_attn.sinks'\] \"colwise\" but "
                                         r"does not run their module 'layers.0.self_attn' \"local_params\""):
        hf_tp_plan(hf_zoo.build(config), 2)


def test_the_trainers_refuse_tensor_parallelism_by_name(tmp_path):
    """CPTrainer builds its CP groups over dp x cp: accelerate's tensor parallelism (``parallelism_config.tp_size``)
    or a model transformers loaded split (its ``tp_size``) is refused before the trainer acts, naming the route
    that runs TP x CP (cp-train --tp-size)."""
    import hf_zoo
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    from cp_handler.integrations.hf_trainer import ContextParallelArguments, CPTrainer

    model = hf_zoo.build("llama")
    split = TrainingArguments(output_dir=str(tmp_path), report_to=[], parallelism_config=ParallelismConfig(tp_size=2))
    with pytest.raises(ValueError, match=r"CPTrainer: refused under context parallelism: parallelism_config\.tp_size=2"
                                         r" .*cp-train --tp-size"):
        CPTrainer(model=model, args=split, cp_args=ContextParallelArguments())
    model._tp_size = 2  # what from_pretrained(tp_plan="auto", tp_size=2) leaves on the model
    with pytest.raises(ValueError, match=r"a model loaded with tensor parallelism \(tp_size=2"):
        CPTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]),
                  cp_args=ContextParallelArguments())


def test_cp_train_hf_model_tp_size_parity(tmp_path):
    """cp-train --hf-config (Qwen3: GQA, per-head q / k norms summed over the TP group) at tp 2 x cp 2: every step
    against the unmodified model in one process; a model whose plan has a style cp_handler does not apply
    (Phi-3's packed projections: ``colwise_gather_output``) is refused before any rank starts."""

    from transformers import Phi3Config, Qwen3Config

    from cp_handler.cli.args import parse

    Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024).save_pretrained(tmp_path / "qwen3")
    flags = ["--nproc", "4", "--tp-size", "2", "--cp-size", "2", "--hf-config", str(tmp_path / "qwen3"), "--steps",
             "2", "--seq-len", "64", "--max-corpus-bytes", "2000000", "--check-parity"]
    result = cp_train(*flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 4 = tp 2 x dp 1 x cp 2" in result.stderr and "parity passed" in result.stderr
    Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, max_position_embeddings=1024, pad_token_id=0).save_pretrained(tmp_path / "phi3")
    with pytest.raises(SystemExit, match=r"styles cp_handler does not apply: .*colwise_gather_output"):
        parse(["--nproc", "4", "--tp-size", "2", "--hf-config", str(tmp_path / "phi3"), "--steps", "1"])
