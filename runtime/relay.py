"""A TCP relay on each host: a stable local address for the quorum service, wherever it runs.

torchft's Managers are given their Lighthouse's address (``http://host:port``) once, when they
are built, and keep it for life. The tree quorum service runs in the controller's process, and a
controller can be replaced (``runtime.takeover``): on the same host it comes back on the same
host and port, but under SLURM a new controller runs on another node (its node died), so the
quorum service comes back at another address, which no running Manager would ever dial.

So the host agent (``runtime.agent``) runs a :class:`Relay` bound to loopback and exports its
address as ``$FTHARNESS_QUORUM_RELAY`` (:data:`RELAY_ENV`) before it forks any worker; the
built-in trainer hands that to its Manager instead of the quorum service's own address. The
controller tells each agent where its quorum service is (``AgentConfig.quorum_upstream``, then
``QuorumUpstream`` once it serves) and the relay forwards every connection there.

Who may use it: only the processes of the agent's own tree (its workers, its programs and what
they start). The relay vouches for that, with :func:`from_this_tree` (the client's end of the
connection held by one of them, read from ``/proc``: ``runtime.peer_process``); any other
client's connection is closed before anything is forwarded. The quorum tap in front of a
program's quorum service relies on it (``harness.job.program.admission``: a call relayed by a
group's host agent is a call of one of the job's processes on that host).

What a client sees is what it sees of a quorum port that is closed during a takeover: a failed
RPC, which its caller retries. A connection made while the relay has no upstream, or cannot
reach it within :data:`DIAL_TIMEOUT_S`, is closed at once; when the upstream changes, every
relayed connection is closed, so that clients reconnect to the new one (an old controller that
is only partitioned must not go on serving them).

Threads: one accepts, two copy the bytes of each connection (quorum traffic is a few long-lived
HTTP/2 connections per host). The agent forks its workers while they run: they touch no lock a
worker needs, a forked worker closes its copies of the relay's sockets (:meth:`Relay.sockets`),
and the relay only ever *shuts down* a connection before closing it, which ends it for every
process holding a copy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from runtime import peer_process

log = logging.getLogger("ftharness.relay")

#: The environment variable a host's workers find the relay's address in (``http://127.0.0.1:P``).
RELAY_ENV = "FTHARNESS_QUORUM_RELAY"

#: A program's ``TORCHFT_LIGHTHOUSE`` as the controller sets it when the job relays the quorum:
#: its host agent puts its relay's address there (the controller does not know it).
VIA_RELAY = "ftharness:relay"

#: How long dialling the upstream may take before the client's connection is closed.
DIAL_TIMEOUT_S = 2.0


def parse_address(addr: str) -> tuple[str, int] | None:
    """``"http://h:p"`` or ``"h:p"`` (``[v6]:p`` too) as ``(h, p)``; None for ``""``."""
    addr = addr.strip()
    if not addr:
        return None
    addr = addr.split("://", 1)[-1].rstrip("/")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"relay upstream {addr!r}: expected HOST:PORT or http://HOST:PORT")
    return host.strip("[]"), int(port)


class _Pair:
    """One relayed connection: the client's socket and (once dialled) the upstream's."""

    def __init__(self, down: socket.socket) -> None:
        self.down = down
        self.up: socket.socket | None = None
        self.dead = False
        self.pumps = 2  # copying threads still running; the last one closes the sockets

    def shut(self) -> None:
        """End the connection for every process holding it (safe from any thread)."""
        self.dead = True
        for s in (self.down, self.up):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


class Relay:
    """Forwards each connection to ``bind_host:<port>`` to the current upstream (module doc)."""

    def __init__(
        self, bind_host: str = "127.0.0.1", admit: Callable[[socket.socket], bool] | None = None
    ) -> None:
        self.bind_host = bind_host
        self._admit = admit  # None: every client; else whether a client's connection may pass
        self._lock = threading.Lock()
        self._upstream: tuple[str, int] | None = None
        self._listener: socket.socket | None = None
        self._port = 0
        self._pairs: set[_Pair] = set()
        self._threads: set[threading.Thread] = set()
        self._closed = False

    def start(self) -> int:
        """Listen on a free port of ``bind_host`` and serve it; the port."""
        with self._lock:
            if self._listener is not None or self._closed:
                raise RuntimeError("the relay was started already")
            sock = socket.socket(socket.AF_INET6 if ":" in self.bind_host else socket.AF_INET)
            sock.bind((self.bind_host, 0))
            sock.listen(128)
            self._listener, self._port = sock, sock.getsockname()[1]
            self._spawn(self._accept, "accept")
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` the relay listens on."""
        host = f"[{self.bind_host}]" if ":" in self.bind_host else self.bind_host
        return f"{host}:{self._port}"

    @property
    def upstream(self) -> str:
        """``host:port`` connections go to now; ``""``: none."""
        up = self._upstream
        return "" if up is None else f"{up[0]}:{up[1]}"

    def set_upstream(self, addr: str) -> None:
        """Forward new connections to ``addr`` (``http://h:p``, ``h:p``; ``""``: nowhere, they
        are closed at once). A different address closes every relayed connection first."""
        new = parse_address(addr)
        with self._lock:
            if new == self._upstream:
                return
            self._upstream = new
            pairs = list(self._pairs)
        for pair in pairs:
            pair.shut()

    def sockets(self) -> list[socket.socket]:
        """Every socket the relay holds: a forked child closes its copies (never shuts them
        down). Takes no lock: the thread that held it does not exist in a child."""
        socks = [s for p in list(self._pairs) for s in (p.down, p.up) if s is not None]
        return [self._listener, *socks] if self._listener is not None else socks

    def close(self) -> None:
        """Stop listening, close every connection, and wait for the relay's threads."""
        with self._lock:
            self._closed = True
            listener, pairs = self._listener, list(self._pairs)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
        for pair in pairs:
            pair.shut()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=DIAL_TIMEOUT_S + 1.0)
        if listener is not None:
            listener.close()

    # -- threads -------------------------------------------------------------------------------
    def _spawn(self, target: Callable[..., None], what: str, *args: object) -> None:
        t = threading.Thread(
            target=self._run, args=(target, *args), daemon=True,
            name=f"ftharness-relay-{self._port}-{what}",
        )  # fmt: skip
        self._threads.add(t)
        t.start()

    def _run(self, target: Callable[..., None], *args: object) -> None:
        try:
            target(*args)
        except Exception:
            log.exception("relay %s: thread failed", self.address)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # ECONNABORTED (a client gone already), EMFILE: no spinning
                continue
            down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = _Pair(down)
            with self._lock:
                if self._closed:
                    down.close()
                    return
                self._pairs.add(pair)
                upstream = self._upstream
                self._spawn(self._serve, "conn", pair, upstream)

    def _serve(self, pair: _Pair, upstream: tuple[str, int] | None) -> None:
        """Dial ``upstream`` for ``pair``, then copy client -> upstream (a second thread copies
        back); on no upstream or a failed dial, close the client's connection at once."""
        up = None
        if self._admit is not None and not self._admitted(pair.down):
            upstream = None  # not one of ours: closed at once, nothing forwarded
        if upstream is not None:
            try:
                up = socket.create_connection(upstream, timeout=DIAL_TIMEOUT_S)
                up.settimeout(None)
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                log.info("relay %s: cannot reach %s:%d: %s", self.address, *upstream, exc)
        with self._lock:
            pair.up = up
            # closed, or the upstream changed while dialling (set_upstream shut the pair)
            ok = up is not None and not pair.dead and not self._closed
            if ok:
                self._spawn(self._pump, "back", pair, up, pair.down)
            else:
                pair.pumps = 1  # no second pump: this thread is the last one
        if up is not None and ok:
            self._pump(pair, pair.down, up)
        else:
            pair.shut()
            self._finish(pair)

    def _admitted(self, sock: socket.socket) -> bool:
        assert self._admit is not None
        try:
            if self._admit(sock):
                return True
            who: object = sock.getpeername()
            # a client that gave up at once (closed: its end has no socket left to look up)
            # is no stranger; only a live one is worth a warning
            gone = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            gone = False
        except OSError as exc:
            who, gone = exc, False
        if not gone:
            log.warning("relay %s: refused %s: no process of this host's job", self.address, who)
        return False

    def _pump(self, pair: _Pair, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        pair.shut()
        self._finish(pair)

    def _finish(self, pair: _Pair) -> None:
        with self._lock:
            pair.pumps -= 1
            if pair.pumps > 0:
                return
            self._pairs.discard(pair)
        for s in (pair.down, pair.up):
            if s is not None:
                s.close()


def from_this_tree(sock: socket.socket) -> bool:
    """Whether the client end of ``sock`` (a connection accepted here) is held by this process or
    one of its descendants (``runtime.peer_process.holders``)."""
    client = peer_process.endpoint(sock.getpeername())
    server = peer_process.endpoint(sock.getsockname())
    return peer_process.holders(os.getpid(), client, server) is not None


def configure_relay(relay: Relay | None, wanted: bool, upstream: str) -> Relay | None:
    """The host agent's relay after a configuration: started (and its address exported as
    :data:`RELAY_ENV`, for every worker forked from now on) when ``wanted`` and not running
    yet, then forwarding to ``upstream`` (``""``: nowhere yet). None while never wanted (and
    no :data:`RELAY_ENV` either, not even one the agent inherited: it names no relay of ours)."""
    if relay is None:
        if not wanted:
            os.environ.pop(RELAY_ENV, None)
            return None
        relay = Relay("127.0.0.1", admit=from_this_tree)  # the agent's tree only
        relay.start()
        os.environ[RELAY_ENV] = f"http://{relay.address}"
    relay.set_upstream(upstream)
    return relay
