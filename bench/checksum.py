"""The checksum check's step-time cost beside the check off, on several workloads.

Each workload runs ``INSTANCES`` guarded models; the configurations (the guard with its
checks off, and with the checksum check alone) are switched block by block, the order
rotating round by round, and timed in blocks of steps with no barrier between the steps
(as a training loop runs). The ratio is the median over rounds of each round's ratio.
The checks-off configuration runs on the same models, whose comm hook the checksum check has
registered (it reads the gradient buckets; DDP cannot remove a hook): the ratio is the check's
own work. What a comm hook costs a guard that never registered one is in ``bench.overhead``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.reference import (
    INSTANCES,
    classification_batch,
    cross_entropy_loss,
    guarded_ddp,
    reference_mlp,
    switch,
)
from bench.timing import bootstrap_interval
from scenarios.run.launch import run_ranks
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.overhead import CHECKS_OFF, CHECKSUM, CHECKSUM_NORM
from sdc_guard import SDCGuard

WORKLOADS = {
    "reference MLP (512-1024-1024-10), batch 128": ("mlp", 128),
    "reference MLP (512-1024-1024-10), batch 1024": ("mlp", 1024),
    "transformer (width 128, 2 blocks, 12 tokens), batch 64": ("transformer", 64),
}
"""name -> (kind, batch): the reference MLP of the other tables, and the scenarios' transformer
made wider (9 linear layers: attention's qkv and projection, two MLP layers per block, head)."""


def _guards(kind: str, batch: int) -> list[SDCGuard]:
    guards = []
    for _ in range(INSTANCES):
        if kind == "mlp":
            model = guarded_ddp(reference_mlp())

            def batch_for(rank: int, step: int) -> Any:
                return classification_batch(rank, step, batch=batch)

            loss = cross_entropy_loss
        else:
            model = guarded_ddp(build_model("transformer", width=128, depth=2, seed=0))

            def batch_for(rank: int, step: int) -> Any:
                return synthetic_batch("transformer", 0, rank, step, 0, batch=batch)

            loss = scenario_loss
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guards.append(SDCGuard(model, opt, loss_fn=loss, batch_for=batch_for,
                               config=CHECKS_OFF.config))
    return guards


def _rank(rank: int, world: int, kind: str, batch: int, rounds: int,
          block: int) -> dict[str, Any]:
    guards = _guards(kind, batch)
    configs = (CHECKS_OFF, CHECKSUM, CHECKSUM_NORM)
    times: dict[str, list[float]] = {oc.name: [] for oc in configs}
    cpu: dict[str, list[float]] = {oc.name: [] for oc in configs}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        for oc in configs[r % 3:] + configs[:r % 3]:
            g = guards[r % INSTANCES]
            assert oc.config is not None
            switch(g, oc.config)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                g.step(step)
                step += 1
            c1 = time.process_time()
            dist.barrier()
            if r:
                times[oc.name].append((time.perf_counter() - t0) / block)
                cpu[oc.name].append((c1 - c0) / block)
    for g in guards:
        g.flush()
    off = CHECKS_OFF.name

    def ratio(m: dict[str, list[float]], on: str) -> float:
        return statistics.median(a / b for a, b in zip(m[on], m[off], strict=True)) - 1.0

    per_round = {k: [[v] for v in vs] for k, vs in times.items()}
    out: dict[str, Any] = {"step_ms_off": statistics.median(times[off]) * 1e3, "bounds": {}}
    for oc, bound in ((CHECKSUM, "exact"), (CHECKSUM_NORM, "norm")):
        out["bounds"][bound] = {
            "step_ms": statistics.median(times[oc.name]) * 1e3,
            "overhead": ratio(times, oc.name),
            "overhead_interval_90": bootstrap_interval(
                per_round, lambda m, name=oc.name: ratio(m, name)),
            "cpu_overhead": ratio(cpu, oc.name)}
    return out


def checksum_overhead(world: int, rounds: int, block: int) -> dict[str, Any]:
    """Every workload of ``WORKLOADS``: step time with the checksum check against it off."""
    out: dict[str, Any] = {"world": world, "rounds": rounds, "block": block, "workloads": {}}
    for name, (kind, batch) in WORKLOADS.items():
        out["workloads"][name] = run_ranks(_rank, world, kind, batch, rounds, block,
                                           timeout=1800)[0]
    return out


def checksum_md(res: dict[str, Any]) -> list[str]:
    lines = ["", f"## The checksum check: every nn.Linear product, every step "
             f"({res['world']} ranks x 1 thread)", "",
             "The guard with the checksum check alone against the guard with every check off, "
             f"on the same model; blocks of {res['block']} steps, {res['rounds']} rounds, "
             "alternated; the median over rounds of each round's ratio.", "",
             "`exact` is the default bound (`ChecksumConfig.bound`); `norm` the looser one, "
             "which on the CPU is also the slower: the C passes serve the exact bound only "
             "(docs/checks/checksum.md).", "",
             "| workload | bound | step, off (ms) | step, checksum (ms) | overhead | 90% interval "
             "| CPU overhead |", "|---|---|---|---|---|---|---|"]
    for name, w in res["workloads"].items():
        for bound, b in w["bounds"].items():
            lo, hi = b["overhead_interval_90"]
            lines.append(f"| {name} | {bound} | {w['step_ms_off']:.2f} | {b['step_ms']:.2f} | "
                         f"**{b['overhead'] * 100:+.1f}%** | {lo * 100:+.1f}% .. "
                         f"{hi * 100:+.1f}% | {b['cpu_overhead'] * 100:+.1f}% |")
    return [*lines, ""]
