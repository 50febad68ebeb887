"""Check "weights": replicas must hold bit-identical weights (and optimizer state).

After ``optimizer.step()`` each rank fingerprints its parameters (in
``named_parameters`` order) and, optionally, its optimizer state tensors
(param groups in order, parameters in order, state keys sorted). One small
all-reduce (the maximum and minimum of the 64-bit words) settles the common case,
every rank equal; otherwise one ``all_gather`` of the word per rank and a
majority vote: ranks outside a strict majority are suspects; no strict majority
(or world size 2) is a detection without a suspect.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sdc_guard.checks.base import Check
from sdc_guard.collectives import gather_if_different, majority_outliers
from sdc_guard.fingerprints.public import fingerprint_tensor
from sdc_guard.fingerprints.words import to_unsigned64
from sdc_guard.report import Detection


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> list[torch.Tensor]:
    """The replicated state in canonical order: parameters, then optimizer state tensors."""
    tensors = [p.detach() for _, p in model.named_parameters()]
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                for key in sorted(st, key=str):
                    v = st[key]
                    if isinstance(v, torch.Tensor):
                        tensors.append(v.detach())
    return tensors


class WeightsCheck(Check):
    """Replicas' weights (and optimizer state) compared after the step, every ``interval``."""

    name = "weights"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        interval: int,
        include_optimizer_state: bool,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.interval = interval
        self.include_optimizer_state = include_optimizer_state
        self.device = device
        self.group = group

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def local_fingerprint(self) -> torch.Tensor:
        opt = self.optimizer if self.include_optimizer_state else None
        return fingerprint_tensor(state_tensors(self.model, opt))

    def post_step(self, step: int) -> list[Detection]:
        """Fingerprint this rank's state; one small all-reduce; a vote only on a mismatch."""
        fp = self.local_fingerprint().to(self.device).reshape(1)
        gathered = gather_if_different(fp, self.group)
        if gathered is None:
            return []
        values = [to_unsigned64(v) for v in gathered]
        outliers = majority_outliers(values)
        if outliers == ():
            return []
        evidence = {"fingerprints": [f"{v:016x}" for v in values]}
        if outliers is None:
            return [
                Detection(
                    "weights",
                    step,
                    (),
                    detail="weight fingerprints differ across ranks and no strict majority "
                    "agrees: cannot attribute",
                    evidence=evidence,
                )
            ]
        return [
            Detection(
                "weights",
                step,
                outliers,
                detail=f"rank(s) {list(outliers)} hold weights that differ from the majority",
                evidence=evidence,
            )
        ]
