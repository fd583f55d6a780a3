"""RDMA backend: the reader pulls the source's snapshot with one-sided RDMA READs.

Setup per reader: open device -> PD -> register the destination tensors (LOCAL_WRITE) and a
header buffer -> CQ -> RC QP -> INIT -> exchange QP info with the source over its TCP control
op -> RTR -> RTS. The source registered its whole snapshot file (header + both slots) as one
MR with REMOTE_READ at ``register`` time; the handle carries its address and rkey. The read
then follows the snapshot's seqlock (snapshot.py) entirely one-sidedly: READ the header,
READ every chunk (a window of outstanding work requests, completions polled), hash each
chunk as it completes, READ the slot's seq again. The source's CPU does nothing but accept
the QP once. A source that dies leaves its QP unanswered: the reader's READs complete with
``IBV_WC_RETRY_EXC_ERR`` after timeout x retries (~0.5 s with timeout=14, retry_cnt=7) and
the read fails with ``SourceGone``.

Only pyverbs is imported, lazily, by ``PyverbsVerbs``: Debian's ``python3-pyverbs`` (PyPI's
pyverbs 59 does not import against Debian 12's rdma-core 44). Destination tensors must be
CPU memory here; GPU memory would need ``ibv_reg_dmabuf_mr`` (not done).

How this is validated here: tests/unit/test_dataplane_verbs.py runs the whole path against
``fake_verbs.FakeVerbs``, which enforces the verbs state machine (QP RESET -> INIT -> RTR ->
RTS before a post, keys belong to the right PD, access flags, bounds, a connected peer QP)
and moves the bytes in memory.

How to validate on an InfiniBand/RoCE host (two hosts A and B, rdma-core + python3-pyverbs):
  1. ``ibv_devices`` lists a device and ``ibv_devinfo -d mlx5_0`` shows a port ``PORT_ACTIVE``;
     for RoCE pick the GID index of a RoCE v2 IPv4 GID (``show_gids``) and export
     ``FTHARNESS_RDMA_GID_INDEX`` to the test (default 0 suits InfiniBand). Check
     ``ulimit -l`` is unlimited (MR pinning).
  2. On one host: ``pytest -m rdma tests/unit/test_dataplane_verbs.py`` runs
     ``test_real_device_round_trip``: a mixed-dtype state registered with
     ``backend="ibverbs"`` is read back through the HCA (loopback), checksums verified.
  3. Across hosts: on A run a source (``python -m runtime.dataplane.rdma_check serve --bind
     <A's IP>``) which prints its handle; on B run ``python -m runtime.dataplane.rdma_check read
     '<handle>'``; it prints the GB/s and verifies the bytes. Expect close to line rate for
     states of hundreds of MiB; ``perftest``'s ``ib_read_bw`` between the same hosts is the
     reference figure.
  4. Kill the source (``kill -9``) during a large read on B: the read must fail with
     ``SourceGone`` in about a second, and ``read_from_any`` must fall back to another source.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Sequence
from functools import cache
from typing import Any

import torch

from runtime.dataplane.errors import (
    ChecksumMismatch,
    SourceGone,
    TornRead,
    TransferError,
    TransferTimeout,
)
from runtime.dataplane.handle import Handle, VerbsInfo, plan_chunks
from runtime.dataplane.memory import address_view, hash_at
from runtime.dataplane.snapshot import SlotView, Snapshot, parse_header, slot_seq, wait_for_step
from runtime.dataplane.verbs_api import (
    ACCESS_LOCAL_WRITE,
    ACCESS_REMOTE_READ,
    WC_SUCCESS,
    Completion,
    QpInfo,
    Verbs,
)

PORT = 1
HEADER_WR = 1 << 63  # wr_id of header reads (chunk reads use the chunk index)
WINDOW = 16  # outstanding READs per QP: enough to fill the link, under max_rd_atomic limits


class PyverbsVerbs(Verbs):
    """``Verbs`` over pyverbs (real hardware)."""

    def __init__(self) -> None:
        import pyverbs.addr as addr
        import pyverbs.cq as cq
        import pyverbs.device as device
        import pyverbs.enums as e
        import pyverbs.mr as mr
        import pyverbs.pd as pd
        import pyverbs.qp as qp
        import pyverbs.wr as wr

        self.addr, self.cq, self.device, self.e = addr, cq, device, e
        self.mr, self.pd, self.qp, self.wr = mr, pd, qp, wr

    def devices(self) -> list[str]:
        try:
            return [d.name.decode() for d in self.device.get_device_list()]
        except Exception:  # pyverbs raises PyverbsRDMAError when there is none
            return []

    def open_device(self, name: str) -> Any:
        return self.device.Context(name=name)

    def query_port(self, ctx: Any, port: int, gid_index: int) -> tuple[int, str]:
        return ctx.query_port(port).lid, str(ctx.query_gid(port, gid_index))

    def alloc_pd(self, ctx: Any) -> Any:
        return self.pd.PD(ctx)

    def reg_mr(self, pd: Any, addr: int, length: int, access: int) -> Any:
        return self.mr.MR(pd, length, access, address=addr)

    def create_cq(self, ctx: Any, cqe: int) -> Any:
        return self.cq.CQ(ctx, cqe, None, None, 0)

    def create_qp(self, pd: Any, cq: Any, max_send_wr: int) -> Any:
        cap = self.qp.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = self.qp.QPInitAttr(qp_type=self.e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1)
        return self.qp.QP(pd, init)

    def qp_to_init(self, qp: Any, port: int, access: int) -> None:
        attr = self.qp.QPAttr(qp_state=self.e.IBV_QPS_INIT)
        attr.port_num, attr.pkey_index, attr.qp_access_flags = port, 0, access
        qp.to_init(attr)

    def qp_to_rtr(self, qp: Any, remote: QpInfo, port: int, gid_index: int) -> None:
        attr = self.qp.QPAttr(qp_state=self.e.IBV_QPS_RTR)
        attr.path_mtu = self.e.IBV_MTU_4096
        attr.dest_qp_num, attr.rq_psn = remote.qpn, remote.psn
        attr.max_dest_rd_atomic, attr.min_rnr_timer = WINDOW, 12
        grh = self.addr.GlobalRoute(dgid=self.addr.GID(remote.gid), sgid_index=gid_index)
        attr.ah_attr = self.addr.AHAttr(port_num=port, is_global=1, grh=grh, dlid=remote.lid)
        qp.to_rtr(attr)

    def qp_to_rts(self, qp: Any, psn: int) -> None:
        attr = self.qp.QPAttr(qp_state=self.e.IBV_QPS_RTS)
        attr.sq_psn, attr.timeout, attr.retry_cnt, attr.rnr_retry = psn, 14, 7, 7
        attr.max_rd_atomic = WINDOW
        qp.to_rts(attr)

    def post_read(self, qp, wr_id, local_addr, length, lkey, remote_addr, rkey) -> None:
        sge = self.wr.SGE(local_addr, length, lkey)
        w = self.wr.SendWR(
            wr_id=wr_id,
            opcode=self.e.IBV_WR_RDMA_READ,
            num_sge=1,
            sg=[sge],
            send_flags=self.e.IBV_SEND_SIGNALED,
        )
        w.set_wr_rdma(rkey, remote_addr)
        qp.post_send(w)

    def poll_cq(self, cq: Any, max_entries: int) -> list[Completion]:
        n, wcs = cq.poll(max_entries)
        return [Completion(wr_id=w.wr_id, status=w.status) for w in wcs[:n]]

    def close(self, obj: Any) -> None:
        obj.close()


@cache
def _real_devices() -> tuple[str, ...]:
    try:
        return tuple(PyverbsVerbs().devices())
    except ImportError:
        return ()


def local_devices(verbs: Verbs | None = None) -> list[str]:
    """RDMA devices usable from this process ([] without pyverbs or hardware)."""
    return verbs.devices() if verbs is not None else list(_real_devices())


def gid_index() -> int:
    # the one environment read of this module, at its edge; RoCE needs a non-zero index
    return int(os.environ.get("FTHARNESS_RDMA_GID_INDEX", "0"))


class VerbsSource:
    """The source's side: its snapshot registered once as an MR, and one RC QP per reader,
    created when the reader's QP info arrives over the TCP control op."""

    def __init__(self, snapshot: Snapshot, verbs: Verbs, device: str | None = None) -> None:
        self.verbs = verbs
        names = verbs.devices()
        if not names:
            raise TransferError("no RDMA device")
        self.device = device or names[0]
        self.gid_index = gid_index()
        self.ctx = verbs.open_device(self.device)
        self.lid, self.gid = verbs.query_port(self.ctx, PORT, self.gid_index)
        self.pd = verbs.alloc_pd(self.ctx)
        self.mr = verbs.reg_mr(
            self.pd, snapshot.address, snapshot.size, ACCESS_REMOTE_READ | ACCESS_LOCAL_WRITE
        )
        self.info = VerbsInfo(
            device=self.device,
            port=PORT,
            gid_index=self.gid_index,
            addr=snapshot.address,
            rkey=self.mr.rkey,
            length=snapshot.size,
        )
        self._peers: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def accept(self, request: dict) -> dict:
        """Create a QP for one reader and bring it to RTS; reply with our QP info."""
        remote = QpInfo.from_dict(request)
        v = self.verbs
        cq = v.create_cq(self.ctx, 4)
        qp = v.create_qp(self.pd, cq, 4)
        psn = secrets.randbelow(1 << 24)
        v.qp_to_init(qp, PORT, ACCESS_REMOTE_READ)
        v.qp_to_rtr(qp, remote, PORT, self.gid_index)
        v.qp_to_rts(qp, psn)
        with self._lock:
            self._peers.append((qp, cq))
        return QpInfo(qpn=qp.qp_num, psn=psn, lid=self.lid, gid=self.gid).to_dict()

    def close(self) -> None:
        with self._lock:
            peers, self._peers = self._peers, []
        for qp, cq in peers:
            self.verbs.close(qp)
            self.verbs.close(cq)
        for obj in (self.mr, self.pd, self.ctx):
            self.verbs.close(obj)


def read_ibverbs(
    handle: Handle,
    dest: Sequence[torch.Tensor],
    *,
    deadline: float,
    step: int | None,
    verbs: Verbs | None = None,
    device: str | None = None,
) -> int:
    """One attempt: RDMA READ the served slot into ``dest`` and verify it. Returns the step.

    Raises ``TornRead`` (caller retries), ``SourceGone`` (a READ failed: the source's QP or
    MR is gone), ``ChecksumMismatch`` or ``TransferTimeout``.
    """
    from runtime.dataplane.tcp import verbs_exchange

    info = handle.verbs
    if info is None:
        raise TransferError("source does not serve ibverbs")
    v = verbs or PyverbsVerbs()
    names = v.devices()
    if not names:
        raise TransferError("no local RDMA device")
    chunks = plan_chunks(handle.tensors, handle.chunk_bytes)
    header = torch.zeros(handle.header_bytes, dtype=torch.uint8)
    opened: list[Any] = []  # closed in reverse order
    try:
        ctx = v.open_device(device or names[0])
        opened.append(ctx)
        lid, gid = v.query_port(ctx, PORT, info.gid_index)
        pd = v.alloc_pd(ctx)
        opened.append(pd)
        hdr_mr = v.reg_mr(pd, header.data_ptr(), header.numel(), ACCESS_LOCAL_WRITE)
        opened.append(hdr_mr)
        mrs = []
        for t in dest:
            n = t.numel() * t.element_size()
            mrs.append(v.reg_mr(pd, t.data_ptr(), n, ACCESS_LOCAL_WRITE) if n else None)
            if n:
                opened.append(mrs[-1])
        cq = v.create_cq(ctx, WINDOW + 2)
        opened.append(cq)
        qp = v.create_qp(pd, cq, WINDOW + 1)
        opened.append(qp)
        psn = secrets.randbelow(1 << 24)
        v.qp_to_init(qp, PORT, ACCESS_LOCAL_WRITE)
        local = QpInfo(qpn=qp.qp_num, psn=psn, lid=lid, gid=gid)
        remote = QpInfo.from_dict(verbs_exchange(handle, local.to_dict(), deadline))
        v.qp_to_rtr(qp, remote, PORT, info.gid_index)
        v.qp_to_rts(qp, psn)
        hdr = memoryview(address_view(header.data_ptr(), header.numel()))

        def read_header() -> SlotView | None:
            v.post_read(
                qp, HEADER_WR, header.data_ptr(), header.numel(), hdr_mr.lkey, info.addr, info.rkey
            )
            _drain(v, cq, 1, deadline)
            return parse_header(hdr, len(chunks))

        view = wait_for_step(read_header, step, deadline, f"RDMA peer {remote.qpn:#x}")
        data = info.addr + handle.header_bytes + view.slot * handle.slot_bytes
        bad: list[int] = []
        pending = 0
        for c in chunks:
            if pending == WINDOW:
                pending -= _complete(v, cq, chunks, dest, view, bad, deadline)
            dst = dest[c.tensor].data_ptr() + c.offset
            mr = mrs[c.tensor]
            # Only an empty tensor has no MR, and plan_chunks gives an empty tensor no chunk
            # (the reader's check_dest made dest's sizes the handle's).
            assert mr is not None
            v.post_read(qp, c.index, dst, c.length, mr.lkey, data + c.flat, info.rkey)
            pending += 1
        while pending:
            pending -= _complete(v, cq, chunks, dest, view, bad, deadline)
        read_header()
        if slot_seq(hdr, view.slot) != view.seq:
            raise TornRead("source republished over the slot during the RDMA read")
        if bad:
            raise ChecksumMismatch(f"{len(bad)} chunk(s) failed their checksum, first {min(bad)}")
        return view.step
    finally:
        for obj in reversed(opened):
            with contextlib.suppress(Exception):
                v.close(obj)


def _drain(v: Verbs, cq: Any, want: int, deadline: float) -> list[Completion]:
    got: list[Completion] = []
    while len(got) < want:
        wcs = v.poll_cq(cq, want - len(got))
        for wc in wcs:
            if wc.status != WC_SUCCESS:
                raise SourceGone(f"RDMA READ failed with work-completion status {wc.status}")
        got += wcs
        if not wcs:
            if time.monotonic() >= deadline:
                raise TransferTimeout("RDMA READ did not complete before the deadline")
            time.sleep(0)
    return got


def _complete(v, cq, chunks, dest, view, bad, deadline) -> int:
    wcs = _drain(v, cq, 1, deadline)
    for wc in wcs:
        c = chunks[wc.wr_id]
        if hash_at(dest[c.tensor].data_ptr() + c.offset, c.length) != view.checksums[c.index]:
            bad.append(c.index)
    return len(wcs)
