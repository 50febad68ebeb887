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
    transient: bool = False
    """The tolerant replay audit's diagnosis: recomputed on the same rank, the suspects'
    result came out right, so the fault did not last (``docs/checks/replay.md``). Not
    quarantined; a second one on a rank within ``GuardConfig.repair_window_steps`` (or one
    after a repair there) is reported as lasting."""
    contained: bool = False
    """The fault never reached the weights: the optimizer step of ``step`` was withheld on
    every rank, and every enabled check had verified the run clean through ``step - 1``.
    A contained detection opens no suspect window (nothing to roll back); its suspects are
    quarantined all the same (docs/recovery.md)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "detection",
            "check": self.check,
            "step": self.step,
            "suspect_ranks": list(self.suspect_ranks),
            "suspect_nodes": list(self.suspect_nodes),
            "repaired": self.repaired,
            "contained": self.contained,
            "transient": self.transient,
            "detail": self.detail,
            "evidence": self.evidence,
        }


class StepReport:
    """The result of ``SDCGuard.step``: ``StepReport(step, loss, skipped, detections,
    withheld_by)``.

    ``loss`` (the step's mean loss, a Python float) is read from the device when first asked
    for, not in the step: on a GPU that read waits for the step's queued work to finish,
    which a loop that never looks at the loss need not do.

    A check may withhold a step before its detection record is ready: the non-finite and the
    checksum checks exchange their words every few steps, so the detection of a withheld
    step arrives in a later step's ``detections`` (with ``Detection.step`` set to this one
    and ``Detection.contained`` saying that it never reached the weights), while this
    step's ``skipped`` and ``withheld_by`` say at once that it was withheld and by which
    checks.
    """

    __slots__ = ("_loss", "detections", "skipped", "step", "withheld_by")

    def __init__(self, step: int, loss: float | torch.Tensor, skipped: bool = False,
                 detections: list[Detection] | None = None,
                 withheld_by: tuple[str, ...] = ()) -> None:
        self.step = step
        self._loss = loss if isinstance(loss, torch.Tensor) else float(loss)
        self.skipped = skipped
        """True when this rank withheld the optimizer step (containment)."""
        self.detections: list[Detection] = [] if detections is None else detections
        """Detections reached in this step; each carries the step it is about."""
        self.withheld_by = withheld_by
        """The checks whose verdict withheld this step ("nonfinite", "checksum", "replay"),
        in the order they ran; empty when the step was applied."""

    @property
    def loss(self) -> float:
        if not isinstance(self._loss, float):
            self._loss = float(self._loss.item())
        return self._loss

    def __repr__(self) -> str:
        return (f"StepReport(step={self.step}, loss={self.loss}, skipped={self.skipped}, "
                f"detections={self.detections}, withheld_by={self.withheld_by})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepReport):
            return NotImplemented
        return ((self.step, self.loss, self.skipped, self.detections, self.withheld_by)
                == (other.step, other.loss, other.skipped, other.detections, other.withheld_by))

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was
