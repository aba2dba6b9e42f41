"""The deterministic mode on CUDA (marked ``gpu``; opt-in: ``CP_HANDLER_DETERMINISTIC_CUDA=1`` and
``torch.use_deterministic_algorithms(True)``, docs/deterministic.md "On a GPU"): torch's FlashAttention-2 kernel
(``flash``) on canonical tiles, bf16, the output and dq, dk, dv of ``p2p`` and ``all_gather`` at cp 2
``torch.equal`` to cp 1 on the same GPU, and the reference GPT's logits and per-token losses; ``a2a`` refused by
name. Skipped without CUDA (not counted as
passed); pending a GPU run (docs/gpu_ledger.json, stage ``deterministic``).

Tolerances: none (bitwise).
"""

import os

import pytest
import torch
from deterministic_cases import GPT_OUTPUTS, assert_equal, case_handler, gpt_outputs, results
from dist_utils import new_cp_group, run_distributed

from cp_handler.handlers.local import DETERMINISTIC_CUDA_ENV

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _worker(rank, world):
    os.environ[DETERMINISTIC_CUDA_ENV] = "1"
    torch.use_deterministic_algorithms(True)
    group = new_cp_group()
    seq_len = 2 * world * 64 * 3  # zigzag chunks of three canonical tiles
    for case in (("gqa-bf16", 8, 4, torch.bfloat16, "causal", None, "bshd"),
                 ("window-bf16", 8, 8, torch.bfloat16, "causal", (37, 0), "bshd")):
        for comm_type in ("p2p", "all_gather"):
            want = results(case_handler(None, "bshd", comm_type), case, seq_len, "cuda")  # cp 1 on this rank's GPU
            got = results(case_handler(group, "bshd", comm_type), case, seq_len, "cuda")
            assert_equal(got, want, f"{case[0]} {comm_type} cp {world}")
    q = torch.zeros(1, seq_len // world, 8, 16, device="cuda", dtype=torch.bfloat16)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="use 'p2p' or 'all_gather'"):
        case_handler(group, "bshd", "a2a").core_attn(module, q, q, q, attn_mask_type="causal")
    want = gpt_outputs(case_handler(None, "bshd", "p2p"), seq_len, torch.bfloat16, "cuda")
    got = gpt_outputs(case_handler(group, "bshd", "p2p"), seq_len, torch.bfloat16, "cuda")
    assert_equal(got, want, f"GPT cp {world}", names=GPT_OUTPUTS)


def test_the_mode_is_bitwise_the_same_at_cp_1_and_2_on_cuda():
    run_distributed(_worker, 2, device="cuda")
