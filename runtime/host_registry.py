"""The controller's hosts: agents that dial in, their liveness both ways, and their loss.

A host's agent is started through the launcher (or by someone else, ``ftharness agent``) and
dials in to the controller's listener; :meth:`HostTable.adopt` configures it, waits until it has
preloaded, registers it and then serves its connection on that thread. Liveness runs both ways
on one timer (:meth:`HostTable.beat_and_check`): the controller beats to every agent (an agent
that hears nothing for ``controller_silence_s`` fences itself) and declares lost an agent silent
for the agent heartbeat timeout. What a loss means for the processes on that host is the
controller's business (``on_host_lost``).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from runtime import channel
from runtime.host_handle import HostAgentHandle
from runtime.launchers import Launcher
from runtime.messages import (
    AgentBeat,
    AgentConfig,
    AgentReady,
    AgentReport,
    ControllerBeat,
    DropConnections,
    HelloAgent,
    QuorumUpstream,
    Shutdown,
)
from runtime.spares import SparePool
from runtime.spec import ControllerSpec
from runtime.takeover import Succession

log = logging.getLogger("ftharness.controller")


class AgentRefused(channel.ChannelError):
    """A host agent answered its configuration with ``channel.Refused``: it cannot serve this
    job (``runtime.agent.run``: no address where ``network.interface``/``cidr`` says)."""


class HostOwner(Protocol):
    """What the table needs of its controller."""

    spec: ControllerSpec
    launcher: Launcher
    secret: bytes
    address: tuple[str, int]
    closed: bool
    epoch: int
    succession: Succession

    def spawn_many(self, requests: Any, *, log_dir: Any = None, cold: bool = False) -> Any: ...

    def make_spare_pool(self, host: Callable[[], HostAgentHandle]) -> SparePool: ...

    def on_agent_message(self, h: HostAgentHandle, msg: Any) -> None: ...

    def on_host_lost(self, h: HostAgentHandle, why: str) -> None: ...

    def on_agent_report(self, h: HostAgentHandle, report: AgentReport) -> None: ...

    def guarded(self, target: Callable[..., None], name: str, *args: Any) -> None: ...


class HostTable:
    def __init__(self, owner: HostOwner) -> None:
        self._owner = owner
        self._lock = threading.Lock()
        self.hosts: dict[str, HostAgentHandle] = {}
        self._expected: dict[str, cf.Future] = {}  # hosts whose agent is to dial in
        # host -> (connection, hello) of the one agent being adopted under that name right now
        self._dialling: dict[str, tuple[channel.Connection, HelloAgent]] = {}
        self._proc_numbers: dict[str, itertools.count] = {}
        # Where the quorum service serves (ControllerSpec.quorum_relay); its lock orders every
        # read of it with its send, so that an agent's last word is the latest address.
        self.quorum_upstream = ""
        self._upstream_lock = threading.Lock()

    # -- starting and dialling in -----------------------------------------------------------
    def boot_settings(self, name: str) -> dict[str, Any]:
        """What an agent needs to dial in (``runtime.agent.Boot``), the secret included: hand it
        over on stdin or in a 0600 file, never on a command line."""
        import sys

        o = self._owner
        return {
            "name": name,
            "controller_host": o.address[0],
            "controller_port": o.address[1],
            "secret": o.secret.hex(),
            "sys_path": [p for p in sys.path if p],
            "dial_timeout_s": o.spec.connect_timeout_s + 30.0,
            **o.succession.boot_settings(),  # control_file, grace_s: outlive this controller
        }

    def expect(self, names: list[str]) -> dict[str, cf.Future]:
        """Futures that resolve when each named agent has dialled in and is ready."""
        with self._lock:
            for name in names:
                fut = self._expected.get(name)
                if fut is None or fut.done():
                    self._expected[name] = cf.Future()
            return {name: self._expected[name] for name in names}

    def wait_for(self, names: list[str], timeout_s: float) -> list[HostAgentHandle]:
        """Block until every named agent has dialled in; ChannelError naming the missing ones
        after ``timeout_s``."""
        futs = self.expect([n for n in names if n not in self.hosts or self.hosts[n].lost])
        cf.wait(list(futs.values()), timeout=timeout_s)
        for f in futs.values():  # an agent that said it cannot serve this job (_configure)
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        missing = sorted(n for n, f in futs.items() if not f.done())
        if missing:
            host, port = self._owner.address
            raise channel.ChannelError(
                f"host agent(s) {', '.join(missing)} did not dial in to {host}:{port} "
                f"within {timeout_s:g} s"
            )
        return [self.hosts[n] for n in names]

    def reserve_proc_numbers(self, name: str, highest: int) -> None:
        """Number host ``name``'s next processes past ``highest`` (``name/pN``): a takeover
        controller restarting a host whose agent never re-dialled knows from the journal which
        numbers a previous controller used there."""
        with self._lock:
            self._proc_numbers[name] = itertools.count(highest + 1)

    def start(self, name: str) -> HostAgentHandle:
        """Start ``name``'s agent through the launcher and wait for it to dial in (call from the
        controller's long-lived spawner thread: a local agent dies with the thread that forked
        it)."""
        fut = self.expect([name])[name]
        launcher = self._owner.launcher
        launcher.start(name, self.boot_settings(name))
        timeout = self._owner.spec.connect_timeout_s + 30.0
        try:
            return fut.result(timeout=timeout)
        except cf.TimeoutError:
            launcher.kill(name)
            raise channel.ChannelError(
                f"host agent {name} did not dial in within {timeout:g} s"
            ) from None

    def adopt(self, conn: channel.Connection, hello: HelloAgent) -> None:
        """An agent dialled in: configure it, wait until it is ready, then serve it on this
        thread until it goes away.

        One agent per host name. The name must be expected (being started, or waited for) or
        belong to a lost host (its new agent replaces the old one, whose connection is closed,
        so that an old agent still running fences itself at once). A second agent under a name
        whose agent is live, or is dialling in right now, is refused: it gets
        ``channel.Refused`` with the reason and the running one keeps its host (a scheduler's
        respawn racing the step before it must not cost the host). An agent nobody expects is
        dropped without a word, as any peer that says something unexpected."""
        name = hello.host
        with self._lock:
            refusal = self._refusal(hello)
            if refusal is None:
                self._dialling[name] = (conn, hello)  # claimed: one adoption at a time
        if refusal is not None:
            self._refuse(conn, refusal)
            return
        try:
            try:
                h = self._configure(conn, hello)
            except AgentRefused as exc:  # fails its start now, not after the dial-in timeout
                with self._lock:
                    fut = self._expected.pop(name, None)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                conn.close()
                return
            with self._lock:
                old = self.hosts.get(name)
                self.hosts[name] = h
                fut = self._expected.pop(name, None)
        finally:
            with self._lock:
                if self._dialling.get(name, (None,))[0] is conn:
                    del self._dialling[name]
        if self._owner.spec.quorum_relay:  # it may have moved while this agent was configured
            self._tell_quorum_upstream(h)
        if old is not None and old.conn is not None:
            _retire(old.conn)  # lost already (else we had refused): its agent must stop
        if hello.report is not None:  # a previous controller's agent: its workers are ours now
            self._owner.on_agent_report(h, hello.report)
        if fut is not None and not fut.done():
            fut.set_result(h)
        self._owner.guarded(self._serve, f"agent-{name}", h)

    def _refusal(self, hello: HelloAgent) -> str | None:
        """Why ``hello``'s agent may not have its host now (None: it may); FrameError for an
        agent nobody expects. Called under the lock. Not guaranteed: an agent that died but is
        not declared lost yet (within the agent heartbeat timeout) still holds its name, and a
        claim is held until the adoption ends (at most ``connect_timeout_s`` + 30 s)."""
        name = hello.host
        dialling = self._dialling.get(name)
        if dialling is not None:
            return (
                f"another agent (pid {dialling[1].pid}) is dialling in as host {name!r} right "
                f"now; this one (pid {hello.pid}) is refused: one agent per host"
            )
        known = self.hosts.get(name)
        if known is not None and not known.lost:
            return (
                f"host {name!r} already has a live agent (pid {known.pid}, heard from "
                f"{time.monotonic() - known.last_beat:.1f} s ago); this one (pid {hello.pid}) "
                "is refused: one agent per host, and the running one keeps it"
            )
        if known is None and name not in self._expected and hello.report is None:
            # An agent with a report outlived the controller before us: it holds the job
            # secret, and a takeover controller knows its hosts only from them.
            raise channel.FrameError(f"unexpected host agent {name!r}")
        return None

    def _refuse(self, conn: channel.Connection, reason: str) -> None:
        log.warning("controller: refusing a host agent: %s", reason)
        with contextlib.suppress(channel.ChannelError):
            conn.send(channel.Refused(reason))
        conn.close()

    def _configure(self, conn: channel.Connection, hello: HelloAgent) -> HostAgentHandle:
        """Send ``hello``'s agent its configuration and wait until it is ready (preloading torch
        takes seconds); its handle, not registered yet."""
        spec = self._owner.spec
        conn.send(
            AgentConfig(
                preload=tuple(spec.preload),
                warmup=tuple(spec.warmup),
                heartbeat_interval_s=spec.heartbeat.interval_s,
                heartbeat_timeout_s=spec.heartbeat.timeout_s,
                agent_heartbeat_interval_s=spec.agent_heartbeat.interval_s,
                controller_silence_s=spec.controller_silence_s,
                connect_timeout_s=spec.connect_timeout_s,
                start_timeout_s=spec.spawn_timeout_s,
                network_interface=spec.network_interface,
                network_cidr=spec.network_cidr,
                epoch=self._owner.epoch,
                quorum_relay=spec.quorum_relay,
                quorum_upstream=self.quorum_upstream,
            )
        )
        conn.sock.settimeout(spec.connect_timeout_s + 30.0)
        ready = conn.recv()
        conn.sock.settimeout(None)
        if isinstance(ready, channel.Refused):  # e.g. no address where network.* says
            raise AgentRefused(f"host agent {hello.host} cannot serve this job: {ready.reason}")
        if not isinstance(ready, AgentReady):
            raise channel.FrameError(f"agent {hello.host} answered {ready!r:.80}")
        pool = self._owner.make_spare_pool(lambda: h)
        h = HostAgentHandle(self._owner, hello.host, pool, self._owner.launcher)
        # Process ids stay unique for the whole job: a host's new agent (after an eviction or a
        # partition) continues its predecessor's numbering instead of reusing host1/p0...
        first = hello.report.highest_proc + 1 if hello.report is not None else 0
        with self._lock:
            h.proc_numbers = self._proc_numbers.setdefault(hello.host, itertools.count(first))
        if hello.report is not None:  # not our child: stopped and killed by its pid
            adopt = getattr(self._owner.launcher, "adopt", None)
            if adopt is not None:
                adopt(hello.host, ready.pid)
        h.conn, h.pid, h.address = conn, ready.pid, ready.address
        h.last_beat = time.monotonic()
        return h

    def _serve(self, h: HostAgentHandle) -> None:
        assert h.conn is not None
        while True:
            try:
                msg = h.conn.recv()
            except channel.ChannelError as exc:
                self.lost(h, f"agent connection closed ({exc})")
                return
            if isinstance(msg, AgentBeat):
                h.last_beat = time.monotonic()
                continue
            try:
                self._owner.on_agent_message(h, msg)
            except channel.FrameError as exc:
                self.lost(h, str(exc))
                return

    # -- liveness and loss ------------------------------------------------------------------
    def lost(self, h: HostAgentHandle, why: str) -> None:
        """Declare ``h`` lost (once): no more spares there, take it down out of band where the
        launcher can (a frozen agent must not train on), have every other host close its
        connections to it (a collective blocked on it fails now, not at its timeout), and fail
        its processes."""
        self._owner.succession.check(f"declaring host {h.name} lost")
        with self._lock:
            if h.lost or self._owner.closed:
                return
            h.lost = True
        h.pool.closed = True
        h.kill()
        self.cut_off(h)
        self._owner.on_host_lost(h, why)

    def cut_off(self, lost: HostAgentHandle) -> None:
        """Tell every other live host to close its connections to ``lost`` (see
        ``runtime.messages.DropConnections``)."""
        for h in list(self.hosts.values()):
            if h is not lost and not h.lost and h.conn is not None:
                with contextlib.suppress(channel.ChannelError):
                    h.conn.send(DropConnections(lost.address))

    def set_quorum_upstream(self, address: str) -> None:
        """The quorum service serves at ``address`` now: every agent's relay forwards there
        (``runtime.relay``); an agent that dials in later gets it in its ``AgentConfig``."""
        with self._upstream_lock:
            self.quorum_upstream = address
        for h in list(self.hosts.values()):
            self._tell_quorum_upstream(h)

    def _tell_quorum_upstream(self, h: HostAgentHandle) -> None:
        """Send ``h``'s agent the quorum's address (again: the same one changes nothing)."""
        if h.lost or h.conn is None:
            return
        with self._upstream_lock, contextlib.suppress(channel.ChannelError):
            h.conn.send(QuorumUpstream(self.quorum_upstream))

    def beat_and_check(self) -> None:
        """One tick of liveness: beat to every live agent, and declare lost those silent for
        longer than the agent heartbeat timeout."""
        timeout = self._owner.spec.agent_heartbeat.timeout_s
        now = time.monotonic()
        for h in list(self.hosts.values()):
            if h.lost:
                continue
            if h.conn is not None:
                with contextlib.suppress(channel.ChannelError):
                    h.conn.send(ControllerBeat(time.time()))
            if now - h.last_beat > timeout:
                self.lost(h, f"no agent heartbeat for {now - h.last_beat:.2f} s")

    def shutdown(self, grace_s: float) -> None:
        """Tell every agent to stop its workers and exit; wait for them, then kill what is left."""
        launcher = self._owner.launcher
        for h in list(self.hosts.values()):
            if h.conn is not None and not h.lost:
                with contextlib.suppress(channel.ChannelError):
                    h.conn.send(Shutdown(grace_s))
        for h in list(self.hosts.values()):
            launcher.stop(h.name, grace_s + 3.0)
            if h.conn is not None:
                h.conn.close()
        launcher.close()


def _retire(conn: channel.Connection) -> None:
    """Close the connection of a lost host's agent that a new agent replaces: ``shutdown`` wakes
    the thread blocked reading it (a bare close would not), and the old agent, if it still runs,
    reads the end of its link and fences itself now instead of after ``controller_silence_s``."""
    with contextlib.suppress(OSError):
        conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
