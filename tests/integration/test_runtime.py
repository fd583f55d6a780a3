"""The supervision tree with real processes: meshes, calls, failures, supervisors, orphans."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import runtime_actors

from runtime import channel
from runtime.actor import RemoteError
from runtime.controller import Controller, HostLostError, ProcFailedError
from runtime.failure import Cause, SupervisionError
from runtime.journal import Journal, read_journal
from runtime.mesh import MeshError
from runtime.messages import HelloAgent, HelloWorker
from runtime.spec import ControllerSpec, HeartbeatSpec, Restart, Strategy, SupervisorSpec

FAST = ControllerSpec(
    heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=0.6),
    agent_heartbeat=HeartbeatSpec(interval_s=0.1, timeout_s=2.0),
    preload=(),
    call_timeout_s=20.0,
)


def wait_for(pred, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie. A process reaped between two looks at
    /proc is gone, not an error (psutil raises NoSuchProcess then)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def ctl():
    c = Controller(FAST, on_failure=lambda f: True)  # tests look at c.failures themselves
    yield c
    c.shutdown(grace_s=0.5)


def test_spawn_slice_and_call(ctl):
    host = ctl.spawn_host("h0")
    procs = host.spawn_procs({"replicas": 3, "ranks": 2})
    actors = procs.spawn("echo", runtime_actors.Echo, "tag")
    out = actors.ping.call(7).get(timeout=20)
    assert sorted(out.keys()) == [(r, k) for r in range(3) for k in range(2)]
    assert out[(2, 1)]["coords"] == {"replicas": 2, "ranks": 1}
    assert len({v["pid"] for v in out.values()}) == 6

    one_group = actors.slice(replicas=1)
    assert one_group.dims == {"ranks": 2}
    got = one_group.ping.call(1).get(timeout=20)
    assert [v["coords"]["replicas"] for v in got.values()] == [1, 1]

    first_ranks = actors.slice(ranks=slice(0, 1))
    assert first_ranks.dims == {"replicas": 3, "ranks": 1}
    assert {v["coords"]["ranks"] for v in first_ranks.ping.call().get(timeout=20).values()} == {0}

    single = actors.slice(replicas=2, ranks=0)
    assert single.ping.call_one(3).get(timeout=20)["coords"] == {"replicas": 2, "ranks": 0}
    assert actors.ping.choose(4).get(timeout=20)["x"] == 4

    with pytest.raises(MeshError, match="out of range"):
        actors.slice(replicas=3)
    with pytest.raises(MeshError, match="no dimension"):
        actors.slice(hosts=0)
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        actors.nope  # noqa: B018
    with pytest.raises(MeshError, match="call_one needs a mesh of one actor"):
        actors.ping.call_one()


def test_remote_exception_carries_traceback_and_coords(ctl):
    actors = ctl.spawn_host().spawn_procs({"ranks": 2}).spawn("echo", runtime_actors.Echo)
    with pytest.raises(RemoteError) as info:
        actors.slice(ranks=1).boom.call_one().get(timeout=20)
    err = info.value
    assert err.exc_type == "ValueError"
    assert err.coords == {"ranks": 1}
    assert "boom from the actor" in str(err)
    assert "runtime_actors.py" in err.remote_traceback and "in boom" in err.remote_traceback
    # the process survives an endpoint exception
    assert actors.slice(ranks=1).ping.call_one().get(timeout=20)["x"] == 0


def test_constructor_failure_is_reported(ctl):
    procs = ctl.spawn_host().spawn_procs({"ranks": 1})
    with pytest.raises(RemoteError, match="constructor failed"):
        procs.spawn("broken", runtime_actors.Broken)


@pytest.mark.parametrize(
    ("how", "cause", "sig", "code"),
    [
        ("sigkill", Cause.SIGNAL, "SIGKILL", None),
        ("segfault", Cause.SIGNAL, "SIGSEGV", None),
        ("exit3", Cause.EXIT_CODE, None, 3),
    ],
)
def test_process_death_reaches_controller_with_cause(ctl, how, cause, sig, code):
    actors = (
        ctl.spawn_host("h0")
        .spawn_procs({"replicas": 2, "ranks": 1})
        .spawn("echo", runtime_actors.Echo)
    )
    victim = actors.slice(replicas=1, ranks=0)
    fut = victim.die.call_one(how)
    failure = wait_for(lambda: ctl.failures and ctl.failures[0], what="failure")
    assert failure.cause is cause
    assert failure.signal == sig and failure.exit_code == code
    assert failure.coords == {"replicas": 1, "ranks": 0}
    assert failure.host == "h0"
    # the pending call fails instead of hanging until its timeout
    with pytest.raises(Exception, match=r"killed by|exited with"):
        fut.get(timeout=10)
    # the other replica is untouched
    assert actors.slice(replicas=0, ranks=0).ping.call_one().get(timeout=20)["x"] == 0


def test_held_gil_is_detected_by_missed_heartbeats(ctl):
    actors = ctl.spawn_host().spawn_procs({"ranks": 1}).spawn("echo", runtime_actors.Echo)
    pid = actors.pid.call_one().get(timeout=20)
    actors.hold_gil.call_one(30)
    failure = wait_for(lambda: ctl.failures and ctl.failures[0], what="hang failure")
    assert failure.cause is Cause.MISSED_HEARTBEAT
    assert "GIL" in failure.detail
    # detection happened after the configured timeout, and the frozen process was killed
    assert failure.t_detected - failure.t_event >= FAST.heartbeat.timeout_s
    wait_for(
        lambda: not _running(pid),
        what="hung worker killed",
    )


def _group_pids(sup, name):
    return sorted(sup.child(name).pid.call().get(timeout=20).values())


@pytest.mark.parametrize("strategy", [Strategy.ONE_FOR_ALL, Strategy.ONE_FOR_ONE])
def test_strategies(strategy):
    restarted = []
    with Controller(FAST) as c:
        host = c.spawn_host()
        sup = c.supervisor(
            "group",
            SupervisorSpec(strategy=strategy, max_restarts=3, grace_s=0.5),
            on_restart=lambda name, inst: restarted.append(name),
        )
        for r in range(2):
            sup.add_child(
                f"rank{r}",
                lambda r=r: host.spawn_procs({"ranks": 1}, fixed={"rank": r}).spawn(
                    "echo", runtime_actors.Echo
                ),
            )
        before = {n: _group_pids(sup, n) for n in ("rank0", "rank1")}
        sup.child("rank1").die.call("sigkill")
        wait_for(lambda: "rank1" in restarted, what="restart")
        after = {n: _group_pids(sup, n) for n in ("rank0", "rank1")}
        assert after["rank1"] != before["rank1"]
        if strategy is Strategy.ONE_FOR_ALL:
            assert after["rank0"] != before["rank0"]
            assert sorted(restarted) == ["rank0", "rank1"]
        else:
            assert after["rank0"] == before["rank0"]
            assert restarted == ["rank1"]
        assert c.fatal is None


def test_restart_intensity_escalates_to_root(tmp_path):
    journal = Journal(tmp_path / "j.jsonl", job="t")
    with Controller(FAST, journal=journal) as c:
        host = c.spawn_host()
        job = c.supervisor("job", SupervisorSpec(max_restarts=0))
        group = job.add_supervisor(
            "replica0",
            SupervisorSpec(strategy=Strategy.ONE_FOR_ALL, max_restarts=2, within_s=60, grace_s=0.2),
        )
        group.add_child(
            "ranks", lambda: host.spawn_procs({"ranks": 1}).spawn("echo", runtime_actors.Echo)
        )
        for _ in range(3):
            pid = group.child("ranks").pid.call_one().get(timeout=20)
            os.kill(pid, 9)
            wait_for(
                lambda pid=pid: (
                    c.fatal
                    or (
                        group.child("ranks").proc_ids
                        and c.procs[group.child("ranks").proc_ids[0]].pid not in (None, pid)
                    )
                ),
                what="restart or escalation",
            )
        with pytest.raises(SupervisionError) as info:
            c.wait(timeout=15)
    report = str(info.value)
    assert "supervisor job gave up: restart intensity exceeded" in report
    assert "supervisor job/replica0 gave up: restart intensity exceeded: 2 restarts" in report
    assert "killed by SIGKILL" in report
    decisions = [
        r["decision"] for r in read_journal(tmp_path / "j.jsonl") if r["event"] == "supervisor"
    ]
    assert decisions == ["restart_all", "restart_all", "escalate", "escalate"]


def test_transient_child_not_restarted_after_clean_exit():
    with Controller(FAST) as c:
        host = c.spawn_host()
        sup = c.supervisor("s", SupervisorSpec())
        sup.add_child(
            "w",
            lambda: host.spawn_procs({"ranks": 1}).spawn("echo", runtime_actors.Echo),
            restart=Restart.TRANSIENT,
        )
        pid = sup.child("w").pid.call_one().get(timeout=20)
        sup.child("w").die.call_one("exit3")  # abnormal: restarted
        wait_for(
            lambda: c.procs[sup.child("w").proc_ids[0]].pid not in (None, pid),
            what="transient restart after abnormal exit",
        )
        assert c.fatal is None


def test_lost_host_fails_its_processes(ctl):
    """Its processes fail (a call under way with them), and what is asked of the host after
    raises HostLostError (the host's failure, which no crash-loop rule counts): a spawn, a
    store."""
    a = ctl.spawn_host("h0")
    ctl.spawn_host("h1").spawn_procs({"ranks": 1}).spawn("echo", runtime_actors.Echo)
    actors = a.spawn_procs({"ranks": 2}).spawn("echo", runtime_actors.Echo)
    under_way = actors.slice(ranks=slice(0, 1)).sleep.call_one(30)
    a.kill()
    wait_for(lambda: len(ctl.failures) >= 2, what="lost-host failures")
    assert {f.host for f in ctl.failures} == {"h0"}
    assert {f.cause for f in ctl.failures} <= {Cause.LOST_HOST, Cause.SIGNAL}
    assert any(f.cause is Cause.LOST_HOST for f in ctl.failures)
    with pytest.raises(ProcFailedError):
        under_way.get(timeout=20)
    wait_for(lambda: a.lost, what="h0 declared lost")
    with pytest.raises(HostLostError):
        a.spawn_procs({"ranks": 1})
    with pytest.raises(HostLostError):
        ctl.serve_store(a, 0)


def assert_dropped(sock: socket.socket) -> None:
    sock.settimeout(5)
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:
        pass
    finally:
        sock.close()


def test_unauthenticated_and_garbage_peers_are_dropped(ctl, caplog):
    host = ctl.spawn_host()
    actors = host.spawn_procs({"ranks": 1}).spawn("echo", runtime_actors.Echo)
    # agents dial in: a host agent listens on no port at all, so there is nothing to attack
    agent_listens = [
        c for c in psutil.Process(host.pid).net_connections("tcp") if c.status == "LISTEN"
    ]
    assert agent_listens == []
    address = ctl.address
    # 1. a client with the wrong secret
    with pytest.raises(channel.AuthError):
        channel.connect(address, b"wrong secret", timeout=5)
    # 2. a client that sends garbage instead of a handshake
    s = socket.create_connection(address, timeout=5)
    s.recv(32)
    s.sendall(b"\x80\x04garbage-pickle" * 8)
    assert_dropped(s)
    # 3. an authenticated peer sending a malformed (bad MAC) and an oversized frame
    for bad in (b"\x00\x00\x00\x05notpk" + bytes(channel.TAG_BYTES), b"\xff\xff\xff\xff"):
        conn = channel.connect(address, ctl.secret, timeout=5)
        conn.sock.sendall(bad)
        assert_dropped(conn.sock)
    # 4. an authenticated peer sending a well-formed message that is neither hello
    conn = channel.connect(address, ctl.secret, timeout=5)
    conn.send(("ping",))
    assert_dropped(conn.sock)
    # 5. a host agent nobody expects
    conn = channel.connect(address, ctl.secret, timeout=5)
    conn.send(HelloAgent("intruder", 1))
    assert_dropped(conn.sock)
    # everybody keeps serving: the workers, the controller's handshake, and the agent's forks
    assert actors.ping.call_one(9).get(timeout=20)["x"] == 9
    channel.connect(address, ctl.secret, timeout=5).close()
    more = host.spawn_procs({"ranks": 1}).spawn("echo2", runtime_actors.Echo)
    assert more.ping.call_one(7).get(timeout=20)["x"] == 7
    assert ctl.failures == []
    assert "intruder" not in ctl.hosts


def test_a_tampered_frame_drops_the_peer(ctl):
    """Every frame carries a MAC under the session key: a frame altered on the path (here: one
    payload byte flipped in a well-formed frame) is never unpickled and the peer is dropped."""
    conn = channel.connect(ctl.address, ctl.secret, timeout=5)
    frame = bytearray(conn.sealer.seal(channel.encode(HelloWorker("nobody", 1))))
    frame[10] ^= 0x01
    conn.sock.sendall(bytes(frame))
    assert_dropped(conn.sock)
    # a replayed frame fails too: the sequence number is part of the MAC
    conn = channel.connect(ctl.address, ctl.secret, timeout=5)
    frame = conn.sealer.seal(channel.encode(("ping",)))
    other = channel.connect(ctl.address, ctl.secret, timeout=5)
    other.sock.sendall(frame)  # another session's frame
    assert_dropped(other.sock)
    conn.close()


ORPHAN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import runtime_actors
    from runtime.controller import Controller
    from runtime.spec import ControllerSpec
    c = Controller(ControllerSpec(preload=()))
    actors = c.spawn_host("h0").spawn_procs({{"ranks": 2}}).spawn("e", runtime_actors.Echo)
    pids = list(actors.pid.call().get(timeout=30).values())
    pids += list(actors.spawn_child.call().get(timeout=30).values())
    pids.append(c.hosts["h0"].pid)
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.timeout(90)
def test_sigkill_of_controller_leaves_no_orphans(tmp_path):
    script = tmp_path / "ctl.py"
    script.write_text(ORPHAN_SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).parents[2]),
    )
    line = proc.stdout.readline()
    pids = [int(p) for p in line.split()]
    assert len(pids) == 5, line
    assert all(psutil.pid_exists(p) for p in pids)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 5.0
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    assert alive == [], f"orphans left behind: {alive}"


UNHANDLED_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import runtime_actors
    from runtime.controller import Controller
    from runtime.failure import SupervisionError
    from runtime.spec import ControllerSpec
    with Controller(ControllerSpec(preload=())) as c:
        actors = c.spawn_host("h0").spawn_procs({{"ranks": 1}}).spawn("e", runtime_actors.Echo)
        actors.die.call("segfault")
        try:
            c.wait(timeout=30)
        except SupervisionError as exc:
            print(exc, file=sys.stderr)
            sys.exit(1)
    """
)


def test_unhandled_failure_at_root_exits_nonzero_with_report(tmp_path):
    script = tmp_path / "ctl.py"
    script.write_text(UNHANDLED_SCRIPT.format(tests=str(Path(__file__).parent)))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(Path(__file__).parents[2]),
    )
    assert done.returncode == 1
    assert "Failure: signal, SIGSEGV at h0/p0 [ranks=0] on h0: killed by SIGSEGV" in done.stderr


def test_warm_spare_is_adopted_then_replenished(tmp_path):
    journal = Journal(tmp_path / "j.jsonl", job="t")
    with Controller(FAST, journal=journal, on_failure=lambda f: True) as c:
        host = c.spawn_host("h0")
        host.keep_spares(2)
        spare_pids = {c.procs[r.ref.proc_id].pid for r in host.spares}
        assert len(spare_pids) == 2
        actors = host.spawn_procs({"ranks": 1}, fixed={"replica": 4}).spawn(
            "e", runtime_actors.Echo
        )
        got = actors.ping.call_one().get(timeout=20)
        assert got["pid"] in spare_pids  # adopted, not forked
        assert got["coords"] == {"replica": 4, "ranks": 0}  # with the mesh's coordinates
        # the pool is refilled in the background with a new process
        wait_for(lambda: len(host.spares) == 2, what="spares replenished")
        now = {c.procs[r.ref.proc_id].pid for r in host.spares}
        assert len(now - spare_pids) == 1
        # a spare that dies while idle is replaced; it is nobody's failure
        victim = c.procs[host.spares[0].ref.proc_id].pid
        os.kill(victim, 9)
        wait_for(
            lambda: (
                len(host.spares) == 2
                and victim not in {c.procs[r.ref.proc_id].pid for r in host.spares}
            ),
            what="dead spare replaced",
        )
        assert c.fatal is None
        # zero spares: plain forks still work
        host.keep_spares(0)
        assert (
            host.spawn_procs({"ranks": 1})
            .spawn("e", runtime_actors.Echo)
            .ping.call_one()
            .get(timeout=20)["pid"]
            not in now
        )
    adopted = [
        r
        for r in read_journal(tmp_path / "j.jsonl")
        if r["event"] == "proc.start" and r.get("spare") and "replica" in r
    ]
    assert len(adopted) == 1 and adopted[0]["replica"] == 4


def test_warmup_runs_in_the_agent_before_it_forks_and_workers_inherit_it():
    import dataclasses

    spec = dataclasses.replace(
        FAST,
        preload=("runtime_actors",),
        warmup=(("runtime_actors:warm", {"value": 42}),),
    )
    with Controller(spec, on_failure=lambda f: True) as c:
        host = c.spawn_host("h0")
        actors = host.spawn_procs({"ranks": 2}).spawn("w", runtime_actors.WarmReader)
        seen = list(actors.warmed.call().get(timeout=30).values())
    assert len(seen) == 2
    for s in seen:
        # built once, in the agent (the workers' parent), not in each worker
        assert s == {"value": 42, "pid": host.pid, "ppid": host.pid}
