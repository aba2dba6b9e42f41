"""How cp_handler.runtime.launch starts ranks on a machine without CUDA (cp_handler.runtime.forking): forked from a
fork of a command that declared itself fresh (run as a command: ``main()`` without ``argv``) and started no thread
since, made before torch elastic's threads start; else from the fork server. A rank forked from a process that
computed (its OpenMP pool started) would inherit that pool broken and hang: a test that called ``cp-train``'s
``main(argv)`` in the pytest process once made every later in-process launch fork from it, and a rank hung
(2026-12-05)."""

import os
import threading
from pathlib import Path

import pytest

from cp_handler.runtime import forking

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def not_fresh(monkeypatch):
    monkeypatch.setattr(forking, "_fork_baseline", None)
    monkeypatch.setattr(forking.torch.cuda, "is_available", lambda: False)


def test_only_a_fresh_process_without_new_threads_forks(not_fresh):
    assert forking.start_method() == "forkserver"  # never declared fresh
    forking.fresh_process()
    assert forking.start_method() == "fork"
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert forking.start_method() == "forkserver"  # a thread started since
    finally:
        release.set()
        thread.join()
    forking.fresh_process()  # (the ended thread's task may linger in /proc for a moment)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process forked from the fresh one (a rank) is not fresh
        os.write(write, forking.start_method().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 32) == b"forkserver"


def test_main_given_argv_does_not_declare_the_caller_fresh(not_fresh, monkeypatch):
    import cp_handler.cli.train as train_cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train_cli, "run_training", lambda config: {"steps": [{"loss": 1.0}], "tokens_per_s_mean": 1.0})
    assert train_cli.main(["--steps", "1"]) == 0
    assert forking.start_method() == "forkserver"


RANK_PARENT = """
import os, sys
from cp_handler.runtime import forking, launch

def rank():
    parent = os.getppid()
    return parent, len(os.listdir(f"/proc/{parent}/task"))

if __name__ == "__main__":
    forking.fresh_process()
    got = launch.launch(rank, 2)
    print(os.getpid(), *(got[r][i] for r in (0, 1) for i in (0, 1)))
"""


def test_ranks_are_forked_from_a_process_that_runs_no_thread(tmp_path):
    """A fresh command's ranks are forked from a fork of it made before any thread started, never from the command
    itself once torch elastic's agent runs threads (its store's server, a keep-alive timer, the watchdog): a rank
    forked beside them can inherit a lock one of them held (ranks so forked hung in ``init_process_group``,
    2026-12-06). The ranks' parent is one process, not the launcher, and runs one thread."""
    import subprocess
    import sys

    from conftest import HANG_GUARD_S

    script = tmp_path / "ranks.py"
    script.write_text(RANK_PARENT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_GUARD_S,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    launcher, parent0, threads0, parent1, threads1 = map(int, done.stdout.split())
    assert parent0 == parent1 != launcher and threads0 == threads1 == 1, done.stdout


SERVED_MODULES = """
import multiprocessing, sys
sys.path.insert(0, sys.argv[1])  # a folder this process added, as a script's own or a test suite's
from cp_handler.runtime import forking

if __name__ == "__main__":
    forking.start_fork_server(["torch", "helper_of_the_script"])
    child = multiprocessing.get_context("forkserver").Process(
        target=exec, args=("import sys; print('helper_of_the_script' in sys.modules, 'torch' in sys.modules)",))
    child.start()
    child.join()
"""


def test_the_fork_server_preloads_modules_found_through_folders_the_process_added(tmp_path):
    """Python 3.11's fork server ignores the import path it is handed: a preloaded module from a folder the process
    added to ``sys.path`` was skipped silently, and every rank imported it again (the suite's own helpers did, in
    every rank, until 2026-12-06). The child runs a builtin, so it imports nothing itself: what it has, the server
    had."""
    import subprocess
    import sys

    from conftest import HANG_GUARD_S

    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "helper_of_the_script.py").write_text("")
    script = tmp_path / "serve.py"
    script.write_text(SERVED_MODULES)
    done = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"], done.stdout + done.stderr[-2000:]
