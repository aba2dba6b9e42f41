"""What a user installs (issue 67): a built wheel holds every module and the cost profiles of the checkout, and every
install hint in an error works from where the user stands (the package is on no public index)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import HANG_GUARD_S

from cp_handler.core.install_hint import extra_hint, extra_requirements

ROOT = Path(__file__).resolve().parent.parent


def test_a_built_wheel_holds_every_module_and_profile(tmp_path):
    """``pip wheel .`` (what ``pip install .`` and ``python -m build`` build) packs every file of the package that git
    tracks: modules, the measured cost profiles "auto" loads (a missing package-data rule once dropped them) and the
    rank times the dynamic-CP benchmark fits; unpacked away from the checkout, it loads them and trains."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path),
                           str(ROOT)], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    wheel, = tmp_path.glob("cp_handler-*.whl")
    packed = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "cp_handler"], capture_output=True, text=True,
                             check=True).stdout.split()
    wanted = {f for f in tracked if f.endswith((".py", ".json", ".csv"))}
    assert any(f.startswith("cp_handler/auto/profiles/") for f in wanted)
    assert wanted <= packed, sorted(wanted - packed)

    # The wheel runs on its own, away from the checkout: unpacked (what pip install does with it) and first on the
    # path, it finds its profiles and data and trains a step of the reference GPT at cp 2 against one process.
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = """
import cp_handler, torch
from pathlib import Path
assert Path(cp_handler.__file__).is_relative_to(Path(SITE)), cp_handler.__file__
from cp_handler.auto.catalog import default_profile
from cp_handler.bench.dynamic_cp import RANK_TIMES
from cp_handler.dynamic import CostModel
assert default_profile("cpu").name == "cpu-2core-gloo"
CostModel.from_rank_times_csv(RANK_TIMES)
"""
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    done = subprocess.run([sys.executable, "-P", "-c", f"SITE = {str(unpacked)!r}\n{probe}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    train = ["--nproc", "2", "--cp-size", "2", "--steps", "1", "--seq-len", "64", "--num-layers", "1",
             "--max-corpus-bytes", "200000", "--check-parity"]
    done = subprocess.run([sys.executable, "-P", "-m", "cp_handler.cli.train", *train], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0 and "parity passed" in done.stderr, done.stderr[-3000:]


def test_install_hints_name_the_packages_and_this_checkout():
    """An extra's hint names its requirements (installable from any index) and, run from this checkout, the editable
    install of the extra from it; an extra's other extras are expanded."""
    assert extra_requirements("bench") == ["matplotlib>=3.7"]
    hint = extra_hint("bench")
    assert hint.startswith("pip install 'matplotlib>=3.7' (cp_handler's bench extra") and \
        f"pip install -e '{ROOT}[bench]'" in hint, hint
    assert "cp_handler[" not in hint.split("from its checkout")[0]
    assert extra_requirements("nothing-such") == []
