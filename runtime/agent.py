"""The host agent: one per host. Forks, reaps and watches the worker processes of its host.

Run as ``python -m runtime.agent``; it reads its configuration (including the job secret) as
one JSON line on stdin, imports the preload modules (torch) once, binds its listener, prints
``PORT <n>`` and serves. It is single-threaded on purpose: it forks workers from its only thread,
so a worker starts with torch already imported in milliseconds and no lock held by another
thread. Everything is one ``selectors`` loop:

* the listener and authenticated connections (non-blocking handshake, then frames);
* SIGCHLD through a wakeup pipe: ``waitpid`` reaps a dead worker the moment it dies;
* one heartbeat socketpair per worker: a worker silent for ``heartbeat.timeout_s`` is hung;
* timers: SIGKILL after a stop's grace period, heartbeats to the controller.

The agent dies with the controller (PR_SET_PDEATHSIG) and also exits, killing its workers, when
the controller connection closes. It is a child subreaper, so nothing below it escapes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import psutil

from runtime import channel, process
from runtime.channel import FrameDecoder, FrameError
from runtime.messages import (
    AgentBeat,
    AgentReady,
    Exited,
    HelloController,
    Hung,
    Shutdown,
    Spawn,
    Spawned,
    StopProc,
)

log = logging.getLogger("ftharness.agent")

#: Bytes queued for a peer that does not read before it is dropped (a beat is ~60 bytes every
#: 0.2 s: this is minutes of a stopped controller, far past its heartbeat timeout).
MAX_BACKLOG = 4 << 20


@dataclass
class _Peer:
    sock: socket.socket
    handshake: channel.ServerHandshake
    deadline: float
    authed: bool = False
    decoder: FrameDecoder = field(default_factory=FrameDecoder)
    out: bytearray = field(default_factory=bytearray)  # not yet accepted by the kernel


@dataclass
class _Worker:
    proc_id: str
    pid: int
    hb: socket.socket
    last_beat: float
    hung_reported: bool = False
    kill_at: float | None = None
    kill_pids: list[int] = field(default_factory=list)


class Agent:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.host = cfg["host"]
        self.secret = bytes.fromhex(cfg["secret"])
        self.controller_addr = (cfg["controller_host"], int(cfg["controller_port"]))
        self.hb_interval = float(cfg["heartbeat_interval_s"])
        self.hb_timeout = float(cfg["heartbeat_timeout_s"])
        self.agent_hb_interval = float(cfg["agent_heartbeat_interval_s"])
        self.connect_timeout = float(cfg["connect_timeout_s"])
        self.preload = list(cfg.get("preload", []))
        self.sel = selectors.DefaultSelector()
        self.listener = channel.listen(cfg.get("bind_host", "127.0.0.1"), 0)
        self.listener.setblocking(False)
        self.peers: dict[int, _Peer] = {}
        self.workers: dict[int, _Worker] = {}  # by pid
        self.controller: _Peer | None = None
        self.wake_r, self.wake_w = socket.socketpair()
        self.next_agent_beat = 0.0
        self.running = True

    # -- set-up ---------------------------------------------------------------------------
    def install(self) -> None:
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._stop_all_and_exit(0))
        self.sel.register(self.listener, selectors.EVENT_READ, ("listener", None))
        self.sel.register(self.wake_r, selectors.EVENT_READ, ("wake", None))

    # -- main loop ------------------------------------------------------------------------
    def serve(self) -> None:
        while self.running:
            for key, mask in self.sel.select(timeout=self._tick()):
                kind, obj = key.data
                try:
                    if kind == "listener":
                        self._accept()
                    elif kind == "wake":
                        self._drain_wake()
                    elif kind == "peer":
                        if mask & selectors.EVENT_WRITE:
                            self._flush(obj)
                        if mask & selectors.EVENT_READ and obj.sock.fileno() >= 0:
                            self._on_peer(obj)
                    elif kind == "hb":
                        self._on_heartbeat(obj)
                except Exception:
                    log.exception("agent %s: error handling %s", self.host, kind)
            self._reap()
            self._timers()

    def _tick(self) -> float:
        return max(0.005, min(self.hb_interval, self.agent_hb_interval) / 2)

    # -- connections ----------------------------------------------------------------------
    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        hs = channel.ServerHandshake(self.secret)
        peer = _Peer(sock, hs, time.monotonic() + self.connect_timeout)
        try:
            sock.send(hs.challenge)
        except OSError:
            sock.close()
            return
        self.peers[sock.fileno()] = peer
        self.sel.register(sock, selectors.EVENT_READ, ("peer", peer))

    def _drop(self, peer: _Peer, why: str) -> None:
        log.warning("agent %s: dropping peer: %s", self.host, why)
        self.peers.pop(peer.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(peer.sock)
        peer.sock.close()
        if peer is self.controller:
            log.warning("agent %s: controller connection lost; stopping workers", self.host)
            self._stop_all_and_exit(3)

    def _on_peer(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(peer, f"recv failed: {exc}")
            return
        if not data:
            self._drop(peer, "connection closed")
            return
        if not peer.authed:
            # Nothing the peer sends is decoded until it has proved the secret.
            try:
                proof = peer.handshake.feed(data)
            except channel.AuthError:
                self._drop(peer, "failed authentication")
                return
            if proof is None:
                return
            peer.authed = True
            self._send_raw(peer, proof)
            data = peer.handshake.leftover
        peer.decoder.feed(data)
        try:
            for msg in peer.decoder.messages():
                self._handle(peer, msg)
        except FrameError as exc:
            self._drop(peer, f"bad frame: {exc}")

    def _send(self, peer: _Peer | None, msg: Any) -> None:
        if peer is not None:
            self._send_raw(peer, channel.encode(msg))

    def _send_raw(self, peer: _Peer, data: bytes) -> None:
        """Queue ``data`` and send what the socket takes now, never blocking: a stopped
        (SIGSTOPped) controller must not stop this loop from reaping and watching workers.
        A peer that lets more than MAX_BACKLOG pile up is dropped."""
        if peer.sock.fileno() < 0:
            return
        peer.out += data
        if len(peer.out) > MAX_BACKLOG:
            self._drop(peer, f"peer not reading: over {MAX_BACKLOG} bytes queued")
            return
        self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        try:
            while peer.out:
                n = peer.sock.send(peer.out)
                del peer.out[:n]
        except BlockingIOError:
            pass
        except OSError as exc:
            self._drop(peer, f"send failed: {exc}")
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if peer.out else 0)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.modify(peer.sock, events, ("peer", peer))

    # -- commands -------------------------------------------------------------------------
    def _handle(self, peer: _Peer, msg: Any) -> None:
        match msg:
            case HelloController():
                self.controller = peer
                self._send(peer, AgentReady(self.host, os.getpid()))
            case Spawn(proc_id, coords, log_path, cold):
                pid = self._fork_worker(proc_id, coords, log_path, cold)
                self._send(peer, Spawned(proc_id, pid))
            case StopProc(proc_id, grace_s):
                for w in self.workers.values():
                    if w.proc_id == proc_id:
                        self._stop_worker(w, float(grace_s))
            case Shutdown(grace_s):
                self._stop_all_and_exit(0, float(grace_s))
            case _:
                raise FrameError(f"unknown message {msg!r:.80}")

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
                process.die_with_parent(agent_pid)
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                for sock in (self.listener, self.wake_r, self.wake_w, parent_hb):
                    sock.close()
                for p in self.peers.values():
                    p.sock.close()
                for w in self.workers.values():
                    w.hb.close()
                if log_path:
                    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
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
                )
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        child_hb.close()
        parent_hb.setblocking(False)
        # The first beat gets a full extra timeout of grace: a fork on a loaded host can be slow.
        w = _Worker(proc_id, pid, parent_hb, time.monotonic() + self.hb_timeout)
        self.workers[pid] = w
        self.sel.register(parent_hb, selectors.EVENT_READ, ("hb", w))
        return pid

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
            "preload": self.preload,
            "sys_path": sys.path,
        }
        read_fd, write_fd = os.pipe()
        os.write(write_fd, json.dumps(cfg).encode() + b"\n")
        os.close(write_fd)
        os.dup2(read_fd, 0)  # the config (with the secret) arrives on stdin, never in argv
        os.execv(sys.executable, [sys.executable, "-m", "runtime.worker"])

    def _stop_worker(self, w: _Worker, grace_s: float) -> None:
        procs = process.tree(w.pid)
        w.kill_pids = [p.pid for p in procs]
        if grace_s <= 0:
            process.signal_all(procs, signal.SIGKILL)
        else:
            process.signal_all(procs, signal.SIGTERM)
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
        try:
            data = w.hb.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            w.last_beat = time.monotonic()
        else:  # the worker closed its end: it is exiting; waitpid reports how
            self.sel.unregister(w.hb)

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
                continue  # an orphaned grandchild we adopted as subreaper
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(w.hb)
            w.hb.close()
            # The worker's own children were re-parented to us (we are a subreaper): any child
            # that is not a worker is such an orphan, and must not outlive its worker.
            orphans = [p for p in psutil.Process().children() if p.pid not in self.workers]
            process.signal_all(orphans, signal.SIGKILL)
            self._send(self.controller, Exited(w.proc_id, pid, status, time.time()))

    def _timers(self) -> None:
        now = time.monotonic()
        for w in list(self.workers.values()):
            if w.kill_at is not None and now >= w.kill_at:
                w.kill_at = None
                for pid in w.kill_pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            silent = now - w.last_beat
            if not w.hung_reported and w.kill_at is None and silent > self.hb_timeout:
                w.hung_reported = True
                t_last = time.time() - silent
                self._send(self.controller, Hung(w.proc_id, w.pid, silent, t_last))
        for peer in list(self.peers.values()):
            if not peer.authed and now > peer.deadline:
                self._drop(peer, "handshake timed out")
        if self.controller is not None and now >= self.next_agent_beat:
            self.next_agent_beat = now + self.agent_hb_interval
            self._send(self.controller, AgentBeat(time.time()))


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    cfg = json.loads(sys.stdin.readline())
    process.become_subreaper()
    # SIGTERM, not SIGKILL, when the controller dies: the handler kills every worker's whole
    # tree (workers' own children included) before the agent exits.
    process.die_with_parent(int(cfg["parent_pid"]), signal.SIGTERM)
    for path in reversed(cfg.get("sys_path", [])):
        if path not in sys.path:
            sys.path.insert(0, path)
    for mod in cfg.get("preload", []):
        importlib.import_module(mod)
    agent = Agent(cfg)
    agent.install()
    print(f"PORT {agent.listener.getsockname()[1]}", flush=True)
    # From here on, stdout is for worker logs: point it at stderr so the port pipe is not filled.
    os.dup2(2, 1)
    agent.serve()


if __name__ == "__main__":
    main()
