"""torchft's Lighthouse gRPC protocol on the wire: a hand-written protobuf codec for the four
messages involved (no generated code), and the one gRPC server builder that the tree quorum
(``harness.quorum.tree``) and a program's quorum tap (``harness.quorum.tap``) both serve it with.

Each requester's ``QuorumMember`` is kept as the raw bytes it sent and returned to every
participant unchanged, so fields added by newer torchft versions pass through; only the fields
the rule needs are decoded. Field numbers of torchft-nightly 2026.10.26, found by capturing a real
Manager's request: replica_id 1, address 2, store_address 3, step 4, world_size 5, shrink_only 6,
data 7, commit_failures 8, reconfigure_handles 9.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from harness.quorum import rule

#: The gRPC service torchft's Managers call (``/torchft.LighthouseService/Quorum``, ``Heartbeat``).
SERVICE = "torchft.LighthouseService"

#: A unary handler: (request bytes, context) -> reply bytes.
Handler = Callable[[bytes, grpc.ServicerContext], bytes]


def lighthouse_server(
    *, bind_host: str, port: int, quorum: Handler, heartbeat: Handler, max_workers: int, name: str
) -> tuple[grpc.Server, str]:
    """A started gRPC server for torchft's Lighthouse protocol on ``bind_host:port`` (0: the OS
    chooses), requests and replies as raw bytes; returns it and its ``http://host:port``
    address. ``max_workers`` bounds concurrent RPCs (a waiting quorum request holds a thread).
    Raises OSError when the address cannot be bound."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Quorum": grpc.unary_unary_rpc_method_handler(quorum),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(heartbeat),
        },
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
        handlers=(handler,),
        options=(("grpc.so_reuseport", 0),),  # a second server on a taken port must fail
    )
    try:
        bound = server.add_insecure_port(f"{bind_host}:{port}")
    except RuntimeError as e:  # what grpcio does now (older ones returned 0)
        raise OSError(f"{name}: cannot bind {bind_host}:{port}: {e}") from e
    if bound == 0:
        raise OSError(f"{name}: cannot bind {bind_host}:{port}")
    server.start()
    return server, f"http://{bind_host}:{bound}"


# QuorumMember field numbers (see the module doc).
_REPLICA_ID, _STEP, _WORLD_SIZE, _SHRINK_ONLY, _COMMIT_FAILURES = 1, 4, 5, 6, 8

# --- protobuf wire codec -------------------------------------------------------------------------


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise WireError("truncated or overlong varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return result, i


def encode_varint(value: int) -> bytes:
    """Unsigned varint; a negative ``value`` is encoded as its 64-bit two's complement (int64)."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def decode_fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """Every field of a message, in order: ``(number, wire_type, value)``; varints and fixed
    ints as ``int``, length-delimited as ``bytes``. Raises :class:`WireError`."""
    fields: list[tuple[int, int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 2:
            n, i = _read_varint(buf, i)
            if i + n > len(buf):
                raise WireError("truncated length-delimited field")
            value, i = buf[i : i + n], i + n
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(buf):
                raise WireError("truncated fixed-width field")
            value, i = int.from_bytes(buf[i : i + width], "little"), i + width
        else:
            raise WireError(f"unsupported wire type {wire} (field {number})")
        if number == 0:
            raise WireError("field number 0")
        fields.append((number, wire, value))
    return fields


def _int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def encode_field(number: int, value: int | bytes) -> bytes:
    """A varint (``int``) or length-delimited (``bytes``) field."""
    if isinstance(value, bytes):
        return encode_varint(number << 3 | 2) + encode_varint(len(value)) + value
    return encode_varint(number << 3) + encode_varint(value)


def encode_wire_field(number: int, wire: int, value: int | bytes) -> bytes:
    """A field as :func:`decode_fields` returned it, re-encoded: varint and length-delimited as
    :func:`encode_field`, fixed64/fixed32 as little-endian bytes."""
    if wire in (0, 2):
        return encode_field(number, value)
    assert isinstance(value, int)
    return encode_varint(number << 3 | wire) + value.to_bytes(8 if wire == 1 else 4, "little")


def decode_member(raw: bytes) -> rule.Member:
    """A ``QuorumMember``'s rule fields; ``raw`` kept as is. Unknown fields are skipped."""
    m: dict[str, Any] = {}
    for number, _, value in decode_fields(raw):
        if number == _REPLICA_ID and isinstance(value, bytes):
            m["replica_id"] = value.decode()
        elif number == _STEP and isinstance(value, int):
            m["step"] = _int64(value)
        elif number == _WORLD_SIZE and isinstance(value, int):
            m["world_size"] = value
        elif number == _SHRINK_ONLY and isinstance(value, int):
            m["shrink_only"] = bool(value)
        elif number == _COMMIT_FAILURES and isinstance(value, int):
            m["commit_failures"] = _int64(value)
    if not m.get("replica_id"):
        raise WireError("QuorumMember without replica_id")
    return rule.Member(raw=raw, **m)


def decode_quorum_request(buf: bytes) -> rule.Member:
    """``LighthouseQuorumRequest{QuorumMember requester = 1}``."""
    for number, wire, value in decode_fields(buf):
        if number == 1 and wire == 2 and isinstance(value, bytes):
            return decode_member(value)
    raise WireError("LighthouseQuorumRequest without requester")


def decode_heartbeat_request(buf: bytes) -> str:
    """``LighthouseHeartbeatRequest{string replica_id = 1}``."""
    for number, wire, value in decode_fields(buf):
        if number == 1 and wire == 2 and isinstance(value, bytes):
            return value.decode()
    raise WireError("LighthouseHeartbeatRequest without replica_id")


def decode_quorum_response(reply: bytes) -> tuple[int, list[rule.Member]]:
    """A ``LighthouseQuorumResponse``'s quorum id (0 if absent: proto3's default) and members,
    in one pass (see :func:`encode_quorum_response`)."""
    qid, members = 0, []
    for number, _, value in decode_fields(reply):
        if number == 1 and isinstance(value, bytes):
            for n, wire, v in decode_fields(value):
                if n == 1 and wire == 0 and isinstance(v, int):
                    qid = v
                elif n == 2 and isinstance(v, bytes):
                    members.append(decode_member(v))
    return qid, members


def encode_quorum_response(quorum: rule.Quorum, created: float) -> bytes:
    """``LighthouseQuorumResponse{Quorum quorum = 1}``, ``Quorum{int64 quorum_id = 1; repeated
    QuorumMember participants = 2; Timestamp created = 3}``, each participant as it sent itself."""
    seconds = int(created)
    stamp = encode_field(1, seconds) + encode_field(2, int((created - seconds) * 1e9))
    parts = [encode_field(1, quorum.quorum_id)]
    parts += [encode_field(2, m.raw) for m in quorum.members]
    parts.append(encode_field(3, stamp))
    return encode_field(1, b"".join(parts))  # one copy: ``+=`` in the loop copies O(N^2) bytes
