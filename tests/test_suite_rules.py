"""The suite's own rules, checked over every test file: no wall-clock limit below the hang guard.

A correct test must not fail because the machine is slow (issue 39: a 400 s subprocess limit expired
on a loaded machine). Subprocesses and collectives take ``conftest.HANG_GUARD_S``; pytest's per-test limit
is above it. ``--timeout N`` flags given to cp-train / cp-generate are the product's own watchdog under
test, not limits on the test.
"""

import re
from pathlib import Path

import conftest

TESTS = Path(__file__).parent


def test_no_test_puts_a_wall_clock_limit_below_the_hang_guard():
    literal = re.compile(r"(?<![-\w])timeout\s*=\s*(\d+(?:\.\d+)?)")
    found = [f"{path.name}:{number}: timeout={match[1]}" for path in sorted(TESTS.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             for match in literal.finditer(line) if float(match[1]) < conftest.HANG_GUARD_S]
    assert not found, found
    addopts = (TESTS.parent / "pyproject.toml").read_text()
    assert int(re.search(r"--timeout=(\d+)", addopts)[1]) > conftest.HANG_GUARD_S
