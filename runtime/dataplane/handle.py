"""The handle: the small, picklable description of a registered state that the control plane
carries to a reader, plus the pure layout and chunking rules both sides derive from it.

A handle names the backends the source serves and what each needs (a shared-memory path, a
``host:port``, RDMA address/rkey), the tensor metadata (dtype, shape, byte offset inside a
snapshot slot) and the chunk size. Checksums are not in the handle: they change on every
publish, so they live with the source's snapshot and are fetched with it.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass, field
from functools import cache

import torch

from runtime.netaddr import boot_and_netns

ALIGN = 64  # tensor start alignment inside a slot: cache line, and fine for every dtype
DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: fits L2, so a chunk is hashed while still hot


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """One registered tensor: ``offset`` is its byte offset inside a snapshot slot."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """A contiguous byte range of one tensor; chunks never straddle tensors."""

    index: int
    tensor: int
    offset: int  # within the tensor
    length: int
    flat: int  # within the slot


@dataclass(frozen=True, kw_only=True)
class VerbsInfo:
    """What an RDMA reader needs besides a per-peer queue pair: the source MR covering the
    whole snapshot file (header and slots), and the device/port it lives on."""

    device: str
    port: int
    gid_index: int
    addr: int
    rkey: int
    length: int


@dataclass(frozen=True, kw_only=True)
class Handle:
    """Everything a reader needs to pull a registered state; serialisable to a short JSON str.

    ``backends`` lists what the source serves, in its order of preference. ``host_id``
    identifies the source's host (hostname + boot id) so a reader can tell whether shared
    memory is reachable. ``pid``/``start_time`` identify the source process for liveness
    checks on shared memory (``start_time`` in clock ticks since boot, not a wall-clock time,
    so a clock step cannot make a live source look dead). ``token`` authenticates TCP
    requests (a reader without the handle cannot read).
    """

    backends: tuple[str, ...]
    host_id: str
    pid: int
    start_time: int
    tensors: tuple[TensorMeta, ...]
    chunk_bytes: int
    header_bytes: int
    slot_bytes: int
    shm_path: str | None = None
    tcp: tuple[str, int] | None = None
    token: str = ""
    verbs: VerbsInfo | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def dumps(self) -> str:
        """JSON text (no pickle: a handle from a peer is data, never code)."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> Handle:
        d = json.loads(text)
        d["backends"] = tuple(d["backends"])
        d["tensors"] = tuple(TensorMeta(**{**t, "shape": tuple(t["shape"])}) for t in d["tensors"])
        d["tcp"] = tuple(d["tcp"]) if d["tcp"] else None
        d["verbs"] = VerbsInfo(**d["verbs"]) if d["verbs"] else None
        return cls(**d)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def layout(tensors: list[torch.Tensor]) -> tuple[TensorMeta, ...]:
    """Pure: place each tensor at an aligned offset inside a slot, in list order."""
    metas, off = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append(
            TensorMeta(dtype=dtype_name(t.dtype), shape=tuple(t.shape), nbytes=nbytes, offset=off)
        )
        off = round_up(off + nbytes, ALIGN)
    return tuple(metas)


def plan_chunks(metas: tuple[TensorMeta, ...], chunk_bytes: int) -> tuple[Chunk, ...]:
    """Pure: split every tensor into chunks of at most ``chunk_bytes``; the index of a chunk is
    its position in the checksum table."""
    chunks: list[Chunk] = []
    for i, m in enumerate(metas):
        for off in range(0, m.nbytes, chunk_bytes):
            chunks.append(
                Chunk(
                    index=len(chunks),
                    tensor=i,
                    offset=off,
                    length=min(chunk_bytes, m.nbytes - off),
                    flat=m.offset + off,
                )
            )
    return tuple(chunks)


@cache
def host_id() -> str:
    """This host's identity: hostname, the kernel boot id (changes on reboot) and the network
    namespace. Shared memory is used only between processes with the same id: test hosts in
    their own network namespaces on one machine count as different hosts, as real ones are."""
    boot, netns = boot_and_netns()
    return f"{socket.gethostname()}/{boot or 'unknown'}/{netns or 0}"
