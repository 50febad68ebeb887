"""The quarantine's stated bounds, end to end through the official client against the stand-in:
how long a failing call takes, that a cordon never depends on the evidence's size, that
``release`` touches only what sdc-guard added, and that a broken kubeconfig is named."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kube_standin import StandInAPIServer
from sdc_guard import Detection
from sdc_guard.__main__ import main as cli
from sdc_guard.remediation import KubeError, KubeQuarantine
from sdc_guard.remediation.api import NodeAPI, load_client, worst_case_s
from sdc_guard.remediation.evidence import EVIDENCE, EVIDENCE_LIMIT, MARKER, TAINT_KEY
from sdc_guard.topology import RankPlace, Topology

NODES = ("n0", "n1")
TOPO = Topology(tuple(RankPlace(r, f"h{r}", n, pod=f"pod-{r}", namespace="default")
                      for r, n in enumerate(NODES)))
SLACK = 3.0
"""A wall-clock bound is the stated value times this: the machine may be loaded."""


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[Any]:
    with StandInAPIServer() as s:
        for n in NODES:
            s.add_node(n)
        s.kubeconfig = s.write_kubeconfig(tmp_path / "kubeconfig")  # type: ignore[attr-defined]
        yield s


def _gets(srv: Any, path: str) -> int:
    return sum(1 for r in srv.requests if r.method == "GET" and r.path == path)


# -- time bounds ---------------------------------------------------------------------------------
def test_one_timeout_no_retries_is_one_request_of_that_timeout(srv: Any) -> None:
    """The client's own urllib3 retries are off: a hanging server costs request_timeout_s once."""
    srv.delay("GET", r"^/api/v1/nodes$", 30.0, times=10)
    api = NodeAPI(load_client(srv.kubeconfig), request_timeout_s=1.0, retries=0)
    start = time.monotonic()
    with pytest.raises(KubeError, match="after 1 attempts"):
        api.list()
    took = time.monotonic() - start
    assert took < SLACK * worst_case_s(1.0, 0, 0.5), took
    assert _gets(srv, "/api/v1/nodes") == 1


def test_a_failing_list_takes_at_most_the_stated_worst_case(srv: Any) -> None:
    """(retries + 1) requests, each cut at request_timeout_s, with the backoff between them."""
    timeout, retries, backoff = 0.5, 2, 0.1
    srv.delay("GET", r"^/api/v1/nodes$", 30.0, times=10)
    api = NodeAPI(load_client(srv.kubeconfig), request_timeout_s=timeout, retries=retries,
                  backoff_s=backoff)
    start = time.monotonic()
    with pytest.raises(KubeError, match="after 3 attempts"):
        api.list()
    took = time.monotonic() - start
    assert worst_case_s(timeout, retries, backoff) == pytest.approx(3 * 0.5 + 0.1 + 0.2)
    assert took < SLACK * worst_case_s(timeout, retries, backoff), took
    assert _gets(srv, "/api/v1/nodes") == retries + 1


def test_the_documented_default_worst_case_is_the_computed_one() -> None:
    """docs/quarantine.md states the defaults' worst case; it is what the formula gives."""
    doc = (Path(__file__).parents[2] / "docs" / "quarantine.md").read_text()
    assert f"{worst_case_s(5.0, 4, 0.5):g} s" in doc  # KubeQuarantine's defaults
    assert f"{worst_case_s(10.0, 2, 0.5):g} s" in doc  # the CLI's defaults


def test_release_with_a_request_timeout_is_bounded(srv: Any, capsys: Any) -> None:
    srv.delay("GET", r"^/api/v1/nodes/n1$", 30.0, times=10)
    kc = ["--kubeconfig", str(srv.kubeconfig)]
    start = time.monotonic()
    assert cli(["quarantine", "release", "n1", "--request-timeout", "1", *kc]) == 1
    took = time.monotonic() - start
    assert took < SLACK * worst_case_s(1.0, 2, 0.5), took
    assert "get nodes 'n1' failed after 3 attempts" in capsys.readouterr().err
    start = time.monotonic()
    assert cli(["quarantine", "release", "n1", "--request-timeout", "1", "--retries", "0",
                *kc]) == 1
    assert time.monotonic() - start < SLACK * 1.0


# -- the evidence's size -------------------------------------------------------------------------
def test_a_detail_of_several_mib_still_cordons_and_taints(srv: Any) -> None:
    q = KubeQuarantine(kubeconfig=srv.kubeconfig, dry_run=False, job="job-a", max_nodes=1,
                       max_fraction=1.0, backoff_s=0.01, request_timeout_s=5.0, deadline_s=20.0)
    q.bind(topology=TOPO, rank=0)
    huge = "x" * (4 * 1024 * 1024)
    q.act(Detection("weights", 3, (1,), huge, {"blob": huge}, suspect_nodes=("n1",)))
    assert q.drain(20.0)
    assert [a.action for a in q.actions] == ["cordon"], [a.detail[:300] for a in q.actions]
    node = srv.node("n1")
    assert node["spec"]["unschedulable"] is True
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT_KEY]
    notes = node["metadata"]["annotations"]
    assert len(notes[EVIDENCE]) <= EVIDENCE_LIMIT and MARKER in notes
    entry = json.loads(notes[EVIDENCE])[-1]
    assert entry["step"] == 3 and entry["suspect_nodes"] == ["n1"] and "cut" in entry


def test_a_node_whose_annotations_are_full_is_still_cordoned(srv: Any) -> None:
    """Other tools' annotations leave no room for the evidence: the cordon and taint land, the
    evidence's failure is recorded beside it."""
    srv.bump("n1", lambda n: n["metadata"]["annotations"].update(
        {"example.com/blob": "y" * (256 * 1024 - 2000)}))
    q = KubeQuarantine(kubeconfig=srv.kubeconfig, dry_run=False, job="job-a", max_nodes=1,
                       max_fraction=1.0, backoff_s=0.01, request_timeout_s=5.0, deadline_s=20.0)
    q.bind(topology=TOPO, rank=0)
    q.act(Detection("weights", 3, (1,), "fingerprints differ", {"f": list(range(3000))},
                    suspect_nodes=("n1",)))
    assert q.drain(20.0)
    actions = [a.action for a in q.actions]
    assert "cordon" in actions, [a.to_json() for a in q.actions]
    node = srv.node("n1")
    assert node["spec"]["unschedulable"] is True
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT_KEY]
    assert "example.com/blob" in node["metadata"]["annotations"]


# -- release: only what we added -----------------------------------------------------------------
def _quarantine(srv: Any, node: str = "n1") -> None:
    q = KubeQuarantine(kubeconfig=srv.kubeconfig, dry_run=False, job="job-a", max_nodes=1,
                       max_fraction=1.0, backoff_s=0.01, request_timeout_s=5.0, deadline_s=10.0)
    q.bind(topology=TOPO, rank=0)
    q.act(Detection("weights", 3, (1,), "fingerprints differ", {}, suspect_nodes=(node,)))
    assert q.drain(10.0)
    assert [a.action for a in q.actions] == ["cordon"]


def test_release_keeps_another_tools_taint_with_our_key_and_another_effect(srv: Any) -> None:
    _quarantine(srv)
    theirs = {"key": TAINT_KEY, "value": "other-tool", "effect": "NoExecute"}
    srv.bump("n1", lambda n: n["spec"]["taints"].append(theirs))
    assert cli(["quarantine", "release", "n1", "--kubeconfig", str(srv.kubeconfig)]) == 0
    node = srv.node("n1")
    assert node["spec"]["taints"] == [theirs]
    assert not node["spec"].get("unschedulable")


def test_release_names_other_taints_and_can_keep_the_cordon(srv: Any, capsys: Any) -> None:
    """An administrator's cordon of a node we hold leaves no trace; release lists the node's
    other taints so the operator can tell, and ``--keep-cordon`` leaves it unschedulable."""
    _quarantine(srv)
    maint = {"key": "example.com/maintenance", "effect": "NoSchedule"}
    srv.bump("n1", lambda n: n["spec"]["taints"].append(maint))
    kc = ["--kubeconfig", str(srv.kubeconfig)]
    assert cli(["quarantine", "release", "n1", "--keep-cordon", *kc]) == 0
    out = capsys.readouterr().out
    assert "example.com/maintenance" in out and "stays cordoned" in out
    node = srv.node("n1")
    assert node["spec"]["unschedulable"] is True and node["spec"]["taints"] == [maint]


# -- the kubeconfig ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, why", [
    ("clusters: [unclosed\n", "not valid YAML"),
    ("apiVersion: v1\nkind: Config\ncurrent-context: nowhere\ncontexts: []\n", "nowhere"),
    ("- just\n- a list\n", "not a mapping"),
])
def test_a_malformed_kubeconfig_is_a_named_one_line_error(tmp_path: Path, text: str,
                                                         why: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(KubeError) as info:
        load_client(path)
    message = str(info.value)
    assert str(path) in message and why in message and "\n" not in message


def test_the_cli_reports_a_malformed_kubeconfig_in_one_line(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text("clusters: [unclosed\n")
    assert cli(["quarantine", "list", "--kubeconfig", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: kubeconfig") and str(path) in err and err.count("\n") == 1
