# Types of the C extension built from _fastpath.c (the fused copy/receive-and-hash of the data
# plane). Addresses are plain ints (a tensor's data_ptr()); digests are xxh3-64, equal to
# xxhash.xxh3_64_intdigest() of the same bytes. Every function releases the GIL.

#: 1 where xxhash's runtime SIMD dispatch (x86) is compiled in, else 0.
SIMD_DISPATCH: int

def copy_hash(dst: int, src: int, n: int, /) -> int:
    """Copy ``n`` bytes from address ``src`` to address ``dst``; the xxh3-64 of the bytes."""

def hash(addr: int, n: int, /) -> int:
    """The xxh3-64 of ``n`` bytes at address ``addr``."""

def recv_hash(fd: int, dst: int, n: int, /) -> tuple[int, int]:
    """Receive ``n`` bytes from the blocking socket ``fd`` into address ``dst``:
    ``(received, xxh3-64 of the bytes received)``; ``received < n`` means the peer closed."""
