"""A real Prometheus server scrapes a real chaos run (``ftharness chaos --prometheus-port``)
and answers for the recovery of a real SIGKILLed replica group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dashboards import names as N

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from e2e_helpers import chaos_argv
from telemetry_fixtures import Prometheus, free_port, stop_process, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

EXPERIMENT = textwrap.dedent(
    """
    name = "live-metrics"
    seed = 1
    duration_s = 40
    policies = ["in_place"]

    [job]
    name = "live-metrics"
    replicas = 3
    ranks = 1
    hosts = 1
    steps = 100000
    checkpoint = { every_steps = 0 }

    [schedule]
    kind = "at_times"
    at_times = [6]

    [faults]
    mix = { kill = 1 }

    [targets]
    kind = "replica"
    replicas = [1]
    keep_alive = { replicas = [0] }
    """
)


def test_prometheus_scrapes_a_real_run_through_a_kill(tmp_path):
    (tmp_path / "exp.toml").write_text(EXPERIMENT)
    port = free_port()
    log = open(tmp_path / "chaos.log", "w")  # noqa: SIM115 - closed below
    job = subprocess.Popen(
        chaos_argv(tmp_path, "--prometheus-port", str(port)),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).parents[2],
    )
    prom = None
    try:
        wait_for(
            lambda: "Prometheus metrics on" in (tmp_path / "chaos.log").read_text(),
            timeout=120,
            what="the job's metrics endpoint",
        )
        prom = Prometheus(tmp_path / "prom", [f"127.0.0.1:{port}"])
        sel = f'{{{N.LABEL_JOB}="live-metrics"}}'
        wait_for(
            lambda: prom.value(f"{N.PARTICIPATE.prom}_count{sel}") == 1.0,
            timeout=120,
            what="the recovery of the killed group to be scraped",
        )
        faults = prom.query(f"{N.FAULTS.prom}{sel}")
        assert [(f["metric"][N.LABEL_FAULT_KIND], f["value"][1]) for f in faults] == [("kill", "1")]
        failures = prom.query(f"{N.FAILURES.prom}{sel}")
        assert [f["metric"][N.LABEL_CAUSE] for f in failures] == ["signal"]
        assert 0.0 < prom.value(f"{N.PARTICIPATE.prom}_sum{sel}") < 60.0
        wait_for(
            lambda: prom.value(f"{N.PARTICIPANTS.prom}{sel}") == 3.0,
            timeout=60,
            what="all three groups participating again",
        )
    finally:
        if prom is not None:
            prom.stop()
        stop_process(job, timeout=60)
        log.close()
