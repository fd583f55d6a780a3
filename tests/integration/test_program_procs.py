"""Programs of the user's own as supervised processes (runtime/program_proc.py), and the quorum
tap in front of a real quorum service (harness/quorum/tap.py): real processes, real gRPC."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import grpc
import psutil
import pytest

from harness.quorum.tap import Admission, QuorumTap, Request
from harness.quorum.tree import TreeQuorum
from harness.quorum.wire import SERVICE, decode_quorum_response, encode_field
from runtime.controller import Controller
from runtime.failure import Cause
from runtime.messages import SpawnProgram
from runtime.spec import ControllerSpec, HeartbeatSpec
from runtime.states import ProcState

pytestmark = pytest.mark.timeout(90)

FAST = ControllerSpec(
    heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=0.6),
    agent_heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=2.0),
    preload=(),
)


def wait_for(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def ctl():
    c = Controller(FAST, on_failure=lambda f: True)  # tests look at c.failures themselves
    yield c
    c.shutdown(grace_s=0.5)


def program(argv, env, cwd, log, warm: bool = False) -> SpawnProgram:
    return SpawnProgram("", {"replica": 0, "rank": 0}, tuple(argv), env, cwd, str(log), warm)


def start(ctl, tmp_path, script: str, *, cwd: str | None = None, env: dict | None = None):
    host = ctl.hosts.get("h0") or ctl.spawn_host("h0")
    log = tmp_path / "replica0-rank0.log"
    rec = ctl.spawn_program(host, program(("sh", "-c", script), env or {}, cwd, log))
    return rec, log


def test_clean_exit_is_finished_not_failed(ctl, tmp_path):
    rec, log = start(ctl, tmp_path, 'echo "hello $GREETING"', env={"GREETING": "world"})
    rec.finished.result(timeout=15)
    assert rec.state is ProcState.EXITED
    time.sleep(0.3)
    assert ctl.failures == []
    assert log.read_text() == "hello world\n"


def test_exit_code_and_signal_are_failures(ctl, tmp_path):
    rec, _ = start(ctl, tmp_path, "exit 3")
    f = wait_for(lambda: ctl.failures, what="the exit")[0]
    assert (f.cause, f.exit_code, f.coords) == (Cause.EXIT_CODE, 3, {"replica": 0, "rank": 0})
    assert not rec.finished.done()

    rec, _ = start(ctl, tmp_path, "sleep 30")
    rec.ready.result(timeout=15)
    os.kill(rec.pid, signal.SIGSEGV)  # a segfault, from outside
    f = wait_for(lambda: ctl.failures[1:], what="the signal")[0]
    assert (f.cause, f.signal) == (Cause.SIGNAL, "SIGSEGV")


def test_a_program_that_cannot_start_fails_with_its_reason_in_its_log(ctl, tmp_path):
    _, log = start(ctl, tmp_path, "true", cwd=str(tmp_path / "gone"))
    f = wait_for(lambda: ctl.failures, what="the failure")[0]
    assert f.exit_code == 127
    assert "ftharness: could not start" in log.read_text()


def test_a_program_whose_log_cannot_be_opened_is_reported_not_started(ctl, tmp_path):
    host = ctl.spawn_host("h0")
    ctl.spawn_program(host, program(("true",), {}, None, tmp_path / "no" / "such" / "log"))
    f = wait_for(lambda: ctl.failures, what="the failure")[0]
    assert f.exit_code == 127


def test_a_stopped_program_is_not_hung_by_heartbeat_and_stop_takes_its_whole_group(ctl, tmp_path):
    """No heartbeat is expected of a program (its liveness is its progress, watched by
    harness.job.program.groups); a stop reaches its children too (its own session)."""
    rec, _ = start(ctl, tmp_path, "sleep 100 & sleep 100; wait")
    pid = rec.ready.result(timeout=15)
    child = wait_for(lambda: psutil.Process(pid).children(), what="the child")[0]
    os.kill(pid, signal.SIGSTOP)
    time.sleep(3 * FAST.heartbeat.timeout_s)
    assert ctl.failures == []
    ctl.stop_procs([rec.ref.proc_id], grace_s=0.2)
    assert rec.state is ProcState.STOPPED
    wait_for(lambda: not psutil.pid_exists(child.pid) or child.status() == "zombie")
    assert ctl.failures == []


class Seen:
    """The tap's observer: admits group 0 by its store address (a quorum request) and then by
    the ids it admitted (a heartbeat), forwarded as ``member_id``; records what it sees."""

    def __init__(self, member_id: str = "") -> None:
        self.member_id = member_id
        self.ids: set[str] = set()
        self.peers: list[str] = []
        self.requests: list[Request] = []
        self.answers: list[int | None] = []

    def admit(self, replica_id: str, peer: str, store_address: str | None) -> Admission | str:
        self.peers.append(peer)
        if replica_id == "stale" or (store_address or "127.0.0.1:1234") != "127.0.0.1:1234":
            return "refused"
        if store_address is None and replica_id not in self.ids:
            return f"{replica_id} unknown"
        self.ids.add(replica_id)
        return Admission(0, 0, self.member_id)

    def asked(self, req: Request) -> None:
        self.requests.append(req)

    def answered(self, req: Request, members) -> None:
        self.answers.append(None if members is None else len(members))


def _member(replica_id: str, store: str, step: int) -> bytes:
    return (
        encode_field(1, replica_id.encode())
        + encode_field(3, store.encode())
        + encode_field(4, step)
        + encode_field(5, 1)
    )


def test_quorum_tap_forwards_what_its_observer_admits_under_the_incarnation_s_tagged_id():
    tree = TreeQuorum(join_timeout_s=0.1, heartbeat_timeout_s=2.0)
    tagged = tree.admit(0, 0)
    seen = Seen(tagged)
    tap = QuorumTap(bind_host="127.0.0.1", upstream=lambda: tree.address, observer=seen)
    channel = grpc.insecure_channel(tap.address.split("://")[1])
    me, upstream = "train_ddp_0:u1", f"{tagged}:train_ddp_0:u1"
    try:
        heartbeat = channel.unary_unary(f"/{SERVICE}/Heartbeat")
        quorum = channel.unary_unary(f"/{SERVICE}/Quorum")
        # A heartbeat of an id the observer never admitted is refused and never forwarded.
        for rid in (me, "stale"):
            with pytest.raises(grpc.RpcError) as refused:
                heartbeat(encode_field(1, rid.encode()), timeout=5)
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert tree.status()["heartbeating"] == []

        reply = quorum(encode_field(1, _member(me, "127.0.0.1:1234", 7)), timeout=10)
        # Upstream the Manager is its incarnation's tagged id (the tree quorum admits nothing
        # else); in the reply it is itself again, every other field as it sent it.
        assert tree.status()["members"] == [upstream]
        members = decode_quorum_response(reply)[1]
        assert [m.replica_id for m in members] == [me] and members[0].step == 7
        assert members[0].raw == _member(me, "127.0.0.1:1234", 7)
        req = seen.requests[0]
        assert (req.replica, req.replica_id, req.step) == (0, me, 7)
        assert seen.answers == [1]  # a quorum of one member
        assert seen.peers[-1].startswith("ipv4:127.0.0.1:")  # the caller's connection
        # torchft's Rust client heartbeats without a deadline: forwarded all the same, renamed
        heartbeat(encode_field(1, me.encode()))
        assert tree.status()["heartbeating"] == [upstream]

        with pytest.raises(grpc.RpcError) as stranger:  # refused by the observer
            quorum(encode_field(1, _member("intruder", "127.0.0.1:9", 7)), timeout=5)
        assert stranger.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert len(seen.requests) == 1
    finally:
        channel.close()
        tap.shutdown()
        tree.shutdown()


def _lighthouse(port: int = 0):
    from torchft._torchft import LighthouseServer

    for _ in range(50):  # a restart rebinds the port the old server just released
        try:
            return LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=100)
        except RuntimeError:
            time.sleep(0.1)
    raise AssertionError(f"port {port} stayed taken")


def test_a_quorum_request_waits_for_a_quorum_service_that_is_not_serving_yet():
    """The quorum service is down (restarting; a new controller not serving yet): a program's
    quorum request through the tap waits for it within its deadline and is answered once it
    serves, instead of failing with UNAVAILABLE (which would crash a torchft program's step).
    Forwarded once as far as the observer sees."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there yet
    seen = Seen()
    tap = QuorumTap(
        bind_host="127.0.0.1", upstream=lambda: f"http://127.0.0.1:{port}", observer=seen
    )
    channel = grpc.insecure_channel(tap.address.split("://")[1])
    got: dict[str, object] = {}

    def ask() -> None:
        try:
            got["reply"] = channel.unary_unary(f"/{SERVICE}/Quorum")(
                encode_field(1, _member("train_ddp_0:u1", "127.0.0.1:1234", 7)), timeout=20
            )
        except grpc.RpcError as e:
            got["error"] = e.code()

    asker = threading.Thread(target=ask)
    asker.start()
    lighthouse = None
    try:
        time.sleep(1.0)  # the request is in the tap, the service still down
        assert asker.is_alive(), got
        lighthouse = _lighthouse(port)
        asker.join(20)
        assert "reply" in got, got
        assert decode_quorum_response(got["reply"])[0] == 1
        assert len(seen.requests) == 1 and seen.answers == [1]
    finally:
        asker.join(20)
        channel.close()
        tap.shutdown()
        if lighthouse is not None:
            lighthouse.shutdown()


def test_quorum_tap_continues_the_ids_of_a_restarted_lighthouse():
    """torchft's Lighthouse numbers its quorums from 1 again after a restart; a program's torchft
    process group would rendezvous on the stale keys of the first quorum 1. Through the tap the
    ids go on: the restarted Lighthouse's quorum 1 reaches the program as quorum 2."""

    def quorum_id(reply: bytes) -> int:
        return decode_quorum_response(reply)[0]

    lighthouse = _lighthouse()
    port = int(lighthouse.address().rsplit(":", 1)[1])
    upstream = f"http://127.0.0.1:{port}"
    tap = QuorumTap(bind_host="127.0.0.1", upstream=lambda: upstream, observer=Seen())
    request = encode_field(1, _member("train_ddp_0:u1", "127.0.0.1:1234", 7))
    channels = [grpc.insecure_channel(tap.address.split("://")[1])]
    try:
        quorum = channels[0].unary_unary(f"/{SERVICE}/Quorum")
        first = quorum(request, timeout=10)
        assert quorum_id(first) == 1
        lighthouse.shutdown()
        tap.upstream_restarted()
        lighthouse = _lighthouse(port)
        again = quorum(request, timeout=10)
        assert quorum_id(again) == 2
        assert decode_quorum_response(again)[1] == decode_quorum_response(first)[1]  # the rest
        channels.append(grpc.insecure_channel(f"127.0.0.1:{port}"))
        direct = channels[1].unary_unary(f"/{SERVICE}/Quorum")(request, timeout=10)
        assert quorum_id(direct) == 1  # the control: what the Lighthouse itself says
        assert quorum_id(quorum(request, timeout=10)) == 2  # unchanged membership, same id
    finally:
        for channel in channels:
            channel.close()
        tap.shutdown()
        lighthouse.shutdown()


BEATING = "import sys, time\nfor i in range(600):\n    print(i, flush=True)\n    time.sleep(0.05)\n"


def _hooked(ctl, tmp_path):
    """A Python program that prints a line every 50 ms, with ftharness's hook on its path."""
    from harness.job.program.env import HOOKS_DIR

    host = ctl.hosts.get("h0") or ctl.spawn_host("h0")
    log = tmp_path / "replica0-rank0.log"
    env = {"PYTHONPATH": str(HOOKS_DIR), "FTHARNESS_HOOK_DIR": str(tmp_path)}
    rec = ctl.spawn_program(host, program(("python", "-c", BEATING), env, None, log))
    pid = rec.ready.result(timeout=15)
    wait_for(lambda: log.exists() and log.read_text().count("\n") > 3, what="the program")
    return rec, pid, log


def _command(tmp_path, pid: int, func: str, *args) -> None:
    from harness.job.program.env import HOOK_SIGNAL

    (tmp_path / f"{pid}.json").write_text(json.dumps({"func": func, "args": list(args)}))
    os.kill(pid, HOOK_SIGNAL)


def test_hook_runs_a_real_segfault_inside_an_unmodified_program(ctl, tmp_path):
    _, pid, _ = _hooked(ctl, tmp_path)
    _command(tmp_path, pid, "faults.inworker:segfault")
    f = wait_for(lambda: ctl.failures, what="the segfault")[0]
    assert (f.cause, f.signal) == (Cause.SIGNAL, "SIGSEGV")
    assert not (tmp_path / f"{pid}.json").exists()  # the hook read its command


def test_hook_holds_the_gil_inside_an_unmodified_program(ctl, tmp_path):
    _, pid, log = _hooked(ctl, tmp_path)
    _command(tmp_path, pid, "faults.inworker:hold_gil", 3.0, 0.0)
    time.sleep(0.5)  # the hold has begun
    lines = log.read_text().count("\n")
    time.sleep(1.5)
    assert log.read_text().count("\n") == lines  # no Python ran: the main loop is frozen
    assert psutil.Process(pid).status() != psutil.STATUS_STOPPED  # alive, not stopped
    wait_for(lambda: log.read_text().count("\n") > lines, timeout=10, what="the GIL released")
    assert ctl.failures == []


WARM = """
import os, signal, sys
print("torch preloaded:", "torch" in sys.modules, flush=True)
print("SIGPIPE ignored:", signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN, flush=True)
print("argv:", sys.argv, "env:", os.environ.get("GREETING"), "cwd:", os.getcwd(), flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_warm_start_runs_the_script_in_a_fork_of_the_preloaded_agent(tmp_path, code):
    """``program.warm``: the agent forks its interpreter (torch already imported) and runs the
    script as ``__main__`` with its argv, environment and cwd; its exit code is reported."""
    c = Controller(replace(FAST, preload=("torch",)), on_failure=lambda f: True)
    try:
        script = tmp_path / "prog.py"
        script.write_text(WARM)
        host = c.spawn_host("h0")
        log = tmp_path / "log"
        msg = program(("python", str(script), str(code)), {"GREETING": "hi"}, str(tmp_path), log)
        rec = c.spawn_program(host, replace(msg, warm=True))
        if code == 0:
            rec.finished.result(timeout=15)
        else:
            f = wait_for(lambda: c.failures, what="the exit")[0]
            assert f.exit_code == 3
        text = log.read_text()
        assert "torch preloaded: True" in text, text
        # as in a fresh interpreter: a write to a dead peer's socket raises, it does not kill
        assert "SIGPIPE ignored: True" in text, text
        assert f"argv: ['{script}', '{code}'] env: hi cwd: {tmp_path}" in text, text
    finally:
        c.shutdown(grace_s=0.5)
