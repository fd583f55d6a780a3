"""Where hosts come from: a launcher starts a host's agent, which then dials in to the controller.

The controller only knows the :class:`Launcher` interface; which one a job uses is its config's
``launcher``:

* :class:`LocalLauncher` (the embedded default): each agent is a child process of the controller
  on this machine, started with ``python -m runtime.agent`` and its boot settings (the secret
  among them) on stdin.
* ``runtime.launchers.netns.NetnsLauncher``: each host is a Linux network namespace with its own
address
  on a bridge, for testing multi-host behaviour (partitions, delay, loss) on one machine.
* :class:`ExternalLauncher`: agents are started by someone else (by hand, a scheduler) with
  ``ftharness agent --controller HOST:PORT --secret-file PATH --name NAME``; the controller only
  waits for them to dial in.

``kill`` is the out-of-band way to take a whole host down at once (what a scheduler's cancel or
a power-off does): a launcher that cannot do it says so by returning False, and the agent's own
fencing (it stops its workers when the controller has been silent too long) and the quorum's
incarnation fencing are then what keep a lost host from training on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import psutil

from runtime import proctree


class Launcher(Protocol):
    def start(self, name: str, boot: Mapping[str, Any]) -> None:
        """Start host ``name``'s agent with these boot settings (see ``runtime.agent.Boot``);
        return at once: the agent dials in when it is up."""
        ...

    def kill(self, name: str) -> bool:
        """Take the whole host down now (the agent and everything under it); False if this
        launcher cannot reach it."""
        ...

    def stop(self, name: str, timeout_s: float) -> None:
        """After the agent was told to shut down: wait up to ``timeout_s``, then kill."""
        ...

    def close(self) -> None: ...


class ChildAgents:
    """Base of the launchers whose agents are child processes of the controller (the agent
    itself, or the ``srun`` that runs it on its node): each host's newest agent by name
    (``procs``), and ``stop``, which waits for it and then forces it down the launcher's way
    (:meth:`_force_stop`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.procs: dict[str, subprocess.Popen] = {}

    def _track(self, name: str, popen: subprocess.Popen) -> None:
        """``popen`` is now host ``name``'s agent; a previous one is reaped if it has exited."""
        with self._lock:
            old = self.procs.get(name)
            self.procs[name] = popen
        if old is not None:
            old.poll()

    def _proc(self, name: str) -> subprocess.Popen | None:
        with self._lock:
            return self.procs.get(name)

    def stop(self, name: str, timeout_s: float) -> None:
        """After the agent was told to shut down: wait up to ``timeout_s`` for it to exit, then
        force it (:meth:`_force_stop`). A host this launcher never started: nothing."""
        popen = self._proc(name)
        if popen is None:
            return
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._force_stop(name, popen)

    def _force_stop(self, name: str, popen: subprocess.Popen) -> None:
        """End host ``name``'s agent that did not exit when told to."""
        raise NotImplementedError


class LocalLauncher(ChildAgents):
    """Agents as child processes of the controller (which must call ``start`` from a thread
    that lives as long as the job: the agent dies with it, PR_SET_PDEATHSIG).

    Unless the boot settings turn survival on (``control_file`` and ``grace_s`` > 0: a
    controller that can be replaced, ``runtime.orphan``): the agent then neither dies with the
    controller nor shares its session (a terminal's Ctrl-C or hang-up is the controller's to
    handle). Agents a takeover controller inherited are not its children: :meth:`adopt` them,
    and ``kill``, ``stop`` and ``close`` reach them by pid."""

    def __init__(self, wrap: list[str] | None = None) -> None:
        super().__init__()
        self._wrap = list(wrap or [])  # a command prefix, e.g. ``ip netns exec NS``
        self.adopted: dict[str, psutil.Process] = {}

    def command(self, name: str) -> list[str]:
        return [*self._wrap, sys.executable, "-m", "runtime.agent"]

    def start(self, name: str, boot: Mapping[str, Any]) -> None:
        survive = bool(boot.get("control_file")) and float(boot.get("grace_s", 0.0)) > 0
        settings = dict(boot) if survive else {**boot, "parent_pid": os.getpid()}
        popen = subprocess.Popen(
            self.command(name), stdin=subprocess.PIPE, cwd=os.getcwd(), start_new_session=survive
        )
        assert popen.stdin is not None
        popen.stdin.write((json.dumps(settings) + "\n").encode())
        popen.stdin.close()
        with self._lock:
            self.adopted.pop(name, None)
        self._track(name, popen)

    def adopt(self, name: str, pid: int) -> None:
        """Host ``name``'s agent is the running process ``pid``, started by a controller this
        one took over from."""
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            return  # gone already: its host is lost, and nothing is left to stop
        with self._lock:
            self.adopted[name] = proc
            self.procs.pop(name, None)

    def _adopted(self, name: str) -> psutil.Process | None:
        with self._lock:
            proc = self.adopted.get(name)
        return proc if proc is not None and proc.is_running() else None

    def kill(self, name: str) -> bool:
        adopted = self._adopted(name)
        if adopted is not None:
            proctree.signal_all(proctree.tree(adopted.pid), signal.SIGKILL)
            return True
        popen = self._proc(name)
        if popen is None:
            return False
        proctree.signal_all(proctree.tree(popen.pid), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(timeout=2.0)  # reap it: no zombie agent for the rest of the run
        return True

    def stop(self, name: str, timeout_s: float) -> None:
        adopted = self._adopted(name)
        if adopted is None:
            super().stop(name, timeout_s)
            return
        _, alive = psutil.wait_procs([adopted], timeout=timeout_s)
        if alive:
            proctree.terminate_tree(adopted.pid, 0.5)

    def _force_stop(self, name: str, popen: subprocess.Popen) -> None:
        proctree.terminate_tree(popen.pid, 0.5)
        popen.wait(timeout=5.0)

    def close(self) -> None:
        with self._lock:
            procs = list(self.procs.values())
            adopted = list(self.adopted.values())
        for popen in procs:
            if popen.poll() is None:
                proctree.terminate_tree(popen.pid, 0.5)
        for proc in adopted:
            if proc.is_running():
                proctree.terminate_tree(proc.pid, 0.5)


class ExternalLauncher:
    """Agents started elsewhere: nothing to start, nothing this process can kill."""

    def start(self, name: str, boot: Mapping[str, Any]) -> None:
        return None

    def kill(self, name: str) -> bool:
        return False

    def stop(self, name: str, timeout_s: float) -> None:
        return None

    def close(self) -> None:
        return None
