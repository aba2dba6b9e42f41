"""The package's commands (cp-train, cp-generate) run for the tests as a user runs them, without a new interpreter
per run: each run is a fork of one server process per test worker that imported the commands, torch and
transformers once.

A run gets its argv, the environment (``PYTHONPATH`` entries put on ``sys.path``, as an interpreter's start would),
the caller's working directory and umask, stdout and stderr captured, and its exit status (``main``'s return value, a
``SystemExit``'s code, 1 with the traceback for an exception): what ``python -m cp_handler.cli.train ARGS`` gives,
less the interpreter's start (about 1.9 of a 2-rank launch's 4.8 core-seconds on this project's 2-core VM,
measured: python, torch and cp_handler imported). The command forks its ranks from a fork of itself made before
any thread starts (a fresh process: ``cp_handler.runtime.forking.fresh_process``). Tests of the interpreter's own entry
point (``python -m``, torchrun) use :mod:`subprocess` (test_cli.py's ``cp_train_process``).

A run that outlives ``timeout`` is killed with its process group (its ranks included) and raises
``subprocess.TimeoutExpired``, as ``subprocess.run`` does.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.connection import Client, Listener

from cp_handler.runtime.forking import freeze_inherited_objects, fresh_process

PRELOAD = ("torch", "torch.distributed", "cp_handler.cli.train", "cp_handler.cli.generate", "cp_handler.training.run",
           "cp_handler.cli.generate_rank", "transformers", "transformers.modeling_utils",
           "cp_handler.integrations.transformers", "torch._dynamo")
"""What the server imports once (everything a command imports before its ranks start)."""

_server: tuple | None = None  # (process, connection) of this test worker's server


def _run_child(module: str, argv: list[str], env: dict, cwd: str, umask: int, out: str, err: str) -> None:
    """In the forked child: become the command's process, run it, exit with its status (never returns)."""
    code = 1
    try:
        freeze_inherited_objects()  # no garbage collection copies the server's heap
        os.setpgid(0, 0)  # the command and its ranks: one group, killed together on a timeout
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(cwd)
        os.umask(umask)
        os.environ.clear()
        os.environ.update(env)
        for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        sys.argv = [module, *argv]
        try:
            command = importlib.import_module(module)
            fresh_process()  # a fork of the server, which computed nothing: the command may fork its ranks
            result = command.main(argv)
            code = 0 if result is None else int(result)
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - reported as an interpreter would, exit status 1
            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(address: str) -> None:
    """The server (its own interpreter, :func:`_connection`): connects to ``address``, imports :data:`PRELOAD` once,
    then one fork per request; answers the child's pid at once and its exit status when it ends."""
    connection = Client(address, family="AF_UNIX")
    for name in PRELOAD:
        importlib.import_module(name)
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the test worker ended
            return
        pid = os.fork()
        if pid == 0:
            connection.close()
            _run_child(*request)
        connection.send(pid)
        _, status = os.waitpid(pid, 0)
        connection.send(os.waitstatus_to_exitcode(status))


def _connection():
    global _server
    if _server is None or _server[0].poll() is not None:
        folder = tempfile.mkdtemp(prefix="cp-commands-")
        address = os.path.join(folder, "socket")
        with Listener(address, family="AF_UNIX") as listener:
            code = f"import sys; sys.path[:0] = {sys.path!r}; import commands; commands.serve({address!r})"
            process = subprocess.Popen([sys.executable, "-c", code])
            connection = listener.accept()
        atexit.register(process.kill)
        _server = (process, connection)
    return _server[1]


def run(module: str, argv: list[str], env: dict | None = None, timeout: float | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -m module *argv`` with ``env`` (the whole environment; default this process's), as
    :func:`subprocess.run` with ``capture_output=True, text=True`` returns it; raises ``subprocess.TimeoutExpired``
    after ``timeout`` seconds (the run and its ranks killed)."""
    connection = _connection()
    with tempfile.TemporaryDirectory(prefix="cp-command-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for path in (out, err):
            open(path, "w").close()
        umask = os.umask(0)
        os.umask(umask)
        connection.send((module, list(argv), dict(os.environ if env is None else env), cwd or os.getcwd(), umask,
                         out, err))
        pid = connection.recv()
        if not connection.poll(timeout):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            connection.recv()  # the server reaps it
            raise subprocess.TimeoutExpired([module, *argv], timeout, output=open(out).read(),
                                            stderr=open(err).read())
        code = connection.recv()
        return subprocess.CompletedProcess([module, *argv], code, open(out).read(), open(err).read())
