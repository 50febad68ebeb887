"""The guard's checks: one class each, one protocol (``base.Check``), built from the config.

``build_checks`` is the only place that knows which checks exist; ``SDCGuard``
loops over what it returns.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.checks.base import Check, Verdict
from sdc_guard.checks.checksum import ChecksumCheck
from sdc_guard.checks.nonfinite import NeighbourRecompute, NonFiniteCheck, ShardedRecompute
from sdc_guard.checks.replay import ReplayAudit
from sdc_guard.checks.replay_tolerant import TolerantReplayAudit
from sdc_guard.checks.weightpass import WeightPass
from sdc_guard.checks.weights import WeightsCheck
from sdc_guard.config import ChecksumConfig, GuardConfig
from sdc_guard.optimizers import Optimizers
from sdc_guard.parallel.base import Backend
from sdc_guard.state import state_tensors
from sdc_guard.types import BatchFor, LossFn

__all__ = [
    "Check",
    "ChecksumCheck",
    "ChecksumConfig",
    "NonFiniteCheck",
    "ReplayAudit",
    "TolerantReplayAudit",
    "Verdict",
    "WeightPass",
    "WeightsCheck",
    "build_checks",
    "state_tensors",
]


def build_checks(
    config: GuardConfig,
    *,
    model: torch.nn.Module,
    optimizer: Optimizers,
    backend: Backend,
    loss_fn: LossFn,
    batch_for: BatchFor | None,
    grad_scaler: Any,
) -> list[Check]:
    """The enabled checks, in the order their verdicts run: non-finite, replay, weights,
    checksum (its hooks switch on in its ``begin_step``, after the replay's recomputation).

    Checks that need the gradients subscribe to ``backend`` as they are built. The weights
    check and the checksum check share one read of the weights (``WeightPass``).
    """
    device = next(model.parameters()).device
    group = backend.group
    weight_pass = WeightPass()
    strikes: dict[int, list[int]] = {}  # repairs and transient faults per rank: one window
    checks: list[Check] = []
    if config.nonfinite:
        streams = config.seed if config.deterministic or config.replay_interval else None
        recompute: NeighbourRecompute | ShardedRecompute | None = None
        if batch_for is not None and backend.layout.sharded:  # collective, through FSDP2
            recompute = ShardedRecompute(cast(Any, backend), loss_fn=loss_fn,
                                         batch_for=batch_for,
                                         micro_batches=config.micro_batches, seed=streams)
        elif batch_for is not None:
            recompute = NeighbourRecompute(
                cast(DistributedDataParallel, model).module, loss_fn=loss_fn,
                batch_for=batch_for, micro_batches=config.micro_batches, seed=streams,
                device=device, group=group)
        checks.append(NonFiniteCheck(
            backend, device=device, group=group, expect_overflow=grad_scaler is not None,
            exchange_interval=config.nonfinite_exchange_interval, recompute=recompute))
    if config.replay_interval:
        if batch_for is None:
            raise ValueError("GuardConfig.replay_interval needs batch_for.")
        scale = grad_scaler.scale if grad_scaler is not None else None
        if backend.layout.sharded and config.replay_mode == "tolerant":
            from sdc_guard.checks.replay_fsdp import FSDPTolerantReplayAudit

            checks.append(FSDPTolerantReplayAudit(
                model, interval=config.replay_interval, loss_fn=loss_fn, batch_for=batch_for,
                backend=cast(Any, backend), seed=config.seed,
                micro_batch_count=config.micro_batches, group=group, scale=scale,
                contain=config.skip_step_on_detection, strikes=strikes,
                repair_window_steps=config.repair_window_steps, trigger=config.replay_trigger))
        elif backend.layout.sharded:  # the FSDP2 root, recomputed through the FSDP backend
            from sdc_guard.checks.replay_fsdp import FSDPReplayAudit

            checks.append(FSDPReplayAudit(
                model, interval=config.replay_interval, loss_fn=loss_fn, batch_for=batch_for,
                backend=cast(Any, backend), seed=config.seed,
                micro_batch_count=config.micro_batches, group=group, scale=scale,
                contain=config.skip_step_on_detection))
        elif config.replay_mode == "tolerant":
            checks.append(TolerantReplayAudit(
                cast(DistributedDataParallel, model), interval=config.replay_interval,
                loss_fn=loss_fn, batch_for=batch_for, backend=backend, seed=config.seed,
                micro_batch_count=config.micro_batches, group=group, scale=scale,
                contain=config.skip_step_on_detection, strikes=strikes,
                repair_window_steps=config.repair_window_steps, trigger=config.replay_trigger))
        else:
            checks.append(ReplayAudit(
                cast(DistributedDataParallel, model), interval=config.replay_interval,
                loss_fn=loss_fn, batch_for=batch_for, backend=backend, seed=config.seed,
                micro_batch_count=config.micro_batches, group=group, scale=scale,
                contain=config.skip_step_on_detection))
    if config.weights_interval:
        checks.append(WeightsCheck(
            model, optimizer, interval=config.weights_interval,
            include_optimizer_state=config.include_optimizer_state, device=device, group=group,
            repair=config.repair_by_majority, repair_window_steps=config.repair_window_steps,
            weight_pass=weight_pass, layout=backend.layout, backend=backend,
            repairs=strikes))
    checksum = config.checksum_config
    if checksum is not None:
        checks.append(ChecksumCheck(
            model, checksum, backend=backend, device=device, group=group,
            expect_overflow=grad_scaler is not None, contain=config.skip_step_on_detection,
            weight_pass=weight_pass))
    return checks
