"""``ftharness bench transfer``: weight-transfer bandwidth, in GB/s (median of reps).

For each state size, a realistic mix of float32 shapes (a transformer's parameters plus Adam's
two moments) is built by a *separate source process*, which serves it five ways at once: the
data plane's shm and tcp backends, torchft's HTTPTransport (its default), torchft's
PGTransport over gloo, and ``tcp_raw``: one plain socket streaming the tensors' bytes with no
framing, no checksum and no parallelism, the issue's reference for what one TCP stream into
pre-faulted tensors does on this host. The reader (this process) receives into pre-built,
pre-faulted tensors (PGTransport in place) and verifies every transfer: an xxh3-128 digest of
every tensor's bytes must equal the source's. ``memcpy`` is torch ``copy_`` within this
process: the limit.

HTTPTransport always allocates the tensors it receives, and what that costs depends on the
receiver's allocator: fresh memory is page-faulted in (at 2 GiB that takes longer than the
bytes' transfer), memory the allocator freed a moment ago is reused. So it is measured both
ways: ``http`` receives in a fresh process each rep, as a replacement does when it heals
(only the receive is timed), and ``http_reuse`` receives back to back in one process after
two untimed receives, the best case for the peer.

Reps are interleaved: each rep runs every method once, in turn, so a slow minute of a shared
machine hits all of them alike. Besides each method's median GB/s, ``ratios`` gives the
median of the per-rep ratios the targets are stated in (``shm/memcpy``, ``tcp/http``,
``tcp/pg``, and ``tcp/tcp_raw``: what the framing, the parallel streams and the checksums
cost or win against a bare socket).

``shm_first`` is the first shm read (it faults in the reader's mapping of the source's
snapshot; later reads reuse the cached mapping); ``publish_s`` is the source's cost of one
``publish`` (copy + checksums), paid once per heal while the healing peer waits, measured once
registration's background prefault of the snapshot is done.

The last line printed is ``{"sizes": [{"bytes", "memcpy", "shm", "tcp", "http", "pg",
"verified", "ratios", ...}, ...], "fastpath": bool}`` with the largest size last;
``fastpath`` says whether the readers used the C fused copy/receive-and-hash
(``runtime/dataplane/_fastpath.c``) or the pure-Python fallback.
"""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import xxhash

MiB = 1 << 20
FULL_SIZES = (64 * MiB, 512 * MiB, 2048 * MiB)
QUICK_SIZES = (16 * MiB, 64 * MiB)  # two small sizes: --quick is for development
TIMEOUT = timedelta(seconds=300)


def transformer_shapes(total_bytes: int) -> list[tuple[int, ...]]:
    """float32 shapes summing to about ``total_bytes``: embeddings, per-layer attention and
    MLP matrices and norms (the parameters), then the same shapes twice (Adam's moments)."""
    # small enough that the embeddings, the head and one layer fit inside the smallest size
    dim = 1024 if total_bytes > 64 * MiB else 256 if total_bytes > 16 * MiB else 128
    vocab = 8192 if total_bytes > 64 * MiB else 2048
    params: list[tuple[int, ...]] = [(vocab, dim)]
    layer = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim), (4 * dim, dim), (dim,), (dim,)]
    per_layer = sum(torch.Size(s).numel() for s in layer)
    budget = total_bytes // 4 // 3 - vocab * dim * 2 - dim
    params += layer * max(1, budget // per_layer)
    params += [(dim,), (vocab, dim)]  # final norm, output head
    used = sum(torch.Size(s).numel() for s in params)
    rest = (total_bytes // 4 // 3 - used) // dim
    if rest > 0:
        params.append((rest, dim))  # a partial layer, so the total lands on the target size
    return params * 3


def _digest(tensors: list[torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for t in tensors:
        if t.numel():
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _source(total_bytes: int, store_addr: str) -> None:
    """The source process: build, serve four ways, then answer "pg" requests from stdin."""
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo, reconfigure_with_store

    from runtime.dataplane import register
    from runtime.dataplane.memory import tensor_view

    g = torch.Generator().manual_seed(0)
    state = [torch.randn(s, generator=g) for s in transformer_shapes(total_bytes)]
    sd = {f"t{i}": t for i, t in enumerate(state)}
    reg = register(state, backend=("shm", "tcp"))
    reg.wait_prefaulted()  # as on a long-running source: registration faulted the snapshot in
    t0 = time.perf_counter()
    reg.publish(1)
    publish_s = time.perf_counter() - t0
    http = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    http.send_checkpoint([1], 1, sd, TIMEOUT)
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    reconfigure_with_store(pg, store_addr, 0, 2)
    pgt = PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu"))
    raw = socket.create_server(("127.0.0.1", 0))
    line = {
        "raw_port": raw.getsockname()[1],
        "handle": reg.handle.dumps(),
        "http": http.metadata(),
        "digest": _digest(state),
        "publish_s": publish_s,
    }
    print(json.dumps(line), flush=True)
    for cmd in sys.stdin:
        if cmd.strip() == "pg":
            pgt.send_checkpoint([1], 1, sd, TIMEOUT)
            print("sent", flush=True)
        elif cmd.strip() == "raw":
            conn, _ = raw.accept()
            with conn:
                for t in state:
                    conn.sendall(tensor_view(t))
            print("sent", flush=True)
    http.shutdown(wait=False)
    reg.close()


def _http_receiver(metadata: str, n_tensors: int) -> None:
    """A fresh process receiving once over torchft HTTP, as a replacement does: its allocator
    has no freed memory to reuse, so the received tensors are page-faulted in. Prints the
    seconds the receive took and the digest of what arrived."""
    from torchft.checkpointing.http_transport import HTTPTransport

    receiver = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    t0 = time.perf_counter()
    got = receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {"seconds": seconds, "digest": _digest([got[f"t{i}"] for i in range(n_tensors)])}
        )
    )
    receiver.shutdown(wait=False)


def _raw_read(proc: subprocess.Popen, port: int, dest: list[torch.Tensor]) -> float:
    """One plain-socket read of every tensor straight into ``dest``; returns seconds."""
    from runtime.dataplane.memory import tensor_view

    proc.stdin.write("raw\n")
    proc.stdin.flush()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for d in dest:
            view = tensor_view(d)
            got = 0
            while got < len(view):
                k = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
                if k == 0:
                    raise RuntimeError("source closed the raw stream early")
                got += k
    seconds = time.perf_counter() - t0
    assert proc.stdout.readline().strip() == "sent"
    return seconds


METHODS = ("memcpy", "shm", "tcp", "tcp_raw", "http", "pg")
# (numerator, denominator) of the ratios the targets are stated in; each is the median of the
# per-rep ratios, which cancels the slow drifts of a shared machine's memory bandwidth.
RATIOS = (("shm", "memcpy"), ("tcp", "http"), ("tcp", "pg"), ("tcp", "tcp_raw"))


def _bench_size(total_bytes: int, reps: int, log) -> dict:
    """All methods at one state size. The reps are interleaved (each rep runs every method
    once, in turn), so every method sees the same machine conditions."""
    import torch.distributed as dist
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo, reconfigure_with_store

    from runtime.dataplane import Handle, read_into
    from runtime.dataplane.shm import release_mappings

    shapes = transformer_shapes(total_bytes)
    dest = [torch.zeros(s) for s in shapes]  # pre-built and pre-faulted
    src = [torch.ones(s) for s in shapes]  # memcpy's source
    nbytes = sum(t.numel() * 4 for t in dest)
    out: dict = {"bytes": nbytes, "tensors": len(dest)}

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store_addr = f"127.0.0.1:{store.port}/bench/{total_bytes}"
    code = f"from experiments.bench.transfer import _source; _source({total_bytes}, {store_addr!r})"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    verified = True
    receiver = HTTPTransport(timeout=TIMEOUT, num_chunks=0)
    try:
        pg = ProcessGroupGloo(timeout=TIMEOUT)
        reconfigure_with_store(pg, store_addr, 1, 2)
        info = json.loads(proc.stdout.readline())
        handle, want = Handle.loads(info["handle"]), info["digest"]
        out["publish_s"] = round(info["publish_s"], 3)
        http_meta = info["http"].replace(
            info["http"].split("/")[2].rsplit(":", 1)[0], "127.0.0.1", 1
        )
        inplace = {f"t{i}": t for i, t in enumerate(dest)}
        pgt = PGTransport(
            pg, timeout=TIMEOUT, device=torch.device("cpu"), state_dict=lambda: inplace
        )

        def check(tensors: list[torch.Tensor]) -> None:
            nonlocal verified
            verified = verified and _digest(tensors) == want

        def zero() -> None:
            for d in dest:
                d.zero_()  # a stale copy could not pass verification

        def memcpy() -> float:
            t0 = time.perf_counter()
            for d, s in zip(dest, src, strict=True):
                d.copy_(s)
            return time.perf_counter() - t0

        def dataplane(backend: str) -> float:
            zero()
            t0 = time.perf_counter()
            read_into(handle, dest, backend=backend, step=1, timeout=300)
            seconds = time.perf_counter() - t0
            check(dest)
            return seconds

        def raw() -> float:
            zero()
            seconds = _raw_read(proc, info["raw_port"], dest)
            check(dest)
            return seconds

        def http() -> float:
            nonlocal verified
            code = (
                "from experiments.bench.transfer import _http_receiver; "
                f"_http_receiver({http_meta!r}, {len(dest)})"
            )
            child = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
            )
            got = json.loads(child.stdout.strip().splitlines()[-1])
            verified = verified and got["digest"] == want
            return got["seconds"]

        def http_reuse() -> float:
            t0 = time.perf_counter()
            got = receiver.recv_checkpoint(0, http_meta, 1, TIMEOUT)
            seconds = time.perf_counter() - t0
            check([got[f"t{i}"] for i in range(len(dest))])
            del got
            gc.collect()
            return seconds

        def pg_inplace() -> float:
            nonlocal verified
            zero()
            proc.stdin.write("pg\n")
            proc.stdin.flush()
            t0 = time.perf_counter()
            got = pgt.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)
            seconds = time.perf_counter() - t0
            assert proc.stdout.readline().strip() == "sent"
            verified = verified and got["t0"].data_ptr() == dest[0].data_ptr()  # in place
            check(dest)
            return seconds

        run = {
            "memcpy": memcpy,
            "shm": lambda: dataplane("shm"),
            "tcp": lambda: dataplane("tcp"),
            "tcp_raw": raw,
            "http": http,
            "pg": pg_inplace,
        }
        # the first shm read maps the source's snapshot (later reads reuse the mapping)
        out["shm_first"] = round(nbytes / run["shm"]() / 1e9, 3)
        gbps: dict[str, list[float]] = {m: [] for m in METHODS}
        for rep in range(reps):
            for m in METHODS:
                gbps[m].append(nbytes / run[m]() / 1e9)
            log(f"  rep {rep + 1}/{reps}: " + ", ".join(f"{m} {gbps[m][-1]:.2f}" for m in METHODS))
        release_mappings()
        # HTTP once more, back to back in this process after two untimed receives: the
        # allocator reuses the memory it freed, the best case for the peer (not paired).
        http_reuse()
        http_reuse()
        gbps["http_reuse"] = [nbytes / http_reuse() / 1e9 for _ in range(reps)]
        log(f"  http_reuse: {statistics.median(gbps['http_reuse']):.2f}")
        pg.shutdown()
    finally:
        receiver.shutdown(wait=False)
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        del store
    for m in METHODS:  # the contract's keys, in its order
        out[m] = round(statistics.median(gbps[m]), 3)
    out["verified"] = verified
    out["http_reuse"] = round(statistics.median(gbps["http_reuse"]), 3)
    out["ratios"] = {
        f"{a}/{b}": round(
            statistics.median(x / y for x, y in zip(gbps[a], gbps[b], strict=True)), 3
        )
        for a, b in RATIOS
    }
    out["ratios"]["tcp/http_reuse"] = round(out["tcp"] / out["http_reuse"], 3)
    return out


def main(args) -> int:
    """Run the benchmark; ``args`` has ``.json``, ``.reps`` and ``.quick``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    reps = args.reps or (3 if args.quick else 5)

    def log(msg: str) -> None:
        if not args.json:
            print(msg, file=sys.stderr, flush=True)

    results = []
    for size in sizes:
        log(f"{size // MiB} MiB state ({reps} reps each)")
        results.append(_bench_size(size, reps, log))
        gc.collect()
    r = results[-1]
    log(f"at {r['bytes'] / 2**30:.2f} GiB, medians of paired ratios: {r['ratios']}")
    from runtime.dataplane.memory import FASTPATH

    print(json.dumps({"sizes": results, "fastpath": FASTPATH}))
    return 0 if all(x["verified"] for x in results) else 1
