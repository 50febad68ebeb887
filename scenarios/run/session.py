"""One scenario's DDP model, optimizer and guard on one rank, reused by every trial.

A ``Session`` is one DDP model, optimizer and ``SDCGuard``. DDP accepts one comm
hook and the guard registers it in its constructor, so a session is built once
and reused: each trial restores the step-0 snapshot (``state_dict`` copies taken
right after construction) into the same parameters (``load_state_dict`` copies
in place) and a fresh optimizer state, gets its guard configuration
(``SDCGuard.reconfigure``: the checks built anew), arms its faults, trains, and
disarms them. So a scenario's golden run and all its trials share one session
(``RankRunner.run_session``); the overhead rounds keep one per configuration.

Two warm-up iterations (forward and backward, no optimizer step) run before the
snapshot is restored the first time: DDP rebuilds its gradient buckets at the
second iteration, and the bucket layout decides the summation order of the
all-reduce, so without them the golden run's first step would not be
bit-identical to a later trial's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.spec.models import DTYPES, build_model, scenario_loss, synthetic_batch
from scenarios.spec.scenario import Scenario
from scenarios.spec.seeds import seed_of
from sdc_guard import BatchFor, GuardConfig, LossFn, SDCGuard, fingerprint, state_tensors
from sdc_guard.optimizers import Optimizers, load_state_dict, state_dict

_CONCAT_BYTES = 1 << 18


def _optimizer(scenario: Scenario, params: Any) -> list[torch.optim.Optimizer]:
    """The scenario's optimizers: one, or for ``"muon"`` Muon for the 2-D parameters and
    AdamW for the rest (``sdc_guard.optimizers``)."""
    o = scenario.optimizer
    if o.kind == "sgd":
        return [torch.optim.SGD(params, lr=o.lr, momentum=o.momentum,
                                weight_decay=o.weight_decay)]
    if o.kind == "muon":
        params = list(params)
        mats = [p for p in params if p.dim() == 2]
        rest = [p for p in params if p.dim() != 2]
        return [torch.optim.Muon(mats, lr=o.lr, momentum=o.momentum,
                                 weight_decay=o.weight_decay),
                torch.optim.AdamW(rest, lr=o.lr, weight_decay=o.weight_decay)]
    return [torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay)]


def batch_for(scenario: Scenario, device: torch.device, rank: int, step: int) -> Any:
    """``batch_for(rank, step)`` of a scenario: one batch, or a list of micro-batches."""
    dtype = DTYPES[scenario.dtype]

    def one(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = synthetic_batch(scenario.model.kind, scenario.seed, rank, step, micro,
                               batch=scenario.batch, dtype=dtype)
        return x.to(device), y.to(device)

    if scenario.micro_batches == 1:
        return one(0)
    return [one(i) for i in range(scenario.micro_batches)]


def loss_for(micro_batches: int, model: nn.Module, batch: Any) -> torch.Tensor:
    """The scenario's ``loss_fn``: the loss of one micro-batch, scaled to a mean."""
    loss = scenario_loss(model, batch)
    return loss if micro_batches == 1 else loss / micro_batches


class Session:
    """A DDP model, its optimizer and (unless ``config`` is None) an SDCGuard, reused by trials."""

    def __init__(self, scenario: Scenario, config: GuardConfig | None, rank: int, world: int,
                 device: torch.device) -> None:
        self.scenario = scenario
        self.rank = rank
        self.device = device
        module = build_model(scenario.model.kind, width=scenario.model.width,
                             depth=scenario.model.depth, seed=scenario.seed)
        module = module.to(device=device, dtype=DTYPES[scenario.dtype])
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = DDP(module, device_ids=ids)
        self.module = module
        optimizers = _optimizer(scenario, module.parameters())
        self.optimizers = optimizers
        self.optimizer: Optimizers = optimizers[0] if len(optimizers) == 1 else optimizers
        self.batch_for: BatchFor = functools.partial(batch_for, scenario, device)
        self.loss_fn: LossFn = functools.partial(loss_for, scenario.micro_batches)
        self.guard = None if config is None else SDCGuard(
            self.ddp, self.optimizer, loss_fn=self.loss_fn, batch_for=self.batch_for,
            config=config)
        self._model0 = copy.deepcopy(module.state_dict())
        self._opt0 = copy.deepcopy(state_dict(self.optimizer))
        for step in range(2):  # DDP rebuilds its buckets at the second iteration
            self.ddp.zero_grad(set_to_none=True)
            batch = self.batch_for(rank, step)
            first = batch[0] if scenario.micro_batches > 1 else batch
            self.loss_fn(self.ddp, first).backward()  # type: ignore[no-untyped-call]
        self.reset()

    def reset(self) -> None:
        """Back to step 0: the snapshot's weights and buffers, an empty optimizer state."""
        self.module.load_state_dict(self._model0)
        load_state_dict(self.optimizer, copy.deepcopy(self._opt0), "Session.reset")
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        # The CPU generator directly: torch.manual_seed also queues a lazy CUDA seeding
        # that formats a stack trace on CPU-only builds (about 1 ms a call).
        seed = seed_of(self.scenario.seed, "torch", self.rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def plain_step(self, step: int) -> float:
        """A training step without the guard (the overhead baseline)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        batch = self.batch_for(self.rank, step)
        batches = batch if self.scenario.micro_batches > 1 else [batch]
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.ddp.no_sync():
                loss = self.loss_fn(self.ddp, mb)
                loss.backward()  # type: ignore[no-untyped-call]
        for opt in self.optimizers:
            opt.step()
        return float(loss.detach())

    def state_fingerprint(self) -> int:
        """Parameters + optimizer state (what the weight check compares), in its order.

        Small states (the campaign models) are fingerprinted as one concatenation of
        their bytes, a single pass instead of one per tensor (the set and order of
        tensors is fixed within a scenario, so any change of any bit still changes the
        value); large ones tensor by tensor, to avoid the copy.
        """
        tensors = [t.detach() for t in state_tensors(self.module, self.optimizer)]
        if sum(t.numel() * t.element_size() for t in tensors) > _CONCAT_BYTES:
            return fingerprint(tensors)
        return fingerprint(torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]))

    def weights_fingerprint(self) -> int:
        """The parameters alone (``sdc_guard.fingerprint``)."""
        return fingerprint([p.detach() for p in self.module.parameters()])

    def close(self) -> None:
        self.guard = None
        del self.ddp, self.optimizer, self.optimizers
