"""TCP backend (across hosts): a small server thread in the source process serves chunks of
its snapshot; the reader pulls them over several parallel streams with ``recv_into`` straight
into the destination tensors' memory, hashing each chunk on arrival. No tensor is pickled.

One-sided in the sense that matters: the training loop never sends; the server threads read
the snapshot (``sendall`` of a memoryview of the mapping releases the GIL).

Wire format (little-endian). Every request is ``REQ``: a 16-byte token, an op, a slot, a
seq, a first chunk and a chunk count. A request with a wrong token closes the connection
before anything is decoded further.

Bounds (a peer without the token can hold nothing for long): at most ``MAX_CONNECTIONS`` open
connections (more are closed the moment they are accepted), the first request must arrive
within ``HANDSHAKE_TIMEOUT_S``, and an authenticated connection that neither sends a request
nor takes bytes for ``IDLE_TIMEOUT_S`` is dropped.

* HELLO: reply ``HELLO_REP`` (status, slot, seq, step) followed by the header bytes of the
  snapshot (the reader parses the checksums itself).
* READ(slot, seq, first, count): reply ``STATUS`` (status, seq now), then the chunks' bytes
  back to back, then a ``u64`` trailer with the slot's seq after sending. Either seq
  differing from the requested one means the slot was overwritten: the read is torn. A count
  of 0 is an empty read (status and trailer, no bytes).
* VERBS: a length-prefixed JSON blob (at most ``MAX_VERBS_BYTES``) for the ibverbs
  queue-pair exchange (see ibverbs.py).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from runtime.dataplane.errors import (
    ChecksumMismatch,
    SourceGone,
    TornRead,
    TransferError,
    TransferTimeout,
)
from runtime.dataplane.handle import Chunk, Handle, plan_chunks
from runtime.dataplane.memory import recv_and_hash, recv_fully
from runtime.dataplane.snapshot import (
    SlotView,
    Snapshot,
    parse_header,
    slot_seq,
    wait_for_step,
)

REQ = struct.Struct("<16sB7xqQQQ")
HELLO_REP = struct.Struct("<qqQq")
STATUS = struct.Struct("<qQ")
U64 = struct.Struct("<Q")
OP_HELLO, OP_READ, OP_VERBS = 1, 2, 3
OK, NOT_READY, STALE, BAD = 0, 1, 2, 3
SOCK_BUF = 4 << 20
RUN_BYTES = 8 << 20  # bytes per READ request: amortises the round trip, keeps streams balanced
# Parallel streams per read. On loopback every stream costs CPU on both ends (the copies and
# the protocol work), so more streams than cores only adds contention: measured at 2 GiB on
# 2 cores, 2 streams beat 4. Across a real NIC, up to 4 spread the receive work over cores.
DEFAULT_STREAMS = max(2, min(4, os.cpu_count() or 2))
# A reader opens up to 4 streams, and a source serves the few replacements healing from it at
# once: 64 leaves room for 16 concurrent readers; beyond that a connection is a flood (each one
# costs a thread).
MAX_CONNECTIONS = 64
# A reader sends its first request right after connecting; 5 s covers a loaded host.
HANDSHAKE_TIMEOUT_S = 5.0
# Between requests, and per send that makes no progress, an authenticated reader is given this
# long; a reader that stalls longer has died or hung (its own deadlines are shorter).
IDLE_TIMEOUT_S = 60.0
MAX_VERBS_BYTES = 1 << 20  # a queue-pair description is a few hundred bytes of JSON


class TcpServer:
    """Serves a ``Snapshot`` on ``bind:0``; one daemon thread per connection, at most
    ``max_connections`` of them (see the module doc for the timeouts)."""

    def __init__(
        self,
        snapshot: Snapshot,
        token: bytes,
        bind: str = "127.0.0.1",
        verbs_accept: Callable[[dict], dict] | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self._snap = snapshot
        self._token = token
        self._max_connections = max_connections
        self._handshake_timeout_s = handshake_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self.refused = 0  # connections closed on accept because the cap was reached
        self._verbs_accept = verbs_accept
        self._sock = socket.create_server((bind, 0), backlog=64)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._mv = memoryview(snapshot.mm)
        self._thread = threading.Thread(target=self._accept, name="dataplane-tcp", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self.refused += 1
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
            # Blocking socket, kernel timeouts: a receive (or a send that makes no progress)
            # past them fails with EAGAIN, an OSError, and the connection is dropped.
            handshake_by = time.monotonic() + self._handshake_timeout_s
            authenticated = False
            while not self._closed:
                # Before the token: one deadline for the whole first request, so a peer that
                # trickles a byte at a time is dropped as surely as a silent one.
                raw = _recv_exact(conn, REQ.size, None if authenticated else handshake_by)
                if raw is None:
                    return
                token, op, slot, seq, first, count = REQ.unpack(raw)
                if not hmac.compare_digest(token, self._token):
                    return  # unauthenticated: drop without decoding anything else
                if not authenticated:
                    authenticated = True
                    _set_timeouts(conn, self._idle_timeout_s)
                if op == OP_HELLO:
                    self._hello(conn)
                elif op == OP_READ:
                    self._read(conn, slot, seq, first, count)
                elif op == OP_VERBS and self._verbs_accept is not None:
                    (n,) = U64.unpack(_recv_exact(conn, 8) or b"\0" * 8)
                    if n > MAX_VERBS_BYTES:
                        return
                    request = json.loads(_recv_exact(conn, n) or b"{}")
                    reply = json.dumps(self._verbs_accept(request))
                    conn.sendall(U64.pack(len(reply)) + reply.encode())
                else:
                    return
        except (OSError, ValueError):  # ValueError: a VERBS blob that is not JSON
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket) -> None:
        try:
            view = self._snap.view()
        except TornRead:
            view = None
        if view is None:
            conn.sendall(HELLO_REP.pack(NOT_READY, -1, 0, -1) + bytes(self._snap.header_bytes))
            return
        header = bytes(self._mv[: self._snap.header_bytes])
        conn.sendall(HELLO_REP.pack(OK, view.slot, view.seq, view.step) + header)

    def _read(self, conn: socket.socket, slot: int, seq: int, first: int, count: int) -> None:
        chunks = self._snap.chunks
        if not (0 <= slot <= 1 and first >= 0 and first + count <= len(chunks)):
            conn.sendall(STATUS.pack(BAD, 0))
            raise OSError("bad request")
        now = slot_seq(self._snap.mm, slot)
        if now != seq:
            conn.sendall(STATUS.pack(STALE, now))
            return
        conn.sendall(STATUS.pack(OK, now))
        if count == 0:  # an empty read: nothing to send but the trailer
            conn.sendall(U64.pack(slot_seq(self._snap.mm, slot)))
            return
        base = self._snap.data_offset(slot)
        run = chunks[first : first + count]
        # chunks of one tensor are contiguous: send each maximal contiguous span in one call
        start = end = base + run[0].flat
        for c in run:
            if base + c.flat != end:
                conn.sendall(self._mv[start:end])
                start = base + c.flat
            end = base + c.flat + c.length
        conn.sendall(self._mv[start:end])
        conn.sendall(U64.pack(slot_seq(self._snap.mm, slot)))

    def close(self) -> None:
        """Stop accepting and drop open connections (readers see ``SourceGone``)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.close()
        with self._lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)
        with contextlib.suppress(BufferError):
            self._mv.release()


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    return struct.pack("ll", sec, max(1, int((seconds - sec) * 1e6)))  # 0 would mean "never"


def _set_timeouts(conn: socket.socket, seconds: float) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    """``n`` bytes, or None if the peer closed first. With a ``deadline`` (monotonic), every
    receive is bounded by the time left, and None is also returned once it passes."""
    buf = bytearray(n)
    if deadline is None:
        return bytes(buf) if recv_fully(conn, memoryview(buf)) == n else None
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
        try:
            k = conn.recv_into(view[got:])
        except BlockingIOError:  # SO_RCVTIMEO expired
            return None
        if k == 0:
            return None
        got += k
    return bytes(buf)


class _Conn:
    """A reader's authenticated connection with deadline-bound I/O and clear errors."""

    def __init__(self, handle: Handle, deadline: float) -> None:
        assert handle.tcp is not None
        self.where = f"{handle.tcp[0]}:{handle.tcp[1]}"
        self.deadline = deadline
        self.token = bytes.fromhex(handle.token)
        try:
            self.sock = socket.create_connection(handle.tcp, timeout=self._left())
        except (ConnectionRefusedError, ConnectionResetError) as e:
            raise SourceGone(f"no data-plane server at {self.where}: {e}") from e
        except TimeoutError as e:
            raise TransferTimeout(f"connecting to {self.where} timed out") from e
        except OSError as e:
            raise SourceGone(f"cannot connect to {self.where}: {e}") from e
        self.sock.settimeout(None)  # blocking: deadlines via SO_RCVTIMEO/SO_SNDTIMEO
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"read from {self.where} passed its deadline")
        return left

    def request(self, op: int, slot: int = 0, seq: int = 0, first: int = 0, count: int = 0) -> None:
        self.send(REQ.pack(self.token, op, slot, seq, first, count))

    def send(self, data: bytes) -> None:
        # Every request re-arms the socket timeouts to the time left, so the deadline is
        # enforced without a setsockopt per received chunk.
        left = self._left()
        sec = int(left)
        timeo = struct.pack("ll", sec, max(1, int((left - sec) * 1e6)))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeo)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeo)
        self._io(self.sock.sendall, data)

    # Receives: SO_RCVTIMEO (armed by the last send) bounds each wait.
    def recv_into(self, view: memoryview) -> None:
        self._all(self._io(recv_fully, self.sock, view), len(view))

    def recv_hash(self, addr: int, n: int) -> int:
        """Receive ``n`` bytes into ``addr``; return their xxh3-64, hashed as they land."""
        got, digest = self._io(recv_and_hash, self.sock, addr, n)
        self._all(got, n)
        return digest

    def _all(self, got: int, n: int) -> None:
        if got < n:
            raise SourceGone(f"{self.where} closed the connection mid-transfer")

    def recv_bytes(self, n: int) -> bytes:
        buf = bytearray(n)
        self.recv_into(memoryview(buf))
        return bytes(buf)

    def _io(self, fn, *args):
        try:
            return fn(*args)
        except (TimeoutError, BlockingIOError) as e:  # SO_RCVTIMEO expiry reads as EAGAIN
            raise TransferTimeout(f"read from {self.where} timed out") from e
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError) as e:
            raise SourceGone(f"{self.where} dropped the connection mid-transfer: {e}") from e
        except OSError as e:
            raise SourceGone(f"I/O error with {self.where}: {e}") from e

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def hello(conn: _Conn, n_chunks: int, header_bytes: int) -> SlotView | None:
    conn.request(OP_HELLO)
    status, _slot, _seq, _step = HELLO_REP.unpack(conn.recv_bytes(HELLO_REP.size))
    header = conn.recv_bytes(header_bytes)
    if status != OK:
        return None
    return parse_header(header, n_chunks)


def read_tcp(
    handle: Handle,
    dest: Sequence[torch.Tensor],
    *,
    deadline: float,
    step: int | None,
    streams: int = DEFAULT_STREAMS,
) -> int:
    """One attempt: pull the served slot into ``dest`` over ``streams`` connections and verify
    every chunk. Returns the step read. Raises ``TornRead``, ``SourceGone``,
    ``ChecksumMismatch`` or ``TransferTimeout``."""
    chunks = plan_chunks(handle.tensors, handle.chunk_bytes)
    first = _Conn(handle, deadline)
    conns = [first]
    try:
        view = wait_for_step(
            lambda: hello(first, len(chunks), handle.header_bytes),
            step,
            deadline,
            first.where,
            interval=0.005,
        )
        runs = _runs(chunks, max(1, RUN_BYTES // handle.chunk_bytes))
        n = max(1, min(streams, len(runs)))
        conns += [_Conn(handle, deadline) for _ in range(n - 1)]
        ptrs = [t.data_ptr() for t in dest]
        next_run = iter(runs)
        lock = threading.Lock()
        errors: list[TransferError] = []
        bad: list[int] = []

        def stream(conn: _Conn) -> None:
            # Two requests in flight per stream: the next READ waits in the server's socket
            # buffer while the current run's bytes arrive, so no round trip idles the stream.
            try:
                pending: deque[tuple[Chunk, ...]] = deque()
                while not errors:
                    while len(pending) < 2:
                        with lock:
                            run = next(next_run, None)
                        if run is None:
                            break
                        conn.request(OP_READ, view.slot, view.seq, run[0].index, len(run))
                        pending.append(run)
                    if not pending:
                        return
                    _receive_run(conn, view, pending.popleft(), ptrs, bad)
            except TransferError as e:
                errors.append(e)
            except Exception as e:  # a bug, not a transfer failure: surface it as one
                errors.append(TransferError(f"reader thread failed: {e!r}"))

        threads = [threading.Thread(target=stream, args=(c,), daemon=True) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # a dead source shows up in every stream; a torn read in one is enough to retry
            raise next((e for e in errors if isinstance(e, TornRead)), errors[0])
        if bad:
            raise ChecksumMismatch(f"{len(bad)} chunk(s) failed their checksum, first {min(bad)}")
        return view.step
    finally:
        for c in conns:
            c.close()


def _runs(chunks: tuple[Chunk, ...], per_run: int) -> list[tuple[Chunk, ...]]:
    return [chunks[i : i + per_run] for i in range(0, len(chunks), per_run)]


def _receive_run(
    conn: _Conn,
    view: SlotView,
    run: tuple[Chunk, ...],
    ptrs: list[int],
    bad: list[int],
) -> None:
    """Receive the reply to a READ of ``run``: status, chunks (each hashed the moment it
    lands, while it is still in cache), trailer seq."""
    status, now = STATUS.unpack(conn.recv_bytes(STATUS.size))
    if status == STALE:
        raise TornRead(f"slot {view.slot} was republished (seq {view.seq} -> {now})")
    if status != OK:
        raise TransferError(f"{conn.where} refused a read (status {status})")
    for c in run:
        if conn.recv_hash(ptrs[c.tensor] + c.offset, c.length) != view.checksums[c.index]:
            bad.append(c.index)
    (after,) = U64.unpack(conn.recv_bytes(8))
    if after != view.seq:
        raise TornRead(f"slot {view.slot} was republished during the read")


def verbs_exchange(handle: Handle, local: dict, deadline: float) -> dict:
    """Send our queue-pair info to the source's server, return its own (ibverbs setup)."""
    conn = _Conn(handle, deadline)
    try:
        conn.request(OP_VERBS)
        body = json.dumps(local).encode()
        conn.send(U64.pack(len(body)) + body)
        (n,) = U64.unpack(conn.recv_bytes(8))
        return json.loads(conn.recv_bytes(n))
    finally:
        conn.close()
