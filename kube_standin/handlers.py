"""The requests served: what each endpoint does with a request that passed authentication.

:func:`serve` authorises the request (RBAC), checks the method, and answers it from the
:class:`~kube_standin.store.Store`: GET of ``/version``, a node, an event and the lists; PATCH
(:mod:`kube_standin.patch`) and PUT of a node or its ``/status``; POST of an Event in core/v1
or ``events.k8s.io/v1``. Options (``dryRun``, ``fieldValidation``, ``fieldManager``) are
checked as ``Validate{Patch,Update,Create}Options`` does, and bodies are decoded as the
typed object (:mod:`kube_standin.schema`).
"""

from __future__ import annotations

import json
from typing import Any

from kube_standin.auth import Access
from kube_standin.patch import PATCH_TYPES, patched
from kube_standin.routes import ALLOWED_METHODS, Route, verb
from kube_standin.schema import (
    KUBE_VERSION,
    DecodeError,
    core_to_events_v1,
    events_v1_to_core,
    json_kind,
    roundtrip,
)
from kube_standin.status import (
    APIError,
    FieldError,
    err_bad_request,
    err_generic,
    err_invalid,
    err_unsupported_media,
    failure,
    goq,
    invalid_value,
    not_supported,
)
from kube_standin.store import Store
from kube_standin.transport import JSON_CONTENT, Response

_VERSION = {"major": "1", "minor": KUBE_VERSION.split(".")[1], "gitVersion": KUBE_VERSION,
            "gitCommit": "0" * 40, "gitTreeState": "clean", "buildDate": "2026-08-01T00:00:00Z",
            "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"}


def serve(store: Store, access: Access, method: str, path: str, route: Route | None,
          query: dict[str, list[str]], headers: Any, body: bytes) -> Response:
    """The answer to one request (``query``: every value of each parameter); an ``APIError``
    for a failure."""
    user = access.authenticate(headers)
    if path == "/version" and method == "GET":
        return ok(_VERSION)
    if route is None:
        raise err_generic(404)
    rbac_verb = verb(method, route, query)
    access.authorize(rbac_verb, route, user)
    if method not in ALLOWED_METHODS[route.endpoint]:
        raise err_generic(405)
    if rbac_verb == "watch":
        raise APIError(failure(405, "MethodNotAllowed", "watch is not served by the stand-in API server",
                               {}))
    if route.endpoint == "nodes":
        return ok(store.list_nodes(query))
    if route.endpoint == "node":
        if method == "GET":
            return ok(store.get_node(route.name))
        if method == "PATCH":
            content_type = (headers.get("Content-Type") or "").split(";")[0].strip()
            return _patch_node(store, route, query, content_type, body)
        return _put_node(store, route, query, body)
    if route.endpoint in ("leases", "lease"):
        return _leases(store, route, method, query, headers, body)
    if route.endpoint == "events":
        if method == "GET":
            return ok(store.list_events(route.namespace, route.group, query))
        if not route.namespace:  # the all-namespaces path lists; creating needs a namespace
            raise err_generic(405)
        return _create_event(store, route, query, body)
    ev = store.get_event(route.namespace, route.name, route.group)
    return ok(core_to_events_v1(ev) if route.group else ev)


def ok(obj: Any, code: int = 200, warnings: list[str] | None = None) -> Response:
    """A JSON answer, with a ``Warning: 299`` header per warning."""
    headers = {"Warning": "\n".join(f'299 - {json.dumps(w)}' for w in warnings)} if warnings else {}
    return Response(code, json.dumps(obj, separators=(",", ":")).encode(), JSON_CONTENT, headers)


def error_response(e: APIError) -> Response:
    """The answer for a failure: its Status as JSON (a 429: plain text)."""
    if e.text is not None:
        return Response(e.code, e.text.encode(), "text/plain; charset=utf-8", dict(e.headers))
    return Response(e.code, json.dumps(e.status, separators=(",", ":")).encode(), JSON_CONTENT,
                    dict(e.headers))


def _options(query: dict[str, list[str]], kind: str) -> tuple[bool, str]:
    """``Validate{Patch,Update,Create}Options``: (dry run, field validation) or a 422."""
    errs: list[FieldError] = []
    manager = query.get("fieldManager", [""])[0]
    if len(manager) > 128:
        errs.append(FieldError("FieldValueTooLong", "fieldManager", "<value omitted>",
                               "may not be more than 128 bytes"))
    elif manager and not manager.isprintable():
        errs.append(invalid_value("fieldManager", manager, "must only contain printable characters"))
    if kind == "PatchOptions" and "force" in query:
        errs.append(FieldError("FieldValueForbidden", "force", "",
                               "may not be specified for non-apply patch"))
    dry = query.get("dryRun", [])
    if any(v != "All" for v in dry):
        errs.append(not_supported("dryRun", dry, ["All"]))
    validation = query.get("fieldValidation", [""])[0]
    if validation not in ("", "Ignore", "Strict", "Warn"):
        errs.append(not_supported("fieldValidation", validation, ["", "Ignore", "Strict", "Warn"]))
    if errs:
        raise err_invalid(kind, "", errs, group="meta.k8s.io")
    return bool(dry), validation or "Warn"


# -- nodes: PATCH and PUT, the update they share in the store ---------------------------------------
def _patch_node(store: Store, route: Route, query: dict[str, list[str]], content_type: str,
                body: bytes) -> Response:
    if content_type not in PATCH_TYPES:
        raise err_unsupported_media(PATCH_TYPES)
    dry_run, validation = _options(query, "PatchOptions")
    try:
        patch = json.loads(body)
    except ValueError:
        raise err_bad_request("invalid JSON patch") from None
    strict = validation in ("Warn", "Strict")
    warnings: list[str] = []
    result, more = store.update_node(
        route.name, route.subresource,
        lambda current: patched(content_type, current, patch, strict=strict, warnings=warnings),
        dry_run=dry_run, validation=validation, put=False)
    return ok(result, warnings=warnings + more)


def _put_node(store: Store, route: Route, query: dict[str, list[str]], body: bytes) -> Response:
    dry_run, validation = _options(query, "UpdateOptions")
    obj = _decode_body(body, "Node", "v1")
    name = (obj.get("metadata") or {}).get("name", "") if isinstance(obj.get("metadata"), dict) else ""
    if name != route.name:
        raise err_bad_request(f"the name of the object ({name}) does not match the name on the URL "
                              f"({route.name})")
    result, warnings = store.update_node(route.name, route.subresource, lambda current: obj,
                                         dry_run=dry_run, validation=validation, put=True)
    return ok(result, warnings=warnings)


def _decode_body(body: bytes, kind: str, api_version: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise err_bad_request(f"the object provided is unrecognized (must be of type {kind}): "
                              f"couldn't get version/kind; json parse error: {e}") from None
    if not isinstance(obj, dict):
        raise err_bad_request(f"the object provided is unrecognized (must be of type {kind}): couldn't "
                              f"get version/kind; json parse error: json: cannot unmarshal "
                              f"{json_kind(obj)} into Go value of type struct {{ APIVersion string "
                              '"json:\\"apiVersion,omitempty\\""; '
                              'Kind string "json:\\"kind,omitempty\\"" }')
    got_kind, got_version = obj.get("kind") or kind, obj.get("apiVersion") or api_version
    if got_kind == kind and got_version in ("v1", "events.k8s.io/v1") and got_version != api_version:
        raise err_bad_request(f"the API version in the data ({got_version}) does not match the expected "
                              f"API version ({api_version})")
    if got_kind != kind or got_version != api_version:
        version = goq(got_version.split("/")[-1])
        raise err_bad_request(f"{got_kind} in version {version} cannot be handled as a {kind}: no kind "
                              f"{goq(got_kind)} is registered for version {goq(got_version)} in "
                              'scheme "pkg/api/legacyscheme/scheme.go:30"')
    return obj


# -- leases -------------------------------------------------------------------------------------------
def _leases(store: Store, route: Route, method: str, query: dict[str, list[str]], headers: Any,
            body: bytes) -> Response:
    if route.endpoint == "leases":
        if method == "GET":
            return ok(store.list_leases(route.namespace))
        if not route.namespace:  # the all-namespaces path lists; creating needs a namespace
            raise err_generic(405)
        dry_run, _ = _options(query, "CreateOptions")
        return ok(store.create_lease(route.namespace, _json_body(body, "Lease"), dry_run=dry_run),
                  code=201)
    if method == "GET":
        return ok(store.get_lease(route.namespace, route.name))
    if method == "DELETE":
        dry_run, _ = _options(query, "DeleteOptions")
        return ok(store.delete_lease(route.namespace, route.name, dry_run=dry_run))
    if method == "PUT":
        dry_run, _ = _options(query, "UpdateOptions")
        obj = _json_body(body, "Lease")
        return ok(store.update_lease(route.namespace, route.name, lambda current: obj,
                                     dry_run=dry_run, put=True))
    content_type = (headers.get("Content-Type") or "").split(";")[0].strip()
    if content_type not in PATCH_TYPES:
        raise err_unsupported_media(PATCH_TYPES)
    dry_run, validation = _options(query, "PatchOptions")
    try:
        patch = json.loads(body)
    except ValueError:
        raise err_bad_request("invalid JSON patch") from None
    return ok(store.update_lease(
        route.namespace, route.name,
        lambda current: patched(content_type, current, patch,
                                strict=validation in ("Warn", "Strict"), warnings=[]),
        dry_run=dry_run, put=False))


def _json_body(body: bytes, kind: str) -> Any:
    try:
        return json.loads(body)
    except ValueError as e:
        raise err_bad_request(f"the object provided is unrecognized (must be of type {kind}): "
                              f"couldn't get version/kind; json parse error: {e}") from None


# -- events -------------------------------------------------------------------------------------------
def _create_event(store: Store, route: Route, query: dict[str, list[str]], body: bytes) -> Response:
    v1 = route.group == "events.k8s.io"
    dry_run, validation = _options(query, "CreateOptions")
    obj = _decode_body(body, "Event", "events.k8s.io/v1" if v1 else "v1")
    try:
        decoded, unknown = roundtrip("EventsV1Event" if v1 else "Event", obj)
    except DecodeError as e:
        raise err_bad_request(f'Event in version "v1" cannot be handled as a Event: {e}') from None
    warnings = [f'unknown field "{u}"' for u in unknown]
    if unknown and validation == "Strict":
        raise err_bad_request('Event in version "v1" cannot be handled as a Event: strict decoding '
                              "error: " + ", ".join(warnings))
    if validation == "Ignore":
        warnings = []
    ev = events_v1_to_core(decoded) if v1 else decoded
    md = ev["metadata"]
    if md.get("namespace") and md["namespace"] != route.namespace:
        raise err_bad_request("the namespace of the provided object does not match the namespace sent "
                              "on the request")
    md["namespace"] = route.namespace
    created = store.create_event(route.namespace, route.group, ev, dry_run=dry_run)
    return ok(core_to_events_v1(created) if v1 else created, code=201, warnings=warnings)
