"""The keeper's beats to a standby on another node (``harness.keeper.beats``), on real sockets:
a connected standby gets a beat every interval and ``E`` when the keeper ends on purpose, the
keeper's ``keeper.json`` says once a standby watches (a fault that fails the keeper's node
waits for that: ``harness.job.fault_context``), and where the standby runs. Only a standby that
proves the beat key counts (issue #49): a stranger's connection gets nothing and watches
nothing, and a standby that stops reading is dropped instead of stalling the others."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from harness.keeper import beats
from harness.keeper.beats import BEAT, END, Remote, standby_node
from harness.keeper.keeper import KEEPER_FILE, Keeper
from runtime.channel import AuthError, client_handshake, new_secret


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
    assert bytes.fromhex(info["beat_key"]) == remote.key
    assert info["pid"] == os.getpid()
    started = info["started"]
    # the beat threads alone (start() would also start the standby's srun step)
    threading.Thread(target=remote._accept, daemon=True).start()
    threading.Thread(target=remote._beat, daemon=True).start()
    host, port = remote.address.rsplit(":", 1)
    standby = socket.create_connection((host, int(port)), timeout=5)
    try:
        client_handshake(standby, bytes.fromhex(info["beat_key"]), 5.0)
        standby.settimeout(5)
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


def _serving(tmp_path: Path) -> tuple[Remote, Keeper, tuple[str, int]]:
    remote = Remote(tmp_path, "127.0.0.1", "n3", interval_s=0.05)
    keeper = Keeper(tmp_path, max_restarts=1, within_s=60.0, controller=["true"], remote=remote)
    keeper._write_keeper_file()
    threading.Thread(target=remote._accept, daemon=True).start()
    threading.Thread(target=remote._beat, daemon=True).start()
    host, port = remote.address.rsplit(":", 1)
    return remote, keeper, (host, int(port))


def test_a_stranger_without_the_beat_key_gets_no_beat_and_watches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(beats, "HANDSHAKE_S", 0.5)
    remote, _, address = _serving(tmp_path)
    silent = socket.create_connection(address, timeout=5)  # connects, never proves anything
    wrong = socket.create_connection(address, timeout=5)
    try:
        with pytest.raises(AuthError):
            client_handshake(wrong, new_secret(), 5.0)
        silent.settimeout(5)
        data = b""
        while chunk := silent.recv(64):  # the challenge, then closed: not one beat
            data += chunk
        assert len(data) == 32 and BEAT * 3 not in data
        time.sleep(0.3)  # a few beat intervals
        info = json.loads((tmp_path / KEEPER_FILE).read_text())
        assert info["watched"] is False and remote._clients == []
        # the job's own standby still gets in and counts
        standby = socket.create_connection(address, timeout=5)
        client_handshake(standby, remote.key, 5.0)
        standby.settimeout(5)
        assert standby.recv(1) == BEAT
        assert _wait(lambda: json.loads((tmp_path / KEEPER_FILE).read_text())["watched"])
        standby.close()
    finally:
        silent.close()
        wrong.close()
        remote.close()


def test_a_standby_that_stops_reading_is_dropped_and_the_other_keeps_its_beats(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(beats, "SEND_S", 0.5)
    remote, _, address = _serving(tmp_path)
    stuck, reader = (socket.create_connection(address, timeout=5) for _ in range(2))
    got = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            while chunk := reader.recv(1 << 16):
                got.extend(chunk)

    try:
        for s in (stuck, reader):
            client_handshake(s, remote.key, 5.0)
        assert _wait(lambda: len(remote._clients) == 2)
        reader.settimeout(None)
        threading.Thread(target=read, daemon=True).start()
        # more than any socket buffers hold: the stuck one blocks the send until SEND_S
        sender = threading.Thread(target=remote._send, args=(BEAT * (64 << 20),), daemon=True)
        sender.start()
        sender.join(30)
        assert not sender.is_alive()
        assert _wait(lambda: len(remote._clients) == 1)
        assert len(got) > 0
        n = len(got)
        assert _wait(lambda: len(got) >= (64 << 20) + 3 > n)  # and the beats go on to it
    finally:
        remote.close()
        stuck.close()
        reader.close()


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
