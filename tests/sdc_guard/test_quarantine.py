"""KubeQuarantine and ``python -m sdc_guard quarantine`` in one process, through the official
client over HTTP, against the loopback stand-in (``kube_standin``): the error paths,
idempotence, the rate limit, the breaker across a restart, ownership on release."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kube_standin import StandInAPIServer
from sdc_guard import Detection
from sdc_guard.__main__ import main as cli
from sdc_guard.remediation import KubeQuarantine
from sdc_guard.remediation.evidence import EVIDENCE, HISTORY, MARKER, TAINT_KEY, parse_entries
from sdc_guard.topology import RankPlace, Topology

NODES = ("n0", "n1", "n2", "n3")
TOPO = Topology(tuple(RankPlace(r, f"h{r}", n, pod=f"pod-{r}", namespace="ml")
                      for r, n in enumerate(NODES)))
OTHER = {"key": "example.com/gpu-maint", "value": "x", "effect": "PreferNoSchedule"}


class _Server(StandInAPIServer):
    """The stand-in, with the kubeconfig the fixture wrote for it."""

    kubeconfig: Path


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[Any]:
    with _Server() as s:
        s.add_namespace("ml")  # the pods' namespace: the breaker's Lease lives there
        for n in NODES:
            s.add_node(n, taints=[OTHER])
        s.kubeconfig = s.write_kubeconfig(tmp_path / "kubeconfig")
        yield s


def _q(srv: Any, rank: int = 0, **kw: Any) -> KubeQuarantine:
    args = {"kubeconfig": srv.kubeconfig, "dry_run": False, "job": "job-a", "max_nodes": 2,
            "max_fraction": 1.0, "backoff_s": 0.01, "request_timeout_s": 2.0, "deadline_s": 10.0,
            **kw}
    q = KubeQuarantine(**args)
    q.bind(topology=TOPO, rank=rank)
    return q


def _det(*ranks: int, step: int = 7, check: str = "weights") -> Detection:
    return Detection(check, step, ranks, "fingerprints differ", {"fingerprints": [1, 2, 3, 4]},
                     suspect_nodes=TOPO.nodes_of(ranks))


def _run(q: KubeQuarantine, *ds: Detection) -> list[str]:
    for d in ds:
        q.act(d)
    assert q.drain(10.0)
    return [a.action for a in q.actions]


def _ours(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for t in node["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


def test_second_detection_appends_evidence_without_a_second_taint(srv: Any) -> None:
    q = _q(srv, evidence_interval_s=0.0)
    assert _run(q, _det(1), _det(1, step=9)) == ["cordon", "evidence"]
    node = srv.node("n1")
    assert len(_ours(node)) == 1 and OTHER in node["spec"]["taints"]
    _, entries = parse_entries(node["metadata"]["annotations"][EVIDENCE])
    assert [e["step"] for e in entries] == [7, 9]


def test_evidence_is_rate_limited_and_written_on_close(srv: Any) -> None:
    q = _q(srv, evidence_interval_s=3600.0)
    assert _run(q, _det(1), _det(1, step=8), _det(1, step=9)) == ["cordon"]
    writes = [r for r in srv.requests if r.method == "PATCH"]
    assert len(writes) == 1
    q.close(10.0)
    _, entries = parse_entries(srv.node("n1")["metadata"]["annotations"][EVIDENCE])
    assert [e["step"] for e in entries] == [7, 8, 9]
    assert [a.action for a in q.actions] == ["cordon", "evidence"]


def test_a_node_changed_between_read_and_write_is_read_again(srv: Any) -> None:
    srv.fail("PATCH", "/api/v1/nodes/n1", 409, times=2)
    q = _q(srv)
    assert _run(q, _det(1)) == ["cordon"]
    assert srv.node("n1")["spec"]["unschedulable"] is True


def test_a_real_version_conflict_keeps_the_other_writers_change(srv: Any) -> None:
    """A kubelet-like writer changes the node after our read: the server refuses our write
    (409), we read again, and both changes survive."""
    q = _q(srv)
    seen: list[str] = []
    original = q.api.get

    def get_then_bump(name: str) -> dict[str, Any]:
        node = original(name)
        if not seen:
            seen.append(name)
            srv.bump(name)
        return node

    q.api.get = get_then_bump  # type: ignore[method-assign]
    assert _run(q, _det(2)) == ["cordon"]
    statuses = [r.status for r in srv.requests if r.method == "PATCH"]
    assert statuses == [409, 200]


def test_server_errors_are_retried(srv: Any) -> None:
    srv.fail("PATCH", "/api/v1/nodes/n1", 500, times=2)
    assert _run(_q(srv), _det(1)) == ["cordon"]


def test_forbidden_names_the_verb_and_resource(srv: Any) -> None:
    srv.forbid("patch", "nodes")
    q = _q(srv)
    assert _run(q, _det(1)) == ["error"]
    detail = q.actions[0].detail
    assert "'patch'" in detail and "'nodes'" in detail and "deploy/rbac.yaml" in detail


def test_a_missing_node_is_named(srv: Any) -> None:
    q = _q(srv)
    d = Detection("weights", 3, (1,), "", {}, suspect_nodes=("ghost",))
    assert _run(q, d) == ["error"]
    assert "'ghost' not found" in q.actions[0].detail


def test_the_breaker_survives_a_restart(srv: Any) -> None:
    """A job restarted after a quarantine counts the nodes it took from their markers."""
    assert _run(_q(srv, max_nodes=1), _det(1)) == ["cordon"]
    again = _q(srv, max_nodes=1)  # a new process of the same job
    assert _run(again, _det(2)) == ["breaker"]
    assert not srv.node("n2")["spec"].get("unschedulable")
    other_job = _q(srv, max_nodes=1, job="job-b")
    assert _run(other_job, _det(2)) == ["cordon"]


def test_a_repeat_on_a_held_node_is_evidence_not_a_breaker_trip(srv: Any) -> None:
    q = _q(srv, max_nodes=1, evidence_interval_s=0.0)
    assert _run(q, _det(1), _det(1, step=9)) == ["cordon", "evidence"]


def test_list_show_release(srv: Any, capsys: Any) -> None:
    assert _run(_q(srv), _det(1)) == ["cordon"]
    kc = ["--kubeconfig", str(srv.kubeconfig)]
    assert cli(["quarantine", "list", *kc]) == 0
    out = capsys.readouterr().out
    assert "n1" in out and "job-a" in out and "weights@7" in out and "n2" not in out
    assert cli(["quarantine", "show", "n1", *kc]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["marker"]["job"] == "job-a" and shown["evidence"][0]["step"] == 7
    assert cli(["quarantine", "release", "n1", "--dry-run", *kc]) == 0
    assert srv.node("n1")["spec"]["unschedulable"] is True  # dry run stored nothing
    assert cli(["quarantine", "release", "n1", "--reason", "ECC clean", *kc]) == 0
    node = srv.node("n1")
    assert not node["spec"].get("unschedulable")
    assert node["spec"]["taints"] == [OTHER]
    notes = node["metadata"]["annotations"]
    assert MARKER not in notes and EVIDENCE not in notes
    _, history = parse_entries(notes[HISTORY])
    assert history[0]["kind"] == "release" and history[0]["reason"] == "ECC clean"
    assert history[0]["evidence"][0]["step"] == 7
    assert cli(["quarantine", "release", "n1", *kc]) == 2  # not ours any more
    assert "not quarantined by sdc-guard" in capsys.readouterr().err


def test_release_refuses_a_node_someone_else_cordoned_first(srv: Any, capsys: Any) -> None:
    srv.add_node("busy", unschedulable=True)
    q = _q(srv)
    d = Detection("replay", 4, (1,), "", {}, suspect_nodes=("busy",))
    assert _run(q, d) == ["cordon"]
    assert json.loads(srv.node("busy")["metadata"]["annotations"][MARKER])[
        "already_unschedulable"] is True
    kc = ["--kubeconfig", str(srv.kubeconfig)]
    assert cli(["quarantine", "release", "busy", *kc]) == 2
    assert "cordoned before sdc-guard" in capsys.readouterr().err
    assert cli(["quarantine", "release", "busy", "--force", *kc]) == 0
    node = srv.node("busy")
    assert node["spec"]["unschedulable"] is True and not _ours(node)


def test_cli_errors_are_one_line(srv: Any, capsys: Any) -> None:
    assert cli(["quarantine", "show", "ghost", "--kubeconfig", str(srv.kubeconfig)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 404: node 'ghost' not found")
    assert cli(["quarantine", "list", "--kubeconfig", "/nonexistent/kubeconfig"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_fraction"):
        KubeQuarantine(max_fraction=2.0, kubeconfig="/nonexistent")
    with pytest.raises(ValueError, match="dry_run"):
        KubeQuarantine(dry_run="yes", kubeconfig="/nonexistent")  # type: ignore[arg-type]


def test_restart_codes_say_restart_after_a_quarantine_and_stop_when_none_held(srv: Any) -> None:
    # The acting rank said 1 when it could not quarantine: not the documented permanent code.
    from sdc_guard import EXIT_CONVICTED, EXIT_QUARANTINED

    q = _q(srv, max_nodes=1, dry_run=False)
    first = _det(1)
    assert _run(q, first) == ["cordon"]
    assert q.restart_code([first]) == EXIT_QUARANTINED
    second = _det(2, step=9)
    assert _run(q, second) == ["cordon", "breaker"]  # the breaker keeps n2 in service
    assert q.restart_code([second]) == EXIT_CONVICTED
    assert _q(srv, rank=1, dry_run=False).restart_code([second]) == EXIT_QUARANTINED
    assert q.restart_code([]) is None  # nothing convicted: train on
