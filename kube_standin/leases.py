"""``coordination.k8s.io/v1`` Leases: create, get, list, update (PUT), patch, delete, with the
real server's optimistic concurrency.

What a writer that shares a count through a Lease relies on, as the generic registry and the
Lease strategy do it (``pkg/registry/coordination/lease``): a create of a name that exists is a
409 ``AlreadyExists``; an update (PUT) must carry ``metadata.resourceVersion`` (the Lease
strategy allows no unconditional update: a 422 ``must be specified for an update``) and one
other than the stored version is a 409 ``Conflict``; an update of a Lease that does not exist
is a 404 (no create on update); a get of one is a 404 ``leases.coordination.k8s.io "x" not
found``. A PATCH applies to the stored object under the store's lock (a JSON patch that sets
``metadata.resourceVersion`` makes it conditional). The namespace must exist (404).
``dryRun=All`` runs everything and stores nothing. Validation: the name is a DNS subdomain,
``spec.leaseDurationSeconds`` > 0, ``spec.leaseTransitions`` >= 0, ``spec.preferredHolder``
only with ``spec.strategy``, whose one value is ``OldestEmulationVersion``.
"""

from __future__ import annotations

import copy
import random
import threading
import uuid
from collections.abc import Callable
from typing import Any

from kube_standin.schema import DecodeError, json_kind, list_item, rfc3339, roundtrip, typed
from kube_standin.status import (
    FieldError,
    err_already_exists,
    err_bad_request,
    err_conflict,
    err_internal,
    err_invalid,
    err_not_found,
    failure,
    goq,
    invalid_value,
    not_supported,
)
from kube_standin.validation import dns_subdomain_errors, validate_meta, validate_meta_update

GROUP = "coordination.k8s.io"
API_VERSION = f"{GROUP}/v1"
_STRATEGIES = ["OldestEmulationVersion"]
_RANDOM_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def _name_errors(name: str, prefix: bool) -> list[str]:
    return dns_subdomain_errors(name + ("a" if prefix else ""))


def validate_lease(lease: dict[str, Any]) -> list[FieldError]:
    """``ValidateLease``: the object's metadata (namespaced, a DNS-subdomain name) and its spec."""
    errs = validate_meta(lease["metadata"], True, _name_errors)
    spec = lease.get("spec") or {}
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and duration <= 0:
        errs.append(invalid_value("spec.leaseDurationSeconds", duration, "must be greater than 0"))
    transitions = spec.get("leaseTransitions")
    if transitions is not None and transitions < 0:
        errs.append(invalid_value("spec.leaseTransitions", transitions,
                                  "must be greater than or equal to 0"))
    strategy = spec.get("strategy")
    if strategy is not None and strategy not in _STRATEGIES:
        errs.append(not_supported("spec.strategy", strategy, _STRATEGIES))
    if spec.get("preferredHolder") is not None and strategy is None:
        errs.append(FieldError("FieldValueForbidden", "spec.preferredHolder", "",
                               "may only be specified if `strategy` is defined"))
    return errs


def decode_lease(raw: Any, *, put: bool) -> dict[str, Any]:
    """``raw`` decoded as a Lease (a 400 for a body that is no Lease; for a patch's result, the
    422 ``patch: Invalid value``)."""
    try:
        if not isinstance(raw, dict):
            raise DecodeError(f"json: cannot unmarshal {json_kind(raw)} into Go value of type v1.Lease")
        kind, version = raw.get("kind") or "Lease", raw.get("apiVersion") or API_VERSION
        if kind != "Lease" or version != API_VERSION:
            raise DecodeError(f"no kind {goq(kind)} is registered for version {goq(version)}")
        obj, _ = roundtrip("Lease", raw)
    except DecodeError as e:
        if put:
            raise err_bad_request(f'Lease in version "v1" cannot be handled as a Lease: {e}') from None
        raise err_invalid("", "", [invalid_value("patch", "<value omitted>", str(e))]) from None
    return typed(obj, "Lease", API_VERSION)


class LeaseStore:
    """The Leases of a :class:`~kube_standin.store.Store`, under its lock and resourceVersion
    counter (the attributes below are the store's)."""

    _lock: threading.RLock
    _namespaces: set[str]
    _leases: dict[tuple[str, str], dict[str, Any]]

    def _next_rv(self) -> str:
        raise NotImplementedError

    # -- for tests ----------------------------------------------------------------------------------
    def lease(self, namespace: str, name: str) -> dict[str, Any]:
        """A deep copy of the stored Lease (``KeyError`` if there is none)."""
        with self._lock:
            return copy.deepcopy(self._leases[(namespace, name)])

    def leases(self) -> list[dict[str, Any]]:
        """Deep copies of every Lease, by namespace and name."""
        with self._lock:
            return [copy.deepcopy(self._leases[k]) for k in sorted(self._leases)]

    # -- for the request handlers -------------------------------------------------------------------
    def get_lease(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            lease = self._leases.get((namespace, name))
            if lease is None:
                raise err_not_found("leases", name, GROUP)
            return copy.deepcopy(lease)

    def list_leases(self, namespace: str) -> dict[str, Any]:
        with self._lock:
            items = [list_item(self._leases[k]) for k in sorted(self._leases)
                     if not namespace or k[0] == namespace]
            return {"kind": "LeaseList", "apiVersion": API_VERSION,
                    "metadata": {"resourceVersion": str(getattr(self, "_rv", 0))}, "items": items}

    def create_lease(self, namespace: str, raw: Any, *, dry_run: bool) -> dict[str, Any]:
        """``Store.Create``: a 404 for a missing namespace, a 409 ``AlreadyExists`` for a taken
        name, a 422 for an invalid Lease."""
        lease = decode_lease(raw, put=True)
        md = lease["metadata"]
        if md.get("namespace") and md["namespace"] != namespace:
            raise err_bad_request("the namespace of the provided object does not match the namespace "
                                  "sent on the request")
        with self._lock:
            if namespace not in self._namespaces:
                raise err_not_found("namespaces", namespace)
            md["namespace"] = namespace
            for k in ("creationTimestamp", "uid", "deletionTimestamp", "deletionGracePeriodSeconds",
                      "selfLink"):
                md.pop(k, None)
            md["uid"] = str(uuid.uuid4())
            md["creationTimestamp"] = rfc3339()
            if md.get("generateName") and not md.get("name"):
                md["name"] = md["generateName"][:58] + "".join(
                    random.choice(_RANDOM_ALPHABET) for _ in range(5))
            lease = typed(roundtrip("Lease", lease)[0], "Lease", API_VERSION)
            md = lease["metadata"]
            if errs := validate_lease(lease):
                raise err_invalid("Lease", md.get("name", ""), errs, group=GROUP)
            if md.get("resourceVersion") and not dry_run:
                raise err_internal("resourceVersion should not be set on objects to be created")
            key = (namespace, md["name"])
            if key in self._leases:
                raise err_already_exists("leases", md["name"], GROUP)
            if not dry_run:
                md["resourceVersion"] = self._next_rv()
                self._leases[key] = lease
            return copy.deepcopy(lease)

    def update_lease(self, namespace: str, name: str, produce: Callable[[dict[str, Any]], Any], *,
                     dry_run: bool, put: bool) -> dict[str, Any]:
        """``Store.Update``: ``produce(copy of the stored Lease)`` is the new object (PUT: the body;
        PATCH: the patched document). A 404 when there is none, a 422 for a PUT without a
        resourceVersion, a 409 for a stale one."""
        with self._lock:
            current = self._leases.get((namespace, name))
            if current is None:
                raise err_not_found("leases", name, GROUP)
            lease = decode_lease(produce(copy.deepcopy(current)), put=put)
            md = lease["metadata"]
            if md.get("name", "") != name:
                raise err_bad_request(f"the name of the object ({md.get('name', '')}) does not match the "
                                      f"name on the URL ({name})")
            if md.get("namespace") and md["namespace"] != namespace:
                raise err_bad_request("the namespace of the provided object does not match the namespace "
                                      "sent on the request")
            md["namespace"] = namespace
            old_md = current["metadata"]
            rv = md.get("resourceVersion", "")
            if not put and rv in ("", "0"):
                md["resourceVersion"] = rv = old_md["resourceVersion"]
            if rv and not rv.isdigit():
                raise err_internal(f"resourceVersion: Invalid value: {goq(rv)}: strconv.ParseUint: parsing "
                                   f"{goq(rv)}: invalid syntax")
            if rv and rv != old_md["resourceVersion"]:
                raise err_conflict("leases", name, group=GROUP)
            if not md.get("uid"):
                md["uid"] = old_md["uid"]
            md["creationTimestamp"] = old_md["creationTimestamp"]
            lease = typed(roundtrip("Lease", lease)[0], "Lease", API_VERSION)
            errs = validate_meta_update(lease["metadata"], old_md) + validate_lease(lease)
            if errs:
                raise err_invalid("Lease", name, errs, group=GROUP)
            if lease == current or dry_run:
                return copy.deepcopy(lease if dry_run else current)
            lease["metadata"]["resourceVersion"] = self._next_rv()
            self._leases[(namespace, name)] = lease
            return copy.deepcopy(lease)

    def delete_lease(self, namespace: str, name: str, *, dry_run: bool) -> dict[str, Any]:
        """The success Status the generic registry answers a delete with."""
        with self._lock:
            lease = self._leases.get((namespace, name))
            if lease is None:
                raise err_not_found("leases", name, GROUP)
            if not dry_run:
                del self._leases[(namespace, name)]
            st = failure(200, "", "", {"name": name, "group": GROUP, "kind": "leases",
                                       "uid": lease["metadata"]["uid"]})
            st["status"] = "Success"
            return st
