"""Pure parts of the data plane: layout, chunking, handles, backend choice, the seqlock header."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from runtime.dataplane import Handle, LayoutMismatch, choose_backend, read_into, register
from runtime.dataplane.errors import TornRead
from runtime.dataplane.handle import ALIGN, layout, plan_chunks
from runtime.dataplane.memory import check_dest
from runtime.dataplane.snapshot import Snapshot, parse_header


def test_layout_aligns_and_chunks_never_straddle_tensors() -> None:
    ts = [torch.zeros(3, dtype=torch.float16), torch.zeros(1000), torch.zeros(0), torch.tensor(1)]
    metas = layout(ts)
    assert [m.nbytes for m in metas] == [6, 4000, 0, 8]
    assert all(m.offset % ALIGN == 0 for m in metas)
    chunks = plan_chunks(metas, 1024)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    for c in chunks:
        m = metas[c.tensor]
        assert c.offset + c.length <= m.nbytes and c.flat == m.offset + c.offset
    assert sum(c.length for c in chunks) == sum(m.nbytes for m in metas)


def test_handle_round_trips_as_json_and_pickle() -> None:
    with register([torch.randn(4, 5), torch.arange(3)], backend="tcp") as reg:
        h = reg.handle
        assert Handle.loads(h.dumps()) == h
        assert pickle.loads(pickle.dumps(h)) == h
        assert len(h.dumps()) < 1024  # small: it travels on the control plane
        assert h.backends == ("tcp",) and h.tcp is not None and h.shm_path is None


@pytest.mark.parametrize(
    ("offered", "same_host", "rdma", "want"),
    [
        (("shm", "tcp"), True, False, "shm"),
        (("shm", "tcp"), False, False, "tcp"),
        (("shm", "ibverbs", "tcp"), False, True, "ibverbs"),
        (("shm", "ibverbs", "tcp"), True, True, "shm"),
        (("ibverbs", "tcp"), False, False, "tcp"),
    ],
)
def test_auto_choice(offered, same_host, rdma, want) -> None:
    assert choose_backend(offered=offered, same_host=same_host, local_rdma=rdma).backend == want


def test_requested_backend_must_be_usable() -> None:
    with pytest.raises(ValueError, match="another host"):
        choose_backend(offered=("shm", "tcp"), same_host=False, local_rdma=False, requested="shm")
    with pytest.raises(ValueError, match="offers"):
        choose_backend(offered=("tcp",), same_host=True, local_rdma=False, requested="ibverbs")


def test_destination_must_match_the_handle() -> None:
    metas = layout([torch.zeros(2, 3), torch.zeros(4, dtype=torch.int32)])
    check_dest(metas, [torch.empty(2, 3), torch.empty(4, dtype=torch.int32)])
    with pytest.raises(LayoutMismatch, match="float32"):
        check_dest(metas, [torch.empty(2, 3), torch.empty(4)])
    with pytest.raises(LayoutMismatch, match="contiguous"):
        check_dest(metas, [torch.empty(3, 2).t(), torch.empty(4, dtype=torch.int32)])
    with pytest.raises(LayoutMismatch, match="2 tensors"):
        check_dest(metas, [torch.empty(2, 3)])


def test_seqlock_header_flips_slots_and_detects_a_write_in_progress() -> None:
    ts = [torch.arange(300_000, dtype=torch.float32)]
    snap = Snapshot(layout(ts), 1 << 16, shared=False)
    try:
        n = len(snap.chunks)
        assert parse_header(snap.mm, n) is None  # nothing published
        snap.publish(ts, step=1)
        v1 = parse_header(snap.mm, n)
        assert (v1.slot, v1.step, v1.seq) == (0, 1, 2)
        snap.publish(ts, step=2)
        v2 = parse_header(snap.mm, n)
        assert (v2.slot, v2.step) == (1, 2)  # the other slot: a reader of slot 0 is untouched
        assert v1.checksums == v2.checksums  # same bytes, same checksums
        snap.mm[48:56] = (7).to_bytes(8, "little")  # slot 1's seq made odd: "being written"
        snap.mm[8:16] = (0).to_bytes(8, "little")  # ... and slot 0 is active again, seq 2
        assert parse_header(snap.mm, n).step == 1
        snap.mm[8:16] = (1).to_bytes(8, "little")
        with pytest.raises(TornRead):
            parse_header(snap.mm, n)
    finally:
        snap.close()


def test_registration_faults_the_snapshot_in_without_changing_a_byte() -> None:
    state = [torch.randn(1 << 20), torch.arange(1 << 18)]  # 4 MiB + 2 MiB
    with register(state, backend="shm") as reg:
        reg.publish(1)  # may run while the prefault is still going: it must not lose bytes
        assert reg.wait_prefaulted(timeout=60)
        path = reg.handle.shm_path
        assert path is not None
        # tmpfs allocates a page when it is first touched: every page of both slots is there
        allocated = os.stat(path).st_blocks * 512
        assert allocated >= 2 * 6 * 2**20, allocated
        dest = [torch.zeros_like(t) for t in state]
        read_into(reg.handle, dest, backend="shm", step=1, timeout=30)
        assert all(torch.equal(d, t) for d, t in zip(dest, state, strict=True))
