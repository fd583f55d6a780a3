"""A pass-through in front of the quorum service that admits a program's Managers and watches
their progress.

A program of the user's own (``harness.job.program.groups``) tells ftharness nothing, but every
one of its replica groups asks the quorum service for a quorum once per step: torchft's Manager
sends its ``QuorumMember`` (replica id, step, store address, commit failures) to
``/torchft.LighthouseService/Quorum`` and heartbeats to ``.../Heartbeat``. Programs get this
tap's address as ``TORCHFT_LIGHTHOUSE``; it decodes each request and reply (the protobuf codec of
``harness.quorum.wire``), asks an observer whether the caller may take part, tells it what it
sees, and forwards to the real service, torchft's Lighthouse or the tree quorum, whichever the
job runs. So both backends are observed the same way, and neither needs to know programs exist.

Admission: every quorum request and heartbeat goes through :meth:`Observer.admit` first, which
names the replica group incarnation the caller belongs to, or refuses it; a refused call ends
with PERMISSION_DENIED and is **never forwarded** (so a heartbeat of an id the job did not admit
reaches no quorum service). ``harness.job.program.groups`` admits a call by the process that holds
its connection (the group's rank 0, started by the job), not by anything the caller sends.

Ids: a program's Manager picks its own ``replica_id`` (``{its id}:{uuid4}``), which cannot carry
the tag the tree quorum admits members by (``harness.quorum.rule.member_id``). The observer
hands the tap the tagged id ``T`` the quorum service gave the caller's incarnation, and the tap
forwards the Manager's id ``P`` as ``T:P`` (:func:`upstream_id`: unique per Manager, tagged, and
fenced with its group); in every reply each participant's id is mapped back to the ``P`` its
Manager sent (torchft's Manager finds itself among the participants by its own id). Every field
but the id passes byte for byte. With no ``T`` (torchft's Lighthouse, which names nobody) ``P``
goes as it is.

Quorum ids: torchft's Lighthouse numbers its quorums from 1 again when it restarts, and a
torchft process group rendezvouses each reconfiguration under its quorum id on a store where the
first use of that id left stale peer addresses (``harness.rank.torchft_glue.ProcessGroupGloo``,
for the built-in trainer). A program's process group is its own, so the tap renumbers instead:
after :meth:`QuorumTap.upstream_restarted`, every reply's quorum id is raised by the highest id
handed out before, so the ids a program sees never repeat. (The tree quorum continues its own.)

A quorum service that cannot take a call (UNAVAILABLE: restarting, not serving yet, the
connection to its previous process closed under the call) is asked again where it serves now,
until the caller's deadline (``UPSTREAM_RETRY_S`` without one): a program's request waits for
it, it does not fail, and the observer sees it once.

Not guaranteed: like the services behind it, the tap speaks insecure gRPC (nothing is
encrypted); it adds one local hop (about a millisecond) per request; a member that reaches the
quorum service without the tap (torchft's Lighthouse admits anyone) is not the tap's to stop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import grpc
import tenacity

from harness.quorum import rule
from harness.quorum.wire import (
    SERVICE,
    WireError,
    decode_fields,
    decode_heartbeat_request,
    decode_quorum_request,
    decode_quorum_response,
    encode_field,
    encode_wire_field,
    lighthouse_server,
)

#: A call the quorum service could not take (UNAVAILABLE: restarting, not serving yet, or the
#: connection to its previous process closed under the call) is sent again until the caller's
#: deadline, or for this long when the caller set none: the program's request waits, it does
#: not fail (a repeated request replaces the earlier one at either service).
UPSTREAM_RETRY_S = 30.0

#: Reconnect to a restarted quorum service within tenths of a second (grpc's default backoff
#: starts at 1 s and grows, and a call meanwhile fails without trying).
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
]

_REPLICA_ID = 1  # QuorumMember.replica_id, LighthouseHeartbeatRequest.replica_id
_STORE_ADDRESS = 3  # QuorumMember.store_address (harness.quorum.wire's module doc)


def _unavailable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() is grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Request:
    """One quorum request as the tap saw it: which group's Manager asked, at which step
    (``replica_id``: the id the Manager sent)."""

    replica: int
    replica_id: str
    step: int
    commit_failures: int
    t: float


@dataclass(frozen=True)
class Admission:
    """Who a caller is: incarnation ``incarnation`` of replica group ``replica``, whose members
    the quorum service knows by ``member_id`` (the tagged id it handed out; empty: the service
    names nobody, the Manager's own id is forwarded)."""

    replica: int
    incarnation: int
    member_id: str = ""


class Observer(Protocol):
    def admit(self, replica_id: str, peer: str, store_address: str | None) -> Admission | str:
        """Whether the Manager calling itself ``replica_id`` on connection ``peer`` (gRPC's
        ``context.peer()``, e.g. ``ipv4:127.0.0.1:54321``) may take part: its admission, or why
        not. ``store_address``: its quorum request's (None for a heartbeat)."""
        ...

    def asked(self, req: Request) -> None: ...

    def answered(self, req: Request, members: list[rule.Member] | None) -> None:
        """The request ended: with a quorum (its members, as the quorum service named them) or
        None (an error, a timeout, a refusal upstream)."""
        ...


def upstream_id(member_id: str, replica_id: str) -> str:
    """The id a Manager calling itself ``replica_id`` has at the quorum service, whose name for
    its incarnation is ``member_id`` (empty: none, the Manager's own id)."""
    return f"{member_id}:{replica_id}" if member_id else replica_id


def store_address(raw: bytes) -> str:
    """A ``QuorumMember``'s store address (empty if it has none)."""
    for number, _, value in decode_fields(raw):
        if number == _STORE_ADDRESS and isinstance(value, bytes):
            return value.decode()
    return ""


def _with_id(message: bytes, new_id: str) -> bytes:
    """``message`` (a ``QuorumMember`` or a ``LighthouseHeartbeatRequest``) with its replica id
    set to ``new_id``; every other field as it was, byte for byte."""
    out = [
        encode_field(_REPLICA_ID, new_id.encode())
        if number == _REPLICA_ID and wire == 2
        else encode_wire_field(number, wire, value)
        for number, wire, value in decode_fields(message)
    ]
    return b"".join(out)


def _id_of(member: bytes) -> str:
    """A ``QuorumMember``'s replica id (empty if it has none or it is not UTF-8)."""
    for number, wire, value in decode_fields(member):
        if number == _REPLICA_ID and wire == 2 and isinstance(value, bytes):
            return value.decode("utf-8", "replace")
    return ""


def with_requester_id(request: bytes, new_id: str) -> bytes:
    """``request`` (a ``LighthouseQuorumRequest``) with its requester's replica id ``new_id``."""
    out = [
        encode_field(1, _with_id(value, new_id))
        if number == 1 and wire == 2 and isinstance(value, bytes)
        else encode_wire_field(number, wire, value)
        for number, wire, value in decode_fields(request)
    ]
    return b"".join(out)


def rewritten(reply: bytes, new_id: int | None, ids: Mapping[str, str]) -> bytes:
    """``reply`` (a ``LighthouseQuorumResponse``) with its quorum's id set to ``new_id`` (None:
    as it was) and each participant whose id is a key of ``ids`` renamed to its value; every
    other field as it was, byte for byte."""
    out = []
    for number, wire, value in decode_fields(reply):
        if number == 1 and isinstance(value, bytes):
            fields = []
            for n, w, v in decode_fields(value):
                if n == 1 and w == 0 and new_id is not None:
                    continue  # replaced below
                if n == 2 and isinstance(v, bytes):
                    name = ids.get(_id_of(v))
                    if name is not None:
                        v = _with_id(v, name)
                fields.append(encode_wire_field(n, w, v))
            head = encode_field(1, new_id) if new_id is not None else b""
            value = head + b"".join(fields)
        out.append(encode_wire_field(number, wire, value))
    return b"".join(out)


class QuorumTap:
    """Serves the Lighthouse protocol on ``bind_host`` (on ``port``; 0: one the OS chooses) and
    forwards to ``upstream()`` (``http://host:port``, asked per call: a restarted service may
    move). A taken ``port`` raises OSError.
    ``address`` is what programs get as ``TORCHFT_LIGHTHOUSE``; ``bind_host`` and ``port`` are
    where it listens (an observer matches a caller's connection against them)."""

    def __init__(
        self,
        *,
        bind_host: str,
        upstream: Callable[[], str],
        observer: Observer,
        max_requests: int = 64,
        port: int = 0,
    ) -> None:
        self._upstream = upstream
        self._observer = observer
        self._lock = threading.Lock()
        self._id_offset = 0  # added to the upstream's quorum ids (upstream_restarted)
        self._id_max = 0  # the highest quorum id handed out
        self._channels: dict[str, grpc.Channel] = {}
        # upstream id -> the Manager's own id, for every Manager admitted (a few per incarnation)
        self._down: dict[str, str] = {}
        self._server, self.address = lighthouse_server(
            bind_host=bind_host,
            port=port,
            quorum=self._quorum,
            heartbeat=self._heartbeat,
            max_workers=max_requests,
            name="quorum-tap",
        )
        self.bind_host = bind_host
        self.port = int(self.address.rsplit(":", 1)[1])

    def _stub(self, method: str) -> Callable[..., bytes]:
        """``method`` of the quorum service where it serves now (a restart may move it)."""
        target = self._upstream().split("://", 1)[-1]
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = self._channels[target] = grpc.insecure_channel(target, _RECONNECT)
        return channel.unary_unary(f"/{SERVICE}/{method}")

    def _call(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        left = context.time_remaining()  # without a deadline: about 9.2e18, which grpc refuses
        budget = left if left is not None and left < 1e6 else UPSTREAM_RETRY_S
        deadline = time.monotonic() + budget - 0.05  # answer before the caller gives up

        def once() -> bytes:
            timeout = max(0.01, deadline - time.monotonic())
            # not wait_for_ready: a refused call is retried here, where the service is *now*
            return self._stub(method)(request, timeout=timeout)

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_unavailable),
            stop=tenacity.stop_after_delay(max(0.0, budget - 0.1)),
            wait=tenacity.wait_exponential(multiplier=0.02, max=0.2),
            reraise=True,
        )
        try:
            return retrying(once)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")
            raise  # not reached: abort raises

    def _admit(
        self, replica_id: str, store: str | None, context: grpc.ServicerContext
    ) -> tuple[Admission, str]:
        """The caller's admission and its upstream id; aborts with PERMISSION_DENIED."""
        admission = self._observer.admit(replica_id, context.peer(), store)
        if isinstance(admission, str):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, admission)
            raise AssertionError("not reached: abort raises")
        up = upstream_id(admission.member_id, replica_id)
        if up != replica_id:
            with self._lock:
                self._down[up] = replica_id
        return admission, up

    def _quorum(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            member = decode_quorum_request(request)
            store = store_address(member.raw)
        except (WireError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        admission, up = self._admit(member.replica_id, store, context)
        req = Request(
            admission.replica, member.replica_id, member.step, member.commit_failures, time.time()
        )
        self._observer.asked(req)
        members: list[rule.Member] | None = None
        try:
            forwarded = with_requester_id(request, up) if up != member.replica_id else request
            reply = self._call("Quorum", forwarded, context)
            qid, members = decode_quorum_response(reply)
            return self._downstream(reply, qid, members)
        finally:
            self._observer.answered(req, members)

    def upstream_restarted(self) -> None:
        """The quorum service was restarted (call it before the new one serves): its quorum ids
        start over, so they are handed out from above the highest one handed out so far."""
        with self._lock:
            self._id_offset = self._id_max

    def _downstream(self, reply: bytes, qid: int, members: list[rule.Member]) -> bytes:
        """``reply`` (whose quorum id is ``qid``, its participants ``members``) as the program
        gets it: renumbered after a restart of the service, every participant under the id its
        Manager sent."""
        with self._lock:
            offset = self._id_offset
            self._id_max = max(self._id_max, qid + offset)
            down = self._down
            ids = {m.replica_id: down[m.replica_id] for m in members if m.replica_id in down}
        if not offset and not ids:
            return reply
        return rewritten(reply, qid + offset if offset else None, ids)

    def _heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            rid = decode_heartbeat_request(request)
        except (WireError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        _, up = self._admit(rid, None, context)
        return self._call("Heartbeat", _with_id(request, up) if up != rid else request, context)

    def shutdown(self) -> None:
        self._server.stop(grace=None).wait(5)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
