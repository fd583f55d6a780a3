"""Simulated host agents under a real controller, for ``ftharness bench scale``.

A simulated agent speaks the agent's side of the control channel and nothing more: it listens,
runs the server side of the authenticated handshake (``runtime.channel.ServerHandshake``, fed
without blocking, as ``runtime.agent`` does), answers ``HelloController`` with ``AgentReady``
and then sends ``AgentBeat`` every interval, on a phase of its own (agents start at different
times). It forks no workers. Many of them share one ``selectors`` loop in each of a few
processes (:func:`run_agents`); each records how late its beats left (``send_lag``), so that a
starved simulator is not mistaken for a slow controller.

The controller runs alone in its own process (:func:`run_controller`) and connects to every
agent with ``Controller.attach_host``. Over a window it measures its own CPU (user + system of
all its threads, ``time.process_time``, divided by wall time: the fraction of one core), less
the CPU of the one sampling thread the bench adds, and the beats it missed: the sampler reads
each host's ``last_beat`` (the controller's receive time of its latest beat) every quarter
interval; a gap of g >= 1.5 intervals between two beats counts round(g / interval) - 1 missed
beats. Hosts the controller declared lost (no beat for its timeout) are reported apart.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import selectors
import socket
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from runtime import channel
from runtime.messages import AgentBeat, AgentReady, HelloController, Shutdown

_CTX = mp.get_context("spawn")


class _SimAgent:
    def __init__(self, name: str, secret: bytes, interval_s: float) -> None:
        self.name = name
        self.interval = interval_s
        self.listener = channel.listen("127.0.0.1", 0)
        self.listener.setblocking(False)
        self.secret = secret
        self.sock: socket.socket | None = None
        self.hs: channel.ServerHandshake | None = None
        self.authed = False
        self.decoder = channel.FrameDecoder()
        self.ready = False
        self.next_beat = 0.0
        self.beats = 0

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])


def run_agents(n: int, first: int, secret: bytes, interval_s: float, conn: Connection) -> None:
    """``n`` simulated agents named ``sim{first}``.. in one selectors loop; sends their ports
    on ``conn``, then serves until ``conn`` says stop; answers ``(beats sent, max send lag)``."""
    sel = selectors.DefaultSelector()
    agents = [_SimAgent(f"sim{first + i}", secret, interval_s) for i in range(n)]
    for a in agents:
        sel.register(a.listener, selectors.EVENT_READ, a)
    sel.register(conn.fileno(), selectors.EVENT_READ, None)
    conn.send([a.port for a in agents])
    lag = 0.0
    rng = random.Random(first)
    while True:
        now = time.monotonic()
        due = min((a.next_beat for a in agents if a.ready), default=now + interval_s)
        for key, _ in sel.select(timeout=max(0.0, min(due - now, interval_s))):
            a = key.data
            if a is None:  # the bench: stop, and close every connection
                conn.recv()
                for x in agents:
                    for sock in (x.sock, x.listener):
                        if sock is not None:
                            sock.close()
                conn.send((sum(x.beats for x in agents), lag))
                return
            if key.fileobj is a.listener:
                _accept(a, sel)
            elif not _on_data(a, rng):
                sel.unregister(a.sock)
                a.sock.close()
                a.ready = False
        now = time.monotonic()
        for a in agents:
            if a.ready and now >= a.next_beat:
                lag = max(lag, now - a.next_beat)
                a.next_beat += a.interval
                a.beats += 1
                try:
                    a.sock.sendall(channel.encode(AgentBeat(time.time())))
                except OSError:
                    a.ready = False


def _accept(a: _SimAgent, sel: selectors.BaseSelector) -> None:
    try:
        sock, _ = a.listener.accept()
    except BlockingIOError:
        return
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    a.sock, a.hs = sock, channel.ServerHandshake(a.secret)
    sock.send(a.hs.challenge)
    sel.register(sock, selectors.EVENT_READ, a)


def _on_data(a: _SimAgent, rng: random.Random) -> bool:
    """Handle what the controller sent; False once the connection is over."""
    assert a.sock is not None and a.hs is not None
    try:
        data = a.sock.recv(1 << 16)
    except BlockingIOError:
        return True
    except OSError:
        return False
    if not data:
        return False
    if not a.authed:
        proof = a.hs.feed(data)  # AuthError: a wrong secret is a bench bug, let it show
        if proof is None:
            return True
        a.authed = True
        a.sock.send(proof)
        data = a.hs.leftover
    a.decoder.feed(data)
    for msg in a.decoder.messages():
        if isinstance(msg, HelloController):
            # Small frames on a fresh non-blocking socket: sendall does not block here.
            a.sock.sendall(channel.encode(AgentReady(a.name, os.getpid())))
            a.ready = True
            a.next_beat = time.monotonic() + rng.uniform(0, a.interval)
        elif isinstance(msg, Shutdown):
            return False
    return True


def run_controller(
    addresses: list[tuple[str, tuple[str, int]]],
    secret: bytes,
    interval_s: float,
    timeout_s: float,
    settle_s: float,
    window_s: float,
    conn: Connection,
) -> None:
    """A controller that attaches every agent, settles, then measures for ``window_s``; sends
    the figures on ``conn``."""
    from runtime.controller import Controller
    from runtime.spec import ControllerSpec, HeartbeatSpec

    spec = ControllerSpec(
        agent_heartbeat=HeartbeatSpec(interval_s=interval_s, timeout_s=timeout_s), preload=()
    )
    ctl = Controller(spec, secret=secret)
    try:
        t0 = time.monotonic()
        for name, addr in addresses:
            ctl.attach_host(name, addr)
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
                "threads": threading.active_count(),
                "attach_s": round(attach_s, 2),
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
    sims: list[tuple[Any, Connection]] = []
    try:
        addresses: list[tuple[str, tuple[str, int]]] = []
        share = [hosts // procs + (1 if p < hosts % procs else 0) for p in range(procs)]
        first = 0
        for k in share:
            parent, child = _CTX.Pipe()
            p = _CTX.Process(
                target=run_agents, args=(k, first, secret, interval_s, child), daemon=True
            )
            p.start()
            child.close()
            ports = _recv(parent, 60.0)
            addresses += [(f"sim{first + i}", ("127.0.0.1", port)) for i, port in enumerate(ports)]
            sims.append((p, parent))
            first += k
        parent, child = _CTX.Pipe()
        ctl = _CTX.Process(
            target=run_controller,
            args=(addresses, secret, interval_s, timeout_s, settle_s, window_s, child),
            daemon=True,
        )
        ctl.start()
        child.close()
        result = _recv(parent, 120.0 + settle_s + window_s + hosts * 0.1)
        ctl.join(30)
        sent, lag = 0, 0.0
        for _, c in sims:
            c.send("stop")
            s, lg = _recv(c, 30.0)
            sent, lag = sent + s, max(lag, lg)
        return {"hosts": hosts, **result, "agent_send_lag_max_ms": round(1000 * lag, 1)}
    finally:
        for p, c in sims:
            with contextlib.suppress(OSError):
                c.close()
            p.join(5)
            if p.is_alive():
                p.kill()


def _recv(conn: Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer within {timeout_s} s")
    return conn.recv()
