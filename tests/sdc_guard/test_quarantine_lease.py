"""The breaker's count shared by every writer of a job through a ``coordination.k8s.io/v1``
Lease: the stand-in serves Leases as the real server does (create 409 on a taken name, update
409 on a stale resourceVersion, get 404), and two KubeQuarantine instances of one job never
cordon more nodes than the limits allow, whatever their timing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from kube_standin import StandInAPIServer
from sdc_guard import Detection
from sdc_guard.remediation import KubeQuarantine
from sdc_guard.remediation.lease import held_in, lease_name
from sdc_guard.topology import RankPlace, Topology
from tests.launch import scaled

NODES = ("n0", "n1", "n2", "n3")
TOPO = Topology(tuple(RankPlace(r, f"h{r}", n, pod=f"pod-{r}", namespace="ml")
                      for r, n in enumerate(NODES)))


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[Any]:
    with StandInAPIServer() as s:
        s.add_namespace("ml")
        for n in NODES:
            s.add_node(n)
        s.kubeconfig = s.write_kubeconfig(tmp_path / "kubeconfig")  # type: ignore[attr-defined]
        yield s


def _leases(srv: Any) -> Any:
    return kubernetes.client.CoordinationV1Api(
        kubernetes.config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(srv.kubeconfig)))


def _body(name: str = "l1", rv: str | None = None, holder: str = "a") -> dict[str, Any]:
    md: dict[str, Any] = {"name": name}
    if rv is not None:
        md["resourceVersion"] = rv
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": md,
            "spec": {"holderIdentity": holder}}


def _message(info: pytest.ExceptionInfo[ApiException]) -> str:
    return str(json.loads(info.value.body or "{}").get("message", ""))


# -- the stand-in's Leases -----------------------------------------------------------------------
def test_lease_get_404_create_409_on_exists(srv: Any) -> None:
    api = _leases(srv)
    with pytest.raises(ApiException) as info:
        api.read_namespaced_lease("l1", "ml")
    assert info.value.status == 404 and _message(info) == 'leases.coordination.k8s.io "l1" not found'
    made = api.create_namespaced_lease("ml", _body())
    assert made.metadata.resource_version and made.spec.holder_identity == "a"
    with pytest.raises(ApiException) as info:
        api.create_namespaced_lease("ml", _body(holder="b"))
    assert info.value.status == 409 and '"reason":"AlreadyExists"' in str(info.value.body)
    assert srv.lease("ml", "l1")["spec"]["holderIdentity"] == "a"
    with pytest.raises(ApiException) as info:
        api.create_namespaced_lease("nowhere", _body())
    assert info.value.status == 404 and _message(info) == 'namespaces "nowhere" not found'


def test_lease_update_409_on_a_stale_version_and_422_without_one(srv: Any) -> None:
    api = _leases(srv)
    rv = api.create_namespaced_lease("ml", _body()).metadata.resource_version
    newer = api.replace_namespaced_lease("l1", "ml", _body(rv=rv, holder="b"))
    assert newer.metadata.resource_version != rv
    with pytest.raises(ApiException) as info:
        api.replace_namespaced_lease("l1", "ml", _body(rv=rv, holder="c"))  # the old version
    assert info.value.status == 409 and '"reason":"Conflict"' in str(info.value.body)
    with pytest.raises(ApiException) as info:
        api.replace_namespaced_lease("l1", "ml", _body(holder="c"))
    assert info.value.status == 422 and "must be specified for an update" in str(info.value.body)
    with pytest.raises(ApiException) as info:
        api.replace_namespaced_lease("ghost", "ml", _body(name="ghost", rv=rv))
    assert info.value.status == 404
    assert srv.lease("ml", "l1")["spec"]["holderIdentity"] == "b"


def test_concurrent_lease_updates_with_one_version_one_wins(srv: Any) -> None:
    api = _leases(srv)
    rv = api.create_namespaced_lease("ml", _body()).metadata.resource_version
    statuses: list[int] = []
    start = threading.Barrier(4)

    def write(holder: str) -> None:
        start.wait()
        try:
            api.replace_namespaced_lease("l1", "ml", _body(rv=rv, holder=holder))
            statuses.append(200)
        except ApiException as e:
            statuses.append(int(e.status))

    threads = [threading.Thread(target=write, args=(h,)) for h in "wxyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(30))
    assert sorted(statuses) == [200, 409, 409, 409]


def test_lease_validation_and_dry_run(srv: Any) -> None:
    api = _leases(srv)
    bad = _body(name="Bad_Name")
    with pytest.raises(ApiException) as info:
        api.create_namespaced_lease("ml", bad)
    assert info.value.status == 422 and "metadata.name" in str(info.value.body)
    bad = _body()
    bad["spec"]["leaseDurationSeconds"] = 0
    with pytest.raises(ApiException) as info:
        api.create_namespaced_lease("ml", bad)
    assert info.value.status == 422 and "spec.leaseDurationSeconds" in str(info.value.body)
    api.create_namespaced_lease("ml", _body(), dry_run="All")
    assert srv.leases() == []


def test_leases_are_under_rbac(srv: Any) -> None:
    srv.forbid("update", "leases")
    api = _leases(srv)
    rv = api.create_namespaced_lease("ml", _body()).metadata.resource_version
    with pytest.raises(ApiException) as info:
        api.replace_namespaced_lease("l1", "ml", _body(rv=rv))
    assert info.value.status == 403
    assert ('cannot update resource "leases" in API group "coordination.k8s.io" in the '
            'namespace "ml"') in _message(info)


# -- the shared breaker --------------------------------------------------------------------------
def _q(srv: Any, **kw: Any) -> KubeQuarantine:
    args = {"kubeconfig": srv.kubeconfig, "dry_run": False, "job": "job-a", "max_nodes": 1,
            "max_fraction": 1.0, "backoff_s": 0.01, "request_timeout_s": 5.0, "deadline_s": 20.0,
            **kw}
    q = KubeQuarantine(**args)
    q.bind(topology=TOPO, rank=0)
    return q


def _det(rank: int) -> Detection:
    return Detection("weights", 7, (rank,), "fingerprints differ", {},
                     suspect_nodes=TOPO.nodes_of((rank,)))


def _cordoned(srv: Any) -> list[str]:
    return [n["metadata"]["name"] for n in srv.nodes() if n["spec"].get("unschedulable")]


def test_two_instances_of_one_job_cordon_one_node_when_max_nodes_is_one(srv: Any) -> None:
    """Both read the cluster before either writes (the lists' answers are held): without a shared
    count each would cordon its node. The Lease serialises them: one cordon, one breaker trip."""
    srv.delay("GET", r"^/api/v1/nodes$", 1.0, times=2)
    a, b = _q(srv), _q(srv)
    a.act(_det(1))
    b.act(_det(2))
    assert a.drain(30.0) and b.drain(30.0)
    actions = sorted(x.action for x in [*a.actions, *b.actions])
    assert actions == ["breaker", "cordon"], [x.to_json() for x in [*a.actions, *b.actions]]
    assert len(_cordoned(srv)) == 1
    lease = srv.lease("ml", lease_name("job-a"))
    assert list(held_in(lease)) == _cordoned(srv)


def test_a_lease_conflict_is_read_again_and_judged_again(srv: Any) -> None:
    """Another writer updates the Lease between our read and our write: ours is refused (409),
    we read it again, and the breaker judges with its count."""
    a, b = _q(srv), _q(srv)
    assert a.breaker is not None
    original = a.breaker.read
    done: list[bool] = []

    def read_then_other_writes(now: float) -> Any:
        got = original(now)
        if not done:
            done.append(True)
            b.act(_det(2))
            assert b.drain(30.0)
        return got

    a.breaker.read = read_then_other_writes  # type: ignore[method-assign]
    a.act(_det(1))
    assert a.drain(30.0)
    assert [x.action for x in b.actions] == ["cordon"]
    assert [x.action for x in a.actions] == ["breaker"]
    assert _cordoned(srv) == ["n2"]
    lease_writes = [r.status for r in srv.requests
                    if r.method in ("POST", "PUT") and "/leases" in r.path]
    assert 409 in lease_writes


def test_a_failed_cordon_gives_its_reservation_back(srv: Any) -> None:
    q = _q(srv)
    q.act(Detection("weights", 3, (1,), "", {}, suspect_nodes=("ghost",)))
    assert q.drain(30.0)
    assert [x.action for x in q.actions] == ["error"]
    assert held_in(srv.lease("ml", lease_name("job-a"))) == {}
    q.act(_det(1))
    assert q.drain(30.0)
    assert [x.action for x in q.actions] == ["error", "cordon"]


def test_without_lease_rights_nothing_is_cordoned_and_the_fix_is_named(srv: Any) -> None:
    srv.forbid("create", "leases")
    q = _q(srv)
    q.act(_det(1))
    assert q.drain(30.0)
    assert [x.action for x in q.actions] == ["error"]
    detail = q.actions[0].detail
    assert "'leases'" in detail and "Role in namespace 'ml'" in detail and "rbac.yaml" in detail
    assert _cordoned(srv) == []


def test_lease_names_are_valid_for_any_job() -> None:
    from kube_standin.validation import dns_subdomain_errors

    for job in ("job-a", "unnamed@host.example", "A" * 300, "x", "Job_With.Caps"):
        name = lease_name(job)
        assert dns_subdomain_errors(name) == [] and len(name) <= 253
    assert lease_name("a@b") != lease_name("a#b")
