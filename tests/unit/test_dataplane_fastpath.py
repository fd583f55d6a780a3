"""The data plane's checksum helpers: the C fast path (fused copy/receive-and-hash) and the
pure-Python fallback must give python-xxhash's xxh3-64 of the bytes, for any length, and report
a closed peer and an expired receive timeout the same way."""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest
import torch
import xxhash

from runtime.dataplane import memory

SIZES = [0, 1, 7, 64 * 1024, 64 * 1024 + 1, 3 * 1024 * 1024 + 13]


def test_the_fast_path_is_built() -> None:
    # bin/setup builds it (a C compiler and libxxhash-dev); a silent fallback would hide a
    # broken build behind slower transfers. Set FTHARNESS_ALLOW_PURE_PYTHON=1 to waive.
    if os.environ.get("FTHARNESS_ALLOW_PURE_PYTHON") == "1":
        pytest.skip("pure-Python data plane allowed by FTHARNESS_ALLOW_PURE_PYTHON=1")
    assert memory.FASTPATH, (
        "runtime/dataplane/_fastpath.c was not built: install a C compiler and libxxhash-dev "
        "(bin/setup does), then reinstall with `pip install -e .`"
    )


@pytest.fixture(params=["fast", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "fast" and not memory.FASTPATH:
        pytest.skip("the C fast path is not built here")
    if request.param == "python":
        monkeypatch.setattr(memory, "_fastpath", None)
    return request.param


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("n", SIZES)
def test_hash_and_copy_and_hash_equal_xxh3_64(path: str, n: int) -> None:
    src = _random_bytes(n, n)
    dst = torch.zeros(n, dtype=torch.uint8)
    want = xxhash.xxh3_64_intdigest(src.numpy().tobytes())
    assert memory.hash_at(src.data_ptr(), n) == want
    assert memory.copy_and_hash(dst.data_ptr(), src.data_ptr(), n) == want
    assert torch.equal(dst, src)


@pytest.mark.parametrize("n", SIZES)
def test_recv_and_hash_receives_every_byte_and_hashes_it(path: str, n: int) -> None:
    src = _random_bytes(n, n + 1).numpy().tobytes()
    dst = torch.zeros(n, dtype=torch.uint8)
    a, b = socket.socketpair()
    with a, b:
        # the writer sends in odd pieces, so the receiver sees partial reads
        writer = threading.Thread(
            target=lambda: [a.sendall(src[i : i + 100_003]) for i in range(0, n, 100_003)]
        )
        writer.start()
        got, digest = memory.recv_and_hash(b, dst.data_ptr(), n)
        writer.join()
    assert got == n
    assert digest == xxhash.xxh3_64_intdigest(src)
    assert dst.numpy().tobytes() == src


def test_recv_and_hash_reports_a_closed_peer_with_a_short_count(path: str) -> None:
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    a, b = socket.socketpair()
    with b:
        a.sendall(b"x" * 1000)
        a.close()
        got, digest = memory.recv_and_hash(b, dst.data_ptr(), dst.numel())
    assert got == 1000
    assert digest == xxhash.xxh3_64_intdigest(b"x" * 1000)


def test_recv_and_hash_raises_when_the_receive_timeout_expires(path: str) -> None:
    dst = torch.zeros(4096, dtype=torch.uint8)
    a, b = socket.socketpair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
        a.sendall(b"y" * 10)  # some bytes, then silence
        with pytest.raises(BlockingIOError):
            memory.recv_and_hash(b, dst.data_ptr(), dst.numel())
