"""The preflight on test hosts with networks of their own (runtime/launchers/netns.py): real host
agents in network namespaces probe each other's advertised addresses and the controller's.

* The matrix on 1 and 3 hosts, with agents that import nothing (no torch: seconds), all paths
  ok; then broken paths made with iptables inside the hosts' namespaces (a dropped SYN, a
  reset, an ICMP host-unreachable) and an advertised address that is loopback: each path is
  named with both ends and the right reason, in about one probe timeout.
* A whole ``run_job`` whose host1 cannot reach host0 (its SYNs dropped) stops before training:
  failed, with the table in its reason and the ``preflight`` record in the journal.

Needs root (CI is root); skipped with the reason otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import bare_netns_hosts, events, iptables_out, tiny_cfg

from harness.job.launch import run_job
from harness.job.preflight import cells_from_journal, render
from runtime.controller import Controller
from runtime.launchers import netns
from runtime.preflight_matrix import Cell, run_matrix

ok, why = netns.available()
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120), pytest.mark.skipif(not ok, reason=why)]

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[netns.TestNetwork, Controller]]:
    """Three test hosts whose agents preload nothing, on one controller at the gateway."""
    with bare_netns_hosts(["host0", "host1", "host2"]) as pair:
        yield pair


def _matrix(controller: Controller, names: list[str]) -> tuple[list[Cell], float]:
    service = [("controller", *controller.address)]
    t0 = time.monotonic()
    cells = run_matrix(
        controller.preflight, [controller.hosts[n] for n in names], service, TIMEOUT_S
    )
    return cells, time.monotonic() - t0


def test_every_host_reaches_every_other_in_well_under_a_second(hosts) -> None:
    net, controller = hosts
    one, t_one = _matrix(controller, ["host0"])
    assert [(c.src, c.dst, c.outcome) for c in one] == [("host0", "controller", "ok")]
    three, t_three = _matrix(controller, ["host0", "host1", "host2"])
    assert len(three) == 3 * 3 and all(c.ok for c in three), render(three, t_three)
    addr = {n: h.address for n, h in net.hosts.items()}
    assert {(c.src, c.dst, c.address) for c in three if c.dst != "controller"} == {
        (s, d, addr[d]) for s in addr for d in addr if s != d
    }
    print(f"preflight: 1 host {t_one * 1000:.0f} ms, 3 hosts {t_three * 1000:.0f} ms")
    assert t_one < 1.0 and t_three < 1.0


def test_broken_paths_are_named_with_both_ends_and_why(hosts) -> None:
    net, controller = hosts
    a = {n: h.address for n, h in net.hosts.items()}
    h2 = controller.hosts["host2"]
    real = h2.address
    try:
        iptables_out(net, "host1", "-p", "tcp", "--syn", "-d", a["host0"], "-j", "DROP")
        iptables_out(net, "host2", "-p", "tcp", "-d", a["host0"], "-j", "REJECT",
                  "--reject-with", "tcp-reset")  # fmt: skip
        iptables_out(net, "host2", "-p", "tcp", "-d", a["host1"], "-j", "REJECT",
                  "--reject-with", "icmp-host-unreachable")  # fmt: skip
        h2.address = "127.0.0.1"  # as if host2's hostname resolved to loopback
        cells, took = _matrix(controller, ["host0", "host1", "host2"])
    finally:
        h2.address = real
        for n in ("host1", "host2"):
            net.clear(n)
    table = render(cells, took)
    print(table)
    bad = {(c.src, c.dst): c.outcome for c in cells if not c.ok}
    assert bad == {
        ("host1", "host0"): "timed out",
        ("host2", "host0"): "refused",
        ("host2", "host1"): "unreachable",
        ("host0", "host2"): "loopback",
        ("host1", "host2"): "loopback",
    }, table
    assert took < TIMEOUT_S + 1.5  # in parallel: one probe timeout, not one per path
    for src, dst in bad:
        assert any(ln.split()[:2] == [src, dst] for ln in table.splitlines()), table
    # and the agents still answer: the next round is clean again
    again, _ = _matrix(controller, ["host0", "host1", "host2"])
    assert all(c.ok for c in again), render(again, 0)


class _CutHost1(netns.TestNetwork):
    """The job's test network, with host1's connection requests to host0 dropped."""

    def up(self) -> netns.TestNetwork:
        super().up()
        to = self.hosts["host0"].address
        iptables_out(self, "host1", "-p", "tcp", "--syn", "-d", to, "-j", "DROP")
        return self


def test_a_job_whose_host_cannot_reach_another_stops_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("harness.job.site.TestNetwork", _CutHost1)
    cfg = tiny_cfg(
        "replicas=2",
        "hosts=2",
        "launcher=netns",
        "recovery.spares_per_host=0",
        f"timeouts.preflight={TIMEOUT_S}",
    )
    t0 = time.monotonic()
    out = run_job(cfg, tmp_path, quiet=True, timeout=100)
    took = time.monotonic() - t0
    assert out["status"] == "failed" and out["steps"] == 0, out
    reason = out["reason"]
    assert reason.startswith("preflight failed"), reason
    row = next(ln.split() for ln in reason.splitlines() if ln.split()[:2] == ["host1", "host0"])
    assert row[3:5] == ["timed", "out"], reason
    (record,) = events(tmp_path, "preflight")
    assert record["status"] == "failed" and record["seconds"] < 10, record
    assert record["hosts"] == ["host0", "host1"]
    cells = cells_from_journal(record)
    assert {(c.src, c.dst) for c in cells if not c.ok} == {("host1", "host0")}
    assert len(cells) == 2 * (1 + 2)  # each host: the other, the controller, the quorum
    assert not events(tmp_path, "step.commit") and not events(tmp_path, "proc.start")
    (end,) = events(tmp_path, "job.end")
    assert end["status"] == "failed" and end["reason"].startswith("preflight failed")
    print(f"job stopped by the preflight after {took:.1f} s ({record['seconds']:.2f} s matrix)")


def test_a_job_on_test_hosts_passes_the_preflight_and_journals_its_matrix(tmp_path: Path) -> None:
    cfg = tiny_cfg(
        "replicas=2", "hosts=2", "steps=3", "launcher=netns", "recovery.spares_per_host=0"
    )
    out = run_job(cfg, tmp_path, quiet=True, timeout=100)
    assert out["status"] == "ok", out["reason"]
    (record,) = events(tmp_path, "preflight")
    assert record["status"] == "ok" and record["failed"] == 0 and record["seconds"] < 1.0, record
    cells = cells_from_journal(record)
    assert {(c.src, c.dst) for c in cells} == {
        (s, d) for s in ("host0", "host1") for d in ("host0", "host1", "controller", "quorum")
        if s != d
    }  # fmt: skip
    assert all(c.ok for c in cells)
    first_start = min(r["t"] for r in events(tmp_path, "proc.start"))
    assert record["t"] < first_start  # before any group started
