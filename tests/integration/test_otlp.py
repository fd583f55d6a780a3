"""An OTLP/HTTP export from a running job reaches a local receiver with the expected spans."""

from __future__ import annotations

import subprocess

import pytest
from telemetry_fixtures import (  # noqa: F401 - fixtures
    REPO,
    attrs,
    job_env,
    otlp_receiver,
    telemetry_job_command,
)

from dashboards import names as N
from runtime.journal import PHASES


@pytest.mark.timeout(120)
def test_otlp_http_export_carries_fault_and_recovery_spans(
    tmp_path,
    otlp_receiver,  # noqa: F811
    telemetry_job_command,  # noqa: F811
):
    argv = telemetry_job_command(
        journal=tmp_path / "j.jsonl",
        address_file=tmp_path / "addr",
        job="otlp-job",
        hold=False,
        otlp_endpoint=otlp_receiver.endpoint,
        step_s=0.01,
    )
    done = subprocess.run(argv, env=job_env(), cwd=REPO, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert not otlp_receiver.errors

    spans = otlp_receiver.spans()
    by_name: dict[str, list] = {}
    for resource, span in spans:
        by_name.setdefault(span.name, []).append((resource, span))
    ((resource, fault),) = by_name[N.SPAN_FAULT]
    res = attrs(resource.attributes)
    assert res["service.name"] == "ftharness" and res[N.ATTR_JOB] == "otlp-job"
    fa = attrs(fault.attributes)
    assert fa[N.ATTR_JOB] == "otlp-job"
    assert fa[N.ATTR_POLICY] == "in_place"
    assert fa[N.ATTR_FAULT_KIND] == "kill"
    assert (fa[N.ATTR_REPLICA], fa[N.ATTR_RANK], fa[N.ATTR_HOST]) == (1, 0, "host1")
    assert fa[N.ATTR_STEP] == 11
    ((_, recovery),) = by_name[N.SPAN_RECOVERY]
    assert recovery.parent_span_id == fault.span_id and recovery.trace_id == fault.trace_id
    ra = attrs(recovery.attributes)
    assert ra[N.ATTR_REPLICA] == 1 and ra[N.ATTR_RECOVERY_ID] == "r1"
    assert [e.name for e in recovery.events] == [
        "detected",
        "replacement_started",
        "survivors_resumed",
        "healed",
        "participating",
    ]
    for phase in PHASES:
        ((_, child),) = by_name[N.phase_span_name(phase)]
        assert child.parent_span_id == recovery.span_id
        assert attrs(child.attributes)[N.ATTR_PHASE] == phase
        assert child.end_time_unix_nano >= child.start_time_unix_nano
    participate_s = (recovery.end_time_unix_nano - fault.start_time_unix_nano) / 1e9
    assert 2.0 < participate_s < 3.0  # the job's replaced group rejoined ~2.3 s after the kill
    ((_, failure),) = by_name[N.SPAN_FAILURE]
    assert attrs(failure.attributes)[N.ATTR_CAUSE] == "signal"
    # metrics travel the same way (pushed by the periodic reader, at the latest on shutdown)
    assert {N.PARTICIPATE.otel, N.STEPS.otel, N.GOODPUT.otel} <= otlp_receiver.metric_names()
