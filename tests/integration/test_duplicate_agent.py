"""One agent per host name (issue #31, item 3).

Two real ``ftharness agent`` processes with the same ``--name``: the second is refused with the
reason, in one line, and exits non-zero, while the first keeps its host (no thread dies, the host
is never declared lost) -- whether the second dials in after the first is serving or while the
first is still being adopted (a scheduler's respawn racing the step before it). An agent whose
host was declared lost is replaced by a new one, and the old one is told at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import runtime_actors
from test_runtime import FAST, wait_for

from runtime.controller import Controller
from runtime.launchers import ExternalLauncher

#: Longer than the agent heartbeat timeout (2 s in FAST): a host wrongly left unserved would be
#: declared lost within it.
SETTLE_S = 3.5


def pause(seconds: float) -> None:
    """An agent's warmup (``ControllerSpec.warmup``): holds its adoption open this long."""
    time.sleep(seconds)


def _secret_file(tmp_path: Path, secret: bytes) -> Path:
    path = tmp_path / "job.secret"
    path.write_text(secret.hex() + "\n")
    path.chmod(0o600)
    return path


def _agent(ctl: Controller, secret_file: Path, name: str) -> subprocess.Popen:
    host, port = ctl.address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "agent", "--controller", f"{host}:{port}",
         "--secret-file", str(secret_file), "--name", name],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _controller(spec=FAST) -> Controller:
    return Controller(spec, on_failure=lambda f: True, launcher=ExternalLauncher())


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=20)


def _assert_refused(proc: subprocess.Popen, why: str) -> None:
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert lines[0].startswith("ftharness agent: the controller refused this agent: "), err
    assert why in lines[0] and "one agent per host" in lines[0], err


def _assert_keeps_serving(ctl: Controller, pid: int) -> None:
    host = ctl.hosts["far0"]
    actors = host.spawn_procs({"rank": 1}).spawn("e", runtime_actors.Echo)
    assert actors.ping.call_one(3).get(timeout=30)["x"] == 3
    time.sleep(SETTLE_S)
    assert ctl.hosts["far0"] is host and host.pid == pid and not host.lost
    assert actors.ping.call_one(4).get(timeout=30)["x"] == 4
    assert ctl.failures == [] and ctl.fatal is None


def _thread_errors(monkeypatch) -> list[BaseException]:
    """Exceptions that end any thread of this process (a dying adopt thread, say)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


def test_a_second_agent_for_a_live_host_is_refused(tmp_path, monkeypatch):
    errors = _thread_errors(monkeypatch)
    ctl = _controller()
    secret = _secret_file(tmp_path, ctl.secret)
    ctl.host_table.expect(["far0"])  # before it can dial in: an unexpected agent is dropped
    first = _agent(ctl, secret, "far0")
    second = None
    try:
        (host,) = ctl.wait_for_hosts(["far0"], timeout_s=60)
        assert host.pid == first.pid
        second = _agent(ctl, secret, "far0")
        _assert_refused(second, f"host 'far0' already has a live agent (pid {first.pid}")
        _assert_keeps_serving(ctl, first.pid)
        assert first.poll() is None
        assert errors == []
    finally:
        ctl.shutdown(grace_s=0.5)
        _stop(first, *([second] if second else []))


def test_two_agents_racing_for_one_name_one_is_refused(tmp_path, monkeypatch):
    """Both dial in while the host is expected; the first one's adoption is held open (a slow
    warmup) so that the second one arrives during it, every time."""
    errors = _thread_errors(monkeypatch)
    spec = replace(FAST, warmup=(("test_duplicate_agent:pause", {"seconds": 1.5}),))
    ctl = _controller(spec)
    secret = _secret_file(tmp_path, ctl.secret)
    ctl.host_table.expect(["far0"])
    agents = [_agent(ctl, secret, "far0"), _agent(ctl, secret, "far0")]
    try:
        (host,) = ctl.wait_for_hosts(["far0"], timeout_s=60)
        (winner,) = [a for a in agents if a.pid == host.pid]
        (loser,) = [a for a in agents if a is not winner]
        _assert_refused(loser, f"another agent (pid {winner.pid}) is dialling in as host 'far0'")
        _assert_keeps_serving(ctl, winner.pid)
        assert winner.poll() is None
        assert errors == []
    finally:
        ctl.shutdown(grace_s=0.5)
        _stop(*agents)


def test_a_lost_hosts_new_agent_replaces_the_old_one(tmp_path):
    """The old agent is frozen (SIGSTOP) until its host is declared lost; a new agent under the
    same name takes the host, and the old one, thawed, finds its link closed and exits at once
    (not after its controller-silence window, 30 s here)."""
    ctl = _controller(replace(FAST, controller_silence_s=30.0))
    secret = _secret_file(tmp_path, ctl.secret)
    ctl.host_table.expect(["far0"])
    old = _agent(ctl, secret, "far0")
    new = None
    try:
        (host,) = ctl.wait_for_hosts(["far0"], timeout_s=60)
        os.kill(old.pid, signal.SIGSTOP)
        wait_for(lambda: host.lost, timeout=20, what="the frozen host declared lost")
        new = _agent(ctl, secret, "far0")
        (again,) = ctl.wait_for_hosts(["far0"], timeout_s=60)
        assert again is not host and again.pid == new.pid
        os.kill(old.pid, signal.SIGCONT)
        t0 = time.monotonic()
        old.communicate(timeout=25)
        assert old.returncode == 3 and time.monotonic() - t0 < 15  # fenced: link closed
        _assert_keeps_serving(ctl, new.pid)
    finally:
        started = [p for p in (old, new) if p is not None]
        for p in started:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        ctl.shutdown(grace_s=0.5)
        _stop(*started)
