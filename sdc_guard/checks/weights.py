"""Check "weights": replicas must hold bit-identical weights (and optimizer state).

After ``optimizer.step()`` each rank fingerprints its parameters (in
``named_parameters`` order) and, optionally, its optimizer state tensors
(param groups in order, parameters in order, state keys sorted). One small
all-reduce (the maximum and minimum of the 64-bit words) settles the common case,
every rank equal; otherwise one ``all_gather`` of the word per rank and a
majority vote: ranks outside a strict majority are suspects; no strict majority
(or world size 2) is a detection without a suspect.

Repair by majority (``GuardConfig.repair_by_majority``, on by default): when the suspects
are a strict minority, the lowest-numbered rank of the majority broadcasts its parameters and
optimizer state to every rank, and a second vote verifies that every rank now agrees. The
detection is reported with ``repaired=True``; the guard does not quarantine for it and no
suspect window opens (the state is the majority's again). A rank repaired a second time
within ``repair_window_steps`` is treated as a permanent fault: its detection is reported
unrepaired (quarantine, rollback), though the state is still made whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.checks.base import Check
from sdc_guard.collectives import gather_if_different, majority_outliers
from sdc_guard.fingerprints.public import WeightSums, fingerprint_tensor, fingerprint_with_sums
from sdc_guard.fingerprints.words import to_unsigned64
from sdc_guard.optimizers import Optimizers, each, param_groups
from sdc_guard.report import Detection


def ddp_ignored(model: torch.nn.Module) -> set[int]:
    """``id`` of each parameter that DDP leaves to each rank (named in the module's
    ``_ddp_params_and_buffers_to_ignore``): never broadcast nor all-reduced, so its replicas
    may differ by design. ``model``: the DDP model or the module inside it."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    names = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    if not names:
        return set()
    return {id(p) for n, p in module.named_parameters() if n in names}


def state_tensors(
    model: torch.nn.Module, optimizer: Optimizers | None, *, every: bool = False
) -> list[torch.Tensor]:
    """The replicated state in canonical order: parameters, then optimizer state tensors
    (of each optimizer in turn, when several are given).

    Parameters that DDP ignores (``ddp_ignored``), and their optimizer state, are not
    replicated and are left out, unless ``every`` (a checkpoint's own fingerprint). So is
    the state of an optimizer that shards it over the ranks (``ZeroRedundancyOptimizer``,
    known by its ``consolidate_state_dict``): each rank holds another part."""
    skip = set() if every else ddp_ignored(model)
    tensors = [p.detach() for _, p in model.named_parameters() if id(p) not in skip]
    for opt in () if optimizer is None else each(optimizer):
        if callable(getattr(opt, "consolidate_state_dict", None)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in skip:
                    continue
                st = opt.state.get(p) or {}
                for key in sorted(st, key=str):
                    v = st[key]
                    if isinstance(v, torch.Tensor):
                        tensors.append(v.detach())
    return tensors


def hyperparameters(optimizer: Optimizers) -> list[dict[str, Any]]:
    """Each param group's settings (learning rate, betas, weight decay, ...) as plain values:
    numbers, strings, tuples of them, one-element tensors as numbers; the rest left out.
    Several optimizers: their groups in turn."""

    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else None
        if isinstance(v, (bool, int, float, str)) or v is None:
            return v
        if isinstance(v, (tuple, list)):
            items = [plain(x) for x in v]
            return tuple(items) if all(x is not None for x in items) else None
        return None

    return [{k: pv for k, v in group.items() if k != "params" and (pv := plain(v)) is not None}
            for group in param_groups(optimizer)]


def settings_differ(everyone: list[list[dict[str, Any]]]) -> list[str]:
    """Where the ranks' ``hyperparameters`` differ: "group g key: rank r value, ..." each."""
    out = []
    groups = max(len(e) for e in everyone)
    for g in range(groups):
        keys = sorted({k for e in everyone if g < len(e) for k in e[g]})
        for k in keys:
            values = [e[g].get(k, "(none)") if g < len(e) else "(no group)" for e in everyone]
            if any(v != values[0] for v in values):
                out.append(f"param group {g} {k!r}: " + ", ".join(
                    f"rank {r} {v!r}" for r, v in enumerate(values)))
    return out


class WeightsCheck(Check):
    """Replicas' weights (and optimizer state) compared after the step, every ``interval``."""

    name = "weights"

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optimizers,
        *,
        interval: int,
        include_optimizer_state: bool,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        repair: bool = False,
        repair_window_steps: int = 1000,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.interval = interval
        self.include_optimizer_state = include_optimizer_state
        self.device = device
        self.group = group
        self.repair = repair
        self.repair_window_steps = repair_window_steps
        self.repairs: dict[int, list[int]] = {}
        """Steps at which each rank was repaired."""
        self.weight_sums: Callable[[int], Sequence[WeightSums]] | None = None
        """Asked after each step's optimizer step for the weight sums another check wants
        taken in this check's read of the weights (the checksum check's ``weight_sums``,
        wired by ``build_checks``): the fingerprint is the same with or without them."""
        self._asks: Sequence[WeightSums] = ()

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def local_fingerprint(self, step: int | None = None) -> torch.Tensor:
        """This rank's fingerprint; after ``step``'s optimizer step, with the weight sums
        asked for (``weight_sums``) taken in the same read."""
        opt = self.optimizer if self.include_optimizer_state else None
        tensors = state_tensors(self.model, opt)
        if step is None or self.weight_sums is None:
            return fingerprint_tensor(tensors)
        self._asks = self.weight_sums(step)
        return fingerprint_with_sums(tensors, self._asks)

    def post_step(self, step: int) -> list[Detection]:
        """Fingerprint this rank's state; one small all-reduce; a vote only on a mismatch."""
        fp = self.local_fingerprint(step).to(self.device).reshape(1)
        gathered = gather_if_different(fp, self.group)
        if gathered is None:
            self.verified(step)
            return []
        values = [to_unsigned64(v) for v in gathered]
        outliers = majority_outliers(values)
        if outliers == ():
            self.verified(step)
            return []
        self._refuse_settings_drift(step)
        evidence: dict[str, Any] = {"fingerprints": [f"{v:016x}" for v in values]}
        if outliers is None:
            self.tainted()
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
        detail = f"rank(s) {list(outliers)} hold weights that differ from the majority"
        repaired = False
        if self.repair and 2 * len(outliers) < len(values):
            repeat = [r for r in outliers if any(step - s < self.repair_window_steps
                                                 for s in self.repairs.get(r, []))]
            ok = self._repair(outliers)
            for r in outliers:
                self.repairs.setdefault(r, []).append(step)
            evidence["repair"] = {"source": min(set(range(len(values))) - set(outliers)),
                                  "verified": ok, "repeat_ranks": repeat}
            if repeat:  # the earlier repair was this permanent fault too: the window opens there
                evidence["repair"]["since"] = min(
                    s for r in repeat for s in self.repairs[r] if step - s < self.repair_window_steps)
            repaired = ok and not repeat
            detail += (f"; repaired in place from rank {evidence['repair']['source']}"
                       + (" and verified" if ok else ", but the ranks still differ"))
            if repeat:
                detail += (f"; rank(s) {repeat} repaired before within "
                           f"{self.repair_window_steps} steps: a permanent fault")
        if repaired:
            self.verified(step)
        else:
            self.tainted()
        return [Detection("weights", step, outliers, detail=detail, evidence=evidence,
                          repaired=repaired)]

    def _refuse_settings_drift(self, step: int) -> None:
        """Before a rank is blamed for weights that differ: do the ranks' optimizers run with
        the same settings? A learning-rate scheduler stepped on some ranks only (or a learning
        rate set under ``if rank == 0``) makes a replica's update differ at every step without
        any fault: the odd rank would be convicted (repaired, then a permanent fault). One
        gather of every rank's settings, on a mismatch only; the error is raised on every
        rank alike (they all hold the same gathered settings)."""
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, hyperparameters(self.optimizer), group=self.group)
        differ = settings_differ(everyone)
        if differ:
            raise ValueError(
                f"weights check, step {step}: the replicas' weights differ, and so do their "
                f"optimizers' settings: {'; '.join(differ[:6])}. Every rank must run the "
                "optimizer with the same settings: step the learning-rate scheduler (and set any "
                "learning rate) on every rank alike, not under `if rank == 0`. Not a fault of "
                "the hardware: no rank is blamed.")

    def _repair(self, outliers: tuple[int, ...]) -> bool:
        """Broadcast the majority's parameters and optimizer state; vote again. Collective."""
        world = dist.get_world_size(self.group)
        source = min(set(range(world)) - set(outliers))
        src = dist.get_global_rank(self.group, source) if self.group is not None else source
        with torch.no_grad():
            for t in state_tensors(self.model, self.optimizer):
                dist.broadcast(t, src=src, group=self.group)
        for ask in self._asks:  # taken from the weights as they were
            ask.taken = False
        return gather_if_different(self.local_fingerprint().to(self.device).reshape(1),
                                   self.group) is None
