"""The source's double-buffered snapshot: two slots of the registered state plus a seqlock
header, in one file under /dev/shm (or an anonymous mapping when shared memory is short).

Every backend reads from here, so they share one consistency protocol:

* Layout: ``[header | slot 0 | slot 1]``. The header holds a magic, the active slot, a publish
  generation, the chunk count, each slot's ``(seq, step)`` and each slot's checksum table
  (xxh3-64 per chunk).
* ``publish(step)`` writes the slot *not* being served: seq becomes odd, tensors are copied
  and hashed, the step is written, seq becomes even, then ``active`` flips. Training goes on
  the moment ``publish`` returns: readers read the snapshot, never the live tensors.
* A reader takes ``active``, reads ``seq`` (even), the step and checksums, copies the chunks,
  then re-reads ``seq``. Unchanged: the copy is a consistent snapshot. Changed: the source
  published twice during the read and reused the slot; the read is torn and is retried.
* Invariant: a slot's bytes and checksums only change while its seq is odd, and only the
  slot that is not ``active`` is ever written.

Memory ordering: the header words are 8-byte aligned single stores, and x86-64 (TSO) keeps
stores in program order, which is what a seqlock needs. On a weakly ordered CPU (ARM) the
publisher would need release fences between the data and the seq stores.

The second slot is allocated by tmpfs only when first written (files are sparse), so a
source that publishes once pays for one copy of its state.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.dataplane.errors import TornRead, TransferTimeout
from runtime.dataplane.handle import Chunk, TensorMeta, plan_chunks, round_up, to_dtype
from runtime.dataplane.memory import copy_and_hash, run_parallel

MAGIC = int.from_bytes(b"FTDPSNP1", "little")
PAGE = 4096
SHM_DIR = "/dev/shm"
# ftdp-PID-tSTARTTICKS-RANDOM. (Names from before start ticks, ftdp-PID-MILLISECONDS-RANDOM,
# are never matched: they cannot be checked without the wall clock, so they are left alone.)
_NAME = re.compile(r"^ftdp-(\d+)-t(\d+)-[0-9a-f]+$")
# header words: magic, active, generation, n_chunks, then (seq, step) for slot 0 and slot 1
_TOP = struct.Struct("<QqQQ")
_SLOT = struct.Struct("<Qq")
_SLOT_AT = (32, 48)
_TABLE_AT = 64


def header_bytes(n_chunks: int) -> int:
    return round_up(_TABLE_AT + 2 * 8 * n_chunks, PAGE)


def slot_bytes(metas: tuple[TensorMeta, ...]) -> int:
    end = max((m.offset + m.nbytes for m in metas), default=0)
    return round_up(max(end, 1), PAGE)


@dataclass(frozen=True, kw_only=True)
class SlotView:
    """A consistent reading of the header: which slot to read, its seq and step, and the
    checksums of its chunks."""

    slot: int
    seq: int
    step: int
    checksums: tuple[int, ...]


def parse_header(buf, n_chunks: int) -> SlotView | None:
    """Read the header from any buffer holding its bytes (an mmap, or a copy fetched over a
    network). Returns None if nothing is published yet; raises ``TornRead`` if the active
    slot is being written (seq odd) or changed while the table was read."""
    magic, active, _gen, n = _TOP.unpack_from(buf, 0)
    if magic != MAGIC or n != n_chunks:
        raise TornRead(f"bad snapshot header (magic {magic:#x}, {n} chunks, want {n_chunks})")
    if active < 0:
        return None
    seq, step = _SLOT.unpack_from(buf, _SLOT_AT[active])
    if seq % 2:
        raise TornRead("the active slot is being written")
    table = struct.unpack_from(f"<{n_chunks}Q", buf, _TABLE_AT + active * 8 * n_chunks)
    if slot_seq(buf, active) != seq:
        raise TornRead("the slot changed while its checksums were read")
    return SlotView(slot=active, seq=seq, step=step, checksums=table)


def wait_for_step(
    read_header: Callable[[], SlotView | None],
    step: int | None,
    deadline: float,
    where: str,
    *,
    interval: float = 0.002,
    check_alive: Callable[[], None] | None = None,
) -> SlotView:
    """Poll ``read_header`` (each backend's way of reading the source's header: a mapping, a
    HELLO, an RDMA READ) until it shows a complete slot, with ``step`` if one is given.
    ``check_alive`` raises if the source is known dead, so a reader need not wait out the
    deadline; ``TransferTimeout`` says what the source served last."""
    last = "nothing published"
    while True:
        try:
            view = read_header()
        except TornRead as e:
            view, last = None, str(e)
        if view is not None:
            if step is None or view.step == step:
                return view
            last = f"source serves step {view.step}"
        if time.monotonic() + interval >= deadline:
            raise TransferTimeout(f"timed out waiting for step {step} from {where}: {last}")
        if check_alive is not None:
            check_alive()
        time.sleep(interval)


def slot_seq(buf, slot: int) -> int:
    return _SLOT.unpack_from(buf, _SLOT_AT[slot])[0]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """``(state, starttime)`` of ``pid`` from ``/proc/PID/stat``, or None if there is no such
    process. ``starttime`` (field 22) is in clock ticks since boot: fixed for the life of the
    process and independent of the wall clock. The command name (field 2) is in parentheses and
    may itself hold spaces and parentheses, so fields are counted after its *last* ``)``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:  # no such process (or /proc hidden from us: treated the same)
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return fields[0].decode(), int(fields[22 - 3])  # fields[0] is field 3 (state)
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int:
    """A clock-independent identity of process ``pid``: its start time in clock ticks since
    boot. A wall-clock time (psutil's ``create_time``) would move when the clock is stepped,
    and live owners would then look dead. Raises ``ProcessLookupError`` if there is none."""
    st = _proc_stat(pid)
    if st is None:
        raise ProcessLookupError(f"no process {pid}")
    return st[1]


def owner_alive(pid: int, start_time: float) -> bool:
    """True if process ``pid`` exists, is not a zombie, and is the same process that had
    ``start_time`` (:func:`process_start_time`), not a later one that reused the pid."""
    st = _proc_stat(pid)
    return st is not None and st[1] == start_time and st[0] not in ("Z", "X")


def reap_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink snapshot files whose owner process is gone (a SIGKILLed source cannot clean up).
    Returns the removed paths."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            m = _NAME.match(name)
            if m and not owner_alive(int(m.group(1)), int(m.group(2))):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))
                    removed.append(os.path.join(directory, name))
    return removed


#: madvise(2) advice that faults a range in, writable, without changing its bytes (Linux 5.14+).
_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)


def _populate(addr: int, size: int) -> bool:
    """Fault in ``size`` bytes at the page-aligned ``addr``; False where the kernel cannot.
    A ctypes call releases the GIL, so the caller's other threads run meanwhile."""
    return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), _MADV_POPULATE_WRITE) == 0


class Snapshot:
    """The owner's side: creates the mapping, publishes into it, unlinks it on close.

    A fresh mapping's pages are allocated on first write, which made the first publish into each
    slot cost about 0.9 s per GiB here, against 0.12 s once faulted in, and a publish runs while
    a healing peer waits. So a background thread faults the whole mapping in at creation
    (``prefaulted`` is set when it is done); it never changes a byte, so publishes may run
    meanwhile.
    """

    def __init__(self, metas: tuple[TensorMeta, ...], chunk_bytes: int, *, shared: bool) -> None:
        self.metas = metas
        self.chunks: tuple[Chunk, ...] = plan_chunks(metas, chunk_bytes)
        self.header_bytes = header_bytes(len(self.chunks))
        self.slot_bytes = slot_bytes(metas)
        self.size = self.header_bytes + 2 * self.slot_bytes
        self.path: str | None = None
        self._lock = threading.Lock()
        pid = os.getpid()
        ticks = process_start_time(pid)
        if shared and _free_bytes(SHM_DIR) > 2 * self.size:
            self.path = f"{SHM_DIR}/ftdp-{pid}-t{ticks}-{secrets.token_hex(6)}"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self.size)
                self.mm = mmap.mmap(fd, self.size)
            finally:
                os.close(fd)
        else:
            self.mm = mmap.mmap(-1, self.size)
        self._base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.address = self._base.data_ptr()
        _TOP.pack_into(self.mm, 0, MAGIC, -1, 0, len(self.chunks))
        for at in _SLOT_AT:
            _SLOT.pack_into(self.mm, at, 0, -1)
        self.prefaulted = threading.Event()
        threading.Thread(target=self._prefault, name="snapshot-prefault", daemon=True).start()

    def _prefault(self) -> None:
        try:
            _populate(self.address, self.size)
        finally:
            self.prefaulted.set()

    def data_offset(self, slot: int) -> int:
        return self.header_bytes + slot * self.slot_bytes

    def publish(self, tensors: list[torch.Tensor], step: int, *, threads: int = 2) -> None:
        """Copy ``tensors`` into the idle slot, hashing each chunk as it is copied, and make it
        the served one. Returns once the snapshot is complete; the caller may then mutate
        ``tensors`` freely."""
        # Contiguous CPU tensors of the registered dtype are copied from in place; anything
        # else (a GPU tensor, a strided view) is first staged into one that is.
        srcs = [_as_source(m, t) for m, t in zip(self.metas, tensors, strict=True)]
        ptrs = [t.data_ptr() for t in srcs]
        with self._lock:
            _magic, active, gen, n = _TOP.unpack_from(self.mm, 0)
            slot = 0 if active < 0 else 1 - active
            seq, _ = _SLOT.unpack_from(self.mm, _SLOT_AT[slot])
            _SLOT.pack_into(self.mm, _SLOT_AT[slot], seq + 1, -1)  # odd: being written
            base = self.address + self.data_offset(slot)
            sums = [0] * n

            def copy_chunk(c: Chunk) -> None:
                sums[c.index] = copy_and_hash(base + c.flat, ptrs[c.tensor] + c.offset, c.length)

            run_parallel(self.chunks, copy_chunk, threads)
            struct.pack_into(f"<{n}Q", self.mm, _TABLE_AT + slot * 8 * n, *sums)
            _SLOT.pack_into(self.mm, _SLOT_AT[slot], seq + 2, step)  # even: complete
            _TOP.pack_into(self.mm, 0, MAGIC, slot, gen + 1, n)

    def view(self) -> SlotView | None:
        """The owner's own consistent view of the header (retries while a publish runs)."""
        for _ in range(1000):
            try:
                return parse_header(self.mm, len(self.chunks))
            except TornRead:
                time.sleep(0.001)
        raise TornRead("snapshot header stayed inconsistent")

    def close(self) -> None:
        # let a running prefault finish first; past the bound, madvise on the unmapped range
        # only fails
        self.prefaulted.wait(timeout=5)
        del self._base
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None


def _as_source(meta: TensorMeta, t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``meta``'s dtype and shape, to copy bytes from."""
    t = t.detach()
    if tuple(t.shape) != meta.shape:
        raise ValueError(f"tensor of shape {list(t.shape)} published as {list(meta.shape)}")
    dtype = to_dtype(meta.dtype)
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        t = t.to(device="cpu", dtype=dtype).contiguous()
    return t


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
