"""The manual cross-host RDMA check (see ``runtime.dataplane.ibverbs``, "Testing"):

    A: python -m runtime.dataplane.rdma_check serve --bind <A's IP>   # prints a handle
    B: python -m runtime.dataplane.rdma_check read '<handle>'         # reads 1 GiB, verified

Its own module so that the data plane's modules never import the package that imports them.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from runtime.dataplane import Handle, read_into, register


def _cli(argv: list[str]) -> int:
    """``serve`` / ``read HANDLE``: the manual cross-host check described above."""
    if argv[:1] == ["serve"]:
        bind = argv[argv.index("--bind") + 1] if "--bind" in argv else "127.0.0.1"
        state = [torch.randn(64 << 20) for _ in range(4)]  # 1 GiB of float32
        reg = register(state, backend="ibverbs", bind=bind)
        reg.publish(1)
        print(reg.handle.dumps(), flush=True)
        threading.Event().wait()
        return 0
    if argv[:1] == ["read"]:
        handle = Handle.loads(argv[1])
        dest = [torch.zeros(m.shape) for m in handle.tensors]
        t0 = time.perf_counter()
        read_into(handle, dest, backend="ibverbs", timeout=60)
        print(f"{handle.total_bytes / (time.perf_counter() - t0) / 1e9:.2f} GB/s, verified")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))
