"""The authenticated, framed control channel between controller, host agents and workers.

Wire format, after a mutual challenge-response handshake over a per-job secret:

    frame := length (4 bytes, big-endian) || pickle(message)

Handshake (no byte of the peer is decoded before it succeeds):

    server -> client   nonce_s (32 random bytes)
    client -> server   HMAC(secret, "client" || nonce_s) (32) || nonce_c (32)
    server -> client   HMAC(secret, "server" || nonce_c) (32)

The server compares the client's digest with ``hmac.compare_digest`` and drops the connection
on a mismatch; only then are frames unpickled. Frames larger than ``MAX_FRAME`` or that do not
unpickle drop the connection (``FrameError``); the caller logs and carries on serving others.

Not guaranteed: confidentiality (frames are not encrypted; bind loopback or a private network)
and protection against an on-path attacker after the handshake.
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
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

NONCE_BYTES = 32
DIGEST_BYTES = 32
MAX_FRAME = 64 * 1024 * 1024
_LEN = struct.Struct(">I")


class ChannelError(Exception):
    """The connection is unusable (closed, timed out, or the peer misbehaved)."""


class AuthError(ChannelError):
    """The peer did not prove it holds the job secret."""


class FrameError(ChannelError):
    """A received frame was oversized or did not decode: the peer misbehaved; drop it."""


class OversizeMessage(ValueError):
    """A message to send pickles to more than ``MAX_FRAME`` bytes. Nothing was sent and the
    connection is still good: the sender's problem, not the link's (so not a ChannelError)."""


def new_secret() -> bytes:
    return os.urandom(32)


def _digest(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, server_nonce: bytes) -> bytes:
    return _digest(secret, b"client", server_nonce)


def server_proof(secret: bytes, client_nonce: bytes) -> bytes:
    return _digest(secret, b"server", client_nonce)


def encode(message: Any) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(payload) > MAX_FRAME:
        raise OversizeMessage(f"message of {len(payload)} bytes exceeds MAX_FRAME={MAX_FRAME}")
    return _LEN.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental frame parser: ``feed(bytes)`` then iterate ``messages()``.

    Used by blocking readers (threads) and by the single-threaded agent's non-blocking loop.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def messages(self) -> Iterator[Any]:
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_FRAME:
                raise FrameError(f"frame length {n} exceeds MAX_FRAME={MAX_FRAME}")
            if len(self._buf) < _LEN.size + n:
                return
            payload = bytes(self._buf[_LEN.size : _LEN.size + n])
            del self._buf[: _LEN.size + n]
            try:
                yield pickle.loads(payload)
            except Exception as exc:
                raise FrameError(f"undecodable frame of {n} bytes: {exc!r}") from exc


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ChannelError("connection closed during handshake")
        buf += chunk
    return bytes(buf)


@contextlib.contextmanager
def _handshake_bounds(sock: socket.socket, timeout: float) -> Iterator[None]:
    """The whole handshake under one ``timeout``; socket errors become channel errors."""
    sock.settimeout(timeout)
    try:
        yield
    except TimeoutError as exc:
        raise AuthError(f"handshake timed out after {timeout} s") from exc
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
        return server_proof(self._secret, reply[DIGEST_BYTES:])


def server_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Authenticate a freshly accepted client (blocking, bounded by ``timeout``)."""
    with _handshake_bounds(sock, timeout):
        hs = ServerHandshake(secret)
        sock.sendall(hs.challenge)
        proof = hs.feed(_recv_exactly(sock, ServerHandshake.REPLY_BYTES))
        assert proof is not None
        sock.sendall(proof)


def client_handshake(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Prove the secret to a server and check that it holds it too."""
    with _handshake_bounds(sock, timeout):
        nonce_s = _recv_exactly(sock, NONCE_BYTES)
        nonce_c = os.urandom(NONCE_BYTES)
        sock.sendall(client_proof(secret, nonce_s) + nonce_c)
        try:
            proof = _recv_exactly(sock, DIGEST_BYTES)
        except ChannelError as exc:
            raise AuthError("server closed the connection: our secret was rejected") from exc
        if not hmac.compare_digest(proof, server_proof(secret, nonce_c)):
            raise AuthError("server failed authentication")


class Connection:
    """A blocking, authenticated, thread-safe-for-send message connection."""

    def __init__(self, sock: socket.socket, peer: str = "?") -> None:
        self.sock = sock
        self.peer = peer
        self._send_lock = threading.Lock()
        self._decoder = FrameDecoder()
        self._pending: Iterator[Any] | None = None
        self.closed = False
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: Any) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Send a frame made by :func:`encode` (so that a caller can encode on its own thread
        and hand the bytes to a sender thread)."""
        with self._send_lock:
            if self.closed:
                raise ChannelError(f"send on closed connection to {self.peer}")
            try:
                self.sock.sendall(data)
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
            self._decoder.feed(data)
            self._pending = self._decoder.messages()

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
        client_handshake(sock, secret, timeout)
    except ChannelError:
        sock.close()
        raise
    return Connection(sock, peer=f"{address[0]}:{address[1]}")


def listen(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock
