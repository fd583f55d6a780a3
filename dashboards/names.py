"""Every span name, metric name and attribute key of ftharness's telemetry, defined once.

The OpenTelemetry names (``ftharness.train.steps``) are what the SDK, OTLP and a collector see.
The Prometheus exporter translates them (dots to underscores, the unit as a suffix, ``_total`` on
counters); :func:`prometheus_name` derives the exported name in this one place, and the Grafana
dashboard and the tests use :data:`PROMETHEUS` instead of spelling names by hand. A test scrapes
the real exporter and checks every derived name is one it emits, so a change in the exporter's
rules shows up as a failing test rather than as an empty Grafana panel.

Attribute keys are namespaced (``ftharness.job``, not ``job``) because Prometheus reserves ``job``
and ``instance`` for its own target labels and would rename ours to ``exported_job``.

Histograms carry only low-cardinality attributes (job, policy, replica group, fault kind,
cause). Rank, host and step go on spans, where a unique value per record costs nothing.

A recovery figure (and the goodput) has one definition, in ``dashboards/metrics.py``, and one
name: its :class:`MetricName` here says which figure it is (``quantity``), what every surface
calls it (``label``: report.md, the HTML and Grafana dashboards) and, in ``description``, the
definition in a sentence. The telemetry records exactly the values ``summarize`` reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SERVICE_NAME = "ftharness"
METER_NAME = "ftharness"
TRACER_NAME = "ftharness"

#: The fault kind of a recovery no injected fault explains (a spontaneous failure).
KIND_UNPLANNED = "unplanned"

# --- attribute keys (spans, metrics, resource) -------------------------------------------------
ATTR_JOB = "ftharness.job"
ATTR_POLICY = "ftharness.policy"
ATTR_REPLICA = "ftharness.replica"
ATTR_HOST = "ftharness.host"
ATTR_RANK = "ftharness.rank"
ATTR_STEP = "ftharness.step"
ATTR_FAULT_ID = "ftharness.fault.id"
ATTR_FAULT_KIND = "ftharness.fault.kind"
ATTR_FAULT_SEED = "ftharness.fault.seed"
ATTR_CAUSE = "ftharness.failure.cause"
ATTR_RECOVERY_ID = "ftharness.recovery.id"
ATTR_PHASE = "ftharness.recovery.phase"
ATTR_INCOMPLETE = "ftharness.incomplete"

# --- span names --------------------------------------------------------------------------------
#: One span per injected fault, from ``fault.inject`` to ``fault.heal``.
SPAN_FAULT = "ftharness.fault"
#: One span per recovery, from its ``detected`` phase to ``participating``; a child of its
#: fault's span when the recovery names a fault.
SPAN_RECOVERY = "ftharness.recovery"
#: Child spans of a recovery, one per phase, from the previous phase (or, for ``detected``, from
#: the fault's injection) to the phase's own record.
SPAN_PHASE_PREFIX = "ftharness.recovery."
#: One span per failure value reported to a supervisor (zero length; carries cause and coords).
SPAN_FAILURE = "ftharness.failure"


def phase_span_name(phase: str) -> str:
    """The child span name for a recovery phase, e.g. ``ftharness.recovery.healed``."""
    return SPAN_PHASE_PREFIX + phase


# --- metrics -----------------------------------------------------------------------------------
Kind = Literal["counter", "histogram", "gauge"]

#: Second-scale histogram buckets: OTel's defaults (0, 5, 10, 25, ... 10000) are sized for
#: milliseconds and would put every recovery into one bucket.
RECOVERY_BUCKETS_S = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    15.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
STEP_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass(frozen=True, kw_only=True)
class MetricName:
    """One instrument: its OTel name, unit, kind and description; ``prom`` is derived.

    ``quantity``: for a figure of ``dashboards/metrics.py``, its key there (``stall_s``);
    ``label``: its name on every surface."""

    otel: str
    unit: str
    kind: Kind
    description: str
    buckets: tuple[float, ...] = ()
    quantity: str | None = None
    label: str | None = None

    @property
    def prom(self) -> str:
        """The family name the Prometheus exporter publishes (histograms add _bucket etc.)."""
        return prometheus_name(self.otel, self.unit, self.kind)


STEP_DURATION = MetricName(
    otel="ftharness.train.step.duration",
    unit="s",
    kind="histogram",
    description="Wall time of one committed training step",
    buckets=STEP_BUCKETS_S,
)
STEPS = MetricName(
    otel="ftharness.train.steps",
    unit="{step}",
    kind="counter",
    description="Step commits of each replica group's rank 0 (a redone step counts again)",
)
SAMPLES = MetricName(
    otel="ftharness.train.samples",
    unit="{sample}",
    kind="counter",
    description="Sequences in step commits of all ranks, per group (a redone step counts again)",
)
PARTICIPANTS = MetricName(
    otel="ftharness.train.participants",
    unit="{replica_group}",
    kind="gauge",
    description="Replica groups in the quorum of the latest committed step",
)
LAST_STEP = MetricName(
    otel="ftharness.train.step",
    unit="{step}",
    kind="gauge",
    description="Latest committed step number, per replica group",
)
HELDOUT_LOSS = MetricName(
    otel="ftharness.train.heldout_loss",
    unit="1",
    kind="gauge",
    description=(
        "Held-out loss at the latest evaluation (data.eval_every): the mean next-token loss "
        "on the corpus's fixed held-out batches"
    ),
)
# The recovery figures: each is one quantity of dashboards/metrics.py (``quantity`` names its key
# in a recovery of ``summarize``; the module docstring there has the full definition), computed
# by its code; ``label`` is what every surface (report, HTML, Grafana) calls it.
DETECTION = MetricName(
    otel="ftharness.recovery.detection",
    unit="s",
    kind="histogram",
    quantity="detection_s",
    label="detection",
    description="Detection: from the fault's injection until the harness detects the failure",
    buckets=RECOVERY_BUCKETS_S,
)
SURVIVOR_STALL = MetricName(
    otel="ftharness.recovery.stall",
    unit="s",
    kind="histogram",
    quantity="stall_s",
    label="survivor stall",
    description=(
        "Survivor stall: while the failed group recovers, the longest a surviving group goes "
        "without committing, beyond its typical gap between commits before the fault "
        "(the largest over surviving groups)"
    ),
    buckets=RECOVERY_BUCKETS_S,
)
PARTICIPATE = MetricName(
    otel="ftharness.recovery.participate",
    unit="s",
    kind="histogram",
    quantity="participate_s",
    label="time to participate",
    description=(
        "Time to participate: from the fault's injection (a recovery no fault explains: from "
        "its detection) until the failed group commits a step again"
    ),
    buckets=RECOVERY_BUCKETS_S,
)
#: The recovery figures, in the order surfaces list them.
RECOVERY_METRICS: tuple[MetricName, ...] = (DETECTION, SURVIVOR_STALL, PARTICIPATE)
GOODPUT = MetricName(
    otel="ftharness.goodput",
    unit="1",
    kind="gauge",
    quantity="goodput",
    label="goodput",
    description=(
        "Goodput: committed samples per second (a redone step counted once) over the "
        "fault-free rate, over the records so far"
    ),
)
FAULTS = MetricName(
    otel="ftharness.faults", unit="{fault}", kind="counter", description="Injected faults, by kind"
)
FAILURES = MetricName(
    otel="ftharness.failures",
    unit="{failure}",
    kind="counter",
    description="Failures reported to a supervisor, by cause",
)

ALL_METRICS: tuple[MetricName, ...] = (
    STEP_DURATION,
    STEPS,
    SAMPLES,
    PARTICIPANTS,
    LAST_STEP,
    HELDOUT_LOSS,
    DETECTION,
    SURVIVOR_STALL,
    PARTICIPATE,
    GOODPUT,
    FAULTS,
    FAILURES,
)

# --- Prometheus translation (mirrors opentelemetry-exporter-prometheus + prometheus_client) ----
_UNIT_SUFFIX = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": "", "%": "percent"}
_NAME_RE = re.compile(r"[^a-zA-Z0-9:]+")
_LABEL_RE = re.compile(r"[^a-zA-Z0-9]+")


def prometheus_label(key: str) -> str:
    """The Prometheus label of an OTel attribute key: ``ftharness.job`` → ``ftharness_job``."""
    return _LABEL_RE.sub("_", key)


def prometheus_name(otel: str, unit: str, kind: Kind) -> str:
    """The metric family name the Prometheus exporter publishes for an OTel instrument.

    Dots become underscores; a unit in braces (``{step}``) is an annotation and adds nothing; a
    known unit adds its suffix (``s`` → ``_seconds``); counters end in ``_total``. Histograms
    are published as ``<name>_bucket``, ``_sum`` and ``_count`` of this family name.
    """
    name = _NAME_RE.sub("_", otel)
    unit_part = re.sub(r"\{.*\}", "", unit)
    suffix = _UNIT_SUFFIX.get(unit_part, _NAME_RE.sub("_", unit_part).strip("_"))
    if suffix and not name.endswith("_" + suffix):
        name += "_" + suffix
    if kind == "counter":
        name += "_total"
    return name


def prometheus_series(metric: MetricName) -> tuple[str, ...]:
    """Every series name the exporter publishes for one instrument."""
    if metric.kind == "histogram":
        return tuple(metric.prom + s for s in ("_bucket", "_sum", "_count"))
    return (metric.prom,)


#: OTel name → exported Prometheus family name, for the Grafana dashboard and the tests.
PROMETHEUS: dict[str, str] = {m.otel: m.prom for m in ALL_METRICS}
#: The labels dashboards group and filter by.
LABEL_JOB = prometheus_label(ATTR_JOB)
LABEL_POLICY = prometheus_label(ATTR_POLICY)
LABEL_REPLICA = prometheus_label(ATTR_REPLICA)
LABEL_FAULT_KIND = prometheus_label(ATTR_FAULT_KIND)
LABEL_CAUSE = prometheus_label(ATTR_CAUSE)
