"""Checkpoints that never lose or mix data (cp_handler/training/checkpoint.py).

Each case reproduces a way a checkpoint was lost, replaced or silently mismatched before:

* resuming an older step into a ``--save`` folder holding newer steps deleted the checkpoint just written
  and the one resumed from (pruning by name); now refused before any rank starts, naming the later steps,
  and a run prunes only what it wrote;
* re-saving a step that exists renamed the old folder aside first (a kill then left ``latest`` dangling);
  now a step is never replaced;
* ``--export-hf`` onto the ``--save`` folder (or any folder with files) deleted it; now refused;
* two runs on one ``--save`` folder both exit 0, one replacing the other's checkpoints; now a lock;
* a GPT-2 config (``n_embd``, ``n_head``) resumed with another shape was not compared; now the whole config;
* 128 bytes overwritten in a shard trained on silently; now the sha256 of every file is verified;
* another file at the same ``--data`` path was accepted; now the data's fingerprint is compared.
"""

import json
import os
import shutil
import socket
import subprocess

import pytest
from test_checkpoint import BASE, straight  # noqa: F401 - the module fixture: 8 steps saved every 2 (cp 2)
from test_cli import SMALL, cp_train

from cp_handler.cli.args import parse
from cp_handler.training.checkpoint import LOCK, SaveFolderError, SaveLock, _process_start, step_name


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _copy(ckpt, tmp_path, name="ckpt"):
    target = tmp_path / name
    shutil.copytree(ckpt, target)
    return target


def test_resuming_an_older_step_into_a_folder_with_newer_steps_is_refused_before_any_rank(tmp_path, straight):  # noqa: F811
    ckpt = _copy(straight[0], tmp_path)  # step-4, step-6, step-8
    with pytest.raises(SystemExit, match=rf"--save {ckpt} holds checkpoints past step 4, where this run starts "
                                         rf"\(--resume {ckpt}/{step_name(4)}\): {step_name(6)}, {step_name(8)}, "
                                         r"written by another run"):
        parse([*BASE, "--nproc", "2", "--steps", "12", "--resume", str(ckpt / step_name(4)), "--save", str(ckpt)])
    with pytest.raises(SystemExit, match=rf"--save {ckpt} holds checkpoints past step 0"):
        parse([*BASE, "--nproc", "2", "--steps", "12", "--save", str(ckpt)])  # a fresh run into a used folder
    parse([*BASE, "--nproc", "2", "--steps", "12", "--resume", str(ckpt), "--save", str(ckpt)])  # from the newest


def test_a_run_prunes_only_what_it_wrote_and_latest_stays_loadable(tmp_path, straight):  # noqa: F811
    """Resumed from the newest (step 8) into its own folder with --save-keep 1: the earlier run's step-4 /
    step-6 / step-8 stay, this run keeps its newest (step 12) only, and ``latest`` names it."""
    ckpt = _copy(straight[0], tmp_path)
    result = cp_train(*BASE, "--nproc", "2", "--steps", "12", "--resume", str(ckpt), "--save", str(ckpt),
                      "--save-every", "2", "--save-keep", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", *(step_name(s) for s in (4, 6, 8, 12))]
    assert (ckpt / "latest").read_text() == step_name(12)
    parse([*BASE, "--nproc", "2", "--steps", "14", "--resume", str(ckpt)])  # loadable, checksums included


def _resave_worker(rank, world, root):
    import torch.distributed as dist
    from test_checkpoint import _toy

    from cp_handler.training.checkpoint import CheckpointError, find_checkpoint, save_checkpoint

    model, optim = _toy(rank)
    save_checkpoint(root, 1, model, optim, {"step": 1, "world_size": world})
    before = {p: open(p, "rb").read() for p in sorted((find_checkpoint(root)).iterdir())}
    with pytest.raises(CheckpointError, match=rf"{step_name(1)} exists already; a checkpoint is never replaced"):
        save_checkpoint(root, 1, model, optim, {"step": 1, "world_size": world})
    dist.barrier()
    assert {p: open(p, "rb").read() for p in sorted(find_checkpoint(root).iterdir())} == before


def test_a_step_is_never_re_saved_so_no_kill_can_leave_latest_dangling(tmp_path):
    """The old re-save renamed ``step-N`` aside before renaming the new one in: a kill between the two
    left ``latest`` naming nothing. Now the second save of a step is refused on every rank, the first intact."""
    from dist_utils import run_distributed

    run_distributed(_resave_worker, 2, str(tmp_path / "ckpt"))


def test_export_target_may_not_be_or_hold_checkpoints_nor_files_it_did_not_write(tmp_path, straight):  # noqa: F811
    from test_cli_hf import _hf_dir

    hf = ["--nproc", "2", "--hf-config", _hf_dir(tmp_path, False), "--steps", "2"]
    ckpt = _copy(straight[0], tmp_path)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("the user's")
    cases = [(["--save", str(tmp_path / "s"), "--export-hf", str(tmp_path / "s")], r"is, or is inside or around, "
                                                                                    r"--save"),
             (["--save", str(tmp_path / "s"), "--export-hf", str(tmp_path / "s" / "hf")], r"inside or around"),
             (["--export-hf", str(ckpt)], r"holds cp-train checkpoints"),
             (["--export-hf", str(other)], r"already holds files \(mine.txt\) that this export did not write")]
    for flags, message in cases:
        with pytest.raises(SystemExit, match=rf"cp-train: error: --export-hf .*{message}"):
            parse([*hf, *flags])
    assert (other / "mine.txt").read_text() == "the user's" and (ckpt / "latest").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    parse([*hf, "--export-hf", str(empty)])  # new or empty folders are fine


def test_one_writer_per_save_folder_and_a_stale_lock_is_named(tmp_path):
    folder = tmp_path / "ckpt"
    with SaveLock(str(folder)):
        with pytest.raises(SaveFolderError, match=rf"--save {folder} is being written by another cp-train run "
                                                  rf"\(pid {os.getpid()} on host {socket.gethostname()}.*still "
                                                  r"running; lock .*\.cp-train\.lock\): one writer per folder"):
            SaveLock(str(folder)).acquire()
    assert not (folder / LOCK).exists()  # released
    # a second cp-train while a live process holds the lock: refused by name, the folder untouched
    (folder / LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                           "start": _process_start(os.getpid()), "since": "now"}))
    result = cp_train("--nproc", "2", *SMALL, "--save", str(folder))
    assert result.returncode == 1 and "is being written by another cp-train run" in result.stderr, result.stderr
    assert sorted(p.name for p in folder.iterdir()) == [LOCK]
    # a lock of a process that is gone (its pid not running): taken over and named
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "start": "1",
                                           "since": "then"}))
    lock = SaveLock(str(folder)).acquire()
    assert lock.took_over["pid"] == dead.pid and json.loads((folder / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    # another host's lock cannot be checked from here: refused, saying so
    (folder / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "start": "1", "since": "then"}))
    with pytest.raises(SaveFolderError, match=r"on another host: its liveness cannot be checked from here"):
        SaveLock(str(folder)).acquire()


def test_the_whole_hugging_face_config_is_compared_on_resume(tmp_path):
    """GPT-2 names its shape n_embd / n_head / n_layer: none of the old shape keys, so another n_head trained
    on as another model. The whole config is compared (minus names and bookkeeping), each field named."""
    from transformers import GPT2Config

    from cp_handler.training.checkpoint import run_meta

    def gpt2(folder, **changes):
        shape = {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "bos_token_id": 0,
                 "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
        GPT2Config(**{**shape, **changes}).save_pretrained(tmp_path / folder)
        return ["--nproc", "2", "--hf-config", str(tmp_path / folder), *SMALL]

    config, _ = parse(gpt2("saved"))
    ckpt = tmp_path / "ckpt" / step_name(2)
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "cp_train.json").write_text(json.dumps({**run_meta(config, 2, "AdamW"), "files": {}}))
    parse([*gpt2("same", architectures=["GPT2LMHeadModel"]), "--resume", str(ckpt)])  # bookkeeping may differ
    for changes, message in (({"n_head": 8}, r"model n_head: checkpoint 4, this run 8"),
                             ({"n_embd": 32}, r"model n_embd: checkpoint 64, this run 32"),
                             ({"activation_function": "relu"}, r"model activation_function: checkpoint 'gelu_new'")):
        with pytest.raises(SystemExit, match=rf"--resume .* does not fit this run: .*{message}"):
            parse([*gpt2(f"other{len(message)}", **changes), "--resume", str(ckpt)])


def test_a_damaged_shard_is_refused_naming_the_file(tmp_path, straight):  # noqa: F811
    ckpt = _copy(straight[0], tmp_path)
    shard = sorted((ckpt / step_name(8)).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[100:228] = bytes(128)  # 128 bytes overwritten: the size is unchanged
    shard.write_bytes(bytes(data))
    flags = [*BASE, "--nproc", "2", "--steps", "10", "--resume", str(ckpt)]
    with pytest.raises(SystemExit, match=rf"--resume .*: {shard} does not match its recorded sha256"):
        parse(flags)
    shard.write_bytes(bytes(data[:1000]))  # truncated
    with pytest.raises(SystemExit, match=rf"{shard} has 1000 bytes, the checkpoint recorded {len(data)}"):
        parse(flags)
    shard.unlink()
    with pytest.raises(SystemExit, match=rf"{shard} is missing"):
        parse(flags)


def test_resume_on_other_data_at_the_same_path_is_refused_unless_allowed(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    first = cp_train("--nproc", "2", *SMALL, "--steps", "2", "--data", str(corpus), "--save", str(tmp_path / "ckpt"))
    assert first.returncode == 0, first.stderr[-2000:]
    corpus.write_text("class A:\n    pass\n" * 600)  # another file at the same path
    flags = ["--nproc", "2", *SMALL, "--steps", "4", "--data", str(corpus), "--resume", str(tmp_path / "ckpt")]
    with pytest.raises(SystemExit, match=r"--data's contents \(sha256 of the bytes read, in order\): checkpoint "
                                         r"'[0-9a-f]{64}', this run '[0-9a-f]{64}' \(--allow-data-change resumes on "
                                         r"other data\)"):
        parse(flags)
    assert parse([*flags, "--allow-data-change"])[0].allow_data_change
    with pytest.raises(SystemExit, match=r"--allow-data-change lets a --resume continue on other data: it needs "
                                         r"--resume"):
        parse(["--nproc", "2", *SMALL, "--allow-data-change"])
