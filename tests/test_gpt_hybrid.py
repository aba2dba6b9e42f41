"""The reference GPT as a hybrid (three Gated DeltaNet layers to one attention layer, as Qwen3-Next): loss and
every parameter gradient at cp 2 and 4 equal the cp 1 run, bshd and thd (zero-length and tiny documents), with a
different comm type in every attention layer; thd also equals every document run alone. Tolerances: see
gpt_reference.py (the linear layers' kernel computes in float32, as attention does).
"""


import pytest
import torch
from dist_utils import run_distributed
from gpt_reference import CONFIG, assert_parity, loss_and_grads
from test_cli import SMALL, cp_generate, cp_train
from test_gpt_thd import documents_alone

from cp_handler import build_dp_cp_groups, get_cp_handler_cls
from cp_handler.models import GPTConfig

LAYERS = ("linear_attention", "full_attention", "linear_attention", "full_attention")
COMM_TYPES = ["p2p", "all_gather", "a2a", "a2a+p2p"]  # per layer: the linear layers ignore theirs
LENGTHS = [5, 0, 1, 17, 2, 30, 9]


def _worker(rank, world):
    config = GPTConfig(**{**vars(CONFIG), "num_layers": len(LAYERS), "layer_types": LAYERS})
    groups = build_dp_cp_groups(world, "cpu", [2, world // 2])
    handler_cls = get_cp_handler_cls("local", COMM_TYPES)
    common = {"cp_comm_type": COMM_TYPES, "hierarchical_cp_groups": groups.hierarchical_cp_groups}
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(7))
    reference = loss_and_grads(config, handler_cls(cp_group=None, cp_comm_type=COMM_TYPES), tokens, None)
    got = loss_and_grads(config, handler_cls(cp_group=groups.cp_group, **common), tokens, groups.cp_group)
    assert_parity(got, reference, f"hybrid bshd cp={world}")
    packed = torch.randint(0, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    alone = documents_alone(config, packed, LENGTHS)
    single = loss_and_grads(config, handler_cls(cp_group=None, cp_comm_type=COMM_TYPES, qkv_format="thd",
                                                cu_seqlens=cu), packed, None)
    assert_parity(single, alone, "hybrid thd cp=1 vs documents alone")
    got = loss_and_grads(config, handler_cls(cp_group=groups.cp_group, qkv_format="thd", cu_seqlens=cu, **common),
                         packed, groups.cp_group)
    assert_parity(got, alone, f"hybrid thd cp={world}")


@pytest.mark.parametrize("world", [2, 4])
def test_hybrid_gpt_matches_one_process(world):
    run_distributed(_worker, world)


def test_hybrid_layer_pattern_parity_checkpoint_and_generation_refused(tmp_path):
    """--layer-pattern LA (Gated DeltaNet and attention layers) at cp 2 against one process, saved; cp-generate
    refuses the hybrid checkpoint by name before any rank starts."""
    result = cp_train("--nproc", "2", "--layer-pattern", "LA", *SMALL[:1], "3", *SMALL[2:], "--check-parity",
                      "--save", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parity passed" in result.stderr
    generate = cp_generate("--nproc", "2", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "hello",
                           "--max-new-tokens", "2")
    assert generate.returncode != 0 and "a hybrid model (linear-attention layers)" in generate.stderr, generate.stderr
