"""Validate ``deploy/*.yaml`` against the real Kubernetes schemas, and check what the schemas cannot.

Built-in kinds are validated with ``kubernetes-validate`` (the Kubernetes OpenAPI schemas, strict mode:
unknown fields are errors) at the newest Kubernetes version the package ships. The PyTorchJob is
validated against the ``openAPIV3Schema`` of the real ``pytorchjobs.kubeflow.org`` CRD (vendored in
``kubeflow.org_pytorchjobs.schema.json``, source in its ``source`` field), made strict the way the API
server's strict field validation treats a structural schema; its metadata and each replica's pod
template are also validated as a core/v1 PodTemplate. On top of the schemas: the ClusterRole grants
exactly what the quarantine needs, and the PyTorchJob is wired the way sdc-guard expects (ExitCode
restarts, downward-API env, the RBAC's ServiceAccount, the checkpoints PVC). Every check has a
negative case, so a broken manifest fails a test.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

Doc = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRD_FIXTURE = Path(__file__).with_name("kubeflow.org_pytorchjobs.schema.json")

# The newest Kubernetes version kubernetes-validate ships schemas for (e.g. "1.37.0").
K8S_VERSION = kubernetes_validate.latest_version()

# Kinds that are not built in, validated against a vendored CRD schema instead.
CRD_KINDS = {("kubeflow.org/v1", "PyTorchJob")}

# What the quarantine needs, and nothing more: (apiGroup, resource) -> verbs.
EXPECTED_GRANTS = {("", "nodes"): {"get", "list", "patch"}, ("", "events"): {"create"}}
CLUSTER_ROLE = "sdc-guard-quarantine"
EXPECTED_LEASE_GRANTS = {("coordination.k8s.io", "leases"): {"get", "create", "update"}}
LEASE_ROLE = "sdc-guard-breaker"

# The downward-API env the guarded training script reads, and where each comes from.
DOWNWARD_ENV = {
    "NODE_NAME": "spec.nodeName",
    "POD_NAME": "metadata.name",
    "POD_NAMESPACE": "metadata.namespace",
    "SDC_GUARD_JOB": "metadata.labels['training.kubeflow.org/job-name']",
}
CONTAINER = "pytorch"  # the training-operator's default container for PyTorchJob
COMMAND = ["python", "examples/train_guarded.py"]
CHECKPOINTS_CLAIM = "sdc-guard-checkpoints"
CHECKPOINTS_PATH = "/checkpoints"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


def _load(path: Path) -> list[Doc]:
    """The non-empty YAML documents of one file."""
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _all_docs() -> list[tuple[str, Doc]]:
    """Every document of every ``deploy/*.yaml``, with a readable id."""
    out = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for i, doc in enumerate(_load(path)):
            if not isinstance(doc, dict):
                raise TypeError(f"{path.name} document {i} is not a mapping: {doc!r}")
            name = doc.get("metadata", {}).get("name", "?")
            out.append((f"{path.name}#{i}:{doc.get('kind', '?')}/{name}", doc))
    return out


ALL_DOCS = _all_docs()
BUILTIN_DOCS = [(i, d) for i, d in ALL_DOCS if (d.get("apiVersion"), d.get("kind")) not in CRD_KINDS]
JOB_DOCS = [(i, d) for i, d in ALL_DOCS if (d.get("apiVersion"), d.get("kind")) in CRD_KINDS]
GUARD_DOCS = [(i, d) for i, d in ALL_DOCS if i.startswith(("rbac.yaml", "pytorchjob.yaml"))]
"""The guarded training's objects (the campaign's Jobs and volume have tests of their own)."""


def _one(kind: str, docs: list[tuple[str, Doc]] = GUARD_DOCS) -> Doc:
    """The single document of ``kind`` (a deep copy, free to mutate)."""
    found = [d for _, d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind} in deploy/, found {len(found)}"
    return copy.deepcopy(found[0])


def _major_minor(version: str) -> str:
    """``"1.37.0"`` -> ``"1.37"``."""
    return ".".join(version.split(".")[:2])


def k8s_validate(doc: Doc) -> None:
    """Validate a built-in object strictly at ``K8S_VERSION``; raises ``kubernetes_validate.ValidationError``.

    An unknown kind or apiVersion (``SchemaNotFoundError``) is a failure, not a skip: a typo in ``kind``
    must not turn validation off.
    """
    try:
        used = kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"no Kubernetes {K8S_VERSION} schema: {e.message}")
    # validate() silently falls back to an older schema set; make sure it did not.
    assert used == _major_minor(K8S_VERSION)


def k8s_error(doc: Doc) -> str | None:
    """``k8s_validate``'s complaint about ``doc`` as ``path: message``, or None when it is valid."""
    try:
        k8s_validate(doc)
    except kubernetes_validate.ValidationError as e:
        return f"{'.'.join(map(str, e.path)) or '<root>'}: {e.message}"
    return None


def _strict(schema: Any) -> Any:
    """A copy of a CRD structural schema in which unknown fields are errors.

    The API server prunes (or, with strict field validation, the kubectl default, rejects) fields a
    structural schema does not declare, except under ``x-kubernetes-preserve-unknown-fields``. JSON
    Schema allows them unless ``additionalProperties`` is false, so set it wherever an object lists its
    ``properties`` and says nothing else about extra fields.
    """
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        elif key in {"items", "additionalProperties", "not", "allOf", "anyOf", "oneOf"}:
            out[key] = _strict(value)
        else:
            out[key] = value
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@cache
def _crd_fixture() -> Doc:
    """The vendored CRD fixture: ``{"source": {...}, "openAPIV3Schema": {...}}``."""
    fixture: Doc = json.loads(CRD_FIXTURE.read_text())
    return fixture


@cache
def _crd_validator() -> jsonschema.Draft4Validator:
    """A validator for the PyTorchJob v1 schema, strict about unknown fields.

    OpenAPI v3.0 schema objects are close to JSON Schema draft 4; the ``x-kubernetes-*`` extensions
    are ignored by jsonschema (the CEL rules in ``x-kubernetes-validations`` only constrain updates).
    """
    schema = _strict(_crd_fixture()["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def crd_errors(job: Doc) -> list[str]:
    """Every violation of the PyTorchJob CRD schema, as ``path: message``."""
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in _crd_validator().iter_errors(job)]


def pod_template_of(job: Doc, replica: str) -> Doc:
    """The job's metadata and one replica's pod template, as a core/v1 PodTemplate object."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": job["metadata"],
            "template": job["spec"]["pytorchReplicaSpecs"][replica]["template"]}


# ---------------------------------------------------------------------------------------------
# The manifests exist and every document validates against the real schemas.


def test_deploy_manifests_exist() -> None:
    """deploy/ holds the RBAC and the example job, and every document names its kind."""
    assert (DEPLOY / "rbac.yaml").is_file()
    assert (DEPLOY / "pytorchjob.yaml").is_file()
    kinds = sorted(d["kind"] for _, d in ALL_DOCS)
    for kind in ("ClusterRole", "ClusterRoleBinding", "PersistentVolumeClaim", "PyTorchJob",
                 "ServiceAccount"):
        assert kind in kinds
    for doc_id, doc in ALL_DOCS:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc_id
        assert doc["metadata"].get("name"), doc_id


@pytest.mark.parametrize("doc", [d for _, d in BUILTIN_DOCS], ids=[i for i, _ in BUILTIN_DOCS])
def test_builtin_document_is_valid(doc: Doc) -> None:
    """Every built-in object is valid in strict mode (unknown fields are errors)."""
    error = k8s_error(doc)
    assert error is None, error


def test_crd_fixture_names_its_source() -> None:
    """The vendored schema says where it came from, under which license, and is the v1 PyTorchJob."""
    source = _crd_fixture()["source"]
    assert source["repository"] == "https://github.com/kubeflow/training-operator"
    assert source["path"] == "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"])
    assert source["license"] == "Apache-2.0"
    assert (source["group"], source["kind"], source["version"]) == ("kubeflow.org", "PyTorchJob", "v1")
    props = _crd_fixture()["openAPIV3Schema"]["properties"]
    assert "pytorchReplicaSpecs" in props["spec"]["properties"]


@pytest.mark.parametrize("job", [d for _, d in JOB_DOCS], ids=[i for i, _ in JOB_DOCS])
def test_pytorchjob_is_valid_against_crd(job: Doc) -> None:
    """The PyTorchJob is valid against the real CRD's schema, unknown fields rejected."""
    assert crd_errors(job) == []


@pytest.mark.parametrize("replica", ["Master", "Worker"])
def test_pytorchjob_pod_template_is_valid_core_v1(replica: str) -> None:
    """Each replica's template is a valid core/v1 PodTemplateSpec (and the job's metadata an ObjectMeta)."""
    error = k8s_error(pod_template_of(_one("PyTorchJob"), replica))
    assert error is None, f"{replica}: {error}"


# ---------------------------------------------------------------------------------------------
# The validators reject broken manifests (so the tests above can fail).


def _rename(mapping: Doc, old: str, new: str) -> None:
    """Rename a key in place, as a typo would."""
    mapping[new] = mapping.pop(old)


def _master_spec(job: Doc) -> Doc:
    """The Master replica's pod spec."""
    spec: Doc = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return spec


def test_misspelled_pod_field_is_rejected_by_kubernetes_schema() -> None:
    """``serviceAcountName`` in a pod template is an error in strict mode."""
    job = _one("PyTorchJob")
    _rename(_master_spec(job), "serviceAccountName", "serviceAcountName")
    with pytest.raises(kubernetes_validate.ValidationError, match="serviceAcountName"):
        k8s_validate(pod_template_of(job, "Master"))


def test_misspelled_pod_field_is_rejected_by_crd_schema() -> None:
    """The same typo, and typos in the job's own fields, violate the CRD schema."""
    job = _one("PyTorchJob")
    _rename(_master_spec(job), "serviceAccountName", "serviceAcountName")
    _rename(job["spec"], "runPolicy", "runPolcy")
    _rename(job["spec"]["pytorchReplicaSpecs"]["Worker"], "restartPolicy", "restartPolcy")
    errors = "\n".join(crd_errors(job))
    for typo in ("serviceAcountName", "runPolcy", "restartPolcy"):
        assert typo in errors


def test_wrong_type_is_rejected_by_crd_schema() -> None:
    """A string where the CRD wants an integer is an error."""
    job = _one("PyTorchJob")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "3"
    assert any("pytorchReplicaSpecs.Worker.replicas" in e for e in crd_errors(job))


@pytest.mark.parametrize("kind, mutate, typo", [
    ("ClusterRole", lambda d: _rename(d, "rules", "rule"), "rule"),
    ("ClusterRoleBinding", lambda d: _rename(d["subjects"][0], "namespace", "namepsace"), "namepsace"),
    ("ServiceAccount", lambda d: _rename(d["metadata"], "namespace", "namespce"), "namespce"),
    ("PersistentVolumeClaim", lambda d: _rename(d["spec"], "accessModes", "accesModes"), "accesModes"),
], ids=["ClusterRole", "ClusterRoleBinding", "ServiceAccount", "PersistentVolumeClaim"])
def test_misspelled_field_is_rejected_for_every_builtin_kind(
        kind: str, mutate: Callable[[Doc], None], typo: str) -> None:
    """A misspelled field in any of the built-in objects is rejected."""
    doc = _one(kind)
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError, match=typo):
        k8s_validate(doc)


def test_unknown_kind_fails_instead_of_being_skipped() -> None:
    """A misspelled kind has no schema; that fails the validation rather than skipping it."""
    doc = _one("ClusterRole")
    doc["kind"] = "ClusterRol"
    with pytest.raises(pytest.fail.Exception, match="no Kubernetes"):
        k8s_validate(doc)


# ---------------------------------------------------------------------------------------------
# RBAC: least privilege for the quarantine.


def _grants(role: Doc) -> Iterator[tuple[str, str, str]]:
    """Every (apiGroup, resource, verb) a role's rules grant."""
    for rule in role.get("rules", []):
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    yield group, resource, verb


def rbac_problems(role: Doc, expected: dict[tuple[str, str], set[str]] | None = None) -> list[str]:
    """Why ``role`` is not exactly the quarantine's least privilege ([] when it is); ``expected``:
    the grants it must make (default: the ClusterRole's)."""
    expected = EXPECTED_GRANTS if expected is None else expected
    problems = []
    granted: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in _grants(role):
        if "*" in (group, resource, verb):
            problems.append(f"wildcard in {group!r}/{resource!r}/{verb!r}")
        granted.setdefault((group, resource), set()).add(verb)
    if granted != expected:
        problems.append(f"grants {granted}, want exactly {expected}")
    for rule in role.get("rules", []):
        if rule.get("nonResourceURLs"):
            problems.append(f"nonResourceURLs {rule['nonResourceURLs']}")
    if role.get("aggregationRule"):
        problems.append("aggregationRule (its rules would be filled in by the controller)")
    return problems


def test_cluster_role_is_least_privilege() -> None:
    """The ClusterRole grants nodes get/list/patch and events create in the core group, nothing more."""
    role = _one("ClusterRole")
    assert role["metadata"]["name"] == CLUSTER_ROLE
    assert rbac_problems(role) == []


def _add_rule(rule: Doc) -> Callable[[Doc], None]:
    """A mutation that appends ``rule`` to a role."""
    return lambda role: role["rules"].append(rule)


def _nodes_rule(role: Doc) -> Doc:
    """The rule that grants on nodes."""
    return next(r for r in role["rules"] if "nodes" in r["resources"])


@pytest.mark.parametrize("mutate", [
    lambda r: _nodes_rule(r)["verbs"].append("delete"),
    lambda r: _nodes_rule(r)["verbs"].append("update"),
    lambda r: _nodes_rule(r)["verbs"].remove("list"),
    lambda r: _nodes_rule(r).update(verbs=["*"]),
    lambda r: _nodes_rule(r).update(resources=["*"]),
    lambda r: _nodes_rule(r).update(apiGroups=["*"]),
    lambda r: _nodes_rule(r)["resources"].append("nodes/status"),
    _add_rule({"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]}),
    _add_rule({"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create"]}),
    _add_rule({"nonResourceURLs": ["/metrics"], "verbs": ["get"]}),
    lambda r: r["rules"].pop(),
], ids=["delete-nodes", "update-nodes", "no-list", "verbs-star", "resources-star", "groups-star",
        "nodes-status", "pods", "events.k8s.io", "non-resource-url", "no-events"])
def test_over_or_under_privileged_cluster_role_is_caught(mutate: Callable[[Doc], None]) -> None:
    """Any extra or missing grant, and any wildcard, is a problem."""
    role = _one("ClusterRole")
    mutate(role)
    assert rbac_problems(role) != []


def test_binding_ties_the_role_to_the_service_account() -> None:
    """The ClusterRoleBinding binds the quarantine role to the sdc-guard ServiceAccount, in its namespace."""
    sa, binding = _one("ServiceAccount"), _one("ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": CLUSTER_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


def test_the_breakers_lease_role_is_namespaced_and_least_privilege() -> None:
    """Leases get/create/update in the job's namespace only: a Role (not the ClusterRole), bound to
    the sdc-guard ServiceAccount in the same namespace."""
    role, binding, sa = _one("Role"), _one("RoleBinding"), _one("ServiceAccount")
    assert role["metadata"]["name"] == LEASE_ROLE
    assert rbac_problems(role, EXPECTED_LEASE_GRANTS) == []
    namespace = sa["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": LEASE_ROLE}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": namespace}]
    assert not any(r for r in _one("ClusterRole")["rules"] if "leases" in r.get("resources", []))


@pytest.mark.parametrize("mutate", [
    lambda r: r["rules"][0]["verbs"].append("delete"),
    lambda r: r["rules"][0]["verbs"].remove("update"),
    lambda r: r["rules"][0]["verbs"].remove("create"),
    lambda r: r["rules"][0].update(resources=["*"]),
    lambda r: r["rules"][0].update(apiGroups=[""]),
], ids=["delete", "no-update", "no-create", "resources-star", "core-group"])
def test_an_over_or_under_privileged_lease_role_is_caught(mutate: Callable[[Doc], None]) -> None:
    role = _one("Role")
    mutate(role)
    assert rbac_problems(role, EXPECTED_LEASE_GRANTS) != []


# ---------------------------------------------------------------------------------------------
# The PyTorchJob is wired the way sdc-guard needs.


def _env_sources(container: Doc) -> dict[str, str | None]:
    """Env var name -> downward-API fieldPath (None for anything else)."""
    return {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            for e in container.get("env", [])}


def job_problems(job: Doc, service_account: Doc, pvcs: list[Doc]) -> list[str]:
    """Why ``job`` is not a working guarded-training job ([] when it is).

    Covers the operator's admission rules (name, replica types, the ``pytorch`` container, one Master)
    and sdc-guard's needs (ExitCode restarts, downward-API env, the RBAC's ServiceAccount, a GPU, the
    shared checkpoints on a ReadWriteMany claim).
    """
    problems = []
    meta, spec = job["metadata"], job["spec"]
    namespace = meta.get("namespace", "default")
    if not DNS1035.match(meta["name"]):
        problems.append(f"name {meta['name']!r} is not a DNS-1035 label")
    if namespace != service_account["metadata"]["namespace"]:
        problems.append(f"namespace {namespace!r} is not the ServiceAccount's")
    backoff = spec.get("runPolicy", {}).get("backoffLimit")
    if not isinstance(backoff, int) or backoff < 0:
        problems.append(f"runPolicy.backoffLimit is {backoff!r}")
    replicas = spec["pytorchReplicaSpecs"]
    if set(replicas) != {"Master", "Worker"}:
        problems.append(f"replica types {sorted(replicas)}, want Master and Worker")
    if replicas.get("Master", {}).get("replicas") != 1:
        problems.append("Master replicas must be 1")
    claims = {(p["metadata"]["name"], p["metadata"].get("namespace", "default")): p for p in pvcs}

    for rtype, rspec in replicas.items():
        where = f"{rtype}:"
        if rspec.get("restartPolicy") != "ExitCode":
            problems.append(f"{where} restartPolicy {rspec.get('restartPolicy')!r}, want ExitCode")
        if not isinstance(rspec.get("replicas"), int) or rspec["replicas"] < 1:
            problems.append(f"{where} replicas {rspec.get('replicas')!r}")
        pod = rspec["template"]["spec"]
        if pod.get("serviceAccountName") != service_account["metadata"]["name"]:
            problems.append(f"{where} serviceAccountName {pod.get('serviceAccountName')!r}")
        containers = {c["name"]: c for c in pod["containers"]}
        if CONTAINER not in containers:
            problems.append(f"{where} no container named {CONTAINER!r}")
            continue
        main = containers[CONTAINER]
        if not main.get("image"):
            problems.append(f"{where} no image")
        if main.get("command") != COMMAND:
            problems.append(f"{where} command {main.get('command')!r}")
        args = [str(a) for a in main.get("args", [])]
        if "--checkpoint-dir" not in args or args[args.index("--checkpoint-dir") + 1:][:1] != [
                CHECKPOINTS_PATH]:
            problems.append(f"{where} args {args!r} do not give --checkpoint-dir {CHECKPOINTS_PATH}")
        env = _env_sources(main)
        for name, field_path in DOWNWARD_ENV.items():
            if env.get(name) != field_path:
                problems.append(f"{where} env {name} from {env.get(name)!r}, want {field_path!r}")
        if str(main.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")) != "1":
            problems.append(f"{where} nvidia.com/gpu limit is not 1")
        for tol in pod.get("tolerations", []):
            if tol.get("operator") == "Exists" and not tol.get("key"):
                problems.append(f"{where} keyless toleration {tol} would tolerate the quarantine taint")

        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in main.get("volumeMounts", [])}
        volume = volumes.get(mounts.get(CHECKPOINTS_PATH, ""), {})
        claim_name = volume.get("persistentVolumeClaim", {}).get("claimName")
        if claim_name != CHECKPOINTS_CLAIM:
            problems.append(f"{where} {CHECKPOINTS_PATH} is not mounted from claim {CHECKPOINTS_CLAIM!r}")
        pvc = claims.get((claim_name, namespace))
        if pvc is None:
            problems.append(f"{where} claim {claim_name!r} has no PersistentVolumeClaim in {namespace!r}")
        elif "ReadWriteMany" not in pvc["spec"].get("accessModes", []):
            problems.append(f"{where} claim {claim_name!r} is not ReadWriteMany")
    return problems


def _job_parts() -> tuple[Doc, Doc, list[Doc]]:
    """Deep copies of the PyTorchJob, the ServiceAccount and every PersistentVolumeClaim in deploy/."""
    pvcs = [copy.deepcopy(d) for _, d in GUARD_DOCS if d["kind"] == "PersistentVolumeClaim"]
    return _one("PyTorchJob"), _one("ServiceAccount"), pvcs


def test_pytorchjob_is_wired_for_sdc_guard() -> None:
    """ExitCode restarts, downward-API env, the RBAC's ServiceAccount, the checkpoints claim: all there."""
    job, sa, pvcs = _job_parts()
    assert job_problems(job, sa, pvcs) == []


def test_master_and_workers_run_the_same_pod() -> None:
    """Master and Worker differ only in their count: one pod template for every rank."""
    replicas = _one("PyTorchJob")["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["template"] == replicas["Worker"]["template"]
    assert replicas["Worker"]["replicas"] >= 1


def _worker(job: Doc) -> Doc:
    """The Worker replica spec."""
    worker: Doc = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    return worker


def _worker_main(job: Doc) -> Doc:
    """The Worker's ``pytorch`` container."""
    container: Doc = _worker(job)["template"]["spec"]["containers"][0]
    return container


def _drop_env(name: str) -> Callable[[Doc, Doc, list[Doc]], None]:
    """A mutation that removes one env var from the Worker's container."""
    def mutate(job: Doc, sa: Doc, pvcs: list[Doc]) -> None:
        main = _worker_main(job)
        main["env"] = [e for e in main["env"] if e["name"] != name]
    return mutate


JOB_MUTATIONS: dict[str, Callable[[Doc, Doc, list[Doc]], None]] = {
    "restart-onfailure": lambda j, s, p: _worker(j).update(restartPolicy="OnFailure"),
    "restart-missing": lambda j, s, p: _worker(j).pop("restartPolicy"),
    "no-node-name": _drop_env("NODE_NAME"),
    "no-pod-name": _drop_env("POD_NAME"),
    "no-pod-namespace": _drop_env("POD_NAMESPACE"),
    "no-job-name": _drop_env("SDC_GUARD_JOB"),
    "node-name-wrong-field": lambda j, s, p: _worker_main(j)["env"][0]["valueFrom"]["fieldRef"].update(
        fieldPath="status.hostIP"),
    "other-service-account": lambda j, s, p: _worker(j)["template"]["spec"].update(
        serviceAccountName="default"),
    "rbac-renamed": lambda j, s, p: s["metadata"].update(name="sdc-guard-other"),
    "rbac-other-namespace": lambda j, s, p: s["metadata"].update(namespace="training"),
    "claim-mismatch": lambda j, s, p: _worker(j)["template"]["spec"]["volumes"][0][
        "persistentVolumeClaim"].update(claimName="checkpoints"),
    "pvc-missing": lambda j, s, p: p.clear(),
    "pvc-rwo": lambda j, s, p: p[0]["spec"].update(accessModes=["ReadWriteOnce"]),
    "mount-elsewhere": lambda j, s, p: _worker_main(j)["volumeMounts"][0].update(mountPath="/ckpt"),
    "container-renamed": lambda j, s, p: _worker_main(j).update(name="train"),
    "no-gpu": lambda j, s, p: _worker_main(j)["resources"].update(limits={}),
    "no-backoff-limit": lambda j, s, p: j["spec"]["runPolicy"].pop("backoffLimit"),
    "two-masters": lambda j, s, p: j["spec"]["pytorchReplicaSpecs"]["Master"].update(replicas=2),
    "bad-name": lambda j, s, p: j["metadata"].update(name="SDC_Guard"),
    "keyless-toleration": lambda j, s, p: _worker(j)["template"]["spec"]["tolerations"].append(
        {"operator": "Exists"}),
}


@pytest.mark.parametrize("name", sorted(JOB_MUTATIONS))
def test_broken_pytorchjob_is_caught(name: str) -> None:
    """Each way of breaking the job's wiring is reported."""
    job, sa, pvcs = _job_parts()
    JOB_MUTATIONS[name](job, sa, pvcs)
    assert job_problems(job, sa, pvcs) != []


def _campaign_docs() -> tuple[Doc, Doc, Doc]:
    """The campaign's Indexed Job, its merge Job and their volume claim."""
    by_file: dict[str, list[Doc]] = {i.split("#")[0]: [] for i, _ in ALL_DOCS}
    for i, d in ALL_DOCS:
        by_file[i.split("#")[0]].append(d)
    shards = {d["kind"]: d for d in by_file["campaign-shards.yaml"]}
    (merge,) = by_file["campaign-merge.yaml"]
    return shards["Job"], merge, shards["PersistentVolumeClaim"]


def test_campaign_shards_run_as_an_indexed_job_and_merge_every_shard() -> None:
    """N shards (completions) with per-index retries, --shard .../N, each writing its own
    directory on a ReadWriteMany claim; the merge Job reads exactly shard-0 .. shard-(N-1)."""
    job, merge, pvc = _campaign_docs()
    spec = job["spec"]
    n = spec["completions"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimitPerIndex"] >= 1
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # backoffLimitPerIndex requires it
    script = " ".join(pod["containers"][0]["args"])
    assert f'--shard "${{JOB_COMPLETION_INDEX}}/{n}"' in script
    assert '--out "/results/shard-${JOB_COMPLETION_INDEX}"' in script
    command = merge["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "scenarios", "merge"]
    assert command[5:] == [f"/results/shard-{i}" for i in range(n)]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for j in (job, merge):
        claims = [v["persistentVolumeClaim"]["claimName"]
                  for v in j["spec"]["template"]["spec"]["volumes"]]
        assert claims == [pvc["metadata"]["name"]]


def test_scenario_pytorchjob_matches_its_scenario_and_is_valid_core_v1() -> None:
    """The multi-node scenario job: pods = the scenario's world_size, NODE_NAME from the
    downward API, each replica's pod template a valid core/v1 PodTemplate."""
    import tomllib

    docs = [d for i, d in ALL_DOCS if i.startswith("scenario-pytorchjob.yaml")]
    (job,) = docs
    replicas = job["spec"]["pytorchReplicaSpecs"]
    world = sum(r["replicas"] for r in replicas.values())
    root = DEPLOY.parent
    for r in replicas.values():
        container = r["template"]["spec"]["containers"][0]
        config = container["command"][container["command"].index("run") + 1]
        scenario = tomllib.loads((root / config).read_text())
        assert scenario["world_size"] == world
        env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
               for e in container["env"]}
        assert env["NODE_NAME"] == "spec.nodeName"
        k8s_validate({"apiVersion": "v1", "kind": "PodTemplate",
                      "metadata": {"name": "t", "namespace": "default"},
                      "template": r["template"]})
