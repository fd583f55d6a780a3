"""The preflight of a host whose agent joins later (``harness.job.preflight.check_host``), on test
hosts with networks of their own (runtime/launchers/netns.py):

* the round of one host with real agents (no torch: seconds): only the paths from and to it are
  probed, all ok; with its connection requests to host0 dropped (iptables inside its namespace)
  the table names that path, the journal's ``preflight`` record names the host, and the console
  says it is kept out;
* a training job whose host1 is evicted while its SYNs to host0 are dropped: its new agent fails
  its round and is kept out (a group whose home it is restarts on host0), the job trains on;
  once the rule is gone its next agent passes, and the group goes home to it.

Needs root (CI is root); skipped with the reason otherwise.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from e2e_helpers import bare_netns_hosts, events, iptables_out, kill_group, tiny_cfg, wait_until

from harness.job.launch import run_job
from harness.job.preflight import cells_from_journal, check_host
from runtime.controller import Controller
from runtime.journal import Journal, read_journal
from runtime.launchers import netns

ok, why = netns.available()
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180), pytest.mark.skipif(not ok, reason=why)]

TIMEOUT_S = 1.0


def _drop_syn(net: netns.TestNetwork, host: str, to: str) -> None:
    iptables_out(net, host, "-p", "tcp", "--syn", "-d", net.hosts[to].address, "-j", "DROP")


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[netns.TestNetwork, Controller]]:
    with bare_netns_hosts(["host0", "host1", "host2"]) as pair:
        yield pair


def test_a_joining_hosts_round_probes_only_its_paths_and_names_a_broken_one(
    hosts: tuple[netns.TestNetwork, Controller], tmp_path: Path
) -> None:
    net, controller = hosts
    said: list[str] = []
    journal = Journal(tmp_path / "journal.jsonl", job="t")
    job = SimpleNamespace(
        controller=controller,
        quorum=SimpleNamespace(address=""),
        cfg=SimpleNamespace(timeouts=SimpleNamespace(preflight=TIMEOUT_S)),
        journal=journal,
        say=said.append,
    )
    assert check_host(job, "host2", lambda: ["host0", "host1"]) is None
    try:
        _drop_syn(net, "host2", "host0")
        t0 = time.monotonic()
        table = check_host(job, "host2", lambda: ["host0", "host1"])
        took = time.monotonic() - t0
    finally:
        net.clear("host2")
    journal.close()
    print(table)
    first, second = read_journal(tmp_path / "journal.jsonl")
    assert first["host"] == "host2" and first["status"] == "ok" and first["failed"] == 0
    assert {(c.src, c.dst) for c in cells_from_journal(first)} == {
        ("host2", "host0"), ("host2", "host1"), ("host2", "controller"),
        ("host0", "host2"), ("host1", "host2"),
    }  # fmt: skip
    assert said[0].startswith("preflight of host host2 (joined late): 5 network path(s)")
    assert table is not None and table.startswith("preflight failed: 1 of 5 network path(s)")
    assert "host host2 is not used" in table.splitlines()[0]
    row = next(ln.split() for ln in table.splitlines() if ln.split()[:2] == ["host2", "host0"])
    assert row[3:5] == ["timed", "out"], table
    assert second["host"] == "host2" and second["status"] == "failed" and second["failed"] == 1
    assert second["reason"] == table
    assert said[1].startswith(table) and said[1].endswith(
        "host2 is kept out of placement until its agent is restarted next"
    )
    assert took < TIMEOUT_S + 1.5


def test_an_evicted_host_is_checked_again_and_kept_out_until_it_passes(tmp_path: Path) -> None:
    cfg = tiny_cfg(
        "replicas=2", "hosts=2", "launcher=netns", "steps=100000", "checkpoint.every_steps=0",
        "timeouts.host_timeout=2.0", "timeouts.controller_silence=4.0",
        f"timeouts.preflight={TIMEOUT_S}",
    )  # fmt: skip
    stop = threading.Event()
    seen: dict[str, Any] = {}
    journal = tmp_path / "journal.jsonl"

    def rounds(status: str) -> list[dict]:
        return [
            r
            for r in read_journal(journal)
            if r["event"] == "preflight" and r.get("host") == "host1" and r["status"] == status
        ]

    def commits_since(replica: int, t: float) -> bool:
        return any(
            r["event"] == "step.commit" and r.get("replica") == replica and r["t"] > t
            for r in read_journal(journal)
        )

    def started(job: Any) -> None:
        net = job.site.network

        def scenario() -> None:
            deadline = time.monotonic() + 120
            try:
                _drop_syn(net, "host1", "host0")  # host1 cannot open a connection to host0
                job.faults.kill_host("host1")  # evicted: its group goes to host0
                assert wait_until(lambda: "host1" in job.hosts.kept_out(), deadline)
                seen["kept_out"] = time.time()
                assert wait_until(lambda: commits_since(1, seen["kept_out"]), deadline)
                kill_group(job, 1)  # its home host is kept out: host0 again
                again = time.time()
                assert wait_until(lambda: commits_since(1, again), deadline)
                assert job.group_host(1) == "host0"
                net.clear("host1")
                seen["cleared"] = time.time()
                job.faults.kill_host("host1")  # its agent goes; the next one is checked
                time.sleep(0.5)
                kill_group(job, 1)  # (a placement restarts the lost host's agent)
                assert wait_until(lambda: rounds("ok"), deadline)
                seen["passed"] = time.time()
                assert wait_until(lambda: commits_since(1, seen["passed"]), deadline)
                kill_group(job, 1)  # now home again
                assert wait_until(lambda: job.group_host(1) == "host1", deadline)
                target = job.faults.committed_step() + 3
                assert wait_until(lambda: job.faults.committed_step() >= target, deadline)
                seen["done"] = True
            finally:
                stop.set()

        def after_step_3() -> None:
            wait_until(lambda: job.faults.committed_step() >= 3, time.monotonic() + 120)
            scenario()

        threading.Thread(target=after_step_3, daemon=True).start()

    t0 = time.monotonic()
    out = run_job(cfg, tmp_path, quiet=True, on_started=started, stop_event=stop, timeout=150)
    print(f"run {time.monotonic() - t0:.1f} s")
    assert out["status"] == "ok", out["reason"]
    assert seen.get("done"), seen
    records = events(tmp_path)
    first, *later = [r for r in records if r["event"] == "preflight"]
    assert "host" not in first and first["status"] == "ok"
    assert [(r["host"], r["status"]) for r in later] == [("host1", "failed"), ("host1", "ok")]
    failed = later[0]
    assert failed["reason"].startswith("preflight failed: ")
    assert any(c.src == "host1" and c.dst == "host0" and not c.ok
               for c in cells_from_journal(failed))  # fmt: skip
    # kept out: no group started on host1 between its failed round and the one it passed
    starts = [r for r in records if r["event"] == "proc.start" and r.get("replica") is not None]
    assert not [
        r for r in starts if r["host"] == "host1" and failed["t"] < r["t"] < later[1]["t"]
    ], starts
    assert any(r["replica"] == 1 and r["host"] == "host0" and r["t"] > seen["kept_out"]
               for r in starts)  # fmt: skip
    # the job trained on meanwhile, and group 1 trains on host1 again at the end
    commits = [r for r in records if r["event"] == "step.commit"]
    assert any(failed["t"] < r["t"] < seen["cleared"] for r in commits)
    assert any(r["replica"] == 1 and r["t"] > seen["passed"] for r in commits)
