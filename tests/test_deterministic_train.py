"""The deterministic mode in training (docs/deterministic.md): ``cp-train --deterministic``'s step losses ``==`` at
every CP degree for the reference GPT (bshd, thd packs, the KV all-gather on canonical tiles), Hugging Face models
(Qwen2, Mixtral), the GPT's MoE layers and tensor parallelism (the GPT's logits ``torch.equal`` at cp 1, 2 and 4
over 2 TP ranks, at cp 1 and 2 over 4); what the mode does not make bitwise refused by name before any rank starts
(a --seq-len whose zigzag chunks are not whole tiles, token mixers other than attention; the handler's mixer methods
refuse too). Negative controls: the
default mode differs in each comparison.

Tolerances: none (bitwise), except Mixtral's steps after the first (its fused experts are not covered:
relative 1e-6, its parameters were updated with gradients all-reduced in float32; dense models' and the GPT's MoE
are summed exactly).
"""

import json
import re

import pytest
import torch
from dist_utils import run_distributed
from test_cli import cp_train

from cp_handler import ContextParallelConfig, LocalContextParallelHandler
from cp_handler.cli.args import build_parser, validate

TRAIN = ["--steps", "3", "--seq-len", "128", "--hidden-size", "64", "--num-heads", "8", "--num-kv-heads", "8",
         "--ffn-hidden-size", "128", "--max-corpus-bytes", "2000000"]


def _losses(tmp_path, cp: int, *flags, norms: bool = False) -> list:
    """Every step's loss of ``cp-train`` at ``--cp-size cp`` (cp ranks), read from ``--metrics-out`` (a float64
    written by ``repr``: every bit of the float32 loss survives JSON); ``norms``: ``(loss, gradient norm)`` pairs,
    after checking that the run summed its parameter gradients exactly (``exact_grads``)."""
    out = tmp_path / f"metrics-{cp}-{len(flags)}.json"
    result = cp_train("--nproc", str(cp), "--cp-size", str(cp), *TRAIN, *flags, "--metrics-out", str(out))
    return _steps(result, out, norms)


def _steps(result, out, norms: bool) -> list:
    """The steps' losses (``norms``: ``(loss, gradient norm)``, the run's gradients summed exactly) of a finished run
    whose metrics are at ``out``."""
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads(out.read_text())
    if norms:
        assert metrics["exact_grads"] is True
        return [(step["loss"], step["grad_norm"]) for step in metrics["steps"]]
    return [step["loss"] for step in metrics["steps"]]


def test_cp_train_deterministic_losses_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """``cp-train --deterministic``: each of 3 steps' loss equal (``==`` on the float) at cp 1, 2 and 4 (the logits
    bitwise, the loss summed over the whole sequence in one order) and each step's gradient norm (the parameter
    gradients summed exactly, ``runtime/exact_grads``: the same bits at every degree, so every step starts from the
    same parameters), bshd and thd packs; bshd through the KV all-gather, the ring (p2p) and auto on canonical tiles
    at cp 2 and a2a+p2p (2 x 2) at cp 4 (256 tokens); thd packs through p2p on canonical tiles at cp 1 and 2; bf16
    (``--dtype bfloat16``) at cp 1 and 2.
    Negative control: the default mode at cp 4 differs from cp 1 in at least one step (measured at steps 1-3), so
    the comparison can fail. (Before the mode pinned one thread per CPU rank, thd's third gradient norm at cp 1, run
    on 2 threads, differed from cp 2's and 4's: the CPU flash kernel at head dim 8, measured 2026-12-06.)"""
    for packing in ("bshd", "thd"):
        flags = ("--deterministic", "--packing", packing)
        want = _losses(tmp_path, 1, *flags, norms=True)
        assert _losses(tmp_path, 2, *flags, norms=True) == want, packing
        assert _losses(tmp_path, 4, *flags, norms=True) == want, packing
    # the patterns on canonical tiles (rows of 256 tokens: zigzag chunks of whole 64-token tiles at cp 2, and over
    # a2a+p2p's ring of 2 at cp 4): the same losses and gradient norms as one process, which are a2a's (the same
    # bits across patterns)
    flags = ("--deterministic", "--seq-len", "256")
    want = _losses(tmp_path, 1, *flags, norms=True)
    for comm_type in ("all_gather", "p2p", "auto"):
        assert _losses(tmp_path, 2, *flags, "--cp-comm-type", comm_type, norms=True) == want, comm_type
    assert _losses(tmp_path, 4, *flags, "--cp-comm-type", "a2a+p2p", "--hierarchical-cp-sizes", "2", "2",
                   norms=True) == want
    # packed documents on canonical tiles (a 48th of each document): p2p at cp 2 against one process on p2p
    flags = ("--deterministic", "--packing", "thd", "--cp-comm-type", "p2p")
    assert _losses(tmp_path, 2, *flags, norms=True) == _losses(tmp_path, 1, *flags, norms=True)
    flags = ("--deterministic", "--dtype", "bfloat16")  # bf16 parameters and activations (the exact sums take them)
    assert _losses(tmp_path, 2, *flags, norms=True) == _losses(tmp_path, 1, *flags, norms=True)
    default = _losses(tmp_path, 4)
    want = _losses(tmp_path, 1, "--deterministic")
    assert default != want
    assert max(abs(a - b) / b for a, b in zip(default, want, strict=True)) < 1e-5  # float32 reordering only


def _hf_losses(tmp_path, folder, cp: int, *flags, norms: bool = False) -> list:
    """Every step's loss of ``cp-train --hf-config folder`` at ``--cp-size cp`` (as :func:`_losses`, ``norms`` too)."""
    out = tmp_path / f"metrics-hf-{cp}-{len(flags)}.json"
    result = cp_train("--nproc", str(cp), "--cp-size", str(cp), "--hf-config", str(folder), "--steps", "3",
                      "--seq-len", "192", "--max-corpus-bytes", "2000000", *flags, "--metrics-out", str(out))
    return _steps(result, out, norms)


def test_cp_train_deterministic_hugging_face_losses_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """``cp-train --deterministic --hf-config``: an unmodified transformers model (Qwen2: q/k/v biases, RMSNorm,
    4 query and 4 key-value heads; Mixtral: a MoE of 4 experts, 2 per token, routed locally on each rank) trains
    bitwise the same at every degree: Qwen2's parameter gradients are summed exactly (its RMSNorm class a scale after
    a normalisation, by the probe), so each of 3 steps' loss and gradient norm is ``==`` at cp 1, 2 and 4 (bshd) and
    at cp 1 and 2 (thd packs; until 2026-12-06, when they were all-reduced in float32, the third step at cp 2 differed
    by 6e-8 relative). Mixtral's fused experts are not covered: its first step's loss ``==`` at cp 1 and 2 (the logits
    are bitwise), the later ones within float32 reordering (relative 1e-6). Negative control: the default mode at
    cp 2 differs from cp 1's mode at the first step (measured: 11.326793730571008 against 11.326794369682592)."""
    from transformers import MixtralConfig, Qwen2Config

    dense, moe = tmp_path / "qwen2", tmp_path / "mixtral"
    # weights drawn wide (std 0.5): logits far from uniform, so a last-bit change in them reaches the loss (with
    # the default 0.02 every mode's first loss rounds to the same float: a comparison that could not fail)
    Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.5).save_pretrained(dense)
    MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
                  initializer_range=0.5).save_pretrained(moe)

    def same(got, want):
        return got[0] == want[0] and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want, strict=True))

    want = _hf_losses(tmp_path, dense, 1, "--deterministic", norms=True)  # Qwen2: exact gradients, every step ==
    assert _hf_losses(tmp_path, dense, 2, "--deterministic", norms=True) == want
    assert _hf_losses(tmp_path, dense, 4, "--deterministic", norms=True) == want
    assert _hf_losses(tmp_path, dense, 2)[0] != want[0][0]  # the control
    packed = ("--deterministic", "--packing", "thd")
    assert _hf_losses(tmp_path, dense, 2, *packed, norms=True) == _hf_losses(tmp_path, dense, 1, *packed, norms=True)
    # Mixtral: its experts are not covered (all-reduced gradients): the first step ==, the later ones within 1e-6
    assert same(_hf_losses(tmp_path, moe, 2, "--deterministic"), _hf_losses(tmp_path, moe, 1, "--deterministic"))


def _tp_logits_worker(rank, world, out, deterministic, tp=2, sequence_parallel=False):
    """The reference GPT split over ``tp`` TP ranks (PyTorch's ColwiseParallel / RowwiseParallel; above 2 in the mode
    the row-wise sums in TP-rank order, as cp-train's; ``sequence_parallel``: Megatron-LM's, its reduce-scatters
    ordered in the mode) with the CP handler on each TP rank's heads at cp ``world / tp``: the whole batch's logits
    in global order, on rank 0."""
    from cp_handler import AttentionShape, ParallelLayout, build_cp_handler
    from cp_handler.models import GPTConfig, GPTModel
    from cp_handler.runtime.groups import data_context_parallel_groups
    from cp_handler.training.tensor_parallel import apply_tensor_parallel, gpt_tp_plan, local_attention_shape

    cp = world // tp
    built = ParallelLayout(world, tensor_model_parallel_size=tp, context_parallel_size=cp).build("cpu")
    groups = data_context_parallel_groups(built)
    config = GPTConfig(vocab_size=256, hidden_size=64, num_layers=2, num_attention_heads=16, num_query_groups=8,
                       ffn_hidden_size=128)  # 8 query over 4 key-value heads per TP rank: a2a splits them at cp 4
    torch.manual_seed(0)
    model = GPTModel(config)
    apply_tensor_parallel(model, built.meshes["attention"]["tp"],
                          gpt_tp_plan(model, tp, sequence_parallel, ordered=deterministic and tp > 2))
    handler = build_cp_handler(ContextParallelConfig(context_parallel_size=cp, cp_comm_type="a2a" if deterministic
                                                     else "p2p", deterministic=deterministic), groups.cp_group,
                               attn_shape=local_attention_shape(AttentionShape(16, 8, 4), tp))
    tokens = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(handler.dispatch(tokens, 1), cp_handler=handler)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        logits = handler.combine(logits, 1)
    if rank == 0:
        torch.save(logits, out)


def test_tensor_parallel_logits_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """TP x CP in the mode: the reference GPT over 2 TP ranks, its logits ``torch.equal`` at cp 1, 2 and 4 (2, 4
    and 8 ranks): each token's partial products are added over the same two TP ranks at every CP degree (an
    all-reduce of two is ``a + b`` whatever its algorithm; the mode is bitwise across CP degrees at one TP size, not
    across TP sizes). Control: the default ring at tp 2 x cp 2 differs."""
    for world, deterministic in ((2, True), (4, True), (8, True), (4, False)):
        run_distributed(_tp_logits_worker, world, str(tmp_path / f"{world}{deterministic}.pt"), deterministic)
    want = torch.load(tmp_path / "2True.pt")
    assert torch.equal(torch.load(tmp_path / "4True.pt"), want)
    assert torch.equal(torch.load(tmp_path / "8True.pt"), want)
    assert not torch.equal(torch.load(tmp_path / "4False.pt"), want)


def test_tensor_parallel_of_4_logits_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """TP 4 x CP in the mode: the row-wise projections add their partial sums in TP-rank order
    (``ordered_rowwise_parallel``, as ``cp-train --deterministic --tp-size 4`` does), so the logits are
    ``torch.equal`` at cp 1 and 2 (4 and 8 ranks; 4 query over 2 key-value heads per TP rank, a2a splits them at cp
    2). Control: the default ring at tp 4 x cp 2 differs. (PyTorch's plain ``RowwiseParallel`` happened to give equal
    logits at cp 1 and 2 here too, at 96 to 1536 tokens, measured: gloo's all-reduce added these buffers in one order;
    the test above shows sizes where it does not, and the ordered sum changes the logits' bits against it.)"""
    for world, deterministic in ((4, True), (8, True), (8, False)):
        run_distributed(_tp_logits_worker, world, str(tmp_path / f"{world}{deterministic}.pt"), deterministic, 4)
    want = torch.load(tmp_path / "4True.pt")
    assert torch.equal(torch.load(tmp_path / "8True.pt"), want)
    # sequence parallelism over the 4 TP ranks: the row-wise outputs reduce-scattered in TP-rank order
    for world in (4, 8):
        run_distributed(_tp_logits_worker, world, str(tmp_path / f"sp{world}.pt"), True, 4, True)
    assert torch.equal(torch.load(tmp_path / "sp8.pt"), torch.load(tmp_path / "sp4.pt"))
    assert not torch.equal(torch.load(tmp_path / "8False.pt"), want)


def test_cp_train_deterministic_with_tensor_parallel(tmp_path):
    """``cp-train --deterministic --tp-size 2`` and ``--tp-size 4`` (row-wise sums in TP-rank order): each step's loss
    ``==`` at cp 1 and 2 (2 and 4, 4 and 8 ranks; the logits' equality is the tests above: this run's loss alone
    would not tell a last-bit change, see the Hugging Face test). Their parameter gradients are all-reduced, not
    summed exactly, and the start line says so with the reason."""
    def losses(tp, cp):
        out = tmp_path / f"tp-{tp}-{cp}.json"
        result = cp_train("--nproc", str(tp * cp), "--tp-size", str(tp), "--cp-size", str(cp), *TRAIN,
                          "--deterministic", "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-2000:]
        assert "parameter gradients all-reduced (float32, not the same bits at every CP degree: tensor " \
               "parallelism" in result.stderr
        metrics = json.loads(out.read_text())
        assert metrics["exact_grads"] is False
        return [step["loss"] for step in metrics["steps"]]

    assert losses(2, 2) == losses(2, 1)
    assert losses(4, 2) == losses(4, 1)


def test_cp_train_deterministic_moe_losses_are_bitwise_the_same_at_every_cp_degree(tmp_path):
    """``cp-train --deterministic --moe-experts 4``: the reference GPT's MoE layers (its load-balancing loss summed
    over the CP group's tokens in one order, ``ExpertParallelHandler.probs_sum``; every gradient summed exactly, an
    expert's per unit of the rows routed to it, ``ExpertParallelHandler.expert_rows``): each of 3 steps' loss and
    gradient norm ``==`` at cp 1, 2 (experts over 2 ranks) and 4 (the same), and with thd packs at cp 1 and 2.
    (Until 2026-12-06 the experts' gradients were all-reduced in float32: the second step's loss at cp 4 was 3.6e-10
    relative off cp 1's on an AMD EPYC.) Negative control: the default mode at cp 2 differs at the first step."""
    moe = ("--moe-experts", "4")
    want = _losses(tmp_path, 1, "--deterministic", *moe, norms=True)
    assert _losses(tmp_path, 2, "--deterministic", "--expert-parallel-size", "2", *moe, norms=True) == want
    assert _losses(tmp_path, 4, "--deterministic", "--expert-parallel-size", "2", *moe, norms=True) == want
    assert _losses(tmp_path, 2, *moe)[0] != want[0][0]
    packed = ("--deterministic", "--packing", "thd", *moe)
    assert _losses(tmp_path, 2, *packed, norms=True) == _losses(tmp_path, 1, *packed, norms=True)


def test_deterministic_mode_refuses_token_mixers_other_than_attention(tmp_path):
    """Token mixers other than attention (a halo convolution, state passing between ranks) are not bitwise the same
    at every CP degree (1e-7 to 4e-6 apart at cp 2 and 4, measured): cp-train refuses a Hugging Face model that has
    one before any rank starts, and the handler's mixer methods refuse in the mode whatever calls them (the
    Trainer integrations)."""
    import hf_zoo

    hf_zoo.tiny_config("qwen3_next", {"vocab_size": 256, "layer_types": ["linear_attention", "full_attention"]}
                       ).save_pretrained(tmp_path)
    argv = ["--nproc", "2", "--cp-size", "2", "--hf-config", str(tmp_path), "--seq-len", "192", "--deterministic"]
    with pytest.raises(ValueError, match=re.escape("--deterministic: Qwen3NextGatedDeltaNet mix tokens other than by "
                                                   "attention")):
        validate(build_parser().parse_args(argv))
    handler = LocalContextParallelHandler(cp_group=None, cp_comm_type="a2a", deterministic=True)
    x, weight = torch.randn(1, 4, 96), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"causal_conv1d: deterministic=True: token mixers other than attention"):
        handler.causal_conv1d(x, weight)


@pytest.mark.parametrize("flags, words", [
    (["--cp-comm-type", "p2p", "--seq-len", "104"], "--seq-len 104: deterministic=True with cp_comm_type='p2p': "
                                                    "documents of [104] tokens"),
    (["--cp-comm-type", "all_gather", "--seq-len", "320"], "--seq-len 320: deterministic=True with "
                                                           "cp_comm_type='all_gather': a sequence of 320 tokens"),
    (["--num-heads", "8", "--num-kv-heads", "1"], "with --cp-size 2: deterministic=True with 1 key-value heads over a "
                                                  "CP group of 2"),
])
def test_cp_train_deterministic_refuses_by_name_before_any_rank(flags, words):
    argv = ["--nproc", "2", "--cp-size", "2", *TRAIN[:-2], "--deterministic", *flags]
    with pytest.raises(ValueError, match=re.escape(words)):
        validate(build_parser().parse_args(argv))


def test_cp_train_deterministic_check_parity_is_bitwise(tmp_path):
    """``cp-train --deterministic --check-parity`` (dp 1, exact gradients): besides the tolerance check against the
    independent reference, every step's loss ``==`` and every parameter gradient ``torch.equal`` to the same step at
    cp 1 through the mode, and it says so (the reference GPT bshd at cp 2, thd at cp 4; Qwen2 at cp 2). At dp 2 the
    check is not made, and the run says why."""
    qwen = tmp_path / "qwen2"
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.5).save_pretrained(qwen)
    runs = {"gpt-bshd": ("--nproc", "2", "--cp-size", "2", *TRAIN),
            "gpt-thd": ("--nproc", "4", "--cp-size", "4", *TRAIN, "--packing", "thd"),
            "qwen2": ("--nproc", "2", "--cp-size", "2", "--hf-config", str(qwen), "--steps", "2", "--seq-len", "192",
                      "--max-corpus-bytes", "2000000")}
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        result = cp_train(*flags, "--deterministic", "--check-parity", "--metrics-out", str(out))
        assert result.returncode == 0, result.stderr[-2000:]
        assert "bitwise parity passed" in result.stderr, name
        bitwise = json.loads(out.read_text())["parity"]["bitwise"]
        assert bitwise == {"passed": True, "loss_steps_differing": [], "gradients_differing": {}}, name
    result = cp_train("--nproc", "4", "--cp-size", "2", *TRAIN, "--steps", "1", "--deterministic", "--check-parity")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no bitwise check against cp 1 in the mode (it needs the gradients summed exactly and dp 1: dp 2)" \
        in result.stderr


def test_bitwise_parity_verdict_fails_on_any_difference(capsys):
    """The verdict of the bitwise check fails when one step's loss differs or one gradient is not ``torch.equal``
    (the check can fail), and names them."""
    from cp_handler.training.parity import parity_result

    record = {"step": 1, "loss": 1.0, "reference_loss": 1.0, "grad_rel_diff": 0.0, "grad_norm": 2.0,
              "reference_grad_norm": 2.0, "twin_loss": 1.0, "twin_grads_differing": []}
    assert parity_result([record], "float32")["passed"]
    bad = [dict(record, twin_loss=1.0 + 2**-52), dict(record, step=2, twin_grads_differing=["lm_head.weight"])]
    result = parity_result(bad, "float32")
    assert not result["passed"]
    assert result["bitwise"]["loss_steps_differing"] == [1]
    assert result["bitwise"]["gradients_differing"] == {2: ["lm_head.weight"]}
    assert "bitwise parity FAILED" in capsys.readouterr().err
