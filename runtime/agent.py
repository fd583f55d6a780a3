"""The host agent: one per host. Forks, reaps and watches the worker processes of its host.

An agent dials in to the controller (``runtime.channel`` handshake over the job secret), says
which host it is (``HelloAgent``), gets its configuration (``AgentConfig``), imports the preload
modules (torch) once and answers ``AgentReady`` with the address other hosts reach it at. Local
agents are started by the controller's launcher (``python -m runtime.agent``, the boot settings
and the secret as one JSON line on stdin); an agent on another machine is started by hand or by a
scheduler (``ftharness agent --controller HOST:PORT --secret-file PATH --name NAME``).

It is single-threaded on purpose: it forks workers from its only thread, so a worker starts
with torch already imported in milliseconds and no lock held by another thread. Everything is
one ``selectors`` loop:

* the controller connection (frames in; frames out through a buffer, never blocking);
* SIGCHLD through a wakeup pipe: ``waitpid`` reaps a dead worker the moment it dies;
* one heartbeat socketpair per worker: a worker silent for ``heartbeat_timeout_s`` is hung;
* the connectivity preflight's listener and probes, before training (``runtime.preflight``);
* timers: SIGKILL after a stop's grace period, heartbeats to the controller, and the
  controller's silence: past ``controller_silence_s`` without a frame from it (a network
  partition, a dead controller) the agent fences itself: it stops every worker and exits, so a
  cut-off host never trains on alone.

The one exception: where the job asks for it (``AgentConfig.quorum_relay``), the quorum relay's
threads (``runtime.relay``: they hold no lock a worker needs, and a worker closes its copies of
their sockets).

A local agent also dies with the controller (PR_SET_PDEATHSIG). It is a child subreaper, so
nothing below it escapes. With survival on (``Boot.control_file``: a controller that can be
replaced) it does neither: it keeps its workers for ``grace_s`` and re-dials the controller the
run's control file names (``runtime.orphan``).

It logs at WARNING; ``FTHARNESS_AGENT_LOG_LEVEL=INFO`` in its environment (a local agent
inherits ``ftharness``'s) also logs each unblocking of a dead program group's survivors
(``runtime.sockets``: how many connections of how many survivors, and how long it took).

Why this module is longer than 500 lines: it is the whole host agent process: its one selector loop
over the controller's connection, the workers' heartbeats and the reaping of children, which share
the agent's state and are read together; forking and warm spares are ``runtime.spares``, programs
``runtime.program_proc``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import psutil
import tenacity

from runtime import channel, group_store, netaddr, orphan, proctree, sockets
from runtime.actor import resolve
from runtime.channel import FrameError
from runtime.control_file import read_secret
from runtime.messages import (
    WORKER_STARTED,
    AgentBeat,
    AgentConfig,
    AgentReady,
    ControllerBeat,
    DropConnections,
    Exited,
    HelloAgent,
    Hung,
    PreflightCommand,
    QuorumUpstream,
    ServeStore,
    Shutdown,
    Spawn,
    Spawned,
    SpawnProgram,
    StopProc,
    StoreServed,
    UnblockPeers,
)
from runtime.preflight import AgentPreflight
from runtime.relay import RELAY_ENV, VIA_RELAY, configure_relay

log = logging.getLogger("ftharness.agent")

#: Bytes queued for a peer that does not read before it is dropped (a beat is ~60 bytes every
#: 0.2 s: this is minutes of a stopped controller, far past its heartbeat timeout).
MAX_BACKLOG = 4 << 20


@dataclass
class _Worker:
    proc_id: str
    pid: int
    hb: socket.socket | None  # None: a program of the user's own (no heartbeat)
    last_beat: float
    # False while a cold worker imports (until it sends WORKER_STARTED): silence is then judged
    # against the start timeout, not the heartbeat timeout
    started: bool = True
    hung_reported: bool = False
    kill_at: float | None = None
    kill_pids: list[int] = field(default_factory=list)
    popen: Any = None  # a program's Popen: kept so subprocess never reaps it behind our back
    group: int | None = None  # a program's replica group (its peers: runtime.sockets)
    unblocked: bool = False  # its group's survivors were unblocked already (once per death)
    coords: dict[str, int] = field(default_factory=dict)  # as spawned (AgentReport)


class Agent:
    def __init__(self, boot: Boot, conn: channel.Connection, cfg: AgentConfig, address: str):
        self.host = boot.name
        self.secret = boot.secret
        self.controller_addr = boot.controller
        self.address = address
        self.cfg = cfg
        self.hb_interval = cfg.heartbeat_interval_s
        self.hb_timeout = cfg.heartbeat_timeout_s
        self.connect_timeout = cfg.connect_timeout_s
        self.sel = selectors.DefaultSelector()
        self.conn: channel.Connection | None = conn  # None while orphaned (runtime.orphan)
        self.epoch = cfg.epoch  # the highest controller epoch served: never obey a lower one
        self.survival = (
            orphan.Survival(boot.control_file, boot.grace_s)
            if boot.control_file and boot.grace_s > 0
            else None
        )
        self.highest_proc = -1  # the highest N of the host/pN this agent was asked to start
        self.workers: dict[int, _Worker] = {}  # by pid
        self.stores: dict[int, int] = {}  # replica group -> pid of its store (runtime.group_store)
        self.out = orphan.FrameQueue()  # frames not yet accepted by the kernel
        self.wake_r, self.wake_w = socket.socketpair()
        self.next_agent_beat = 0.0
        self.last_heard = time.monotonic()
        # GLOO/NCCL_SOCKET_IFNAME and FTHARNESS_ADVERTISE for every worker and program
        self.net_env = netaddr.worker_env(address)
        self.preflight = AgentPreflight(self.host, address, self.secret, self.sel, self._send)
        # The quorum relay (runtime.relay): started, and its address exported to every worker,
        # before the first fork (its threads are the only ones besides this loop's)
        self.relay = configure_relay(None, cfg.quorum_relay, cfg.quorum_upstream)

    # -- set-up ---------------------------------------------------------------------------
    def install(self) -> None:
        assert self.conn is not None
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        self.conn.sock.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._stop_all_and_exit(0))
        self.sel.register(self.conn.sock, selectors.EVENT_READ, ("controller", None))
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))

    # -- main loop ------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            for key, mask in self.sel.select(timeout=self._tick()):
                kind, obj = key.data
                try:
                    if kind == "wake":
                        self._drain_wake()
                    elif kind == "controller":
                        if mask & selectors.EVENT_WRITE:
                            self._flush()
                        if mask & selectors.EVENT_READ:
                            self._on_controller()
                    elif kind == "hb":
                        self._on_heartbeat(obj)
                    elif kind == "preflight":
                        obj.on_event(key.fileobj, mask)
                except Exception:
                    log.exception("agent %s: error handling %s", self.host, kind)
            self._reap()
            self._timers()

    def _tick(self) -> float:
        return max(0.005, min(self.hb_interval, self.cfg.agent_heartbeat_interval_s) / 2)

    # -- the controller connection --------------------------------------------------------
    def _lost_controller(self, why: str) -> None:
        if self.survival is None:
            log.warning("agent %s: %s; stopping workers", self.host, why)
            self._stop_all_and_exit(3)
            return
        if self.conn is None:
            return
        log.warning(
            "agent %s: %s; keeping %d worker(s) for up to %g s while a new controller is found",
            self.host, why, len(self.workers), self.survival.grace_s,
        )  # fmt: skip
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(self.conn.sock)
        self.conn.close()
        self.conn = None
        if self.relay is not None:
            # Forward nowhere until a new controller says where its quorum serves: the dead
            # one's port is free now, and whoever binds it next must not get the Managers'
            # requests (issue #49). Meanwhile they fail and are asked again.
            self.relay.set_upstream("")
        self.survival.lose(time.monotonic(), self.out.take_unsent())

    def _reattach(self) -> None:
        """Orphaned: one try at the controller the control file names (``runtime.orphan``)."""
        assert self.survival is not None
        report = orphan.report(self.workers.values(), self.epoch, self.address, self.highest_proc)
        got = self.survival.dial(self.host, self.secret, self.epoch, report)
        if got is None:
            return
        conn, cfg, address = got
        self.conn, self.controller_addr, self.epoch = conn, address, cfg.epoch
        self.cfg = replace(cfg, preload=self.cfg.preload, warmup=self.cfg.warmup)
        self.hb_interval, self.hb_timeout = cfg.heartbeat_interval_s, cfg.heartbeat_timeout_s
        self.relay = configure_relay(self.relay, cfg.quorum_relay, cfg.quorum_upstream)
        self.last_heard = time.monotonic()
        conn.sock.setblocking(False)
        self.sel.register(conn.sock, selectors.EVENT_READ, ("controller", None))
        log.warning("agent %s: serving the controller of epoch %d", self.host, cfg.epoch)
        self._send(AgentReady(self.host, os.getpid(), self.address))
        for msg in self.survival.attached():
            self._send(msg)
        socks = [w.hb for w in self.workers.values() if w.hb is not None]
        orphan.tell_workers(socks, address, cfg.epoch)

    def _on_controller(self) -> None:
        if self.conn is None:
            return
        try:
            data = self.conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost_controller(f"recv failed: {exc}")
            return
        if not data:
            self._lost_controller("controller connection closed")
            return
        self.last_heard = time.monotonic()
        conn = self.conn
        conn.decoder.feed(data)
        try:
            for msg in conn.decoder.messages():
                if self.conn is not conn:
                    return  # lost while handling the frames before: obey nothing after
                self._handle(msg)
        except FrameError as exc:
            self._lost_controller(f"bad frame from the controller: {exc}")

    def _send(self, msg: Any) -> None:
        """Queue a frame and send what the socket takes now, never blocking: a stopped
        (SIGSTOPped) controller must not stop this loop from reaping and watching workers.
        A controller that lets more than MAX_BACKLOG pile up counts as gone. Orphaned, the
        frame is kept for the next controller (``runtime.orphan``)."""
        if self.conn is None:
            assert self.survival is not None
            self.survival.keep(msg)
            return
        self.out.push(msg, self.conn.sealer.seal(channel.encode(msg)))
        if self.out.bytes > MAX_BACKLOG:
            self._lost_controller(f"controller not reading: over {MAX_BACKLOG} bytes queued")
        self._flush()

    def _flush(self) -> None:
        if self.conn is None:
            return
        try:
            self.out.send_some(self.conn.sock)
        except OSError as exc:
            self._lost_controller(f"send failed: {exc}")
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.modify(self.conn.sock, events, ("controller", None))

    # -- commands -------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        match msg:
            case ControllerBeat():
                pass  # last_heard is updated for every frame
            case DropConnections(address):
                self._drop_connections(address)
            case QuorumUpstream(address):
                self.relay = configure_relay(self.relay, True, address)
            case UnblockPeers(replica):
                groups = {p: x.group for p, x in self.workers.items() if x.group is not None}
                if any(g != replica for g in groups.values()):
                    self._unblock_survivors(replica, sockets.socket_fds(groups), groups)
            case Spawn(proc_id, coords, log_path, cold):
                self.highest_proc = max(self.highest_proc, orphan.proc_number(proc_id))
                pid = self._fork_worker(proc_id, coords, log_path, cold)
                self._send(Spawned(proc_id, pid))
            case SpawnProgram():
                self._start_program(msg)
            case ServeStore(replica):
                self._serve_store(replica)
            case StopProc(proc_id, grace_s):
                for w in self.workers.values():
                    if w.proc_id == proc_id:
                        unblock = self._survivor_sockets(w)  # fenced: dead to its peers
                        if unblock is not None:
                            self._unblock_survivors(*unblock)
                        self._stop_worker(w, float(grace_s))
            case Shutdown(grace_s):
                self._stop_all_and_exit(0, float(grace_s))
            case PreflightCommand():
                self.preflight.handle(msg)
            case _:
                raise FrameError(f"unknown message {msg!r:.80}")

    def _serve_store(self, replica: int) -> None:
        """A fresh store for ``replica``'s next incarnation; its last one's ends."""
        old = self.stores.pop(replica, None)
        if old is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGKILL)  # reaped by _reap, as any child
        try:
            pid, address = group_store.serve_in_child(self.address, self.connect_timeout)
        except OSError as exc:
            self._send(StoreServed(replica, "", f"cannot serve a store on {self.address}: {exc}"))
            return
        self.stores[replica] = pid
        self._send(StoreServed(replica, address))

    def _drop_connections(self, address: str) -> None:
        if address != self.address:
            drop_connections(address)

    def _fork_worker(
        self, proc_id: str, coords: dict[str, int], log_path: str | None, cold: bool = False
    ) -> int:
        parent_hb, child_hb = socket.socketpair()
        agent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.setsid()
                proctree.die_with_parent(agent_pid)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                for sock in (self.wake_r, self.wake_w, parent_hb, *self._conn_socks(),
                             *self.preflight.sockets(), *self._relay_socks()):  # fmt: skip
                    sock.close()
                for w in self.workers.values():
                    if w.hb is not None:
                        w.hb.close()
                if log_path:
                    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                os.environ.update(self.net_env)  # collectives use the advertised network
                if cold:
                    self._exec_cold_worker(proc_id, coords, child_hb)
                from runtime.worker import worker_main

                worker_main(
                    proc_id=proc_id,
                    coords=coords,
                    controller_addr=self.controller_addr,
                    secret=self.secret,
                    heartbeat_sock=child_hb,
                    heartbeat_interval_s=self.hb_interval,
                    connect_timeout_s=self.connect_timeout,
                    host_address=self.address,
                    grace_s=self._grace_s(),
                    epoch=self.epoch,
                )
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        child_hb.close()
        parent_hb.setblocking(False)
        # The first beat gets a full extra timeout of grace: a fork on a loaded host can be slow.
        w = _Worker(proc_id, pid, parent_hb, time.monotonic() + self.hb_timeout, started=not cold)
        w.coords = dict(coords)
        self.workers[pid] = w
        self.sel.register(parent_hb, selectors.EVENT_READ, ("hb", w))
        return pid

    def _conn_socks(self) -> list[socket.socket]:
        return [self.conn.sock] if self.conn is not None else []

    def _relay_socks(self) -> list[socket.socket]:
        return self.relay.sockets() if self.relay is not None else []

    def _grace_s(self) -> float:
        return self.survival.grace_s if self.survival is not None else 0.0

    def _start_program(self, msg: SpawnProgram) -> None:
        from runtime import program_proc

        if msg.env.get("TORCHFT_LIGHTHOUSE") == VIA_RELAY:  # the quorum, through our relay
            relayed = os.environ.get(RELAY_ENV, "") if self.relay is not None else ""
            msg = replace(msg, env={**msg.env, "TORCHFT_LIGHTHOUSE": relayed})
        self.highest_proc = max(self.highest_proc, orphan.proc_number(msg.proc_id))
        extra = dict(self.net_env)
        group = msg.coords.get("replica")
        if msg.warm:
            socks = [*self._conn_socks(), self.wake_r, self.wake_w, *self.preflight.sockets()]
            socks += self._relay_socks()
            socks += [w.hb for w in self.workers.values() if w.hb is not None]
            pid = program_proc.fork_program(msg, extra, [s.fileno() for s in socks])
            self.workers[pid] = _Worker(
                msg.proc_id, pid, None, 0.0, group=group, coords=dict(msg.coords)
            )
            self._send(Spawned(msg.proc_id, pid))
            return
        try:
            popen = program_proc.start_program(msg, extra)
        except OSError as exc:
            program_proc.log_not_started(msg, exc)
            self._send(Exited(msg.proc_id, 0, program_proc.NOT_STARTED, time.time()))
            return
        self.workers[popen.pid] = _Worker(
            msg.proc_id, popen.pid, None, 0.0, popen=popen, group=group, coords=dict(msg.coords)
        )
        self._send(Spawned(msg.proc_id, popen.pid))

    def _exec_cold_worker(self, proc_id: str, coords: dict[str, int], hb: socket.socket) -> None:
        """Replace this forked child by a fresh interpreter that imports everything itself:
        what a scheduler's restart gives (the full_restart baseline), not the warm fork."""
        os.set_inheritable(hb.fileno(), True)
        cfg = {
            "proc_id": proc_id,
            "coords": coords,
            "controller": list(self.controller_addr),
            "secret": self.secret.hex(),
            "heartbeat_fd": hb.fileno(),
            "heartbeat_interval_s": self.hb_interval,
            "connect_timeout_s": self.connect_timeout,
            "host_address": self.address,
            "grace_s": self._grace_s(),
            "epoch": self.epoch,
            "preload": list(self.cfg.preload),
            "sys_path": sys.path,
        }
        read_fd, write_fd = os.pipe()
        os.write(write_fd, json.dumps(cfg).encode() + b"\n")
        os.close(write_fd)
        os.dup2(read_fd, 0)  # the config (with the secret) arrives on stdin, never in argv
        os.execv(sys.executable, [sys.executable, "-m", "runtime.worker"])

    def _stop_worker(self, w: _Worker, grace_s: float) -> None:
        procs = proctree.tree(w.pid)
        w.kill_pids = [p.pid for p in procs]
        if grace_s <= 0:
            proctree.signal_all(procs, signal.SIGKILL)
        else:
            proctree.signal_all(procs, signal.SIGTERM)
            w.kill_at = time.monotonic() + grace_s

    def _stop_all_and_exit(self, code: int, grace_s: float = 0.0) -> None:
        for w in list(self.workers.values()):
            self._stop_worker(w, grace_s)
        deadline = time.monotonic() + grace_s
        while self.workers and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)
        for w in list(self.workers.values()):
            self._stop_worker(w, 0)
        self._reap()
        os._exit(code)

    # -- liveness -------------------------------------------------------------------------
    def _drain_wake(self) -> None:
        try:
            while self.wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _on_heartbeat(self, w: _Worker) -> None:
        hb = w.hb
        assert hb is not None  # only a forked worker's socket is registered for "hb" (_fork_worker)
        try:
            data = hb.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            w.last_beat = time.monotonic()
            if not w.started and WORKER_STARTED in data:
                w.started = True
        else:  # the worker closed its end: it is exiting; waitpid reports how
            self.sel.unregister(hb)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            w = self.workers.pop(pid, None)
            if w is None:
                self._store_exited(pid, status)
                continue  # or an orphaned grandchild we adopted as subreaper
            if w.hb is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.sel.unregister(w.hb)
                w.hb.close()
            if w.popen is not None:
                w.popen.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not there
            # The worker's own children were re-parented to us (we are a subreaper): any child
            # that is not a worker is such an orphan, and must not outlive its worker.
            stores = set(self.stores.values())
            orphans = [
                p
                for p in psutil.Process().children()
                if p.pid not in self.workers and p.pid not in stores
            ]
            proctree.signal_all(orphans, signal.SIGKILL)
            # The survivors' sockets are listed before the controller hears of the death (so
            # none of a communicator rebuilt without the dead group), shut down after.
            unblock = self._survivor_sockets(w) if status != 0 else None
            self._send(Exited(w.proc_id, pid, status, time.time()))
            if unblock is not None:
                self._unblock_survivors(*unblock)

    def _store_exited(self, pid: int, status: int) -> None:
        for replica, store in list(self.stores.items()):
            if store == pid:  # not replaced, not killed by us: its group's ranks will say so
                del self.stores[replica]
                log.warning(
                    "agent %s: the store of replica group %d exited (%s)",
                    self.host,
                    replica,
                    os.waitstatus_to_exitcode(status),
                )

    def _survivor_sockets(self, w: _Worker) -> tuple[int, dict, dict] | None:
        """``w``'s program group died or is being fenced: its host's ranks' sockets now (pid ->
        inode -> fd) and groups, or None (not a program, or its group's death was handled)."""
        if w.group is None or w.unblocked:
            return None
        groups = {p: x.group for p, x in self.workers.items() if x.group is not None}
        for x in self.workers.values():
            if x.group == w.group:
                x.unblocked = True  # the group's other ranks: the same death
        if all(g == w.group for g in groups.values()):
            return None
        return w.group, sockets.socket_fds(groups), groups

    def _unblock_survivors(self, dead: int, fds: dict, groups: dict) -> None:
        """Fail at once every other group's pending collective with program group ``dead`` on
        this host (``runtime.sockets``): a program does not close its failed communicator."""
        t0 = time.monotonic()
        try:
            done = sockets.unblock_survivors(fds, groups, dead)
        except Exception:  # never the agent's loop: the survivors then wait out their timeout
            log.exception("agent %s: could not unblock the survivors", self.host)
            return
        log.info(
            "agent %s: replica group %s gone; shut down %d connection(s) of %d survivor(s) "
            "in %.1f ms",
            self.host,
            dead,
            sum(done.values()),
            len(done),
            1000 * (time.monotonic() - t0),
        )

    def _timers(self) -> None:
        now = time.monotonic()
        self.preflight.tick(now)
        for w in list(self.workers.values()):
            if w.kill_at is not None and now >= w.kill_at:
                w.kill_at = None
                for pid in w.kill_pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            silent = now - w.last_beat
            if w.hb is None:
                continue  # a program: its liveness is its progress (harness.job.program.groups)
            limit = self.hb_timeout if w.started else self.cfg.start_timeout_s
            if not w.hung_reported and w.kill_at is None and silent > limit:
                w.hung_reported = True
                t_last = time.time() - silent
                self._send(Hung(w.proc_id, w.pid, silent, t_last))
        if self.survival is not None and self.conn is None:
            if self.survival.expired(now):  # said why
                self._stop_all_and_exit(3)
            if self.survival.due(now):
                self._reattach()
            return
        silent = now - self.last_heard
        if silent > self.cfg.controller_silence_s:
            self._lost_controller(f"no frame from the controller for {silent:.1f} s (fencing)")
        if now >= self.next_agent_beat:
            self.next_agent_beat = now + self.cfg.agent_heartbeat_interval_s
            self._send(AgentBeat(time.time()))


def drop_connections(address: str) -> bool:
    """Close every TCP connection of this network namespace to ``address`` (the kernel's
    SOCK_DESTROY, ``ss -K``; needs CAP_NET_ADMIN): a read blocked on one fails at once with
    ECONNABORTED. Never loopback (that would cut this host's own links). False if it could not."""
    if not address or address.startswith("127.") or address == "::1":
        return False
    try:
        done = subprocess.run(["ss", "-K", "dst", address], capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("cannot drop connections to %s: %s", address, exc)
        return False
    return done.returncode == 0


@dataclass(frozen=True)
class Boot:
    """What an agent needs before it can dial in."""

    name: str
    controller: tuple[str, int]
    secret: bytes
    parent_pid: int | None = None  # a local agent dies with its controller
    sys_path: tuple[str, ...] = ()
    advertise: str | None = None  # the address other hosts reach this one at (default: see dial)
    # Survival (runtime.orphan): the run's control file, and how long to keep the workers
    # without a controller; None or 0: die with the controller / fence as before.
    control_file: str | None = None
    grace_s: float = 0.0


def dial(boot: Boot, timeout_s: float) -> channel.Connection:
    """Connect to the controller and authenticate, retrying while it is not up yet (an agent
    started before its controller), for at most ``timeout_s``."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(channel.ChannelError),
        stop=tenacity.stop_after_delay(timeout_s),
        wait=tenacity.wait_exponential(multiplier=0.05, max=2.0),
        reraise=True,
    )
    return retrying(channel.connect, boot.controller, boot.secret, min(10.0, timeout_s))


def run(boot: Boot, dial_timeout_s: float = 60.0) -> None:
    """Dial in, configure, preload, serve until the controller goes away; never returns.
    ChannelError if it cannot dial in, or if the controller refuses it (``channel.Refused``:
    the message says why, e.g. a live agent already has this host's name)."""
    proctree.become_subreaper()
    if boot.parent_pid is not None:
        # SIGTERM, not SIGKILL, when the controller dies: the handler kills every worker's
        # whole tree (workers' own children included) before the agent exits.
        proctree.die_with_parent(boot.parent_pid, signal.SIGTERM)
    for path in reversed(boot.sys_path):
        if path not in sys.path:
            sys.path.insert(0, path)
    conn = dial(boot, dial_timeout_s)
    conn.send(HelloAgent(boot.name, os.getpid()))
    conn.sock.settimeout(dial_timeout_s)
    cfg = conn.recv()
    conn.sock.settimeout(None)
    if isinstance(cfg, channel.Refused):  # e.g. another agent already serves this host name
        conn.close()
        raise channel.ChannelError(f"the controller refused this agent: {cfg.reason}")
    if not isinstance(cfg, AgentConfig):
        raise channel.ChannelError(f"the controller answered {cfg!r:.80}")
    # The address other hosts reach us at: --advertise, else the job's network.interface or
    # network.cidr, else the one our connection to the controller leaves from (the interface
    # that routes to the job's network): runtime.netaddr.
    try:
        address = netaddr.choose(
            host=boot.name,
            default=conn.sock.getsockname()[0],
            advertise=boot.advertise,
            interface=cfg.network_interface,
            cidr=cfg.network_cidr,
        )
    except netaddr.NoAddress as exc:  # the controller fails the job with it (host_registry)
        print(f"ftharness agent: {exc}", file=sys.stderr, flush=True)
        with contextlib.suppress(channel.ChannelError, OSError):
            conn.send(channel.Refused(str(exc)))
        conn.close()
        os._exit(2)
    for mod in cfg.preload:
        importlib.import_module(mod)
    for target, kwargs in cfg.warmup:
        resolve(target)(**kwargs)
    # Everything imported so far lives as long as the process: keep it out of the collector.
    # A worker forked from here inherits ~300K tracked objects (torch, dynamo, torchft), and a
    # full collection in it (torchft's failure path runs one) would walk them all: 0.2-0.6 s
    # idle, over 2 s on a loaded machine, long enough to miss heartbeats and be killed as hung.
    gc.freeze()
    agent = Agent(boot, conn, cfg, address)
    agent.install()
    agent._send(AgentReady(boot.name, os.getpid(), address))
    agent.serve()


#: The agent's log level (a name: ``INFO`` shows each unblocking of survivors); WARNING unless
#: set. Read from the agent's environment, which a local launcher inherits from ``ftharness``.
LOG_LEVEL_ENV = "FTHARNESS_AGENT_LOG_LEVEL"


def log_level(environ: Mapping[str, str] = os.environ) -> int:
    """The agent's log level: ``$FTHARNESS_AGENT_LOG_LEVEL`` if it names one, else WARNING."""
    level = logging.getLevelName(environ.get(LOG_LEVEL_ENV, "").strip().upper())
    return level if isinstance(level, int) else logging.WARNING


def _log_setup() -> None:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(name)s %(message)s")


def cli(args: Any) -> int:
    """``ftharness agent``: this host's agent for a controller elsewhere."""
    _log_setup()
    host, _, port = args.controller.rpartition(":")
    if not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        print(
            f"ftharness agent: --controller {args.controller!r}: expected HOST:PORT "
            "(PORT 1..65535)",
            file=sys.stderr,
        )
        return 2
    week = 7 * 24 * 3600.0  # harness.config.MAX_SECONDS; runtime does not import harness
    if not 0 < args.dial_timeout <= week:  # False for NaN too, which would retry forever
        print(
            f"ftharness agent: --dial-timeout {args.dial_timeout!r}: must be a number of "
            f"seconds > 0 and <= {week:g} (a week)",
            file=sys.stderr,
        )
        return 2
    try:
        secret = read_secret(args.secret_file)
    except (OSError, ValueError) as exc:
        print(f"ftharness agent: {exc}", file=sys.stderr)
        return 2
    grace = float(getattr(args, "grace", 0.0) or 0.0)
    if not 0 <= grace <= week:
        print(f"ftharness agent: --grace {grace!r}: must be >= 0 and <= {week:g}", file=sys.stderr)
        return 2
    boot = Boot(
        name=args.name,
        controller=(host, int(port)),
        secret=secret,
        advertise=args.advertise,
        control_file=getattr(args, "control_file", None),
        grace_s=grace,
    )
    try:
        run(boot, args.dial_timeout)
    except channel.ChannelError as exc:
        print(f"ftharness agent: {exc}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    """``python -m runtime.agent``: the boot settings as one JSON line on stdin (the local
    launcher's way; the secret never appears in argv)."""
    _log_setup()
    raw = json.loads(sys.stdin.readline())
    os.dup2(2, 1)  # stdout is for worker logs and diagnostics
    run(
        Boot(
            name=raw["name"],
            controller=(raw["controller_host"], int(raw["controller_port"])),
            secret=bytes.fromhex(raw["secret"]),
            parent_pid=raw.get("parent_pid"),
            sys_path=tuple(raw.get("sys_path", ())),
            advertise=raw.get("advertise"),
            control_file=raw.get("control_file"),
            grace_s=float(raw.get("grace_s", 0.0)),
        ),
        float(raw.get("dial_timeout_s", 60.0)),
    )


if __name__ == "__main__":
    main()
