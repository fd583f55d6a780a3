"""The controller's listener under connections that never authenticate (issue #31, item 2).

Idle connections and a slow-loris (one byte at a time) against a real Controller on loopback:
threads stay bounded (handshakes run on the listener's one thread), every held connection is
dropped by the handshake's one deadline (not one per ``recv``), and the job goes on meanwhile:
a new agent dials in through the flood, its worker connects, calls complete. A failed
``Thread.start`` costs one connection, not the job.

Bounds on time are generous on purpose (a 2-core machine shared with other tests): what is
asserted is the order of magnitude, seconds against the minute a per-``recv`` deadline allows.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace

import pytest
import runtime_actors
from test_runtime import FAST, wait_for

from runtime import channel
from runtime.controller import Controller
from runtime.listener import Listener

DEADLINE_S = 3.0  # the handshake deadline (connect_timeout_s) of these controllers
IDLE = 300  # more than the default max_pending_handshakes (256): some are evicted at once
THREAD_SLACK = 25  # the new host's serving thread, its worker's, timers: far below IDLE


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the peer has closed ``sock`` (EOF or reset) within ``timeout``; what it sent
    before (the challenge) is read and ignored."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


class _SlowLoris:
    """A connection that sends its handshake reply one byte every ``every_s`` (64 bytes: half a
    minute at 0.5 s), from a thread of its own; ``dropped_after`` is how long after its connect
    the controller closed it."""

    def __init__(self, address: tuple[str, int], every_s: float = 0.5) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.t0 = time.monotonic()
        self.dropped_after: float | None = None
        self._stop = threading.Event()
        self._every = every_s
        threading.Thread(target=self._trickle, daemon=True).start()

    def _trickle(self) -> None:
        for _ in range(channel.ServerHandshake.REPLY_BYTES):
            if self._stop.wait(self._every):
                return
            try:
                self.sock.send(b"\x00")
            except OSError:
                return

    def wait_dropped(self, timeout: float) -> float | None:
        if _closed_by_peer(self.sock, timeout):
            self.dropped_after = time.monotonic() - self.t0
        self._stop.set()
        self.sock.close()
        return self.dropped_after


@pytest.fixture
def ctl():
    c = Controller(replace(FAST, connect_timeout_s=DEADLINE_S), on_failure=lambda f: True)
    yield c
    c.shutdown(grace_s=0.5)


def test_idle_and_slow_connections_are_bounded_and_dropped_while_the_job_goes_on(ctl):
    actors = ctl.spawn_host("h0").spawn_procs({"ranks": 1}).spawn("e", runtime_actors.Echo)
    assert actors.ping.call_one(1).get(timeout=20)["x"] == 1
    threads_before = threading.active_count()

    idle = [socket.create_connection(ctl.address, timeout=10) for _ in range(IDLE)]
    loris = _SlowLoris(ctl.address)
    try:
        # the job goes on: calls complete, a new agent dials in, its worker connects
        assert actors.ping.call_one(2).get(timeout=20)["x"] == 2
        more = ctl.spawn_host("h1").spawn_procs({"ranks": 1}).spawn("e2", runtime_actors.Echo)
        assert more.ping.call_one(3).get(timeout=20)["x"] == 3
        threads_during = threading.active_count()
        assert threads_during <= threads_before + THREAD_SLACK, (threads_before, threads_during)

        # the slow-loris is dropped at its whole-handshake deadline, not after 64 trickled bytes
        dropped_after = loris.wait_dropped(timeout=25)
        assert dropped_after is not None and dropped_after < DEADLINE_S + 12, dropped_after
        # and so is every idle connection (the oldest ones at once, evicted)
        still_open = [s for s in idle if not _closed_by_peer(s, timeout=10)]
        assert still_open == []
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: ctl.listener.pending == 0, timeout=10, what="no handshake left in flight")
    assert ctl.listener.stats.timed_out >= 1 and ctl.listener.stats.evicted >= IDLE - 256
    assert actors.ping.call_one(4).get(timeout=20)["x"] == 4
    assert ctl.failures == [] and ctl.fatal is None


def test_a_failed_thread_start_costs_one_connection_not_the_job(ctl, monkeypatch):
    actors = ctl.spawn_host("h0").spawn_procs({"ranks": 1}).spawn("e", runtime_actors.Echo)
    real_start = threading.Thread.start
    failures = []

    def start(self: threading.Thread) -> None:
        # only the thread that would serve an authenticated peer, and only once
        if getattr(self._target, "__name__", "") == "_serve_peer" and not failures:
            failures.append(self)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    conn = channel.connect(ctl.address, ctl.secret, timeout=5)
    assert _closed_by_peer(conn.sock, timeout=10)  # that one connection is dropped...
    conn.close()
    assert failures
    time.sleep(0.5)
    # ... and the listener still serves: a new peer authenticates, workers connect, calls work
    channel.connect(ctl.address, ctl.secret, timeout=5).close()
    more = ctl.spawn_host("h1").spawn_procs({"ranks": 1}).spawn("e2", runtime_actors.Echo)
    assert more.ping.call_one(5).get(timeout=20)["x"] == 5
    assert actors.ping.call_one(6).get(timeout=20)["x"] == 6
    assert ctl.fatal is None


def test_the_oldest_pending_handshake_makes_room_for_a_new_one():
    """With ``max_pending`` handshakes in flight, one more drops the oldest; a real client that
    dials in then still authenticates at once."""
    secret = channel.new_secret()
    served: list[tuple[bytes, bytes]] = []
    listener = Listener(
        channel.listen(),
        secret,
        lambda sock, keys: (served.append(keys), sock.close()),
        timeout_s=30.0,
        max_pending=4,
    )
    threading.Thread(target=listener.run, daemon=True).start()
    idle = [socket.create_connection(listener.address, timeout=10) for _ in range(4)]
    try:
        wait_for(lambda: listener.pending == 4, timeout=10, what="4 handshakes in flight")
        newer = socket.create_connection(listener.address, timeout=10)
        idle.append(newer)
        assert _closed_by_peer(idle[0], timeout=10)  # the oldest, long before its 30 s
        assert not _closed_by_peer(idle[1], timeout=0.3)
        channel.connect(listener.address, secret, timeout=5).close()  # evicts idle[1]
        wait_for(lambda: served, timeout=10, what="the real client served")
        assert listener.stats.evicted == 2 and listener.stats.authenticated == 1
    finally:
        for s in idle:
            s.close()
        listener.close()


@pytest.mark.e2e
def test_a_thousand_idle_connections_and_a_slow_loris_at_the_default_deadline(capsys):
    """The measurement of issue #31 (run with ``-s -m e2e`` to see the figures): 1000 idle
    connections and a slow-loris against a live controller at the default handshake deadline
    (``connect_timeout_s`` = 10 s) and ``max_pending_handshakes`` (256)."""
    import psutil

    n = 1000
    me = psutil.Process()
    ctl = Controller(FAST, on_failure=lambda f: True)
    try:
        deadline = ctl.spec.connect_timeout_s
        actors = ctl.spawn_host("h0").spawn_procs({"ranks": 1}).spawn("e", runtime_actors.Echo)
        assert actors.ping.call_one(1).get(timeout=20)["x"] == 1
        before = (threading.active_count(), me.num_threads())
        peak = list(before)
        sampling = threading.Event()

        def sample() -> None:  # this sampler is one of the threads it counts
            while not sampling.wait(0.02):
                peak[0] = max(peak[0], threading.active_count())
                peak[1] = max(peak[1], me.num_threads())

        threading.Thread(target=sample, daemon=True).start()
        t0 = time.monotonic()
        idle = [socket.create_connection(ctl.address, timeout=10) for _ in range(n)]
        opened_s = time.monotonic() - t0
        loris = _SlowLoris(ctl.address)
        t1 = time.monotonic()
        channel.connect(ctl.address, ctl.secret, timeout=10).close()
        connect_s = time.monotonic() - t1
        t1 = time.monotonic()
        more = ctl.spawn_host("h1").spawn_procs({"ranks": 1}).spawn("e2", runtime_actors.Echo)
        assert more.ping.call_one(2).get(timeout=30)["x"] == 2
        new_host_s = time.monotonic() - t1
        assert actors.ping.call_one(3).get(timeout=30)["x"] == 3
        during = (threading.active_count(), me.num_threads())
        loris_s = loris.wait_dropped(timeout=deadline + 30)
        open_left = [s for s in idle if not _closed_by_peer(s, timeout=deadline + 10)]
        all_dropped_s = time.monotonic() - t0
        for s in idle:
            s.close()
        wait_for(lambda: ctl.listener.pending == 0, timeout=10, what="no handshake in flight")
        sampling.set()
        time.sleep(0.1)
        after = (threading.active_count(), me.num_threads())
        stats = ctl.listener.stats
        with capsys.disabled():
            print(
                f"\n{n} idle connections + 1 slow-loris (1 byte / 0.5 s), handshake deadline "
                f"{deadline:g} s, max_pending_handshakes {ctl.spec.max_pending_handshakes}:\n"
                f"  threads (python, os): before {before}, during {during}, peak {tuple(peak)} "
                f"(the sampler included), after {after}\n"
                f"  opened {n} in {opened_s:.2f} s; an authenticated connect during the flood "
                f"{connect_s * 1000:.1f} ms; a new agent + worker + call {new_host_s:.2f} s\n"
                f"  slow-loris dropped {loris_s or float('nan'):.2f} s after its connect; all {n} "
                f"idle dropped "
                f"{all_dropped_s:.1f} s after the first connect; still open: {len(open_left)}\n"
                f"  listener stats: {stats}"
            )
        assert loris_s is not None and loris_s < deadline + 15
        assert open_left == [] and peak[0] <= before[0] + THREAD_SLACK
        assert ctl.failures == [] and ctl.fatal is None
    finally:
        ctl.shutdown(grace_s=0.5)
