"""An in-memory verbs layer that enforces the rules real hardware enforces and moves bytes with
memmove, so the ibverbs backend runs end to end without an RDMA device.

Both ends must live in one process and share a ``FakeFabric`` (the fake's "wire"). Every call
is appended to ``fabric.calls`` as ``(verb, detail)`` so tests can assert the sequence. It
checks: a context before a PD, a PD before MRs/QPs, QP state order RESET -> INIT -> RTR ->
RTS, a post only on an RTS QP whose peer QP is connected back to it, the local key
registered in the QP's PD with LOCAL_WRITE, the remote key registered in the *peer's* PD with
REMOTE_READ, the peer QP allowing REMOTE_READ, both ranges in bounds, and no more
outstanding work requests than the QP was created for. A READ to a peer whose QP was
destroyed completes with ``WC_RETRY_EXC_ERR``, as real hardware does after its retries.
``fabric.before_read`` (if set) is called with the number of READs so far: tests use it to
kill a source mid-transfer.
"""

from __future__ import annotations

import ctypes
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.dataplane.verbs_api import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    WC_RETRY_EXC_ERR,
    WC_SUCCESS,
    Completion,
    QpInfo,
    Verbs,
)


class VerbsMisuse(AssertionError):
    """A verbs call that real hardware would reject (EINVAL, a QP in error, a protection
    fault)."""


@dataclass(eq=False)
class _Obj:
    kind: str
    alive: bool = True


@dataclass(eq=False)
class FakeCtx(_Obj):
    name: str = ""


@dataclass(eq=False)
class FakePD(_Obj):
    ctx: FakeCtx | None = None


@dataclass(eq=False)
class FakeMR(_Obj):
    pd: FakePD | None = None
    addr: int = 0
    length: int = 0
    access: int = 0
    lkey: int = 0
    rkey: int = 0


@dataclass(eq=False)
class FakeCQ(_Obj):
    ctx: FakeCtx | None = None
    cqe: int = 0
    entries: deque = field(default_factory=deque)


@dataclass(eq=False)
class FakeQP(_Obj):
    pd: FakePD | None = None
    cq: FakeCQ | None = None
    max_send_wr: int = 0
    qp_num: int = 0
    state: str = "RESET"
    access: int = 0
    remote_qpn: int | None = None
    outstanding: int = 0


class FakeFabric:
    """Shared state of the fake: devices, keys, queue pairs and the call log."""

    def __init__(self, devices: tuple[str, ...] = ("fake_mlx5_0",)) -> None:
        self.devices = devices
        self.calls: list[tuple[str, str]] = []
        self.mrs: dict[int, FakeMR] = {}
        self.qps: dict[int, FakeQP] = {}
        self.reads = 0
        self.bytes_read = 0
        self.before_read: Callable[[int], None] | None = None
        self._keys = itertools.count(0x1000)
        self._qpns = itertools.count(0x100)

    def verbs_of(self, verb: str) -> list[str]:
        return [d for v, d in self.calls if v == verb]


class FakeVerbs(Verbs):
    def __init__(self, fabric: FakeFabric) -> None:
        self.f = fabric

    def _log(self, verb: str, detail: str = "") -> None:
        self.f.calls.append((verb, detail))

    @staticmethod
    def _need(cond: object, why: str) -> None:
        if not cond:
            raise VerbsMisuse(why)

    def devices(self) -> list[str]:
        return list(self.f.devices)

    def open_device(self, name: str) -> Any:
        self._need(name in self.f.devices, f"no device {name}")
        self._log("open_device", name)
        return FakeCtx("ctx", name=name)

    def query_port(self, ctx: FakeCtx, port: int, gid_index: int) -> tuple[int, str]:
        self._need(ctx.alive and port == 1, "query_port on a closed context or bad port")
        self._log("query_port", str(port))
        return 1, f"fe80::{gid_index}"

    def alloc_pd(self, ctx: FakeCtx) -> Any:
        self._need(ctx.alive, "alloc_pd on a closed context")
        self._log("alloc_pd")
        return FakePD("pd", ctx=ctx)

    def reg_mr(self, pd: FakePD, addr: int, length: int, access: int) -> Any:
        self._need(pd.alive and addr != 0 and length > 0, "reg_mr: bad PD, address or length")
        key = next(self.f._keys)
        mr = FakeMR("mr", pd=pd, addr=addr, length=length, access=access, lkey=key, rkey=key)
        self.f.mrs[key] = mr
        self._log("reg_mr", f"access={access}")
        return mr

    def create_cq(self, ctx: FakeCtx, cqe: int) -> Any:
        self._need(ctx.alive and cqe > 0, "create_cq: bad context or size")
        self._log("create_cq")
        return FakeCQ("cq", ctx=ctx, cqe=cqe)

    def create_qp(self, pd: FakePD, cq: FakeCQ, max_send_wr: int) -> Any:
        self._need(pd.alive and cq.alive and pd.ctx is cq.ctx, "create_qp: PD/CQ mismatch")
        qp = FakeQP("qp", pd=pd, cq=cq, max_send_wr=max_send_wr, qp_num=next(self.f._qpns))
        self.f.qps[qp.qp_num] = qp
        self._log("create_qp", "RC")
        return qp

    def _move(self, qp: FakeQP, frm: str, to: str) -> None:
        self._need(qp.alive and qp.state == frm, f"QP {qp.qp_num}: {qp.state} -> {to}")
        qp.state = to
        self._log("modify_qp", to)

    def qp_to_init(self, qp: FakeQP, port: int, access: int) -> None:
        self._move(qp, "RESET", "INIT")
        qp.access = access

    def qp_to_rtr(self, qp: FakeQP, remote: QpInfo, port: int, gid_index: int) -> None:
        self._move(qp, "INIT", "RTR")
        qp.remote_qpn = remote.qpn

    def qp_to_rts(self, qp: FakeQP, psn: int) -> None:
        self._move(qp, "RTR", "RTS")

    def post_read(self, qp, wr_id, local_addr, length, lkey, remote_addr, rkey) -> None:
        self._need(qp.alive and qp.state == "RTS", "post_send on a QP not in RTS")
        self._need(qp.outstanding < qp.max_send_wr, "send queue overflow")
        self._need(len(qp.cq.entries) < qp.cq.cqe, "CQ overrun")
        lmr = self.f.mrs.get(lkey)
        if lmr is None or not lmr.alive or lmr.pd is not qp.pd:
            raise VerbsMisuse("bad lkey for this PD")
        self._need(lmr.access & ACCESS_LOCAL_WRITE, "local MR lacks LOCAL_WRITE")
        self._need(
            lmr.addr <= local_addr and local_addr + length <= lmr.addr + lmr.length,
            "local range outside its MR",
        )
        self._log("post_send", "RDMA_READ")
        self.f.reads += 1
        if self.f.before_read is not None:
            self.f.before_read(self.f.reads)
        qp.outstanding += 1
        peer = self.f.qps.get(qp.remote_qpn)
        if peer is None or not peer.alive or peer.state not in ("RTR", "RTS"):
            qp.cq.entries.append((qp, Completion(wr_id=wr_id, status=WC_RETRY_EXC_ERR)))
            return
        self._need(peer.remote_qpn == qp.qp_num, "peer QP is connected to someone else")
        self._need(peer.access & ACCESS_REMOTE_READ, "peer QP does not allow REMOTE_READ")
        rmr = self.f.mrs.get(rkey)
        if rmr is None or not rmr.alive or rmr.pd is not peer.pd:
            raise VerbsMisuse("bad rkey for peer PD")
        self._need(rmr.access & ACCESS_REMOTE_READ, "remote MR lacks REMOTE_READ")
        self._need(
            rmr.addr <= remote_addr and remote_addr + length <= rmr.addr + rmr.length,
            "remote range outside its MR",
        )
        ctypes.memmove(local_addr, remote_addr, length)
        self.f.bytes_read += length
        qp.cq.entries.append((qp, Completion(wr_id=wr_id, status=WC_SUCCESS)))

    def poll_cq(self, cq: FakeCQ, max_entries: int) -> list[Completion]:
        self._need(cq.alive, "poll on a destroyed CQ")
        out: list[Completion] = []
        while cq.entries and len(out) < max_entries:
            qp, wc = cq.entries.popleft()
            qp.outstanding -= 1
            out.append(wc)
        self._log("poll_cq", str(len(out)))
        return out

    def close(self, obj: _Obj) -> None:
        self._need(obj.alive, f"double close of a {obj.kind}")
        obj.alive = False
        if isinstance(obj, FakeMR):
            self.f.mrs.pop(obj.lkey, None)
        if isinstance(obj, FakeQP):
            self.f.qps.pop(obj.qp_num, None)
        self._log("close", obj.kind)
