"""Pure parts of the data plane: layout, chunking, handles, backend choice, the seqlock header."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from runtime.dataplane import Handle, LayoutMismatch, choose_backend, read_into, register, tcp
from runtime.dataplane.errors import TornRead
from runtime.dataplane.handle import ALIGN, layout, plan_chunks
from runtime.dataplane.memory import check_dest
from runtime.dataplane.snapshot import (
    Snapshot,
    owner_alive,
    parse_header,
    process_start_time,
    reap_orphans,
)


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


# --- the TCP server holds nothing for a peer without the token; bad requests kill nothing ---


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the server has closed ``sock`` (EOF or reset) within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(60)
def test_idle_unauthenticated_connections_are_capped_and_dropped() -> None:
    state = [torch.arange(4096, dtype=torch.float32)]
    with register(state, backend="tcp") as reg:
        assert reg.handle.tcp is not None
        before = threading.active_count()
        idle = [socket.create_connection(reg.handle.tcp, timeout=10) for _ in range(100)]
        try:
            time.sleep(0.5)  # let the accept loop take them all
            # 100 idle sockets cost at most the cap in threads, not one each
            assert threading.active_count() - before <= tcp.MAX_CONNECTIONS
            # and every one is closed: beyond the cap at once, the rest at the handshake
            # deadline (a generous bound here: three times it)
            waited_until = time.monotonic() + 3 * tcp.HANDSHAKE_TIMEOUT_S
            for s in idle:
                left = max(0.1, waited_until - time.monotonic())
                assert _closed_by_peer(s, left), "an idle unauthenticated socket is still held"
        finally:
            for s in idle:
                s.close()
        # the server still serves a real reader afterwards
        dest = [torch.zeros(4096)]
        reg.publish(3)
        assert read_into(reg.handle, dest, backend="tcp", step=3, timeout=20) == 3
        assert torch.equal(dest[0], state[0])


@pytest.mark.timeout(60)
def test_a_peer_trickling_its_first_request_is_dropped_at_the_deadline() -> None:
    with register([torch.zeros(16)], backend="tcp") as reg:
        assert reg.handle.tcp is not None
        server = tcp.TcpServer(reg._snap, bytes.fromhex(reg.handle.token), handshake_timeout_s=1.0)
        try:
            s = socket.create_connection(server.address, timeout=10)
            closed = False
            for _ in range(tcp.REQ.size - 1):  # one byte every 0.25 s: never a whole request
                try:
                    s.send(b"\0")
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                if _closed_by_peer(s, 0.25):
                    closed = True
                    break
            s.close()
            assert closed, "a peer sending a byte at a time was never dropped"
        finally:
            server.close()


@pytest.mark.timeout(60)
def test_an_empty_read_does_not_kill_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    crashed: list[object] = []
    monkeypatch.setattr(threading, "excepthook", crashed.append)
    with register([torch.arange(1000, dtype=torch.float32)], backend="tcp") as reg:
        reg.publish(5)
        h = reg.handle
        n_chunks = len(plan_chunks(h.tensors, h.chunk_bytes))
        conn = tcp._Conn(h, time.monotonic() + 20)
        try:
            view = tcp.hello(conn, n_chunks, h.header_bytes)
            assert view is not None and view.step == 5
            conn.request(tcp.OP_READ, view.slot, view.seq, 0, 0)
            status, now = tcp.STATUS.unpack(conn.recv_bytes(tcp.STATUS.size))
            (after,) = tcp.U64.unpack(conn.recv_bytes(8))
            assert (status, now, after) == (tcp.OK, view.seq, view.seq)
            again = tcp.hello(conn, n_chunks, h.header_bytes)  # same connection, still served
            assert again is not None and again.step == 5
        finally:
            conn.close()
    assert crashed == []


# --- a snapshot's owner is known by a clock-independent identity ------------------------------


def test_a_clock_step_does_not_make_a_live_owner_look_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step the wall clock by an hour as the kernel reports it (/proc/stat's btime moves with
    the clock, and psutil's create_time with it): a live owner's snapshot must survive
    reap_orphans, and its readers must still see it alive."""
    with register([torch.zeros(1024)], backend="shm") as reg:
        path = reg.handle.shm_path
        assert path is not None and os.path.exists(path)
        fake = tmp_path / "proc"
        fake.mkdir()
        lines = Path("/proc/stat").read_text().splitlines()
        stepped = [
            f"btime {int(line.split()[1]) + 3600}" if line.startswith("btime") else line
            for line in lines
        ]
        (fake / "stat").write_text("\n".join(stepped) + "\n")
        pid = os.getpid()
        (fake / str(pid)).symlink_to(f"/proc/{pid}")
        monkeypatch.setattr(psutil, "PROCFS_PATH", str(fake))
        assert owner_alive(reg.handle.pid, reg.handle.start_time)
        assert path not in reap_orphans()
        assert os.path.exists(path)


def test_owner_identity_rejects_a_reused_pid_and_a_dead_process() -> None:
    ticks = process_start_time(os.getpid())
    assert isinstance(ticks, int)
    assert owner_alive(os.getpid(), ticks)
    assert not owner_alive(os.getpid(), ticks + 1)  # same pid, another process
    assert not owner_alive(2**22 + 1, ticks)  # above pid_max: no such process
