"""Telemetry sink: journal records in, OTel spans and metrics out (in-memory SDK exporters)."""

from __future__ import annotations

import pytest
from journal_scenario import scenario
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sim_journal import simulate

from dashboards import names as N
from dashboards.metrics import summarize
from dashboards.telemetry import Telemetry
from runtime.journal import PHASES, Journal


def _feed(records, **kw):
    spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tel = Telemetry("unit", span_exporters=[spans], metric_readers=[reader], **kw)
    for r in records:
        tel.sink(r)
    return tel, spans, reader


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


@pytest.mark.parametrize(
    ("otel", "unit", "kind", "prom"),
    [
        ("ftharness.train.steps", "{step}", "counter", "ftharness_train_steps_total"),
        ("ftharness.recovery.duration", "s", "histogram", "ftharness_recovery_duration_seconds"),
        ("ftharness.goodput", "1", "gauge", "ftharness_goodput"),
        ("a.b_seconds", "s", "gauge", "a_b_seconds"),
        ("bytes.moved", "By", "counter", "bytes_moved_bytes_total"),
    ],
)
def test_prometheus_name_derivation(otel, unit, kind, prom):
    assert N.prometheus_name(otel, unit, kind) == prom


def test_metric_names_are_unique_and_histograms_have_second_buckets():
    otel = [m.otel for m in N.ALL_METRICS]
    assert len(set(otel)) == len(otel)
    assert len(set(N.PROMETHEUS.values())) == len(otel)
    for m in N.ALL_METRICS:
        if m.kind == "histogram":
            assert m.unit == "s" and list(m.buckets) == sorted(m.buckets)
            assert m.buckets[-1] >= 60  # a minutes-long recovery still lands in a finite bucket


def test_spans_form_a_fault_recovery_phase_tree_with_coordinates():
    tel, exporter, _ = _feed(scenario(job="unit", policy="in_place"))
    tel.shutdown()
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    fault, recovery = by_name[N.SPAN_FAULT], by_name[N.SPAN_RECOVERY]
    assert fault.attributes[N.ATTR_FAULT_KIND] == "kill"
    assert fault.attributes[N.ATTR_REPLICA] == 1
    assert fault.attributes[N.ATTR_RANK] == 0
    assert fault.attributes[N.ATTR_HOST] == "host1"
    assert fault.attributes[N.ATTR_STEP] == 11  # the last committed step when it fired
    assert fault.attributes[N.ATTR_JOB] == "unit"
    assert fault.attributes[N.ATTR_POLICY] == "in_place"
    assert recovery.parent is not None and recovery.parent.span_id == fault.context.span_id
    assert recovery.context.trace_id == fault.context.trace_id
    assert recovery.attributes.get(N.ATTR_INCOMPLETE) is None
    assert (recovery.end_time - recovery.start_time) / 1e9 == pytest.approx(2.3, abs=1e-3)
    phase_spans = {
        s.attributes[N.ATTR_PHASE]: s
        for s in spans
        if s.name.startswith(N.SPAN_PHASE_PREFIX) and s.name != N.SPAN_RECOVERY
    }
    assert set(phase_spans) == set(PHASES)
    for phase, span in phase_spans.items():
        assert span.name == N.phase_span_name(phase)
        assert span.parent.span_id == recovery.context.span_id
    detected = phase_spans["detected"]
    assert (detected.end_time - detected.start_time) / 1e9 == pytest.approx(0.04, abs=1e-3)
    assert [e.name for e in recovery.events] == [
        "detected",
        "replacement_started",
        "survivors_resumed",
        "healed",
        "participating",
    ]
    failure = by_name[N.SPAN_FAILURE]
    assert failure.attributes[N.ATTR_CAUSE] == "signal"
    assert failure.resource.attributes["service.name"] == "ftharness"
    assert failure.resource.attributes[N.ATTR_JOB] == "unit"


def test_metrics_match_the_journal_summary():
    records = scenario(job="unit", policy="in_place")
    tel, _, reader = _feed(records)
    points = _points(reader)
    summary = summarize(records)["policies"]["in_place"]
    (dur,) = points[N.PARTICIPATE.otel]
    assert dur.count == 1
    assert dur.sum == pytest.approx(summary["recoveries"][0]["participate_s"], abs=1e-6)
    assert tuple(dur.explicit_bounds) == N.RECOVERY_BUCKETS_S
    (det,) = points[N.DETECTION.otel]
    assert det.sum == pytest.approx(summary["recoveries"][0]["detection_s"], abs=1e-6)
    steps = {p.attributes[N.ATTR_REPLICA]: p.value for p in points[N.STEPS.otel]}
    assert steps == {"0": 40, "1": 30}  # group 1 missed the steps while it was away
    (part,) = points[N.PARTICIPANTS.otel]
    assert part.value == 2
    (faults,) = points[N.FAULTS.otel]
    assert faults.value == 1 and faults.attributes[N.ATTR_FAULT_KIND] == "kill"
    (goodput,) = points[N.GOODPUT.otel]
    assert goodput.value == pytest.approx(summary["goodput"], rel=1e-6)
    step_counts = sum(p.count for p in points[N.STEP_DURATION.otel])
    assert step_counts == sum(1 for r in records if r["event"] == "step.commit")
    tel.shutdown()


def test_the_latest_held_out_loss_of_each_policy_is_a_gauge():
    def evaluation(policy: str, step: int, loss: float) -> dict:
        return {
            "t": 1.7e9 + step,
            "event": "eval",
            "job": "unit",
            "policy": policy,
            "step": step,
            "replica": 0,
            "rank": 0,
            "heldout_loss": loss,
        }

    records = [
        evaluation("control", 0, 7.6),
        evaluation("in_place", 0, 7.6),
        evaluation("control", 50, 5.2),
        evaluation("in_place", 50, 5.25),
    ]
    tel, _, reader = _feed(records)
    losses = {p.attributes[N.ATTR_POLICY]: p.value for p in _points(reader)[N.HELDOUT_LOSS.otel]}
    assert losses == {"control": 5.2, "in_place": 5.25}  # the latest, not the first
    tel.shutdown()


def test_shutdown_ends_open_spans_marked_incomplete():
    records = scenario(job="unit")
    cut = next(
        i
        for i, r in enumerate(records)
        if r["event"] == "recovery.phase" and r["phase"] == "healed"
    )
    tel, exporter, _ = _feed(records[:cut])
    assert not [s for s in exporter.get_finished_spans() if s.name == N.SPAN_RECOVERY]
    tel.shutdown()
    (rec,) = [s for s in exporter.get_finished_spans() if s.name == N.SPAN_RECOVERY]
    assert rec.attributes[N.ATTR_INCOMPLETE] is True
    assert rec.end_time == int(records[cut - 1]["t"] * 1e9)


def test_sparse_and_unknown_records_do_not_raise_and_recovery_without_fault_is_unplanned():
    recs = [
        {"t": 1.0, "event": "something.new", "job": "unit"},
        {"t": 2.0, "event": "step.commit", "job": "unit"},
        {"t": 3.0, "event": "failure", "job": "unit"},
        {"t": 4.0, "event": "fault.heal", "job": "unit", "fault_id": "nope"},
        {"t": 4.5, "event": "step.commit", "job": "unit", "step_time_s": "fast"},
        {
            "t": 5.0,
            "event": "recovery.phase",
            "job": "unit",
            "recovery_id": "x",
            "phase": "detected",
            "replica": 0,
            "cause": "heartbeat",
        },
        {
            "t": 6.0,
            "event": "recovery.phase",
            "job": "unit",
            "recovery_id": "x",
            "phase": "participating",
            "replica": 0,
        },
    ]
    tel, exporter, reader = _feed(recs)
    assert tel.dropped_records == 1  # the malformed step.commit, and nothing else
    (dur,) = _points(reader)[N.PARTICIPATE.otel]
    assert dur.attributes[N.ATTR_FAULT_KIND] == "unplanned" and dur.sum == pytest.approx(1.0)
    tel.shutdown()
    (rec,) = [s for s in exporter.get_finished_spans() if s.name == N.SPAN_RECOVERY]
    assert rec.parent is None


def test_attached_to_a_journal_as_a_sink(tmp_path):
    tel, exporter, _ = _feed([])
    journal = Journal(tmp_path / "j.jsonl", job="unit", host="h0")
    journal.add_sink(tel.sink)
    journal.emit(
        "fault.inject", fault_id="a", kind="segfault", target={"replica": 0}, policy="in_place"
    )
    journal.emit("fault.heal", fault_id="a", kind="segfault")
    journal.close()
    tel.shutdown()
    (fault,) = exporter.get_finished_spans()
    assert fault.attributes[N.ATTR_HOST] == "h0"  # the journal's stamp reaches the span
    assert fault.attributes[N.ATTR_REPLICA] == 0


def _bucket_counts(values: list[float], bounds: tuple[float, ...]) -> list[int]:
    """OTel's explicit buckets: (-inf, b0], (b0, b1], ..., (b_last, +inf)."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return counts


def test_every_recovery_figure_is_the_same_live_and_in_the_report():
    """One journal (both policies of a case-study-shaped run, phases from the real tracker)
    through summarize() and through the Telemetry sink: every recovery figure the histograms
    hold is the value summarize() gives that recovery, and the goodput gauge is its goodput.
    The two policies' records are interleaved, with the same fault and recovery ids."""
    records = sorted(simulate("in_place") + simulate("full_restart"), key=lambda r: r["t"])
    tel, _, reader = _feed(records)
    points = _points(reader)
    summary = summarize(records)["policies"]
    checked = 0
    for metric in N.RECOVERY_METRICS:
        live = {
            (p.attributes[N.ATTR_POLICY], p.attributes[N.ATTR_FAULT_KIND]): p
            for p in points[metric.otel]
        }
        offline: dict[tuple[str, str], list[float]] = {}
        for policy, s in summary.items():
            for r in s["recoveries"]:
                if r[metric.quantity] is not None:
                    offline.setdefault((policy, r["kind"]), []).append(r[metric.quantity])
        assert set(live) == set(offline), metric.otel
        for key, values in offline.items():
            point = live[key]
            assert point.count == len(values), (metric.otel, key)
            assert point.sum == pytest.approx(sum(values), abs=1e-9), (metric.otel, key)
            assert list(point.bucket_counts) == _bucket_counts(values, metric.buckets), key
            checked += len(values)
    assert checked == 2 * (5 + 6 + 6)  # detection: not for the unplanned recovery
    # the case the issue was about: stall and time to participate per policy, as in report.md
    for policy in ("in_place", "full_restart"):
        for metric in (N.SURVIVOR_STALL, N.PARTICIPATE):
            (p,) = [
                p
                for p in points[metric.otel]
                if p.attributes[N.ATTR_POLICY] == policy
                and p.attributes[N.ATTR_FAULT_KIND] == "host_eviction"
            ]
            assert p.count == 2  # one value per evicted group
            stats = summary[policy]["faults"]["host_eviction"][metric.quantity]
            assert p.sum / p.count == pytest.approx(stats["mean"], abs=1e-9)
    goodput = {p.attributes[N.ATTR_POLICY]: p.value for p in points[N.GOODPUT.otel]}
    assert goodput == pytest.approx({p: s["goodput"] for p, s in summary.items()}, abs=1e-12)
    assert goodput["full_restart"] < goodput["in_place"]  # redone steps do not count twice
    tel.shutdown()
