"""Suite-wide settings: the suite's one hypothesis settings profile, loaded here for the pytest process
and by every spawned rank (:mod:`dist_utils` calls :func:`load`), so a property test runs under the same
rules in both.

* ``deadline=None``: no example may fail because the machine is slow (the suite runs on 2 loaded
  cores; a 458 ms example once failed the 200 ms default deadline). Wall-clock limits belong in
  benchmarks, never in correctness tests.
* ``derandomize=True`` under ``CI=true``: CI draws the same examples on every run, so a red CI run
  is reproducible with ``CI=true pytest``; locally examples vary from run to run and explore more.
* ``database=None``: no ``.hypothesis`` folder written into a clone.
* example counts: hypothesis' default (100) unless a test states its own (``@settings(max_examples=...)``
  inherits everything else from this profile).
* threads: a pytest-xdist worker computes on its share of the cores (``torch.set_num_threads``: 1 each with
  ``make test``'s 2 workers on 2 cores), as the ranks do (1 each): two workers each running OpenMP pools as wide
  as the machine oversubscribe it, their threads spinning while the other worker's hold the cores.
* order: the files that take longest (:data:`LONGEST_FIRST`) are collected first; ``make test`` runs
  ``--dist loadfile --no-loadscope-reorder``, so pytest-xdist hands them out first and a long file does not start
  last, leaving one worker alone at the end (xdist's own reorder sorts by test count, not time).
* ranks: each worker starts its fork server at its start (:func:`dist_utils.start_fork_server`), with every module
  the suite's ranks import, whichever test starts ranks first.
* :data:`HANG_GUARD_S`: the one wall-clock limit a test may put on a subprocess or a collective, a hang guard
  only (a loaded 2-core machine ran the suite 2.7x slower than idle, and a 400 s limit failed a correct test);
  pytest's own per-test limit (pyproject.toml) is above it, so a hung subprocess is killed with its output.
  ``tests/test_suite_rules.py`` holds every test file to it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE = "cp_handler"
HANG_GUARD_S = 1500
"""Seconds after which a subprocess or a collective of a test is taken to hang (see module doc)."""


def load() -> None:
    """Register (idempotent) and load the profile."""
    ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    settings.register_profile(PROFILE, deadline=None, derandomize=ci, database=None,
                              suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(PROFILE)


load()


LONGEST_FIRST = ("test_conformance.py", "test_deterministic_train.py", "test_deterministic_tiles.py", "test_cli.py",
                 "test_cli_hf.py", "test_hf_trainer.py", "test_compile.py", "test_hf_zoo.py", "test_bench.py",
                 "test_tensor_parallel.py", "test_examples.py", "test_hf_vlm.py", "test_hf_integration.py",
                 "test_deterministic.py")
"""The test files that took longest, longest first (``pytest --durations``, 2026-12-06: 342 s down to 52 s on two
loaded workers); every other file follows in collection order. Only the balance of the two workers depends on it."""


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


def pytest_configure(config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker (not the controller, which runs no test)
        import dist_utils

        dist_utils.start_fork_server()  # before any test: its modules, whichever test starts ranks first
