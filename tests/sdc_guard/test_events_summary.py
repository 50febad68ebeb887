"""``python -m sdc_guard events summarize LOG``: an event log counted per check, rank and node.

One log comes from a real guarded 3-rank run that quarantines (dry run) through the official
client on the loopback Kubernetes stand-in; the others are written by ``EventLog`` with
records in the formats the guard, the quarantine and the injectors write.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kube_standin import StandInAPIServer
from sdc_guard.__main__ import main
from sdc_guard.events import EventLog
from sdc_guard.remediation.kube import QuarantineAction
from sdc_guard.report import Detection
from sdc_guard.summary import summarize
from tests import workers
from tests.launch import run_ranks, scaled

ROOT = Path(__file__).resolve().parents[2]
NODES = ["gpu-a", "gpu-b", "gpu-c"]


def _summarize(log: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["events", "summarize", str(log), *extra])
    return code, capsys.readouterr().out


@pytest.mark.timeout(240)
def test_a_real_run_with_a_weight_fault_and_a_dry_run_quarantine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "events.jsonl"
    with StandInAPIServer() as srv:
        for n in NODES:
            srv.add_node(n)
        srv.add_namespace("ml")
        quarantine = {"nodes": NODES, "kwargs": {
            "kubeconfig": str(srv.write_kubeconfig(tmp_path / "kubeconfig")), "job": "test-job",
            "max_nodes": 1, "max_fraction": 0.5, "backoff_s": 0.05, "request_timeout_s": 2.0,
            "deadline_s": 10.0}}
        flip = {"site": "weight_bitflip", "rank": 1, "step": 3, "bit": 0}
        run_ranks(workers.guarded_run, 3, 6, flip,
                  {"event_log": str(log), "repair_by_majority": False}, "adamw", False,
                  quarantine)
    code, out = _summarize(log, capsys, "--json")
    assert code == 0
    s = json.loads(out)
    # unrepaired, rank 1's weights differ at every step from the flip on: 3, 4 and 5; the
    # votes of 3 and 4 are read in steps 4 and 5, which they withhold (the last in flush())
    assert s["detections"] == 3
    weights = s["by_check"]["weights"]
    assert (weights["detections"], weights["repaired"], weights["withheld"]) == (3, 0, 2)
    assert (weights["first_step"], weights["last_step"]) == (3, 5)
    assert set(s["by_rank"]) == {"1"} and s["by_rank"]["1"]["detections"] == 3
    assert set(s["by_node"]) == {"gpu-b"} and s["by_node"]["gpu-b"]["detections"] == 3
    assert s["by_node"]["gpu-b"]["cordon"] == 1  # rank 0 cordons the suspect's node once
    assert s["quarantine"]["actions"]["cordon"] == 1
    assert s["quarantine"]["dry_run"] >= 1 and s["quarantine"]["real"] == 0
    assert s["bad_lines"] == 0 and s["first_step"] == 3 and s["last_step"] == 5

    code, text = _summarize(log, capsys)
    assert code == 0
    row = next(line for line in text.splitlines() if line.strip().startswith("weights"))
    assert row.split() == ["weights", "3", "0", "0", "2", "3", "5"]
    assert "quarantine: 1 cordon" in text and "gpu-b" in text


def _detection(check: str, step: int, ranks: tuple[int, ...], nodes: tuple[str, ...],
               **kw: Any) -> dict[str, Any]:
    return Detection(check=check, step=step, suspect_ranks=ranks, suspect_nodes=nodes,
                     detail="test", **kw).to_json()


def _quarantine(action: str, step: int, node: str | None, **kw: Any) -> dict[str, Any]:
    return QuarantineAction(action=action, node=node, dry_run=False, check="checksum",
                            step=step, time=0.0, **kw).to_json()


def _written_log(path: Path) -> Path:
    logs = [EventLog(path, rank=r) for r in range(3)]
    for r in range(3):  # an older log: every rank wrote the same detection
        logs[r].write({**_detection("replay", 10, (2,), ("gpu-c",)),
                       "optimizer_step_skipped": True})
    logs[0].write({"event": "injection", "rank": 1, "step": 19, "site": "linear_product"})
    logs[0].write({**_detection("checksum", 20, (1,), ("gpu-b",), contained=True),
                   "withheld_by": ["checksum"], "optimizer_step_skipped": True})
    logs[1].write({"event": "telemetry", "check": "checksum", "step": 20, "telemetry": None})
    logs[0].write(_quarantine("cordon", 20, "gpu-b"))
    logs[0].write({**_detection("weights", 30, (1,), ("gpu-b",), repaired=True),
                   "withheld_by": [], "optimizer_step_skipped": False})
    logs[0].write({**_detection("nonfinite", 40, (0, 1, 2), tuple(NODES)),
                   "withheld_by": ["nonfinite"], "optimizer_step_skipped": True})
    logs[0].write(_quarantine("breaker", 40, None, nodes=tuple(NODES)))
    logs[0].write({"event": "restore", "step": 35})
    logs[0].write({"event": "watchdog", "step": 41, "detail": "rank 2 silent"})
    with path.open("a") as f:
        f.write("{not json\n")
    return path


def test_counts_per_check_rank_and_node_from_records_in_the_real_formats(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = _written_log(tmp_path / "events.jsonl")
    code, out = _summarize(log, capsys, "--json")
    assert code == 0
    s = json.loads(out)
    assert s["bad_lines"] == 1 and s["logged_by_ranks"] == [0, 1, 2]
    assert (s["first_step"], s["last_step"]) == (10, 41)
    assert s["detections"] == 4  # the replay detection three ranks wrote counts once
    c = s["by_check"]
    assert (c["replay"]["detections"], c["replay"]["withheld"]) == (1, 1)
    assert (c["checksum"]["contained"], c["checksum"]["withheld"]) == (1, 1)
    assert (c["weights"]["repaired"], c["weights"]["withheld"]) == (1, 0)
    assert c["nonfinite"]["withheld"] == 1
    r = s["by_rank"]
    assert list(r) == ["0", "1", "2"]
    assert (r["1"]["detections"], r["1"]["repaired"], r["1"]["contained"]) == (3, 1, 1)
    assert (r["1"]["first_step"], r["1"]["last_step"]) == (20, 40)
    assert r["2"]["detections"] == 2 and r["0"]["detections"] == 1
    n = s["by_node"]
    assert (n["gpu-b"]["detections"], n["gpu-b"]["cordon"], n["gpu-b"]["breaker"]) == (3, 1, 1)
    assert (n["gpu-a"]["detections"], n["gpu-a"]["breaker"]) == (1, 1)
    assert s["withheld_steps"] == [10, 20, 40]
    assert (s["restores"], s["restore_steps"]) == (1, [35])
    assert s["quarantine"] == {"actions": {"breaker": 1, "cordon": 1}, "dry_run": 0, "real": 2}
    assert s["injections"] == {"total": 1, "by_site": {"linear_product": 1}}
    assert s["other_events"] == {"telemetry": 1, "watchdog": 1}

    code, text = _summarize(log, capsys)
    assert code == 0
    assert "1 bad line(s) skipped" in text
    assert "withheld steps: 3 (10, 20, 40)" in text
    assert "restores: 1 (to steps 35)" in text
    assert "quarantine: 1 breaker, 1 cordon (0 dry run, 2 real)" in text
    assert "injections: 1 (linear_product 1)" in text
    node_row = next(line.split() for line in text.split("by node")[1].splitlines()
                    if line.strip().startswith("gpu-b"))
    assert node_row == ["gpu-b", "3", "1", "1", "1", "0", "1", "0"]


def test_an_empty_log_says_so() -> None:
    s = summarize([])
    assert s["detections"] == 0 and s["first_step"] is None and s["by_check"] == {}


def test_a_missing_log_is_named_with_the_fix(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["events", "summarize", str(tmp_path / "nope.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.jsonl: no such event log" in err and "GuardConfig.event_log" in err


def test_python_m_sdc_guard_events_summarize_runs(tmp_path: Path) -> None:
    log = _written_log(tmp_path / "events.jsonl")
    run = subprocess.run([sys.executable, "-m", "sdc_guard", "events", "summarize", str(log)],
                         cwd=ROOT, capture_output=True, text=True, timeout=scaled(120),
                         check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"event log {log}")
    assert "by check" in run.stdout and "by suspect rank" in run.stdout
