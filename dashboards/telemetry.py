"""OpenTelemetry from the journal: a journal sink that turns records into spans and metrics.

The JSONL journal (``runtime/journal.py``) is the source of truth and needs nothing running;
this module is one of its sinks::

    journal = Journal(path, job="tiny")
    tel = Telemetry("tiny", prometheus_port=0, otlp_endpoint="http://127.0.0.1:4318")
    journal.add_sink(tel.sink)
    ...
    tel.shutdown()

Contract:

* ``sink(record)`` is called on the training thread for every record, so it does no I/O: metric
  updates are in-memory aggregations, spans go to a ``BatchSpanProcessor`` whose worker thread
  exports them, the Prometheus endpoint is served from its own thread and OTLP metrics are
  pushed by a periodic reader. ``ftharness bench telemetry`` measures what it costs a step.
* Spans are built from the records' own times (``t``), not from when the sink saw them, so a
  replayed journal gives the same spans as a live run. A fault span runs from ``fault.inject``
  to ``fault.heal``; a recovery span from its first phase (``detected``) to ``participating``,
  with one event and one child span per phase; a recovery naming a fault is that fault's child.
  Spans still open at ``shutdown`` are ended at the last time seen and marked incomplete.
* Metrics carry only low-cardinality attributes (job, policy, replica group, fault kind, cause);
  spans also carry host, rank and step. Names come from ``dashboards/names.py``.
* The recovery figures and the goodput are ``dashboards/metrics.py``'s, computed by its code:
  the sink folds each policy's records into a :class:`~dashboards.metrics.Throughput` and a
  :class:`~dashboards.metrics.RunState`, records a recovery's detection when its ``detected``
  phase arrives and its time to participate and survivor stall when it closes
  (``participating``), each from :func:`~dashboards.metrics.recovery_figures`. Fed a journal in
  time order, the histograms hold exactly the values ``summarize`` reports for the recoveries
  with phase records (its *derived* recoveries, read off journals without phase records, have
  no live counterpart). Memory grows by one float per committed step of each group.
* Not guaranteed: exporting. A collector that is down loses spans (the batch processor drops
  when full) but never blocks or fails training; the journal still has everything.

Why this module is longer than 500 lines: it is the one mapping from journal events to spans and
metrics; each event's mapping sits next to the instruments it updates, so a new event or metric is
one change in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from dashboards import names as N
from dashboards.metrics import (
    RunState,
    Throughput,
    failed_groups,
    host_fault,
    policy_of,
    recovery_figures,
)
from runtime import journal as J

_NS = 1_000_000_000
#: How often OTLP metrics are pushed to a collector (Prometheus is pulled instead).
OTLP_METRIC_INTERVAL_MS = 5_000


def _ns(t: float) -> int:
    return int(t * _NS)


@dataclass
class _Fault:
    span: Any
    t: float
    kind: str
    record: dict[str, Any]  # its fault.inject record (the target)
    on_host: set[Any]  # for a host fault: the groups on that host when it fired
    explained: set[Any] = field(default_factory=set)  # the groups of the recoveries it explains


@dataclass
class _Recovery:
    span: Any
    fault: _Fault | None
    replica: Any
    policy: str
    kind: str
    attrs: dict[str, Any]
    last_t: float
    phases: dict[str, float] = field(default_factory=dict)


@dataclass
class _Group:
    """Running totals of one replica group, read by the observable instruments."""

    steps: int = 0
    samples: float = 0.0
    last_step: int | None = None


class Telemetry:
    """Journal sink exporting OTel spans and metrics; see the module docstring for the contract.

    ``prometheus_port``: serve ``/metrics`` on ``prometheus_host:port`` (0 picks a free port;
    :attr:`prometheus_address` reports the real one). ``otlp_endpoint``: a collector's OTLP/HTTP
    base URL (``http://host:4318``); traces go to ``/v1/traces``, metrics to ``/v1/metrics``.
    ``resource``: extra resource attributes. ``metric_readers`` / ``span_exporters``: more
    destinations (an in-memory reader in tests, a console exporter while debugging).
    """

    def __init__(
        self,
        job: str,
        *,
        prometheus_port: int | None = None,
        prometheus_host: str = "127.0.0.1",
        otlp_endpoint: str | None = None,
        resource: Mapping[str, Any] | None = None,
        metric_readers: Sequence[MetricReader] = (),
        span_exporters: Sequence[SpanExporter] = (),
    ) -> None:
        self.job = job
        self._resource = Resource.create(
            {"service.name": N.SERVICE_NAME, N.ATTR_JOB: job, **dict(resource or {})}
        )
        readers: list[MetricReader] = list(metric_readers)
        exporters: list[SpanExporter] = list(span_exporters)
        self._http_server: WSGIServer | None = None  # serving /metrics, with prometheus_port
        self._prometheus_address: tuple[str, int] | None = None
        if prometheus_port is not None:
            readers.append(self._start_prometheus(prometheus_host, prometheus_port))
        if otlp_endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            base = otlp_endpoint.rstrip("/")
            exporters.append(OTLPSpanExporter(endpoint=base + "/v1/traces"))
            readers.append(
                PeriodicExportingMetricReader(
                    OTLPMetricExporter(endpoint=base + "/v1/metrics"),
                    export_interval_millis=OTLP_METRIC_INTERVAL_MS,
                )
            )
        views = [
            View(instrument_name=m.otel, aggregation=ExplicitBucketHistogramAggregation(m.buckets))
            for m in N.ALL_METRICS
            if m.kind == "histogram"
        ]
        self._meter_provider = MeterProvider(
            resource=self._resource,
            metric_readers=readers,
            views=views,
            exemplar_filter=AlwaysOffExemplarFilter(),  # exemplars cost time on every record
        )
        self._tracer_provider = TracerProvider(resource=self._resource)
        for exporter in exporters:
            self._tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._tracer_provider.get_tracer(N.TRACER_NAME)
        self._make_instruments()

        self._lock = threading.Lock()  # the journal may call the sink from several threads
        self._faults: dict[Any, _Fault] = {}
        # kept after the heal: a recovery often starts after its fault's span has ended
        self._fault_info: dict[Any, _Fault] = {}
        self._recoveries: dict[Any, _Recovery] = {}
        self._throughput: dict[str, Throughput] = {}
        self._state: dict[str, RunState] = {}
        self._groups: dict[tuple[str, Any], _Group] = {}
        self._participants_now: dict[str, int] = {}
        self._heldout_now: dict[str, float] = {}  # policy -> its latest held-out loss
        self._last_step: dict[str, int] = {}
        self._last_t = 0.0
        self._attr_cache: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._closed = False
        #: records skipped because a field had an unexpected type (the journal keeps them)
        self.dropped_records = 0

    # --- setup -----------------------------------------------------------------------------
    def _start_prometheus(self, host: str, port: int) -> MetricReader:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        # A registry per Telemetry, not the process-global one, so several can coexist.
        registry = CollectorRegistry(auto_describe=True)
        reader = PrometheusMetricReader(registry=registry)
        server, _thread = start_http_server(port, addr=host, registry=registry)
        self._http_server = server
        self._prometheus_address = (host, int(server.server_address[1]))
        return reader

    def _make_instruments(self) -> None:
        meter = self._meter_provider.get_meter(N.METER_NAME)

        def hist(m: N.MetricName):
            return meter.create_histogram(m.otel, unit=m.unit, description=m.description)

        def counter(m: N.MetricName):
            return meter.create_counter(m.otel, unit=m.unit, description=m.description)

        self._step_duration = hist(N.STEP_DURATION)
        for m, callback in ((N.STEPS, self._observe_steps), (N.SAMPLES, self._observe_samples)):
            meter.create_observable_counter(
                m.otel, callbacks=[callback], unit=m.unit, description=m.description
            )
        for m, callback in (
            (N.PARTICIPANTS, self._observe_participants),
            (N.LAST_STEP, self._observe_last_step),
            (N.HELDOUT_LOSS, self._observe_heldout),
        ):
            meter.create_observable_gauge(
                m.otel, callbacks=[callback], unit=m.unit, description=m.description
            )
        self._participate = hist(N.PARTICIPATE)
        self._detection = hist(N.DETECTION)
        self._stall = hist(N.SURVIVOR_STALL)
        self._faults_counter = counter(N.FAULTS)
        self._failures = counter(N.FAILURES)
        meter.create_observable_gauge(
            N.GOODPUT.otel,
            callbacks=[self._observe_goodput],
            unit=N.GOODPUT.unit,
            description=N.GOODPUT.description,
        )

    # --- public ----------------------------------------------------------------------------
    @property
    def prometheus_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the Prometheus endpoint really listens on, or None when disabled."""
        return self._prometheus_address

    def sink(self, record: Mapping[str, Any]) -> None:
        """Consume one journal record (any event; unknown events are ignored)."""
        event = record.get("event")
        handler = _HANDLERS.get(event)  # type: ignore[arg-type]
        if handler is None or self._closed:
            return
        with self._lock:
            try:
                t = float(record.get("t", 0.0))
                if t > self._last_t:
                    self._last_t = t
                handler(self, record, t)
            except (TypeError, ValueError, AttributeError):
                # one malformed record costs its own telemetry, not the sink: the journal
                # would drop a sink that raises, losing every later record
                self.dropped_records += 1

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Export buffered spans and metrics now; True if every exporter finished in time."""
        spans_ok = self._tracer_provider.force_flush(timeout_millis)
        metrics_ok = self._meter_provider.force_flush(timeout_millis)
        return bool(spans_ok and metrics_ok)

    def shutdown(self) -> None:
        """End open spans (marked incomplete), flush, stop exporters and the HTTP endpoint."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            end = _ns(self._last_t) if self._last_t else None
            for rec in self._recoveries.values():
                rec.span.set_attribute(N.ATTR_INCOMPLETE, True)
                rec.span.end(end_time=end)
            for fault in self._faults.values():
                fault.span.set_attribute(N.ATTR_INCOMPLETE, True)
                fault.span.end(end_time=end)
            self._recoveries.clear()
            self._faults.clear()
        self._tracer_provider.shutdown()
        self._meter_provider.shutdown()
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None

    # --- attributes --------------------------------------------------------------------------
    def _metric_attrs(self, policy: Any, **extra: Any) -> dict[str, Any]:
        """Attributes for a measurement, cached: the step path builds none per call."""
        key = (policy, *sorted(extra.items()))
        attrs = self._attr_cache.get(key)
        if attrs is None:
            attrs = {N.ATTR_JOB: self.job, N.ATTR_POLICY: str(policy or "")}
            for k, v in extra.items():
                attrs[k] = str(v) if v is not None else ""
            self._attr_cache[key] = attrs
        return attrs

    def _span_attrs(self, record: Mapping[str, Any]) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            N.ATTR_JOB: record.get("job") or self.job,
            N.ATTR_POLICY: policy_of(record),
        }
        target = record.get("target")
        if not isinstance(target, dict):
            target = {}
        coords = record.get("coords")
        if not isinstance(coords, dict):
            coords = {}
        for key, attr in (
            ("replica", N.ATTR_REPLICA),
            ("rank", N.ATTR_RANK),
            ("host", N.ATTR_HOST),
            ("step", N.ATTR_STEP),
        ):
            value = record.get(key, target.get(key, coords.get(key)))
            if value is None and key == "step":
                value = self._last_step.get(policy_of(record))
            if value is not None:
                attrs[attr] = value if isinstance(value, int | float | bool) else str(value)
        return attrs

    # --- handlers (called under the lock) ----------------------------------------------------
    def _folds(self, policy: str) -> tuple[Throughput, RunState]:
        tp = self._throughput.get(policy)
        if tp is None:
            tp = self._throughput[policy] = Throughput()
            self._state[policy] = RunState()
        return tp, self._state[policy]

    def _on_step(self, r: Mapping[str, Any], t: float) -> None:
        # The hot path: one histogram record, the rest are plain dict updates that the
        # observable instruments read at collection time (an SDK measurement costs ~15 us).
        policy = policy_of(r)
        replica = r.get("replica")
        step_time = r.get("step_time_s")
        if step_time is not None:
            self._step_duration.record(
                float(step_time), self._metric_attrs(policy, **{N.ATTR_REPLICA: replica})
            )
        samples = r.get("samples", 1) or 0  # each rank's own sequences, as metrics.py counts
        tp, state = self._folds(policy)
        tp.add(r)  # metrics.py's goodput, folded one commit at a time
        state.add(r)  # the commit times a survivor stall is computed from
        group = self._groups.get((policy, replica))
        if group is None:
            group = self._groups[(policy, replica)] = _Group()
        group.samples += samples
        if r.get("rank") not in (None, 0):
            return  # count each replica group's step once, not once per rank
        group.steps += 1
        step = r.get("step")
        if step is not None:
            group.last_step = step
            if step > self._last_step.get(policy, -1):
                self._last_step[policy] = step
        participants = r.get("participants")
        if participants is not None:
            n = participants if isinstance(participants, int) else len(participants)
            self._participants_now[policy] = n

    def _on_eval(self, r: Mapping[str, Any], t: float) -> None:
        loss = r.get("heldout_loss")
        if isinstance(loss, (int, float)):
            self._heldout_now[policy_of(r)] = float(loss)

    def _on_fault_inject(self, r: Mapping[str, Any], t: float) -> None:
        policy = policy_of(r)
        kind = str(r.get("kind") or "unknown")
        fault_id = r.get("fault_id")
        attrs = self._span_attrs(r)
        attrs[N.ATTR_FAULT_KIND] = kind
        if fault_id is not None:
            attrs[N.ATTR_FAULT_ID] = str(fault_id)
        if r.get("seed") is not None:
            attrs[N.ATTR_FAULT_SEED] = r["seed"]
        span = self._tracer.start_span(N.SPAN_FAULT, start_time=_ns(t), attributes=attrs)
        tp, state = self._folds(policy)
        tp.add(r)  # the first fault ends the fault-free stretch the baseline rate is read over
        host = host_fault(r)
        # by policy too: both policies of an experiment run the same plan, so the same ids
        self._faults[(policy, fault_id)] = self._fault_info[(policy, fault_id)] = _Fault(
            span=span,
            t=t,
            kind=kind,
            record=dict(r),
            on_host=state.groups_on(host) if host is not None else set(),
        )
        self._faults_counter.add(1, self._metric_attrs(policy, **{N.ATTR_FAULT_KIND: kind}))

    def _on_proc_start(self, r: Mapping[str, Any], t: float) -> None:
        self._folds(policy_of(r))[1].add(r)  # which host each group runs on

    def _on_fault_heal(self, r: Mapping[str, Any], t: float) -> None:
        fault = self._faults.pop((policy_of(r), r.get("fault_id")), None)
        if fault is not None:
            fault.span.end(end_time=_ns(max(t, fault.t)))

    def _on_failure(self, r: Mapping[str, Any], t: float) -> None:
        cause = str(r.get("cause") or "unknown")
        policy = policy_of(r)
        self._failures.add(1, self._metric_attrs(policy, **{N.ATTR_CAUSE: cause}))
        attrs = self._span_attrs(r)
        attrs[N.ATTR_CAUSE] = cause
        for key in ("exit_code", "signal", "detail"):
            if r.get(key) is not None:
                attrs[f"ftharness.failure.{key}"] = str(r[key])
        span = self._tracer.start_span(N.SPAN_FAILURE, start_time=_ns(t), attributes=attrs)
        span.end(end_time=_ns(t))

    def _on_phase(self, r: Mapping[str, Any], t: float) -> None:
        phase = str(r.get("phase"))
        rid = (policy_of(r), r.get("recovery_id"))  # ids restart with each policy's run
        rec = self._recoveries.get(rid)
        if rec is None:
            rec = self._start_recovery(r, t)
            self._recoveries[rid] = rec
        if phase in rec.phases:
            return  # a repeated phase record (several ranks report it) adds nothing
        # the detected phase's child span measures detection latency from the injection
        fault = rec.fault
        start = fault.t if (phase == "detected" and fault is not None) else rec.last_t
        start = min(start, t)
        rec.phases[phase] = t
        rec.last_t = max(rec.last_t, t)
        phase_attrs = {**rec.attrs, N.ATTR_PHASE: phase}
        rec.span.add_event(phase, attributes={N.ATTR_PHASE: phase}, timestamp=_ns(t))
        child = self._tracer.start_span(
            N.phase_span_name(phase),
            context=trace.set_span_in_context(rec.span),
            start_time=_ns(start),
            attributes=phase_attrs,
        )
        child.end(end_time=_ns(t))

        if phase not in ("detected", "participating"):
            return
        # metrics.py's figures, from the records seen so far (all a closed recovery's need)
        if fault is not None:
            failed = failed_groups(fault.record, fault.on_host, fault.explained)
        else:
            failed = failed_groups(None, (), [rec.replica])
        figures = recovery_figures(
            fault_t=fault.t if fault is not None else None,
            phases=rec.phases,
            times_by_group=self._folds(rec.policy)[1].times,
            failed=failed,
        )
        attrs = self._metric_attrs(rec.policy, **{N.ATTR_FAULT_KIND: rec.kind})
        if phase == "detected":
            if figures["detection_s"] is not None:
                self._detection.record(figures["detection_s"], attrs)
            return
        self._participate.record(figures["participate_s"], attrs)
        if figures["stall_s"] is not None:
            self._stall.record(figures["stall_s"], attrs)
        rec.span.end(end_time=_ns(t))
        del self._recoveries[rid]

    def _start_recovery(self, r: Mapping[str, Any], t: float) -> _Recovery:
        fault_id = r.get("fault_id")
        key = (policy_of(r), fault_id)
        fault = self._fault_info.get(key) if fault_id is not None else None
        # metrics.py calls a recovery with no fault "unplanned"; the cause is its own attribute
        kind = fault.kind if fault is not None else N.KIND_UNPLANNED
        if fault is not None:
            fault.explained.add(r.get("replica"))
        attrs = self._span_attrs(r)
        attrs[N.ATTR_FAULT_KIND] = kind
        if r.get("recovery_id") is not None:
            attrs[N.ATTR_RECOVERY_ID] = str(r["recovery_id"])
        if fault_id is not None:
            attrs[N.ATTR_FAULT_ID] = str(fault_id)
        if r.get("cause") is not None:
            attrs[N.ATTR_CAUSE] = str(r["cause"])
        # an ended span is still a valid parent: the trace reads fault -> recovery -> phases
        context = trace.set_span_in_context(fault.span) if fault is not None else None
        span = self._tracer.start_span(
            N.SPAN_RECOVERY, context=context, start_time=_ns(t), attributes=attrs
        )
        span_attrs = {k: v for k, v in attrs.items() if k != N.ATTR_STEP}
        return _Recovery(
            span=span,
            fault=fault,
            replica=r.get("replica"),
            policy=policy_of(r),
            kind=kind,
            attrs=span_attrs,
            last_t=t,
        )

    def _group_observations(self, value) -> list[Observation]:
        with self._lock:
            return [
                Observation(v, self._metric_attrs(policy, **{N.ATTR_REPLICA: replica}))
                for (policy, replica), g in self._groups.items()
                if (v := value(g)) is not None
            ]

    def _observe_steps(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._group_observations(lambda g: g.steps)

    def _observe_samples(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._group_observations(lambda g: g.samples)

    def _observe_last_step(self, _options: CallbackOptions) -> Iterable[Observation]:
        return self._group_observations(lambda g: g.last_step)

    def _observe_participants(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [
                Observation(n, self._metric_attrs(p)) for p, n in self._participants_now.items()
            ]

    def _observe_heldout(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [Observation(v, self._metric_attrs(p)) for p, v in self._heldout_now.items()]

    def _observe_goodput(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            values = [
                (tp.figures()["goodput"], self._metric_attrs(p))
                for p, tp in self._throughput.items()
            ]
        return [Observation(v, attrs) for v, attrs in values if v is not None]


_HANDLERS = {
    J.STEP_COMMIT: Telemetry._on_step,
    J.EVAL: Telemetry._on_eval,
    J.FAULT_INJECT: Telemetry._on_fault_inject,
    J.FAULT_HEAL: Telemetry._on_fault_heal,
    J.PROC_START: Telemetry._on_proc_start,
    J.FAILURE: Telemetry._on_failure,
    J.RECOVERY_PHASE: Telemetry._on_phase,
}
