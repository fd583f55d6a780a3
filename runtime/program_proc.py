"""A program of the user's own, started by its host agent as a plain process.

Unlike a worker (``runtime.worker``) it is not forked from the agent's preloaded interpreter,
has no control connection and sends no heartbeat: it is ``argv`` exec'd as is, with the
agent's environment plus the launcher environment the controller chose, stdout and stderr to
its per-rank log, in a session of its own (so a stop reaches its whole process group and a
terminal's ^C does not), tied to the agent by PR_SET_PDEATHSIG. The agent reaps it like any
worker (``waitpid`` on SIGCHLD), so its exit, a signal or a core dump reach the controller as
the same ``Exited`` value. Its liveness is its training progress, watched by the controller
(``harness.program``), not here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from runtime import process
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
        if log is not subprocess.DEVNULL:
            log.close()


def _child_setup(agent_pid: int) -> None:
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    process.die_with_parent(agent_pid)


def log_not_started(msg: SpawnProgram, exc: OSError) -> None:
    """Say in the program's log why it never ran (the console shows the log's tail)."""
    if not msg.log_path:
        return
    with open(msg.log_path, "a", encoding="utf-8") as f:
        f.write(f"ftharness: could not start {list(msg.argv)} in {msg.cwd or os.getcwd()}: {exc}\n")
