"""How ranks start without importing torch again: forked, from the launching command or from a preloaded server.

Start-up: on a machine without CUDA the ranks are forked, nothing imported again: from a fork of the command itself
made before any thread starts (:func:`fork_server_from_here`: that fork serves as multiprocessing's fork server)
when the command declared itself fresh (:func:`fresh_process`: cp-train, cp-generate and cp-bench run as commands,
which compute nothing before their ranks start; not a caller of their ``main(argv)``, nor a process forked from one)
and has started no thread since (no thread pool, OpenMP's included, that a forked rank would inherit broken), else
from one server process that imported torch and the entry point's module once (``forkserver`` with those modules
preloaded). Never from the launching process once torch elastic's agent runs: it starts threads before the ranks
(its store's server, a keep-alive timer), and a rank forked beside them can inherit a lock one of them held (ranks so
forked hung in ``init_process_group`` until ``--timeout``: three runs of one test session, 2026-12-06). ``spawn``
re-imports torch in every rank: 4 ranks on 2 cores started in 17-21 s with it, about 9 s from the fork server; a
fork of the command saves the server's start (about 1 core-second, 0.7 s of a 2-rank launch's 4.2 s, measured). Each
rank is still a new process. With CUDA the ranks are spawned (the start method GPU runs were made with).

The objects a forked process inherited are kept out of its garbage collections (:func:`freeze_inherited_objects`).
"""

from __future__ import annotations

import gc
import os
import socket

import torch


def freeze_inherited_objects() -> None:
    """In a process just forked from one that imported torch (a rank; a command forked from a server): move every
    object it inherited to the garbage collector's permanent generation (``gc.freeze()``, O(1)), where no collection
    visits it. A collection visits every tracked object and writes to its header, so in a fork it copies the whole
    inherited heap page by page (copy-on-write): ``gc.collect()`` took 0.43 s in each rank forked from a server that
    imported torch and transformers (363,000 objects), against 0.001 s after the freeze (2-core VM, 2026-12-06); a
    4-rank run of one collective ended in 0.13 s instead of 1.0 s. The inherited objects (modules, classes,
    functions) live as long as the process anyway; what the process creates after is collected as usual. The
    pattern is the one Python's documentation gives for ``gc.freeze`` before a fork."""
    gc.freeze()


def _thread_count() -> int:
    """The threads of this process (``/proc/self/task``; 0 where it cannot be read)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


_fork_baseline: tuple[int, int] | None = None
"""``(pid, threads)`` of the process that declared itself fresh (:func:`fresh_process`); ``None``: never forks."""


def fresh_process() -> None:
    """Declare this process fresh: a command started as one (``cp-train``, ``cp-generate``, ``cp-bench`` run as
    commands: their ``main`` called without ``argv``) that imported torch and computed nothing yet. :func:`launch`
    may then fork the ranks from it (:func:`start_method`). Only this process: a process forked from it (a rank) is
    not fresh, nor is a caller of ``main(argv)`` (a test, a script), which may have computed already."""
    global _fork_baseline
    _fork_baseline = (os.getpid(), _thread_count())


def start_method() -> str:
    """How :func:`launch` starts the ranks (module doc): ``"spawn"`` with CUDA; without it ``"fork"`` (from a fork of
    this process, :func:`fork_server_from_here`) for a command that declared itself fresh (:func:`fresh_process`) and
    has started no thread since (a thread pool, OpenMP's included, would be inherited broken), else ``"forkserver"``."""
    if torch.cuda.is_available():
        return "spawn"
    fresh = _fork_baseline is not None and _fork_baseline[0] == os.getpid() and \
        0 < _thread_count() <= _fork_baseline[1]
    return "fork" if fresh else "forkserver"


def start_fork_server(preload) -> None:
    """Start multiprocessing's fork server, unless one already serves this process, with the modules ``preload``
    (names) imported once, found on this process's import path. Python 3.11's server is handed that path
    (``forkserver.main``'s ``sys_path``) and never applies it: a preloaded module found through a folder this process
    added to ``sys.path`` (a script's own folder, a test suite's) failed to import in the server, silently (the
    server skips an ``ImportError``), and every rank imported it again (each of the test suite's ranks imported its
    helpers and, through them, torch's launcher: 2026-12-06's profile). The server gets the folders this process
    added (outside the interpreter's prefixes: the standard library and site-packages are its own already) through
    ``PYTHONPATH``, set for the moment it starts; the ranks it forks get their launcher's environment back (their
    entry points restore it). A server already running keeps the modules it started with."""
    import multiprocessing
    import multiprocessing.forkserver
    import sys

    multiprocessing.set_forkserver_preload(list(preload))
    installed = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    added = [p for p in sys.path if isinstance(p, str) and p and os.path.isdir(p)  # not the interpreter's own
             and not (os.path.realpath(p) + os.sep).startswith(installed)]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(added)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


RANK_IMPORTS = ("torch._dynamo",)
"""What cp-train and cp-generate ranks import besides their entry point: torch._dynamo (160 of the test suite's 205
ranks imported it, 1.4 s each on this project's loaded 2-core VM, timed 2026-12-05), imported once by the launching
process or the fork server instead (:func:`launch`'s ``preload``)."""
HF_RANK_IMPORTS = ("transformers", "transformers.modeling_utils", "cp_handler.integrations.transformers")
"""What a Hugging Face model's ranks import besides :data:`RANK_IMPORTS`, imported once the same way:
``transformers.modeling_utils`` (every model class's base; ``import transformers`` leaves it to the first model)
took 2.5 s per rank on this project's idle 2-core VM (2026-12-06) and starts no thread."""


def fork_server_from_here() -> bool:
    """Start multiprocessing's fork server as a fork of this process (module doc: its modules imported, no thread
    running), instead of a new interpreter that imports them again; ``True`` when it is (or one already serves this
    process). ``False`` where this Python's fork server keeps state this is not written against (Python 3.14 adds an
    authentication key): :func:`launch` then starts the usual one."""
    from multiprocessing import connection, forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    fields = ("_lock", "_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if server is None or hasattr(server, "_forkserver_authkey") or not all(hasattr(server, f) for f in fields):
        return False
    if server._forkserver_pid is not None:
        return True
    resource_tracker.ensure_running()
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # the server ends when this process (the only holder of alive_w) does
    pid = os.fork()  # no lock held (the server's own lock stays free in the fork: a rank may start processes)
    if pid == 0:  # the server: serves until alive_r reaches end of file, then exits
        code = 1
        try:
            os.close(alive_w)
            forkserver.main(listener.fileno(), alive_r, [])
            code = 0
        finally:
            os._exit(code)
    os.close(alive_r)
    listener.close()
    with server._lock:
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True
