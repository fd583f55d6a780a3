"""The data plane: one-sided pulls of a registered state over shared memory, TCP or RDMA.

Source::

    reg = register(tensors)            # backend="auto": shm + tcp (+ ibverbs with a device)
    reg.publish(step)                  # snapshot; training continues at once
    send(reg.handle.dumps())           # a few hundred bytes on the control plane

Reader::

    read_into(handle, dest_tensors, step=step, timeout=30)   # fills dest in place, verified
    read_from_any([h1, h2], dest_tensors)                     # falls over to the next source

Imports only torch, the standard library, psutil, tenacity and xxhash (pyverbs lazily, in
ibverbs.py); nothing from the harness or torchft.
"""

from runtime.dataplane.errors import (
    ChecksumMismatch,
    LayoutMismatch,
    SourceGone,
    TornRead,
    TransferError,
    TransferTimeout,
)
from runtime.dataplane.handle import Handle, TensorMeta
from runtime.dataplane.reader import ReadResult, read_from_any, read_into
from runtime.dataplane.registry import RegisteredState, register
from runtime.dataplane.select import Choice, choose_backend

__all__ = [
    "ChecksumMismatch",
    "Choice",
    "Handle",
    "LayoutMismatch",
    "ReadResult",
    "RegisteredState",
    "SourceGone",
    "TensorMeta",
    "TornRead",
    "TransferError",
    "TransferTimeout",
    "choose_backend",
    "read_from_any",
    "read_into",
    "register",
]
