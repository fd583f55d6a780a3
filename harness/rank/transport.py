"""The data plane as a torchft ``CheckpointTransport``: ``metadata()`` is the data-plane handle,
``send_checkpoint`` publishes a snapshot (training continues at once), ``recv_checkpoint`` is
``read_into`` the replacement's already-built tensors.

Selectable by name: ``harness.rank.torchft_glue.TRANSPORTS`` names :func:`make_dataplane_transport`
as
``"dataplane"`` (config ``transport = "dataplane"``).

How the state dict travels: its tensor leaves are the registered tensors (in pytree flatten
order); everything else (the tree structure, ints such as torchft's step, the data position)
is encoded as JSON into one extra fixed-size byte tensor, the "blob", published in the same
snapshot, so tensors and non-tensor leaves always belong to the same step.

The blob comes from a peer, and a peer can be anyone who got into the quorum: it is decoded
without any code execution (no pickle, and not ``torch.utils._pytree.treespec_loads``, whose
enum hook imports modules the JSON names). What it may hold, checked on receipt (anything else
raises :class:`BlobError` and the heal fails): containers ``dict``/``OrderedDict`` (keys ``str``
or ``int``), ``list`` and ``tuple``; leaves ``None``, ``bool``, ``int``, ``float``, ``str`` and
the tensors. A state with other containers or leaves (a namedtuple, a ``torch.dtype``) is
refused when it is sent, naming the path. This is stricter than torchft's own transports,
which unpickle what a peer sends: ``HTTPTransport`` loads with ``torch.load(weights_only=False)``
and ``PGTransport`` ``pickle.loads`` its metadata, so with them a member of the quorum can run
code in every healing trainer (we cannot change that from outside torchft).

Layout changes (e.g. Adam moments appear after the first step) are handled in
``metadata()``, which torchft calls at the start of every quorum, before any send: if the
state's tensor layout differs from the registered one, it re-registers and hands out the new
handle.
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.utils._pytree import TreeSpec, tree_flatten_with_path, tree_unflatten, treespec_leaf
from torchft.checkpointing.transport import CheckpointTransport

from runtime.actor import host_address
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

    def _ensure_registered(
        self, values: list[Any], blob_len: int
    ) -> tuple[RegisteredState, torch.Tensor]:
        """Register ``values`` and a blob of room for ``blob_len`` (unless what is registered
        already fits); returns the registration and its blob tensor."""
        sig = _signature(values)
        need = max(MIN_BLOB, 4 * (blob_len + _LEN.size))
        # _blob is set whenever _reg is (just below), so `_blob is not None` only narrows
        if (
            self._reg is not None
            and self._blob is not None
            and sig == self._sig
            and self._blob.numel() >= blob_len + 8
        ):
            return self._reg, self._blob
        if self._reg is not None:
            self._reg.close()
        blob = self._blob = torch.zeros(need, dtype=torch.uint8)
        tensors = [v for v in values if isinstance(v, torch.Tensor)] + [blob]
        reg = self._reg = register(tensors, backend=self._backend, bind=self._bind)
        self._sig = sig
        return reg, blob

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
            reg, blob_tensor = self._ensure_registered(values, len(blob))
            blob_tensor[: _LEN.size + len(blob)].copy_(
                torch.frombuffer(bytearray(_LEN.pack(len(blob)) + blob), dtype=torch.uint8)
            )
            reg.publish(step)

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
        dest: list[torch.Tensor] = []
        for i, m in enumerate(metas[:-1]):
            t = template[i] if i < len(template) else None
            if (
                t is not None
                and t.device.type == "cpu"
                and t.is_contiguous()
                and str(t.dtype).removeprefix("torch.") == m.dtype
                and tuple(t.shape) == m.shape
            ):
                dest.append(t.detach())
            else:
                dest.append(torch.empty(m.shape, dtype=getattr(torch, m.dtype)))
        blob = torch.empty(metas[-1].shape, dtype=torch.uint8)
        read_into(
            handle,
            [*dest, blob],
            step=step,
            timeout=timeout.total_seconds(),
            backend=self._read_backend,
        )
        (n,) = _LEN.unpack(bytes(blob[: _LEN.size].numpy()))
        if n > blob.numel() - _LEN.size:
            raise BlobError(f"blob length {n} exceeds the blob ({blob.numel()} bytes)")
        paths, others, spec = decode_blob(bytes(blob[_LEN.size : _LEN.size + n].numpy()))
        if sum(v is _TENSOR for v in others) != len(dest):
            raise BlobError(f"blob names {len(others)} leaves, not the {len(dest)} tensors sent")
        tensors = iter(dest)
        values = [next(tensors) if v is _TENSOR else v for v in others]
        _check_paths(paths, others, local_paths)
        return tree_unflatten(values, spec)

    def shutdown(self, wait: bool = True) -> None:
        with self._lock:
            if self._reg is not None:
                self._reg.close()
                self._reg = None


class BlobError(ValueError):
    """A blob that is not a well-formed description of a state (see the module doc); nothing in
    it was executed."""


class _TensorSlot:
    """Placeholder for a tensor leaf in the decoded blob."""

    def __repr__(self) -> str:
        return "<tensor>"


_TENSOR = _TensorSlot()
_SCALARS = (type(None), bool, int, float, str)
# Container types a blob may name, by the name it uses: nothing else can be built from one.
_NODES: dict[str, type] = {"dict": dict, "odict": OrderedDict, "list": list, "tuple": tuple}
_NODE_NAMES = {t: name for name, t in _NODES.items()}
_MAX_DEPTH = 64


def _encode_blob(paths: list[tuple[str, ...]], values: list[Any], spec: TreeSpec) -> bytes:
    leaves: list[Any] = []
    tensors: list[int] = []
    for i, (path, v) in enumerate(zip(paths, values, strict=True)):
        if isinstance(v, torch.Tensor):
            tensors.append(i)
            leaves.append(None)
        elif type(v) in _SCALARS:
            leaves.append(v)
        else:
            raise BlobError(f"{''.join(path)}: a {type(v).__name__} leaf cannot be sent")
    doc = {"paths": paths, "leaves": leaves, "tensors": tensors, "spec": _spec_to_json(spec)}
    return json.dumps(doc, separators=(",", ":")).encode()


def _spec_to_json(spec: TreeSpec) -> Any:
    if spec.is_leaf():
        return None
    name = _NODE_NAMES.get(spec.type)
    if name is None:
        raise BlobError(f"a {spec.type.__name__} container cannot be sent")
    keys = None
    if name in ("dict", "odict"):
        keys = list(spec.context)
        if not all(type(k) in (str, int) for k in keys):
            raise BlobError(f"{name} keys must be str or int: {keys!r}")
    return [name, keys, [_spec_to_json(c) for c in spec.children()]]


def _spec_from_json(node: Any, depth: int = 0) -> TreeSpec:
    if node is None:
        return treespec_leaf()
    if depth > _MAX_DEPTH:
        raise BlobError(f"blob nests deeper than {_MAX_DEPTH}")
    if not (isinstance(node, list) and len(node) == 3 and isinstance(node[2], list)):
        raise BlobError(f"malformed tree node {str(node)[:80]!r}")
    name, keys, children = node
    if name not in _NODES:
        raise BlobError(f"a blob may not build {str(name)[:40]!r}")
    specs = [_spec_from_json(c, depth + 1) for c in children]
    if name in ("dict", "odict"):
        if not (
            isinstance(keys, list)
            and len(keys) == len(specs)
            and all(type(k) in (str, int) for k in keys)
        ):
            raise BlobError(f"malformed {name} keys {str(keys)[:80]!r}")
    elif keys is not None:
        raise BlobError(f"a {name} has no keys")
    return TreeSpec(_NODES[name], keys, specs)


def decode_blob(raw: bytes) -> tuple[list[tuple[str, ...]], list[Any], TreeSpec]:
    """``(paths, leaves, spec)`` from a peer's blob, tensor leaves as a placeholder. Runs no code
    named by the blob; raises :class:`BlobError` for anything but the module doc's format."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise BlobError(f"blob is not JSON: {e}") from None
    if not isinstance(doc, dict) or set(doc) != {"paths", "leaves", "tensors", "spec"}:
        raise BlobError("blob is not a state description")
    paths, leaves, tensors = doc["paths"], doc["leaves"], doc["tensors"]
    if not (
        isinstance(paths, list)
        and isinstance(leaves, list)
        and isinstance(tensors, list)
        and len(paths) == len(leaves)
        and all(isinstance(p, list) and all(isinstance(k, str) for k in p) for p in paths)
        and all(type(v) in _SCALARS for v in leaves)
        and all(type(i) is int and 0 <= i < len(leaves) for i in tensors)
    ):
        raise BlobError("malformed paths, leaves or tensor positions")
    spec = _spec_from_json(doc["spec"])
    if spec.num_leaves != len(leaves):
        raise BlobError(f"tree has {spec.num_leaves} leaves, blob {len(leaves)}")
    others = list(leaves)
    for i in tensors:
        others[i] = _TENSOR
    return [tuple(p) for p in paths], others, spec


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
    bind: str | None = None,
) -> DataplaneTransport:
    """Factory with ``harness.rank.torchft_glue``'s ``(pg, timeout, state_dict)`` signature; ``pg``
    is
    unused (bytes never go through the process group)."""
    return DataplaneTransport(
        state_dict=state_dict,
        timeout=timeout,
        backend=backend,
        read_backend=read_backend,
        bind=bind or host_address(),  # where healing peers on other hosts reach us
    )
