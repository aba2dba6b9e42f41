"""cp-train checkpoints (``--save`` / ``--resume`` / ``--export-hf``, cp_handler/training/checkpoint.py).

* Exact resume: 8 steps straight, and a resume from that run's step-4 checkpoint to step 8, give
  bitwise-equal losses for steps 5-8 and final parameters
  (CPU: the same reductions in the same order, the optimizer state and the learning-rate schedule's
  position restored bit for bit, batches drawn by step index). Every run here warms the learning rate up,
  decays it along a cosine and clips the gradient norm (active: the norms exceed the clip), so a schedule
  restarted from step 0 or a clip by a rank-local norm of sharded experts changes the resumed losses.
* Another layout (cp 2 -> dp 2 with a2a, ep 2 -> ep 1 with MoE, static -> dynamic CP): the loss curve
  continues within ``--check-parity``'s float32 tolerance (1e-5 relative: only the order of float32
  sums differs between layouts) of the straight run; dynamic CP draws other batches, so it is checked
  with ``--check-parity`` on the resumed steps instead.
* Nothing lost: a rank SIGKILLed during a save leaves the previous checkpoint as ``latest`` and
  loadable, the partial one ignored; a full disk is a clear error on every rank with the previous
  checkpoint intact; ``--resume`` of a missing, partial or incompatible checkpoint fails before any
  rank starts, naming the mismatch.
"""

import errno
import json
import os
import signal
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import run_distributed
from test_cli import SMALL, cp_train

from cp_handler.cli.args import parse
from cp_handler.training.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint, step_name
from cp_handler.training.schedule import LRSchedule

SCHEDULE = ["--lr-warmup-steps", "2", "--lr-decay-style", "cosine", "--lr-decay-steps", "8", "--min-lr", "3e-4"]
CLIP = 0.5
BASE = [flag for flag in SMALL if flag not in ("--steps", "6")] + SCHEDULE + ["--clip-grad", str(CLIP)]
PARITY_RTOL = 1e-5


def losses(path):
    return [r["loss"] for r in json.loads(path.read_text())["steps"]]


def steps_of(path) -> list[dict]:
    return json.loads(path.read_text())["steps"]


def model_tensors(checkpoint) -> dict:
    """The model's tensors of a DCP checkpoint folder (every rank's shards, read on one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, out)
    return {k: v for k, v in torch.load(out, weights_only=False)["model"].items()}


def train(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    result = cp_train(*BASE, *flags, "--metrics-out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out), result.stderr


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """8 steps at cp 2 on 2 ranks, saved every 2 steps, the last 3 kept; returns the ``--save``
    folder and the loss curve (the step-4 checkpoint is the resume point of the tests)."""
    tmp = tmp_path_factory.mktemp("straight")
    curve, _ = train(tmp, "straight", "--nproc", "2", "--steps", "8", "--save", str(tmp / "ckpt"), "--save-every", "2",
                     "--save-keep", "3")
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == ["latest", step_name(4), step_name(6), step_name(8)]
    records = steps_of(tmp / "straight.json")
    want = [3e-3 * LRSchedule(3e-3, 3e-4, 2, "cosine", 8)(step) for step in range(8)]
    assert [r["lr"] for r in records] == pytest.approx(want, rel=1e-12) and want[-1] == pytest.approx(3e-4)
    assert all(r["grad_norm"] > CLIP for r in records)  # the clip is active at every step
    return tmp / "ckpt", curve


def test_resume_same_layout_is_bitwise_exact(tmp_path, straight):
    ckpt, curve = straight
    second, err = train(tmp_path, "second", "--nproc", "2", "--steps", "8", "--resume", str(ckpt / step_name(4)),
                        "--save", str(tmp_path / "ckpt"))
    assert "resumed from" in err and step_name(4) in err
    assert "cp-train: step 5/8 loss" in err and "cp-train: step 1/" not in err  # counts on from the checkpoint
    assert second == curve[4:]  # bitwise
    got = model_tensors(tmp_path / "ckpt" / step_name(8))
    want = model_tensors(ckpt / step_name(8))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_resume_at_another_layout_continues_the_curve(tmp_path, straight):
    ckpt, curve = straight
    # cp 2 x dp 1 (2 sequences per rank) -> cp 1 x dp 2 (1 sequence per rank), p2p -> a2a: the same global batch
    second, _ = train(tmp_path, "second", "--nproc", "2", "--cp-size", "1", "--batch-size", "1", "--cp-comm-type",
                      "a2a", "--steps", "8", "--resume", str(ckpt / step_name(4)))
    torch.testing.assert_close(torch.tensor(second), torch.tensor(curve[4:]), rtol=PARITY_RTOL, atol=0)
    # static -> dynamic CP: other batches (whole documents), so each resumed step is checked against one process
    dynamic, err = train(tmp_path, "dynamic", "--nproc", "2", "--dynamic-cp", "--max-seqlen-per-rank", "128",
                         "--steps", "6", "--resume", str(ckpt / step_name(4)), "--check-parity")
    assert len(dynamic) == 2 and "parity passed" in err


def test_moe_checkpoint_holds_every_expert_once_and_resumes_at_another_ep(tmp_path):
    moe = ["--nproc", "2", "--moe-experts", "4"]
    curve, _ = train(tmp_path, "straight", *moe, "--expert-parallel-size", "2", "--steps", "6", "--save",
                     str(tmp_path / "ckpt"), "--save-every", "3")
    metadata = dcp.FileSystemReader(tmp_path / "ckpt" / step_name(3)).read_metadata().state_dict_metadata
    weights = [k for k in metadata if k.startswith("model.layers.0.mlp.experts.") and k.endswith("gate_proj.weight")]
    assert sorted(k.split(".experts.")[1].split(".")[0] for k in weights) == ["0", "1", "2", "3"]  # each once
    assert all(r["grad_norm"] > CLIP for r in steps_of(tmp_path / "straight.json"))  # clipped by the global norm
    second, _ = train(tmp_path, "second", *moe, "--expert-parallel-size", "1", "--steps", "6", "--resume",
                      str(tmp_path / "ckpt" / step_name(3)))
    torch.testing.assert_close(torch.tensor(second), torch.tensor(curve[3:]), rtol=PARITY_RTOL, atol=0)


def test_hugging_face_model_saves_resumes_and_exports(tmp_path):
    from test_cli_hf import _hf_dir
    from transformers import AutoModelForCausalLM

    source = ["--nproc", "2", "--hf-config", _hf_dir(tmp_path, False)]
    train(tmp_path, "first", *source, "--steps", "2", "--save", str(tmp_path / "ckpt"))
    second, err = train(tmp_path, "second", *source, "--steps", "4", "--resume", str(tmp_path / "ckpt"), "--save",
                        str(tmp_path / "ckpt"), "--export-hf", str(tmp_path / "exported"), "--check-parity")
    assert len(second) == 2 and "parity passed" in err
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").state_dict()
    saved = model_tensors(tmp_path / "ckpt" / step_name(4))
    for key, value in exported.items():
        torch.testing.assert_close(value, saved[f"model.{key}"], rtol=0, atol=0)  # CPCausalLM.model is the HF model


def test_resume_refuses_what_does_not_fit_before_any_rank_starts(tmp_path, straight, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ckpt = str(straight[0])
    cases = [  # (--steps, more flags, --resume, the error)
        (12, [], str(tmp_path / "nothing"), "no such directory"),
        (8, [], ckpt, rf"--steps 8: {step_name(8)} has already trained 8 steps"),
        (12, ["--hidden-size", "96"], ckpt, r"model --hidden-size: checkpoint 64, this run 96"),
        (12, ["--moe-experts", "4"], ckpt, r"model --moe-experts: checkpoint 0, this run 4"),
        (12, ["--lr", "0.001"], ckpt, r"--lr: checkpoint 0.003, this run 0.001"),
        (12, ["--lr-decay-steps", "12"], ckpt, r"--lr-decay-steps \(default: --steps\): checkpoint 8, this run 12"),
        (12, ["--seed", "1"], ckpt, r"--seed: checkpoint 0, this run 1"),
        (12, ["--batch-size", "4"], ckpt, r"global batch: checkpoint 2, this run 4 \(--batch-size"),
    ]
    (tmp_path / "partial_only" / ".step-00000002.partial").mkdir(parents=True)
    cases.append((12, [], str(tmp_path / "partial_only"), r"only partial checkpoints \(.step-00000002.partial"))
    for steps, extra, path, message in cases:
        with pytest.raises(SystemExit, match=rf"cp-train: error: .*{message}"):
            parse([*BASE, "--nproc", "2", "--steps", str(steps), *extra, "--resume", path])


def _toy(rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def _kill_during_save_worker(rank, world, root):
    model, optim = _toy(rank)
    save_checkpoint(root, 1, model, optim, {"step": 1, "world_size": world})
    if rank == 1:  # the second save dies half-way on rank 1 (a SIGKILL: no cleanup of any kind)
        dcp.FileSystemWriter.write_data = lambda self, plan, planner: os.kill(os.getpid(), signal.SIGKILL)
    else:  # rank 0 is still writing (a slow disk) when the job is stopped: it never gets to clean up either
        dcp.FileSystemWriter.write_data = lambda self, plan, planner: threading.Event().wait()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_checkpoint(root, 2, model, optim, {"step": 2, "world_size": world})


def _load_worker(rank, world, root):
    model, optim = _toy(rank)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert load_checkpoint(find_checkpoint(root), model, optim) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_a_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    with pytest.raises(Exception, match=r"signal|SIGKILL|exit code"):
        run_distributed(_kill_during_save_worker, 2, root)
    assert (tmp_path / "ckpt" / ".step-00000002.partial").is_dir()  # the partial save, ignored
    assert find_checkpoint(root).name == step_name(1)
    run_distributed(_load_worker, 2, root)


def _disk_full_worker(rank, world, root):
    model, optim = _toy(rank)
    save_checkpoint(root, 1, model, optim, {"step": 1, "world_size": world})

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")
    if rank == 0:
        dcp.FileSystemWriter.write_data = full
    with pytest.raises(CheckpointError, match=r"saving step 2 to .* failed \(the disk is full\); the previous "
                                              r"checkpoint is intact"):
        save_checkpoint(root, 2, model, optim, {"step": 2, "world_size": world})
    dist.barrier()
    assert find_checkpoint(root).name == step_name(1)
    assert not os.path.exists(os.path.join(root, ".step-00000002.partial"))


def test_disk_full_during_a_save_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(_disk_full_worker, 2, root)
    run_distributed(_load_worker, 2, root)
