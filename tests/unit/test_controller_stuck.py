"""A controller stuck without holding its lock is found (issue #26): ``Controller.stuck`` names
its monitor that stopped running, or its supervision thread held by one failure, as it names a
lock that cannot be taken; the keeper's beat stops on any of them (harness.job.controller_proc).

A real controller (its real threads, no hosts), each duty blocked for real on an event."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import runtime.controller as controller_mod
from runtime.controller import Controller
from runtime.failure import Cause, Failure
from runtime.spec import ControllerSpec, HeartbeatSpec


def _until(cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    return None


@pytest.fixture
def ctl():
    spec = ControllerSpec(
        preload=(),
        agent_heartbeat=HeartbeatSpec(interval_s=0.05, timeout_s=0.1),
        spawn_timeout_s=0.2,
    )
    c = Controller(spec)
    yield c
    c.shutdown(0.5)


def test_a_controller_with_every_duty_running_is_not_stuck(ctl):
    time.sleep(0.5)  # several monitor periods
    assert ctl.stuck(0.1) is None and ctl.responsive(0.1)


def test_a_monitor_blocked_without_the_lock_is_named(ctl):
    release = threading.Event()
    ctl.host_table.beat_and_check = lambda: release.wait(30)  # blocks the monitor's next turn
    try:
        why = _until(lambda: ctl.stuck(0.1))
        assert why is not None and "its monitor (host heartbeats and checks) has not run" in why
        assert not ctl.responsive(0.1)
    finally:
        release.set()
    assert _until(lambda: ctl.stuck(0.1) is None), "the monitor ran again"


def test_a_supervision_thread_held_by_one_failure_is_named(ctl, monkeypatch):
    monkeypatch.setattr(controller_mod, "SUPERVISION_STUCK_S", 0.2)
    release, entered = threading.Event(), threading.Event()

    def handle_failure(failure, child, generation):
        entered.set()
        release.wait(30)

    owner = SimpleNamespace(
        supervisor=SimpleNamespace(handle_failure=handle_failure), child="c", generation=0
    )
    ctl.deliver(Failure(cause=Cause.SIGNAL, detail="killed"), owner)
    try:
        assert entered.wait(5)
        assert ctl.stuck(0.1) is None  # not yet: a spawn may take spawn_timeout_s
        why = _until(lambda: ctl.stuck(0.1))
        assert why is not None and "supervision thread has been handling one failure" in why
    finally:
        release.set()
    assert _until(lambda: ctl.stuck(0.1) is None)


def test_a_lock_held_elsewhere_is_named(ctl):
    taken, release = threading.Event(), threading.Event()

    def hold():
        with ctl._lock:
            taken.set()
            release.wait(30)

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(5)
    try:
        why = ctl.stuck(0.1)
        assert why is not None and "lock was not free within 0.1 s" in why
    finally:
        release.set()
