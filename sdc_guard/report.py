"""What a checked step reports: detections and the step's outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

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
    rank it also holds ``"telemetry"``: that rank's own GPU snapshot (``docs/quarantine.md``)."""
    suspect_nodes: tuple[str, ...] = ()
    """The nodes of ``suspect_ranks`` (the Kubernetes node name, or the hostname without one:
    ``GuardConfig.node_name_env``), filled in by the guard."""
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


class StepReport:
    """The result of ``SDCGuard.step``: ``StepReport(step, loss, skipped, detections)``.

    ``loss`` (the step's mean loss, a float) is read from the device when first asked for,
    not in the step: on a GPU that read waits for the step's queued work to finish, which
    a loop that never looks at the loss need not do.
    """

    __slots__ = ("_loss", "detections", "skipped", "step")

    def __init__(self, step: int, loss: float | torch.Tensor, skipped: bool = False,
                 detections: list[Detection] | None = None) -> None:
        self.step = step
        self._loss = loss if isinstance(loss, torch.Tensor) else float(loss)
        self.skipped = skipped
        """True when the optimizer step was withheld on every rank (containment)."""
        self.detections: list[Detection] = [] if detections is None else detections

    @property
    def loss(self) -> float:
        if not isinstance(self._loss, float):
            self._loss = float(self._loss.item())
        return self._loss

    def __repr__(self) -> str:
        return (f"StepReport(step={self.step}, loss={self.loss}, skipped={self.skipped}, "
                f"detections={self.detections})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepReport):
            return NotImplemented
        return ((self.step, self.loss, self.skipped, self.detections)
                == (other.step, other.loss, other.skipped, other.detections))

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was
