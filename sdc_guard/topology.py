"""Where each rank runs: hostname, pod and Kubernetes node, gathered once when the guard starts.

A detection names ranks; a quarantine acts on nodes. The guard gathers every rank's place
once (one gather of pickled bytes at construction, never on the detection path) and maps
suspect ranks to ``Detection.suspect_nodes`` with it.

The node name comes from the downward API (``NODE_NAME`` from ``spec.nodeName``) and the pod
name from ``POD_NAME`` (``metadata.name``), as ``deploy/pytorchjob.yaml`` sets them; the
variable names are configurable. Without a node name (a bare-metal ``torchrun``), the
hostname stands in for the node.

The same gather carries each rank's compute signature (``sdc_guard.determinism``): what
decides the bits of its kernels, which the replay audit needs alike on every rank.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sdc_guard.collectives import gather_objects
from sdc_guard.determinism import compute_signature, signature_mismatch
from sdc_guard.fingerprints.words import FINGERPRINT_VERSION


@dataclass(frozen=True, slots=True)
class RankPlace:
    """One rank's place in the cluster."""

    rank: int
    hostname: str
    node: str
    """The Kubernetes node name, or the hostname when the node-name variable is unset."""
    pod: str | None = None
    """The pod name, when the pod-name variable is set."""
    namespace: str | None = None
    """The pod's namespace (``POD_NAMESPACE``), when set."""

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "hostname": self.hostname, "node": self.node, "pod": self.pod,
                "namespace": self.namespace}


def local_place(rank: int, *, node_env: str = "NODE_NAME", pod_env: str = "POD_NAME",
                namespace_env: str = "POD_NAMESPACE",
                environ: Mapping[str, str] | None = None) -> RankPlace:
    """This process's place, from the environment (downward API) and the hostname."""
    env = os.environ if environ is None else environ
    hostname = socket.gethostname()
    return RankPlace(rank=rank, hostname=hostname, node=env.get(node_env) or hostname,
                     pod=env.get(pod_env) or None, namespace=env.get(namespace_env) or None)


@dataclass(frozen=True, slots=True)
class Topology:
    """Every rank's place, indexed by rank in the guard's process group."""

    places: tuple[RankPlace, ...]
    compute: tuple[dict[str, str], ...] = ()
    """Every rank's ``compute_signature`` when the guard was built (empty: not gathered)."""
    fingerprint_versions: tuple[int, ...] = ()
    """Every rank's fingerprint version (``sdc_guard.fingerprints.words.FINGERPRINT_VERSION``
    of the release it runs; 1 for a rank that did not say: a release before version 2)."""

    def fingerprint_mismatch(self) -> str | None:
        """Where the ranks' fingerprint versions differ, in words; None if they agree."""
        by: dict[int, list[int]] = {}
        for r, v in enumerate(self.fingerprint_versions):
            by.setdefault(v, []).append(r)
        if len(by) < 2:
            return None
        return "; ".join(f"version {v} on ranks {', '.join(map(str, r))}" for v, r in by.items())

    def compute_mismatch(self) -> str | None:
        """Where the ranks' compute signatures differ, in words; None if they agree."""
        return signature_mismatch(self.compute)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes of the job, in rank order of first appearance."""
        return tuple(dict.fromkeys(p.node for p in self.places))

    def nodes_of(self, ranks: Iterable[int]) -> tuple[str, ...]:
        """The distinct nodes that hold ``ranks``, in the order of the ranks given."""
        return tuple(dict.fromkeys(self.places[r].node for r in ranks))

    def ranks_on(self, node: str) -> tuple[int, ...]:
        return tuple(p.rank for p in self.places if p.node == node)

    def to_json(self) -> list[dict[str, object]]:
        return [p.to_json() for p in self.places]


def gather_topology(group: dist.ProcessGroup | None = None, *, node_env: str = "NODE_NAME",
                    pod_env: str = "POD_NAME", namespace_env: str = "POD_NAMESPACE",
                    device: torch.device | None = None) -> Topology:
    """Every rank's place and, given the model's ``device``, its compute signature.
    Collective (``collectives.gather_objects``): call on every rank."""
    rank = dist.get_rank(group)
    mine = local_place(rank, node_env=node_env, pod_env=pod_env, namespace_env=namespace_env)
    sent = {**mine.to_json(),
            "compute": None if device is None else compute_signature(device),
            "fingerprint_version": FINGERPRINT_VERSION}
    out = gather_objects(sent, group, device=device)
    places = []
    compute = []
    versions = []
    for r, rec in enumerate(out):
        if not isinstance(rec, dict):  # pragma: no cover - every rank sends its place
            raise RuntimeError(f"gather_topology: rank {r} sent {rec!r}, not its place")
        if rec["compute"] is not None:
            compute.append({str(k): str(v) for k, v in rec["compute"].items()})
        versions.append(int(rec.get("fingerprint_version", 1)))
        places.append(RankPlace(rank=r, hostname=str(rec["hostname"]), node=str(rec["node"]),
                                pod=rec["pod"] if rec["pod"] is None else str(rec["pod"]),
                                namespace=(None if rec["namespace"] is None
                                           else str(rec["namespace"]))))
    return Topology(tuple(places), tuple(compute), tuple(versions))
