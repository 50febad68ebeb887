"""Validation as the API server runs it: names, labels, annotations, taints, Nodes and Events.

Each function returns the field errors the real server reports for the same object (same
field paths, same wording), which :func:`kube_standin.status.err_invalid` turns into a 422.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from kube_standin.status import FieldError, invalid_value, not_supported, required

_ANNOTATIONS_LIMIT = 256 * 1024
"""``TotalAnnotationSizeLimitB``: keys and values of one object's annotations together."""

# -- names, labels and annotations (apimachinery/pkg/util/validation, api/validate/content) -------
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


def _regex_error(msg: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    return msg + " (e.g. " + " or ".join(f"'{e}', " for e in examples)[:-2] + \
        f", regex used for validation is '{fmt}')"


def _max_len(n: int) -> str:
    return f"must be no more than {n} characters"


def dns_subdomain_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append(_max_len(253))
    if not _DNS_SUBDOMAIN_RE.match(value):
        errs.append(_regex_error("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                                 "characters, '-' or '.', and must start and end with an alphanumeric "
                                 "character", _DNS_SUBDOMAIN_FMT, "example.com"))
    return errs


def dns_label_errors(value: str) -> list[str]:
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


def label_key_errors(value: str) -> list[str]:
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
            errs.extend("prefix part " + m for m in dns_subdomain_errors(prefix))
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


def label_value_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append(_max_len(63))
    if not _LABEL_VALUE_RE.match(value):
        errs.append(_regex_error("a valid label must be an empty string or consist of alphanumeric "
                                 "characters, '-', '_' or '.', and must start and end with an alphanumeric "
                                 "character", _LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errs


def path_segment_errors(name: str, prefix: bool) -> list[str]:
    """``path.IsValidPathSegmentName`` (the generic check every object name gets)."""
    if not prefix and name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]



# -- objects (pkg/apis/core/validation, apimachinery/pkg/api/validation) ---------------------------
_TAINT_EFFECTS = ["NoSchedule", "PreferNoSchedule", "NoExecute"]


def _validate_labels(labels: dict[str, str] | None, path: str) -> list[FieldError]:
    errs = []
    for k, v in (labels or {}).items():
        errs += [invalid_value(path, k, m) for m in label_key_errors(k)]
        errs += [invalid_value(path, v, m) for m in label_value_errors(v)]
    return errs


def _validate_annotations(annotations: dict[str, str] | None, path: str) -> list[FieldError]:
    errs = []
    annotations = annotations or {}
    for k in annotations:
        errs += [invalid_value(path, k, m) for m in label_key_errors(k.lower())]
    if sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items()) > _ANNOTATIONS_LIMIT:
        errs.append(FieldError("FieldValueTooLong", path, "<value omitted>",
                               f"may not be more than {_ANNOTATIONS_LIMIT} bytes"))
    return errs


def _validate_owner_refs(refs: list[dict[str, Any]] | None, path: str) -> list[FieldError]:
    errs: list[FieldError] = []
    controller = ""
    for i, r in enumerate(refs or []):
        p = f"{path}[{i}]"
        for k in ("apiVersion", "kind", "name", "uid"):
            if not r.get(k):
                errs.append(required(f"{p}.{k}", "must not be empty"))
        if r.get("controller"):
            here = f"{r.get('kind', '')}/{r.get('name', '')}"
            if controller:
                errs.append(invalid_value(path, refs, "Only one reference can have Controller set to "
                                          f'true. Found "true" in references for {controller} and {here}'))
            else:
                controller = here
    return errs


def validate_meta(md: dict[str, Any], namespaced: bool,
                  name_fn: Callable[[str, bool], list[str]]) -> list[FieldError]:
    """``ValidateObjectMetaAccessor``."""
    errs: list[FieldError] = []
    if md.get("generateName"):
        errs += [invalid_value("metadata.generateName", md["generateName"], m)
                 for m in name_fn(md["generateName"], True)]
    if not md.get("name"):
        errs.append(required("metadata.name", "name or generateName is required"))
    else:
        errs += [invalid_value("metadata.name", md["name"], m) for m in name_fn(md["name"], False)]
    if namespaced:
        if not md.get("namespace"):
            errs.append(required("metadata.namespace"))
        else:
            errs += [invalid_value("metadata.namespace", md["namespace"], m)
                     for m in dns_label_errors(md["namespace"])]
    elif md.get("namespace"):
        errs.append(FieldError("FieldValueForbidden", "metadata.namespace", "", "not allowed on this type"))
    if md.get("generation", 0) < 0:
        errs.append(invalid_value("metadata.generation", md["generation"],
                                  "must be greater than or equal to 0"))
    errs += _validate_labels(md.get("labels"), "metadata.labels")
    errs += _validate_annotations(md.get("annotations"), "metadata.annotations")
    errs += _validate_owner_refs(md.get("ownerReferences"), "metadata.ownerReferences")
    for f in md.get("finalizers") or []:
        errs += [invalid_value("metadata.finalizers", f, m) for m in label_key_errors(f)]
    return errs


def validate_meta_update(md: dict[str, Any], old: dict[str, Any]) -> list[FieldError]:
    """``ValidateObjectMetaAccessorUpdate``."""
    errs: list[FieldError] = []
    if not md.get("resourceVersion"):
        errs.append(invalid_value("metadata.resourceVersion", "", "must be specified for an update"))
    for k in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
              "deletionGracePeriodSeconds"):
        if md.get(k) != old.get(k):
            bad = md.get(k)
            if bad is None and k in ("name", "namespace", "uid"):
                bad = ""
            errs.append(invalid_value(f"metadata.{k}", bad, "field is immutable"))
    errs += _validate_labels(md.get("labels"), "metadata.labels")
    errs += _validate_annotations(md.get("annotations"), "metadata.annotations")
    errs += _validate_owner_refs(md.get("ownerReferences"), "metadata.ownerReferences")
    return errs


def _validate_taints(taints: list[dict[str, Any]] | None, path: str) -> list[FieldError]:
    """``validateNodeTaints`` (the caller passes ``metadata.taints``: the real server's field path)."""
    errs: list[FieldError] = []
    seen: dict[str, set[str]] = {}
    for i, t in enumerate(taints or []):
        p = f"{path}[{i}]"
        key, value, effect = t.get("key", ""), t.get("value", ""), t.get("effect", "")
        errs += [invalid_value(f"{p}.key", key, m) for m in label_key_errors(key)]
        if msgs := label_value_errors(value):
            errs.append(invalid_value(f"{p}.value", value, ";".join(msgs)))
        if not effect:
            errs.append(required(f"{p}.effect"))
        elif effect not in _TAINT_EFFECTS:
            errs.append(not_supported(f"{p}.effect", effect, _TAINT_EFFECTS))
        if key in seen.get(effect, set()):
            internal = {"Key": key, "Value": value, "Effect": effect, "TimeAdded": t.get("timeAdded")}
            errs.append(FieldError("FieldValueDuplicate", p, internal,
                                   "taints must be unique by key and effect pair"))
            continue
        seen.setdefault(effect, set()).add(key)
    return errs


def _node_name_errors(name: str, prefix: bool) -> list[str]:
    return dns_subdomain_errors(name[:-1] if prefix and name.endswith("-") else name)


def validate_node(node: dict[str, Any]) -> list[FieldError]:
    """``ValidateNode``."""
    errs = validate_meta(node["metadata"], False, _node_name_errors)
    errs += _validate_taints(node["spec"].get("taints"), "metadata.taints")
    return errs


def validate_node_update(node: dict[str, Any], old: dict[str, Any]) -> list[FieldError]:
    """``ValidateNodeUpdate``."""
    errs = validate_meta_update(node["metadata"], old["metadata"])
    seen: list[dict[str, Any]] = []
    for i, a in enumerate(node["status"].get("addresses") or []):
        if a in seen:
            errs.append(FieldError("FieldValueDuplicate", f"status.addresses[{i}]",
                                   {"Type": a.get("type", ""), "Address": a.get("address", "")}))
        seen.append(a)
    old_cidrs, new_cidrs = old["spec"].get("podCIDRs") or [], node["spec"].get("podCIDRs") or []
    if old_cidrs and old_cidrs != new_cidrs:
        changed = 1 if len(old_cidrs) != len(new_cidrs) else \
            sum(a != b for a, b in zip(old_cidrs, new_cidrs, strict=True))
        errs += [FieldError("FieldValueForbidden", "spec.podCIDRs", "",
                            'node updates may not change podCIDR except from "" to valid')] * changed
    if old["spec"].get("providerID") and old["spec"].get("providerID") != node["spec"].get("providerID"):
        errs.append(FieldError("FieldValueForbidden", "spec.providerID", "",
                               'node updates may not change providerID except from "" to valid'))
    errs += _validate_taints(node["spec"].get("taints"), "metadata.taints")
    if node["spec"].get("externalID", "") != old["spec"].get("externalID", ""):
        errs.append(FieldError("FieldValueForbidden", "spec.externalID", "", "may not be updated"))
    return errs


def validate_event(ev: dict[str, Any], legacy_only: bool) -> list[FieldError]:
    """``ValidateEventCreate`` on the internal event (core/v1 shape; ``legacy_only`` for core/v1)."""
    errs: list[FieldError] = []
    ns, inv_ns = ev["metadata"].get("namespace", ""), ev["involvedObject"].get("namespace", "")
    mismatch = invalid_value("involvedObject.namespace", inv_ns, "does not match event.namespace")
    if not ev.get("eventTime"):
        if (not inv_ns and ns not in ("", "default")) or (inv_ns and ns != inv_ns):
            errs.append(mismatch)
    else:
        if not inv_ns and ns not in ("default", "kube-system"):
            errs.append(mismatch)
        controller = ev.get("reportingComponent", "")
        if not controller:
            errs.append(required("reportingController"))
        errs += [invalid_value("reportingController", controller, m) for m in label_key_errors(controller)]
        for name, limit in (("reportingInstance", 128), ("action", 128), ("reason", 128)):
            if not ev.get(name):
                errs.append(required(name))
            if len(ev.get(name, "")) > limit:
                errs.append(invalid_value(name, "", f"can have at most {limit} characters"))
        if len(ev.get("message", "")) > 1024:
            errs.append(invalid_value("message", "", "can have at most 1024 characters"))
    errs += [invalid_value("namespace", ns, m) for m in dns_subdomain_errors(ns)]
    if legacy_only:
        return errs
    errs += validate_meta(ev["metadata"], True, lambda n, p: dns_subdomain_errors(
        n[:-1] if p and n.endswith("-") else n))
    if ev.get("series") is not None:
        if ev["series"].get("count", 0) < 2:
            errs.append(invalid_value("series.count", "", "should be at least 2"))
        if not ev["series"].get("lastObservedTime"):
            errs.append(required("series.lastObservedTime"))
    if not ev.get("eventTime"):
        errs.append(required("eventTime"))
    if ev.get("type", "") not in ("Normal", "Warning"):
        errs.append(invalid_value("type", "", f"has invalid value: {ev.get('type', '')}"))
    for name in ("firstTimestamp", "lastTimestamp"):
        if ev.get(name):
            errs.append(invalid_value(name, "", "needs to be unset"))
    if ev.get("count"):
        errs.append(invalid_value("count", "", "needs to be unset"))
    if ev.get("source"):
        errs.append(invalid_value("source", "", "needs to be unset"))
    return errs
