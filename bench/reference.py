"""The benchmarks' reference workload: an MLP of about 1.6M parameters, its data and loss, and
guarded and plain DDP instances of it whose configuration is switched block by block."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scenarios.spec.overhead import CHECKS_OFF, OverheadConfig
from scenarios.spec.seeds import data_generator
from sdc_guard import GuardConfig, SDCGuard

D_IN, N_OUT = 512, 10

INSTANCES = 3
"""Model instances of each kind, used in turn round by round (the round counts in
``bench.__main__`` are multiples of it). Two instances of the same model can differ in
speed by 1-2% (where their memory landed), as much as the cheapest check costs: with
every configuration of a kind on one instance and the instances rotated, that difference
neither biases a comparison nor hides from the bootstrap intervals."""


PLAIN_DDP_VIEWS = OverheadConfig(name="plain DDP, gradient_as_bucket_view", config=None)
"""Plain DDP built with bucket views (``gradient_as_bucket_view=True``)."""
CHECKS_OFF_COPIED = OverheadConfig(
    name="guard, checks off, DDP's default construction (gradients copied)",
    config=CHECKS_OFF.config)
"""The guard on DDP's default construction. Every other guarded configuration runs on bucket
views (``guarded_ddp``); with the gradients set to None every step, as the guard does, DDP
copies them into the buckets either way (docs/architecture.md).

Both checks-off configurations run on models of their own that never had a check: the guard
registers its comm hook with DDP the first time a check reads the gradient buckets, and DDP
cannot remove it (``SDCGuard.comm_hook_registered``)."""


def guarded_ddp(module: nn.Module) -> DDP:
    """``module`` wrapped with ``gradient_as_bucket_view=True``."""
    return DDP(module, gradient_as_bucket_view=True)


def reference_mlp(seed: int = 0, d_in: int = D_IN, width: int = 1024,
                  n_out: int = N_OUT) -> nn.Module:
    """The reference model: 512 -> 1024 -> 1024 -> 10, ReLU."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, n_out)
    )


def classification_batch(rank: int, step: int, *, batch: int, d_in: int = D_IN,
                         n_out: int = N_OUT, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch for (rank, step): the same inputs in every process and run."""
    g = data_generator(seed, rank, step, 0)
    x = torch.randn(batch, d_in, generator=g)
    y = torch.randint(0, n_out, (batch,), generator=g)
    return x, y


def cross_entropy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The reference ``loss_fn`` (``sdc_guard.LossFn``)."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def switch(guard: SDCGuard, config: GuardConfig) -> None:
    """Give ``guard`` the checks of ``config`` for the steps that follow (every rank alike).

    The benchmarks alternate configurations on one model; the non-finite words still
    out belong to the old checks and are collected first.
    """
    if guard.config == config:
        return
    if guard.config.nonfinite:
        guard.flush()
    guard.reconfigure(config)


Runner = Callable[[OverheadConfig, int], Callable[[int], object]]
"""``runner(configuration, instance)``: the step function of that instance, set to it."""


def reference_runs(rank: int, batch: int) -> tuple[list[SDCGuard], Runner]:
    """``INSTANCES`` of each model of the reference workload: a guarded model on bucket views
    that every guarded configuration with a check shares, and the two checks-off
    configurations' own (``CHECKS_OFF`` on bucket views, ``CHECKS_OFF_COPIED`` on DDP's
    default construction). Plain DDP loops (``PLAIN_DDP``, ``PLAIN_DDP_VIEWS``) train the
    checks-off guards' models and optimizers themselves: a guard without checks registers no
    comm hook, so its model is plain DDP, and the comparison carries no difference between
    two instances of the model (where their memory landed). Returns the guards and the
    ``Runner``; the guards with checks come first."""
    batch_for = functools.partial(classification_batch, batch=batch)
    guards: dict[str, list[SDCGuard]] = {"checks": [], CHECKS_OFF.name: [],
                                         CHECKS_OFF_COPIED.name: []}
    for _ in range(INSTANCES):
        for kind in guards:
            gmodel = DDP(reference_mlp(), gradient_as_bucket_view=kind != CHECKS_OFF_COPIED.name)
            gopt = torch.optim.AdamW(gmodel.parameters(), lr=1e-3)
            config = CHECKS_OFF.config if kind != "checks" else None
            guards[kind].append(SDCGuard(gmodel, gopt, loss_fn=cross_entropy_loss,
                                         batch_for=batch_for, config=config))

    def plain_loop(guard: SDCGuard) -> Callable[[int], None]:
        assert not guard.comm_hook_registered  # else it would not be plain DDP
        model, (opt,) = guard.model, guard.optimizers

        def plain(step: int) -> None:
            opt.zero_grad(set_to_none=True)
            cross_entropy_loss(model, batch_for(rank, step)).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return plain

    def runner(oc: OverheadConfig, i: int) -> Callable[[int], object]:
        if oc.config is None:
            kind = CHECKS_OFF.name if oc.name == PLAIN_DDP_VIEWS.name else CHECKS_OFF_COPIED.name
            return plain_loop(guards[kind][i])
        guard = guards[oc.name if oc.name in guards else "checks"][i]
        switch(guard, oc.config)
        return guard.step

    return [g for kind in guards.values() for g in kind], runner
