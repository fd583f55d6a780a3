"""The keeper's beats to a standby on another node (``harness.job.beats``), on real sockets:
a connected standby gets a beat every interval and ``E`` when the keeper ends on purpose, the
keeper's ``keeper.json`` says once a standby watches (a fault that fails the keeper's node
waits for that: ``harness.job.fault_context``), and where the standby runs."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from harness.job.beats import BEAT, END, Remote, standby_node
from harness.job.keeper import KEEPER_FILE, Keeper


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_a_connected_standby_gets_beats_then_the_end_and_keeper_json_says_it_watches(
    tmp_path: Path,
) -> None:
    remote = Remote(tmp_path, "127.0.0.1", "n3", interval_s=0.05)
    keeper = Keeper(tmp_path, max_restarts=1, within_s=60.0, controller=["true"], remote=remote)
    keeper._write_keeper_file()
    info = json.loads((tmp_path / KEEPER_FILE).read_text())
    assert info["beat"] == remote.address and info["watched"] is False
    assert info["pid"] == os.getpid()
    started = info["started"]
    # the beat threads alone (start() would also start the standby's srun step)
    threading.Thread(target=remote._accept, daemon=True).start()
    threading.Thread(target=remote._beat, daemon=True).start()
    host, port = remote.address.rsplit(":", 1)
    standby = socket.create_connection((host, int(port)), timeout=5)
    try:
        assert standby.recv(1) == BEAT
        assert _wait(lambda: json.loads((tmp_path / KEEPER_FILE).read_text())["watched"])
        info = json.loads((tmp_path / KEEPER_FILE).read_text())
        assert info["started"] == started and info["beat"] == remote.address
        remote.close()
        data = b""
        while not data.endswith(END):
            chunk = standby.recv(64)
            assert chunk, data
            data += chunk
        assert set(data[:-1]) <= set(BEAT)
    finally:
        standby.close()


def test_keeper_json_is_not_rewritten_by_a_superseded_keeper(tmp_path: Path) -> None:
    remote = Remote(tmp_path, "127.0.0.1", "n3", interval_s=0.05)
    keeper = Keeper(tmp_path, max_restarts=1, within_s=60.0, controller=["true"], remote=remote)
    other = {"pid": os.getpid() + 1, "host": "n3", "beat": "10.0.0.3:1", "watched": False}
    (tmp_path / KEEPER_FILE).write_text(json.dumps(other))
    keeper._on_watched()  # a standby connected to a keeper another one replaced
    assert json.loads((tmp_path / KEEPER_FILE).read_text()) == other
    remote.close()


def test_the_standby_runs_on_the_last_other_node() -> None:
    assert standby_node(["n1", "n2", "n3"], "n1") == "n3"
    assert standby_node(["n1", "n2", "n3"], "n3") == "n2"
    assert standby_node(["n1"], "n1") is None
