"""How cp_handler.runtime.launch starts ranks on a machine without CUDA: forked from a command that declared itself
fresh (run as a command: ``main()`` without ``argv``) and started no thread since; else from the fork server. A rank
forked from a process that computed (its OpenMP pool started) would inherit that pool broken and hang: a test that
called ``cp-train``'s ``main(argv)`` in the pytest process once made every later in-process launch fork from it, and
a rank hung (2026-12-05)."""

import os
import threading

import pytest

from cp_handler.runtime import launch


@pytest.fixture
def not_fresh(monkeypatch):
    monkeypatch.setattr(launch, "_fork_baseline", None)
    monkeypatch.setattr(launch.torch.cuda, "is_available", lambda: False)


def test_only_a_fresh_process_without_new_threads_forks(not_fresh):
    assert launch.start_method() == "forkserver"  # never declared fresh
    launch.fresh_process()
    assert launch.start_method() == "fork"
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert launch.start_method() == "forkserver"  # a thread started since
    finally:
        release.set()
        thread.join()
    launch.fresh_process()  # (the ended thread's task may linger in /proc for a moment)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a process forked from the fresh one (a rank) is not fresh
        os.write(write, launch.start_method().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 32) == b"forkserver"


def test_main_given_argv_does_not_declare_the_caller_fresh(not_fresh, monkeypatch):
    import cp_handler.cli.train as train_cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(train_cli, "run_training", lambda config: {"steps": [{"loss": 1.0}], "tokens_per_s_mean": 1.0})
    assert train_cli.main(["--steps", "1"]) == 0
    assert launch.start_method() == "forkserver"
