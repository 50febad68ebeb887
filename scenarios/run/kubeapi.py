"""A Kubernetes API server stand-in on loopback, for tests and for the fault-injection campaign.

Why it exists: the node quarantine (``sdc_guard.remediation``) talks to kube-apiserver through the
official ``kubernetes`` client. Mocking the client would only test our *beliefs* about the server;
a real cluster (kind, k3s) is too heavy to start per test or per campaign trial. This module serves
the small part of the core API the quarantine uses, over real HTTP on 127.0.0.1, with the real
server's semantics and wire format, so the official client (and anything else that speaks HTTP)
can be pointed at it through a kubeconfig it writes, and so tests can inject the failures a real
control plane produces (403, 409, 500, 503, slow answers, the server going away).

Served (everything else answers a 404 Status; a known path with a verb not served answers 405):

* ``GET /api/v1/nodes`` (``labelSelector``: ``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``,
  ``>``, ``<``; ``fieldSelector`` on ``metadata.name`` and ``spec.unschedulable``; ``limit`` and
  ``continue``), ``GET``/``PATCH``/``PUT`` on ``/api/v1/nodes/{name}`` and ``.../{name}/status``.
* ``POST``/``GET`` ``/api/v1/namespaces/{ns}/events``, ``GET /api/v1/events``, ``GET .../events/{name}``,
  ``POST``/``GET`` ``/apis/events.k8s.io/v1/namespaces/{ns}/events`` (stored once, as core/v1 Events).
* ``GET /version``.

What is reproduced, and where it was read (the Go sources of kubernetes/apiserver, apimachinery,
api and kubernetes, 2026 heads, i.e. Kubernetes 1.37, the release the ``kubernetes`` v37 client targets):

* PATCH (``handlers/patch.go``): the accepted types are checked first (415 ``UnsupportedMediaType``,
  message ``the body of the request was in an unknown format - accepted media types include: ...``);
  then the options (``dryRun`` other than ``All`` and bad ``fieldValidation``/``fieldManager`` are a
  422 ``PatchOptions.meta.k8s.io "" is invalid``, not a 400); then the body must be JSON (400
  ``invalid JSON patch``). JSON merge patch is RFC 7386 as evanphx/json-patch does it. Strategic
  merge patch is a port of ``apimachinery/pkg/util/strategicpatch`` with the Node's struct tags:
  ``status.conditions`` and ``status.addresses`` merge by ``type``, ``metadata.ownerReferences`` by
  ``uid``, ``metadata.finalizers`` and ``spec.podCIDRs`` are merged sets, and every other list
  (``spec.taints`` included: it has no ``patchStrategy``) is replaced whole, so a client that sends
  only its own taint drops everyone else's. ``$patch`` (``replace``/``delete``), ``$retainKeys``,
  ``$setElementOrder/`` and ``$deleteFromPrimitiveList/`` are honoured, and so is the ordering (an
  item new to a merged list goes first; without ``$setElementOrder``); the port gives the expected
  result on all 252 apply cases of apimachinery's ``patch_test.go``. JSON patch (RFC 6902, with the
  ``jsonpatch`` library) that fails, a failed ``test`` included, is a 422 ``Invalid`` whose message is
  only ``the server rejected our request due to an error in our request`` (the real server drops the
  library's text: ``NewGenericServerResponse(422, ..., isUnexpectedResponse=false)``).
* The result is decoded into the typed object, as the server does: unknown fields are dropped (a
  ``Warning: 299`` header per field; ``fieldValidation=Strict`` makes it a 422), empty optional
  fields disappear (``omitempty``: patching ``spec.taints`` to ``[]`` leaves no ``taints`` key),
  a wrong type is a 422 ``patch: Invalid value``. A PATCH/PUT of the node never changes its status,
  one of ``/status`` never changes its spec (``nodeStrategy.PrepareForUpdate``).
* Then the name must match the URL (400), a ``metadata.resourceVersion`` in the result must equal the
  stored one (409 ``Conflict``: ``Operation cannot be fulfilled on nodes "n1": the object has been
  modified; please apply your changes to the latest version and try again``), ``uid`` may not change
  (422 ``field is immutable``), ``creationTimestamp`` changes are silently reverted, and the node is
  validated: taint key/value/effect, duplicate (key, effect) pairs (reported, as the real server
  does, under ``metadata.taints[i]``), label and annotation keys and values, the 262144-byte total
  for annotations (``metadata.annotations: Too long: may not be more than 262144 bytes``, the wording
  since 1.32; 1.31 and older said ``must have at most 262144 bytes``), ``spec.providerID`` and
  ``spec.podCIDRs`` immutability. A write that changes nothing keeps the resourceVersion (etcd is not
  written). ``resourceVersion`` is one cluster-wide counter, a decimal string.
* ``dryRun=All`` runs all of it and answers the would-be object (with the stored resourceVersion for
  an update, none for a create) and stores nothing.
* Events (core/v1): the namespace must exist (404 ``namespaces "x" not found``; ``default``,
  ``kube-system``, ``kube-public``, ``kube-node-lease`` exist, see :meth:`StandInAPIServer.add_namespace`);
  the legacy event validation applies: an event whose ``involvedObject`` has no namespace (a Node)
  may only be created in ``default`` (or with no namespace); ``metadata.name`` or ``generateName``
  is required; ``generateName`` gets 5 random characters. There is no check that ``involvedObject``
  is present: the real server has none either. ``events.k8s.io/v1`` creations get that API's strict
  validation (``eventTime``, ``reportingController``, ``action``, ...). ``eventTime`` is a MicroTime:
  exactly six fraction digits, or a 400 (a Python ``datetime`` with no microseconds is refused).
* HTTPS when given a certificate and key (``tls=``), as a pod's in-cluster client reaches the
  real server (``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, verified against the
  service account's ``ca.crt``); plain HTTP otherwise.
* Authentication by bearer token (401 ``Unauthorized``); RBAC denials with the real message
  (``nodes "n1" is forbidden: User "..." cannot patch resource "nodes" in API group "" at the cluster
  scope``); Status bodies byte-compatible with ``metav1.Status`` (``details`` only where the server
  sets it; ``kind`` in details is the resource for NotFound/Conflict/Forbidden and the Kind for
  Invalid). :meth:`StandInAPIServer.fail` answers before authentication and without processing;
  :meth:`StandInAPIServer.delay` processes at once and holds the answer.

Not reproduced: watch, server-side apply (``application/apply-patch+yaml`` is answered 415, and the
415 message lists only the three types served, as a server with server-side apply disabled would),
protobuf/CBOR, ``managedFields``, admission webhooks, quantity canonicalisation (``"1000m"`` stays as
sent), consistent snapshots for paginated lists, and node creation through the API (nodes are made
with :meth:`StandInAPIServer.add_node`, as a kubelet would register them).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime as _dt
import http.server
import json
import random
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["RequestRecord", "StandInAPIServer"]

KUBE_VERSION = "v1.37.0"
"""The release whose behaviour is reproduced (and what ``/version`` and the nodes' kubelets report)."""

DEFAULT_USER = "system:serviceaccount:default:sdc-guard"
"""Who the bearer token authenticates as, in RBAC denials."""

_JSON = "application/json"
_JSON_PATCH = "application/json-patch+json"
_MERGE_PATCH = "application/merge-patch+json"
_SMP = "application/strategic-merge-patch+json"
_PATCH_TYPES = (_JSON_PATCH, _MERGE_PATCH, _SMP)
_MAX_BODY = 3 * 1024 * 1024  # apiserver --max-request-body-bytes default
_MAX_JSON_PATCH_OPS = 10000
_ANNOTATIONS_LIMIT = 256 * 1024
_OPTIMISTIC_LOCK = ("the object has been modified; please apply your changes to the latest version "
                    "and try again")
_DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


# -- Go-style rendering of values in messages ------------------------------------------------------
def _goq(s: str) -> str:
    """Go's ``%q`` for the strings that appear in messages (close enough: JSON string escaping)."""
    return json.dumps(s, ensure_ascii=False)


def _gojson(v: Any) -> str:
    """Go's ``json.Marshal`` of a value, HTML-escaped as Go does."""
    out = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    return out.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _gov(v: Any) -> str:
    """Go's ``%v`` of a decoded-JSON value (``map[k:v]``, ``[a b]``, ``<nil>``)."""
    if v is None:
        return "<nil>"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{_gov(v[k])}" for k in sorted(v)) + "]"
    if isinstance(v, list):
        return "[" + " ".join(_gov(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(int(v)) if v.is_integer() and abs(v) < 1e21 else repr(v)
    return str(v)


def _gotype(v: Any) -> str:
    """``reflect.TypeOf(v)`` of a decoded-JSON value, for mergepatch's error messages."""
    if v is None:
        return "<nil>"
    return {dict: "map[string]interface {}", list: "[]interface {}", str: "string", bool: "bool",
            int: "int64", float: "float64"}.get(type(v), type(v).__name__)


# -- field errors and Status bodies -------------------------------------------------------------
_OMIT = object()

_FIELD_ERROR_TEXT = {
    "FieldValueRequired": "Required value", "FieldValueInvalid": "Invalid value",
    "FieldValueNotSupported": "Unsupported value", "FieldValueDuplicate": "Duplicate value",
    "FieldValueForbidden": "Forbidden", "FieldValueTooLong": "Too long",
}


@dataclass(frozen=True)
class _FieldError:
    """``field.Error``: rendered exactly as ``ErrorBody`` does since 1.34 (JSON for non-scalars)."""

    type: str
    field: str
    bad: Any = _OMIT
    detail: str = ""

    def body(self) -> str:
        text = _FIELD_ERROR_TEXT[self.type]
        bodyless = ("FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong")
        if self.type in bodyless or self.bad is _OMIT:
            s = text
        elif isinstance(self.bad, bool):
            s = f"{text}: {'true' if self.bad else 'false'}"
        elif isinstance(self.bad, (int, float)):
            s = f"{text}: {self.bad}"
        elif isinstance(self.bad, str):
            s = f"{text}: {_goq(self.bad)}"
        else:
            s = f"{text}: {_gojson(self.bad)}"
        return f"{s}: {self.detail}" if self.detail else s

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def _required(path: str, detail: str = "") -> _FieldError:
    return _FieldError("FieldValueRequired", path, "", detail)


def _invalid_value(path: str, bad: Any, detail: str) -> _FieldError:
    return _FieldError("FieldValueInvalid", path, bad, detail)


def _not_supported(path: str, bad: Any, allowed: list[str]) -> _FieldError:
    return _FieldError("FieldValueNotSupported", path, bad,
                       "supported values: " + ", ".join(_goq(a) for a in allowed) if allowed else "")


def _aggregate(errs: list[_FieldError]) -> str:
    """``utilerrors.Aggregate.Error()``: duplicates (by text) removed, brackets when more than one."""
    seen: list[str] = []
    for e in errs:
        if str(e) not in seen:
            seen.append(str(e))
    return seen[0] if len(seen) == 1 else "[" + ", ".join(seen) + "]"


class _APIError(Exception):
    """An error the server answers with a ``metav1.Status`` (or, for 429, plain text)."""

    def __init__(self, status: dict[str, Any], headers: dict[str, str] | None = None,
                 text: str | None = None) -> None:
        super().__init__(status.get("message", ""))
        self.status = status
        self.code = int(status["code"])
        self.headers = headers or {}
        self.text = text


def _details(name: str = "", group: str = "", kind: str = "", causes: list[dict[str, str]] | None = None,
             retry_after: int = 0) -> dict[str, Any]:
    d: dict[str, Any] = {}
    if name:
        d["name"] = name
    if group:
        d["group"] = group
    if kind:
        d["kind"] = kind
    if causes:
        d["causes"] = causes
    if retry_after:
        d["retryAfterSeconds"] = retry_after
    return d


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A failure ``metav1.Status`` with Go's field order and ``omitempty``s."""
    st: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    if message:
        st["message"] = message
    if reason:
        st["reason"] = reason
    if details is not None:
        st["details"] = details
    st["code"] = code
    return st


def _gr(resource: str, group: str) -> str:
    """``schema.GroupResource.String()``."""
    return f"{resource}.{group}" if group else resource


def _err_not_found(resource: str, name: str, group: str = "") -> _APIError:
    return _APIError(_status(404, "NotFound", f"{_gr(resource, group)} {_goq(name)} not found",
                             _details(name=name, group=group, kind=resource)))


def _err_already_exists(resource: str, name: str, group: str = "") -> _APIError:
    return _APIError(_status(409, "AlreadyExists", f"{_gr(resource, group)} {_goq(name)} already exists",
                             _details(name=name, group=group, kind=resource)))


def _err_conflict(resource: str, name: str, why: str = _OPTIMISTIC_LOCK, group: str = "") -> _APIError:
    return _APIError(_status(409, "Conflict",
                             f"Operation cannot be fulfilled on {_gr(resource, group)} {_goq(name)}: {why}",
                             _details(name=name, group=group, kind=resource)))


def _err_bad_request(message: str) -> _APIError:
    return _APIError(_status(400, "BadRequest", message))


def _err_invalid(kind: str, name: str, errs: list[_FieldError], group: str = "") -> _APIError:
    """``errors.NewInvalid``: every error is a cause; the message lists each distinct one once."""
    qualified = f"{kind}.{group}" if group else kind
    causes = [{"reason": e.type, "message": e.body(), "field": e.field} for e in errs]
    message = f"{qualified} {_goq(name)} is invalid"
    if errs:
        message += ": " + _aggregate(errs)
    return _APIError(_status(422, "Invalid", message, _details(name=name, group=group, kind=kind,
                                                                causes=causes)))


def _err_generic(code: int, server_message: str = "") -> _APIError:
    """``errors.NewGenericServerResponse(code, "", {}, "", msg, 0, false)``: what go-restful and a
    failed JSON patch produce (``details`` present but empty)."""
    reason, message = {
        400: ("BadRequest", "the server rejected our request for an unknown reason"),
        401: ("Unauthorized", "the server has asked for the client to provide credentials"),
        403: ("Forbidden", server_message),
        404: ("NotFound", "the server could not find the requested resource"),
        405: ("MethodNotAllowed", "the server does not allow this method on the requested resource"),
        409: ("Conflict", "the server reported a conflict"),
        415: ("UnsupportedMediaType", server_message),
        422: ("Invalid", "the server rejected our request due to an error in our request"),
        429: ("TooManyRequests", "the server has received too many requests and has asked us to try "
                                 "again later"),
        503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
        504: ("Timeout", "the server was unable to return a response in the time allotted, but may "
                         "still be processing the request"),
    }.get(code, ("", f"the server responded with the status code {code} but did not return more "
                     "information"))
    if code >= 500 and code not in (503, 504):
        reason, message = "InternalError", f"an error on the server ({_goq(server_message)}) has prevented " \
                                           "the request from succeeding"
    return _APIError(_status(code, reason, message, {}))


def _err_internal(message: str) -> _APIError:
    """An error that is not an ``APIStatus`` (``ErrorToAPIStatus``: 500, reason empty)."""
    return _APIError(_status(500, "", message))


def _err_unsupported_media(accepted: tuple[str, ...]) -> _APIError:
    return _APIError(_status(415, "UnsupportedMediaType",
                             "the body of the request was in an unknown format - accepted media types "
                             "include: " + ", ".join(accepted)))


def _err_unauthorized() -> _APIError:
    return _APIError(_status(401, "Unauthorized", "Unauthorized"))


# -- name, label and annotation rules (apimachinery/pkg/util/validation, api/validate/content) -----
_LABEL_KEY_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_KEY_RE = re.compile(f"^{_LABEL_KEY_FMT}$")
_LABEL_KEY_MSG = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
                  "an alphanumeric character")
_LABEL_VALUE_FMT = f"({_LABEL_KEY_FMT})?"
_LABEL_VALUE_RE = re.compile(f"^{_LABEL_VALUE_FMT}$")
_DNS_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL_RE = re.compile(f"^{_DNS_LABEL_FMT}$")
_DNS_SUBDOMAIN_FMT = _DNS_LABEL_FMT + "(\\." + _DNS_LABEL_FMT + ")*"
_DNS_SUBDOMAIN_RE = re.compile(f"^{_DNS_SUBDOMAIN_FMT}$")
_RANDOM_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # utilrand.String


def _regex_error(msg: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    return msg + " (e.g. " + " or ".join(f"'{e}', " for e in examples)[:-2] + \
        f", regex used for validation is '{fmt}')"


def _max_len(n: int) -> str:
    return f"must be no more than {n} characters"


def _dns_subdomain_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append(_max_len(253))
    if not _DNS_SUBDOMAIN_RE.match(value):
        errs.append(_regex_error("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                 "characters, '-' or '.', and must start and end with an alphanumeric "
                                 "character", _DNS_SUBDOMAIN_FMT, "example.com"))
    return errs


def _dns_label_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append(_max_len(63))
    if not _DNS_LABEL_RE.match(value):
        if _DNS_SUBDOMAIN_RE.match(value):
            errs.append("must not contain dots")
        else:
            errs.append(_regex_error("a lowercase RFC 1123 label must consist of lower case alphanumeric "
                                     "characters or '-', and must start and end with an alphanumeric "
                                     "character", _DNS_LABEL_FMT, "my-name", "123-abc"))
    return errs


def _label_key_errors(value: str) -> list[str]:
    """``content.IsLabelKey`` (``IsQualifiedName``)."""
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs.extend("prefix part " + m for m in _dns_subdomain_errors(prefix))
    else:
        return ["a valid label key " + _regex_error(_LABEL_KEY_MSG, _LABEL_KEY_FMT, "MyName", "my.name",
                                                    "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part " + _max_len(63))
    if not _LABEL_KEY_RE.match(name):
        errs.append("name part " + _regex_error(_LABEL_KEY_MSG, _LABEL_KEY_FMT, "MyName", "my.name",
                                                "123-abc"))
    return errs


def _label_value_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append(_max_len(63))
    if not _LABEL_VALUE_RE.match(value):
        errs.append(_regex_error("a valid label must be an empty string or consist of alphanumeric "
                                 "characters, '-', '_' or '.', and must start and end with an alphanumeric "
                                 "character", _LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errs


def _path_segment_errors(name: str, prefix: bool) -> list[str]:
    """``path.IsValidPathSegmentName`` (the generic check every object name gets)."""
    if not prefix and name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]


# -- the typed schema: what decoding into the Go structs keeps, drops and rejects -------------------
@dataclass(frozen=True)
class _F:
    """One struct field: JSON name, type, ``omitempty``/``omitzero``, patch strategy and merge key."""

    name: str
    type: str
    omit: str = "omitempty"
    strategy: str = ""
    key: str = ""


def _fields(*specs: tuple[Any, ...]) -> tuple[_F, ...]:
    return tuple(_F(*s) for s in specs)


# Transcribed from k8s.io/api core/v1 and events/v1, apimachinery meta/v1 (field order = JSON order).
# Types: string, bool, int32, int64, Time, MicroTime, Quantity, any; "*T", "[]T", "map[string]T";
# otherwise a struct below. Required fields (no omitempty) have omit "".
_SCHEMA: dict[str, tuple[_F, ...]] = {
    "ObjectMeta": _fields(
        ("name", "string"), ("generateName", "string"), ("namespace", "string"), ("selfLink", "string"),
        ("uid", "string"), ("resourceVersion", "string"), ("generation", "int64"),
        ("creationTimestamp", "Time", "omitzero"), ("deletionTimestamp", "*Time"),
        ("deletionGracePeriodSeconds", "*int64"), ("labels", "map[string]string"),
        ("annotations", "map[string]string"),
        ("ownerReferences", "[]OwnerReference", "omitempty", "merge", "uid"),
        ("finalizers", "[]string", "omitempty", "merge"), ("managedFields", "[]ManagedFieldsEntry")),
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
        ("podCIDR", "string"), ("podCIDRs", "[]string", "omitempty", "merge"), ("providerID", "string"),
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
        ("conditions", "[]NodeCondition", "omitempty", "merge", "type"),
        ("addresses", "[]NodeAddress", "omitempty", "merge", "type"),
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
}
_FIELD_INDEX = {t: {f.name: f for f in fs} for t, fs in _SCHEMA.items()}
_GO_TYPE_NAMES = {"EventsV1Event": "v1.Event", "EventsV1EventSeries": "v1.EventSeries"}
_QUANTITY_RE = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_DATE_TIME = r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})"
_RFC3339_RE = re.compile(_DATE_TIME + r"(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
_RFC3339_MICRO_RE = re.compile(_DATE_TIME + r"(\.\d{6})(Z|[+-]\d{2}:\d{2})$")  # exactly 6 digits, as Go


class _DecodeError(Exception):
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


def _json_kind(v: Any) -> str:
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
        raise _DecodeError(f"parsing time {_goq(raw)} as {_goq(layout)}: cannot parse {_goq(raw)} as "
                           f"{_goq(layout)}")
    y, mo, d, h, mi, s, frac, tz = m.groups()
    try:
        offset = _dt.timedelta(0) if tz == "Z" else \
            (1 if tz[0] == "+" else -1) * _dt.timedelta(hours=int(tz[1:3]), minutes=int(tz[4:6]))
        micros = int((frac or ".0")[1:7].ljust(6, "0"))
        return _dt.datetime(int(y), int(mo), int(d), int(h), int(mi), int(s), micros,
                            tzinfo=_dt.timezone(offset)).astimezone(_dt.timezone.utc)
    except ValueError as e:
        raise _DecodeError(f"parsing time {_goq(raw)}: {e}") from None


class _Decoder:
    """Decode JSON into the Go structs' shape: record unknown fields, reject type mismatches."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.unknown: list[str] = []

    def _mismatch(self, raw: Any, t: str, path: str) -> _DecodeError:
        value = _json_kind(raw)
        if isinstance(raw, (int, float)) and not isinstance(raw, bool) and t in ("int32", "int64"):
            value = f"number {raw}"
        plain = re.sub(r"\[\d+\]", "", path)
        root = "Event" if self.root == "EventsV1Event" else self.root
        where = f"Go struct field {root}.{plain}" if plain else "Go value"
        return _DecodeError(f"json: cannot unmarshal {value} into {where} of type {_go_type(t)}")

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
            text = raw.strip() if isinstance(raw, str) else _gov(raw)
            if not _QUANTITY_RE.match(text):
                raise _DecodeError("quantities must match the regular expression "
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


def _format_time(v: _dt.datetime, micro: bool) -> str:
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
        return None if v is None else _format_time(v, t == "MicroTime")
    if t not in _SCHEMA:
        return v
    return {f.name: _encode(f.type, v[f.name]) for f in _SCHEMA[t] if not _omitted(f, v[f.name])}


def _roundtrip(t: str, raw: Any) -> tuple[dict[str, Any], list[str]]:
    """Decode then encode: the object as the server stores and serves it, and the dropped fields."""
    dec = _Decoder(t)
    value = dec.decode(t, raw)
    return _encode(t, value), dec.unknown


# -- JSON merge patch (evanphx/json-patch MergePatch) ---------------------------------------------------
def _prune_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _prune_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_prune_nulls(x) for x in v]
    return v


def _merge_patch(doc: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return _prune_nulls(patch)
    out = dict(doc) if isinstance(doc, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge_patch(out[k], v)
        else:
            out[k] = _prune_nulls(v)
    return out


# -- strategic merge patch (port of apimachinery/pkg/util/strategicpatch, server side) -----------------
_DIRECTIVE = "$patch"
_RETAIN_KEYS = "$retainKeys"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList"
_SET_ORDER = "$setElementOrder"


class _SMPError(Exception):
    """An error of the strategic merge; ``code`` 400/422 for mergepatch's sentinels, else 500."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


_ERR_BAD_PRIMITIVE_LIST = "invalid patch format of primitive list"
_ERR_BAD_RETAIN_KEYS = "invalid patch format of retainKeys"
_ERR_BAD_SET_ORDER = "invalid patch format of setElementOrder list"


def _smp_lookup(schema: str | None, key: str) -> tuple[str | None, str, str]:
    """(sub-schema, patch strategy, merge key) of ``key`` in a struct or map type."""
    if schema is None:
        return None, "", ""
    if schema.startswith("map[string]"):
        return _smp_elem(schema[11:]), "", ""
    f = _FIELD_INDEX.get(schema, {}).get(key)
    if f is None:
        return None, "", ""
    return _smp_elem(f.type), f.strategy, f.key


def _smp_elem(t: str) -> str | None:
    while t.startswith(("*", "[]")):
        t = t[1:] if t.startswith("*") else t[2:]
    return t if (t in _SCHEMA or t.startswith("map[")) else None


def _bad_arg_type(expected: str, actual: Any) -> _SMPError:
    return _SMPError(f"expected a {expected}, but received a {_gotype(actual)}")


def _no_merge_key(m: dict[str, Any], key: str) -> _SMPError:
    return _SMPError(f"map: {_gov(m)} does not contain declared merge key: {key}")


def _remove_directives(obj: Any) -> tuple[Any, bool]:
    if isinstance(obj, dict):
        if _DIRECTIVE in obj:
            return None, False
        out = {}
        for k, v in obj.items():
            nv, keep = _remove_directives(v)
            if keep:
                out[k] = nv
        return out, True
    if isinstance(obj, list):
        return [nv for nv, keep in (_remove_directives(v) for v in obj) if keep], True
    return obj, True


def _discard_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _discard_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_discard_nulls(x) for x in v]
    return v


def _slice_element_type(*slices: list[Any]) -> type:
    prev: type | None = None
    for s in slices:
        for v in s:
            cur = type(v)
            if prev is None:
                prev = cur
                if cur is list:
                    raise _SMPError("lists of lists are not supported", 422)
            elif prev is not cur:
                raise _SMPError("list element types are not identical: ["
                                + " ".join(_gov(x) for x in slices) + "]")
    if prev is None:
        raise _SMPError("no elements in any of the given slices")
    return prev


def _merge_value(item: Any, key: str, is_map: bool) -> Any:
    return item.get(key) if (is_map and isinstance(item, dict)) else (None if is_map else item)


def _index(items: list[Any], val: Any, key: str, is_map: bool) -> int:
    want = _merge_value(val, key, is_map)
    for i, v in enumerate(items):
        if _merge_value(v, key, is_map) == want:
            return i
    return -1


def _find_by_key(items: list[Any], key: str, value: Any) -> tuple[dict[str, Any] | None, int]:
    for i, v in enumerate(items):
        if not isinstance(v, dict):
            raise _SMPError(f"value for key {i} is not a map")
        if key in v and v[key] == value:
            return v, i
    return None, -1


def _normalize_slice_order(to_sort: list[Any], order: list[Any], key: str, is_map: bool) -> list[Any]:
    to_delete: list[Any] = []
    if is_map:
        for lst in (to_sort, order):
            for item in lst:
                if not isinstance(item, dict):
                    raise _bad_arg_type("map[string]interface {}", item)
                if key not in item:
                    raise _no_merge_key(item, key)
        keep = [v for v in to_sort if v.get(_DIRECTIVE) != "delete"]
        to_delete = [v for v in to_sort if v.get(_DIRECTIVE) == "delete"]
        to_sort = keep
    positions = [_index(order, v, key, is_map) for v in to_sort]
    ranked = sorted(range(len(to_sort)), key=lambda i: (positions[i] < 0, positions[i]))
    if any(p < 0 for p in positions):  # Go's comparator then is not an order: keep them where they are
        ranked = list(range(len(to_sort)))
    return [to_sort[i] for i in ranked] + to_delete


def _merge_sorted(left: list[Any], right: list[Any], server_order: list[Any], key: str,
                  is_map: bool) -> list[Any]:
    out: list[Any] = []
    i = j = 0
    while i < len(left) or j < len(right):
        if i >= len(left):
            out.append(right[j])
            j += 1
        elif j >= len(right):
            out.append(left[i])
            i += 1
        else:
            li, ri = _index(server_order, left[i], key, is_map), _index(server_order, right[j], key, is_map)
            if li >= 0 and ri >= 0 and li < ri:
                out.append(left[i])
                i += 1
            else:
                out.append(right[j])
                j += 1
    return out


def _normalize_element_order(patch: list[Any], server_only: list[Any], patch_order: list[Any],
                             server_order: list[Any], key: str, is_map: bool) -> list[Any]:
    patch = _normalize_slice_order(patch, patch_order, key, is_map)
    server_only = _normalize_slice_order(server_only, server_order, key, is_map)
    return _merge_sorted(server_only, patch, server_order, key, is_map)


def _partition(merged: list[Any], by: list[Any], key: str, is_map: bool) -> tuple[list[Any], list[Any]]:
    if not is_map:
        inside = {v for v in by if not isinstance(v, (dict, list))}
        return ([v for v in merged if _hashable_in(v, inside)],
                [v for v in merged if not _hashable_in(v, inside)])
    patch_items: list[Any] = []
    server_only: list[Any] = []
    for v in merged:
        if not isinstance(v, dict):
            raise _bad_arg_type("map[string]interface {}", v)
        if key not in v:
            raise _no_merge_key(v, key)
        found, _ = _find_by_key(by, key, v[key])
        (patch_items if found is not None else server_only).append(v)
    return patch_items, server_only


def _hashable_in(v: Any, s: set[Any]) -> bool:
    try:
        return v in s
    except TypeError:
        return False


def _dedup_scalars(s: list[Any]) -> list[Any]:
    """``deduplicateScalars``: Go's swap-with-last removal, whose order ``normalizeElementOrder`` fixes."""
    s = list(s)
    length = len(s) - 1
    i = 0
    while i < length:
        j = i + 1
        while j <= length:
            if s[i] == s[j] and type(s[i]) is type(s[j]):
                s[j] = s[length]
                s = s[:length]
                length -= 1
                j -= 1
            j += 1
        i += 1
    return s


def _merge_slice(original: list[Any], patch: list[Any], schema: str | None, key: str,
                 is_delete_list: bool) -> list[Any]:
    if not original and not patch:
        return original
    is_map = _slice_element_type(original, patch) is dict
    if not is_map:
        if is_delete_list:
            return [v for v in original if not _hashable_in(v, {x for x in patch if not isinstance(x, dict)})]
        merged = _dedup_scalars(original + patch)
    else:
        if not key:
            raise _SMPError(f"cannot merge lists without merge key for {schema or ''}")
        without: list[Any] = []
        replace = False
        for v in patch:
            if _DIRECTIVE not in v:
                without.append(v)
                continue
            directive = v[_DIRECTIVE]
            if directive == "delete":
                if key not in v:
                    raise _no_merge_key(v, key)
                original = [o for o in original if not (key in o and o[key] == v[key])]
            elif directive == "replace":
                replace = True
            elif directive == "merge":
                raise _SMPError("merging lists cannot yet be specified in the patch")
            else:
                raise _SMPError(f"unknown patch type: {_gov(directive)} in map: {_gov(v)}")
        if replace:
            original, patch = without, []
        else:
            patch = without
        merged = list(original)
        for v in patch:
            if key not in v:
                raise _no_merge_key(v, key)
            found, at = _find_by_key(merged, key, v[key])
            if found is not None:
                merged[at] = _merge_map(found, v, schema)
            else:
                merged.append(v)
        original = [merged[i] for i in range(len(original))]
    patch_items, server_only = _partition(merged, patch, key, is_map)
    return _normalize_element_order(patch_items, server_only, patch, original, key, is_map)


def _merge_slice_handler(original: Any, patch: Any, schema: str | None, strategy: str, key: str,
                         is_delete_list: bool) -> list[Any]:
    if not isinstance(original, list):
        raise _bad_arg_type("[]interface {}", original)
    if not isinstance(patch, list):
        raise _bad_arg_type("[]interface {}", patch)
    if strategy == "merge" or is_delete_list:
        return _merge_slice(original, patch, schema, key, is_delete_list)
    return patch


def _retain_strategy(strategy: str) -> str:
    parts = [p for p in strategy.split(",") if p]
    return next((p for p in parts if p != "retainKeys"), "")


def _apply_retain_keys(original: dict[str, Any], patch: dict[str, Any]) -> None:
    if _RETAIN_KEYS not in patch:
        return
    keys = patch.pop(_RETAIN_KEYS)
    if not isinstance(keys, list):
        raise _SMPError(_ERR_BAD_RETAIN_KEYS, 400)
    allowed = {k for k in keys if isinstance(k, str)}
    for k, v in patch.items():
        if v is None or k.startswith((_DELETE_PRIMITIVE, _SET_ORDER)):
            continue
        if k not in allowed:
            raise _SMPError(_ERR_BAD_RETAIN_KEYS, 400)
    for k in list(original):
        if k not in allowed:
            del original[k]


def _extract_key(s: str, prefix: str) -> str:
    parts = s.split("/", 1)
    if len(parts) <= 1 or parts[0] != prefix:
        raise _SMPError(_ERR_BAD_PRIMITIVE_LIST if prefix == _DELETE_PRIMITIVE else _ERR_BAD_SET_ORDER, 400)
    return parts[1]


def _apply_set_element_order(original: dict[str, Any], patch: dict[str, Any], schema: str | None) -> None:
    for k in [k for k in patch if k.startswith(_SET_ORDER)]:
        order = patch.pop(k)
        if not isinstance(order, list):
            raise _bad_arg_type("[]interface {}", order)
        name = _extract_key(k, _SET_ORDER)
        sub, strategy, key = _smp_lookup(schema, name)
        strategy = _retain_strategy(strategy)
        have_orig, have_patch = name in original, name in patch
        orig_list = original.get(name) if have_orig else None
        patch_list = patch.get(name) if have_patch else None
        if have_orig and not isinstance(orig_list, list):
            raise _bad_arg_type("[]interface {}", orig_list)
        if have_patch and not isinstance(patch_list, list):
            raise _bad_arg_type("[]interface {}", patch_list)
        _validate_set_order(patch_list or [], order, key)
        if have_orig and not have_patch:
            merged = orig_list
        elif have_patch and not have_orig:
            merged, _ = _remove_directives(patch_list)
        elif have_orig and have_patch:
            merged = _merge_slice_handler(orig_list, patch_list, sub, strategy, key, False)
        else:
            continue
        assert isinstance(merged, list)
        is_map = bool(key)
        server_order = orig_list or []
        if have_orig and have_patch and is_map and strategy == "merge":
            server_order = _aliased_original(server_order, patch_list or [], key)
        patch_items, server_only = _partition(merged, order, key, is_map)
        original[name] = _normalize_element_order(patch_items, server_only, order, server_order, key, is_map)
        patch.pop(name, None)


def _aliased_original(original: list[Any], patch: list[Any], key: str) -> list[Any]:
    """What Go's ``originalFieldValue`` holds after ``mergeSlice`` ran on the same backing array.

    ``deleteMatchingEntries`` (``append(s[:i], s[i+1:]...)``) and the appends of new items write into
    the array the caller still reads through its own slice header, so ``mergePatchIntoOriginal`` orders
    the result by that mutated list. The array's capacity is the next power of two of its length, as
    Go's ``append``-grown slices from decoding have (what apimachinery's tests exercise).
    """
    n = length = len(original)
    cap = 1 << (length - 1).bit_length() if length else 0
    backing: list[Any] = [{key: v.get(key)} if isinstance(v, dict) else v for v in original]
    backing += [None] * (cap - n)
    shared = True
    for v in patch:
        if not isinstance(v, dict) or _DIRECTIVE not in v:
            continue
        if v[_DIRECTIVE] == "delete" and key in v:
            while True:
                at = next((i for i in range(n) if isinstance(backing[i], dict) and key in backing[i]
                           and backing[i][key] == v[key]), -1)
                if at < 0:
                    break
                backing[at:n - 1] = backing[at + 1:n]
                n -= 1
        elif v[_DIRECTIVE] == "replace":
            shared = False
    for v in patch:
        if not shared or not isinstance(v, dict) or _DIRECTIVE in v or key not in v:
            continue
        if any(isinstance(b, dict) and b.get(key) == v[key] for b in backing[:n]):
            continue  # merged in place: the merge key, all the ordering looks at, is unchanged
        if n < cap:
            backing[n] = {key: v[key]}
            n += 1
        else:
            shared = False  # append reallocated: later writes go to a new array
    return backing[:length]


def _validate_set_order(patch_list: list[Any], order: list[Any], key: str) -> None:
    if not order or not patch_list:
        return
    items = [v for v in patch_list if not (isinstance(v, dict) and v.get(_DIRECTIVE) == "delete")] \
        if key else patch_list
    pi = si = 0
    while pi < len(items) and si < len(order):
        if isinstance(items[pi], dict) and _DIRECTIVE in items[pi]:
            pi += 1
            continue
        if key:
            left, right = items[pi], order[si]
            if not isinstance(left, dict) or not isinstance(right, dict):
                raise _bad_arg_type("map[string]interface {}", right if isinstance(left, dict) else left)
            if key not in left:
                raise _no_merge_key(left, key)
            if key not in right:
                raise _no_merge_key(right, key)
            equal = left[key] == right[key]
        else:
            equal = items[pi] == order[si]
        if equal:
            pi += 1
        si += 1
    if pi < len(items) and si >= len(order):
        raise _SMPError(f"The order in patch list:\n{_gov(patch_list)}\n doesn't match {_SET_ORDER} list:\n"
                        f"{_gov(order)}\n")


def _merge_map(original: dict[str, Any] | None, patch: dict[str, Any], schema: str | None) -> dict[str, Any]:
    """``mergeMap`` with ``MergeParallelList`` and ``IgnoreUnmatchedNulls`` (what the server uses)."""
    patch = dict(patch)
    if _DIRECTIVE in patch:
        directive = patch[_DIRECTIVE]
        if directive == "replace":
            del patch[_DIRECTIVE]
            return patch
        if directive == "delete":
            return {}
        raise _SMPError(f"unknown patch type: {_gov(directive)} in map: {_gov(patch)}")
    original = {} if original is None else dict(original)
    _apply_retain_keys(original, patch)
    _apply_set_element_order(original, patch, schema)
    for k, pv in patch.items():
        is_delete_list = False
        if k.startswith(_DELETE_PRIMITIVE):
            k = _extract_key(k, _DELETE_PRIMITIVE)
            is_delete_list = True
        if pv is None:
            original.pop(k, None)
            continue
        if k not in original:
            if not is_delete_list:
                v, keep = _remove_directives(_discard_nulls(pv))
                if keep:
                    original[k] = v
            continue
        ov = original[k]
        if type(ov) is not type(pv):
            if not is_delete_list:
                v, keep = _remove_directives(_discard_nulls(pv))
                if keep:
                    original[k] = v
                else:
                    del original[k]
            continue
        if isinstance(ov, dict):
            sub, strategy, _ = _smp_lookup(schema, k)
            if _retain_strategy(strategy) != "replace":
                original[k] = _merge_map(ov, pv, sub)
            else:
                original[k] = pv
        elif isinstance(ov, list):
            sub, strategy, key = _smp_lookup(schema, k)
            original[k] = _merge_slice_handler(ov, pv, sub, _retain_strategy(strategy), key, is_delete_list)
        else:
            v, keep = _remove_directives(pv)
            if keep:
                original[k] = v
            else:
                del original[k]
    return original


def _strategic_merge(original: dict[str, Any], patch: dict[str, Any], kind: str) -> dict[str, Any]:
    return _merge_map(copy.deepcopy(original), copy.deepcopy(patch), kind)


# -- selectors --------------------------------------------------------------------------------------------
def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


_REQ_SET = re.compile(r"^\s*([^\s!=<>(),]+)\s+(in|notin)\s*\(([^()]*)\)\s*$")
_REQ_OP = re.compile(r"^\s*([^\s!=<>(),]+)\s*(==|!=|=|>|<)\s*([^\s!=<>(),]*)\s*$")
_REQ_EXISTS = re.compile(r"^\s*(!?)\s*([^\s!=<>(),]+)\s*$")


def _parse_label_selector(text: str) -> list[tuple[str, str, list[str]]]:
    """``labels.Parse``: a list of (key, operator, values); raises ``_APIError`` 400 on bad syntax."""
    reqs: list[tuple[str, str, list[str]]] = []
    if not text.strip():
        return reqs
    for part in _split_top(text):
        if m := _REQ_SET.match(part):
            key, op, values = m.group(1), m.group(2), [v.strip() for v in m.group(3).split(",")]
            values = [v for v in values if v] if op == "notin" else values
        elif m := _REQ_OP.match(part):
            key, op, values = m.group(1), m.group(2), [m.group(3)]
            if op in (">", "<") and not re.fullmatch(r"-?\d+", values[0]):
                raise _err_bad_request("unable to parse requirement: for 'Gt', 'Lt' operators, the value "
                                       "must be an integer")
        elif m := _REQ_EXISTS.match(part):
            key, op, values = m.group(2), "!" if m.group(1) else "exists", []
        else:
            raise _err_bad_request(f"unable to parse requirement: found '{part.strip()}', expected: "
                                   "',' or 'end of string'")
        if errs := _label_key_errors(key):
            raise _err_bad_request(f"unable to parse requirement: <nil>: Invalid value: {_goq(key)}: "
                                   + "; ".join(errs))
        for v in values if op not in (">", "<") else []:
            if errs := _label_value_errors(v):
                raise _err_bad_request(f"unable to parse requirement: <nil>: Invalid value: {_goq(v)}: "
                                       + "; ".join(errs))
        reqs.append((key, op, values))
    return reqs


def _labels_match(labels: dict[str, str], reqs: list[tuple[str, str, list[str]]]) -> bool:
    for key, op, values in reqs:
        has, val = key in labels, labels.get(key, "")
        if op in ("exists", "!"):
            ok = has == (op == "exists")
        elif op in ("=", "=="):
            ok = has and val == values[0]
        elif op == "!=":
            ok = not has or val != values[0]
        elif op in ("in", "notin"):
            ok = (has and val in values) if op == "in" else (not has or val not in values)
        else:  # > and <
            try:
                ok = has and (int(val) > int(values[0]) if op == ">" else int(val) < int(values[0]))
            except ValueError:
                ok = False
        if not ok:
            return False
    return True


def _parse_field_selector(text: str, supported: Callable[[str], bool]) -> list[tuple[str, str, str]]:
    reqs: list[tuple[str, str, str]] = []
    if not text.strip():
        return reqs
    for part in re.split(r"(?<!\\),", text):
        m = re.match(r"^(.*?)(==|!=|=)(.*)$", part)
        if not m:
            raise _err_bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        key, op, value = m.group(1).strip(), m.group(2), re.sub(r"\\(.)", r"\1", m.group(3))
        if not supported(key):
            raise _err_bad_request(f"field label not supported: {key}")
        reqs.append((key, "!=" if op == "!=" else "=", value))
    return reqs


def _fields_match(fields: dict[str, str], reqs: list[tuple[str, str, str]]) -> bool:
    return all((fields.get(k, "") == v) == (op == "=") for k, op, v in reqs)


# -- validation (pkg/apis/core/validation, apimachinery/pkg/api/validation) -------------------------------
_TAINT_EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute"]


def _validate_labels(labels: dict[str, str] | None, path: str) -> list[_FieldError]:
    errs = []
    for k, v in (labels or {}).items():
        errs += [_invalid_value(path, k, m) for m in _label_key_errors(k)]
        errs += [_invalid_value(path, v, m) for m in _label_value_errors(v)]
    return errs


def _validate_annotations(annotations: dict[str, str] | None, path: str) -> list[_FieldError]:
    errs = []
    annotations = annotations or {}
    for k in annotations:
        errs += [_invalid_value(path, k, m) for m in _label_key_errors(k.lower())]
    if sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items()) > _ANNOTATIONS_LIMIT:
        errs.append(_FieldError("FieldValueTooLong", path, "<value omitted>",
                                f"may not be more than {_ANNOTATIONS_LIMIT} bytes"))
    return errs


def _validate_owner_refs(refs: list[dict[str, Any]] | None, path: str) -> list[_FieldError]:
    errs: list[_FieldError] = []
    controller = ""
    for i, r in enumerate(refs or []):
        p = f"{path}[{i}]"
        for k in ("apiVersion", "kind", "name", "uid"):
            if not r.get(k):
                errs.append(_required(f"{p}.{k}", "must not be empty"))
        if r.get("controller"):
            here = f"{r.get('kind', '')}/{r.get('name', '')}"
            if controller:
                errs.append(_invalid_value(path, refs, "Only one reference can have Controller set to "
                                           f'true. Found "true" in references for {controller} and {here}'))
            else:
                controller = here
    return errs


def _validate_meta(md: dict[str, Any], namespaced: bool,
                   name_fn: Callable[[str, bool], list[str]]) -> list[_FieldError]:
    """``ValidateObjectMetaAccessor``."""
    errs: list[_FieldError] = []
    if md.get("generateName"):
        errs += [_invalid_value("metadata.generateName", md["generateName"], m)
                 for m in name_fn(md["generateName"], True)]
    if not md.get("name"):
        errs.append(_required("metadata.name", "name or generateName is required"))
    else:
        errs += [_invalid_value("metadata.name", md["name"], m) for m in name_fn(md["name"], False)]
    if namespaced:
        if not md.get("namespace"):
            errs.append(_required("metadata.namespace"))
        else:
            errs += [_invalid_value("metadata.namespace", md["namespace"], m)
                     for m in _dns_label_errors(md["namespace"])]
    elif md.get("namespace"):
        errs.append(_FieldError("FieldValueForbidden", "metadata.namespace", "", "not allowed on this type"))
    if md.get("generation", 0) < 0:
        errs.append(_invalid_value("metadata.generation", md["generation"],
                                   "must be greater than or equal to 0"))
    errs += _validate_labels(md.get("labels"), "metadata.labels")
    errs += _validate_annotations(md.get("annotations"), "metadata.annotations")
    errs += _validate_owner_refs(md.get("ownerReferences"), "metadata.ownerReferences")
    for f in md.get("finalizers") or []:
        errs += [_invalid_value("metadata.finalizers", f, m) for m in _label_key_errors(f)]
    return errs


def _validate_meta_update(md: dict[str, Any], old: dict[str, Any]) -> list[_FieldError]:
    """``ValidateObjectMetaAccessorUpdate``."""
    errs: list[_FieldError] = []
    if not md.get("resourceVersion"):
        errs.append(_invalid_value("metadata.resourceVersion", "", "must be specified for an update"))
    for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
              "deletionGracePeriodSeconds"):
        if md.get(k) != old.get(k):
            bad = md.get(k)
            if bad is None and k in ("name", "namespace", "uid"):
                bad = ""
            errs.append(_invalid_value(f"metadata.{k}", bad, "field is immutable"))
    errs += _validate_labels(md.get("labels"), "metadata.labels")
    errs += _validate_annotations(md.get("annotations"), "metadata.annotations")
    errs += _validate_owner_refs(md.get("ownerReferences"), "metadata.ownerReferences")
    return errs


def _validate_taints(taints: list[dict[str, Any]] | None, path: str) -> list[_FieldError]:
    """``validateNodeTaints`` (the caller passes ``metadata.taints``: the real server's field path)."""
    errs: list[_FieldError] = []
    seen: dict[str, set[str]] = {}
    for i, t in enumerate(taints or []):
        p = f"{path}[{i}]"
        key, value, effect = t.get("key", ""), t.get("value", ""), t.get("effect", "")
        errs += [_invalid_value(f"{p}.key", key, m) for m in _label_key_errors(key)]
        if msgs := _label_value_errors(value):
            errs.append(_invalid_value(f"{p}.value", value, ";".join(msgs)))
        if not effect:
            errs.append(_required(f"{p}.effect"))
        elif effect not in _TAINT_EFFECTS:
            errs.append(_not_supported(f"{p}.effect", effect, _TAINT_EFFECTS))
        if key in seen.get(effect, set()):
            internal = {"Key": key, "Value": value, "Effect": effect, "TimeAdded": t.get("timeAdded")}
            errs.append(_FieldError("FieldValueDuplicate", p, internal,
                                    "taints must be unique by key and effect pair"))
            continue
        seen.setdefault(effect, set()).add(key)
    return errs


def _node_name_errors(name: str, prefix: bool) -> list[str]:
    return _dns_subdomain_errors(name[:-1] if prefix and name.endswith("-") else name)


def _validate_node(node: dict[str, Any]) -> list[_FieldError]:
    """``ValidateNode``."""
    errs = _validate_meta(node["metadata"], False, _node_name_errors)
    errs += _validate_taints(node["spec"].get("taints"), "metadata.taints")
    return errs


def _validate_node_update(node: dict[str, Any], old: dict[str, Any]) -> list[_FieldError]:
    """``ValidateNodeUpdate``."""
    errs = _validate_meta_update(node["metadata"], old["metadata"])
    seen: list[dict[str, Any]] = []
    for i, a in enumerate(node["status"].get("addresses") or []):
        if a in seen:
            errs.append(_FieldError("FieldValueDuplicate", f"status.addresses[{i}]",
                                    {"Type": a.get("type", ""), "Address": a.get("address", "")}))
        seen.append(a)
    old_cidrs, new_cidrs = old["spec"].get("podCIDRs") or [], node["spec"].get("podCIDRs") or []
    if old_cidrs and old_cidrs != new_cidrs:
        changed = 1 if len(old_cidrs) != len(new_cidrs) else \
            sum(a != b for a, b in zip(old_cidrs, new_cidrs, strict=True))
        errs += [_FieldError("FieldValueForbidden", "spec.podCIDRs", "",
                             'node updates may not change podCIDR except from "" to valid')] * changed
    if old["spec"].get("providerID") and old["spec"].get("providerID") != node["spec"].get("providerID"):
        errs.append(_FieldError("FieldValueForbidden", "spec.providerID", "",
                                'node updates may not change providerID except from "" to valid'))
    errs += _validate_taints(node["spec"].get("taints"), "metadata.taints")
    if node["spec"].get("externalID", "") != old["spec"].get("externalID", ""):
        errs.append(_FieldError("FieldValueForbidden", "spec.externalID", "", "may not be updated"))
    return errs


def _validate_event(ev: dict[str, Any], legacy_only: bool) -> list[_FieldError]:
    """``ValidateEventCreate`` on the internal event (core/v1 shape; ``legacy_only`` for core/v1)."""
    errs: list[_FieldError] = []
    ns, inv_ns = ev["metadata"].get("namespace", ""), ev["involvedObject"].get("namespace", "")
    mismatch = _invalid_value("involvedObject.namespace", inv_ns, "does not match event.namespace")
    if not ev.get("eventTime"):
        if (not inv_ns and ns not in ("", "default")) or (inv_ns and ns != inv_ns):
            errs.append(mismatch)
    else:
        if not inv_ns and ns not in ("default", "kube-system"):
            errs.append(mismatch)
        controller = ev.get("reportingComponent", "")
        if not controller:
            errs.append(_required("reportingController"))
        errs += [_invalid_value("reportingController", controller, m) for m in _label_key_errors(controller)]
        for name, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
            if not ev.get(name):
                errs.append(_required(name))
            if len(ev.get(name, "")) > limit:
                errs.append(_invalid_value(name, "", f"can have at most {limit} characters"))
        if len(ev.get("message", "")) > 1024:
            errs.append(_invalid_value("message", "", "can have at most 1024 characters"))
    errs += [_invalid_value("namespace", ns, m) for m in _dns_subdomain_errors(ns)]
    if legacy_only:
        return errs
    errs += _validate_meta(ev["metadata"], True, lambda n, p: _dns_subdomain_errors(
        n[:-1] if p and n.endswith("-") else n))
    if ev.get("series") is not None:
        if ev["series"].get("count", 0) < 2:
            errs.append(_invalid_value("series.count", "", "should be at least 2"))
        if not ev["series"].get("lastObservedTime"):
            errs.append(_required("series.lastObservedTime"))
    if not ev.get("eventTime"):
        errs.append(_required("eventTime"))
    if ev.get("type", "") not in ("Normal", "Warning"):
        errs.append(_invalid_value("type", "", f"has invalid value: {ev.get('type', '')}"))
    for name in ("firstTimestamp", "lastTimestamp"):
        if ev.get(name):
            errs.append(_invalid_value(name, "", "needs to be unset"))
    if ev.get("count"):
        errs.append(_invalid_value("count", "", "needs to be unset"))
    if ev.get("source"):
        errs.append(_invalid_value("source", "", "needs to be unset"))
    return errs


_EVENTS_V1_TO_CORE = {
    "regarding": "involvedObject", "note": "message", "reportingController": "reportingComponent",
    "deprecatedSource": "source", "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp", "deprecatedCount": "count",
}


def _events_v1_to_core(ev: dict[str, Any]) -> dict[str, Any]:
    out = {_EVENTS_V1_TO_CORE.get(k, k): copy.deepcopy(v) for k, v in ev.items()}
    out["kind"], out["apiVersion"] = "Event", "v1"
    return _roundtrip("Event", out)[0]


def _core_to_events_v1(ev: dict[str, Any]) -> dict[str, Any]:
    back = {v: k for k, v in _EVENTS_V1_TO_CORE.items()}
    out = {back.get(k, k): copy.deepcopy(v) for k, v in ev.items()}
    out["kind"], out["apiVersion"] = "Event", "events.k8s.io/v1"
    return _roundtrip("EventsV1Event", out)[0]


# -- requests, rules --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestRecord:
    """One request, recorded when its answer is decided (before any :meth:`StandInAPIServer.delay`).

    ``status`` is the code answered (or that would have been, had :meth:`StandInAPIServer.stop` not
    dropped a delayed answer); ``query`` keeps the first value of each parameter; ``dry_run`` is
    whether ``dryRun`` was sent; ``time`` is ``time.time()`` at arrival; ``body`` is the parsed JSON
    body (``None`` when there was none or it was not JSON).
    """

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    status: int
    dry_run: bool
    time: float
    body: Any = None
    user_agent: str = ""


@dataclass
class _Rule:
    method: str
    pattern: re.Pattern[str]
    times: int
    status: int = 0
    message: str | None = None
    seconds: float = 0.0

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and self.method in ("*", method) and self.pattern.search(path) is not None


@dataclass
class _Route:
    """What a path names: the RBAC attributes and which handler serves it."""

    endpoint: str
    resource: str
    group: str = ""
    namespace: str = ""
    name: str = ""
    subresource: str = ""


_ROUTES: tuple[tuple[re.Pattern[str], str, str, str, str], ...] = tuple(
    (re.compile(p), endpoint, resource, group, sub) for p, endpoint, resource, group, sub in (
        (r"^/api/v1/nodes$", "nodes", "nodes", "", ""),
        (r"^/api/v1/nodes/(?P<name>[^/]+)$", "node", "nodes", "", ""),
        (r"^/api/v1/nodes/(?P<name>[^/]+)/status$", "node", "nodes", "", "status"),
        (r"^/api/v1/events$", "events", "events", "", ""),
        (r"^/api/v1/namespaces/(?P<namespace>[^/]+)/events$", "events", "events", "", ""),
        (r"^/api/v1/namespaces/(?P<namespace>[^/]+)/events/(?P<name>[^/]+)$", "event", "events", "", ""),
        (r"^/apis/events\.k8s\.io/v1/events$", "events", "events", "events.k8s.io", ""),
        (r"^/apis/events\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/events$", "events", "events",
         "events.k8s.io", ""),
        (r"^/apis/events\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/events/(?P<name>[^/]+)$", "event",
         "events", "events.k8s.io", ""),
    ))
_ALLOWED_METHODS = {"nodes": {"GET"}, "node": {"GET", "PATCH", "PUT"}, "events": {"GET", "POST"},
                    "event": {"GET"}}


@dataclass
class _Response:
    code: int
    body: bytes
    content_type: str = _JSON
    headers: dict[str, str] = field(default_factory=dict)


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


def _rfc3339(t: _dt.datetime | None = None) -> str:
    return _format_time(t or _now(), micro=False)


class _HTTPServer(http.server.ThreadingHTTPServer):
    """Tracks its connections so that :meth:`StandInAPIServer.stop` can cut keep-alive ones too."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], owner: StandInAPIServer) -> None:
        self.owner = owner
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)
        if owner.tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*owner.tls)
            # the handshake in the connection's own thread (``finish_request``), not in accept
            self.socket = ctx.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except (OSError, ssl.SSLError):
                return  # a client that refused our certificate: nothing to answer
        super().finish_request(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def version_string(self) -> str:
        """The ``Server`` header (kube-apiserver sends none; a name helps when reading captures)."""
        return "kube-apiserver-stand-in"

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request stderr lines (the records are in ``StandInAPIServer.requests``)."""

    def _serve(self) -> None:
        owner = self.server.owner
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_BODY:
            self.rfile.read(length)
            body = b""
            oversized = True
        else:
            body = self.rfile.read(length) if length else b""
            oversized = False
        resp, delay = owner._handle(self.command, self.path, self.headers, body, oversized)
        if delay and owner._stopping.wait(delay):
            self.close_connection = True
            return
        try:
            self.send_response(resp.code)
            self.send_header("Content-Type", resp.content_type)
            self.send_header("Content-Length", str(len(resp.body)))
            self.send_header("Cache-Control", "no-cache, private")
            self.send_header("Audit-Id", str(uuid.uuid4()))
            for k, v in resp.headers.items():
                for line in v.split("\n"):
                    self.send_header(k, line)
            self.end_headers()
            self.wfile.write(resp.body)
        except OSError:
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _serve


_Server = TypeVar("_Server", bound="StandInAPIServer")


class StandInAPIServer:
    """A kube-apiserver stand-in on 127.0.0.1 (see the module docstring for what it reproduces).

    ``token``: the bearer token a request must carry (``None``: no authentication, every request is
    ``user``). ``tls``: ``(certificate file, key file)`` to serve HTTPS (``None``: HTTP). ``user``:
    whom the token authenticates as, in RBAC denials. ``anonymous``: a request
    without any token is ``system:anonymous`` (so a 403, as with ``--anonymous-auth=true``) instead of
    a 401. The socket is bound at construction, so ``url`` and :meth:`write_kubeconfig` work before
    :meth:`start`; after :meth:`stop`, :meth:`start` binds the same port again (a restarted server,
    same store).
    """

    def __init__(self, token: str | None = "test-token", *, user: str = DEFAULT_USER,
                 anonymous: bool = False, tls: tuple[str | Path, str | Path] | None = None) -> None:
        self.tls = None if tls is None else (str(tls[0]), str(tls[1]))
        self.token = token
        self.user = user
        self.anonymous = anonymous
        self._lock = threading.RLock()
        self._rv = 1000
        self._nodes: dict[str, dict[str, Any]] = {}
        self._events: dict[tuple[str, str], dict[str, Any]] = {}
        self._namespaces: set[str] = set(_DEFAULT_NAMESPACES)
        self._records: list[RequestRecord] = []
        self._fail_rules: list[_Rule] = []
        self._delay_rules: list[_Rule] = []
        self._forbidden: set[tuple[str, str]] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd: _HTTPServer | None = _HTTPServer(("127.0.0.1", 0), self)
        self.port: int = self._httpd.server_address[1]

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with ``tls``)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> StandInAPIServer:
        """Serve on a daemon thread (rebinding the same port if the server was stopped)."""
        if self._thread is not None:
            return self
        if self._httpd is None:
            self._httpd = _HTTPServer(("127.0.0.1", self.port), self)
        self._stopping.clear()
        httpd = self._httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"kubeapi-stand-in:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop like a killed process: close the listening socket and every open connection, so the
        next client call gets connection refused; answers still held by :meth:`delay` are dropped."""
        self._stopping.set()
        httpd, thread = self._httpd, self._thread
        self._httpd, self._thread = None, None
        if httpd is None:
            return
        if thread is not None:
            httpd.shutdown()
        httpd.server_close()
        httpd.cut_connections()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self: _Server) -> _Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        """Write a kubeconfig (cluster ``stand-in`` at :attr:`url`, the token, a current context) that
        ``kubernetes.config.load_kube_config``/``new_client_from_config`` load. JSON is valid YAML:
        every value is written JSON-quoted."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        user = f"    token: {json.dumps(self.token)}\n" if self.token is not None else "    {}\n"
        p.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: stand-in\n  cluster:\n    server: {json.dumps(self.url)}\n"
            + (f"    certificate-authority: {json.dumps(self.tls[0])}\n" if self.tls else "") +
            "users:\n- name: sdc-guard\n  user:\n" + user +
            "contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: sdc-guard\n"
            f"    namespace: {json.dumps(namespace)}\n"
            "current-context: stand-in\npreferences: {}\n")
        return p

    # -- the store, for tests ------------------------------------------------------------------------
    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

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
            now = _rfc3339()
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
            node, _ = _roundtrip("Node", raw)
        except _DecodeError as e:
            raise ValueError(str(e)) from None
        node = _typed(node, "Node", "v1")
        _default_node(node)
        errs = _validate_node(node)
        if old is not None:
            errs += _validate_node_update(node, old)
        if errs:
            raise ValueError(_err_invalid("Node", node["metadata"].get("name", ""), errs).status["message"])
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
                        c["lastHeartbeatTime"] = _rfc3339()
            else:
                mutate(raw)
            node = self._checked_node(raw, old)
            node["metadata"]["resourceVersion"] = self._next_rv()
            self._nodes[name] = node
            return copy.deepcopy(node)

    def add_namespace(self, name: str) -> None:
        """Make a namespace exist (events may only be created in existing namespaces)."""
        if errs := _dns_label_errors(name):
            raise ValueError(f"namespace {name!r}: {'; '.join(errs)}")
        with self._lock:
            self._namespaces.add(name)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Deep copies of the created Events, all namespaces, in creation order, in core/v1 form."""
        with self._lock:
            return copy.deepcopy(list(self._events.values()))

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request answered so far, in arrival order of their answers."""
        with self._lock:
            return list(self._records)

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        with self._lock:
            self._records.clear()

    # -- fault injection -------------------------------------------------------------------------------
    def fail(self, method: str, path_regex: str, status: int, *, times: int = 1,
             message: str | None = None) -> None:
        """The next ``times`` requests whose method is ``method`` (``"*"``: any) and whose path (no
        query) matches ``path_regex`` (``re.search``) are answered ``status`` with the Status body the
        real server sends for that code (``message`` replaces its message), before authentication and
        without being processed: nothing is stored. A 429 is the real plain-text answer with
        ``Retry-After: 1``."""
        with self._lock:
            self._fail_rules.append(_Rule(method.upper(), re.compile(path_regex), times, status=status,
                                          message=message))

    def delay(self, method: str, path_regex: str, seconds: float, *, times: int = 1) -> None:
        """The next ``times`` matching requests are processed (and any write committed) at once, and
        answered only after ``seconds``: what a client with a shorter read timeout sees is a timeout
        on a request that did take effect. :meth:`stop` drops the held answers."""
        with self._lock:
            self._delay_rules.append(_Rule(method.upper(), re.compile(path_regex), times, seconds=seconds))

    def forbid(self, verb: str, resource: str) -> None:
        """RBAC: deny ``verb`` (get, list, watch, create, update, patch, delete; ``*``) on ``resource``
        (``nodes``, ``nodes/status``, ``events``; ``*``). Everything not forbidden is allowed."""
        with self._lock:
            self._forbidden.add((verb, resource))

    def allow(self, verb: str, resource: str) -> None:
        """Undo :meth:`forbid`."""
        with self._lock:
            self._forbidden.discard((verb, resource))

    # -- request handling ------------------------------------------------------------------------------
    def _handle(self, method: str, raw_path: str, headers: Any, body: bytes,
                oversized: bool) -> tuple[_Response, float]:
        arrived = time.time()
        split = urlsplit(raw_path)
        path = split.path
        multi = parse_qs(split.query, keep_blank_values=True)
        query = {k: v[0] for k, v in multi.items()}
        content_type = headers.get("Content-Type") or ""
        try:
            parsed_body = json.loads(body) if body else None
        except ValueError:
            parsed_body = None
        delay = 0.0
        with self._lock:
            rule = next((r for r in self._fail_rules if r.matches(method, path)), None)
            if rule is not None:
                rule.times -= 1
            delay_rule = next((r for r in self._delay_rules if r.matches(method, path)), None)
            if delay_rule is not None:
                delay_rule.times -= 1
                delay = delay_rule.seconds
            self._fail_rules = [r for r in self._fail_rules if r.times > 0]
            self._delay_rules = [r for r in self._delay_rules if r.times > 0]
        route = self._route(path)
        try:
            if rule is not None:
                raise self._injected(rule, method, route)
            if oversized:
                raise _APIError(_status(413, "RequestEntityTooLarge",
                                        f"Request entity too large: limit is {_MAX_BODY}"))
            resp = self._serve(method, path, route, multi, headers, body)
        except _APIError as e:
            resp = self._error_response(e)
        except Exception as e:  # a bug here must reach the test as a 500, not hang the client
            resp = self._error_response(_APIError(_status(500, "InternalError",
                                                          f"Internal error occurred: stand-in: {e!r}")))
        with self._lock:
            self._records.append(RequestRecord(
                method=method, path=path, query=query, content_type=content_type, status=resp.code,
                dry_run="dryRun" in multi, time=arrived, body=parsed_body,
                user_agent=headers.get("User-Agent") or ""))
        return resp, delay

    @staticmethod
    def _error_response(e: _APIError) -> _Response:
        if e.text is not None:
            return _Response(e.code, e.text.encode(), "text/plain; charset=utf-8", dict(e.headers))
        return _Response(e.code, json.dumps(e.status, separators=(",", ":")).encode(), _JSON, dict(e.headers))

    @staticmethod
    def _route(path: str) -> _Route | None:
        for pattern, endpoint, resource, group, sub in _ROUTES:
            m = pattern.match(path)
            if m:
                g = {k: unquote(v) for k, v in m.groupdict().items()}
                return _Route(endpoint, resource, group, g.get("namespace", ""), g.get("name", ""), sub)
        return None

    def _injected(self, rule: _Rule, method: str, route: _Route | None) -> _APIError:
        code, message = rule.status, rule.message
        resource, name, group = (route.resource, route.name, route.group) if route else ("", "", "")
        err: _APIError
        if code == 401:
            err = _err_unauthorized()
        elif code == 403 and route is not None:
            err = self._forbidden_error(self._verb(method, route, {}), route, self.user)
        elif code == 404 and route is not None and name:
            err = _err_not_found(resource, name, group)
        elif code == 409 and route is not None and name:
            err = _err_conflict(resource, name, group=group)
        elif code == 429:
            text = (message or "Too many requests, please try again later.") + "\n"
            return _APIError(_status(429, "TooManyRequests", text.strip()), {"Retry-After": "1"}, text=text)
        elif code == 500:
            why = message or "injected failure"
            err = _APIError(_status(500, "InternalError", f"Internal error occurred: {why}",
                                    _details(causes=[{"message": why}])))
            return err
        elif code == 503:
            err = _APIError(_status(503, "ServiceUnavailable", message or
                                    "the server is currently unable to handle the request"))
            return err
        elif code == 504:
            err = _APIError(_status(504, "Timeout", "Timeout: request did not complete within requested "
                                                    "timeout - context deadline exceeded", {}))
        else:
            err = _err_generic(code, message or "")
        if message:
            err.status["message"] = message
        return err

    def _authenticate(self, headers: Any) -> str:
        if self.token is None:
            return self.user
        auth = headers.get("Authorization")
        if auth is None and self.anonymous:
            return "system:anonymous"
        parts = (auth or "").split(" ", 2)
        if len(parts) < 2 or parts[0].lower() != "bearer" or parts[1] != self.token:
            raise _err_unauthorized()
        return self.user

    @staticmethod
    def _verb(method: str, route: _Route, query: dict[str, list[str]]) -> str:
        if method == "GET":
            if route.endpoint in ("nodes", "events"):
                return "watch" if query.get("watch", [""])[0] in ("true", "1") else "list"
            return "get"
        return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method,
                                                                                               method.lower())

    @staticmethod
    def _forbidden_error(verb: str, route: _Route, user: str) -> _APIError:
        resource = route.resource + (f"/{route.subresource}" if route.subresource else "")
        where = f'in the namespace "{route.namespace}"' if route.namespace else "at the cluster scope"
        why = f'User "{user}" cannot {verb} resource "{resource}" in API group "{route.group}" {where}'
        gr = _gr(route.resource, route.group)
        message = f"{gr} {_goq(route.name)} is forbidden: {why}" if route.name else \
            f"{gr} is forbidden: {why}"
        return _APIError(_status(403, "Forbidden", message,
                                 _details(name=route.name, group=route.group, kind=route.resource)))

    def _serve(self, method: str, path: str, route: _Route | None, query: dict[str, list[str]],
               headers: Any, body: bytes) -> _Response:
        user = self._authenticate(headers)
        if path == "/version" and method == "GET":
            return self._ok({"major": "1", "minor": KUBE_VERSION.split(".")[1], "gitVersion": KUBE_VERSION,
                             "gitCommit": "0" * 40, "gitTreeState": "clean",
                             "buildDate": "2026-08-01T00:00:00Z", "goVersion": "go1.25.0", "compiler": "gc",
                             "platform": "linux/amd64"})
        if route is None:
            raise _err_generic(404)
        verb = self._verb(method, route, query)
        resource = route.resource + (f"/{route.subresource}" if route.subresource else "")
        with self._lock:
            denied = any((v in (verb, "*")) and (r in (resource, "*")) for v, r in self._forbidden)
        if denied or user == "system:anonymous":
            raise self._forbidden_error(verb, route, user)
        if method not in _ALLOWED_METHODS[route.endpoint]:
            raise _err_generic(405)
        if verb == "watch":
            raise _APIError(_status(405, "MethodNotAllowed", "watch is not served by the stand-in API server",
                                    {}))
        content_type = (headers.get("Content-Type") or "").split(";")[0].strip()
        if route.endpoint == "nodes":
            return self._list_nodes(query)
        if route.endpoint == "node":
            if method == "GET":
                with self._lock:
                    if route.name not in self._nodes:
                        raise _err_not_found("nodes", route.name)
                    return self._ok(self._nodes[route.name])
            if method == "PATCH":
                return self._patch_node(route, query, content_type, body, headers.get("User-Agent") or "")
            return self._put_node(route, query, body)
        if route.endpoint == "events":
            if method == "GET":
                return self._list_events(route, query)
            if not route.namespace:  # the all-namespaces path lists; creating needs a namespace
                raise _err_generic(405)
            return self._create_event(route, query, body)
        with self._lock:
            ev = self._events.get((route.namespace, route.name))
            if ev is None:
                raise _err_not_found("events", route.name, route.group)
            return self._ok(_core_to_events_v1(ev) if route.group else ev)

    @staticmethod
    def _ok(obj: Any, code: int = 200, warnings: list[str] | None = None) -> _Response:
        headers = {"Warning": "\n".join(f'299 - {json.dumps(w)}' for w in warnings)} if warnings else {}
        return _Response(code, json.dumps(obj, separators=(",", ":")).encode(), _JSON, headers)

    # -- lists -----------------------------------------------------------------------------------------
    def _paginate(self, keys: list[str], query: dict[str, list[str]]) -> tuple[list[str], dict[str, Any]]:
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
                raise _err_bad_request(f"continue key is not valid: {token}") from None
        keys = [k for k in keys if k >= start]
        try:
            limit = int(query.get("limit", ["0"])[0] or 0)
        except ValueError:
            bad = _goq(query["limit"][0])
            raise _err_bad_request(f"strconv.ParseInt: parsing {bad}: invalid syntax") from None
        if 0 < limit < len(keys):
            nxt = {"v": "meta.k8s.io/v1", "rv": self._rv, "start": keys[limit - 1] + "\x00"}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(nxt, separators=(",", ":")).encode()
                                                        ).decode().rstrip("=")
            meta["remainingItemCount"] = len(keys) - limit
            keys = keys[:limit]
        return keys, meta

    def _list_nodes(self, query: dict[str, list[str]]) -> _Response:
        labels = _parse_label_selector(query.get("labelSelector", [""])[0])
        fields = _parse_field_selector(query.get("fieldSelector", [""])[0],
                                       lambda k: k in ("metadata.name", "spec.unschedulable"))
        with self._lock:
            matching = []
            for name in sorted(self._nodes):
                node = self._nodes[name]
                values = {"metadata.name": name,
                          "spec.unschedulable": "true" if node["spec"].get("unschedulable") else "false"}
                if _labels_match(node["metadata"].get("labels") or {}, labels) and \
                        _fields_match(values, fields):
                    matching.append(name)
            keys, meta = self._paginate(matching, query)
            items = [_list_item(self._nodes[n]) for n in keys]
            return self._ok({"kind": "NodeList", "apiVersion": "v1", "metadata": meta, "items": items})

    def _list_events(self, route: _Route, query: dict[str, list[str]]) -> _Response:
        event_fields = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                        "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                        "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type",
                        "metadata.namespace", "metadata.name")
        labels = _parse_label_selector(query.get("labelSelector", [""])[0])
        fields = _parse_field_selector(query.get("fieldSelector", [""])[0], lambda k: k in event_fields)
        with self._lock:
            chosen: dict[str, dict[str, Any]] = {}
            for (ns, name), ev in self._events.items():
                if route.namespace and ns != route.namespace:
                    continue
                inv = ev["involvedObject"]
                values = {f"involvedObject.{k}": inv.get(k, "") for k in
                          ("kind", "namespace", "name", "uid", "apiVersion", "resourceVersion", "fieldPath")}
                values.update({"reason": ev.get("reason", ""),
                               "reportingComponent": ev.get("reportingComponent", ""),
                               "source": ev["source"].get("component", ""), "type": ev.get("type", ""),
                               "metadata.namespace": ns, "metadata.name": name})
                if _labels_match(ev["metadata"].get("labels") or {}, labels) and \
                        _fields_match(values, fields):
                    chosen[f"{ns}/{name}"] = ev
            keys, meta = self._paginate(sorted(chosen), query)
            convert = _core_to_events_v1 if route.group else copy.deepcopy
            items = [_list_item(convert(chosen[k])) for k in keys]
            api_version = "events.k8s.io/v1" if route.group else "v1"
            return self._ok({"kind": "EventList", "apiVersion": api_version, "metadata": meta,
                             "items": items})

    # -- options ----------------------------------------------------------------------------------------
    @staticmethod
    def _options(query: dict[str, list[str]], kind: str) -> tuple[bool, str]:
        """``Validate{Patch,Update,Create}Options``: (dry run, field validation) or a 422."""
        errs: list[_FieldError] = []
        manager = query.get("fieldManager", [""])[0]
        if len(manager) > 128:
            errs.append(_FieldError("FieldValueTooLong", "fieldManager", "<value omitted>",
                                    "may not be more than 128 bytes"))
        elif manager and not manager.isprintable():
            errs.append(_invalid_value("fieldManager", manager, "must only contain printable characters"))
        if kind == "PatchOptions" and "force" in query:
            errs.append(_FieldError("FieldValueForbidden", "force", "",
                                    "may not be specified for non-apply patch"))
        dry = query.get("dryRun", [])
        if any(v != "All" for v in dry):
            errs.append(_not_supported("dryRun", dry, ["All"]))
        validation = query.get("fieldValidation", [""])[0]
        if validation not in ("", "Ignore", "Strict", "Warn"):
            errs.append(_not_supported("fieldValidation", validation, ["", "Ignore", "Strict", "Warn"]))
        if errs:
            raise _err_invalid(kind, "", errs, group="meta.k8s.io")
        return bool(dry), validation or "Warn"

    # -- nodes: PATCH, PUT, and the update they share ---------------------------------------------------
    def _patch_node(self, route: _Route, query: dict[str, list[str]], content_type: str, body: bytes,
                    user_agent: str) -> _Response:
        if content_type not in _PATCH_TYPES:
            raise _err_unsupported_media(_PATCH_TYPES)
        dry_run, validation = self._options(query, "PatchOptions")
        try:
            patch = json.loads(body)
        except ValueError:
            raise _err_bad_request("invalid JSON patch") from None
        strict = validation in ("Warn", "Strict")
        warnings: list[str] = []

        def produce(current: dict[str, Any]) -> tuple[Any, str]:
            if content_type == _JSON_PATCH:
                return self._apply_json_patch(current, patch, strict, warnings), "json"
            if content_type == _MERGE_PATCH:
                if strict and not isinstance(patch, dict) and patch is not None:
                    what = _json_kind(patch)
                    raise _err_bad_request(f"error decoding patch: json: cannot unmarshal {what} into Go "
                                           "value of type map[string]interface {}")
                if patch is None or (not isinstance(patch, (dict, list))):
                    raise _err_bad_request("Invalid JSON Patch")
                return _merge_patch(current, patch), "json"
            if not isinstance(patch, dict) and patch is not None:
                raise _err_bad_request(f"json: cannot unmarshal {_json_kind(patch)} into Go value of type "
                                       "map[string]interface {}")
            try:
                return _strategic_merge(current, patch or {}, "Node"), "smp"
            except _SMPError as e:
                if e.code == 400:
                    raise _err_bad_request(str(e)) from None
                if e.code == 422:
                    raise _err_generic(422, str(e)) from None
                raise _err_internal(str(e)) from None

        result, more = self._update_node(route, produce, dry_run, validation, patch_source=patch)
        return self._ok(result, warnings=warnings + more)

    @staticmethod
    def _apply_json_patch(current: dict[str, Any], ops: Any, strict: bool, warnings: list[str]) -> Any:
        import jsonpatch  # a dev dependency; only JSON-patch requests need it

        if not isinstance(ops, list):
            what = _json_kind(ops)
            if strict:
                raise _err_bad_request(f"error decoding patch: json: cannot unmarshal {what} into Go value "
                                       "of type []handlers.jsonPatchOp")
            raise _err_bad_request(f"json: cannot unmarshal {what} into Go value of type jsonpatch.Patch")
        for op in ops:
            if not isinstance(op, dict):
                raise _err_bad_request(f"error decoding patch: json: cannot unmarshal {_json_kind(op)} into "
                                       "Go value of type handlers.jsonPatchOp")
            if strict:
                warnings.extend(f'json patch unknown field "{k}"' for k in op
                                if k not in ("op", "path", "from", "value"))
        if len(ops) > _MAX_JSON_PATCH_OPS:
            raise _APIError(_status(413, "RequestEntityTooLarge",
                                    "Request entity too large: The allowed maximum operations in a JSON "
                                    f"patch is {_MAX_JSON_PATCH_OPS}, got {len(ops)}"))
        try:
            return jsonpatch.JsonPatch(ops).apply(current)
        except Exception:  # jsonpatch's conflicts, failed tests, bad pointers: the server says only 422
            raise _err_generic(422) from None

    def _put_node(self, route: _Route, query: dict[str, list[str]], body: bytes) -> _Response:
        dry_run, validation = self._options(query, "UpdateOptions")
        obj = self._decode_body(body, "Node", "v1")
        name = (obj.get("metadata") or {}).get("name", "") if isinstance(obj.get("metadata"), dict) else ""
        if name != route.name:
            raise _err_bad_request(f"the name of the object ({name}) does not match the name on the URL "
                                   f"({route.name})")
        result, warnings = self._update_node(route, lambda current: (obj, "put"), dry_run, validation,
                                             patch_source=obj)
        return self._ok(result, warnings=warnings)

    @staticmethod
    def _decode_body(body: bytes, kind: str, api_version: str) -> dict[str, Any]:
        try:
            obj = json.loads(body)
        except ValueError as e:
            raise _err_bad_request(f"the object provided is unrecognized (must be of type {kind}): "
                                   f"couldn't get version/kind; json parse error: {e}") from None
        if not isinstance(obj, dict):
            raise _err_bad_request(f"the object provided is unrecognized (must be of type {kind}): couldn't "
                                   f"get version/kind; json parse error: json: cannot unmarshal "
                                   f"{_json_kind(obj)} into Go value of type struct {{ APIVersion string "
                                   '"json:\\"apiVersion,omitempty\\""; '
                                   'Kind string "json:\\"kind,omitempty\\"" }')
        got_kind, got_version = obj.get("kind") or kind, obj.get("apiVersion") or api_version
        if got_kind == kind and got_version in ("v1", "events.k8s.io/v1") and got_version != api_version:
            raise _err_bad_request(f"the API version in the data ({got_version}) does not match the expected "
                                   f"API version ({api_version})")
        if got_kind != kind or got_version != api_version:
            version = _goq(got_version.split("/")[-1])
            raise _err_bad_request(f"{got_kind} in version {version} cannot be handled as a {kind}: no kind "
                                   f"{_goq(got_kind)} is registered for version {_goq(got_version)} in "
                                   'scheme "pkg/api/legacyscheme/scheme.go:30"')
        return obj

    def _update_node(self, route: _Route, produce: Callable[[dict[str, Any]], tuple[Any, str]], dry_run: bool,
                     validation: str, patch_source: Any) -> tuple[dict[str, Any], list[str]]:
        """``patcher.patchResource``/``Store.Update`` for a node: produce, decode, check, validate, store."""
        with self._lock:
            current = self._nodes.get(route.name)
            if current is None:
                raise _err_not_found("nodes", route.name)
            raw, how = produce(copy.deepcopy(current))
            try:
                if not isinstance(raw, dict):
                    raise _DecodeError(f"json: cannot unmarshal {_json_kind(raw)} into Go value of type "
                                       "v1.Node")
                kind, version = raw.get("kind") or "Node", raw.get("apiVersion") or "v1"
                if kind != "Node" or version != "v1":
                    raise _DecodeError(f"no kind {_goq(kind)} is registered for version {_goq(version)}")
                obj, unknown = _roundtrip("Node", raw)
            except _DecodeError as e:
                if how == "put":
                    raise _err_bad_request(f'Node in version "v1" cannot be handled as a Node: {e}') from None
                shown = _gov(patch_source) if how == "smp" else json.dumps(raw, separators=(",", ":"))
                raise _err_invalid("", "", [_invalid_value("patch", shown, str(e))]) from None
            warnings = [f'unknown field "{u}"' for u in unknown]
            if unknown and validation == "Strict":
                detail = "strict decoding error: " + ", ".join(warnings)
                if how == "put":
                    raise _err_bad_request(f'Node in version "v1" cannot be handled as a Node: {detail}')
                shown = _gov(patch_source) if how == "smp" else json.dumps(raw, separators=(",", ":"))
                raise _err_invalid("", "", [_invalid_value("patch", shown, detail)])
            if validation == "Ignore":
                warnings = []
            obj = _typed(obj, "Node", "v1")
            _default_node(obj)
            md = obj["metadata"]
            name = md.get("name", "")
            if name != route.name:
                raise _err_bad_request(f"the name of the object ({name}) does not match the name on the URL "
                                       f"({route.name})")
            md.pop("namespace", None)  # cluster-scoped: the server clears it
            rv = md.get("resourceVersion", "")
            if rv in ("", "0"):
                md["resourceVersion"] = current["metadata"]["resourceVersion"]
            elif not rv.isdigit():
                raise _err_internal(f"resourceVersion: Invalid value: {_goq(rv)}: strconv.ParseUint: parsing "
                                    f"{_goq(rv)}: invalid syntax")
            elif rv != current["metadata"]["resourceVersion"]:
                raise _err_conflict("nodes", route.name)
            # rest.BeforeUpdate
            old_md = current["metadata"]
            for k in ("generation",):
                if k in old_md:
                    md[k] = old_md[k]
                else:
                    md.pop(k, None)
            if route.subresource == "status":
                obj["spec"] = copy.deepcopy(current["spec"])
            else:
                obj["status"] = copy.deepcopy(current["status"])
            if not md.get("uid"):
                md["uid"] = old_md["uid"]
            md["creationTimestamp"] = old_md["creationTimestamp"]
            for k in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                if k in old_md:
                    md[k] = old_md[k]
            obj = _roundtrip("Node", obj)[0]
            obj = _typed(obj, "Node", "v1")
            errs = _validate_meta(obj["metadata"], False, _path_segment_errors) + \
                _validate_meta_update(obj["metadata"], old_md)
            if route.subresource != "status":
                errs += _validate_node(obj)
            errs += _validate_node_update(obj, current)
            if errs:
                raise _err_invalid("Node", route.name, errs)
            if obj == current or dry_run:
                return copy.deepcopy(obj if dry_run else current), warnings
            obj["metadata"]["resourceVersion"] = self._next_rv()
            self._nodes[route.name] = obj
            return copy.deepcopy(obj), warnings

    # -- events ---------------------------------------------------------------------------------------------
    def _create_event(self, route: _Route, query: dict[str, list[str]], body: bytes) -> _Response:
        v1 = route.group == "events.k8s.io"
        dry_run, validation = self._options(query, "CreateOptions")
        obj = self._decode_body(body, "Event", "events.k8s.io/v1" if v1 else "v1")
        try:
            decoded, unknown = _roundtrip("EventsV1Event" if v1 else "Event", obj)
        except _DecodeError as e:
            raise _err_bad_request(f'Event in version "v1" cannot be handled as a Event: {e}') from None
        warnings = [f'unknown field "{u}"' for u in unknown]
        if unknown and validation == "Strict":
            raise _err_bad_request('Event in version "v1" cannot be handled as a Event: strict decoding '
                                   "error: " + ", ".join(warnings))
        if validation == "Ignore":
            warnings = []
        ev = _events_v1_to_core(decoded) if v1 else decoded
        md = ev["metadata"]
        if md.get("namespace") and md["namespace"] != route.namespace:
            raise _err_bad_request("the namespace of the provided object does not match the namespace sent "
                                   "on the request")
        md["namespace"] = route.namespace
        with self._lock:
            if route.namespace not in self._namespaces:
                raise _err_not_found("namespaces", route.namespace)
            for k in ("creationTimestamp", "uid", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "selfLink"):
                md.pop(k, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = _rfc3339()
            if md.get("generateName") and not md.get("name"):
                base = md["generateName"][:58]
                md["name"] = base + "".join(random.choice(_RANDOM_ALPHABET) for _ in range(5))
            ev = _roundtrip("Event", ev)[0]
            ev = _typed(ev, "Event", "v1")
            md = ev["metadata"]
            errs = _validate_event(ev, legacy_only=not v1)
            if not errs:
                errs = _validate_meta(md, True, _path_segment_errors)
            if errs:
                raise _err_invalid("Event", md.get("name", ""), errs)
            if md.get("resourceVersion") and not dry_run:  # etcd3 store.Create; the dry-run store skips it
                raise _err_internal("resourceVersion should not be set on objects to be created")
            key = (route.namespace, md["name"])
            if key in self._events:
                raise _err_already_exists("events", md["name"], route.group)
            if not dry_run:
                md["resourceVersion"] = self._next_rv()
                self._events[key] = ev
            out = _core_to_events_v1(ev) if v1 else copy.deepcopy(ev)
        return self._ok(out, code=201, warnings=warnings)


def _typed(obj: dict[str, Any], kind: str, api_version: str) -> dict[str, Any]:
    """``obj`` with the ``kind`` and ``apiVersion`` the encoder writes (first, as Go does)."""
    rest = {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
    return {"kind": kind, "apiVersion": api_version, **rest}


def _list_item(obj: dict[str, Any]) -> dict[str, Any]:
    """An item of a list answer: the real server leaves ``kind`` and ``apiVersion`` out of items."""
    return {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _default_node(node: dict[str, Any]) -> None:
    """``SetDefaults_NodeStatus``: allocatable defaults to capacity."""
    status = node.setdefault("status", {})
    if not status.get("allocatable") and status.get("capacity"):
        status["allocatable"] = dict(status["capacity"])


