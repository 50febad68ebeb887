"""The guard's counters and timings reach TensorBoard and Prometheus as the names promise.

The sinks are the real ones: ``torch.utils.tensorboard.SummaryWriter`` writing event files,
read back with TensorBoard's ``EventAccumulator``, and a ``prometheus_client`` registry read
back from its exposition text. The records are in the formats the guard and the quarantine
write (``Detection``, ``QuarantineAction.to_json``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from sdc_guard.metrics import (
    METRICS,
    GuardMetrics,
    MetricsSink,
    PrometheusMetrics,
    Sample,
    TensorBoardMetrics,
)
from sdc_guard.remediation.kube import QuarantineAction
from sdc_guard.report import Detection, StepReport
from tests.launch import scaled

ROOT = Path(__file__).resolve().parents[2]


def _detection(check: str, step: int, **kw: Any) -> Detection:
    return Detection(check=check, step=step, suspect_ranks=(1,), detail="test", **kw)


def _quarantine(action: str, step: int) -> dict[str, Any]:
    return QuarantineAction(action=action, node="node-b", dry_run=True, check="replay",
                            step=step, time=0.0).to_json()


def _run(metrics: GuardMetrics) -> None:
    """Five steps: a withheld replay detection at 2, a repaired weights detection at 4, a
    cordon and a restore in the event log."""
    for step in range(5):
        detections = []
        if step == 2:
            detections = [_detection("replay", 2)]
        if step == 4:
            detections = [_detection("weights", 4, repaired=True)]
        report = StepReport(step, 0.5, skipped=step == 2, detections=detections)
        due = ["nonfinite"] + (["replay"] if step % 2 == 0 else [])
        metrics.step(report, seconds=0.1 * (step + 1),
                     check_seconds={name: 0.01 for name in due}, due=due,
                     verified_step=step - 1)
        if step == 2:
            metrics.event({**_detection("replay", 2).to_json(), "rank": 0})  # not counted twice
            metrics.event(_quarantine("cordon", 2))
            metrics.event({"event": "injection", "step": 2})
        if step == 3:
            metrics.event({"event": "restore", "step": 1, "rank": 0})


def test_the_totals_count_what_the_steps_and_records_say() -> None:
    m = GuardMetrics()
    _run(m)
    assert m.value("sdc_guard_steps_total") == 5
    assert m.value("sdc_guard_detections_total", "replay") == 1
    assert m.value("sdc_guard_detections_total", "weights") == 1
    assert m.value("sdc_guard_repaired_total", "weights") == 1
    assert m.value("sdc_guard_repaired_total", "replay") == 0
    assert m.value("sdc_guard_withheld_steps_total") == 1
    assert m.value("sdc_guard_audits_total", "nonfinite") == 5
    assert m.value("sdc_guard_audits_total", "replay") == 3
    assert m.value("sdc_guard_quarantine_actions_total", "cordon") == 1
    assert m.value("sdc_guard_restores_total") == 1
    assert m.value("sdc_guard_last_step") == 4
    assert m.value("sdc_guard_verified_step") == 3


def test_contained_detections_and_the_checks_that_withheld_are_counted() -> None:
    m = GuardMetrics()
    # the withheld step's report names who withheld it; its detection arrives two steps later
    m.step(StepReport(7, 0.5, skipped=True, withheld_by=("checksum",)), seconds=0.1)
    later = _detection("checksum", 7, contained=True)
    m.step(StepReport(9, 0.5, detections=[later]), seconds=0.1)
    assert m.value("sdc_guard_withholds_total", "checksum") == 1
    assert m.value("sdc_guard_contained_total", "checksum") == 1
    assert m.value("sdc_guard_detections_total", "checksum") == 1


def test_tensorboard_reads_back_every_series(tmp_path: Path) -> None:
    # tensorboard ships no type information
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    _run(GuardMetrics(TensorBoardMetrics(writer)))
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()

    def series(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    assert series("sdc_guard_detections_total/replay") == [(2, 1.0)]
    assert series("sdc_guard_repaired_total/weights") == [(4, 1.0)]
    assert series("sdc_guard_withheld_steps_total") == [(2, 1.0)]
    # a counter is its running total, at the steps it changed
    assert series("sdc_guard_steps_total") == [(s, s + 1.0) for s in range(5)]
    assert series("sdc_guard_audits_total/replay") == [(0, 1.0), (2, 2.0), (4, 3.0)]
    steps, seconds = zip(*series("sdc_guard_step_seconds"), strict=True)
    assert steps == (0, 1, 2, 3, 4)
    assert seconds == pytest.approx([0.1 * (s + 1) for s in range(5)])  # float32 in the file
    steps, seconds = zip(*series("sdc_guard_check_seconds/nonfinite"), strict=True)
    assert steps == (0, 1, 2, 3, 4) and seconds == pytest.approx([0.01] * 5)
    # an event record lands at its own step (the restore names the step it went back to)
    assert series("sdc_guard_quarantine_actions_total/cordon") == [(2, 1.0)]
    assert series("sdc_guard_restores_total") == [(1, 1.0)]


def _exposition(registry: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_exposes_counters_gauges_and_histograms() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    _run(GuardMetrics(PrometheusMetrics(registry)))
    got = _exposition(registry)
    assert got[("sdc_guard_steps_total", ())] == 5
    assert got[("sdc_guard_detections_total", (("check", "replay"),))] == 1
    assert got[("sdc_guard_repaired_total", (("check", "weights"),))] == 1
    assert got[("sdc_guard_withheld_steps_total", ())] == 1
    assert got[("sdc_guard_audits_total", (("check", "replay"),))] == 3
    assert got[("sdc_guard_quarantine_actions_total", (("action", "cordon"),))] == 1
    assert got[("sdc_guard_restores_total", ())] == 1
    assert got[("sdc_guard_last_step", ())] == 4
    assert got[("sdc_guard_verified_step", ())] == 3
    assert got[("sdc_guard_step_seconds_count", ())] == 5
    assert got[("sdc_guard_step_seconds_sum", ())] == pytest.approx(1.5)
    assert got[("sdc_guard_step_seconds_bucket", (("le", "0.25"),))] == 2  # 0.1, 0.2
    assert got[("sdc_guard_check_seconds_count", (("check", "replay"),))] == 3
    # every metric is declared, with its help, before it has a value
    assert ("sdc_guard_contained_total", (("check", "checksum"),)) not in got
    families = {f.name for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {m.name.removesuffix("_total") for m in METRICS.values()} <= families


def test_a_second_prometheus_sink_in_one_registry_is_refused_with_the_fix() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    first = PrometheusMetrics(registry)
    with pytest.raises(ValueError, match=r"already registered.*one PrometheusMetrics per "
                                         r"process.*CollectorRegistry"):
        PrometheusMetrics(registry)
    GuardMetrics(first).step(StepReport(0, 0.0), seconds=0.1)  # the first still works
    assert _exposition(registry)[("sdc_guard_steps_total", ())] == 1


def test_prometheus_without_its_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'sdc-guard\[prometheus\]'"):
        PrometheusMetrics()


def test_bad_buckets_name_the_argument() -> None:
    from prometheus_client import CollectorRegistry

    with pytest.raises(ValueError, match=r"PrometheusMetrics\(buckets=...\) must be increasing"):
        PrometheusMetrics(CollectorRegistry(), buckets=(1.0, 0.5))


def test_something_that_is_not_a_sink_or_a_writer_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"sinks\[0\].*record\(step, samples\).*TensorBoardMetrics"):
        GuardMetrics(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TensorBoardMetrics\(writer\).*add_scalar.*SummaryWriter"):
        TensorBoardMetrics(object())
    with pytest.raises(KeyError, match="no such metric"):
        GuardMetrics().value("sdc_guard_detections")


class _Broken:
    def __init__(self) -> None:
        self.calls = 0

    def record(self, step: int, samples: Any) -> None:
        self.calls += 1
        raise OSError("disk full")


class _Kept:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def record(self, step: int, samples: Any) -> None:
        self.steps.append(step)


def test_a_failing_sink_never_stops_training_and_is_reported_once(
        caplog: pytest.LogCaptureFixture) -> None:
    broken, kept = _Broken(), _Kept()
    assert isinstance(broken, MetricsSink)
    m = GuardMetrics(broken, kept)
    with caplog.at_level(logging.DEBUG, logger="sdc_guard.metrics"):
        for step in range(3):
            m.step(StepReport(step, 0.0), seconds=0.1)
    assert broken.calls == 3 and kept.steps == [0, 1, 2]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "_Broken failed at step 0 (OSError: disk full)" in errors[0].message


def test_samples_carry_their_kind_for_a_sink_of_ones_own() -> None:
    got: list[Sample] = []

    class Collect:
        def record(self, step: int, samples: Any) -> None:
            got.extend(samples)

    GuardMetrics(Collect()).step(StepReport(3, 0.0, detections=[_detection("replay", 3)]),
                                 seconds=0.2, due=["replay"])
    kinds = {(s.metric.name, s.labels): s.metric.kind for s in got}
    assert kinds[("sdc_guard_detections_total", ("replay",))] == "counter"
    assert kinds[("sdc_guard_step_seconds", ())] == "histogram"
    assert kinds[("sdc_guard_last_step", ())] == "gauge"
    assert all(len(s.labels) == len(s.metric.labels) for s in got)


def test_importing_sdc_guard_imports_neither_tensorboard_nor_prometheus() -> None:
    script = textwrap.dedent("""
        import sys
        for name in ("tensorboard", "prometheus_client"):
            sys.modules[name] = None  # importing it raises ImportError from here on
        import sdc_guard, sdc_guard.metrics, sdc_guard.summary, sdc_guard.__main__
        from sdc_guard.metrics import GuardMetrics, TensorBoardMetrics
        from sdc_guard.report import StepReport

        class Writer:
            def __init__(self):
                self.tags = []
            def add_scalar(self, tag, value, global_step):
                self.tags.append(tag)

        w = Writer()
        GuardMetrics(TensorBoardMetrics(w)).step(StepReport(0, 0.0), seconds=0.1)
        assert "sdc_guard_steps_total" in w.tags, w.tags
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=scaled(120), check=False)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
