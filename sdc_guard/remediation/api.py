"""The few Kubernetes API calls a quarantine makes, with retries and errors that say what to fix.

Built on the official ``kubernetes`` client (extra ``kube``). Every write is a read-modify-write
of the node: a JSON patch (RFC 6902, the content type every client version sends for a list
body) whose first operation sets ``metadata.resourceVersion`` to the version we read.
``spec.taints`` has no merge key, so any patch that sets it replaces the whole list; sending
the list we read, with our taint added, under the version we read, keeps other tools' taints,
and a node changed in between (a kubelet update, another tool) fails the server's
optimistic-concurrency check with 409 and is read again.

Errors: 401/403 name the credentials or the RBAC verb and resource to grant
(``deploy/rbac.yaml``); 404 names the node; 409 is retried with the fresh object;
429, 5xx, timeouts and refused connections are retried with exponential backoff, then
reported as ``KubeError``.

Time: the client's own retries (urllib3's, three by default, each a full request timeout) are
switched off in :func:`load_client`, so ours are the only ones: a call makes at most
``retries + 1`` requests, each cut at ``request_timeout_s``, and takes at most
:func:`worst_case_s` in all.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
JsonPatch = list[dict[str, Any]]


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def annotation_ops(node: dict[str, Any], changes: dict[str, str | None]) -> JsonPatch:
    """JSON-patch operations that set (or, for None, remove) annotations of ``node``."""
    have = (node.get("metadata") or {}).get("annotations")
    if not have:
        new = {k: v for k, v in changes.items() if v is not None}
        return [{"op": "add", "path": "/metadata/annotations", "value": new}] if new else []
    ops: JsonPatch = []
    for key, value in changes.items():
        path = f"/metadata/annotations/{_pointer(key)}"
        if value is None:
            if key in have:
                ops.append({"op": "remove", "path": path})
        else:
            ops.append({"op": "add", "path": path, "value": value})
    return ops


def worst_case_s(request_timeout_s: float, retries: int, backoff_s: float) -> float:
    """The longest one API call takes when every request hangs: ``retries + 1`` requests of
    ``request_timeout_s`` each and the backoff between them (``backoff_s``, doubling)."""
    return float((retries + 1) * request_timeout_s + backoff_s * (2 ** retries - 1))


class KubeError(RuntimeError):
    """A Kubernetes API call failed for good; the message says what to fix. ``status``: the
    HTTP status the server answered (0 when none came: a timeout, a refused connection)."""

    def __init__(self, message: str, *, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Conflict(KubeError):
    """409: the object changed since it was read, or (on a create) it exists already."""


class NotFound(KubeError):
    """404 for an object other than a node (a node's 404 names the node and NODE_NAME)."""


def load_client(kubeconfig: str | Path | None) -> Any:
    """An ``ApiClient``: in-cluster (service account) when ``kubeconfig`` is None.

    Its urllib3 retries are off (``Configuration.retries = False``): :class:`NodeAPI` retries
    on its own terms, and a timeout costs one request timeout, not four. A kubeconfig that
    cannot be used is a ``KubeError`` naming the file and what is wrong with it, in one line.
    """
    try:
        from kubernetes import client, config
    except ImportError as e:
        raise ImportError(
            "sdc_guard.remediation needs the official Kubernetes client: "
            "pip install 'sdc-guard[kube]'") from e
    settings = type.__call__(client.Configuration)  # not a copy of the process-wide default
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=settings)  # type: ignore[no-untyped-call]
        except config.ConfigException as e:
            raise KubeError(
                f"in-cluster Kubernetes credentials not found ({e}); outside a pod pass a "
                "kubeconfig: kubeconfig='~/.kube/config' (or --kubeconfig PATH)") from e
    else:
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            raise KubeError(f"kubeconfig {str(path)!r} does not exist; pass an existing "
                            "kubeconfig (kubeconfig=PATH, --kubeconfig PATH), or inside a pod use "
                            "its service account (kubeconfig=None, --in-cluster)")
        _check_kubeconfig(path)
        try:
            config.load_kube_config(config_file=str(path),  # type: ignore[no-untyped-call]
                                    client_configuration=settings)
        except Exception as e:  # the loader raises ConfigException, KeyError, TypeError, ...
            raise KubeError(f"kubeconfig {str(path)!r} cannot be used: {_one_line(e)}; fix the "
                            "file or pass another (kubeconfig=PATH, --kubeconfig PATH)") from e
    settings.retries = False
    return client.ApiClient(configuration=settings)


def _check_kubeconfig(path: Path) -> None:
    """A ``KubeError`` naming ``path`` when it is not YAML or not a mapping."""
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise KubeError(f"kubeconfig {str(path)!r} cannot be read: {_one_line(e)}") from e
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or _one_line(e)
        raise KubeError(f"kubeconfig {str(path)!r} is not valid YAML{at}: {problem}; fix the "
                        "file or pass another (kubeconfig=PATH, --kubeconfig PATH)") from e
    if not isinstance(doc, dict):
        raise KubeError(f"kubeconfig {str(path)!r} is not a mapping (found "
                        f"{type(doc).__name__}); a kubeconfig has apiVersion, kind: Config, "
                        "clusters, users, contexts and current-context")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class NodeAPI:
    """Nodes and events through ``CoreV1Api``, every call bounded in time and retried."""

    def __init__(self, api_client: Any, *, request_timeout_s: float = 5.0, retries: int = 4,
                 backoff_s: float = 0.5, sleep: Callable[[float], None] = time.sleep) -> None:
        from kubernetes import client

        self.client = api_client
        self.core = client.CoreV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.timeout = request_timeout_s
        self.retries = retries
        self.backoff = backoff_s
        self.sleep = sleep

    # -- calls -----------------------------------------------------------------------------
    def get(self, name: str) -> dict[str, Any]:
        return self._call("get", "nodes", name, lambda: self._dict(
            self.core.read_node(name, _request_timeout=self.timeout)))

    def list(self) -> list[dict[str, Any]]:
        out = self._call("list", "nodes", None, lambda: self._dict(
            self.core.list_node(_request_timeout=self.timeout)))
        return list(out.get("items") or [])

    def patch(self, name: str, ops: JsonPatch, *, dry_run: bool) -> dict[str, Any]:
        """A JSON patch (a list body: ``application/json-patch+json`` in every client)."""
        return self._call("patch", "nodes", name, lambda: self._dict(self.core.patch_node(
            name, ops, dry_run="All" if dry_run else None, _request_timeout=self.timeout)))

    def event(self, namespace: str, body: dict[str, Any], *, dry_run: bool) -> dict[str, Any]:
        return self._call("create", "events", None, lambda: self._dict(
            self.core.create_namespaced_event(namespace, body,  # type: ignore[arg-type]
                                              dry_run="All" if dry_run else None,
                                              _request_timeout=self.timeout)))

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A ``coordination.k8s.io/v1`` Lease, or None when there is none."""
        try:
            return self._call("get", "leases", name, lambda: self._dict(
                self.coordination.read_namespaced_lease(name, namespace,
                                                        _request_timeout=self.timeout)),
                group="coordination.k8s.io", namespace=namespace)
        except NotFound:
            return None

    def create_lease(self, namespace: str, body: dict[str, Any], *,
                     dry_run: bool) -> dict[str, Any]:
        """Create a Lease; ``Conflict`` when one of that name exists."""
        return self._call("create", "leases", None, lambda: self._dict(
            self.coordination.create_namespaced_lease(
                namespace, body, dry_run="All" if dry_run else None,  # type: ignore[arg-type]
                _request_timeout=self.timeout)),
            group="coordination.k8s.io", namespace=namespace)

    def replace_lease(self, namespace: str, name: str, body: dict[str, Any], *,
                      dry_run: bool) -> dict[str, Any]:
        """Update a Lease under the ``metadata.resourceVersion`` of ``body``; ``Conflict`` when
        it changed since."""
        return self._call("update", "leases", name, lambda: self._dict(
            self.coordination.replace_namespaced_lease(
                name, namespace, body, dry_run="All" if dry_run else None,  # type: ignore[arg-type]
                _request_timeout=self.timeout)),
            group="coordination.k8s.io", namespace=namespace)

    def update(self, name: str, change: Callable[[dict[str, Any]], JsonPatch | None], *,
               dry_run: bool, attempts: int = 6) -> dict[str, Any]:
        """Read the node, ``change(node)`` -> JSON-patch operations (None: nothing to do), write
        them under the version read; on 409 read again and redo ``change``."""
        for _ in range(attempts):
            node = self.get(name)
            ops = change(node)
            if ops is None:
                return node
            version = {"op": "replace", "path": "/metadata/resourceVersion",
                       "value": node["metadata"]["resourceVersion"]}
            try:
                return self.patch(name, [version, *ops], dry_run=dry_run)
            except Conflict:
                log.info("node %s changed while we wrote it (409); reading it again", name)
        raise KubeError(f"node {name!r}: still changed by someone else after {attempts} "
                        "read-modify-write attempts (409 Conflict each time)")

    # -- plumbing --------------------------------------------------------------------------
    def _dict(self, obj: Any) -> dict[str, Any]:
        return dict(self.client.sanitize_for_serialization(obj))

    def _call(self, verb: str, resource: str, name: str | None, fn: Callable[[], T], *,
              group: str = "", namespace: str | None = None) -> T:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        what = f"{resource}{f' {name!r}' if name else ''}"
        delay = self.backoff
        last = ""
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except ApiException as e:
                status = int(e.status or 0)
                message = _status_message(e)
                if status == 401:
                    raise KubeError(f"401 Unauthorized to {verb} {resource}: the credentials were "
                                    f"refused ({message}); check the kubeconfig or the pod's "
                                    "service account token", status=401) from e
                if status == 403:
                    role = (f"its Role in namespace {namespace!r}" if namespace is not None
                            else "its ClusterRole")
                    raise KubeError(
                        f"403 Forbidden: the service account may not {verb!r} {resource!r} "
                        f"(API group \"{group}\"); grant verb {verb!r} on resource {resource!r} "
                        f"in {role} (deploy/rbac.yaml). Server said: {message}",
                        status=403) from e
                if status == 404 and resource == "nodes" and name is not None:
                    raise KubeError(f"404: node {name!r} not found (server said: {message}); is "
                                    "NODE_NAME the node's name (spec.nodeName)?", status=404) from e
                if status == 404 and name is not None:
                    raise NotFound(f"404: {what} not found: {message}", status=404) from e
                if status == 409:
                    raise Conflict(f"409 Conflict on {what}: {message}", status=409) from e
                if status not in (0, 429) and status < 500:
                    raise KubeError(f"{status} from the API server on {verb} {what}: {message}",
                                    status=status) from e
                last = f"{status} {message}"
            except (HTTPError, OSError) as e:  # timeouts, refused or reset connections
                last = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                log.warning("Kubernetes API %s %s failed (%s); retrying in %.2g s", verb,
                            resource, last, delay)
                self.sleep(delay)
                delay *= 2
        raise KubeError(f"{verb} {what} failed after {self.retries + 1} attempts; last error: "
                        f"{last}")


def _status_message(e: Any) -> str:
    try:
        body = json.loads(e.body or "")
    except (TypeError, ValueError):
        return str(e.reason or "")
    return str(body.get("message") or e.reason or "") if isinstance(body, dict) else str(e.reason)
