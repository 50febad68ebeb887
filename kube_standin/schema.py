"""The typed schema: what decoding a request into the Go structs keeps, drops and rejects.

The server decodes every body into its typed object and encodes the result, so unknown fields
are dropped (and reported), empty optional fields disappear (``omitempty``), and a value of the
wrong JSON type is refused with ``json.Unmarshal``'s message. :func:`roundtrip` does both steps
over a transcription of the structs the stand-in serves (Node, core/v1 and events.k8s.io/v1
Event, coordination.k8s.io/v1 Lease); the two Event versions convert into each other as the
server stores them (core/v1).
"""

from __future__ import annotations

import copy
import datetime as _dt
import re
from dataclasses import dataclass
from typing import Any

from kube_standin.status import goq, gov

KUBE_VERSION = "v1.37.0"
"""The release whose types and behaviour are reproduced (what ``/version`` and the kubelets report)."""


@dataclass(frozen=True)
class _F:
    """One struct field: JSON name, type, ``omitempty``/``omitzero``."""

    name: str
    type: str
    omit: str = "omitempty"


def _fields(*specs: tuple[Any, ...]) -> tuple[_F, ...]:
    return tuple(_F(*s) for s in specs)


# Transcribed from k8s.io/api core/v1, events/v1 and coordination/v1, apimachinery meta/v1
# (field order = JSON order).
# Types: string, bool, int32, int64, Time, MicroTime, Quantity, any; "*T", "[]T", "map[string]T";
# otherwise a struct below. Required fields (no omitempty) have omit "".
_SCHEMA: dict[str, tuple[_F, ...]] = {
    "ObjectMeta": _fields(
        ("name", "string"), ("generateName", "string"), ("namespace", "string"), ("selfLink", "string"),
        ("uid", "string"), ("resourceVersion", "string"), ("generation", "int64"),
        ("creationTimestamp", "Time", "omitzero"), ("deletionTimestamp", "*Time"),
        ("deletionGracePeriodSeconds", "*int64"), ("labels", "map[string]string"),
        ("annotations", "map[string]string"),
        ("ownerReferences", "[]OwnerReference"), ("finalizers", "[]string"),
        ("managedFields", "[]ManagedFieldsEntry")),
    "OwnerReference": _fields(
        ("apiVersion", "string", ""), ("kind", "string", ""), ("name", "string", ""), ("uid", "string", ""),
        ("controller", "*bool"), ("blockOwnerDeletion", "*bool")),
    "ManagedFieldsEntry": _fields(
        ("manager", "string"), ("operation", "string"), ("apiVersion", "string"), ("time", "*Time"),
        ("fieldsType", "string"), ("fieldsV1", "*any"), ("subresource", "string")),
    "Node": _fields(
        ("kind", "string"), ("apiVersion", "string"), ("metadata", "ObjectMeta"), ("spec", "NodeSpec"),
        ("status", "NodeStatus")),
    "NodeSpec": _fields(
        ("podCIDR", "string"), ("podCIDRs", "[]string"), ("providerID", "string"),
        ("unschedulable", "bool"), ("taints", "[]Taint"), ("configSource", "*NodeConfigSource"),
        ("externalID", "string"), ("podPreemptionPolicy", "*NodePodPreemptionPolicy")),
    "NodePodPreemptionPolicy": _fields(("disableResizePreemption", "[]string"),),
    "Taint": _fields(("key", "string", ""), ("value", "string"), ("effect", "string", ""),
                     ("timeAdded", "*Time")),
    "NodeConfigSource": _fields(("configMap", "*ConfigMapNodeConfigSource"),),
    "ConfigMapNodeConfigSource": _fields(
        ("namespace", "string", ""), ("name", "string", ""), ("uid", "string"), ("resourceVersion", "string"),
        ("kubeletConfigKey", "string", "")),
    "NodeStatus": _fields(
        ("capacity", "map[string]Quantity"), ("allocatable", "map[string]Quantity"), ("phase", "string"),
        ("conditions", "[]NodeCondition"), ("addresses", "[]NodeAddress"),
        ("daemonEndpoints", "NodeDaemonEndpoints"), ("nodeInfo", "NodeSystemInfo"),
        ("images", "[]ContainerImage"), ("volumesInUse", "[]string"), ("volumesAttached", "[]AttachedVolume"),
        ("config", "*NodeConfigStatus"), ("runtimeHandlers", "[]NodeRuntimeHandler"),
        ("features", "*NodeFeatures"), ("declaredFeatures", "[]string")),
    "NodeCondition": _fields(
        ("type", "string", ""), ("status", "string", ""), ("lastHeartbeatTime", "Time"),
        ("lastTransitionTime", "Time"), ("reason", "string"), ("message", "string")),
    "NodeAddress": _fields(("type", "string", ""), ("address", "string", "")),
    "NodeDaemonEndpoints": _fields(("kubeletEndpoint", "DaemonEndpoint"),),
    "DaemonEndpoint": _fields(("Port", "int32", ""),),
    "NodeSystemInfo": _fields(
        ("machineID", "string", ""), ("systemUUID", "string", ""), ("bootID", "string", ""),
        ("kernelVersion", "string", ""), ("osImage", "string", ""), ("containerRuntimeVersion", "string", ""),
        ("kubeletVersion", "string", ""), ("kubeProxyVersion", "string", ""),
        ("operatingSystem", "string", ""), ("architecture", "string", ""), ("swap", "*NodeSwapStatus")),
    "NodeSwapStatus": _fields(("capacity", "*int64"),),
    "ContainerImage": _fields(("names", "[]string", ""), ("sizeBytes", "int64")),
    "AttachedVolume": _fields(("name", "string", ""), ("devicePath", "string", "")),
    "NodeConfigStatus": _fields(
        ("assigned", "*NodeConfigSource"), ("active", "*NodeConfigSource"),
        ("lastKnownGood", "*NodeConfigSource"), ("error", "string")),
    "NodeRuntimeHandler": _fields(("name", "string", ""), ("features", "*NodeRuntimeHandlerFeatures")),
    "NodeRuntimeHandlerFeatures": _fields(("recursiveReadOnlyMounts", "*bool"), ("userNamespaces", "*bool")),
    "NodeFeatures": _fields(("supplementalGroupsPolicy", "*bool"),),
    "Event": _fields(
        ("kind", "string"), ("apiVersion", "string"), ("metadata", "ObjectMeta", ""),
        ("involvedObject", "ObjectReference", ""), ("reason", "string"), ("message", "string"),
        ("source", "EventSource"), ("firstTimestamp", "Time"), ("lastTimestamp", "Time"), ("count", "int32"),
        ("type", "string"), ("eventTime", "MicroTime"), ("series", "*EventSeries"), ("action", "string"),
        ("related", "*ObjectReference"), ("reportingComponent", "string", ""),
        ("reportingInstance", "string", "")),
    "ObjectReference": _fields(
        ("kind", "string"), ("namespace", "string"), ("name", "string"), ("uid", "string"),
        ("apiVersion", "string"), ("resourceVersion", "string"), ("fieldPath", "string")),
    "EventSource": _fields(("component", "string"), ("host", "string")),
    "EventSeries": _fields(("count", "int32"), ("lastObservedTime", "MicroTime")),
    "EventsV1Event": _fields(
        ("kind", "string"), ("apiVersion", "string"), ("metadata", "ObjectMeta", ""),
        ("eventTime", "MicroTime", ""), ("series", "*EventsV1EventSeries"), ("reportingController", "string"),
        ("reportingInstance", "string"), ("action", "string"), ("reason", "string"),
        ("regarding", "ObjectReference"), ("related", "*ObjectReference"), ("note", "string"),
        ("type", "string"), ("deprecatedSource", "EventSource"), ("deprecatedFirstTimestamp", "Time"),
        ("deprecatedLastTimestamp", "Time"), ("deprecatedCount", "int32")),
    "EventsV1EventSeries": _fields(("count", "int32", ""), ("lastObservedTime", "MicroTime", "")),
    "Lease": _fields(("kind", "string"), ("apiVersion", "string"), ("metadata", "ObjectMeta"),
                     ("spec", "LeaseSpec")),
    "LeaseSpec": _fields(
        ("holderIdentity", "*string"), ("leaseDurationSeconds", "*int32"), ("acquireTime", "*MicroTime"),
        ("renewTime", "*MicroTime"), ("leaseTransitions", "*int32"), ("strategy", "*string"),
        ("preferredHolder", "*string")),
}
_FIELD_INDEX = {t: {f.name: f for f in fs} for t, fs in _SCHEMA.items()}
_GO_TYPE_NAMES = {"EventsV1Event": "v1.Event", "EventsV1EventSeries": "v1.EventSeries"}
_QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_DATE_TIME = r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})"
_RFC3339_RE = re.compile(_DATE_TIME + r"(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
_RFC3339_MICRO_RE = re.compile(_DATE_TIME + r"(\.\d{6})(Z|[+-]\d{2}:\d{2})$")  # exactly 6 digits, as Go


class DecodeError(Exception):
    """What ``json.Unmarshal`` into the typed object reports (the first type mismatch)."""


def _go_type(t: str) -> str:
    if t.startswith("*"):
        return _go_type(t[1:])
    if t.startswith("[]"):
        return "[]" + _go_type(t[2:])
    if t.startswith("map[string]"):
        return "map[string]" + _go_type(t[11:])
    return {"string": "string", "bool": "bool", "int32": "int32", "int64": "int64", "Time": "v1.Time",
            "MicroTime": "v1.MicroTime", "Quantity": "resource.Quantity", "any": "interface {}"}.get(
        t, _GO_TYPE_NAMES.get(t, f"v1.{t}"))


def json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "object" if isinstance(v, dict) else "array" if isinstance(v, list) else "value"


def _zero(t: str) -> Any:
    if t in ("string", "Quantity"):
        return ""
    if t == "bool":
        return False
    if t in ("int32", "int64"):
        return 0
    if t in ("Time", "MicroTime", "any") or t.startswith(("*", "[]", "map[")):
        return None
    return {f.name: _zero(f.type) for f in _SCHEMA[t]}


def _parse_time(raw: str, micro: bool) -> _dt.datetime:
    m = (_RFC3339_MICRO_RE if micro else _RFC3339_RE).match(raw)
    layout = "2006-01-02T15:04:05.000000Z07:00" if micro else "2006-01-02T15:04:05Z07:00"
    if not m:
        raise DecodeError(f"parsing time {goq(raw)} as {goq(layout)}: cannot parse {goq(raw)} as "
                          f"{goq(layout)}")
    y, mo, d, h, mi, s, frac, tz = m.groups()
    try:
        offset = _dt.timedelta(0) if tz == "Z" else \
            (1 if tz[0] == "+" else -1) * _dt.timedelta(hours=int(tz[1:3]), minutes=int(tz[4:6]))
        micros = int((frac or ".0")[1:7].ljust(6, "0"))
        return _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micros,
                            tzinfo=_dt.timezone(offset)).astimezone(_dt.timezone.utc)
    except ValueError as e:
        raise DecodeError(f"parsing time {goq(raw)}: {e}") from None


class _Decoder:
    """Decode JSON into the Go structs' shape: record unknown fields, reject type mismatches."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.unknown: list[str] = []

    def _mismatch(self, raw: Any, t: str, path: str) -> DecodeError:
        value = json_kind(raw)
        if isinstance(raw, (int, float)) and not isinstance(raw, bool) and t in ("int32", "int64"):
            value = f"number {raw}"
        plain = re.sub(r"\[\d+\]", "", path)
        root = "Event" if self.root == "EventsV1Event" else self.root
        where = f"Go struct field {root}.{plain}" if plain else "Go value"
        return DecodeError(f"json: cannot unmarshal {value} into {where} of type {_go_type(t)}")

    def decode(self, t: str, raw: Any, path: str = "") -> Any:
        if raw is None:
            return _zero(t)
        if t.startswith("*"):
            return self.decode(t[1:], raw, path)
        if t.startswith("[]"):
            if not isinstance(raw, list):
                raise self._mismatch(raw, t, path)
            return [self.decode(t[2:], v, f"{path}[{i}]") for i, v in enumerate(raw)]
        if t.startswith("map[string]"):
            if not isinstance(raw, dict):
                raise self._mismatch(raw, t, path)
            return {k: self.decode(t[11:], v, f"{path}.{k}" if path else k) for k, v in raw.items()}
        if t == "any":
            return raw
        if t == "string":
            if not isinstance(raw, str):
                raise self._mismatch(raw, t, path)
            return raw
        if t == "bool":
            if not isinstance(raw, bool):
                raise self._mismatch(raw, t, path)
            return raw
        if t in ("int32", "int64"):
            bits = 31 if t == "int32" else 63
            if isinstance(raw, bool) or not isinstance(raw, int) or not -(2 ** bits) <= raw < 2 ** bits:
                raise self._mismatch(raw, t, path)
            return raw
        if t == "Quantity":
            if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
                raise self._mismatch(raw, t, path)
            text = raw.strip() if isinstance(raw, str) else gov(raw)
            if not _QUANTITY_RE.match(text):
                raise DecodeError("quantities must match the regular expression "
                                  "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")
            return text
        if t in ("Time", "MicroTime"):
            if not isinstance(raw, str):
                raise self._mismatch(raw, t, path)
            return _parse_time(raw, t == "MicroTime")
        if not isinstance(raw, dict):
            raise self._mismatch(raw, t, path)
        out = _zero(t)
        index = _FIELD_INDEX[t]
        for k, v in raw.items():
            sub = f"{path}.{k}" if path else k
            f = index.get(k)
            if f is None:
                self.unknown.append(sub)
                continue
            out[k] = self.decode(f.type, v, sub)
        return out


def format_time(v: _dt.datetime, micro: bool) -> str:
    return v.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


def _omitted(f: _F, v: Any) -> bool:
    """Go's ``omitempty`` (structs are never empty) and ``omitzero``."""
    t = f.type
    if f.omit == "omitzero" and t in ("Time", "MicroTime"):
        return v is None
    if not f.omit or t in ("Time", "MicroTime") or t in _SCHEMA:
        return False
    if t.startswith("*") or t == "any":
        return v is None
    if t.startswith(("[]", "map[")):
        return not v
    return v == "" or v is False or (type(v) is int and v == 0)


def _encode(t: str, v: Any) -> Any:
    if t.startswith("*"):
        return None if v is None else _encode(t[1:], v)
    if t.startswith("[]"):
        return None if v is None else [_encode(t[2:], x) for x in v]
    if t.startswith("map[string]"):
        return None if v is None else {k: _encode(t[11:], v[k]) for k in sorted(v)}
    if t in ("Time", "MicroTime"):
        return None if v is None else format_time(v, t == "MicroTime")
    if t not in _SCHEMA:
        return v
    return {f.name: _encode(f.type, v[f.name]) for f in _SCHEMA[t] if not _omitted(f, v[f.name])}


def roundtrip(t: str, raw: Any) -> tuple[dict[str, Any], list[str]]:
    """Decode then encode: the object as the server stores and serves it, and the dropped fields."""
    dec = _Decoder(t)
    value = dec.decode(t, raw)
    return _encode(t, value), dec.unknown


_EVENTS_V1_TO_CORE = {
    "regarding": "involvedObject", "note": "message", "reportingController": "reportingComponent",
    "deprecatedSource": "source", "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp", "deprecatedCount": "count",
}


def events_v1_to_core(ev: dict[str, Any]) -> dict[str, Any]:
    """An ``events.k8s.io/v1`` Event as the server stores it (core/v1)."""
    out = {_EVENTS_V1_TO_CORE.get(k, k): copy.deepcopy(v) for k, v in ev.items()}
    out["kind"], out["apiVersion"] = "Event", "v1"
    return roundtrip("Event", out)[0]


def core_to_events_v1(ev: dict[str, Any]) -> dict[str, Any]:
    """A stored (core/v1) Event as ``events.k8s.io/v1`` serves it."""
    back = {v: k for k, v in _EVENTS_V1_TO_CORE.items()}
    out = {back.get(k, k): copy.deepcopy(v) for k, v in ev.items()}
    out["kind"], out["apiVersion"] = "Event", "events.k8s.io/v1"
    return roundtrip("EventsV1Event", out)[0]


def typed(obj: dict[str, Any], kind: str, api_version: str) -> dict[str, Any]:
    """``obj`` with the ``kind`` and ``apiVersion`` the encoder writes (first, as Go does)."""
    rest = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    return {"kind": kind, "apiVersion": api_version, **rest}


def list_item(obj: dict[str, Any]) -> dict[str, Any]:
    """An item of a list answer: the real server leaves ``kind`` and ``apiVersion`` out of items."""
    return {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("kind", "apiVersion")}


def default_node(node: dict[str, Any]) -> None:
    """``SetDefaults_NodeStatus``: allocatable defaults to capacity."""
    status = node.setdefault("status", {})
    if not status.get("allocatable") and status.get("capacity"):
        status["allocatable"] = dict(status["capacity"])


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


def rfc3339(t: _dt.datetime | None = None) -> str:
    """``metav1.Time`` on the wire: whole seconds, UTC (now, by default)."""
    return format_time(t or _now(), micro=False)

