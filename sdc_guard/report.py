"""What a checked step reports: detections and the step's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CHECKS = ("nonfinite", "replay", "weights", "checksum")


@dataclass(frozen=True, slots=True)
class Detection:
    """One check firing at one step."""

    check: str
    """Which check fired: "nonfinite", "replay", "weights" or "checksum"."""
    step: int
    """The training step at which it fired."""
    suspect_ranks: tuple[int, ...]
    """The ranks the evidence blames, in the guard's process group (the global ranks unless
    ``SDCGuard(process_group=...)``); empty when it cannot attribute (e.g. world size 2)."""
    detail: str = ""
    """A sentence for humans: what differed and why these suspects."""
    evidence: dict[str, Any] = field(default_factory=dict, compare=False)
    """Machine-readable evidence (fingerprints per rank, flags per rank, ...). On a suspect
    rank it also holds ``"telemetry"``: that rank's own GPU snapshot (``sdc_guard.telemetry``)."""
    suspect_nodes: tuple[str, ...] = ()
    """The nodes of ``suspect_ranks`` (``sdc_guard.topology``: the Kubernetes node name, or the
    hostname without one), filled in by the guard."""
    repaired: bool = False
    """The weights check repaired the suspects' state in place from the majority and verified
    it (``GuardConfig.repair_by_majority``): no quarantine, no suspect window."""

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "detection",
            "check": self.check,
            "step": self.step,
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_nodes": list(self.suspect_nodes),
            "repaired": self.repaired,
            "detail": self.detail,
            "evidence": self.evidence,
        }


@dataclass(slots=True)
class StepReport:
    """The result of ``SDCGuard.step``."""

    step: int
    loss: float
    skipped: bool = False
    """True when the optimizer step was withheld on every rank (containment)."""
    detections: list[Detection] = field(default_factory=list)
