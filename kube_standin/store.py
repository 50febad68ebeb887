"""The object store: Nodes, Events, Leases and namespaces under one lock, one resourceVersion counter.

``resourceVersion`` is one cluster-wide counter, a decimal string, bumped by every write that
changes an object (a write that changes nothing keeps it: etcd is not written). An update
whose object carries a ``metadata.resourceVersion`` other than the stored one is a 409
Conflict, checked under the same lock as the write, so of concurrent writers holding the same
version exactly one wins. ``dryRun=All`` runs every step and stores nothing.

:class:`Store` serves two sides: the methods a test calls to set up and inspect the cluster
(:meth:`Store.add_node`, :meth:`Store.node`, :meth:`Store.bump`, ...), and the ones the request
handlers call (:meth:`Store.update_node`, :meth:`Store.create_event`, the lists).
"""

from __future__ import annotations

import base64
import copy
import json
import random
import threading
import uuid
from collections.abc import Callable
from typing import Any

from kube_standin.leases import LeaseStore
from kube_standin.schema import (
    KUBE_VERSION,
    DecodeError,
    core_to_events_v1,
    default_node,
    json_kind,
    list_item,
    rfc3339,
    roundtrip,
    typed,
)
from kube_standin.selectors import fields_match, labels_match, parse_field_selector, parse_label_selector
from kube_standin.status import (
    err_already_exists,
    err_bad_request,
    err_conflict,
    err_internal,
    err_invalid,
    err_not_found,
    goq,
    invalid_value,
)
from kube_standin.validation import (
    dns_label_errors,
    path_segment_errors,
    validate_event,
    validate_meta,
    validate_meta_update,
    validate_node,
    validate_node_update,
)

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_RANDOM_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # utilrand.String, for generateName


class Store(LeaseStore):
    """The cluster's objects (see the module docstring; Leases: :mod:`kube_standin.leases`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rv = 1000
        self._nodes: dict[str, dict[str, Any]] = {}
        self._events: dict[tuple[str, str], dict[str, Any]] = {}
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._namespaces: set[str] = set(DEFAULT_NAMESPACES)

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    # -- for tests: the cluster as a kubelet and other writers make it ------------------------------
    def add_node(self, name: str, *, labels: dict[str, str] | None = None,
                 annotations: dict[str, str] | None = None, taints: list[dict[str, Any]] | None = None,
                 unschedulable: bool = False) -> dict[str, Any]:
        """Register a Node as a kubelet would: the standard ``kubernetes.io/{hostname,os,arch}``
        labels and kubelet annotations (``labels``/``annotations`` are added over them), capacity
        with 8 ``nvidia.com/gpu``, and Ready plus the three pressure conditions. Raises ``ValueError``
        for a node the server would refuse (a bad name, label or taint) or a name already taken."""
        with self._lock:
            if name in self._nodes:
                raise ValueError(f'nodes "{name}" already exists')
            now = rfc3339()
            index = len(self._nodes) + 1
            raw = {
                "kind": "Node", "apiVersion": "v1",
                "metadata": {
                    "name": name, "uid": str(uuid.uuid4()), "creationTimestamp": now,
                    "labels": {"kubernetes.io/arch": "amd64", "kubernetes.io/hostname": name,
                               "kubernetes.io/os": "linux", **(labels or {})},
                    "annotations": {"node.alpha.kubernetes.io/ttl": "0",
                                    "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                                    **(annotations or {})},
                },
                "spec": {"taints": copy.deepcopy(taints or []), "unschedulable": unschedulable,
                         "podCIDR": f"10.244.{index}.0/24", "podCIDRs": [f"10.244.{index}.0/24"]},
                "status": {
                    "capacity": {"cpu": "64", "ephemeral-storage": "1055762868Ki", "memory": "2113411068Ki",
                                 "nvidia.com/gpu": "8", "pods": "110"},
                    "conditions": [
                        self._condition("MemoryPressure", "False", "KubeletHasSufficientMemory",
                                        "kubelet has sufficient memory available", now),
                        self._condition("DiskPressure", "False", "KubeletHasNoDiskPressure",
                                        "kubelet has no disk pressure", now),
                        self._condition("PIDPressure", "False", "KubeletHasSufficientPID",
                                        "kubelet has sufficient PID available", now),
                        self._condition("Ready", "True", "KubeletReady", "kubelet is posting ready status",
                                        now),
                    ],
                    "addresses": [{"type": "InternalIP", "address": f"10.0.{index // 250}.{index % 250 + 1}"},
                                  {"type": "Hostname", "address": name}],
                    "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                    "nodeInfo": {"machineID": uuid.uuid4().hex, "systemUUID": str(uuid.uuid4()),
                                 "bootID": str(uuid.uuid4()), "kernelVersion": "6.8.0-60-generic",
                                 "osImage": "Ubuntu 24.04.2 LTS", "containerRuntimeVersion": "containerd://2.1.3",
                                 "kubeletVersion": KUBE_VERSION, "kubeProxyVersion": "",
                                 "operatingSystem": "linux", "architecture": "amd64"},
                },
            }
            node = self._checked_node(raw, None)
            node["metadata"]["resourceVersion"] = self._next_rv()
            self._nodes[name] = node
            return copy.deepcopy(node)

    @staticmethod
    def _condition(kind: str, status: str, reason: str, message: str, now: str) -> dict[str, str]:
        return {"type": kind, "status": status, "lastHeartbeatTime": now, "lastTransitionTime": now,
                "reason": reason, "message": message}

    def _checked_node(self, raw: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        try:
            node, _ = roundtrip("Node", raw)
        except DecodeError as e:
            raise ValueError(str(e)) from None
        node = typed(node, "Node", "v1")
        default_node(node)
        errs = validate_node(node)
        if old is not None:
            errs += validate_node_update(node, old)
        if errs:
            raise ValueError(err_invalid("Node", node["metadata"].get("name", ""), errs).status["message"])
        return node

    def node(self, name: str) -> dict[str, Any]:
        """A deep copy of the stored node (``KeyError`` if there is none)."""
        with self._lock:
            return copy.deepcopy(self._nodes[name])

    def nodes(self) -> list[dict[str, Any]]:
        """Deep copies of all nodes, by name."""
        with self._lock:
            return [copy.deepcopy(self._nodes[n]) for n in sorted(self._nodes)]

    def bump(self, name: str, mutate: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Change a node behind the client's back, as another writer would: by default a kubelet
        heartbeat (the Ready condition's ``lastHeartbeatTime``); ``mutate`` edits the node dict in place
        instead (e.g. another tool adding its taint). Always writes a new resourceVersion, so a client
        still holding the old one gets a 409. Returns the stored node."""
        with self._lock:
            old = self._nodes[name]
            raw = copy.deepcopy(old)
            if mutate is None:
                for c in raw["status"].get("conditions") or []:
                    if c.get("type") == "Ready":
                        c["lastHeartbeatTime"] = rfc3339()
            else:
                mutate(raw)
            node = self._checked_node(raw, old)
            node["metadata"]["resourceVersion"] = self._next_rv()
            self._nodes[name] = node
            return copy.deepcopy(node)

    def add_namespace(self, name: str) -> None:
        """Make a namespace exist (events may only be created in existing namespaces)."""
        if errs := dns_label_errors(name):
            raise ValueError(f"namespace {name!r}: {'; '.join(errs)}")
        with self._lock:
            self._namespaces.add(name)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Deep copies of the created Events, all namespaces, in creation order, in core/v1 form."""
        with self._lock:
            return copy.deepcopy(list(self._events.values()))

    # -- for the request handlers ----------------------------------------------------------------------
    def get_node(self, name: str) -> dict[str, Any]:
        """The stored node (a copy), or a 404."""
        with self._lock:
            if name not in self._nodes:
                raise err_not_found("nodes", name)
            return copy.deepcopy(self._nodes[name])

    def get_event(self, namespace: str, name: str, group: str) -> dict[str, Any]:
        """The stored Event (a copy, core/v1), or a 404 naming ``group``'s resource."""
        with self._lock:
            ev = self._events.get((namespace, name))
            if ev is None:
                raise err_not_found("events", name, group)
            return copy.deepcopy(ev)

    def update_node(self, name: str, subresource: str, produce: Callable[[dict[str, Any]], Any], *,
                    dry_run: bool, validation: str, put: bool) -> tuple[dict[str, Any], list[str]]:
        """``patcher.patchResource``/``Store.Update`` for a node: produce, decode, check, validate,
        store. ``produce(copy of the stored node)`` is the new object (a PATCH: the patched
        document, under the lock, so a JSON patch's ``test`` sees the stored version; a PUT: the
        body, ``put``). Returns the node answered and the warnings."""
        with self._lock:
            current = self._nodes.get(name)
            if current is None:
                raise err_not_found("nodes", name)
            raw = produce(copy.deepcopy(current))
            try:
                if not isinstance(raw, dict):
                    raise DecodeError(f"json: cannot unmarshal {json_kind(raw)} into Go value of type "
                                      "v1.Node")
                kind, version = raw.get("kind") or "Node", raw.get("apiVersion") or "v1"
                if kind != "Node" or version != "v1":
                    raise DecodeError(f"no kind {goq(kind)} is registered for version {goq(version)}")
                obj, unknown = roundtrip("Node", raw)
            except DecodeError as e:
                if put:
                    raise err_bad_request(f'Node in version "v1" cannot be handled as a Node: {e}') from None
                shown = json.dumps(raw, separators=(",", ":"))
                raise err_invalid("", "", [invalid_value("patch", shown, str(e))]) from None
            warnings = [f'unknown field "{u}"' for u in unknown]
            if unknown and validation == "Strict":
                detail = "strict decoding error: " + ", ".join(warnings)
                if put:
                    raise err_bad_request(f'Node in version "v1" cannot be handled as a Node: {detail}')
                shown = json.dumps(raw, separators=(",", ":"))
                raise err_invalid("", "", [invalid_value("patch", shown, detail)])
            if validation == "Ignore":
                warnings = []
            obj = typed(obj, "Node", "v1")
            default_node(obj)
            md = obj["metadata"]
            if md.get("name", "") != name:
                raise err_bad_request(f"the name of the object ({md.get('name', '')}) does not match the "
                                      f"name on the URL ({name})")
            md.pop("namespace", None)  # cluster-scoped: the server clears it
            rv = md.get("resourceVersion", "")
            if rv in ("", "0"):
                md["resourceVersion"] = current["metadata"]["resourceVersion"]
            elif not rv.isdigit():
                raise err_internal(f"resourceVersion: Invalid value: {goq(rv)}: strconv.ParseUint: parsing "
                                   f"{goq(rv)}: invalid syntax")
            elif rv != current["metadata"]["resourceVersion"]:
                raise err_conflict("nodes", name)
            # rest.BeforeUpdate
            old_md = current["metadata"]
            for k in ("generation",):
                if k in old_md:
                    md[k] = old_md[k]
                else:
                    md.pop(k, None)
            if subresource == "status":
                obj["spec"] = copy.deepcopy(current["spec"])
            else:
                obj["status"] = copy.deepcopy(current["status"])
            if not md.get("uid"):
                md["uid"] = old_md["uid"]
            md["creationTimestamp"] = old_md["creationTimestamp"]
            for k in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if k in old_md:
                    md[k] = old_md[k]
            obj = roundtrip("Node", obj)[0]
            obj = typed(obj, "Node", "v1")
            errs = validate_meta(obj["metadata"], False, path_segment_errors) + \
                validate_meta_update(obj["metadata"], old_md)
            if subresource != "status":
                errs += validate_node(obj)
            errs += validate_node_update(obj, current)
            if errs:
                raise err_invalid("Node", name, errs)
            if obj == current or dry_run:
                return copy.deepcopy(obj if dry_run else current), warnings
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self._nodes[name] = obj
            return copy.deepcopy(obj), warnings

    def create_event(self, namespace: str, group: str, ev: dict[str, Any], *,
                     dry_run: bool) -> dict[str, Any]:
        """``Store.Create`` of a decoded core/v1 Event (``metadata.namespace`` set) through the API
        group ``group`` (``""``: core/v1, its legacy validation; ``events.k8s.io``: that API's):
        name generated, validated, stored (unless ``dry_run``). Returns the Event answered."""
        md = ev["metadata"]
        with self._lock:
            if namespace not in self._namespaces:
                raise err_not_found("namespaces", namespace)
            for k in ("creationTimestamp", "uid", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "selfLink"):
                md.pop(k, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = rfc3339()
            if md.get("generateName") and not md.get("name"):
                base = md["generateName"][:58]
                md["name"] = base + "".join(random.choice(_RANDOM_ALPHABET) for _ in range(5))
            ev = roundtrip("Event", ev)[0]
            ev = typed(ev, "Event", "v1")
            md = ev["metadata"]
            errs = validate_event(ev, legacy_only=not group)
            if not errs:
                errs = validate_meta(md, True, path_segment_errors)
            if errs:
                raise err_invalid("Event", md.get("name", ""), errs)
            if md.get("resourceVersion") and not dry_run:  # etcd3 store.Create; the dry-run store skips it
                raise err_internal("resourceVersion should not be set on objects to be created")
            key = (namespace, md["name"])
            if key in self._events:
                raise err_already_exists("events", md["name"], group)
            if not dry_run:
                md["resourceVersion"] = self._next_rv()
                self._events[key] = ev
            return copy.deepcopy(ev)

    def _paginate(self, keys: list[str], query: dict[str, list[str]]) -> tuple[list[str], dict[str, Any]]:
        """``limit`` and ``continue`` over sorted ``keys``: the page and the list's metadata."""
        meta: dict[str, Any] = {"resourceVersion": str(self._rv)}
        start = ""
        token = query.get("continue", [""])[0]
        if token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
                start = decoded["start"]
                if decoded.get("v") != "meta.k8s.io/v1" or not isinstance(start, str):
                    raise ValueError(token)
            except (ValueError, KeyError, TypeError):
                raise err_bad_request(f"continue key is not valid: {token}") from None
        keys = [k for k in keys if k >= start]
        try:
            limit = int(query.get("limit", ["0"])[0] or 0)
        except ValueError:
            bad = goq(query["limit"][0])
            raise err_bad_request(f"strconv.ParseInt: parsing {bad}: invalid syntax") from None
        if 0 < limit < len(keys):
            nxt = {"v": "meta.k8s.io/v1", "rv": self._rv, "start": keys[limit - 1] + "\x00"}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(nxt, separators=(",", ":")).encode()
                                                        ).decode().rstrip("=")
            meta["remainingItemCount"] = len(keys) - limit
            keys = keys[:limit]
        return keys, meta

    def list_nodes(self, query: dict[str, list[str]]) -> dict[str, Any]:
        """A NodeList: the nodes the selectors of ``query`` match, by name, one page of them."""
        labels = parse_label_selector(query.get("labelSelector", [""])[0])
        fields = parse_field_selector(query.get("fieldSelector", [""])[0],
                                      lambda k: k in ("metadata.name", "spec.unschedulable"))
        with self._lock:
            matching = []
            for name in sorted(self._nodes):
                node = self._nodes[name]
                values = {"metadata.name": name,
                          "spec.unschedulable": "true" if node["spec"].get("unschedulable") else "false"}
                if labels_match(node["metadata"].get("labels") or {}, labels) and \
                        fields_match(values, fields):
                    matching.append(name)
            keys, meta = self._paginate(matching, query)
            items = [list_item(self._nodes[n]) for n in keys]
            return {"kind": "NodeList", "apiVersion": "v1", "metadata": meta, "items": items}

    def list_events(self, namespace: str, group: str, query: dict[str, list[str]]) -> dict[str, Any]:
        """An EventList of ``namespace`` (``""``: all) as API group ``group`` serves it."""
        event_fields = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                        "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                        "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type",
                        "metadata.namespace", "metadata.name")
        labels = parse_label_selector(query.get("labelSelector", [""])[0])
        fields = parse_field_selector(query.get("fieldSelector", [""])[0], lambda k: k in event_fields)
        with self._lock:
            chosen: dict[str, dict[str, Any]] = {}
            for (ns, name), ev in self._events.items():
                if namespace and ns != namespace:
                    continue
                inv = ev["involvedObject"]
                values = {f"involvedObject.{k}": inv.get(k, "") for k in
                          ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")}
                values.update({"reason": ev.get("reason", ""),
                               "reportingComponent": ev.get("reportingComponent", ""),
                               "source": ev["source"].get("component", ""), "type": ev.get("type", ""),
                               "metadata.namespace": ns, "metadata.name": name})
                if labels_match(ev["metadata"].get("labels") or {}, labels) and \
                        fields_match(values, fields):
                    chosen[f"{ns}/{name}"] = ev
            keys, meta = self._paginate(sorted(chosen), query)
            convert = core_to_events_v1 if group else copy.deepcopy
            items = [list_item(convert(chosen[k])) for k in keys]
            api_version = "events.k8s.io/v1" if group else "v1"
            return {"kind": "EventList", "apiVersion": api_version, "metadata": meta, "items": items}
