"""The GPU pass's bookkeeping on CPU (scripts/gpu_ledger.py, scripts/gpu_check.py): which stages are pending, what a
pass records, how a part's end is classified. The stages' commands are replaced by tiny ``python -c`` parts (fake
stage results); no GPU is needed or used."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check  # noqa: E402
import gpu_ledger  # noqa: E402


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A stand-in repository with two stages: ``a`` covers a folder and a file, ``b`` another file."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "x.py").write_text("x = 1\n")
    (tmp_path / "t.py").write_text("t = 1\n")
    (tmp_path / "other.py").write_text("o = 1\n")
    monkeypatch.setattr(gpu_ledger, "COVERS", {"a": ("lib", "t.py"), "b": ("other.py",)})
    return tmp_path


def test_a_stage_is_pending_until_it_passes_on_the_code_it_covers(tree):
    h = gpu_ledger.source_hash("a", [["p", ["python", "-c", "1"], {}]], tree)
    assert gpu_ledger.is_pending("a", h, {})  # never run
    entry = {"result": "PASS", "source_hash": h}
    assert not gpu_ledger.is_pending("a", h, {"a": entry})
    assert gpu_ledger.is_pending("a", h, {"a": {**entry, "result": "FAIL"}})
    assert gpu_ledger.is_pending("a", h, {"a": {**entry, "result": "INCOMPLETE"}})
    # a covered file changes (in a covered folder or named): pending again; an uncovered one: not
    (tree / "lib" / "x.py").write_text("x = 2\n")
    h2 = gpu_ledger.source_hash("a", [["p", ["python", "-c", "1"], {}]], tree)
    assert h2 != h and gpu_ledger.is_pending("a", h2, {"a": entry})
    (tree / "lib" / "new.py").write_text("")
    assert gpu_ledger.source_hash("a", [["p", ["python", "-c", "1"], {}]], tree) != h2  # a file added
    h3 = gpu_ledger.source_hash("a", [["p", ["python", "-c", "1"], {}]], tree)
    (tree / "other.py").write_text("o = 2\n")
    assert gpu_ledger.source_hash("a", [["p", ["python", "-c", "1"], {}]], tree) == h3
    # the stage's own commands are covered too
    assert gpu_ledger.source_hash("a", [["p", ["python", "-c", "2"], {}]], tree) != h3
    (tree / "t.py").unlink()
    with pytest.raises(FileNotFoundError, match="t.py"):
        gpu_ledger.source_hash("a", [], tree)


def _summary(stages):
    return {"date": "2026-11-27", "device": "fake GPU", "torch": "2.11", "cuda": "13.0", "cudnn": 91900,
            "fa4": None, "stages": stages}


def test_record_writes_what_ran_and_refuses_other_code():
    ran = {"stage": "a", "result": "PASS", "source_hash": "h1", "seconds": 3.0,
           "parts": [{"part": "p", "status": "PASS"}]}
    skipped = {"stage": "b", "result": "NOT RUN", "source_hash": "h2", "seconds": 0, "parts": []}
    old = {"b": {"result": "PASS", "source_hash": "h0"}}
    new = gpu_ledger.record(old, _summary([ran, skipped]), {"a": "h1"}, "c0ffee", {"a": []})
    assert new["a"] == {"commit": "c0ffee", "source_hash": "h1", "date": "2026-11-27", "device": "fake GPU",
                        "torch": "2.11", "cuda": "13.0", "cudnn": 91900, "fa4": None, "result": "PASS",
                        "seconds": 3.0, "parts": {"p": "PASS"}}
    assert new["b"] == old["b"]  # a stage that did not run keeps its entry
    with pytest.raises(ValueError, match="'a' ran on other code"):
        gpu_ledger.record(old, _summary([ran]), {"a": "h9"}, "c0ffee", {"a": []})
    with pytest.raises(ValueError, match="'a' covers uncommitted files"):
        gpu_ledger.record(old, _summary([ran]), {"a": "h1"}, "c0ffee", {"a": ["lib/x.py"]})


def test_every_stage_of_the_pass_covers_existing_files_and_hashes():
    for stage in gpu_check.PASS_ORDER:
        assert len(gpu_check.stage_hash(stage)) == 64
    assert set(gpu_check.PASS_ORDER) <= set(gpu_ledger.COVERS)


def _fake_stages(py):
    return lambda scratch: {
        "default": [("ok", [py, "-c", "print('fine')"], {}), ("bad", [py, "-c", "raise SystemExit(3)"], {})],
        "memory": [("offload", [py, "-c", "pass"], {}), ("row_65536", [py, "-c", "pass"], {}),
                   ("row_131072", [py, "-c", "raise SystemExit('torch.OutOfMemoryError: CUDA out of memory')"], {}),
                   ("row_262144", [py, "-c", "pass"], {})],
        "slow": [("sleepy", [py, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                             "'import os, time; open(os.environ[\"CHILD\"], \"w\").write(str(os.getpid())); "
                             "time.sleep(60)']); time.sleep(60)"], {}),
                 ("after", [py, "-c", "pass"], {})],
    }


def test_a_stage_result_from_its_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "stages", _fake_stages(sys.executable))
    with open(tmp_path / "log", "w") as log:
        far = time.monotonic() + 300
        default = gpu_check.run_stage("default", tmp_path, far, log, tmp_path / "trace")
        assert [p["status"] for p in default["parts"]] == ["PASS", "FAIL (exit 3)"]
        assert default["result"] == "FAIL" and default["parts"][0]["tail"] == ["fine"]
        (tmp_path / "m").mkdir()
        memory = gpu_check.run_stage("memory", tmp_path / "m", far, log, tmp_path / "trace")
        # the first length that runs out of memory ends the row, and the stage passes
        assert [p["status"] for p in memory["parts"]] == ["PASS", "PASS", "OOM"] and memory["result"] == "PASS"
        # the budget ends a part: STOPPED, its stage INCOMPLETE, its spawned child gone with it
        monkeypatch.setenv("CHILD", str(tmp_path / "child_pid"))
        monkeypatch.setattr(gpu_check, "MIN_START_S", 1)
        slow = gpu_check.run_stage("slow", tmp_path, time.monotonic() + 3, log, tmp_path)
        assert [p["status"] for p in slow["parts"]] == ["STOPPED (budget spent)", "NOT RUN (budget spent)"]
        assert slow["result"] == "INCOMPLETE"
        child = int((tmp_path / "child_pid").read_text())
        with pytest.raises(ProcessLookupError):
            for _ in range(50):  # the SIGTERM reaches it at once; allow for the reaping
                os.kill(child, 0)
                time.sleep(0.1)
        # a part over its cap fails
        monkeypatch.setitem(gpu_check.PART_CAP_S, "sleepy", 1)
        capped = gpu_check.run_stage("slow", tmp_path, far, log, tmp_path)
        assert capped["parts"][0]["status"] == "FAIL (over its 1 s cap)" and capped["result"] == "FAIL"
    assert "[" in (tmp_path / "log").read_text().split("===== ok")[1].splitlines()[1]  # lines carry their time


def test_pass_dry_run_follows_the_ledger(tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    h = gpu_check.stage_hash("default")
    ledger.write_text(json.dumps({"default": {"commit": "c0ffee1234", "source_hash": h, "date": "2026-11-27",
                                              "device": "fake GPU", "result": "PASS"}}))
    assert gpu_check.main(["pass", "--dry-run", "--ledger", str(ledger), "--only", "default", "memory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["default", "passed", "on", "this"] and "c0ffee1234" in out[0]
    assert out[1].split()[:2] == ["memory", "PENDING"] and len(out) == 2
