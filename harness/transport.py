"""The data plane as a torchft ``CheckpointTransport``: ``metadata()`` is the data-plane handle,
``send_checkpoint`` publishes a snapshot (training continues at once), ``recv_checkpoint`` is
``read_into`` the replacement's already-built tensors.

Selectable by name: importing this module registers ``"dataplane"`` with
``harness.quorum.register_transport`` (config ``transport = "dataplane"``).

How the state dict travels: its tensor leaves are the registered tensors (in pytree flatten
order); everything else (the tree structure, ints such as torchft's step, the data position)
is pickled into one extra fixed-size byte tensor, the "blob", published in the same snapshot,
so tensors and non-tensor leaves always belong to the same step. The blob is a peer's pickle,
trusted as torchft's HTTP transport trusts it (``weights_only=False``).

Layout changes (e.g. Adam moments appear after the first step) are handled in
``metadata()``, which torchft calls at the start of every quorum, before any send: if the
state's tensor layout differs from the registered one, it re-registers and hands out the new
handle.
"""

from __future__ import annotations

import pickle
import struct
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten
from torchft.checkpointing.transport import CheckpointTransport

from runtime.dataplane import Handle, LayoutMismatch, RegisteredState, read_into, register

T = TypeVar("T")
_LEN = struct.Struct("<Q")
MIN_BLOB = 64 << 10


def _flatten(state: object) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    leaves, spec = tree_flatten_with_path(state)
    paths = [tuple(str(k) for k in path) for path, _ in leaves]
    return paths, [v for _, v in leaves], spec


def _signature(values: list[Any]) -> tuple:
    return tuple((v.dtype, tuple(v.shape)) for v in values if isinstance(v, torch.Tensor))


class DataplaneTransport(CheckpointTransport[T]):
    """torchft checkpoint transport over ``runtime.dataplane``.

    ``state_dict``: returns the state a healing peer needs (on a source: what it would send;
    on a replacement: its already-built tensors, filled in place). ``backend``: what a source
    serves ("auto", "shm", "tcp", "ibverbs"); ``read_backend``: what a reader uses ("auto"
    picks shm on the same host). Tensor leaves of the replacement's state are matched to the
    source's by position, then checked by dtype, shape and path.
    """

    def __init__(
        self,
        *,
        state_dict: Callable[[], object] | None = None,
        timeout: timedelta = timedelta(seconds=60),
        backend: str = "auto",
        read_backend: str = "auto",
        bind: str = "127.0.0.1",
    ) -> None:
        self._state_dict = state_dict
        self._timeout = timeout
        self._backend = backend
        self._read_backend = read_backend
        self._bind = bind
        self._reg: RegisteredState | None = None
        self._blob: torch.Tensor | None = None
        self._sig: tuple | None = None
        self._lock = threading.Lock()  # held while publishing; disallow_checkpoint waits on it

    def _ensure_registered(self, values: list[Any], blob_len: int) -> None:
        sig = _signature(values)
        need = max(MIN_BLOB, 4 * (blob_len + _LEN.size))
        if self._reg is not None and sig == self._sig and self._blob.numel() >= blob_len + 8:
            return
        if self._reg is not None:
            self._reg.close()
        self._blob = torch.zeros(need, dtype=torch.uint8)
        tensors = [v for v in values if isinstance(v, torch.Tensor)] + [self._blob]
        self._reg = register(tensors, backend=self._backend, bind=self._bind)
        self._sig = sig

    def metadata(self) -> str:
        """The current handle as JSON; registers (or re-registers on a layout change) from
        ``state_dict()``. Empty until there is a state to describe."""
        with self._lock:
            if self._state_dict is not None:
                paths, values, spec = _flatten(self._state_dict())
                self._ensure_registered(values, len(_encode_blob(paths, values, spec)))
            return self._reg.handle.dumps() if self._reg is not None else ""

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Publish ``state_dict`` as ``step``; returns when the snapshot is complete."""
        with self._lock:
            paths, values, spec = _flatten(state_dict)
            blob = _encode_blob(paths, values, spec)
            self._ensure_registered(values, len(blob))
            self._blob[: _LEN.size + len(blob)].copy_(
                torch.frombuffer(bytearray(_LEN.pack(len(blob)) + blob), dtype=torch.uint8)
            )
            self._reg.publish(step)

    def disallow_checkpoint(self) -> None:
        # A publish in flight copies the live tensors: wait for it before they change.
        with self._lock:
            pass

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Read the source's ``step`` into this process's tensors (from ``state_dict()``, or
        fresh ones when there is no template) and rebuild the state dict around them."""
        if not metadata:
            raise LayoutMismatch(f"source rank {src_rank} has no data-plane state registered")
        handle = Handle.loads(metadata)
        metas = handle.tensors
        template: list[torch.Tensor] = []
        local_paths: list[tuple[str, ...]] = []
        if self._state_dict is not None:
            lp, values, _ = _flatten(self._state_dict())
            pairs = [(p, v) for p, v in zip(lp, values, strict=True) if isinstance(v, torch.Tensor)]
            local_paths = [p for p, _ in pairs]
            template = [v for _, v in pairs]
        dest = []
        for i, m in enumerate(metas[:-1]):
            t = template[i] if i < len(template) else None
            ok = (
                t is not None
                and t.device.type == "cpu"
                and t.is_contiguous()
                and str(t.dtype).removeprefix("torch.") == m.dtype
                and tuple(t.shape) == m.shape
            )
            dest.append(t.detach() if ok else torch.empty(m.shape, dtype=getattr(torch, m.dtype)))
        blob = torch.empty(metas[-1].shape, dtype=torch.uint8)
        read_into(
            handle,
            [*dest, blob],
            step=step,
            timeout=timeout.total_seconds(),
            backend=self._read_backend,
        )
        (n,) = _LEN.unpack(bytes(blob[: _LEN.size].numpy()))
        paths, others, spec = pickle.loads(bytes(blob[_LEN.size : _LEN.size + n].numpy()))
        tensors = iter(dest)
        values = [next(tensors) if v is _TENSOR else v for v in others]
        _check_paths(paths, others, local_paths)
        return tree_unflatten(values, spec)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            if self._reg is not None:
                self._reg.close()
                self._reg = None


class _TensorSlot:
    """Placeholder for a tensor leaf inside the pickled blob."""

    def __reduce__(self):
        return (_tensor_slot, ())


def _tensor_slot() -> _TensorSlot:
    return _TENSOR


_TENSOR = _TensorSlot()


def _encode_blob(paths, values, spec) -> bytes:
    others = [_TENSOR if isinstance(v, torch.Tensor) else v for v in values]
    return pickle.dumps((paths, others, spec))


def _check_paths(src_paths, src_values, local_paths) -> None:
    """The i-th source tensor must sit at the same path as the i-th local one, up to a prefix
    (torchft wraps the user state as ``{"user": {"default": ...}}``)."""
    src_t = [p for p, v in zip(src_paths, src_values, strict=True) if v is _TENSOR]
    for i, (a, b) in enumerate(zip(src_t, local_paths, strict=False)):
        if a[-len(b) :] != b and b[-len(a) :] != a:
            raise LayoutMismatch(f"tensor {i}: source path {''.join(a)} vs local {''.join(b)}")


def make_dataplane_transport(
    pg: object = None,
    timeout: timedelta = timedelta(seconds=60),
    state_dict: Callable[[], object] | None = None,
    *,
    backend: str = "auto",
    read_backend: str = "auto",
    bind: str = "127.0.0.1",
) -> DataplaneTransport:
    """Factory with ``harness.quorum``'s ``(pg, timeout, state_dict)`` signature; ``pg`` is
    unused (bytes never go through the process group)."""
    return DataplaneTransport(
        state_dict=state_dict,
        timeout=timeout,
        backend=backend,
        read_backend=read_backend,
        bind=bind,
    )


def _register_with_quorum() -> None:
    try:
        from harness.quorum import register_transport
    except ImportError:  # quorum glue not present: the factory is still usable directly
        return
    register_transport("dataplane", make_dataplane_transport)


_register_with_quorum()
