"""The README's two commands' set-up (issue 50): make train asks for the main job's packages only (torch and the
package) and saves a checkpoint, make test and make lint for the test extra; scripts/setup.sh installs nothing when
this checkout's install and the requirements are there, and names what is missing."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("make") is None, reason="no make here")
def test_make_train_installs_the_main_job_only_and_saves_a_checkpoint():
    """make train asks scripts/setup.sh for torch and the package (``main``), never the test stack; make test and
    make lint ask for the test extra; make train saves its final checkpoint."""
    def commands(target, *extra):
        done = subprocess.run(["make", "-n", "-C", str(ROOT), target, *extra], capture_output=True, text=True,
                              timeout=HANG_GUARD_S)
        assert done.returncode == 0, done.stderr
        return done.stdout

    train = commands("train")
    assert "scripts/setup.sh main" in train and "--save runs/train_ckpt" in train
    assert not re.search(r"setup\.sh test|\[(dev|test)\]|pytest", train), train
    assert "setup.sh test" in commands("test") and "setup.sh test" in commands("lint")
    assert ".venv/bin/python -m cp_handler.cli.train" in commands("train", "VENV=.venv")


def _fake_site(tmp_path, packages: dict[str, str], cp_handler_from: str, scripts: dict[str, str] | None = None):
    """A site folder of dist-info metadata only: ``packages`` (name -> version) and cp_handler installed editable
    from ``cp_handler_from`` with the console ``scripts`` (default: pyproject.toml's)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (scripts/setup.sh reads pyproject.toml with it too)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    for name, version in {**packages, "cp_handler": project["version"]}.items():
        info = site / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    info = site / f"cp_handler-{project['version']}.dist-info"
    (info / "direct_url.json").write_text(json.dumps({"url": Path(cp_handler_from).as_uri(),
                                                      "dir_info": {"editable": True}}))
    lines = [f"{k} = {v}" for k, v in (project["scripts"] if scripts is None else scripts).items()]
    (info / "entry_points.txt").write_text("[console_scripts]\n" + "\n".join(lines) + "\n")
    import pip

    (site / "pip").symlink_to(Path(pip.__file__).parent)  # packaging, as pip vendors it
    return site


def _check(tmp_path, site, what):
    """``scripts/setup.sh --check WHAT`` with a Python that sees only ``site`` and this checkout (``-S``)."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site}:{ROOT} exec {sys.executable} -S \"$@\"\n")
    python.chmod(0o755)
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--check", what], capture_output=True,
                          text=True, env={**os.environ, "PYTHON": str(python), "VENV": ""}, timeout=HANG_GUARD_S)


def test_setup_installs_nothing_when_everything_is_there_and_names_what_is_missing(tmp_path):
    """scripts/setup.sh's check: the package editable from this checkout and pyproject.toml's requirements
    installed is "there" (make train / make test then install nothing); another checkout's install, a missing or
    too old package, another extra's packages, other commands are each named."""
    main = {"torch": "2.13.0", "einops": "0.8.1", "tqdm": "4.67.1", "numpy": "2.4.6"}
    done = _check(tmp_path / "a", _fake_site(tmp_path / "a", main, str(ROOT)), "main")
    assert done.returncode == 0 and "main is installed" in done.stderr and "nothing to do" in done.stderr, done.stderr
    done = _check(tmp_path / "b", _fake_site(tmp_path / "b", main, str(ROOT)), "test")
    assert done.returncode == 1 and "setup: missing: pytest is not installed (pytest>=8)" in done.stderr, done.stderr
    assert "transformers is not installed" in done.stderr and "trl is not installed" in done.stderr
    done = _check(tmp_path / "c", _fake_site(tmp_path / "c", {**main, "torch": "2.9.1"}, "/elsewhere/main"), "main")
    assert done.returncode == 1, done.stderr
    assert "cp_handler is installed from /elsewhere/main, not editable from this checkout" in done.stderr
    assert "torch 2.9.1 is installed, torch>=2.10 is needed" in done.stderr
    without_einops = {k: v for k, v in main.items() if k != "einops"}
    done = _check(tmp_path / "d", _fake_site(tmp_path / "d", without_einops, str(ROOT),
                                             {"cp-train": "cp_handler.cli.train:main"}), "main")
    assert done.returncode == 1 and "einops is not installed" in done.stderr, done.stderr
    assert "the installed commands ['cp-train'] are not pyproject.toml's" in done.stderr
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "dev"], capture_output=True, text=True,
                          timeout=HANG_GUARD_S)
    assert done.returncode == 2 and "unknown target 'dev': main" in done.stderr
