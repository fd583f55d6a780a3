"""Pure parts of the runtime: policy, mesh slicing, framing, handshake, exit decoding."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from runtime import channel
from runtime.failure import Cause, Failure, decode_wait_status
from runtime.mesh import Mesh, MeshError
from runtime.policy import Action, decide, recent
from runtime.spec import HeartbeatSpec, Restart, SpecError, Strategy, SupervisorSpec
from runtime.states import IllegalTransition, ProcState, check_transition

KILLED = Failure(cause=Cause.SIGNAL, detail="killed by SIGKILL", signal="SIGKILL")
CLEAN = Failure(cause=Cause.CLEAN_EXIT, detail="exited with code 0", exit_code=0)


def test_policy_restart_and_intensity():
    spec = SupervisorSpec(strategy=Strategy.ONE_FOR_ONE, max_restarts=2, within_s=10)
    assert decide(spec, Restart.PERMANENT, KILLED, [], 100.0).action is Action.RESTART_ONE
    assert decide(spec, Restart.PERMANENT, KILLED, [95.0], 100.0).action is Action.RESTART_ONE
    d = decide(spec, Restart.PERMANENT, KILLED, [95.0, 99.0], 100.0)
    assert d.action is Action.ESCALATE
    assert "2 restarts within 10 s (max 2)" in d.reason
    # restarts older than the window no longer count
    assert decide(spec, Restart.PERMANENT, KILLED, [80.0, 85.0], 100.0).action is Action.RESTART_ONE
    assert recent([80.0, 95.0, 99.0], 100.0, 10.0) == 2


def test_policy_strategies_and_restart_types():
    all_spec = SupervisorSpec(strategy=Strategy.ONE_FOR_ALL)
    assert decide(all_spec, Restart.PERMANENT, KILLED, [], 0).action is Action.RESTART_ALL
    assert decide(all_spec, Restart.TEMPORARY, KILLED, [], 0).action is Action.DROP
    assert decide(all_spec, Restart.TRANSIENT, CLEAN, [], 0).action is Action.DROP
    assert decide(all_spec, Restart.TRANSIENT, KILLED, [], 0).action is Action.RESTART_ALL
    assert decide(all_spec, Restart.PERMANENT, CLEAN, [], 0).action is Action.RESTART_ALL


def test_specs_reject_impossible_values():
    with pytest.raises(SpecError, match=r"timeout_s \(0.1\) must be larger than interval_s"):
        HeartbeatSpec(interval_s=0.5, timeout_s=0.1)
    with pytest.raises(SpecError, match="max_restarts"):
        SupervisorSpec(max_restarts=-1)


def test_mesh_slicing_by_name():
    m = Mesh({"replicas": 3, "ranks": 2}, {(r, k): f"{r}{k}" for r in range(3) for k in range(2)})
    dims, items = m._select(replicas=1)
    assert dims == {"ranks": 2} and list(items.values()) == ["10", "11"]
    dims, items = m._select(ranks=slice(0, 1))
    assert dims == {"replicas": 3, "ranks": 1} and list(items.values()) == ["00", "10", "20"]
    dims, items = m._select(replicas=slice(1, None), ranks=-1)
    assert dims == {"replicas": 2} and items == {(0,): "11", (1,): "21"}
    assert m.at(replicas=2, ranks=0) == "20"
    with pytest.raises(MeshError, match="out of range"):
        m._select(ranks=2)
    with pytest.raises(MeshError, match="empty"):
        m._select(ranks=slice(5, 9))
    with pytest.raises(MeshError, match="do not fill"):
        Mesh({"a": 2}, {(0,): 1})


def _frames(*messages, key=None) -> bytes:
    sealer = channel.Sealer(key)
    return b"".join(sealer.seal(channel.encode(m)) for m in messages)


def test_frame_decoder_partial_and_bad_frames():
    data = _frames(("hello", 1), {"x": [1, 2]})
    dec = channel.FrameDecoder()
    got = []
    for i in range(len(data)):  # byte by byte
        dec.feed(data[i : i + 1])
        got.extend(dec.messages())
    assert got == [("hello", 1), {"x": [1, 2]}]
    dec = channel.FrameDecoder()
    dec.feed(b"\xff\xff\xff\xff")
    with pytest.raises(channel.FrameError, match="exceeds MAX_FRAME"):
        list(dec.messages())
    dec = channel.FrameDecoder()
    dec.feed(b"\x00\x00\x00\x03abc")
    with pytest.raises(channel.FrameError, match="undecodable"):
        list(dec.messages())


def test_authenticated_frames_refuse_tampering_replay_and_the_wrong_key():
    key = bytes(range(32))
    data = _frames(("hello", 1), {"x": [1, 2]}, key=key)
    dec = channel.FrameDecoder(key)
    got = []
    for i in range(len(data)):  # byte by byte, MACs checked in sequence
        dec.feed(data[i : i + 1])
        got.extend(dec.messages())
    assert got == [("hello", 1), {"x": [1, 2]}]
    flipped = bytearray(data)
    flipped[6] ^= 1  # one payload bit
    for bad, _why in (
        (bytes(flipped), "altered"),
        (_frames(("hello", 1), key=key) * 2, "replayed"),  # frame 0 (sequence 0) twice
        (_frames(("hello", 1), key=bytes(32)), "wrong key"),
    ):
        dec = channel.FrameDecoder(key)
        dec.feed(bad)
        with pytest.raises(channel.FrameError, match="failed authentication"):
            list(dec.messages())  # a replay yields frame 0, then fails on the copy


def test_session_keys_differ_per_direction_and_per_connection():
    secret = b"s" * 32
    c2s, s2c = channel.session_keys(secret, b"a" * 32, b"b" * 32)
    again = channel.session_keys(secret, b"a" * 32, b"c" * 32)
    assert c2s != s2c and (c2s, s2c) != again


def _handshake_pair(server_secret: bytes, client_secret: bytes):
    a, b = socket.socketpair()
    errors: dict[str, Exception] = {}

    def server() -> None:
        try:
            channel.server_handshake(a, server_secret, 5)
        except Exception as exc:
            errors["server"] = exc
            a.close()

    t = threading.Thread(target=server)
    t.start()
    try:
        channel.client_handshake(b, client_secret, 5)
    except Exception as exc:
        errors["client"] = exc
    t.join()
    return errors


def test_handshake_accepts_same_secret_and_rejects_others():
    s = channel.new_secret()
    assert _handshake_pair(s, s) == {}
    errors = _handshake_pair(s, os.urandom(32))
    assert isinstance(errors["server"], channel.AuthError)
    assert isinstance(errors["client"], channel.AuthError)


def test_decode_wait_status():
    assert decode_wait_status(9)[:3] == (Cause.SIGNAL, None, "SIGKILL")
    assert decode_wait_status(11 | 0x80)[3] == "killed by SIGSEGV (core dumped)"
    assert decode_wait_status(3 << 8)[:2] == (Cause.EXIT_CODE, 3)
    assert decode_wait_status(0)[0] is Cause.CLEAN_EXIT


def test_state_transitions():
    assert check_transition(ProcState.RUNNING, ProcState.FAILED)
    assert not check_transition(ProcState.FAILED, ProcState.FAILED)  # second report ignored
    assert not check_transition(ProcState.STOPPING, ProcState.FAILED)  # a stop is not a failure
    with pytest.raises(IllegalTransition):
        check_transition(ProcState.STOPPED, ProcState.RUNNING)


def test_failure_report_follows_the_chain():
    top = Failure(cause=Cause.ESCALATED, detail="supervisor job gave up", chained=KILLED)
    text = top.report()
    assert text.splitlines()[0] == "Failure: escalated: supervisor job gave up"
    assert "Caused by:" in text and "killed by SIGKILL" in text
