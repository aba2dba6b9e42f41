"""``cp-train --fsdp``: parameters, gradients and optimizer states sharded over every rank (FSDP2 over dp x cp).

* dp 2 x cp 2 with micro-batches, recomputation and a chunked loss: every step's loss, whole gradient and
  gradient norm against one process (``--check-parity``, float32 1e-5: only the order of sums differs); each rank
  holds a quarter of the parameters, gradients and AdamW states (``state_bytes_per_rank``: exactly 1/world here,
  every tensor's first dimension divisible by 4);
* its checkpoint (DCP, sharded) resumes without FSDP at another layout and back with FSDP at cp 4 with evaluation
  at cp 2, the loss curve continuing within parity's tolerance of the straight FSDP run;
* a Hugging Face model with FSDP: parity, and ``--export-hf`` gathers the shards (the exported weights equal the
  checkpoint's).
"""

import json

import pytest
import torch
from test_checkpoint import model_tensors
from test_cli import cp_train

from cp_handler.cli.args import parse
from cp_handler.training.checkpoint import step_name

FLAGS = ["--seq-len", "128", "--hidden-size", "64", "--ffn-hidden-size", "128", "--max-corpus-bytes", "2000000",
         "--batch-size", "2"]


def _run(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    result = cp_train(*FLAGS, *flags, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stderr


def test_fsdp_parity_sharded_state_and_resume_at_other_layouts(tmp_path):
    straight, err = _run(tmp_path, "straight", "--nproc", "4", "--cp-size", "2", "--fsdp", "--steps", "6",
                         "--micro-batch-size", "1", "--recompute", "--loss-chunk-tokens", "40", "--check-parity",
                         "--save", str(tmp_path / "ckpt"), "--save-every", "2", "--save-keep", "3")
    assert "FSDP2 over all 4 ranks" in err and straight["parity"]["passed"], err[-2000:]
    replicated, _ = _run(tmp_path, "ddp", "--nproc", "4", "--cp-size", "2", "--steps", "1")
    for sharded, whole in zip(straight["state_bytes_per_rank"], replicated["state_bytes_per_rank"], strict=True):
        assert 4 * sharded["parameters"] == whole["parameters"], (sharded, whole)
        assert abs(4 * sharded["optimizer"] - whole["optimizer"]) <= 4 * 4 * 64, (sharded, whole)  # AdamW's steps
    curve = [r["loss"] for r in straight["steps"]]
    ddp, _ = _run(tmp_path, "resumed_ddp", "--nproc", "2", "--cp-size", "2", "--batch-size", "4", "--steps", "4",
                  "--resume", str(tmp_path / "ckpt" / step_name(2)), "--save", str(tmp_path / "ddp"))
    torch.testing.assert_close(torch.tensor([r["loss"] for r in ddp["steps"]]), torch.tensor(curve[2:4]), rtol=1e-5,
                               atol=0)
    back, err = _run(tmp_path, "back", "--nproc", "4", "--cp-size", "4", "--batch-size", "4", "--fsdp", "--steps", "6",
                     "--resume", str(tmp_path / "ddp"), "--eval-cp-size", "2", "--check-eval-cp")
    assert "eval-cp check passed" in err, err[-2000:]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in back["steps"]]), torch.tensor(curve[4:]), rtol=1e-5,
                               atol=0)


def test_fsdp_hugging_face_model_parity_and_export(tmp_path):
    from test_cli_hf import _hf_dir
    from transformers import AutoModelForCausalLM

    _, err = _run(tmp_path, "hf", "--nproc", "2", "--fsdp", "--hf-config", _hf_dir(tmp_path, False), "--steps", "2",
                  "--check-parity", "--save", str(tmp_path / "ckpt"), "--export-hf", str(tmp_path / "exported"))
    assert "parity passed" in err, err[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    saved = model_tensors(tmp_path / "ckpt" / step_name(2))
    for key, value in exported.items():
        torch.testing.assert_close(value, saved[f"model.{key}"], rtol=0, atol=0)


@pytest.mark.parametrize("flags, message", [
    (["--fsdp", "--moe-experts", "4"], "--fsdp with --moe-experts: not implemented"),
    (["--fsdp", "--dynamic-cp", "--max-seqlen-per-rank", "256"], "--fsdp with --dynamic-cp: not implemented"),
    pytest.param(["--offload-activations"], "--offload-activations: no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the rule is for machines without CUDA")),
])
def test_what_does_not_combine_is_refused_before_any_rank(flags, message, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit, match=message):
        parse(["--nproc", "2", *flags])
