"""Shared-memory backend (same host): the reader maps the source's snapshot file read-only and
copies each chunk straight into the destination tensors, hashing it while it is still in cache.

No socket and no source-side work: the source's training loop is never interrupted. The
mapping is cached per snapshot file, because faulting in a fresh mapping of a large state
costs about as much as the copy; ``release_mappings()`` drops the cache.

A snapshot whose owner process is gone is refused (``SourceGone``): its bytes may still be
consistent, but a dead replica is no longer a member of the quorum, so its state is not
authoritative. The check runs before and after the copy.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence

import torch

from runtime.dataplane.errors import ChecksumMismatch, SourceGone, TornRead
from runtime.dataplane.handle import Handle, plan_chunks
from runtime.dataplane.memory import copy_and_hash, run_parallel
from runtime.dataplane.snapshot import owner_alive, parse_header, slot_seq, wait_for_step

_MAX_MAPS = 8
_maps: OrderedDict[str, tuple[mmap.mmap, int, torch.Tensor]] = OrderedDict()
_maps_lock = threading.Lock()


def _attach(path: str, size: int) -> tuple[mmap.mmap, int]:
    with _maps_lock:
        hit = _maps.get(path)
        if hit is not None:
            _maps.move_to_end(path)
            return hit[0], hit[1]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise SourceGone(f"shared-memory snapshot {path} no longer exists") from e
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: we only take its address
            anchor = torch.frombuffer(mm, dtype=torch.uint8)
        _maps[path] = (mm, anchor.data_ptr(), anchor)
        while len(_maps) > _MAX_MAPS:
            _drop(next(iter(_maps)))
        return mm, anchor.data_ptr()


def _drop(path: str) -> None:
    mm, _, anchor = _maps.pop(path)
    del anchor
    with contextlib.suppress(BufferError):
        mm.close()


def release_mappings() -> None:
    """Unmap every cached snapshot mapping."""
    with _maps_lock:
        for path in list(_maps):
            _drop(path)


def read_shm(
    handle: Handle,
    dest: Sequence[torch.Tensor],
    *,
    deadline: float,
    step: int | None,
    threads: int = 2,
) -> int:
    """One attempt: copy the active slot into ``dest`` and verify it. Returns the step read.

    Raises ``TornRead`` if the source republished over the slot mid-read (caller retries),
    ``SourceGone`` if the owner died, ``ChecksumMismatch`` on corruption, ``TransferTimeout``
    if ``step`` was not published before ``deadline``.
    """
    assert handle.shm_path is not None
    if not owner_alive(handle.pid, handle.start_time):
        with _maps_lock:
            if handle.shm_path in _maps:
                _drop(handle.shm_path)
        raise SourceGone(f"source process {handle.pid} is gone")
    size = handle.header_bytes + 2 * handle.slot_bytes
    mm, base = _attach(handle.shm_path, size)
    chunks = plan_chunks(handle.tensors, handle.chunk_bytes)

    def check_alive() -> None:
        if not owner_alive(handle.pid, handle.start_time):
            raise SourceGone(f"source process {handle.pid} is gone")

    view = wait_for_step(
        lambda: parse_header(mm, len(chunks)),
        step,
        deadline,
        handle.shm_path,
        check_alive=check_alive,
    )
    data = base + handle.header_bytes + view.slot * handle.slot_bytes
    ptrs = [t.data_ptr() for t in dest]
    bad: list[int] = []

    def copy(c) -> None:
        digest = copy_and_hash(ptrs[c.tensor] + c.offset, data + c.flat, c.length)
        if digest != view.checksums[c.index]:
            bad.append(c.index)

    run_parallel(chunks, copy, threads)
    if slot_seq(mm, view.slot) != view.seq:
        raise TornRead("source republished over the slot during the read")
    if bad:
        raise ChecksumMismatch(f"{len(bad)} chunk(s) failed their checksum, first {min(bad)}")
    if not owner_alive(handle.pid, handle.start_time):
        raise SourceGone(f"source process {handle.pid} died during the read")
    return view.step
