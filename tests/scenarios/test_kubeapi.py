"""The Kubernetes API server stand-in, driven by the official ``kubernetes`` client over HTTP (no mocks).

What is asserted is what a real kube-apiserver answers (status codes, Status reasons and messages,
merge-patch list semantics, optimistic concurrency, dry run), because code tested against the
stand-in must behave the same against a cluster. A strategic-merge patch is answered 415 (the
product never sends one; see ``kube_standin``).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("jsonpatch")

import urllib3  # noqa: E402 - after the skips: the client and urllib3 come together
from kubernetes.client.exceptions import ApiException  # noqa: E402

from kube_standin import StandInAPIServer  # noqa: E402

MERGE = "application/merge-patch+json"
SMP = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
OTHER_TAINT = {"key": "example.com/maintenance", "effect": "NoSchedule"}
OUR_TAINT = {"key": "sdc-guard.io/quarantine", "value": "sdc", "effect": "NoSchedule"}


@pytest.fixture
def srv() -> Iterator[StandInAPIServer]:
    with StandInAPIServer() as s:
        s.add_node("n1", labels={"pool": "gpu"}, taints=[OTHER_TAINT])
        s.add_node("n2", labels={"pool": "cpu"})
        s.add_node("n3")
        yield s


def _api(srv: StandInAPIServer, tmp_path: Path, name: str = "kubeconfig") -> Any:
    config = kubernetes.config.new_client_from_config(config_file=str(srv.write_kubeconfig(tmp_path / name)))
    return kubernetes.client.CoreV1Api(config)


@pytest.fixture
def api(srv: StandInAPIServer, tmp_path: Path) -> Any:
    return _api(srv, tmp_path)


def _status(info: pytest.ExceptionInfo[ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(info.value.body or "")
    assert body["kind"] == "Status" and body["apiVersion"] == "v1" and body["status"] == "Failure"
    assert body["code"] == info.value.status
    return body


def _raw(srv: StandInAPIServer, method: str, path: str, body: Any = None, *,
         content_type: str = "application/json", token: str | None = "test-token") -> tuple[int, Any, Any]:
    """A request without the client: (status, parsed body, headers)."""
    headers = {"Content-Type": content_type}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


# -- connecting -----------------------------------------------------------------------------------
def test_kubeconfig_loads_with_both_loaders(srv: StandInAPIServer, tmp_path: Path) -> None:
    path = srv.write_kubeconfig(tmp_path / "sub" / "kubeconfig")
    assert path.exists()
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(path), client_configuration=cfg)
    assert cfg.host == srv.url == f"http://127.0.0.1:{srv.port}"
    core = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(cfg))
    assert [n.metadata.name for n in core.list_node().items] == ["n1", "n2", "n3"]


def test_missing_or_wrong_token_is_401(srv: StandInAPIServer, tmp_path: Path) -> None:
    code, body, _ = _raw(srv, "GET", "/api/v1/nodes", token=None)
    assert (code, body["reason"], body["message"]) == (401, "Unauthorized", "Unauthorized")
    assert "details" not in body
    other = StandInAPIServer(token="other")  # a kubeconfig carrying the wrong token
    try:
        path = other.write_kubeconfig(tmp_path / "wrong")
        path.write_text(path.read_text().replace(other.url, srv.url))
        core = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(config_file=str(path)))
        with pytest.raises(ApiException) as info:
            core.read_node("n1")
        assert _status(info)["reason"] == "Unauthorized" and info.value.status == 401
    finally:
        other.stop()


# -- reading --------------------------------------------------------------------------------------
def test_read_node_has_kubelet_shape(api: Any, srv: StandInAPIServer) -> None:
    node = api.read_node("n1")
    assert (node.kind, node.api_version, node.metadata.name) == ("Node", "v1", "n1")
    assert node.metadata.uid and node.metadata.creation_timestamp is not None
    assert node.metadata.resource_version.isdigit()
    assert node.metadata.labels["kubernetes.io/hostname"] == "n1" and node.metadata.labels["pool"] == "gpu"
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert len(ready) == 1 and ready[0].status == "True" and ready[0].reason == "KubeletReady"
    assert node.spec.taints[0].key == OTHER_TAINT["key"]
    assert srv.node("n1")["metadata"]["uid"] == node.metadata.uid
    assert node.spec.unschedulable is None  # false is omitted on the wire (omitempty)


def test_missing_node_is_404_with_details(api: Any) -> None:
    with pytest.raises(ApiException) as info:
        api.read_node("ghost")
    body = _status(info)
    assert info.value.status == 404 and body["reason"] == "NotFound"
    assert body["message"] == 'nodes "ghost" not found'
    assert body["details"] == {"name": "ghost", "kind": "nodes"}


def test_list_with_label_and_field_selectors(api: Any, srv: StandInAPIServer) -> None:
    def names(**kw: Any) -> list[str]:
        return [n.metadata.name for n in api.list_node(**kw).items]

    listed = api.list_node()
    assert listed.metadata.resource_version.isdigit() and names() == ["n1", "n2", "n3"]
    assert names(label_selector="pool=gpu") == ["n1"]
    assert names(label_selector="pool==cpu") == ["n2"]
    assert names(label_selector="pool") == ["n1", "n2"]
    assert names(label_selector="!pool") == ["n3"]
    assert names(label_selector="pool!=gpu") == ["n2", "n3"]
    assert names(label_selector="pool in (gpu, cpu),kubernetes.io/os=linux") == ["n1", "n2"]
    assert names(label_selector="pool notin (gpu)") == ["n2", "n3"]
    assert names(field_selector="metadata.name=n2") == ["n2"]
    assert names(field_selector="metadata.name!=n2") == ["n1", "n3"]
    with pytest.raises(ApiException) as info:
        api.list_node(field_selector="status.phase=Running")
    assert info.value.status == 400 and _status(info)["message"] == "field label not supported: status.phase"
    first = api.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n1", "n2"]
    assert first.metadata.remaining_item_count == 1
    rest = api.list_node(limit=2, _continue=first.metadata._continue)
    assert [n.metadata.name for n in rest.items] == ["n3"] and not rest.metadata._continue
    code, body, _ = _raw(srv, "GET", "/api/v1/nodes")
    assert code == 200 and body["kind"] == "NodeList" and "kind" not in body["items"][0]


def test_unknown_path_and_verb(srv: StandInAPIServer) -> None:
    code, body, headers = _raw(srv, "GET", "/api/v1/pods")
    assert code == 404 and headers["Content-Type"] == "application/json"
    assert body["message"] == "the server could not find the requested resource" and body["details"] == {}
    code, body, _ = _raw(srv, "DELETE", "/api/v1/nodes/n1")
    assert (code, body["reason"]) == (405, "MethodNotAllowed")


# -- the patch types ------------------------------------------------------------------------------
def test_merge_patch_maps_merge_null_deletes_lists_replace(api: Any, srv: StandInAPIServer) -> None:
    before = srv.node("n1")
    out = api.patch_node("n1", {"metadata": {"labels": {"pool": None, "rack": "r7"}},
                                "spec": {"podCIDRs": before["spec"]["podCIDRs"]}}, _content_type=MERGE)
    assert "pool" not in out.metadata.labels and out.metadata.labels["rack"] == "r7"
    assert out.metadata.labels["kubernetes.io/hostname"] == "n1"
    assert int(out.metadata.resource_version) > int(before["metadata"]["resourceVersion"])
    assert srv.node("n1")["metadata"]["labels"]["rack"] == "r7"
    assert srv.requests[-1].content_type == MERGE and srv.requests[-1].status == 200


def test_a_merge_patch_of_our_taint_alone_drops_the_others(api: Any, srv: StandInAPIServer) -> None:
    # A list in a merge patch replaces the stored one: sending only our taint drops the one
    # another tool set (what a test of the quarantine must be able to catch).
    out = api.patch_node("n1", {"spec": {"taints": [OUR_TAINT]}}, _content_type=MERGE)
    assert [t.key for t in out.spec.taints] == [OUR_TAINT["key"]]
    assert [t["key"] for t in srv.node("n1")["spec"]["taints"]] == [OUR_TAINT["key"]]


def test_a_strategic_merge_patch_is_415_and_changes_nothing(api: Any, srv: StandInAPIServer) -> None:
    before = srv.node("n1")
    for patch_node in (api.patch_node, api.patch_node_status):
        with pytest.raises(ApiException) as info:
            patch_node("n1", {"spec": {"taints": [OUR_TAINT]}}, _content_type=SMP)
        body = _status(info)
        assert info.value.status == 415 and body["reason"] == "UnsupportedMediaType"
        assert body["message"] == ("the body of the request was in an unknown format - accepted media "
                                   f"types include: {JSON_PATCH}, {MERGE}")
        assert srv.requests[-1].content_type == SMP and srv.requests[-1].status == 415
    assert srv.node("n1") == before


def test_merge_patch_with_the_full_list_keeps_other_taints(api: Any, srv: StandInAPIServer) -> None:
    node = api.read_node("n1")
    taints = [{"key": t.key, "effect": t.effect} for t in node.spec.taints] + [OUR_TAINT]
    out = api.patch_node("n1", {"metadata": {"resourceVersion": node.metadata.resource_version},
                                "spec": {"taints": taints}}, _content_type=MERGE)
    assert [t.key for t in out.spec.taints] == [OTHER_TAINT["key"], OUR_TAINT["key"]]
    assert out.spec.taints[1].value == "sdc"
    # Emptying the list removes the key altogether, as Go's omitempty does: clients must expect None.
    cleared = api.patch_node("n1", {"spec": {"taints": []}}, _content_type=MERGE)
    assert cleared.spec.taints is None and "taints" not in srv.node("n1")["spec"]


def test_the_status_is_written_through_its_subresource_only(api: Any, srv: StandInAPIServer) -> None:
    cond = {"type": "SDCSuspect", "status": "True", "reason": "Fingerprint", "message": "rank 3"}
    add = [{"op": "add", "path": "/status/conditions/-", "value": cond}]
    out = api.patch_node_status("n1", add, _content_type=JSON_PATCH)
    assert [c.type for c in out.status.conditions] == ["MemoryPressure", "DiskPressure", "PIDPressure",
                                                       "Ready", "SDCSuspect"]
    # ... and never the spec (nodeStrategy.PrepareForUpdate for /status).
    spec = api.patch_node_status("n1", [{"op": "add", "path": "/spec/unschedulable", "value": True}],
                                 _content_type=JSON_PATCH)
    assert spec.spec.unschedulable is None
    assert spec.metadata.resource_version == out.metadata.resource_version  # a no-op is not written
    # Through the main resource the status is not writable: the patch changes nothing.
    drop = [{"op": "remove", "path": "/status/conditions/4"}]
    same = api.patch_node("n1", drop, _content_type=JSON_PATCH)
    assert "SDCSuspect" in [c.type for c in same.status.conditions]
    assert same.metadata.resource_version == out.metadata.resource_version
    assert srv.node("n1")["status"]["conditions"][-1]["type"] == "SDCSuspect"


def test_json_patch_applies_and_a_failed_test_is_422(api: Any, srv: StandInAPIServer) -> None:
    rv = srv.node("n1")["metadata"]["resourceVersion"]
    out = api.patch_node("n1", [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                                {"op": "add", "path": "/spec/unschedulable", "value": True}],
                         _content_type=JSON_PATCH)
    assert out.spec.unschedulable is True
    before = srv.node("n1")
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", [{"op": "test", "path": "/metadata/resourceVersion", "value": rv},
                              {"op": "add", "path": "/spec/unschedulable", "value": False}],
                       _content_type=JSON_PATCH)
    body = _status(info)
    assert info.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == "the server rejected our request due to an error in our request"
    assert srv.node("n1") == before


def test_unsupported_content_type_is_415(api: Any, srv: StandInAPIServer) -> None:
    for content_type in ("application/json", "application/apply-patch+yaml"):
        with pytest.raises(ApiException) as info:
            api.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=content_type)
        body = _status(info)
        assert info.value.status == 415 and body["reason"] == "UnsupportedMediaType"
        assert body["message"].startswith("the body of the request was in an unknown format - accepted media "
                                          "types include: application/json-patch+json")
    assert srv.node("n1")["spec"].get("unschedulable") is None


def test_unknown_fields_are_dropped_with_a_warning(srv: StandInAPIServer) -> None:
    code, body, headers = _raw(srv, "PATCH", "/api/v1/nodes/n1", {"spec": {"unschedulabel": True}},
                               content_type=MERGE)
    assert code == 200 and "unschedulabel" not in body["spec"]
    assert headers.get_all("Warning") == ['299 - "unknown field \\"spec.unschedulabel\\""']
    code, body, _ = _raw(srv, "PATCH", "/api/v1/nodes/n1?fieldValidation=Strict",
                         {"spec": {"unschedulabel": True}}, content_type=MERGE)
    assert code == 422 and "strict decoding error" in body["message"]


# -- concurrency, dry run, validation ----------------------------------------------------------------
def test_stale_resource_version_is_409_after_bump(api: Any, srv: StandInAPIServer) -> None:
    rv = api.read_node("n1").metadata.resource_version
    bumped = srv.bump("n1")  # e.g. a kubelet heartbeat
    assert int(bumped["metadata"]["resourceVersion"]) > int(rv)
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"metadata": {"resourceVersion": rv}, "spec": {"unschedulable": True}},
                       _content_type=MERGE)
    body = _status(info)
    assert info.value.status == 409 and body["reason"] == "Conflict"
    assert body["message"] == ('Operation cannot be fulfilled on nodes "n1": the object has been modified; '
                               "please apply your changes to the latest version and try again")
    assert body["details"] == {"name": "n1", "kind": "nodes"}
    # Another tool's taint arriving behind our back, then a patch with the fresh version succeeds.
    srv.bump("n1", lambda n: n["spec"]["taints"].append({"key": "third.io/x", "effect": "NoExecute"}))
    fresh = api.read_node("n1")
    out = api.patch_node("n1", {"metadata": {"resourceVersion": fresh.metadata.resource_version},
                                "spec": {"unschedulable": True}}, _content_type=MERGE)
    assert out.spec.unschedulable is True and len(out.spec.taints) == 2


def test_concurrent_writers_with_the_same_version_one_wins(api: Any, srv: StandInAPIServer) -> None:
    rv = srv.node("n3")["metadata"]["resourceVersion"]

    def attempt(i: int) -> int:
        try:
            api.patch_node("n3", {"metadata": {"resourceVersion": rv, "labels": {"writer": str(i)}}},
                           _content_type=MERGE)
            return 200
        except ApiException as e:
            return int(e.status or 0)

    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(attempt, range(8)))
    assert sorted(codes) == [200] + [409] * 7
    assert srv.node("n3")["metadata"]["labels"]["writer"] == str(codes.index(200))


def test_dry_run_all_validates_and_returns_but_stores_nothing(api: Any, srv: StandInAPIServer) -> None:
    before = srv.node("n1")
    out = api.patch_node("n1", {"spec": {"unschedulable": True, "taints": [OTHER_TAINT, OUR_TAINT]}},
                         dry_run="All", _content_type=MERGE)
    assert out.spec.unschedulable is True and len(out.spec.taints) == 2
    assert out.metadata.resource_version == before["metadata"]["resourceVersion"]
    assert srv.node("n1") == before
    assert srv.requests[-1].dry_run and srv.requests[-1].query["dryRun"] == "All"
    with pytest.raises(ApiException) as info:  # validation still runs
        api.patch_node("n1", {"spec": {"taints": [{"key": "k", "effect": "Sometimes"}]}}, dry_run="All",
                       _content_type=MERGE)
    assert info.value.status == 422


def test_bad_dry_run_value_is_rejected_like_the_real_server(api: Any, srv: StandInAPIServer) -> None:
    # ValidatePatchOptions makes this a 422 on PatchOptions, not a 400.
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"spec": {"unschedulable": True}}, dry_run="Server", _content_type=MERGE)
    body = _status(info)
    assert info.value.status == 422 and body["reason"] == "Invalid"
    assert body["message"] == ('PatchOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: '
                               '["Server"]: supported values: "All"')
    assert srv.node("n1")["spec"].get("unschedulable") is None


def test_taint_validation(api: Any) -> None:
    # The real server reports node taint errors under metadata.taints (validateNodeTaints' field path).
    cases = [
        ([{"key": "a"}], "metadata.taints[0].effect: Required value"),
        ([{"key": "a", "effect": "Sometimes"}],
         'metadata.taints[0].effect: Unsupported value: "Sometimes": supported values: "NoSchedule", '
         '"PreferNoSchedule", "NoExecute"'),
        ([{"key": "a", "effect": "NoSchedule"}, {"key": "a", "value": "v", "effect": "NoSchedule"}],
         'metadata.taints[1]: Duplicate value: {"Key":"a","Value":"v","Effect":"NoSchedule",'
         '"TimeAdded":null}: taints must be unique by key and effect pair'),
        ([{"key": "", "effect": "NoSchedule"}],
         '[metadata.taints[0].key: Invalid value: "": name part must be non-empty, '),
    ]
    for taints, expected in cases:
        with pytest.raises(ApiException) as info:
            api.patch_node("n1", {"spec": {"taints": taints}}, _content_type=MERGE)
        body = _status(info)
        assert info.value.status == 422 and body["reason"] == "Invalid"
        assert body["message"].startswith(f'Node "n1" is invalid: {expected}'), body["message"]
        assert body["details"]["kind"] == "Node" and body["details"]["name"] == "n1"


def test_annotation_size_limit(api: Any, srv: StandInAPIServer) -> None:
    existing = srv.node("n1")["metadata"]["annotations"]
    used = sum(len(k) + len(v) for k, v in existing.items())
    room = 262144 - used - len("big")
    out = api.patch_node("n1", {"metadata": {"annotations": {"big": "x" * room}}}, _content_type=MERGE)
    assert len(out.metadata.annotations["big"]) == room  # exactly at the limit is accepted
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"metadata": {"annotations": {"big": "x" * (room + 1)}}}, _content_type=MERGE)
    body = _status(info)
    assert info.value.status == 422
    assert body["message"] == 'Node "n1" is invalid: metadata.annotations: Too long: may not be more than ' \
                              "262144 bytes"
    with pytest.raises(ApiException) as info:
        api.patch_node("n2", {"metadata": {"annotations": {"bad key!": "v"}}}, _content_type=MERGE)
    assert info.value.status == 422
    assert _status(info)["message"].startswith('Node "n2" is invalid: metadata.annotations: Invalid value: '
                                               '"bad key!": name part must consist of alphanumeric')


def test_name_is_checked_and_uid_is_immutable(api: Any, srv: StandInAPIServer) -> None:
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"metadata": {"name": "n9"}}, _content_type=MERGE)
    assert info.value.status == 400
    assert _status(info)["message"] == "the name of the object (n9) does not match the name on the URL (n1)"
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"metadata": {"uid": "0000"}}, _content_type=MERGE)
    assert info.value.status == 422
    assert 'metadata.uid: Invalid value: "0000": field is immutable' in _status(info)["message"]
    created = srv.node("n1")["metadata"]["creationTimestamp"]
    out = api.patch_node("n1", {"metadata": {"creationTimestamp": "2001-01-01T00:00:00Z"}},
                         _content_type=MERGE)
    assert out.metadata.creation_timestamp.strftime("%Y-%m-%dT%H:%M:%SZ") == created  # silently kept


# -- RBAC and injected faults -------------------------------------------------------------------------
def test_forbid_is_403_with_the_rbac_message(api: Any, srv: StandInAPIServer) -> None:
    srv.forbid("patch", "nodes")
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
    body = _status(info)
    assert info.value.status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == ('nodes "n1" is forbidden: User "system:serviceaccount:default:sdc-guard" '
                               'cannot patch resource "nodes" in API group "" at the cluster scope')
    api.read_node("n1")  # other verbs still allowed
    srv.forbid("create", "events")
    with pytest.raises(ApiException) as info:
        api.create_namespaced_event("default", {"metadata": {"generateName": "x."}, "involvedObject": {}})
    assert _status(info)["message"] == ('events is forbidden: User "system:serviceaccount:default:sdc-guard" '
                                        'cannot create resource "events" in API group "" in the namespace '
                                        '"default"')
    srv.allow("patch", "nodes")
    assert api.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE).spec.unschedulable


def test_fail_once_then_succeed(api: Any, srv: StandInAPIServer) -> None:
    srv.fail("PATCH", r"/api/v1/nodes/n1$", 500)
    with pytest.raises(ApiException) as info:
        api.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE)
    body = _status(info)
    assert info.value.status == 500 and body["reason"] == "InternalError"
    assert srv.node("n1")["spec"].get("unschedulable") is None  # a failed request is not applied
    assert api.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE).spec.unschedulable
    srv.fail("GET", "/nodes/", 503, times=2, message="etcd is down")
    for _ in range(2):
        with pytest.raises(ApiException) as info:
            api.read_node("n2")
        assert info.value.status == 503 and _status(info)["message"] == "etcd is down"
    api.read_node("n2")
    assert [r.status for r in srv.requests[-3:]] == [503, 503, 200]


def test_delay_beyond_the_client_timeout(api: Any, srv: StandInAPIServer) -> None:
    srv.delay("PATCH", r"/nodes/n1$", 1.0)
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        api.patch_node("n1", {"spec": {"unschedulable": True}}, _content_type=MERGE, _request_timeout=0.2)
    assert time.monotonic() - start < 0.9
    assert srv.node("n1")["spec"]["unschedulable"] is True  # processed: only the answer was late
    # urllib3 retries an idempotent GET after a read timeout: with every try delayed it gives up.
    srv.delay("GET", r"/nodes/n2$", 1.0, times=4)
    with pytest.raises((urllib3.exceptions.ReadTimeoutError, urllib3.exceptions.MaxRetryError)):
        api.read_node("n2", _request_timeout=0.1)


# -- events --------------------------------------------------------------------------------------------
def test_create_event_and_dry_run(api: Any, srv: StandInAPIServer) -> None:
    uid = srv.node("n1")["metadata"]["uid"]
    body = {"metadata": {"generateName": "n1.sdc."}, "type": "Warning", "reason": "SDCQuarantine",
            "message": "rank 3 diverged", "source": {"component": "sdc-guard"},
            "involvedObject": {"kind": "Node", "name": "n1", "uid": uid, "apiVersion": "v1"}}
    dry = api.create_namespaced_event("default", body, dry_run="All")
    assert dry.metadata.name.startswith("n1.sdc.") and len(dry.metadata.name) == len("n1.sdc.") + 5
    assert dry.metadata.resource_version is None and srv.events == []
    created = api.create_namespaced_event("default", body)
    assert srv.requests[-1].status == 201
    assert created.metadata.namespace == "default" and created.metadata.uid
    assert created.metadata.resource_version.isdigit()
    [stored] = srv.events
    assert stored["metadata"]["name"] == created.metadata.name and stored["reason"] == "SDCQuarantine"
    assert stored["involvedObject"]["uid"] == uid and stored["kind"] == "Event"
    listed = api.list_namespaced_event("default", field_selector="involvedObject.name=n1")
    assert [e.metadata.name for e in listed.items] == [created.metadata.name]


def test_event_namespace_rules(api: Any, srv: StandInAPIServer) -> None:
    body = {"metadata": {"name": "e1"}, "reason": "R", "involvedObject": {"kind": "Node", "name": "n1"}}
    with pytest.raises(ApiException) as info:  # a Node's events belong in "default"
        api.create_namespaced_event("kube-system", body)
    assert info.value.status == 422
    assert _status(info)["message"] == ('Event "e1" is invalid: involvedObject.namespace: Invalid value: "": '
                                        "does not match event.namespace")
    with pytest.raises(ApiException) as info:
        api.create_namespaced_event("nowhere", body)
    assert info.value.status == 404 and _status(info)["message"] == 'namespaces "nowhere" not found'
    code, status, _ = _raw(srv, "POST", "/api/v1/namespaces/default/events",  # the client insists on metadata
                           {"involvedObject": {"kind": "Node", "name": "n1"}})
    assert code == 422
    assert status["message"] == ('Event "" is invalid: metadata.name: Required value: name or generateName '
                                 "is required")
    api.create_namespaced_event("default", body)
    with pytest.raises(ApiException) as info:
        api.create_namespaced_event("default", body)
    assert info.value.status == 409 and _status(info)["reason"] == "AlreadyExists"


def test_events_k8s_io_v1_are_stored_as_core_events(srv: StandInAPIServer, tmp_path: Path) -> None:
    events = kubernetes.client.EventsV1Api(kubernetes.config.new_client_from_config(
        config_file=str(srv.write_kubeconfig(tmp_path / "kc"))))
    created = events.create_namespaced_event("default", {
        "metadata": {"name": "e2"}, "eventTime": "2026-01-02T03:04:05.123456Z", "type": "Normal",
        "reason": "Quarantined", "action": "Taint", "note": "n1 tainted",
        "reportingController": "sdc-guard.io/q", "reportingInstance": "sdc-guard-0",
        "regarding": {"kind": "Node", "name": "n1"}})
    assert created.note == "n1 tainted" and created.regarding.name == "n1"
    [stored] = srv.events
    assert (stored["message"], stored["reportingComponent"], stored["involvedObject"]["name"]) == \
        ("n1 tainted", "sdc-guard.io/q", "n1")
    code, body, _ = _raw(srv, "POST", "/apis/events.k8s.io/v1/namespaces/default/events",
                         {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e3"},
                          "reason": "R"})
    assert code == 422 and "eventTime: Required value" in body["message"]


# -- the server going away -------------------------------------------------------------------------------
def test_stop_refuses_connections_and_start_comes_back(api: Any, srv: StandInAPIServer) -> None:
    api.read_node("n1")  # leaves a keep-alive connection in the client's pool
    srv.stop()
    with pytest.raises(urllib3.exceptions.MaxRetryError) as info:
        api.read_node("n1")
    assert isinstance(info.value.reason, urllib3.exceptions.NewConnectionError)
    assert "Connection refused" in str(info.value.reason)
    srv.start()  # same port, same store: a restarted API server
    assert api.read_node("n1").metadata.name == "n1"
