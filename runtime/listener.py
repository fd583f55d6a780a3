"""The controller's listener: accepts every peer and authenticates them all on ONE thread.

Workers and host agents dial in to one listening socket. Until its handshake succeeds a peer is
nobody (a port scanner, a stale process, a slow-loris holding connections open), so nothing it
does may cost the controller more than a bounded amount:

* threads: the handshakes of every not-yet-authenticated peer run on this listener's single
  thread, a non-blocking selector loop over :class:`runtime.channel.ServerHandshake` (the same
  code the agent's own loop runs). Only an authenticated peer gets a thread of its own, running
  ``serve(sock, keys)``; a peer that holds the job secret is part of the job, and the job's size
  bounds those.
* handshakes in flight: at most ``max_pending``. When one more is accepted, the OLDEST pending
  handshake is dropped. Why not refuse the newcomer, or leave it in the kernel's accept backlog:
  a real worker or agent answers the challenge within one round trip, so under a flood of idle
  connections the oldest pending one is almost surely an idle one, and the real peer that dials
  in now gets through at once. Left in the backlog it would wait behind up to a backlog's worth
  of idle connections, each holding a slot for a whole deadline; refused, it would be refused
  for as long as the flood lasts (and a worker does not retry its dial).
* time: each handshake has ONE deadline, ``timeout_s`` after its accept, for the whole exchange,
  not one per ``recv``: a peer trickling one byte at a time is dropped at that deadline too.

Errors are per connection: a failed ``accept`` (out of file descriptors, say), a peer that
misbehaves, or a ``Thread.start`` that fails (out of threads) drops that one connection, is
logged, and the loop goes on serving; only :meth:`close` ends it.

Not guaranteed: a real peer is dropped if more than ``max_pending`` other connections are
accepted during its round trip (a flood that fast); it sees its connection closed (an agent's
dial retries, a worker fails to start and is handled as a failure).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from runtime import channel

log = logging.getLogger("ftharness.listener")

#: Connections accepted per wake-up of the loop before it reads the replies of those already
#: challenged: a burst of connections then cannot starve the handshakes it interleaves with.
ACCEPT_BATCH = 32

#: ``accept`` errors that say the process or the machine is out of something (descriptors,
#: buffers): the listening socket stays readable, so the loop frees a slot and pauses briefly
#: instead of spinning.
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

#: At most one warning per this many seconds about dropped connections (see Listener._dropped).
REPORT_EVERY_S = 5.0

Serve = Callable[[socket.socket, tuple[bytes, bytes]], None]


@dataclass
class ListenerStats:
    """What the listener did with the connections it accepted (monotonic counters)."""

    accepted: int = 0
    authenticated: int = 0
    timed_out: int = 0  # the whole handshake did not finish by its deadline
    evicted: int = 0  # the oldest pending handshake, dropped to make room for a newer one
    failed: int = 0  # wrong secret, closed, reset, or anything else wrong with one peer
    accept_errors: int = 0


@dataclass
class _Pending:
    sock: socket.socket
    peer: str
    hs: channel.ServerHandshake
    deadline: float
    got: int = 0


class Listener:
    """Accept on ``sock`` and authenticate with ``secret``; hand each authenticated peer, as a
    blocking socket and its session keys, to ``serve`` on a thread of its own (an exception
    there is logged and the socket closed). At most ``max_pending`` handshakes in flight, each
    done within ``timeout_s`` of its accept or dropped. Run :meth:`run` on one thread;
    :meth:`close` ends it and closes every socket it holds (never those handed to ``serve``)."""

    def __init__(
        self,
        sock: socket.socket,
        secret: bytes,
        serve: Serve,
        *,
        timeout_s: float,
        max_pending: int,
    ) -> None:
        if max_pending < 1 or timeout_s <= 0:
            raise ValueError("a listener needs max_pending >= 1 and timeout_s > 0")
        self.sock, self.secret, self.serve = sock, secret, serve
        self.timeout_s, self.max_pending = timeout_s, max_pending
        self.stats = ListenerStats()
        sock.setblocking(False)
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self.closed = False
        self._sel = selectors.DefaultSelector()
        # Insertion order is accept order, and every deadline is accept time + timeout_s, so
        # the first entry is both the oldest and the next to expire.
        self._pending: dict[socket.socket, _Pending] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._unreported = 0  # drops not logged yet (see _dropped)
        self._next_report = 0.0

    @property
    def pending(self) -> int:
        """Handshakes in flight now."""
        return len(self._pending)

    def close(self) -> None:
        """Stop accepting at once and end :meth:`run` (idempotent, from any thread)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :meth:`close`. Nothing a peer does ends this loop."""
        self._sel.register(self.sock, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self.closed:
                for key, _ in self._sel.select(self._wait_s()):
                    if self.closed:
                        break
                    try:
                        if key.fileobj is self.sock:
                            self._accept_some()
                        elif isinstance(key.data, _Pending):
                            self._advance(key.data)
                    except Exception:  # a bug with one connection must not stop the rest
                        log.exception("listener: handling %s", key.data or "accept")
                self._expire()
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
            self._sel.close()
            for s in (self.sock, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    s.close()

    def _wait_s(self) -> float | None:
        for p in self._pending.values():
            return max(0.0, p.deadline - time.monotonic())
        return None  # nothing pending: sleep until a connection or close()

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self.closed:
                    return
                self._dropped("accept_errors", "a connection", f"accept failed: {exc}")
                if exc.errno in _EXHAUSTED:
                    self._evict_oldest()  # frees a descriptor for the next accept
                    time.sleep(0.05)
                return
            self._start(sock, f"{addr[0]}:{addr[1]}")

    def _start(self, sock: socket.socket, peer: str) -> None:
        self.stats.accepted += 1
        if len(self._pending) >= self.max_pending:
            self._evict_oldest()
        p = _Pending(sock, peer, channel.ServerHandshake(self.secret), 0.0)
        try:
            sock.setblocking(False)
            # 32 bytes into a fresh socket's empty send buffer: sent whole or not at all
            if sock.send(p.hs.challenge) != len(p.hs.challenge):
                raise channel.ChannelError("challenge not sent whole")
            p.deadline = time.monotonic() + self.timeout_s
            self._sel.register(sock, selectors.EVENT_READ, p)
        except Exception as exc:  # OSError mostly (reset already): this peer only
            self._dropped("failed", peer, str(exc))
            with contextlib.suppress(OSError):
                sock.close()
            return
        self._pending[sock] = p

    def _advance(self, p: _Pending) -> None:
        """Read what ``p`` sent; on its complete, correct reply send the proof and hand it off.
        Reads no further than the reply: what follows (its first frame) stays in the socket for
        the connection that serves it."""
        if self._pending.get(p.sock) is not p:
            return  # evicted or expired earlier in this same round of events
        try:
            try:
                data = p.sock.recv(channel.ServerHandshake.REPLY_BYTES - p.got)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                raise channel.ChannelError("closed during the handshake")
            p.got += len(data)
            proof = p.hs.feed(data)
            if proof is None:
                return
            if p.sock.send(proof) != len(proof):  # the send buffer holds only our 32 bytes
                raise channel.ChannelError("proof not sent whole")
        except Exception as exc:  # OSError, AuthError, or a bug: this peer only
            self._dropped("failed", p.peer, str(exc))
            self._drop(p)
            return
        assert p.hs.keys is not None
        self._forget(p)
        self.stats.authenticated += 1
        self._hand_off(p.sock, p.peer, p.hs.keys)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))
            if p.deadline > now:
                return
            self._dropped("timed_out", p.peer, f"handshake not done within {self.timeout_s:g} s")
            self._drop(p)

    def _evict_oldest(self) -> None:
        for p in self._pending.values():
            why = f"the oldest of {len(self._pending)} handshakes in flight, evicted"
            self._dropped("evicted", p.peer, why)
            self._drop(p)
            return

    def _dropped(self, kind: str, peer: str, why: str) -> None:
        """Count a dropped connection; log it at most once per ``REPORT_EVERY_S`` with how many
        went unlogged since: a flood must not turn into a flood of log lines (each one is
        logged at DEBUG)."""
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        log.debug("listener: dropping %s: %s", peer, why)
        self._unreported += 1
        now = time.monotonic()
        if now >= self._next_report:
            log.warning(
                "listener: dropping %s: %s (%d unauthenticated connection(s) dropped since the "
                "last such line; %d handshakes in flight)",
                peer, why, self._unreported, len(self._pending),
            )  # fmt: skip
            self._unreported, self._next_report = 0, now + REPORT_EVERY_S

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(p.sock)

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        with contextlib.suppress(OSError):
            p.sock.close()

    # -- authenticated peers --------------------------------------------------------------
    def _hand_off(self, sock: socket.socket, peer: str, keys: tuple[bytes, bytes]) -> None:
        try:
            sock.setblocking(True)
            threading.Thread(
                target=self._serve_peer,
                args=(sock, peer, keys),
                daemon=True,
                name=f"ftharness-peer-{peer}",
            ).start()
        except Exception as exc:  # RuntimeError: can't start new thread
            self.stats.failed += 1
            log.error("listener: cannot serve authenticated peer %s: %s", peer, exc)
            with contextlib.suppress(OSError):
                sock.close()

    def _serve_peer(self, sock: socket.socket, peer: str, keys: tuple[bytes, bytes]) -> None:
        """``serve`` on this peer's own thread: whatever it raises is logged here, never left to
        kill the thread with a traceback nobody handles."""
        try:
            self.serve(sock, keys)
        except Exception:
            if not self.closed:
                log.exception("listener: serving %s raised", peer)
            with contextlib.suppress(OSError):
                sock.close()
