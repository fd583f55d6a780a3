"""A program of the user's own, started by its host agent as a plain proctree.

Unlike a worker (``runtime.worker``) it is not forked from the agent's preloaded interpreter,
has no control connection and sends no heartbeat: it is ``argv`` exec'd as is, with the
agent's environment plus the launcher environment the controller chose, stdout and stderr to
its per-rank log, in a session of its own (so a stop reaches its whole process group and a
terminal's ^C does not), tied to the agent by PR_SET_PDEATHSIG. The agent reaps it like any
worker (``waitpid`` on SIGCHLD), so its exit, a signal or a core dump reach the controller as
the same ``Exited`` value. Its liveness is its training progress, watched by the controller
(``harness.job.program.groups``), not here.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import subprocess
import sys
import traceback
from typing import Any

from runtime import proctree
from runtime.messages import SpawnProgram

#: ``argv[0]`` values that mean "this interpreter" (the one the agent runs, which has torch).
PYTHON_NAMES = ("python", "python3")
#: The exit status reported for a program that could not be started (the shell's 127).
NOT_STARTED = 127 << 8


def program_argv(argv: tuple[str, ...]) -> list[str]:
    """``argv`` with ``python`` replaced by this interpreter."""
    out = list(argv)
    if out and out[0] in PYTHON_NAMES:
        out[0] = sys.executable
    return out


def start_program(msg: SpawnProgram, extra_env: dict[str, str]) -> subprocess.Popen:
    """Start ``msg``'s program; raises OSError if it cannot be (the caller logs and reports
    it). Call from the agent's only thread (``preexec_fn`` runs between fork and exec)."""
    env = {**os.environ, **extra_env, **msg.env}
    agent_pid = os.getpid()
    log = open(msg.log_path, "ab") if msg.log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(
            program_argv(msg.argv),
            env=env,
            cwd=msg.cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            preexec_fn=lambda: _child_setup(agent_pid),
        )
    finally:
        if not isinstance(log, int):  # an opened log file, not subprocess.DEVNULL
            log.close()


def fork_program(msg: SpawnProgram, extra_env: dict[str, str], close: list[int]) -> int:
    """Start ``msg``'s ``python SCRIPT ...`` or ``python -m MODULE ...`` as a fork of this
    (the agent's) interpreter, torch and the other preloads already imported, the way a warm
    worker starts. Returns the pid. ``close``: the agent's descriptors the child must not keep.

    What a warm rank sees differently from a cold start (the same argv, environment, cwd, pid
    parent, signal dispositions, stdin from /dev/null and stdout/stderr to its log; buffered as
    a fresh interpreter's, unbuffered with ``PYTHONUNBUFFERED``):

    * ``sys.modules`` holds what the agent imported (torch, its preloads, ftharness's runtime),
      so environment variables read at import (torch's thread counts, ``PYTHON*`` start-up
      options) are the agent's (``harness.program_config.cold_reason`` starts such a program
      cold unless told otherwise; the launcher's ``OMP_NUM_THREADS`` is applied by hand), and
      module-level state of those modules is shared with nothing but was set up by the agent;
    * ``sys.path`` is the script's directory (``-m``: the cwd) and ``PYTHONPATH``, put first
      by hand, then the agent's path (which can reach ftharness);
    * ``sys.orig_argv`` is ``program.command`` with this interpreter; ``sys.argv[0]`` is the
      script (``-m``: the module's file), as in a fresh interpreter;
    * ftharness's hooks (``$FTHARNESS_SITE``: its address patch, and the fault hook with
      ``program.hooks``) are run explicitly (no interpreter start-up runs ``sitecustomize``),
      and no other ``sitecustomize``/``usercustomize`` or ``.pth`` file of the program's
      ``PYTHONPATH`` is run."""
    agent_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        _child_setup(agent_pid)
        # What a fresh interpreter's start-up sets: Python ignores SIGPIPE (a write to a closed
        # socket raises instead), so a peer's death must not kill this rank with SIGPIPE.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # as a cold start's stdin (the agent's may carry its boot settings)
        fd = (
            os.open(msg.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            if msg.log_path
            else null
        )
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if fd != null:
            os.close(null)
        _fresh_stdio(bool({**extra_env, **msg.env}.get("PYTHONUNBUFFERED")))
        code = _run_warm(msg, extra_env)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fresh_stdio(unbuffered: bool) -> None:
    """New ``sys.std*`` objects on descriptors 0-2, as a fresh interpreter would make them
    (the agent's may hold buffered output of its own)."""
    import io

    encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"  # the interpreter's choice

    def text(fd: int, mode: str, buffered: bool) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        binary: Any = (
            (io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)) if buffered else raw
        )
        return io.TextIOWrapper(
            binary,
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=fd == 2,
            write_through=not buffered,
        )

    sys.stdin = text(0, "r", True)
    sys.stdout = text(1, "w", not unbuffered)
    sys.stderr = text(2, "w", not unbuffered)


def _run_warm(msg: SpawnProgram, extra_env: dict[str, str]) -> int:
    sys.orig_argv = program_argv(msg.argv)
    os.environ.update({**extra_env, **msg.env})
    threads = msg.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        # read by torch when it was imported (by the agent): applied by hand, as a fresh
        # interpreter would have read it (torchrun sets 1 for several ranks: program_env)
        sys.modules["torch"].set_num_threads(int(threads))
    if msg.cwd:
        os.chdir(msg.cwd)
    extra_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    args = list(msg.argv[1:])
    if args[:1] == ["-m"]:
        sys.argv = [args[1], *args[2:]]
        sys.path[:0] = [*extra_path, os.getcwd()]
        _run_hook(extra_path)
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[:0] = [*extra_path, os.path.dirname(os.path.abspath(args[0]))]
        _run_hook(extra_path)
        runpy.run_path(args[0], run_name="__main__")
    return 0


def _run_hook(paths: list[str]) -> None:
    """What interpreter start-up would have done with ftharness's hooks on PYTHONPATH: the
    ``sitecustomize`` of each directory ``$FTHARNESS_SITE`` names that is on it, in order (at a
    cold start each runs the next itself; here none runs another: ``FTHARNESS_CHAIN``)."""
    for d in os.environ.get("FTHARNESS_SITE", "").split(os.pathsep):
        hook = os.path.join(d, "sitecustomize.py")
        if d and d in paths and os.path.isfile(hook):
            runpy.run_path(hook, {"FTHARNESS_CHAIN": False}, run_name="sitecustomize")


def _child_setup(agent_pid: int) -> None:
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    proctree.die_with_parent(agent_pid)


def log_not_started(msg: SpawnProgram, exc: OSError) -> None:
    """Say in the program's log why it never ran (the console shows the log's tail)."""
    if not msg.log_path:
        return
    with contextlib.suppress(OSError), open(msg.log_path, "a", encoding="utf-8") as f:
        f.write(f"ftharness: could not start {list(msg.argv)} in {msg.cwd or os.getcwd()}: {exc}\n")
