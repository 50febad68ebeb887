"""The breaker's count, shared by every writer of a job through a ``coordination.k8s.io/v1`` Lease.

Two processes of one job (two guard instances, a restarted rank beside an old one) that each
listed the cluster and then cordoned would each see room under ``max_nodes`` and together
exceed it. So a quarantine first *reserves* its nodes in the job's Lease (one per job, in the
job's namespace, named by :func:`lease_name`): read the Lease, judge with its count
(:func:`~sdc_guard.remediation.breaker.admit`), write the new count under the
``resourceVersion`` read. A writer that lost the race gets 409 (a stale version, or a Lease
created meanwhile), reads again and judges again, so of N writers the limits hold for all of
them together. Only a node reserved is cordoned; a cordon that fails gives its reservation
back.

The count is the annotation ``sdc-guard.io/breaker`` of the Lease: JSON ``{"job": ..., "nodes":
{node: unix time}}``, the entries older than the window dropped at each write. The Lease's
``spec.holderIdentity`` and ``renewTime`` name the last writer, for people reading it; nothing
here elects a leader. Deleting the Lease resets the count (the nodes still carrying our marker
are counted from the cluster all the same). In a dry run the writes are sent with
``dryRun=All`` and store nothing, so dry-run reservations are counted in memory only.

RBAC: ``get``, ``create`` and ``update`` on ``leases`` (API group ``coordination.k8s.io``) in
the job's namespace only: a Role and RoleBinding, ``deploy/rbac.yaml``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

from sdc_guard.remediation.api import Conflict, KubeError, NodeAPI
from sdc_guard.remediation.breaker import Admission, BreakerLimits, admit

log = logging.getLogger(__name__)

BREAKER_ANNOTATION = "sdc-guard.io/breaker"
ATTEMPTS = 8
"""Read-judge-write rounds before giving up (each lost round means another writer won one)."""


def lease_name(job: str) -> str:
    """The Lease of ``job``: ``sdc-guard-<job>``, a valid DNS subdomain; a job name that needs
    changing to be one (``unnamed@host``, capitals, length) gets a hash of the original."""
    clean = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", job.lower())).strip("-")
    name = f"sdc-guard-{clean}" if clean else "sdc-guard"
    if clean != job or len(name) > 200:
        name = f"{name[:200].rstrip('-')}-{hashlib.sha256(job.encode()).hexdigest()[:10]}"
    return name


def held_in(lease: Mapping[str, Any] | None) -> dict[str, float]:
    """The nodes a Lease counts and when each was reserved ({} for None or foreign content)."""
    notes = ((lease or {}).get("metadata") or {}).get("annotations") or {}
    try:
        nodes = json.loads(notes.get(BREAKER_ANNOTATION) or "{}").get("nodes") or {}
        return {str(n): float(t) for n, t in nodes.items()}
    except (ValueError, TypeError, AttributeError):
        log.warning("the breaker's Lease holds no count sdc-guard can read; counting it empty")
        return {}


class SharedBreaker:
    """Reserve nodes in the job's Lease before cordoning them (see the module doc)."""

    def __init__(self, api: NodeAPI, *, namespace: str, job: str, limits: BreakerLimits,
                 identity: str, dry_run: bool) -> None:
        self.api = api
        self.namespace = namespace
        self.name = lease_name(job)
        self.job = job
        self.limits = limits
        self.identity = identity
        self.dry_run = dry_run

    def read(self, now: float) -> tuple[dict[str, Any] | None, dict[str, float]]:
        """The Lease (None when there is none) and the nodes it holds within the window."""
        lease = self.api.get_lease(self.namespace, self.name)
        held = {n: t for n, t in held_in(lease).items() if now - t < self.limits.window_s}
        return lease, held

    def reserve(self, suspects: Iterable[str], *, held_elsewhere: Mapping[str, float],
                nodes_in_job: int, now: float) -> Admission:
        """Judge ``suspects`` with the Lease's count and ``held_elsewhere`` (this process's own,
        the cluster's markers); record the admitted ones in the Lease. ``KubeError`` when the
        Lease cannot be read or written (then nothing may be cordoned)."""
        suspects = tuple(suspects)
        for _ in range(ATTEMPTS):
            lease, held = self.read(now)
            adm = admit(suspects, {**held_elsewhere, **held}, now=now,
                        nodes_in_job=nodes_in_job, limits=self.limits)
            if adm.tripped or not adm.cordon:
                return adm
            try:
                self._write(lease, {**held, **{n: now for n in adm.cordon}}, now)
                return adm
            except Conflict:
                log.info("the breaker's Lease %s/%s changed while we wrote it; reading it again",
                         self.namespace, self.name)
        raise KubeError(f"lease {self.namespace}/{self.name}: still changed by other writers after "
                        f"{ATTEMPTS} read-judge-write rounds (409 each time)")

    def give_back(self, node: str, since: float) -> None:
        """Remove ``node``'s reservation made at ``since`` (a cordon that failed); best effort."""
        for _ in range(ATTEMPTS):
            try:
                lease, held = self.read(time.time())
                if lease is None or held.get(node) != since:
                    return
                del held[node]
                self._write(lease, held, time.time())
                return
            except Conflict:
                continue
            except KubeError as e:
                log.error("sdc-guard: the reservation of node %s stays in lease %s/%s (it counts "
                          "until the window passes): %s", node, self.namespace, self.name, e)
                return

    def _write(self, lease: dict[str, Any] | None, nodes: dict[str, float], now: float) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
        record = json.dumps({"job": self.job, "nodes": nodes}, sort_keys=True,
                            separators=(",", ":"))
        if lease is None:
            body: dict[str, Any] = {
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/name": "sdc-guard",
                                        "app.kubernetes.io/component": "quarantine"},
                             "annotations": {BREAKER_ANNOTATION: record}},
                "spec": {"holderIdentity": self.identity, "acquireTime": stamp,
                         "renewTime": stamp}}
            self.api.create_lease(self.namespace, body, dry_run=self.dry_run)
            return
        body = {k: v for k, v in lease.items() if k != "status"}
        meta = dict(body.get("metadata") or {})
        meta["annotations"] = {**(meta.get("annotations") or {}), BREAKER_ANNOTATION: record}
        meta.pop("managedFields", None)
        body["metadata"] = meta
        spec = {k: _micro(v) if k in ("acquireTime", "renewTime") else v
                for k, v in (body.get("spec") or {}).items() if v is not None}
        body["spec"] = {**spec, "holderIdentity": self.identity, "renewTime": stamp}
        self.api.replace_lease(self.namespace, self.name, body, dry_run=self.dry_run)


def _micro(value: Any) -> Any:
    """A MicroTime as the API wants it back (six fraction digits; the client's reading of a
    value with no microseconds has none)."""
    import datetime

    try:
        when = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return value
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
