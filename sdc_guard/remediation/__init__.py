"""What happens after a detection: the node of a suspect rank is quarantined.

``SDCGuard(..., remediation=r)`` calls ``r.bind(topology=..., rank=..., log_event=...)`` once
and ``r.act(detection)`` for every detection (with ``suspect_nodes`` filled in) on every rank;
``guard.flush()`` calls ``r.drain()``. ``act`` must return at once and never raise.

``KubeQuarantine`` (extra ``kube``: the official ``kubernetes`` client) cordons, taints and
annotates nodes with the evidence, behind a circuit breaker, dry run by default.
``python -m sdc_guard quarantine list|show|release`` is the operator's side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from sdc_guard.exits import EXIT_QUARANTINED
from sdc_guard.remediation.api import KubeError
from sdc_guard.remediation.breaker import BreakerLimits
from sdc_guard.remediation.kube import KubeQuarantine, QuarantineAction
from sdc_guard.report import Detection
from sdc_guard.topology import Topology


@runtime_checkable
class Remediation(Protocol):
    def bind(self, *, topology: Topology, rank: int,
             log_event: Callable[[dict[str, Any]], None] | None = None) -> None: ...

    def act(self, detection: Detection) -> None: ...

    def drain(self, timeout: float | None = None) -> bool: ...


__all__ = ["EXIT_QUARANTINED", "BreakerLimits", "KubeError", "KubeQuarantine", "QuarantineAction",
           "Remediation"]
