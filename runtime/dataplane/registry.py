"""The source side: ``register`` a flat list of tensors, ``publish`` a step, hand out the
handle. The registered tensors stay the caller's (live training state); ``publish`` copies
them into the double-buffered snapshot that every backend serves."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Sequence

import torch

from runtime.dataplane.errors import TransferError
from runtime.dataplane.handle import DEFAULT_CHUNK_BYTES, Handle, host_id, layout
from runtime.dataplane.select import BACKENDS
from runtime.dataplane.snapshot import Snapshot, process_start_time, reap_orphans
from runtime.dataplane.tcp import TcpServer
from runtime.dataplane.verbs_api import Verbs


class RegisteredState:
    """A registered state: ``handle`` for readers, ``publish(step)`` to make a new step
    readable, ``close()`` to stop serving and free the snapshot.

    Guarantees: a reader only ever gets a complete published step (never a mix of two steps,
    never bytes written while copying); the tensors may be mutated as soon as ``publish``
    returns. Not guaranteed: that an old step stays readable after two further publishes.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        backends: tuple[str, ...],
        bind: str,
        chunk_bytes: int,
        verbs: Verbs | None,
        rdma_device: str | None,
    ) -> None:
        self.tensors = list(tensors)
        metas = layout(self.tensors)
        self._snap = Snapshot(metas, chunk_bytes, shared="shm" in backends)
        if self._snap.path is None:
            backends = tuple(b for b in backends if b != "shm")
        self._server: TcpServer | None = None
        self._verbs_source = None
        self._published: int | None = None
        self._lock = threading.Lock()
        token = secrets.token_bytes(16)
        verbs_info = None
        try:
            if "ibverbs" in backends:
                from runtime.dataplane.ibverbs import PyverbsVerbs, VerbsSource

                self._verbs_source = VerbsSource(self._snap, verbs or PyverbsVerbs(), rdma_device)
                verbs_info = self._verbs_source.info
            if "tcp" in backends or "ibverbs" in backends:
                accept = self._verbs_source.accept if self._verbs_source else None
                self._server = TcpServer(self._snap, token, bind, verbs_accept=accept)
        except BaseException:
            self.close()
            raise
        if not backends:
            raise TransferError("no backend left to serve (shared memory unavailable?)")
        pid = os.getpid()
        self.handle = Handle(
            backends=backends,
            host_id=host_id(),
            pid=pid,
            start_time=process_start_time(pid),
            tensors=metas,
            chunk_bytes=chunk_bytes,
            header_bytes=self._snap.header_bytes,
            slot_bytes=self._snap.slot_bytes,
            shm_path=self._snap.path,
            tcp=self._server.address if self._server else None,
            token=token.hex(),
            verbs=verbs_info,
        )

    @property
    def published_step(self) -> int | None:
        return self._published

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Wait until the snapshot's memory is faulted in (a background thread started at
        registration does it, so that a first publish does not pay the page faults)."""
        return self._snap.prefaulted.wait(timeout)

    def publish(self, step: int, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Snapshot the registered tensors (or ``tensors``, same layout) as ``step``."""
        with self._lock:
            self._snap.publish(list(tensors) if tensors is not None else self.tensors, step)
            self._published = step

    def close(self) -> None:
        """Stop serving (open reads fail with ``SourceGone``) and unlink the snapshot."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._verbs_source is not None:
            self._verbs_source.close()
            self._verbs_source = None
        self._snap.close()

    def __enter__(self) -> RegisteredState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register(
    tensors: Sequence[torch.Tensor],
    *,
    backend: str | Sequence[str] = "auto",
    bind: str = "127.0.0.1",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    verbs: Verbs | None = None,
    rdma_device: str | None = None,
) -> RegisteredState:
    """Register ``tensors`` (any dtypes and devices) for one-sided reads.

    ``backend``: ``"auto"`` serves shared memory and TCP, plus ibverbs where an RDMA device
    exists; a name or a sequence of names restricts it. ``bind`` is the TCP listen address
    (port chosen by the OS). ``verbs`` substitutes the verbs layer (tests pass a fake).
    Nothing is readable until the first ``publish``. Also unlinks snapshot files left by
    sources that died without closing.
    """
    if backend == "auto":
        from runtime.dataplane.ibverbs import local_devices

        backends: tuple[str, ...] = ("shm", "tcp")
        if local_devices(verbs):
            backends = ("shm", "ibverbs", "tcp")
    else:
        backends = (backend,) if isinstance(backend, str) else tuple(backend)
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backend(s) {sorted(unknown)}; choose from {BACKENDS}")
    reap_orphans()
    return RegisteredState(
        tensors,
        backends=backends,
        bind=bind,
        chunk_bytes=chunk_bytes,
        verbs=verbs,
        rdma_device=rdma_device,
    )
