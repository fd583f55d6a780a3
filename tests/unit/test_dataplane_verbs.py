"""The ibverbs backend against the fake verbs layer (no RDMA device exists here), and the
real-hardware variant, skipped where no device exists."""

from __future__ import annotations

import pytest
import torch

from runtime.dataplane import SourceGone, read_from_any, read_into, register
from runtime.dataplane.fake_verbs import FakeFabric, FakeVerbs, VerbsMisuse
from runtime.dataplane.ibverbs import local_devices
from runtime.dataplane.verbs_api import ACCESS_LOCAL_WRITE


def _state() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(700, 300, generator=g),
        torch.randn(513, generator=g).to(torch.bfloat16),
        torch.arange(12, dtype=torch.int64),
        torch.tensor([True, False, True]),
    ]


def _reader_calls(fabric: FakeFabric, start: int) -> list[str]:
    return [v if v != "modify_qp" else f"modify_qp:{d}" for v, d in fabric.calls[start:]]


def test_rdma_read_moves_verified_bytes_with_the_verbs_sequence() -> None:
    fabric = FakeFabric()
    src = _state()
    with register(src, backend="ibverbs", verbs=FakeVerbs(fabric)) as reg:
        assert reg.handle.backends == ("ibverbs",) and reg.handle.verbs.rkey
        reg.publish(11)
        before = len(fabric.calls)
        dest = [torch.zeros_like(t) for t in src]
        assert read_into(reg.handle, dest, verbs=FakeVerbs(fabric), step=11) == 11
        assert all(torch.equal(a, b) for a, b in zip(src, dest, strict=True))
        calls = _reader_calls(fabric, before)
        # reader setup order, then the source's QP (created when our QP info arrives)
        order = [
            "open_device",
            "alloc_pd",
            "reg_mr",
            "create_cq",
            "create_qp",
            "modify_qp:INIT",
            "modify_qp:RTR",
            "modify_qp:RTS",
            "post_send",
            "poll_cq",
        ]
        positions = [calls.index(c) for c in order]
        assert positions == sorted(positions), calls[:30]
        assert calls.count("modify_qp:RTS") == 2  # one QP per side of the connection
        chunks = sum(-(-m.nbytes // reg.handle.chunk_bytes) for m in reg.handle.tensors)
        assert calls.count("post_send") == chunks + 2  # every chunk + the header twice
        assert fabric.bytes_read >= sum(t.numel() * t.element_size() for t in src)
        assert calls[-1] == "close"  # the reader tore its resources down
        assert not [qp for qp in fabric.qps.values() if qp.pd.ctx.alive and qp.state != "RTS"]


def test_source_dying_mid_read_fails_fast_and_another_source_serves() -> None:
    fabric = FakeFabric()
    src = _state()
    dying = register(src, backend="ibverbs", verbs=FakeVerbs(fabric), chunk_bytes=64 << 10)
    healthy = register(src, backend="ibverbs", verbs=FakeVerbs(fabric), chunk_bytes=64 << 10)
    try:
        dying.publish(4)
        healthy.publish(4)

        def kill_after_some_reads(n: int) -> None:
            if n == 5:  # the dying source's QP and MR vanish after 4 READs (its process died)
                fabric.before_read = None
                dying.close()

        fabric.before_read = kill_after_some_reads
        dest = [torch.zeros_like(t) for t in src]
        with pytest.raises(SourceGone, match="work-completion status 12"):
            read_into(dying.handle, dest, verbs=FakeVerbs(fabric), timeout=10)
        # the same failure inside read_from_any falls over to the healthy peer
        dying2 = register(src, backend="ibverbs", verbs=FakeVerbs(fabric), chunk_bytes=64 << 10)
        dying2.publish(4)
        fabric.before_read = lambda n: (setattr(fabric, "before_read", None), dying2.close())
        res = read_from_any([dying2.handle, healthy.handle], dest, verbs=FakeVerbs(fabric))
        assert res.index == 1 and res.step == 4 and "SourceGone" in res.failures[0]
        assert all(torch.equal(a, b) for a, b in zip(src, dest, strict=True))
    finally:
        healthy.close()


def test_the_fake_rejects_what_hardware_rejects() -> None:
    fabric = FakeFabric()
    v = FakeVerbs(fabric)
    ctx = v.open_device("fake_mlx5_0")
    pd = v.alloc_pd(ctx)
    buf = torch.zeros(64, dtype=torch.uint8)
    mr = v.reg_mr(pd, buf.data_ptr(), 64, ACCESS_LOCAL_WRITE)
    qp = v.create_qp(pd, v.create_cq(ctx, 4), 4)
    with pytest.raises(VerbsMisuse, match="RTS"):
        v.post_read(qp, 0, buf.data_ptr(), 64, mr.lkey, 0, 0)
    with pytest.raises(VerbsMisuse, match="RESET -> RTR"):
        v.qp_to_rtr(qp, None, 1, 0)


@pytest.mark.rdma
@pytest.mark.skipif(not local_devices(), reason="no RDMA device on this host")
def test_real_device_round_trip() -> None:
    src = _state()
    with register(src, backend="ibverbs") as reg:
        reg.publish(1)
        dest = [torch.zeros_like(t) for t in src]
        assert read_into(reg.handle, dest, backend="ibverbs", timeout=30) == 1
        assert all(torch.equal(a, b) for a, b in zip(src, dest, strict=True))
