"""The reader side: ``read_into`` one source, ``read_from_any`` of several.

Retries happen at exactly two named boundaries, both with tenacity: a torn read (the source
republished over the slot being read) is retried against the same source, and a failed
source is replaced by the next healthy one. Everything else fails at once with a
``TransferError`` saying what happened.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt

from runtime.dataplane.errors import TornRead, TransferError
from runtime.dataplane.handle import Handle, host_id
from runtime.dataplane.memory import check_dest
from runtime.dataplane.select import choose_backend
from runtime.dataplane.verbs_api import Verbs

TORN_RETRIES = 5


def read_into(
    handle: Handle | str,
    dest: Sequence[torch.Tensor],
    *,
    backend: str = "auto",
    timeout: float = 60.0,
    step: int | None = None,
    streams: int | None = None,
    threads: int = 2,
    verbs: Verbs | None = None,
    rdma_device: str | None = None,
) -> int:
    """Fill ``dest`` (pre-built contiguous CPU tensors matching the handle) in place with the
    source's published state; every chunk's checksum is verified. Returns the step read.

    ``step``: wait (up to ``timeout``) until the source serves exactly this step. ``backend``:
    ``"auto"`` picks shared memory on the same host, RDMA where both ends have a device, TCP
    otherwise. ``streams``: parallel TCP connections (default 2-4, by core
    count). Raises ``TransferError`` (``SourceGone``, ``TransferTimeout``,
    ``ChecksumMismatch``, ``LayoutMismatch``); on error ``dest`` holds partial data.
    """
    h = Handle.loads(handle) if isinstance(handle, str) else handle
    check_dest(h.tensors, dest)
    local_rdma = False
    if "ibverbs" in h.backends and backend in ("auto", "ibverbs"):
        from runtime.dataplane.ibverbs import local_devices

        local_rdma = bool(local_devices(verbs))
    choice = choose_backend(
        offered=h.backends,
        same_host=h.host_id == host_id(),
        local_rdma=local_rdma,
        requested=backend,
    )
    deadline = time.monotonic() + timeout

    def attempt() -> int:
        if choice.backend == "shm":
            from runtime.dataplane.shm import read_shm

            return read_shm(h, dest, deadline=deadline, step=step, threads=threads)
        if choice.backend == "tcp":
            from runtime.dataplane.tcp import DEFAULT_STREAMS, read_tcp

            return read_tcp(
                h, dest, deadline=deadline, step=step, streams=streams or DEFAULT_STREAMS
            )
        from runtime.dataplane.ibverbs import read_ibverbs

        return read_ibverbs(h, dest, deadline=deadline, step=step, verbs=verbs, device=rdma_device)

    # named boundary 1: a torn read is retried against the same source
    for at in Retrying(
        retry=retry_if_exception_type(TornRead),
        stop=stop_after_attempt(TORN_RETRIES),
        reraise=True,
    ):
        with at:
            return attempt()
    raise AssertionError("unreachable")


@dataclass(frozen=True, kw_only=True)
class ReadResult:
    """Which source delivered (index into the handles), its step, and why earlier ones failed."""

    index: int
    step: int
    failures: tuple[str, ...]


def read_from_any(
    handles: Sequence[Handle | str],
    dest: Sequence[torch.Tensor],
    **kwargs,
) -> ReadResult:
    """Try each source in order until one delivers a verified state into ``dest``.

    ``kwargs`` go to ``read_into`` (``timeout`` is per source). Raises ``TransferError``
    naming every source's failure if none delivers.
    """
    if not handles:
        raise TransferError("no sources to read from")
    failures: list[str] = []
    # named boundary 2: a failed source is replaced by the next one
    retrying = Retrying(
        retry=retry_if_exception_type(TransferError),
        stop=stop_after_attempt(len(handles)),
        reraise=True,
    )
    try:
        for at in retrying:
            i = at.retry_state.attempt_number - 1
            with at:
                try:
                    step = read_into(handles[i], dest, **kwargs)
                except TransferError as e:
                    failures.append(f"source {i}: {type(e).__name__}: {e}")
                    raise
                return ReadResult(index=i, step=step, failures=tuple(failures))
    except TransferError as e:
        raise TransferError(f"all {len(handles)} sources failed: " + "; ".join(failures)) from e
    raise AssertionError("unreachable")
