"""A real Prometheus server scrapes a running job's telemetry and answers for its recovery."""

from __future__ import annotations

import pytest
from telemetry_fixtures import (  # noqa: F401 - fixtures
    Prometheus,
    running_job,
    stop_process,
    telemetry_job_command,
    wait_for,
)

from dashboards import names as N
from runtime.journal import read_journal


@pytest.fixture
def prometheus(tmp_path, running_job):  # noqa: F811
    server = Prometheus(tmp_path / "prom", [running_job["address"]])
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_prometheus_scrapes_recovery_metrics_after_a_fault(tmp_path, running_job, prometheus):  # noqa: F811
    job = running_job["job"]
    sel = f'{{{N.LABEL_JOB}="{job}"}}'
    wait_for(
        lambda: prometheus.value('up{job="ftharness"}') == 1.0,
        timeout=60,
        what="Prometheus to scrape the job",
    )
    # the job journals a kill of group 1 and its recovery, then both groups finish 40 steps
    wait_for(
        lambda: prometheus.value(f"{N.PARTICIPATE.prom}_count{sel}") == 1.0,
        timeout=60,
        what="the recovery to be scraped",
    )
    wait_for(
        lambda: (
            prometheus.value(f'{N.STEPS.prom}{{{N.LABEL_JOB}="{job}", {N.LABEL_REPLICA}="0"}}')
            == 40.0
        ),
        timeout=60,
        what="the last committed step to be scraped",
    )

    faults = prometheus.query(f"{N.FAULTS.prom}{sel}")
    assert [(f["metric"][N.LABEL_FAULT_KIND], f["value"][1]) for f in faults] == [("kill", "1")]
    failures = prometheus.query(f"{N.FAILURES.prom}{sel}")
    assert [f["metric"][N.LABEL_CAUSE] for f in failures] == ["signal"]
    assert prometheus.value(f"{N.PARTICIPANTS.prom}{sel}") == 2.0  # the group is back
    # the replaced group participated ~2.3 s after the kill: Prometheus puts it in (2, 3]
    p50 = prometheus.value(
        f"histogram_quantile(0.5, sum by (le) ({N.PARTICIPATE.prom}_bucket{sel}))"
    )
    assert 2.0 < p50 <= 3.0
    assert 0.0 < prometheus.value(f"{N.DETECTION.prom}_sum{sel}") < 1.0
    stall = prometheus.value(f"{N.SURVIVOR_STALL.prom}_sum{sel}")
    assert 0.5 < stall < 2.0
    goodput = prometheus.value(f"{N.GOODPUT.prom}{sel}")
    assert 0.0 < goodput < 1.0  # the fault cost throughput
    # the resource identifies the job and service in target_info
    (info,) = prometheus.query(f'target_info{{{N.LABEL_JOB}="{job}"}}')
    assert info["metric"]["service_name"] == "ftharness"

    assert stop_process(running_job["proc"]) == 0, running_job["log"].read_text()
    events = [r["event"] for r in read_journal(running_job["journal"])]
    assert events.count("fault.inject") == 1 and events.count("recovery.phase") == 5
