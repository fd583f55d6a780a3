"""The connectivity preflight, the host agent's side: a short-lived listener and a set of probes.

Before any group trains, every agent checks that it reaches every other agent's advertised address
(and the controller's services), so that a path a firewall drops, an address that is another
machine's loopback, or a port nobody answers on stops the job with a table instead of a stall
(``harness.job.preflight`` drives it; ``runtime.preflight_matrix`` is the controller's side):

1. :class:`~runtime.messages.PreflightListen`: the agent opens a TCP listener on its advertised
   address, port 0, and answers :class:`~runtime.messages.PreflightListening` with the port and
   where it runs (:func:`place_identity`);
2. :class:`~runtime.messages.PreflightProbe`: it connects to every target at once, each with its
   own deadline, and answers one :class:`~runtime.messages.PreflightReport`;
3. :class:`~runtime.messages.PreflightClose` (or the end of the listen window): the listener closes.

Everything runs on the agent's one selector loop, non-blocking (the agent must not stop reading its
workers' heartbeats for a probe's timeout, and it forks from its only thread).

The listener is no open service: it accepts only during its window (the controller's close, at the
latest ``window_s`` after it opened), at most :data:`MAX_INBOUND` connections at once, each for at
most the probe timeout, and the only thing it ever says is one 32-byte answer to a peer that first
sent the 32-byte proof that it holds the job secret for this preflight (:func:`ask_token`: an HMAC
of the round's nonce and the host's name); anything else is closed without a byte. The probe checks
the answer too, so "ok" means the job's own agent answered at that address and port, not just that
something accepted a connection there.

Not guaranteed: a host name (``--advertise NAME``) is resolved with ``getaddrinfo``, which blocks
the agent's loop for as long as the resolver takes; the listener's port is one the OS picks, so a
firewall that lets only some port ranges through is seen as far as that one port tells.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.messages import (
    PreflightClose,
    PreflightCommand,
    PreflightListen,
    PreflightListening,
    PreflightProbe,
    PreflightReport,
    PreflightResult,
    PreflightTarget,
)
from runtime.netaddr import boot_and_netns, is_loopback

log = logging.getLogger("ftharness.preflight")

TOKEN_BYTES = 32
#: Connections the preflight listener holds at once; more are closed at once (the job's own
#: probers are one per other host: a flood of strangers cannot hold the agent's descriptors).
MAX_INBOUND = 256


class Outcome(enum.StrEnum):
    """What one probe found, from the prober's side."""

    OK = "ok"  # connected, and the job's agent answered the token (a service: connected)
    REFUSED = "refused"  # a TCP reset: nothing listens there, or a firewall rejects it
    TIMED_OUT = "timed out"  # no answer within the timeout: dropped on the way, or no such host
    UNREACHABLE = "unreachable"  # no route to the host or network (an ICMP error, or none known)
    LOOPBACK = "loopback"  # the address is a loopback address, and the target is elsewhere
    WRONG_PEER = "wrong peer"  # something answers there, but not this job's agent
    UNRESOLVED = "unresolved"  # the advertised name does not resolve
    NOT_LISTENING = "not listening"  # the target could not listen at its advertised address
    NO_ANSWER = "no answer"  # the agent did not answer the controller in time
    ERROR = "error"  # anything else (the detail says what)


_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def classify(err: int) -> Outcome:
    """The outcome of a connection that failed with ``errno`` ``err``."""
    if err == errno.ECONNREFUSED:
        return Outcome.REFUSED
    if err == errno.ETIMEDOUT:
        return Outcome.TIMED_OUT
    if err in _UNREACHABLE:
        return Outcome.UNREACHABLE
    return Outcome.ERROR


def describe(err: int) -> str:
    """``err`` as words, with its symbolic name (``ECONNREFUSED: Connection refused``)."""
    return f"{errno.errorcode.get(err, str(err))}: {os.strerror(err)}"


def place_identity() -> str:
    """Where this process runs, as far as its addresses go: the machine (its boot id) and its
    network namespace. Two processes with the same identity reach each other over loopback."""
    boot, netns = boot_and_netns()
    if boot is None or netns is None:
        return f"host:{socket.gethostname()}"
    return f"{boot}/net:{netns}"


def ask_token(secret: bytes, nonce: bytes, host: str) -> bytes:
    """What a prober sends to ``host``'s listener: proof that it holds the job secret, for this
    preflight (``nonce``) and this host (a stale probe, or one meant for another host, fails)."""
    return hmac.new(secret, b"preflight-ask" + nonce + host.encode(), hashlib.sha256).digest()


def answer_token(secret: bytes, nonce: bytes, host: str) -> bytes:
    """What ``host``'s listener answers a prober that sent :func:`ask_token`."""
    return hmac.new(secret, b"preflight-answer" + nonce + host.encode(), hashlib.sha256).digest()


def resolve(address: str) -> tuple[socket.AddressFamily, str]:
    """The address family and IP of ``address`` (an IP literal, or a name: resolved, first
    answer). ``socket.gaierror`` if a name does not resolve."""
    literal = address.strip("[]")
    with contextlib.suppress(ValueError):
        ip = ipaddress.ip_address(literal)
        return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), literal
    info = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = info[0]
    return socket.AddressFamily(family), str(sockaddr[0])


@dataclass
class _Inbound:
    deadline: float
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class _Probe:
    target: PreflightTarget
    address: str  # the IP connected to
    t0: float
    deadline: float
    answering: bool = False  # connected, the token sent: waiting for the answer
    buf: bytearray = field(default_factory=bytearray)


Send = Callable[[Any], None]


class AgentPreflight:
    """One agent's preflight: driven by the agent's selector loop (``on_event`` for the sockets
    it registers with data ``("preflight", self)``, ``tick`` from its timers, ``handle`` for the
    controller's commands). Sockets opened here are closed in a forked child (:meth:`sockets`)."""

    def __init__(
        self,
        host: str,
        address: str,
        secret: bytes,
        sel: selectors.BaseSelector,
        send: Send,
    ) -> None:
        self.host = host
        self.address = address
        self.secret = secret
        self.sel = sel
        self.send = send
        self.place = place_identity()
        self.nonce = b""
        self.timeout_s = 1.0
        self.listener: socket.socket | None = None
        self.until = 0.0  # monotonic end of the listen window
        self.inbound: dict[socket.socket, _Inbound] = {}
        self.probes: dict[socket.socket, _Probe] = {}
        self.results: list[PreflightResult] = []
        self.probing = b""  # the nonce of the round being probed (b"": none)
        self.strangers = 0  # connections closed for a wrong or missing token

    def sockets(self) -> list[socket.socket]:
        """Every socket the preflight holds now (a forked worker closes its copies)."""
        listener = [self.listener] if self.listener is not None else []
        return [*listener, *self.inbound, *self.probes]

    # -- the controller's commands ------------------------------------------------------------
    def handle(self, msg: PreflightCommand) -> None:
        match msg:
            case PreflightListen(nonce, timeout_s, window_s):
                self.close()
                self.nonce, self.timeout_s = nonce, timeout_s
                self.until = time.monotonic() + window_s
                self.send(self._listen(nonce))
            case PreflightProbe(nonce, targets, timeout_s):
                if nonce == self.nonce:
                    self._probe(nonce, targets, timeout_s)
            case PreflightClose(nonce):
                if nonce == self.nonce:
                    self.close()

    def _listen(self, nonce: bytes) -> PreflightListening:
        try:
            family, ip = resolve(self.address)
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            return PreflightListening(nonce, self.host, 0, self.place, f"{exc}")
        try:
            sock.bind((ip, 0))
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            why = describe(exc.errno) if exc.errno else str(exc)
            return PreflightListening(nonce, self.host, 0, self.place, f"cannot listen: {why}")
        self.listener = sock
        self.sel.register(sock, selectors.EVENT_READ, ("preflight", self))
        return PreflightListening(nonce, self.host, sock.getsockname()[1], self.place, "", ip)

    def close(self) -> None:
        """End the round: the listener and every connection still open close."""
        for sock in self.sockets():
            self._drop(sock)
        self.listener = None
        self.inbound.clear()
        self.probes.clear()
        self.probing = b""
        if self.strangers:
            log.warning(
                "agent %s: the preflight listener closed %d connection(s) without the job's token",
                self.host,
                self.strangers,
            )
            self.strangers = 0

    def _drop(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()

    # -- events -------------------------------------------------------------------------------
    def on_event(self, sock: Any, mask: int) -> None:
        if sock is self.listener:
            self._accept()
        elif sock in self.inbound:
            self._on_inbound(sock)
        elif sock in self.probes:
            self._on_probe(sock)

    def tick(self, now: float) -> None:
        """Deadlines: probes that did not finish, peers that did not send their token, and the
        listen window."""
        for sock, p in list(self.probes.items()):
            if now >= p.deadline:
                within = f"within {p.deadline - p.t0:.3g} s"
                what = (
                    f"connected, but the agent did not answer {within}"
                    if p.answering
                    else f"no reply to the connection request {within}"
                )
                self._finish(sock, Outcome.TIMED_OUT, what)
        for sock, i in list(self.inbound.items()):
            if now >= i.deadline:
                self.strangers += 1
                del self.inbound[sock]
                self._drop(sock)
        if self.listener is not None and now >= self.until:
            self.close()

    # -- the listener -------------------------------------------------------------------------
    def _accept(self) -> None:
        assert self.listener is not None
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: this one is lost, the loop goes on
                log.warning("agent %s: preflight accept failed: %s", self.host, exc)
                return
            if len(self.inbound) >= MAX_INBOUND:
                self.strangers += 1
                conn.close()
                continue
            conn.setblocking(False)
            self.inbound[conn] = _Inbound(time.monotonic() + self.timeout_s)
            self.sel.register(conn, selectors.EVENT_READ, ("preflight", self))

    def _on_inbound(self, sock: socket.socket) -> None:
        i = self.inbound[sock]
        try:
            data = sock.recv(TOKEN_BYTES - len(i.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        i.buf += data
        if data and len(i.buf) < TOKEN_BYTES:
            return
        del self.inbound[sock]
        if hmac.compare_digest(bytes(i.buf), ask_token(self.secret, self.nonce, self.host)):
            with contextlib.suppress(OSError):  # 32 bytes into an empty socket buffer
                sock.send(answer_token(self.secret, self.nonce, self.host))
        else:
            self.strangers += 1
        self._drop(sock)

    # -- the probes ---------------------------------------------------------------------------
    def _probe(self, nonce: bytes, targets: tuple[PreflightTarget, ...], timeout_s: float) -> None:
        for sock in list(self.probes):
            self._drop(sock)
        self.probes.clear()
        self.results = []
        self.probing = nonce
        for target in targets:
            self._start(target, timeout_s)
        self._maybe_report()

    def _start(self, target: PreflightTarget, timeout_s: float) -> None:
        t0 = time.monotonic()

        def done(outcome: Outcome, detail: str, address: str = target.address) -> None:
            self.results.append(
                PreflightResult(
                    target.name, address, target.port, outcome.value, detail, time.monotonic() - t0
                )
            )

        try:
            family, ip = resolve(target.address)
        except OSError as exc:
            done(Outcome.UNRESOLVED, f"{target.address} does not resolve: {exc}")
            return
        if target.place != self.place and (is_loopback(ip) or is_loopback(target.bound)):
            # A loopback address names the prober itself here; a name that resolves to loopback
            # where the target runs (Debian's 127.0.1.1 for its own hostname) has the target
            # listen where no other machine reaches it, whatever it resolves to here.
            what = (
                f"{target.address} is a loopback address"
                if is_loopback(ip)
                else f"{target.address} resolves to {target.bound} (loopback) on {target.name}"
            )
            done(Outcome.LOOPBACK, f"{what}, and {target.name} is another machine or netns", ip)
            return
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex((ip, target.port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            sock.close()
            done(classify(err), describe(err), ip)
            return
        self.probes[sock] = _Probe(target, ip, t0, t0 + timeout_s)
        self.sel.register(sock, selectors.EVENT_WRITE, ("preflight", self))

    def _on_probe(self, sock: socket.socket) -> None:
        p = self.probes[sock]
        if not p.answering:
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._finish(sock, classify(err), describe(err))
                return
            if not p.target.token:
                self._finish(sock, Outcome.OK, "connected")
                return
            try:
                sock.send(ask_token(self.secret, self.probing, p.target.name))
            except OSError as exc:
                self._finish(sock, Outcome.WRONG_PEER, f"connected, then the send failed: {exc}")
                return
            p.answering = True
            self.sel.modify(sock, selectors.EVENT_READ, ("preflight", self))
            return
        try:
            data = sock.recv(TOKEN_BYTES - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(sock, Outcome.WRONG_PEER, f"connected, then: {exc}")
            return
        p.buf += data
        if data and len(p.buf) < TOKEN_BYTES:
            return
        if hmac.compare_digest(
            bytes(p.buf), answer_token(self.secret, self.probing, p.target.name)
        ):
            self._finish(sock, Outcome.OK, "the agent answered")
        else:
            self._finish(
                sock,
                Outcome.WRONG_PEER,
                f"something accepts connections at {p.address}:{p.target.port}, but it is not "
                f"{p.target.name}'s preflight listener (no valid answer to the job's token)",
            )

    def _finish(self, sock: socket.socket, outcome: Outcome, detail: str) -> None:
        p = self.probes.pop(sock)
        self._drop(sock)
        self.results.append(
            PreflightResult(
                p.target.name,
                p.address,
                p.target.port,
                outcome.value,
                detail,
                time.monotonic() - p.t0,
            )
        )
        self._maybe_report()

    def _maybe_report(self) -> None:
        if self.probing and not self.probes:
            self.send(PreflightReport(self.probing, self.host, tuple(self.results)))
            self.probing = b""
