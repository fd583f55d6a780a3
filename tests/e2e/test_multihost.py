"""Jobs across test hosts with networks of their own: one Linux network namespace per host, each
with its own address on a bridge (runtime/launchers/netns.py). Control channel, torchft's stores,
quorum
and process groups, and the data plane all cross real interfaces here.

Needs root (CI is root); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_helpers import after_step, check_invariants, events, no_leftover_namespaces, tiny_cfg

from harness.job.launch import run_job
from runtime.launchers import netns

ok, why = netns.available()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not ok, reason=why),
]

FAST_HOSTS = ("timeouts.host_timeout=2.0", "timeouts.controller_silence=4.0")


def _cfg(*extra: str):
    return tiny_cfg(
        "replicas=3", "hosts=3", "launcher=netns", "recovery.quorum=tree", *FAST_HOSTS, *extra
    )


_no_leftover_namespaces = pytest.fixture(autouse=True)(no_leftover_namespaces)


def test_a_job_trains_across_hosts_with_their_own_addresses(tmp_path):
    out = run_job(_cfg("steps=25"), tmp_path, quiet=True)
    assert out["status"] == "ok", out["reason"]
    records = events(tmp_path)
    check_invariants(records)
    commits = [r for r in records if r["event"] == "step.commit"]
    assert {(r["replica"], r["host"]) for r in commits} == {
        (0, "host0"),
        (1, "host1"),
        (2, "host2"),
    }
    assert max(r["participants"] for r in commits) == 3  # the groups met across hosts


def test_a_partitioned_host_is_replaced_and_its_stale_incarnation_never_commits(tmp_path):
    """Split brain is the test: host1 is cut off mid-run for 8 s. Its group is declared lost
    after the host timeout and restarted on another host, healing from a peer over TCP across
    namespaces; the cut-off incarnation never commits again, also after the link is back."""
    # A process-group timeout longer than the partition: the survivors' collective with the
    # cut-off group must fail when the host is declared lost (~2 s: every other host closes its
    # connections to it), not when the link comes back (8 s) or gloo gives up (10 s).
    cfg = _cfg("steps=100000", "transport=dataplane", "timeouts.process_group_timeout=10")
    stop = threading.Event()
    seen: dict[str, object] = {}

    def started(job):
        def partition():
            seen["t"] = time.time()
            job.faults.set_host_cooldown("host1", 8.0)
            job.faults.partition_host("host1")
            deadline = time.monotonic() + 120
            while job.group_host(1) == "host1" and time.monotonic() < deadline:
                time.sleep(0.05)
            seen["moved_to"] = job.group_host(1)
            time.sleep(max(0.0, seen["t"] + 8.0 - time.time()))
            job.faults.reconnect_host("host1")
            seen["healed_at"] = time.time()
            target = job.faults.committed_step() + 15
            while job.faults.committed_step() < target and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()

        after_step(job, 10, partition)

    out = run_job(cfg, tmp_path, quiet=True, on_started=started, stop_event=stop, timeout=240)
    assert out["status"] == "ok", out["reason"]
    assert seen["moved_to"] in ("host0", "host2")
    records = events(tmp_path)
    check_invariants(records)  # replicas bitwise equal at every step committed by several
    failures = [r for r in records if r["event"] == "failure" and r.get("replica") == 1]
    assert failures and failures[0]["cause"] == "lost_host", failures
    t_fail = failures[0]["t"]
    stale = {
        r["proc"]
        for r in records
        if r["event"] == "proc.start" and r.get("replica") == 1 and r["t"] < t_fail
    }
    late = [
        r
        for r in records
        if r["event"] == "step.commit" and r.get("proc") in stale and r["t"] > t_fail
    ]
    assert late == [], f"the cut-off incarnation committed after it was replaced: {late[:2]}"
    # the survivors trained on while host1 was cut off (their collective with its group, if one
    # was in flight, failed when the host was declared lost, not when the link came back)
    during = {
        r["replica"]
        for r in records
        if r["event"] == "step.commit" and t_fail + 1.0 < r["t"] < seen["healed_at"]
    }
    assert {0, 2} <= during
    healed = [r for r in records if r["event"] == "trainer.healed" and r["t"] > t_fail]
    assert healed and all(r["replica"] == 1 for r in healed)
    back = [
        r
        for r in records
        if r["event"] == "step.commit" and r["replica"] == 1 and r["t"] > seen["healed_at"]
    ]
    assert back and all(r["proc"] not in stale for r in back)


def _train_through_impairment(tmp_path, delay_ms: float, loss_pct: float) -> None:
    """Impair host1's link for 6 s mid-run: every group keeps committing, none is lost."""
    cfg = _cfg("steps=100000")
    stop = threading.Event()
    window: dict[str, float] = {}

    def started(job):
        def impair():
            job.faults.impair_link("host1", delay_ms, loss_pct)
            window["start"] = time.time()
            time.sleep(6.0)
            window["end"] = time.time()
            job.faults.clear_link("host1")
            time.sleep(2.0)
            stop.set()

        after_step(job, 5, impair)

    out = run_job(cfg, tmp_path, quiet=True, on_started=started, stop_event=stop, timeout=180)
    assert out["status"] == "ok", out["reason"]
    records = events(tmp_path)
    check_invariants(records)
    during = [
        r
        for r in records
        if r["event"] == "step.commit" and window["start"] < r["t"] < window["end"]
    ]
    assert {r["replica"] for r in during} == {0, 1, 2}, "a group stopped under the impairment"
    assert not [r for r in records if r["event"] == "failure"]


@pytest.mark.skipif(
    ok and not netns.netem_available(), reason="this kernel has no netem qdisc (delay)"
)
def test_training_goes_on_under_50ms_of_network_delay(tmp_path):
    _train_through_impairment(tmp_path, delay_ms=50.0, loss_pct=0.0)


def test_training_goes_on_under_packet_loss(tmp_path):
    _train_through_impairment(tmp_path, delay_ms=0.0, loss_pct=3.0)


SOURCE = """
import sys, torch
from runtime.dataplane import register
state = [torch.arange(3 << 20, dtype=torch.float32), torch.randn(257, 33)]
reg = register(state, backend="auto", bind=sys.argv[1])
reg.publish(7)
torch.save(state, sys.argv[2])
print(reg.handle.dumps(), flush=True)
sys.stdin.read()
"""

READER = """
import json, sys, torch
from runtime.dataplane import Handle, choose_backend, read_into
from runtime.dataplane.handle import host_id
h = Handle.loads(sys.stdin.readline())
dest = [torch.empty(m.shape, dtype=getattr(torch, m.dtype)) for m in h.tensors]
step = read_into(h, dest, timeout=60)
want = torch.load(sys.argv[1])
chosen = choose_backend(offered=h.backends, same_host=h.host_id == host_id(), local_rdma=False)
print(json.dumps({"step": step, "backend": chosen.backend,
                  "equal": all(torch.equal(a, b) for a, b in zip(dest, want))}))
"""


def test_a_cross_host_heal_goes_over_tcp_and_is_bitwise_exact(tmp_path):
    """Processes in two namespaces are two hosts to the data plane (shared memory is only for
    one host, even though /dev/shm is shared here): the read goes over TCP between the hosts'
    addresses, every chunk verified, and the result is bitwise equal."""
    repo = str(Path(__file__).resolve().parents[2])
    with netns.TestNetwork(["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        want = str(tmp_path / "want.pt")
        src = subprocess.Popen(
            ["ip", "netns", "exec", a.netns, sys.executable, "-c", SOURCE, a.address, want],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=repo,
        )  # fmt: skip
        try:
            handle = src.stdout.readline()
            assert handle.strip(), "the source printed no handle"
            done = subprocess.run(
                ["ip", "netns", "exec", b.netns, sys.executable, "-c", READER, want],
                input=handle, capture_output=True, text=True, timeout=120, cwd=repo,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            got = json.loads(done.stdout.strip().splitlines()[-1])
            assert got == {"step": 7, "backend": "tcp", "equal": True}
        finally:
            src.stdin.close()
            src.wait(30)


BLOCKED_READER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.settimeout(60)
print("connected", flush=True)
t0 = time.monotonic()
try:
    c.recv(1)
    print("returned", flush=True)
except OSError as exc:
    print(type(exc).__name__, round(time.monotonic() - t0, 1), flush=True)
"""

SILENT_SERVER = """
import socket, sys, time
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
time.sleep(120)
"""


def test_a_read_blocked_on_a_cut_off_host_fails_once_connections_to_it_are_dropped():
    """What a survivor's agent does when the controller declares a host lost: close this host's
    connections to it (``runtime.agent.drop_connections``). A read blocked on a peer behind a
    cut link (nothing ever closes it) fails at once instead of after its 60 s timeout."""
    repo = str(Path(__file__).resolve().parents[2])
    with netns.TestNetwork(["a", "b"]) as net:
        a, b = net.hosts["a"], net.hosts["b"]
        server = _in_ns(b.netns, SILENT_SERVER, b.address)
        reader = None
        try:
            port = server.stdout.readline().strip()
            reader = _in_ns(a.netns, BLOCKED_READER, b.address, port)
            assert reader.stdout.readline().strip() == "connected"
            net.partition("b")
            time.sleep(1.0)  # the reader is blocked in recv, and nothing will wake it
            drop = f"from runtime.agent import drop_connections as d; print(d({b.address!r}))"
            done = subprocess.run(
                ["ip", "netns", "exec", a.netns, sys.executable, "-c", drop],
                capture_output=True, text=True, timeout=30, cwd=repo,
            )  # fmt: skip
            assert done.stdout.strip() == "True", done.stderr
            outcome = reader.stdout.readline().split()
            assert outcome[0] == "ConnectionAbortedError", outcome
            assert float(outcome[1]) < 30.0  # long before its 60 s timeout
        finally:
            for p in (server, reader):
                if p is not None:
                    p.kill()
                    p.wait(10)


def _in_ns(ns: str, script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parents[2]),
    )  # fmt: skip
