"""``ftharness agent``: an agent started by hand (as on another machine) dials in to a running
controller with the job secret from a 0600 file; the controller waits for the hosts it expects
and says which are missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import runtime_actors
from test_runtime import FAST

from runtime import channel
from runtime.controller import Controller
from runtime.launchers import ExternalLauncher


@pytest.fixture
def ctl():
    c = Controller(FAST, on_failure=lambda f: True, launcher=ExternalLauncher())
    yield c
    c.shutdown(grace_s=0.5)


def _secret_file(tmp_path: Path, secret: bytes, mode: int) -> Path:
    path = tmp_path / "job.secret"
    path.write_text(secret.hex() + "\n")
    path.chmod(mode)
    return path


def _agent(ctl: Controller, secret_file: Path, name: str) -> subprocess.Popen:
    host, port = ctl.address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    return subprocess.Popen(
        [sys.executable, "-m", "harness", "agent", "--controller", f"{host}:{port}",
         "--secret-file", str(secret_file), "--name", name],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_an_agent_started_by_hand_dials_in_and_runs_workers(ctl, tmp_path):
    proc = _agent(ctl, _secret_file(tmp_path, ctl.secret, 0o600), "far0")
    try:
        (host,) = ctl.wait_for_hosts(["far0"], timeout_s=60)
        assert host.pid == proc.pid and host.address == "127.0.0.1"
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert ctl.secret.hex().encode() not in f.read()  # never on a command line
        actors = host.spawn_procs({"rank": 2}).spawn("e", runtime_actors.Echo)
        assert [v["x"] for v in actors.ping.call(3).get(timeout=30).values()] == [3, 3]
    finally:
        ctl.shutdown(grace_s=0.5)
        proc.wait(20)
    assert proc.returncode == 0  # told to shut down: a clean exit


def test_a_secret_file_others_can_read_is_refused(ctl, tmp_path):
    proc = _agent(ctl, _secret_file(tmp_path, ctl.secret, 0o644), "far0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "must be mode 0600" in err and "chmod 600" in err
    assert "far0" not in ctl.hosts


def test_the_wrong_secret_never_joins(ctl, tmp_path):
    proc = _agent(ctl, _secret_file(tmp_path, b"x" * 32, 0o600), "far0")
    try:
        with pytest.raises(channel.ChannelError, match="far0 did not dial in"):
            ctl.wait_for_hosts(["far0"], timeout_s=3)
    finally:
        proc.kill()
        proc.wait(10)


def test_waiting_names_every_missing_host(ctl):
    with pytest.raises(channel.ChannelError, match=r"host agent\(s\) a, b did not dial in"):
        ctl.wait_for_hosts(["a", "b"], timeout_s=0.5)
