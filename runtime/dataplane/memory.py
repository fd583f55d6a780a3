"""Raw memory helpers shared by the backends: byte views of tensors, chunk checksums (plain,
fused with a copy, fused with a socket receive), and the check that destination tensors match a
handle.

Views are built from ``data_ptr()`` with ctypes, so they work for every dtype (bfloat16,
bool, ...) without numpy; the caller keeps the tensor alive while a view is in use.

Checksums are xxh3-64. With the C fast path (``runtime/dataplane/_fastpath.c``, built at
install when a C compiler and Debian's ``libxxhash-dev`` are there) each block is hashed right
after it is copied or received, while it is still in cache, with SIMD-dispatched xxh3 and the
GIL released; without it the same digests are computed in a second pass by python-xxhash.
"""

from __future__ import annotations

import ctypes
import socket
import threading
from collections.abc import Callable, Sequence

import torch
import xxhash

from runtime.dataplane.errors import LayoutMismatch
from runtime.dataplane.handle import Chunk, TensorMeta, dtype_name

try:
    from runtime.dataplane import _fastpath
except ImportError:  # not built: no C compiler or no xxhash headers at install time
    # mypy types an imported module as never None and has no "module or None" type that keeps
    # the stub's signatures (python/mypy#1297); the `is not None` checks below are what count.
    _fastpath = None  # type: ignore[assignment]

#: Whether the fused C path is in use (``ftharness bench transfer`` reports it).
FASTPATH = _fastpath is not None


def hash_at(addr: int, nbytes: int) -> int:
    """xxh3-64 of ``nbytes`` at ``addr`` (releases the GIL)."""
    if _fastpath is not None:
        return _fastpath.hash(addr, nbytes)
    return xxhash.xxh3_64_intdigest(address_view(addr, nbytes))


def copy_and_hash(dst: int, src: int, nbytes: int) -> int:
    """Copy ``nbytes`` from ``src`` to ``dst``; return the xxh3-64 of the bytes written."""
    if _fastpath is not None:
        return _fastpath.copy_hash(dst, src, nbytes)
    ctypes.memmove(dst, src, nbytes)
    return hash_at(dst, nbytes)


def recv_and_hash(sock: socket.socket, dst: int, nbytes: int) -> tuple[int, int]:
    """Receive ``nbytes`` from the blocking ``sock`` into ``dst``: ``(received, xxh3-64 of the
    bytes received)``; ``received < nbytes`` means the peer closed the connection. Socket
    errors raise ``OSError`` (an expired ``SO_RCVTIMEO`` raises ``BlockingIOError``)."""
    if _fastpath is not None:
        return _fastpath.recv_hash(sock.fileno(), dst, nbytes)
    got = recv_fully(sock, address_view(dst, nbytes))
    return got, hash_at(dst, got)


def recv_fully(sock: socket.socket, view: memoryview) -> int:
    """Receive into all of ``view``; return the bytes received, fewer only if the peer closed.

    ``MSG_WAITALL``: on a blocking socket one syscall (one GIL release) fills the view, not one
    per socket-buffer's worth; the loop covers a signal or an ``SO_RCVTIMEO`` cutting it short.
    """
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if k == 0:
            break
        got += k
    return got


def address_view(addr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at a raw address (no copy)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def tensor_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's data."""
    return address_view(t.data_ptr(), t.numel() * t.element_size())


def check_dest(metas: Sequence[TensorMeta], dest: Sequence[torch.Tensor]) -> None:
    """Raise ``LayoutMismatch`` unless ``dest`` are contiguous CPU tensors with the handle's
    dtypes and shapes, in order. Nothing is written before this passes."""
    if len(metas) != len(dest):
        raise LayoutMismatch(f"handle has {len(metas)} tensors, destination has {len(dest)}")
    for i, (m, t) in enumerate(zip(metas, dest, strict=True)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise LayoutMismatch(f"destination tensor {i} must be a contiguous CPU tensor")
        if dtype_name(t.dtype) != m.dtype or tuple(t.shape) != m.shape:
            raise LayoutMismatch(
                f"destination tensor {i} is {dtype_name(t.dtype)}{list(t.shape)}, "
                f"source is {m.dtype}{list(m.shape)}"
            )


def run_parallel(chunks: Sequence[Chunk], work: Callable[[Chunk], None], threads: int) -> None:
    """Run ``work`` over ``chunks`` on ``threads`` threads that each take the next unclaimed
    chunk (so a thread the scheduler delays does not leave its share for last); re-raise the
    first exception after all threads stop. Memory copies and xxhash release the GIL, so two
    threads use both cores."""
    if threads <= 1 or len(chunks) < 2:
        for c in chunks:
            work(c)
        return
    errors: list[BaseException] = []
    stop = threading.Event()
    claim = iter(chunks)
    lock = threading.Lock()

    def loop() -> None:
        try:
            while not stop.is_set():
                with lock:
                    c = next(claim, None)
                if c is None:
                    return
                work(c)
        except BaseException as e:  # re-raised in the caller
            errors.append(e)
            stop.set()

    ts = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
