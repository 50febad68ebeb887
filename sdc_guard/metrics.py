"""Counters and timings of a guarded run, for the dashboards a user already has.

The guard hands ``GuardMetrics`` what it knows after each step (``GuardMetrics.step``: the
``StepReport``, the step's wall time, each due check's time) and every record it writes to the
event log (``GuardMetrics.event``: restores, quarantine outcomes). ``GuardMetrics`` turns them
into the named samples of ``METRICS`` and passes them, once per step or record, to its sinks:

- ``TensorBoardMetrics(writer)``: any object with ``add_scalar(tag, value, global_step)``,
  such as ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package:
  ``pip install 'sdc-guard[tensorboard]'``);
- ``PrometheusMetrics(registry=None)``: ``prometheus_client`` counters, gauges and histograms
  (``pip install 'sdc-guard[prometheus]'``), served by the user's own
  ``prometheus_client.start_http_server``;
- anything that implements ``MetricsSink``.

Nothing here imports TensorBoard or ``prometheus_client`` when ``sdc_guard`` is imported:
torch stays the only hard dependency. A sink that raises never stops training: the first
failure of each sink is logged at ERROR, later ones at DEBUG. Each rank counts what its own
guard saw; detections are agreed on every rank, so a dashboard over several ranks takes the
``max`` (or attaches the metrics on one rank). See docs/observability.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from sdc_guard.report import StepReport

log = logging.getLogger(__name__)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One named series family: what it counts and how a sink should treat its values."""

    name: str
    """The Prometheus name (counters end in ``_total``); TensorBoard tags start with it."""
    kind: Kind
    """"counter": a sample's value is an increment; "gauge": the new value; "histogram":
    one observation."""
    help: str
    """A sentence for the dashboard's reader."""
    labels: tuple[str, ...] = ()
    """The label names every sample of this family carries, in this order."""


METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric("sdc_guard_steps_total", "counter", "Steps the guard ran."),
    Metric("sdc_guard_detections_total", "counter",
           "Detections, by the check that fired.", ("check",)),
    Metric("sdc_guard_repaired_total", "counter",
           "Detections whose suspects' state was repaired in place from the majority.",
           ("check",)),
    Metric("sdc_guard_contained_total", "counter",
           "Detections whose corrupt gradient reached no weights in the step it happened.",
           ("check",)),
    Metric("sdc_guard_withheld_steps_total", "counter",
           "Steps whose optimizer step was withheld on every rank."),
    Metric("sdc_guard_withholds_total", "counter",
           "Withheld steps, by each check whose verdict withheld it.", ("check",)),
    Metric("sdc_guard_audits_total", "counter",
           "Steps in which a check was due (an audit run), by check.", ("check",)),
    Metric("sdc_guard_restores_total", "counter",
           "Checkpoint restores recorded in the event log."),
    Metric("sdc_guard_quarantine_actions_total", "counter",
           "Quarantine outcomes: cordon, evidence, breaker, error.", ("action",)),
    Metric("sdc_guard_step_seconds", "histogram", "Wall time of a guarded step, in seconds."),
    Metric("sdc_guard_check_seconds", "histogram",
           "Host time a due check took in a step, in seconds.", ("check",)),
    Metric("sdc_guard_last_step", "gauge", "The newest step the guard ran."),
    Metric("sdc_guard_verified_step", "gauge",
           "The newest step every enabled check has verified clean (-1: none yet)."),
)}
"""Every series the guard emits, by name."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One value of one series: an increment, a gauge's value or an observation (by kind)."""

    metric: Metric
    value: float
    labels: tuple[str, ...] = ()
    """The label values, in the order of ``metric.labels``."""


@runtime_checkable
class MetricsSink(Protocol):
    """Where ``GuardMetrics`` sends its samples: one call per step or event record."""

    def record(self, step: int, samples: Sequence[Sample]) -> None:
        """Take the samples of ``step`` (read each one by ``sample.metric.kind``)."""


class GuardMetrics:
    """Turns what the guard knows per step, and its event records, into ``METRICS``.

    ``GuardMetrics(*sinks)``: each sink receives every sample. ``totals`` keeps the running
    value of each counter and gauge (by name and label values), for tests and for a loop that
    prints them. Safe to call from several threads (the quarantine's records arrive on its
    worker thread).
    """

    def __init__(self, *sinks: MetricsSink) -> None:
        for i, sink in enumerate(sinks):
            if not callable(getattr(sink, "record", None)):
                raise TypeError(
                    f"GuardMetrics(sinks[{i}]): a sink needs record(step, samples) (a "
                    f"sdc_guard.metrics.MetricsSink), got {type(sink).__name__}. Wrap a "
                    "SummaryWriter in TensorBoardMetrics(writer), or use PrometheusMetrics().")
        self.sinks: tuple[MetricsSink, ...] = sinks
        self.totals: dict[tuple[str, tuple[str, ...]], float] = {}
        """Counters' sums and gauges' last values, keyed by (name, label values)."""
        self._lock = threading.Lock()
        self._failed: set[int] = set()
        self._last_step = -1

    def step(self, report: StepReport, *, seconds: float,
             check_seconds: Mapping[str, float] | None = None, due: Iterable[str] = (),
             verified_step: int | None = None) -> None:
        """What a step did: ``report`` (detections, withheld), its wall time ``seconds``, the
        time of each due check (name -> seconds) and the names of the checks due (audits run);
        ``verified_step``: the guard's ``clean_through`` after the step, when known."""
        m = METRICS
        samples = [Sample(m["sdc_guard_steps_total"], 1.0),
                   Sample(m["sdc_guard_step_seconds"], float(seconds)),
                   Sample(m["sdc_guard_last_step"], float(report.step))]
        samples += [Sample(m["sdc_guard_audits_total"], 1.0, (name,)) for name in due]
        samples += [Sample(m["sdc_guard_check_seconds"], float(s), (name,))
                    for name, s in (check_seconds or {}).items()]
        if verified_step is not None:
            samples.append(Sample(m["sdc_guard_verified_step"], float(verified_step)))
        if report.skipped:
            samples.append(Sample(m["sdc_guard_withheld_steps_total"], 1.0))
        samples += [Sample(m["sdc_guard_withholds_total"], 1.0, (name,))
                    for name in getattr(report, "withheld_by", ())]
        for d in report.detections:
            samples.append(Sample(m["sdc_guard_detections_total"], 1.0, (d.check,)))
            if d.repaired:
                samples.append(Sample(m["sdc_guard_repaired_total"], 1.0, (d.check,)))
            if getattr(d, "contained", False):
                samples.append(Sample(m["sdc_guard_contained_total"], 1.0, (d.check,)))
        self._emit(report.step, samples)

    def event(self, record: Mapping[str, Any]) -> None:
        """An event-log record: restores and quarantine outcomes are counted; detections are
        not (they are counted from the step's report), nor other records."""
        kind = record.get("event")
        if kind == "restore":
            samples = [Sample(METRICS["sdc_guard_restores_total"], 1.0)]
        elif kind == "quarantine":
            action = str(record.get("action", "unknown"))
            samples = [Sample(METRICS["sdc_guard_quarantine_actions_total"], 1.0, (action,))]
        else:
            return
        step = record.get("step")
        self._emit(step if isinstance(step, int) and step >= 0 else self._last_step, samples)

    def value(self, name: str, *labels: str) -> float:
        """A counter's running sum or a gauge's last value (0.0 before any sample)."""
        if name not in METRICS:
            raise KeyError(f"GuardMetrics.value({name!r}): no such metric; one of "
                           f"{sorted(METRICS)}.")
        return self.totals.get((name, labels), 0.0)

    def _emit(self, step: int, samples: list[Sample]) -> None:
        with self._lock:
            self._last_step = max(self._last_step, step)
            for s in samples:
                key = (s.metric.name, s.labels)
                if s.metric.kind == "counter":
                    self.totals[key] = self.totals.get(key, 0.0) + s.value
                elif s.metric.kind == "gauge":
                    self.totals[key] = s.value
            for i, sink in enumerate(self.sinks):
                try:
                    sink.record(step, samples)
                except Exception as e:  # a dashboard's failure must not stop training
                    level = logging.DEBUG if i in self._failed else logging.ERROR
                    self._failed.add(i)
                    log.log(level, "sdc-guard: metrics sink %s failed at step %d (%s: %s); "
                            "training goes on", type(sink).__name__, step, type(e).__name__, e)


class TensorBoardMetrics:
    """A ``MetricsSink`` for ``torch.utils.tensorboard.SummaryWriter`` (or any object with
    ``add_scalar(tag, value, global_step)``).

    Tags are the metric's name, then its label values: ``sdc_guard_detections_total/replay``.
    A counter is written as its running total at the step it changed, a gauge as its value, a
    histogram's observation as it is (TensorBoard plots the series over steps). The writer is
    the caller's: flush and close it as usual.
    """

    def __init__(self, writer: Any) -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(
                f"TensorBoardMetrics(writer): needs an object with add_scalar(tag, value, "
                f"global_step), such as torch.utils.tensorboard.SummaryWriter(log_dir), got "
                f"{type(writer).__name__}.")
        self.writer = writer
        self._totals: dict[str, float] = {}

    def record(self, step: int, samples: Sequence[Sample]) -> None:
        for s in samples:
            tag = "/".join((s.metric.name, *s.labels))
            value = s.value
            if s.metric.kind == "counter":
                value = self._totals[tag] = self._totals.get(tag, 0.0) + s.value
            self.writer.add_scalar(tag, value, step)


class PrometheusMetrics:
    """A ``MetricsSink`` that keeps ``prometheus_client`` series for every metric in ``METRICS``.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (default: the client's global
    ``REGISTRY``, which ``start_http_server`` serves). One ``PrometheusMetrics`` per registry:
    a second one in the same registry is refused with the fix. Needs
    ``pip install 'sdc-guard[prometheus]'``.
    """

    def __init__(self, registry: Any = None, *,
                 buckets: Sequence[float] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                             0.5, 1.0, 2.5, 5.0, 10.0, 30.0)) -> None:
        """``buckets``: the upper bounds, in seconds, of the step and check time histograms."""
        try:
            import prometheus_client as prom
        except ImportError:
            raise ImportError("PrometheusMetrics needs prometheus_client: "
                              "pip install 'sdc-guard[prometheus]'") from None
        if registry is None:
            registry = prom.REGISTRY
        if list(buckets) != sorted(buckets) or not buckets or min(buckets) <= 0:
            raise ValueError(f"PrometheusMetrics(buckets=...) must be increasing numbers of "
                             f"seconds > 0, got {tuple(buckets)!r}.")
        self.registry = registry
        self.series: dict[str, Any] = {}
        """The ``prometheus_client`` metric of each name in ``METRICS``."""
        makers = {"counter": prom.Counter, "gauge": prom.Gauge}
        for m in METRICS.values():
            try:
                if m.kind == "histogram":
                    self.series[m.name] = prom.Histogram(m.name, m.help, m.labels,
                                                         registry=registry, buckets=buckets)
                else:
                    self.series[m.name] = makers[m.kind](m.name, m.help, m.labels,
                                                         registry=registry)
            except ValueError as e:  # "Duplicated timeseries in CollectorRegistry"
                for made in self.series.values():
                    registry.unregister(made)
                raise ValueError(
                    f"PrometheusMetrics: {m.name} is already registered in this registry ({e}); "
                    "make one PrometheusMetrics per process and share it, or pass "
                    "registry=prometheus_client.CollectorRegistry() of its own.") from None

    def record(self, step: int, samples: Sequence[Sample]) -> None:
        for s in samples:
            series = self.series[s.metric.name]
            if s.labels:
                series = series.labels(*s.labels)
            if s.metric.kind == "counter":
                series.inc(s.value)
            elif s.metric.kind == "gauge":
                series.set(s.value)
            else:
                series.observe(s.value)
