"""Failures the runtime must never swallow or wait on: an actor's escaping exception, an
oversized reply, a dead control-plane thread, one group's slow restart, a stopped controller."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import runtime_actors
from test_runtime import FAST, wait_for

from faults import inworker
from runtime.actor import RemoteError
from runtime.channel import MAX_FRAME
from runtime.controller import Controller
from runtime.failure import Cause, Failure
from runtime.spec import Strategy, SupervisorSpec


@pytest.fixture
def ctl():
    c = Controller(FAST, on_failure=lambda f: True)
    yield c
    c.shutdown(grace_s=0.5)


def test_exception_escaping_a_supervised_endpoint_is_a_failure_value(ctl):
    host = ctl.spawn_host("h0")
    restarts: list[int] = []
    sup = ctl.supervisor("job", SupervisorSpec(max_restarts=3, within_s=60))
    sup.add_child(
        "loop", lambda: host.spawn_procs({"rank": 1}).spawn("s", runtime_actors.Supervised)
    )
    sup.on_restart = lambda name, inst: restarts.append(inst.pid.call_one().get(timeout=20))
    first = sup.child("loop")
    pid = first.pid.call_one().get(timeout=20)
    with pytest.raises(RemoteError, match="the loop gave up"):
        first.run.call_one(True).get(timeout=20)
    failure = wait_for(lambda: next(iter(ctl.failures), None), what="a failure value")
    assert failure.cause is Cause.EXCEPTION
    assert "RuntimeError: the loop gave up" in failure.detail
    assert "the loop gave up" in (failure.traceback or "")
    assert failure.coords == {"rank": 0}
    wait_for(lambda: not psutil.pid_exists(pid) or _zombie(pid), what="the crashed worker gone")
    # its supervisor restarted it, and the new one serves
    wait_for(lambda: restarts, what="a restart")
    assert restarts[0] != pid
    assert sup.child("loop").run.call_one(False).get(timeout=20) == "done"


def test_a_plain_endpoint_that_raises_leaves_its_process_serving(ctl):
    actors = ctl.spawn_host("h0").spawn_procs({"rank": 1}).spawn("e", runtime_actors.Echo)
    with pytest.raises(RemoteError, match="boom"):
        actors.boom.call_one().get(timeout=20)
    assert actors.ping.call_one(1).get(timeout=20)["x"] == 1
    assert ctl.failures == []


def test_oversized_reply_is_a_remote_error_and_the_worker_lives_on(ctl):
    actors = ctl.spawn_host("h0").spawn_procs({"rank": 1}).spawn("s", runtime_actors.Supervised)
    pid = actors.pid.call_one().get(timeout=20)
    with pytest.raises(RemoteError, match="exceeds MAX_FRAME"):
        actors.reply_of.call_one(MAX_FRAME + 1).get(timeout=60)
    assert actors.reply_of.call_one(10).get(timeout=20) == b"x" * 10
    assert actors.pid.call_one().get(timeout=20) == pid
    assert ctl.failures == []


def test_a_control_plane_thread_that_dies_stops_the_job_with_its_traceback():
    c = Controller(FAST)
    try:
        host = c.spawn_host("h0")
        actors = host.spawn_procs({"rank": 1}).spawn("e", runtime_actors.Echo)

        def broken(*args: object) -> None:
            raise KeyError("a bug in exit handling")

        c._on_exit = broken  # type: ignore[method-assign]
        actors.die.call_one("sigkill")
        assert c.fatal_event.wait(20), "the job hung instead of stopping"
        assert c.fatal is not None
        assert c.fatal.cause is Cause.EXCEPTION
        assert "controller thread agent-h0 died" in c.fatal.detail
        assert "a bug in exit handling" in (c.fatal.traceback or "")
    finally:
        c.shutdown(grace_s=0.5)


def test_one_groups_slow_restart_does_not_hold_up_anothers(ctl):
    """Group a's restart blocks until group b has been restarted: with restarts run one after
    the other on the supervision thread, b's restart would wait behind a's forever."""
    host = ctl.spawn_host("h0")
    job = ctl.supervisor("job", SupervisorSpec(max_restarts=0))
    b_restarted = threading.Event()
    a_saw_b: list[bool] = []
    starts = {"a": 0}

    def start_a():
        starts["a"] += 1
        if starts["a"] > 1:  # the restart: hold it until b is back
            a_saw_b.append(b_restarted.wait(30))
        return host.spawn_procs({"rank": 1}).spawn("e", runtime_actors.Echo)

    spec = SupervisorSpec(strategy=Strategy.ONE_FOR_ALL, max_restarts=3, within_s=60)
    a = job.add_supervisor("a", spec)
    a.add_child("ranks", start_a)
    b = job.add_supervisor("b", spec, on_restart=lambda *_: b_restarted.set())
    b.add_child("ranks", lambda: host.spawn_procs({"rank": 1}).spawn("e", runtime_actors.Echo))
    a.child("ranks").die.call_one("sigkill")
    time.sleep(0.2)  # a's restart is now waiting
    b.child("ranks").die.call_one("sigkill")
    wait_for(lambda: a_saw_b, timeout=40, what="a's restart to finish")
    assert a_saw_b == [True]
    wait_for(lambda: not a.children["ranks"].restarting, what="a's restart to return")
    assert a.child("ranks").ping.call_one(1).get(timeout=20)["x"] == 1


def test_late_failure_of_a_replaced_incarnation_is_ignored():
    """A failure report about a process of an earlier generation of a child must not restart
    the child's current incarnation (Supervisor.handle_failure's generation check)."""
    calls: list[str] = []

    class Plane:
        spec = FAST

        def owning(self, owner):
            import contextlib

            return contextlib.nullcontext()

        def deliver(self, failure, owner):
            calls.append("deliver")

        def stop_procs(self, ids, grace_s=None):
            calls.append("stop")

        def emit(self, event, **fields):
            calls.append(fields.get("decision", event))

    from runtime.supervisor import Supervisor

    sup = Supervisor(Plane(), "g", SupervisorSpec(max_restarts=5, within_s=60))  # type: ignore[arg-type]
    sup.add_child("ranks", lambda: None)
    assert sup.children["ranks"].generation == 0
    f = Failure(cause=Cause.SIGNAL, detail="killed")
    sup.handle_failure(f, "ranks", 0)
    wait_for(lambda: not sup.children["ranks"].restarting, what="restart done")
    assert sup.children["ranks"].generation == 1
    n = len(calls)
    sup.handle_failure(f, "ranks", 0)  # the second rank of the old incarnation reports late
    assert len(calls) == n and sup.children["ranks"].generation == 1


STOPPED_CONTROLLER = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import runtime_actors
    from runtime.controller import Controller
    from runtime.spec import ControllerSpec, HeartbeatSpec
    spec = ControllerSpec(preload=(), agent_heartbeat=HeartbeatSpec(interval_s=0.2, timeout_s=600))
    c = Controller(spec, on_failure=lambda f: True)
    host = c.spawn_host("h0")
    chat = host.spawn_procs({{"rank": 1}}).spawn("c", runtime_actors.Chatter)
    echo = host.spawn_procs({{"rank": 1}}).spawn("e", runtime_actors.Echo)
    victim = echo.pid.call_one().get(timeout=30)
    chat.chatter.call_one({counter!r}, 60.0)
    print(host.pid, victim, flush=True)
    time.sleep(600)
    """
)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _count(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


@pytest.mark.timeout(120)
def test_a_stopped_controller_blocks_neither_training_nor_reaping(tmp_path):
    """SIGSTOP the controller: a worker emitting an event per iteration keeps going (its sends
    never block on the stopped reader), and the agent still reaps a worker that dies."""
    counter = tmp_path / "count"
    script = STOPPED_CONTROLLER.format(tests=str(Path(__file__).parent), counter=str(counter))
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=os.getcwd(), text=True
    )
    try:
        agent_pid, victim = map(int, proc.stdout.readline().split())
        wait_for(lambda: _count(counter) > 100, timeout=30, what="the worker to start emitting")
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.0)  # far more than the kernel buffers hold at this rate
        before = _count(counter)
        time.sleep(3.0)
        after = _count(counter)
        assert after > before + 100, (
            f"the worker stalled behind a stopped controller ({before}->{after})"
        )
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(victim), timeout=10, what="the agent to reap it")
        assert psutil.Process(agent_pid).status() != psutil.STATUS_STOPPED
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


def test_workers_inherit_the_agents_imports_frozen_out_of_the_collector():
    """The agent freezes what it imported before forking: a full gc.collect() in a worker (the
    failure path runs one) must not walk torch's ~300K objects (seconds on a loaded machine,
    long enough to miss heartbeats and be killed as hung)."""
    import dataclasses

    c = Controller(dataclasses.replace(FAST, preload=("torch",)), on_failure=lambda f: True)
    try:
        (proc_id,) = c.spawn_host("h0").spawn_procs({"rank": 1}).proc_ids
        frozen = c.run_in_worker(proc_id, gc.get_freeze_count).result(timeout=30)
        assert frozen > 50_000
    finally:
        c.shutdown(grace_s=0.5)


def test_process_ids_stay_unique_when_a_host_gets_a_new_agent(ctl):
    """Journal records name processes by id: a lost host's new agent must not reuse its
    predecessor's ids (a stale process would look like its successor)."""
    first = ctl.spawn_host("h0").spawn_procs({"rank": 2}).proc_ids
    ctl.host_table.lost(ctl.hosts["h0"], "test")
    second = ctl.spawn_host("h0").spawn_procs({"rank": 2}).proc_ids
    assert not set(first) & set(second), (first, second)


def test_a_cold_worker_slow_to_import_is_not_hung():
    """A cold worker's imports may hold the GIL (its heartbeat thread stops) far longer than the
    heartbeat timeout: until it says it has started it is judged against the start timeout. Once
    started, the heartbeat timeout applies again: the same GIL held then is a hang."""
    import dataclasses

    failures: list[Failure] = []
    spec = dataclasses.replace(FAST, preload=("slow_cold_import",))  # heartbeat timeout 0.6 s
    c = Controller(spec, on_failure=lambda f: failures.append(f) or True)
    try:
        (proc_id,) = c.spawn_host("h0").spawn_procs({"rank": 1}, cold=True).proc_ids
        time.sleep(2 * FAST.heartbeat.timeout_s)
        assert c.run_in_worker(proc_id, os.getpid).result(timeout=10) > 0
        assert failures == [], failures
        c.run_in_worker(proc_id, inworker.hold_gil, 30.0).result(timeout=10)
        wait_for(lambda: failures, timeout=10, what="the started worker to be found hung")
        assert failures[0].cause is Cause.MISSED_HEARTBEAT, failures[0]
    finally:
        c.shutdown(grace_s=0.5)
