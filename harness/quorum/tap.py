"""A pass-through in front of the quorum service that watches a program's progress.

A program of the user's own (``harness.job.programs``) tells ftharness nothing, but every one of its
replica groups asks the quorum service for a quorum once per step: torchft's Manager sends its
``QuorumMember`` (replica id, step, store address, commit failures) to
``/torchft.LighthouseService/Quorum`` and heartbeats to ``.../Heartbeat``. Programs get this
tap's address as ``TORCHFT_LIGHTHOUSE``; it decodes each request and reply (the protobuf codec of
``harness.quorum.tree``), tells an observer, and forwards the bytes unchanged to the real
service, torchft's Lighthouse or the tree quorum, whichever the job runs. So both backends are
observed the same way, and neither needs to know programs exist.

Quorum ids: torchft's Lighthouse numbers its quorums from 1 again when it restarts, and a
torchft process group rendezvouses each reconfiguration under its quorum id on a store where the
first use of that id left stale peer addresses (``harness.rank.torchft_glue.ProcessGroupGloo``, for
the
built-in trainer). A program's process group is its own, so the tap renumbers instead: after
:meth:`QuorumTap.upstream_restarted`, every reply's quorum id is raised by the highest id handed
out before, so the ids a program sees never repeat. (The tree quorum continues its own ids.)

Admission: a quorum request is forwarded only if its ``store_address`` is the store of a replica
group's current incarnation (the job hands each incarnation a fresh store), so a stale
incarnation, or a process the job did not start, cannot join; a heartbeat only from an id not
known to belong to a replaced incarnation. Not guaranteed: like the services behind it, the tap
speaks insecure gRPC; it adds one local hop (about a millisecond) per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

import grpc

from harness.quorum import rule
from harness.quorum.tree import (
    SERVICE,
    WireError,
    decode_fields,
    decode_heartbeat_request,
    decode_quorum_request,
    decode_quorum_response,
    encode_field,
    encode_wire_field,
)

_STORE_ADDRESS = 3  # QuorumMember.store_address (harness.quorum.tree's module doc)


@dataclass(frozen=True)
class Request:
    """One quorum request as the tap saw it: which group's Manager asked, at which step."""

    replica: int
    replica_id: str
    step: int
    commit_failures: int
    t: float


class Observer(Protocol):
    def admit(self, replica_id: str, store_address: str) -> int | None:
        """The replica group whose current incarnation owns ``store_address``, or None."""
        ...

    def refused_id(self, replica_id: str) -> bool:
        """True if ``replica_id`` belongs to a replaced incarnation."""
        ...

    def asked(self, req: Request) -> None: ...

    def answered(self, req: Request, members: list[rule.Member] | None) -> None:
        """The request ended: with a quorum (its members) or None (an error, a timeout)."""
        ...


def store_address(raw: bytes) -> str:
    for number, _, value in decode_fields(raw):
        if number == _STORE_ADDRESS and isinstance(value, bytes):
            return value.decode()
    return ""


def renumbered(reply: bytes, new_id: int) -> bytes:
    """``reply`` (a ``LighthouseQuorumResponse``) with its quorum's id set to ``new_id``; every
    other field as it was, byte for byte."""
    out = []
    for number, wire, value in decode_fields(reply):
        if number == 1 and isinstance(value, bytes):
            fields = [(n, w, v) for n, w, v in decode_fields(value) if not (n == 1 and w == 0)]
            value = encode_field(1, new_id) + b"".join(encode_wire_field(*f) for f in fields)
        out.append(encode_wire_field(number, wire, value))
    return b"".join(out)


class QuorumTap:
    """Serves the Lighthouse protocol on ``bind_host`` (port 0) and forwards to
    ``upstream()`` (``http://host:port``, asked per call: a restarted service may move).
    ``address`` is what programs get as ``TORCHFT_LIGHTHOUSE``."""

    def __init__(
        self,
        *,
        bind_host: str,
        upstream: Callable[[], str],
        observer: Observer,
        max_requests: int = 64,
    ) -> None:
        self._upstream = upstream
        self._observer = observer
        self._lock = threading.Lock()
        self._id_offset = 0  # added to the upstream's quorum ids (upstream_restarted)
        self._id_max = 0  # the highest quorum id handed out
        self._channels: dict[str, grpc.Channel] = {}
        handler = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Quorum": grpc.unary_unary_rpc_method_handler(self._quorum),
                "Heartbeat": grpc.unary_unary_rpc_method_handler(self._heartbeat),
            },
        )
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_requests, thread_name_prefix="quorum-tap"),
            handlers=(handler,),
            options=(("grpc.so_reuseport", 0),),
        )
        port = self._server.add_insecure_port(f"{bind_host}:0")
        if port == 0:
            raise OSError(f"quorum tap: cannot bind {bind_host}")
        self.address = f"http://{bind_host}:{port}"
        self._server.start()

    def _call(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        target = self._upstream().split("://", 1)[-1]
        with self._lock:
            channel = self._channels.get(target)
            if channel is None:
                channel = self._channels[target] = grpc.insecure_channel(target)
        stub = channel.unary_unary(f"/{SERVICE}/{method}")
        left = context.time_remaining()  # without a deadline: about 9.2e18, which grpc refuses
        try:
            return stub(request, timeout=left if left is not None and left < 1e6 else None)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")
            raise  # not reached: abort raises

    def _quorum(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            member = decode_quorum_request(request)
            store = store_address(member.raw)
        except (WireError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        replica = self._observer.admit(member.replica_id, store)
        if replica is None:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{member.replica_id!r}: store {store!r} is no current replica group's",
            )
        req = Request(replica, member.replica_id, member.step, member.commit_failures, time.time())
        self._observer.asked(req)
        members: list[rule.Member] | None = None
        try:
            reply = self._call("Quorum", request, context)
            qid, members = decode_quorum_response(reply)
            return self._continue_ids(reply, qid)
        finally:
            self._observer.answered(req, members)

    def upstream_restarted(self) -> None:
        """The quorum service was restarted (call it before the new one serves): its quorum ids
        start over, so they are handed out from above the highest one handed out so far."""
        with self._lock:
            self._id_offset = self._id_max

    def _continue_ids(self, reply: bytes, qid: int) -> bytes:
        """``reply`` (whose quorum id is ``qid``) as the program gets it: renumbered after a
        restart of the service."""
        with self._lock:
            offset = self._id_offset
            self._id_max = max(self._id_max, qid + offset)
        return renumbered(reply, qid + offset) if offset else reply

    def _heartbeat(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            rid = decode_heartbeat_request(request)
        except (WireError, UnicodeDecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._observer.refused_id(rid):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{rid} was replaced")
        return self._call("Heartbeat", request, context)

    def shutdown(self) -> None:
        self._server.stop(grace=None).wait(5)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
