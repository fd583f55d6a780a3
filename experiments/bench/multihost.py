"""``ftharness bench multihost``: recovery across hosts with networks of their own, the heal's
bandwidth between hosts, and what authenticating every frame costs. Needs root (test hosts are
network namespaces, runtime/launchers/netns.py).

Figures, all from one run:

* ``partition`` / ``eviction``: a job of 3 replica groups on 3 namespace hosts (tiny model, tree
  quorum, a warm spare per host, heals over the data plane) in which a host running a group is
  cut off for ``PARTITION_S`` (``network_partition``) or evicted (``host_eviction``), ``--reps``
  times each, once the previous recovery has finished and every host is back (ready for a group:
  a fault before an evicted host is back puts every group on one host, and the next one takes the
  whole job, leaving no survivors to measure). Per recovery, from the journal with
  ``dashboards.metrics``' definitions: ``survivor_stall_s`` and ``replacement_back_s`` (the time
  to participate), each ``{median, p95, min, max}``; ``weights_match`` (every step committed by
  several groups has one checksum); ``stale_commits``: commits by a process of a group's
  incarnation that had already been declared failed, after that moment (must be 0).
* ``heal_cross_host_gbps``: a data-plane read (every chunk verified) of ``--size-mb`` from a
  source in one namespace to a reader in another (TCP, as between hosts);
  ``heal_same_host_gbps``: the same with both in one namespace (shared memory);
  ``plain_socket_cross_host_gbps``: one plain TCP stream of the same size between the same two
  namespaces, no checksums (the floor). Medians of ``REPS_TRANSFER`` interleaved repetitions.
* ``call_p50_ms`` / ``call_p50_ms_unauthenticated``: the median round trip of a call-sized
  request and its reply through ``runtime.channel`` between two processes, with a MAC on every
  frame and without, interleaved in blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dashboards.metrics import percentile, summarize
from experiments.report import evaluate_hypotheses
from experiments.spec import Hypotheses
from harness.config import load_config
from harness.job.launch import run_job
from runtime.journal import FAULT_HEAL, FAULT_INJECT, read_journal
from runtime.launchers import netns

PARTITION_S = 6.0
#: How long a host may be silent before it is lost; the goal for the survivors' stall is this +
#: 0.3 s (the multi-host issue's "heartbeat timeout + 0.3 s").
HOST_TIMEOUT_S = 1.0
EVICTION_COOLDOWN_S = 6.0
REPS_TRANSFER = 3
JOB = [
    "replicas=3",
    "hosts=3",
    "launcher=netns",
    "recovery.quorum=tree",
    "recovery.spares_per_host=1",
    "transport=dataplane",
    f"timeouts.host_timeout={HOST_TIMEOUT_S}",
    "timeouts.controller_silence=4.0",
    "steps=1000000",
    "checkpoint.every_steps=50",
]


def _stats(xs: list[float | None]) -> dict[str, float] | None:
    vals = sorted(x for x in xs if x is not None)
    if not vals:
        return None
    return {
        "median": round(statistics.median(vals), 3),
        "p95": round(percentile(vals, 95) or 0.0, 3),
        "min": round(vals[0], 3),
        "max": round(vals[-1], 3),
        "n": len(vals),
    }


def _hosts_back(job: Any) -> bool:
    """Every host of the job could take a group now (its agent up and checked, not cooling)."""
    return set(job.hosts.ready_hosts()) == set(job.host_names())


def _faulter(job: Any, kind: str, reps: int, seed: int, done: threading.Event, log: Any) -> None:
    """``reps`` faults of ``kind``, each on a host that runs a group now (a random one), once
    the job has no open recovery, every host is back and it has trained 10 more steps."""
    ctx = job.faults
    rng = random.Random(seed)
    for i in range(reps):
        deadline = time.monotonic() + 120
        target = ctx.committed_step() + 10
        while time.monotonic() < deadline and (
            ctx.committed_step() < target or job.tracker.open_count or not _hosts_back(job)
        ):
            time.sleep(0.05)
        host = rng.choice(sorted({job.group_host(r) for r in range(job.replicas)}))
        fault_id = f"{kind[:4]}{i:02d}"
        job.journal.emit(
            FAULT_INJECT,
            fault_id=fault_id,
            kind=kind,
            target={"replica": None, "rank": None, "host": host},
            seed=seed,
            step=ctx.committed_step(),
        )
        log(f"{kind} {i + 1}/{reps}: {host} at step {ctx.committed_step()}")
        if kind == "network_partition":
            ctx.set_host_cooldown(host, PARTITION_S)
            ctx.partition_host(host)
            time.sleep(PARTITION_S)
            ctx.reconnect_host(host)
        else:
            ctx.set_host_cooldown(host, EVICTION_COOLDOWN_S)
            ctx.kill_host(host)
        job.journal.emit(FAULT_HEAL, fault_id=fault_id, kind=kind)
    deadline = time.monotonic() + 120
    target = ctx.committed_step() + 10
    while (ctx.committed_step() < target or job.tracker.open_count) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    done.set()


def stale_commits(records: list[dict]) -> int:
    """Commits by a process after it was declared failed (a cut-off incarnation training on)."""
    failed: dict[str, float] = {}
    for r in records:
        if r["event"] == "failure" and r.get("proc") and not r.get("fatal"):
            failed.setdefault(r["proc"], r.get("t_detected", r["t"]))
    return sum(
        1
        for r in records
        if r["event"] == "step.commit" and r.get("proc") in failed and r["t"] > failed[r["proc"]]
    )


def measure_faults(kind: str, reps: int, seed: int, workdir: Path, log: Any) -> dict[str, Any]:
    cfg = load_config(str(Path(__file__).parents[1] / "tiny.toml"), [*JOB, f"name=mh-{kind}"])
    run_dir = workdir / kind
    done = threading.Event()

    def started(job: Any) -> None:
        threading.Thread(
            target=_faulter, args=(job, kind, reps, seed, done, log), daemon=True
        ).start()

    t0 = time.monotonic()
    outcome = run_job(
        cfg, run_dir, quiet=True, on_started=started, stop_event=done, timeout=120 + reps * 90
    )
    records = read_journal(run_dir / "journal.jsonl")
    summary = summarize(records)["policies"].get("in_place", {})
    recs = [r for r in summary.get("recoveries", []) if r.get("fault_id")]
    hyp = evaluate_hypotheses(Hypotheses(replicas_equal_after_heal=True), {}, records)
    return {
        "faults": reps,
        "recoveries": len(recs),
        "survivor_stall_s": _stats([r.get("stall_s") for r in recs]),
        "replacement_back_s": _stats([r.get("participate_s") for r in recs]),
        "weights_match": all(h["passed"] for h in hyp),
        "stale_commits": stale_commits(records),
        "status": outcome["status"],
        "seconds": round(time.monotonic() - t0, 1),
    }


SOURCE = """
import sys, torch
from runtime.dataplane import register
n = int(sys.argv[2]) << 20
state = [torch.ones(n // 4, dtype=torch.float32)]
reg = register(state, backend="auto", bind=sys.argv[1])
reg.publish(1)
print(reg.handle.dumps(), flush=True)
sys.stdin.read()
"""

READER = """
import sys, time, torch
from runtime.dataplane import Handle, read_into
h = Handle.loads(sys.stdin.readline())
dest = [torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in h.tensors]  # touched
for _ in range(int(sys.argv[1])):
    t0 = time.perf_counter()
    read_into(h, dest, timeout=120)
    print(h.total_bytes / (time.perf_counter() - t0) / 1e9, flush=True)
"""

PLAIN_SERVER = """
import socket, sys
n = int(sys.argv[2]) << 20
buf = bytearray(bytes([1]) * n)  # touched, like the source's state
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
for _ in range(int(sys.argv[3])):
    c, _ = srv.accept()
    c.sendall(buf)
    c.close()
"""

PLAIN_CLIENT = """
import socket, sys, time
n = int(sys.argv[3]) << 20
buf = bytearray(bytes(n))  # touched: a replacement's state exists before it heals
view = memoryview(buf)
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
t0 = time.perf_counter()
got = 0
while got < n:
    k = c.recv_into(view[got:])
    if not k:
        break
    got += k
print(n / (time.perf_counter() - t0) / 1e9, flush=True)
"""


def _in(ns: str, script: str, *args: str, **kw: Any) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
        **kw,
    )


def measure_transfer(size_mb: int, reps: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"cross": [], "same": [], "plain": []}
    with netns.TestNetwork(["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        src = _in(a.netns, SOURCE, a.address, str(size_mb))
        try:
            handle = src.stdout.readline()
            for _ in range(reps):  # interleaved: each repetition measures all three
                for key, ns in (("cross", b.netns), ("same", a.netns)):
                    r = _in(ns, READER, "1")
                    got, _ = r.communicate(handle, timeout=300)
                    out[key].append(float(got.split()[-1]))
                srv = _in(a.netns, PLAIN_SERVER, a.address, str(size_mb), "1")
                port = srv.stdout.readline().strip()
                cli = _in(b.netns, PLAIN_CLIENT, a.address, port, str(size_mb))
                got, _ = cli.communicate(timeout=300)
                srv.wait(30)
                out["plain"].append(float(got.split()[-1]))
        finally:
            src.stdin.close()
            src.wait(30)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "heal_cross_host_gbps": round(med["cross"], 3),
        "heal_same_host_gbps": round(med["same"], 3),
        "plain_socket_cross_host_gbps": round(med["plain"], 3),
        "cross_host_vs_plain_socket": round(med["cross"] / med["plain"], 3),
        "transfer_mb": size_mb,
    }


ECHO = """
import socket, sys
from runtime import channel
authed = sys.argv[1] == "1"
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
sock, _ = srv.accept()
keys = channel.server_handshake(sock, bytes(32), 10) if authed else (None, None)
conn = channel.Connection(sock, keys=keys)
while True:
    try:
        msg = conn.recv()
    except channel.ChannelError:
        break
    conn.send(msg)
"""


def measure_calls(n: int, blocks: int = 4) -> dict[str, float]:
    """Round trips of a call-sized frame pair through runtime.channel, with and without MACs."""
    import socket

    from runtime import channel
    from runtime.messages import CallEndpoint, Result

    lat: dict[bool, list[float]] = {True: [], False: []}
    request = CallEndpoint(1, "trainer", "step", (5,), {"lr": 0.1})
    for _ in range(blocks):
        for authed in (True, False):
            server = subprocess.Popen(
                [sys.executable, "-c", ECHO, "1" if authed else "0"],
                stdout=subprocess.PIPE,
                text=True,
                cwd=str(Path(__file__).resolve().parents[2]),
            )
            try:
                port = int(server.stdout.readline())
                sock = socket.create_connection(("127.0.0.1", port))
                keys = channel.client_handshake(sock, bytes(32), 10) if authed else (None, None)
                conn = channel.Connection(sock, keys=keys)
                for i in range(n):
                    t0 = time.perf_counter()
                    conn.send(request)
                    conn.recv()
                    if i >= 20:  # warm-up
                        lat[authed].append((time.perf_counter() - t0) * 1e3)
                conn.send(Result(1, True, None))
                conn.close()
            finally:
                server.kill()
                server.wait(10)
    auth, plain = statistics.median(lat[True]), statistics.median(lat[False])
    return {
        "call_p50_ms": round(auth, 4),
        "call_p50_ms_unauthenticated": round(plain, 4),
        "call_auth_ratio": round(auth / plain, 3),
    }


def main(args: argparse.Namespace) -> int:
    ok, why = netns.available()
    if not ok:
        print(f"ftharness bench multihost: {why}", file=sys.stderr)
        return 2
    reps = args.reps or (2 if args.quick else 5)
    size_mb = 64 if args.quick else 256

    def log(msg: str) -> None:
        if not args.json:
            print(f"[bench multihost] {msg}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "hosts": 3,
        "reps": reps,
        "host_timeout_s": HOST_TIMEOUT_S,
        "stall_goal_s": HOST_TIMEOUT_S + 0.3,
    }
    log("call latency through the channel, with and without a MAC per frame")
    result.update(measure_calls(400 if args.quick else 2000))
    log(f"data plane between namespaces, {size_mb} MiB")
    result.update(measure_transfer(size_mb, REPS_TRANSFER))
    with tempfile.TemporaryDirectory(prefix="ftharness-mh-") as tmp:
        for name, kind in (("partition", "network_partition"), ("eviction", "host_eviction")):
            log(f"{kind} x {reps}")
            result[name] = measure_faults(kind, reps, seed=11, workdir=Path(tmp), log=log)
            log(f"{name}: {json.dumps(result[name])}")
    print(json.dumps(result))
    return 0
