"""Simulated host agents under a real controller, for ``ftharness bench scale``.

A simulated agent speaks the agent's side of the control channel and nothing more: it dials in
to the controller (``runtime.channel.connect``: the authenticated handshake, then frames sealed
with the session keys), says ``HelloAgent``, takes the ``AgentConfig``, answers ``AgentReady``
and then sends an ``AgentBeat`` every interval, on a phase of its own (agents start at different
times); it reads and drops the controller's beats. It forks no workers and preloads nothing.
Many of them share one ``selectors`` loop in each of a few processes (:func:`run_agents`), and
record how late their beats left (``send_lag``), so that a starved simulator is not mistaken for
a slow controller.

The controller runs alone in its own process (:func:`run_controller`) with the
``ExternalLauncher`` (agents started by someone else) and waits for every agent to dial in.
Over a window it measures its own CPU (user + system of all its threads,
``time.process_time``, divided by wall time: the fraction of one core), less the CPU of the one
sampling thread the bench adds, and the beats it missed: the sampler reads each host's
``last_beat`` (the controller's receive time of its latest beat) every quarter interval; a
gap of g >= 1.5 intervals between two beats counts round(g / interval) - 1 missed beats. Hosts
the controller declared lost (no beat for its timeout) are reported apart, and so are its
thread count (one reader thread per agent) and resident memory.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import selectors
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from experiments.bench.sim_members import recv_within
from runtime import channel
from runtime.messages import AgentBeat, AgentConfig, AgentReady, HelloAgent

_CTX = mp.get_context("spawn")


class _SimAgent:
    def __init__(self, name: str, conn: channel.Connection, interval_s: float) -> None:
        self.name = name
        self.conn = conn
        self.interval = interval_s
        self.next_beat = 0.0
        self.beats = 0
        self.open = True


def _dial(name: str, controller: tuple[str, int], secret: bytes) -> channel.Connection:
    """Dial in and go through HelloAgent -> AgentConfig -> AgentReady (blocking)."""
    conn = channel.connect(controller, secret, 30.0)
    conn.send(HelloAgent(name, os.getpid()))
    conn.sock.settimeout(30.0)
    cfg = conn.recv()
    if not isinstance(cfg, AgentConfig):
        raise channel.ChannelError(f"{name}: the controller answered {cfg!r:.80}")
    conn.send(AgentReady(name, os.getpid(), "127.0.0.1"))
    conn.sock.setblocking(False)
    return conn


def run_agents(
    names: list[str],
    controller: tuple[str, int],
    secret: bytes,
    interval_s: float,
    conn: Connection,
) -> None:
    """Simulated agents ``names`` in one selectors loop: they dial in one after the other, then
    beat until ``conn`` says stop; answers ``(beats sent, max send lag)``."""
    rng = random.Random(names[0] if names else 0)
    agents = [_SimAgent(name, _dial(name, controller, secret), interval_s) for name in names]
    start = time.monotonic()  # the first beats are due from here, each on its own phase
    for a in agents:
        a.next_beat = start + rng.uniform(0, interval_s)
    conn.send(len(agents))
    sel = selectors.DefaultSelector()
    for a in agents:
        sel.register(a.conn.sock, selectors.EVENT_READ, a)
    sel.register(conn.fileno(), selectors.EVENT_READ, None)
    lag = 0.0
    while True:
        now = time.monotonic()
        due = min((a.next_beat for a in agents if a.open), default=now + interval_s)
        for key, _ in sel.select(timeout=max(0.0, min(due - now, interval_s))):
            a = key.data
            if a is None:  # the bench: stop, and close every connection
                conn.recv()
                for x in agents:
                    x.conn.close()
                conn.send((sum(x.beats for x in agents), lag))
                return
            if not _drain(a):  # the controller's beats, or its Shutdown and close
                sel.unregister(a.conn.sock)
                a.conn.close()
                a.open = False
        now = time.monotonic()
        for a in agents:
            if a.open and now >= a.next_beat:
                lag = max(lag, now - a.next_beat)
                a.next_beat += a.interval
                a.beats += 1
                try:  # a few dozen bytes on an idle socket: never blocks
                    a.conn.sock.send(a.conn.sealer.seal(channel.encode(AgentBeat(time.time()))))
                except OSError:
                    a.open = False


def _drain(a: _SimAgent) -> bool:
    """Read and drop what the controller sent; False once the connection is over."""
    try:
        return bool(a.conn.sock.recv(1 << 16))
    except BlockingIOError:
        return True
    except OSError:
        return False


def run_controller(
    names: list[str],
    secret: bytes,
    interval_s: float,
    timeout_s: float,
    settle_s: float,
    window_s: float,
    conn: Connection,
) -> None:
    """A controller that expects agents ``names`` (sends its address on ``conn``), waits for
    them to dial in, settles, then measures for ``window_s``; sends the figures on ``conn``."""
    import psutil

    from runtime.controller import Controller
    from runtime.launchers import ExternalLauncher
    from runtime.spec import ControllerSpec, HeartbeatSpec

    spec = ControllerSpec(
        agent_heartbeat=HeartbeatSpec(interval_s=interval_s, timeout_s=timeout_s), preload=()
    )
    ctl = Controller(spec, secret=secret, launcher=ExternalLauncher())
    try:
        ctl.host_table.expect(names)  # before any dials in: an unexpected agent is refused
        conn.send(ctl.address)
        t0 = time.monotonic()
        ctl.wait_for_hosts(names, 60.0 + 0.2 * len(names))
        attach_s = time.monotonic() - t0
        time.sleep(settle_s)
        stop = threading.Event()
        sampled: dict[str, Any] = {}
        sampler = threading.Thread(
            target=_sample, args=(ctl, interval_s, stop, sampled), daemon=True
        )
        c0, w0 = time.process_time(), time.monotonic()
        sampler.start()
        time.sleep(window_s)
        stop.set()
        sampler.join()
        c1, w1 = time.process_time(), time.monotonic()
        cpu = max(0.0, c1 - c0 - sampled["cpu"]) / (w1 - w0)
        conn.send(
            {
                "controller_cpu": round(cpu, 4),
                "missed_beats": sampled["missed"],
                "lost_hosts": sum(1 for h in ctl.hosts.values() if h.lost),
                "max_beat_gap_s": round(sampled["max_gap"], 3),
                "beats_seen": sampled["beats"],
                "threads": threading.active_count(),  # one reader per agent, and a few
                "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
                "dial_in_s": round(attach_s, 2),
            }
        )
    finally:
        ctl.shutdown(grace_s=0.5)


def _sample(ctl: Any, interval_s: float, stop: threading.Event, out: dict[str, Any]) -> None:
    t_cpu = time.thread_time()
    hosts = list(ctl.hosts.values())
    prev = {h.name: h.last_beat for h in hosts}
    missed = beats = 0
    max_gap = 0.0

    def count(gap: float) -> int:
        return round(gap / interval_s) - 1 if gap >= 1.5 * interval_s else 0

    while not stop.wait(interval_s / 4):
        for h in hosts:
            lb = h.last_beat
            if lb != prev[h.name]:
                gap = lb - prev[h.name]
                prev[h.name] = lb
                beats += 1
                max_gap = max(max_gap, gap)
                missed += count(gap)
    now = time.monotonic()
    for h in hosts:  # a silence still open at the end counts too
        max_gap = max(max_gap, now - prev[h.name])
        missed += count(now - prev[h.name])
    out.update(missed=missed, beats=beats, max_gap=max_gap, cpu=time.thread_time() - t_cpu)


def measure_agents(
    hosts: int,
    *,
    interval_s: float = 1.0,
    timeout_s: float = 3.0,
    settle_s: float = 3.0,
    window_s: float = 20.0,
    procs: int = 2,
) -> dict[str, Any]:
    """Controller CPU and missed beats with ``hosts`` simulated agents (see the module doc)."""
    secret = channel.new_secret()
    names = [f"sim{i}" for i in range(hosts)]
    children: list[Any] = []
    sims: list[Connection] = []
    try:
        ours, theirs = _CTX.Pipe()
        ctl = _CTX.Process(
            target=run_controller,
            args=(names, secret, interval_s, timeout_s, settle_s, window_s, theirs),
            daemon=True,
        )
        ctl.start()
        children.append(ctl)
        theirs.close()
        address = recv_within(ours, 60.0)
        for p in range(procs):
            parent, child = _CTX.Pipe()
            sim = _CTX.Process(
                target=run_agents,
                args=(names[p::procs], address, secret, interval_s, child),
                daemon=True,
            )
            sim.start()
            children.append(sim)
            child.close()
            sims.append(parent)
        for c in sims:
            recv_within(c, 60.0 + 0.2 * hosts)
        result = recv_within(ours, 120.0 + settle_s + window_s + hosts * 0.2)
        ctl.join(30)
        sent, lag = 0, 0.0
        for c in sims:
            c.send("stop")
            s, lg = recv_within(c, 30.0)
            sent, lag = sent + s, max(lag, lg)
        return {"hosts": hosts, **result, "agent_send_lag_max_ms": round(1000 * lag, 1)}
    finally:
        for p in children:
            p.join(5)
            if p.is_alive():
                p.kill()
