"""One scenario's model (DDP, FSDP2 or HSDP), optimizer and guard on one rank, reused by every trial.

A ``Session`` is one wrapped model, optimizer and ``SDCGuard``. The model is spread over
the ranks as the scenario's ``parallel`` says (``scenarios.spec.sharding.shard_model``);
the guard is handed the wrapper (DDP) or the ``fully_shard`` root (FSDP2). DDP accepts one
comm hook and the guard registers it in its constructor, so a session is built once
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
bit-identical to a later trial's. FSDP2 has no buckets to rebuild: no warm-up.

Under FSDP2 each rank holds shards, so what a run is compared by is gathered: the state
fingerprint is one value over every rank's shard fingerprint (the same on every rank; a
changed bit in any shard, any replica, changes it), and the final parameters are the full
tensors.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from injectors.noise import LinearNoise
from scenarios.spec.models import DTYPES, build_model, scenario_loss, synthetic_batch
from scenarios.spec.scenario import Scenario
from scenarios.spec.seeds import seed_of
from scenarios.spec.sharding import shard_model
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


def noisy_loss_for(noise: LinearNoise, micro_batches: int, model: nn.Module,
                   batch: Any) -> torch.Tensor:
    """``loss_for`` on the testbed (``Scenario.noise_ulps``): the noise's draws are keyed by
    the batch (its inputs' fingerprint), so that this rank's first computation of a batch
    draws alike in every run and each recomputation draws anew."""
    noise.begin(fingerprint(batch[0]))
    return loss_for(micro_batches, model, batch)


class Session:
    """A wrapped model (DDP or FSDP2), its optimizer and (unless ``config`` is None) an
    SDCGuard, reused by trials."""

    def __init__(self, scenario: Scenario, config: GuardConfig | None, rank: int, world: int,
                 device: torch.device) -> None:
        self.scenario = scenario
        self.rank = rank
        self.device = device
        module = build_model(scenario.model.kind, width=scenario.model.width,
                             depth=scenario.model.depth, seed=scenario.seed)
        module = module.to(device=device, dtype=DTYPES[scenario.dtype])
        self.model: nn.Module
        """What trains and what the guard and the checkpoints are handed: the DDP wrapper,
        or the ``fully_shard`` root (``module`` itself, sharded in place)."""
        if scenario.sharded:
            self.model = shard_model(module, parallel=scenario.parallel,
                                     mesh_shape=scenario.mesh_shape)
        else:
            ids = [device.index] if device.type == "cuda" else None
            self.model = DDP(module, device_ids=ids)
        self.module = module
        optimizers = _optimizer(scenario, module.parameters())
        self.optimizers = optimizers
        self.optimizer: Optimizers = optimizers[0] if len(optimizers) == 1 else optimizers
        self.batch_for: BatchFor = functools.partial(batch_for, scenario, device)
        self.noise = None if not scenario.noise_ulps else LinearNoise(
            module, ulps=scenario.noise_ulps, seed=scenario.seed, rank=rank)
        self.loss_fn: LossFn = (
            functools.partial(loss_for, scenario.micro_batches) if self.noise is None
            else functools.partial(noisy_loss_for, self.noise, scenario.micro_batches))
        self.guard = None if config is None else SDCGuard(
            self.model, self.optimizer, loss_fn=self.loss_fn, batch_for=self.batch_for,
            config=config)
        self._model0 = copy.deepcopy(module.state_dict())
        self._opt0 = copy.deepcopy(state_dict(self.optimizer))
        for step in range(0 if scenario.sharded else 2):  # DDP rebuilds its buckets at the
            self.model.zero_grad(set_to_none=True)           # second iteration
            batch = self.batch_for(rank, step)
            first = batch[0] if scenario.micro_batches > 1 else batch
            self.loss_fn(self.model, first).backward()  # type: ignore[no-untyped-call]
        self.reset()

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2 (each rank holds shards of the state)."""
        return isinstance(self.model, FSDPModule)

    @contextlib.contextmanager
    def _no_sync(self) -> Any:
        """Accumulate this micro-batch's gradients without reducing them (DDP's ``no_sync``;
        FSDP2's ``set_requires_gradient_sync(False)``)."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            with self.model.no_sync():  # type: ignore[operator]
                yield

    def reset(self) -> None:
        """Back to step 0: the snapshot's weights and buffers, an empty optimizer state."""
        self.module.load_state_dict(self._model0)
        load_state_dict(self.optimizer, copy.deepcopy(self._opt0), "Session.reset")
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.forget_noise()
        # The CPU generator directly: torch.manual_seed also queues a lazy CUDA seeding
        # that formats a stack trace on CPU-only builds (about 1 ms a call).
        seed = seed_of(self.scenario.seed, "torch", self.rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)

    def forget_noise(self) -> None:
        """On the testbed: the next computation of every batch is a first again (step 0, or a
        rollback: the steps trained again draw as they did the first time)."""
        if self.noise is not None:
            self.noise.forget()

    def plain_step(self, step: int) -> float:
        """A training step without the guard (the overhead baseline)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        batch = self.batch_for(self.rank, step)
        batches = batch if self.scenario.micro_batches > 1 else [batch]
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self._no_sync():
                loss = self.loss_fn(self.model, mb)
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
            return self._over_ranks(fingerprint(tensors))
        return self._over_ranks(fingerprint(
            torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])))

    def weights_fingerprint(self) -> int:
        """The parameters alone (``sdc_guard.fingerprint``; this rank's shards under FSDP2,
        gathered as ``state_fingerprint``'s)."""
        return self._over_ranks(fingerprint([_local(p.detach()) for p in self.module.parameters()]))

    def _over_ranks(self, fp: int) -> int:
        """``fp`` as it is (DDP: every rank holds the whole state), or under FSDP2 one value
        over every rank's (an all-gather of one word; collective: every rank calls it)."""
        if not self.sharded:
            return fp
        word = torch.tensor([fp - (1 << 64) if fp >= 1 << 63 else fp], dtype=torch.int64,
                            device=self.device)
        words = [torch.empty_like(word) for _ in range(dist.get_world_size())]
        dist.all_gather(words, word)
        return fingerprint(torch.cat(words).cpu())

    def full_parameters(self) -> list[torch.Tensor]:
        """The model's parameters as whole tensors, detached (under FSDP2 gathered from the
        shards: collective, every rank calls it)."""
        return [(p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for p in self.module.parameters()]

    def close(self) -> None:
        self.guard = None
        del self.model, self.optimizer, self.optimizers


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (FSDP2), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t
