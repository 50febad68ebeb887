"""Guarded 3-rank trainings that quarantine through the official client, over HTTP, on the
loopback stand-in for the Kubernetes API server (``kube_standin``)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kube_standin import StandInAPIServer
from sdc_guard import read_events
from sdc_guard.remediation.evidence import EVIDENCE, MARKER, TAINT_KEY, parse_entries
from tests import workers
from tests.launch import run_ranks, scaled

pytestmark = pytest.mark.timeout(240)

NODES = ["gpu-a", "gpu-b", "gpu-c"]
OTHER_TAINT = {"key": "example.com/maintenance", "value": "soon", "effect": "PreferNoSchedule"}


class _Server(StandInAPIServer):
    """The stand-in, with the kubeconfig the fixture wrote for it."""

    kubeconfig: Path


@pytest.fixture
def server(tmp_path: Path) -> Any:
    with _Server() as srv:
        for n in NODES:
            srv.add_node(n, taints=[OTHER_TAINT] if n == "gpu-b" else None)
        srv.add_node("gpu-spare")
        srv.add_namespace("ml")
        srv.kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
        yield srv


def _quarantine(srv: Any, **kwargs: Any) -> dict[str, Any]:
    base = {"kubeconfig": str(srv.kubeconfig), "job": "test-job", "max_nodes": 1,
            "max_fraction": 0.5, "backoff_s": 0.05, "request_timeout_s": 2.0,
            "deadline_s": 10.0}
    return {"nodes": NODES, "kwargs": {**base, **kwargs}}


def _our_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in node["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


WEIGHT_FLIP = {"site": "weight_bitflip", "rank": 1, "step": 3, "bit": 0}
NO_REPAIR = {"repair_by_majority": False}  # a repaired first detection does not quarantine


def test_a_fault_on_rank_1_cordons_exactly_its_node(server: Any, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    res = run_ranks(workers.guarded_run, 3, 6, WEIGHT_FLIP, {"event_log": str(log), **NO_REPAIR},
                    "adamw", False, _quarantine(server, dry_run=False))
    assert all(r["detections"][0] == ("weights", 3, (1,)) for r in res)
    assert all(r["suspect_nodes"][0] == ("gpu-b",) for r in res)
    cordoned = [n for n in [*NODES, "gpu-spare"] if server.node(n)["spec"].get("unschedulable")]
    assert cordoned == ["gpu-b"]
    node = server.node("gpu-b")
    assert len(_our_taints(node)) == 1
    assert OTHER_TAINT in node["spec"]["taints"], "another tool's taint was lost"
    marker = json.loads(node["metadata"]["annotations"][MARKER])
    assert marker["job"] == "test-job" and marker["already_unschedulable"] is False
    _, entries = parse_entries(node["metadata"]["annotations"][EVIDENCE])
    kinds = sorted(e["kind"] for e in entries)
    assert kinds == ["detection", "telemetry"]  # rank 0 cordons; rank 1 adds its own snapshot
    det = next(e for e in entries if e["kind"] == "detection")
    assert (det["check"], det["step"], det["suspect_ranks"]) == ("weights", 3, [1])
    assert det["evidence"]["fingerprints"]
    tel = next(e for e in entries if e["kind"] == "telemetry")
    assert tel["rank"] == 1 and tel["telemetry"]["available"] is False
    assert [e["involvedObject"]["name"] for e in server.events] == ["gpu-b"]
    # Only rank 0 acts; only the suspect rank writes its telemetry; nobody else writes.
    assert [a["action"] for a in res[0]["actions"]] == ["cordon"]
    assert [a["action"] for a in res[1]["actions"]] == ["evidence"]
    assert res[2]["actions"] == []
    assert res[1]["telemetry"][0]["available"] is False and res[0]["telemetry"][0] is None
    events = read_events(log)
    # One detection record per job (the lowest rank's), the suspect's own telemetry beside it.
    logged = [e for e in events if e["event"] == "detection" and e["step"] == 3]
    assert [(e["rank"], e["suspect_nodes"]) for e in logged] == [(0, ["gpu-b"])]
    assert "telemetry" not in logged[0]["evidence"]
    snapshots = [e for e in events if e["event"] == "telemetry" and e["step"] == 3]
    assert [(e["rank"], e["check"], e["telemetry"]["available"]) for e in snapshots] == [
        (1, "weights", False)]
    cordons = [e for e in events if e["event"] == "quarantine" and e["action"] == "cordon"]
    assert [(e["rank"], e["node"], e["dry_run"]) for e in cordons] == [(0, "gpu-b", False)]


def test_dry_run_is_the_default_and_stores_nothing(server: Any) -> None:
    res = run_ranks(workers.guarded_run, 3, 6, WEIGHT_FLIP, NO_REPAIR, "adamw", False,
                    _quarantine(server))
    assert [a["action"] for a in res[0]["actions"]] == ["cordon"]
    assert res[0]["actions"][0]["dry_run"] is True
    assert not server.node("gpu-b")["spec"].get("unschedulable")
    assert MARKER not in (server.node("gpu-b")["metadata"].get("annotations") or {})
    assert server.events == []
    writes = [r for r in server.requests if r.method in ("PATCH", "POST")]
    assert writes and all(r.dry_run for r in writes)


def test_every_rank_suspect_trips_the_breaker_and_cordons_nothing(server: Any) -> None:
    fault = {"site": "grad_nan", "ranks": [0, 1, 2], "step": 2}
    res = run_ranks(workers.guarded_run, 3, 12, fault, None, "adamw", False,
                    _quarantine(server, dry_run=False))
    assert all(set(r["suspect_nodes"][0]) == set(NODES) for r in res)
    assert [a["action"] for a in res[0]["actions"]] == ["breaker"]
    assert "circuit breaker" in res[0]["actions"][0]["detail"]
    assert not any(server.node(n)["spec"].get("unschedulable") for n in NODES)
    alerts = [e for e in server.events if e["involvedObject"]["kind"] == "Pod"]
    assert [(e["involvedObject"]["name"], e["reason"]) for e in alerts] == [
        ("job-worker-0", "SDCQuarantineBreaker")]
    assert not [e for e in server.events if e["involvedObject"]["kind"] == "Node"]


def test_an_api_server_killed_mid_run_leaves_training_going(server: Any) -> None:
    """The server dies while the quarantine talks to it (its first request, held 1 s, is
    the moment): the quarantine fails and says so; training runs to its last step."""
    server.delay("GET", "/api/v1/nodes", 1.0, times=1)

    def kill_at_first_request() -> None:
        deadline = time.monotonic() + scaled(120)
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        server.stop()

    killer = threading.Thread(target=kill_at_first_request, daemon=True)
    killer.start()
    res = run_ranks(workers.guarded_run, 3, 8, WEIGHT_FLIP, NO_REPAIR, "adamw", False,
                    _quarantine(server, dry_run=False, retries=2, deadline_s=1.0,
                                request_timeout_s=3.0))
    killer.join(scaled(5))
    assert server.requests, "the quarantine never reached the server"
    assert all(r["steps_run"] == 8 for r in res)
    assert all(r["detections"][0] == ("weights", 3, (1,)) for r in res)
    assert {a["action"] for a in res[0]["actions"]} == {"error"}
    assert "Connection refused" in res[0]["actions"][0]["detail"]


def test_a_hanging_api_server_does_not_slow_the_steps(server: Any) -> None:
    server.delay("GET", "/api/v1/nodes", 30.0, times=100)
    res = run_ranks(workers.guarded_run, 3, 10, WEIGHT_FLIP, NO_REPAIR, "adamw", False,
                    _quarantine(server, dry_run=False, request_timeout_s=1.0, retries=1,
                                deadline_s=0.5))
    assert all(r["steps_run"] == 10 for r in res)
    after = [t for r in res for t in r["step_s"][4:]]
    assert max(after) < 1.0, f"a step waited for the API server: {max(after):.2f} s"
    assert not server.node("gpu-b")["spec"].get("unschedulable")
