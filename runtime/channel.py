"""The authenticated, framed control channel between controller, host agents and workers.

Handshake (no byte of the peer is decoded before it succeeds), over a per-job secret:

    server -> client   nonce_s (32 random bytes)
    client -> server   HMAC(secret, "client" || nonce_s) (32) || nonce_c (32)
    server -> client   HMAC(secret, "server" || nonce_c) (32)

Both sides then derive one session key per direction from the secret and both nonces, and every
frame carries a MAC over its sequence number and payload:

    frame := length (4 bytes, big-endian) || pickle(message) || BLAKE2b-128(key, seq || payload)

A receiver checks the MAC before it unpickles anything: a frame altered, replayed, reordered or
injected on the path (the sequence number is implicit, so a replayed frame fails too) drops the
connection (``FrameError``), as does one larger than ``MAX_FRAME`` or one that does not unpickle;
the caller logs and carries on serving others.

Not guaranteed: confidentiality (frames are not encrypted: weights and configs cross in clear;
use a private network), and protection against a peer that holds the job secret.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import pickle
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

NONCE_BYTES = 32
DIGEST_BYTES = 32
TAG_BYTES = 16
MAX_FRAME = 64 * 1024 * 1024
_LEN = struct.Struct(">I")
_SEQ = struct.Struct(">Q")


class ChannelError(Exception):
    """The connection is unusable (closed, timed out, or the peer misbehaved)."""


class AuthError(ChannelError):
    """The peer did not prove it holds the job secret."""


class FrameError(ChannelError):
    """A received frame was oversized or did not decode: the peer misbehaved; drop it."""


class OversizeMessage(ValueError):
    """A message to send pickles to more than ``MAX_FRAME`` bytes. Nothing was sent and the
    connection is still good: the sender's problem, not the link's (so not a ChannelError)."""


@dataclass(frozen=True, slots=True)
class Refused:
    """The last frame a server sends to an authenticated peer it will not serve, saying why,
    before it closes the connection (e.g. a second host agent dialling in under a name that is
    already live). The peer reports ``reason`` and gives up: it is no channel failure to retry."""

    reason: str


def new_secret() -> bytes:
    return os.urandom(32)


def _digest(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, server_nonce: bytes) -> bytes:
    return _digest(secret, b"client", server_nonce)


def server_proof(secret: bytes, client_nonce: bytes) -> bytes:
    return _digest(secret, b"server", client_nonce)


def session_keys(secret: bytes, nonce_s: bytes, nonce_c: bytes) -> tuple[bytes, bytes]:
    """(client -> server key, server -> client key) of one connection."""
    material = nonce_s + nonce_c
    return _digest(secret, b"c2s", material), _digest(secret, b"s2c", material)


def _tag(key: bytes, seq: int, payload: bytes) -> bytes:
    h = hashlib.blake2b(_SEQ.pack(seq), key=key, digest_size=TAG_BYTES)
    h.update(payload)
    return h.digest()


def encode(message: Any) -> bytes:
    """The pickled payload of ``message`` (checked against ``MAX_FRAME``), ready to seal."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME:
        raise OversizeMessage(f"message of {len(payload)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return payload


class Sealer:
    """Frames payloads for one direction of one connection: length, payload and, with a key,
    the MAC of (sequence number, payload). Not thread-safe: seal in the order frames are sent.
    ``key=None`` frames without a MAC (only for measuring what the MAC costs)."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key
        self._seq = 0

    def seal(self, payload: bytes) -> bytes:
        frame = _LEN.pack(len(payload)) + payload
        if self._key is None:
            return frame
        tag = _tag(self._key, self._seq, payload)
        self._seq += 1
        return frame + tag


class FrameDecoder:
    """Incremental frame parser: ``feed(bytes)`` then iterate ``messages()``; with a key, each
    frame's MAC is checked (in sequence) before its payload is unpickled.

    Used by blocking readers (threads) and by the single-threaded agent's non-blocking loop.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._buf = bytearray()
        self._key = key
        self._tag_bytes = TAG_BYTES if key is not None else 0
        self._seq = 0

    def feed(self, data: bytes) -> None:
        self._buf += data

    def messages(self) -> Iterator[Any]:
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise FrameError(f"frame length {n} exceeds MAX_FRAME={MAX_FRAME}")
            end = _LEN.size + n
            if len(self._buf) < end + self._tag_bytes:
                return
            payload = bytes(self._buf[_LEN.size : end])
            tag = bytes(self._buf[end : end + self._tag_bytes])
            del self._buf[: end + self._tag_bytes]
            if self._key is not None:
                if not hmac.compare_digest(tag, _tag(self._key, self._seq, payload)):
                    raise FrameError(
                        f"frame {self._seq} failed authentication (altered or replayed)"
                    )
                self._seq += 1
            try:
                yield pickle.loads(payload)
            except Exception as exc:
                raise FrameError(f"undecodable frame of {n} bytes: {exc!r}") from exc


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all of them by ``deadline`` (monotonic): the timeout is the time left, set
    before every ``recv``, so a peer trickling a byte at a time cannot stretch the wait."""
    buf = bytearray()
    while len(buf) < n:
        _until(sock, deadline)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelError("connection closed during handshake")
        buf += chunk
    return bytes(buf)


def _until(sock: socket.socket, deadline: float) -> None:
    """Bound the next blocking call on ``sock`` by what is left until ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


@contextlib.contextmanager
def _handshake_bounds(sock: socket.socket, timeout: float) -> Iterator[float]:
    """The whole handshake under one deadline, ``timeout`` from now (yielded, monotonic): not
    one per ``recv``. Socket errors become channel errors."""
    try:
        yield time.monotonic() + timeout
    except TimeoutError as exc:
        raise AuthError(f"handshake not done within {timeout} s") from exc
    except OSError as exc:
        raise ChannelError(f"handshake failed: {exc}") from exc
    finally:
        sock.settimeout(None)


class ServerHandshake:
    """The server's side of the handshake, without I/O, so that a blocking server (a thread per
    connection) and a non-blocking one (the host agent's single loop) run the same code.

    Send ``challenge`` first; ``feed`` what the client sends until it returns the proof to send
    back. Raises AuthError on a wrong digest; nothing the client sent is decoded before that.
    """

    REPLY_BYTES = DIGEST_BYTES + NONCE_BYTES

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self.challenge = os.urandom(NONCE_BYTES)
        self._buf = bytearray()
        self.leftover = b""  # bytes after the client's reply: the first frames, already sent
        self.keys: tuple[bytes, bytes] | None = None  # (send, receive) once authenticated

    def feed(self, data: bytes) -> bytes | None:
        """The server proof once the client's reply is complete and correct, else None."""
        self._buf += data
        if len(self._buf) < self.REPLY_BYTES:
            return None
        reply, self.leftover = (
            bytes(self._buf[: self.REPLY_BYTES]),
            bytes(self._buf[self.REPLY_BYTES :]),
        )
        self._buf.clear()
        expected = client_proof(self._secret, self.challenge)
        if not hmac.compare_digest(reply[:DIGEST_BYTES], expected):
            raise AuthError("client failed authentication")
        nonce_c = reply[DIGEST_BYTES:]
        c2s, s2c = session_keys(self._secret, self.challenge, nonce_c)
        self.keys = (s2c, c2s)
        return server_proof(self._secret, nonce_c)


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> tuple[bytes, bytes]:
    """Authenticate a freshly accepted client (blocking, the whole exchange within ``timeout``);
    returns the session's (send, receive) keys. A server with many peers runs the handshakes on
    one thread instead (``runtime.listener``)."""
    with _handshake_bounds(sock, timeout) as deadline:
        hs = ServerHandshake(secret)
        _until(sock, deadline)
        sock.sendall(hs.challenge)
        proof = hs.feed(_recv_exactly(sock, ServerHandshake.REPLY_BYTES, deadline))
        assert proof is not None and hs.keys is not None
        _until(sock, deadline)
        sock.sendall(proof)
        return hs.keys


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> tuple[bytes, bytes]:
    """Prove the secret to a server and check that it holds it too, the whole exchange within
    ``timeout``; returns the session's (send, receive) keys."""
    with _handshake_bounds(sock, timeout) as deadline:
        nonce_s = _recv_exactly(sock, NONCE_BYTES, deadline)
        nonce_c = os.urandom(NONCE_BYTES)
        _until(sock, deadline)
        sock.sendall(client_proof(secret, nonce_s) + nonce_c)
        try:
            proof = _recv_exactly(sock, DIGEST_BYTES, deadline)
        except ChannelError as exc:
            raise AuthError("server closed the connection: our secret was rejected") from exc
        if not hmac.compare_digest(proof, server_proof(secret, nonce_c)):
            raise AuthError("server failed authentication")
        return session_keys(secret, nonce_s, nonce_c)


class Connection:
    """A blocking, authenticated, thread-safe-for-send message connection. ``keys`` are the
    (send, receive) session keys from the handshake; ``(None, None)`` only in benchmarks."""

    def __init__(
        self,
        sock: socket.socket,
        peer: str = "?",
        keys: tuple[bytes | None, bytes | None] = (None, None),
    ) -> None:
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self.sealer = Sealer(keys[0])
        self.decoder = FrameDecoder(keys[1])
        self._pending: Iterator[Any] | None = None
        self.closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: Any) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, payload: bytes) -> None:
        """Send a payload made by :func:`encode` (so that a caller can encode on its own thread
        and hand the bytes to a sender thread); it is sealed here, in sending order."""
        with self._send_lock:
            if self.closed:
                raise ChannelError(f"send on closed connection to {self.peer}")
            try:
                self.sock.sendall(self.sealer.seal(payload))
            except OSError as exc:
                self.closed = True
                raise ChannelError(f"send to {self.peer} failed: {exc}") from exc

    def recv(self) -> Any:
        """The next message; raises ChannelError on EOF and FrameError on a bad frame."""
        while True:
            if self._pending is not None:
                for message in self._pending:
                    return message
                self._pending = None
            try:
                data = self.sock.recv(1 << 16)
            except OSError as exc:
                raise ChannelError(f"recv from {self.peer} failed: {exc}") from exc
            if not data:
                raise ChannelError(f"connection to {self.peer} closed")
            self.decoder.feed(data)
            self._pending = self.decoder.messages()

    def close(self) -> None:
        with self._send_lock:
            self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()


def connect(address: tuple[str, int], secret: bytes, timeout: float) -> Connection:
    """Connect and authenticate; every step bounded by ``timeout``."""
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        raise ChannelError(f"cannot connect to {address[0]}:{address[1]}: {exc}") from exc
    try:
        keys = client_handshake(sock, secret, timeout)
    except ChannelError:
        sock.close()
        raise
    sock.settimeout(None)
    return Connection(sock, peer=f"{address[0]}:{address[1]}", keys=keys)


def listen(host: str = "127.0.0.1", port: int = 0, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket. The backlog is deep (the kernel caps it at ``somaxconn``): a
    burst of workers dialling in at once (a whole replica group restarting) or of idle
    connections must not overflow the accept queue, where a dropped SYN costs the peer a 1 s
    retransmission."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock
