"""The checksum check's step-time cost beside the check off, on several workloads.

Each workload runs ``INSTANCES`` guarded models with the checksum check (exact or norm
bound) and ``INSTANCES`` models of the guard with its checks off; the configurations are
timed in blocks of steps with no barrier between the steps (as a training loop runs), the
order rotating round by round, each block after one untimed step (the first after a switch
builds the check anew: its hooks, buffers and workspaces, once in a training run). The ratio
is the median over whole rotations of each rotation's ratio of means
(``bench.timing.per_rotation``).

The headline baseline is the guard with its checks off on models of its own: it never
registered a comm hook, so the ratio is everything the check costs a user who turns it on,
the comm hook it needs included (any hook costs DDP a pass: docs/architecture.md). The
second baseline is the checks-off guard on the checksum's own models, whose hook stays
registered (DDP cannot remove one): the ratio to it is the check's own work, what it adds
where another check (the non-finite check, on by default) has registered the hook already.
The third comparison is the one a user of the defaults makes: the guard's default checks
(non-finite and weights, which register the hook themselves) with ``checksum=True`` against
the same defaults without it, on the checksum's models, for the default (exact) bound; and
beside it the same configuration with the checksum's weight sums taken in a read of its own
instead of in the weights check's fingerprint pass (what that shared read saves).
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
from bench.timing import (
    bootstrap_interval,
    launch_rounds,
    per_rotation,
    resampled,
    split_rounds,
    whole_rotations,
)
from scenarios.run.launch import run_ranks
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.overhead import CHECKS_OFF, CHECKSUM, CHECKSUM_NORM
from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.internal import ChecksumCheck, WeightsCheck

WORKLOADS = {
    "reference MLP (512-1024-1024-10), batch 128": ("mlp", 128),
    "reference MLP (512-1024-1024-10), batch 1024": ("mlp", 1024),
    "transformer (width 128, 2 blocks, 12 tokens), batch 64": ("transformer", 64),
}
"""name -> (kind, batch): the reference MLP of the other tables, and the scenarios' transformer
made wider (9 linear layers: attention's qkv and projection, two MLP layers per block, head)."""


def _guards(kind: str, batch: int) -> list[SDCGuard]:
    """``INSTANCES`` guards (checks off) on fresh models of the workload ``kind``."""
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


OFF_HOOKED = "checks off, comm hook registered"
"""The checksum models' checks-off blocks: the hook the check registered stays (see above)."""
DEFAULTS = "defaults (non-finite + weights)"
DEFAULTS_CHECKSUM = "defaults + checksum"
"""The guard's default checks without and with the checksum check (``GuardConfig()`` and
``GuardConfig(checksum=True)``), on the checksum's models."""
OWN_READ = "defaults + checksum, the weight read again"
"""``GuardConfig(checksum=True)`` with the checksum's weight sums taken in its own read of each
weight (its forward hook's), not in the weights check's (unsubscribed from its ``WeightPass``)."""
CONFIGS = (CHECKS_OFF.name, OFF_HOOKED, CHECKSUM.name, CHECKSUM_NORM.name, DEFAULTS,
           DEFAULTS_CHECKSUM, OWN_READ)
"""What a workload's rounds rotate, in this order."""


def _weight_read(guard: SDCGuard, *, shared: bool) -> None:
    """The checksum's weight sums taken in the weights check's read (``shared``: subscribed
    to its ``WeightPass``, as ``build_checks`` wires it) or in its own."""
    checksum = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
    for c in guard.checks:
        if isinstance(c, WeightsCheck):
            c.weight_pass.unsubscribe(checksum.weight_sums)
            if shared:
                c.weight_pass.subscribe(checksum.weight_sums)


def _timed(guards: list[SDCGuard], plain: list[SDCGuard], configs: tuple[str, ...],
           rounds: int, block: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per step, wall and CPU, of each of ``configs`` per round: ``guards`` switched
    to each configuration in turn, ``plain`` (checks off, never hooked) for ``CHECKS_OFF``;
    blocks of ``block`` steps after one untimed step, the order rotating round by round."""
    settings = {OFF_HOOKED: CHECKS_OFF.config, CHECKSUM.name: CHECKSUM.config,
                CHECKSUM_NORM.name: CHECKSUM_NORM.config, DEFAULTS: GuardConfig(),
                DEFAULTS_CHECKSUM: GuardConfig(checksum=True),
                OWN_READ: GuardConfig(checksum=True)}
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        k = r % len(configs)
        for name in configs[k:] + configs[:k]:
            if name == CHECKS_OFF.name:
                g = plain[r % INSTANCES]
            else:
                g = guards[r % INSTANCES]
                config = settings[name]
                assert config is not None
                switch(g, config)
                if name in (DEFAULTS_CHECKSUM, OWN_READ):  # one configuration, two wirings
                    _weight_read(g, shared=name == DEFAULTS_CHECKSUM)
            g.step(step)  # the first step after a switch is not timed: it builds the check's
            step += 1     # hooks and buffers, which a training run does once
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                g.step(step)
                step += 1
            c1 = time.process_time()
            dist.barrier()
            if r:
                times[name].append((time.perf_counter() - t0) / block)
                cpu[name].append((c1 - c0) / block)
    assert not any(g.comm_hook_registered for g in plain)  # the headline baseline is hookless
    for g in guards + plain:
        g.flush()
    return times, cpu


def _ratio(m: dict[str, list[float]], on: str, base: str) -> float:
    """The median over ``m``'s samples (whole rotations) of ``on``'s time over ``base``'s,
    minus one."""
    return statistics.median(a / b for a, b in zip(m[on], m[base], strict=True)) - 1.0


def _rank(rank: int, world: int, kind: str, batch: int, rounds: int,
          block: int) -> dict[str, Any]:
    configs = CONFIGS
    # The checksum's models (their hook stays registered), and the checks-off guard's own.
    times, cpu = _timed(_guards(kind, batch), _guards(kind, batch), configs, rounds, block)
    # Ratios over whole rotations of the configurations (bench.timing.per_rotation).
    rot, rot_cpu = per_rotation(times, len(configs)), per_rotation(cpu, len(configs))
    per_rot = {k: [[v] for v in vs] for k, vs in rot.items()}
    out: dict[str, Any] = {"step_ms_off": statistics.median(times[CHECKS_OFF.name]) * 1e3,
                           "step_ms_off_hooked": statistics.median(times[OFF_HOOKED]) * 1e3,
                           "round_step_s": {k: [round(v, 9) for v in vs]
                                            for k, vs in times.items()},
                           "bounds": {}}
    for name, bound in ((CHECKSUM.name, "exact"), (CHECKSUM_NORM.name, "norm")):
        out["bounds"][bound] = {
            "step_ms": statistics.median(times[name]) * 1e3,
            "overhead": _ratio(rot, name, CHECKS_OFF.name),
            "overhead_interval_90": bootstrap_interval(
                per_rot, lambda m, on=name: _ratio(m, on, CHECKS_OFF.name)),
            "cpu_overhead": _ratio(rot_cpu, name, CHECKS_OFF.name),
            "overhead_vs_hooked": _ratio(rot, name, OFF_HOOKED),
            "overhead_vs_hooked_interval_90": bootstrap_interval(
                per_rot, lambda m, on=name: _ratio(m, on, OFF_HOOKED))}
    out["defaults"] = {
        "step_ms": statistics.median(times[DEFAULTS]) * 1e3,
        "step_ms_checksum": statistics.median(times[DEFAULTS_CHECKSUM]) * 1e3,
        "overhead": _ratio(rot, DEFAULTS_CHECKSUM, DEFAULTS),
        "overhead_interval_90": bootstrap_interval(
            per_rot, lambda m: _ratio(m, DEFAULTS_CHECKSUM, DEFAULTS)),
        "cpu_overhead": _ratio(rot_cpu, DEFAULTS_CHECKSUM, DEFAULTS),
        "step_ms_own_read": statistics.median(times[OWN_READ]) * 1e3,
        "overhead_own_read": _ratio(rot, OWN_READ, DEFAULTS),
        "overhead_own_read_interval_90": bootstrap_interval(
            per_rot, lambda m: _ratio(m, OWN_READ, DEFAULTS))}
    return out


def checksum_overhead(world: int, rounds: int, block: int) -> dict[str, Any]:
    """Every workload of ``WORKLOADS``: step time with the checksum check against it off."""
    whole_rotations(rounds, len(CONFIGS))
    out: dict[str, Any] = {"world": world, "rounds": rounds, "block": block,
                           "untimed_first": True, "rotation_rounds": len(CONFIGS),
                           "workloads": {}}
    for name, (kind, batch) in WORKLOADS.items():
        out["workloads"][name] = run_ranks(_rank, world, kind, batch, rounds, block,
                                           timeout=1800)[0]
    return out


PAIR = (DEFAULTS, DEFAULTS_CHECKSUM)
"""What ``checksum_launches`` alternates: the check turned on in the guard's defaults."""


def _pair_rank(rank: int, world: int, batch: int, rounds: int, block: int) -> dict[str, Any]:
    """One launch of ``checksum_launches``: ``PAIR`` on the reference MLP, per round."""
    times, cpu = _timed(_guards("mlp", batch), [], PAIR, rounds, block)
    return {"round_step_s": times, "round_cpu_s": cpu}


def checksum_launches(world: int, rounds: int, block: int, launches: int,
                      batch: int = 128) -> dict[str, Any]:
    """``GuardConfig(checksum=True)`` against ``GuardConfig()`` on the reference MLP, timed in
    blocks as ``checksum_overhead`` times them, the rounds split over ``launches`` runs of new
    rank processes, one after another, the interval resampling whole launches: where glibc's
    trimming faults pages in depends on each process's heap (``bench.overhead.block_stats``),
    a draw that every round of one launch shares."""
    each = launch_rounds(rounds, launches, len(PAIR))
    runs = [run_ranks(_pair_rank, world, batch, each, block, timeout=1800)[0]
            for _ in range(launches)]
    times, cpu = ({k: [x for run in runs for x in run[key][k]] for k in PAIR}
                  for key in ("round_step_s", "round_cpu_s"))
    return {"world": world, "batch": batch, "rounds": rounds, "block": block,
            **launch_stats(times, cpu, launches)}


def launch_stats(times: dict[str, list[float]], cpu: dict[str, list[float]],
                 launches: int) -> dict[str, Any]:
    """``checksum_launches``'s numbers from ``PAIR``'s seconds per step per round, wall
    (``times``) and CPU, ``launches`` runs of equal rounds one after another."""
    rot, rot_cpu = per_rotation(times, len(PAIR)), per_rotation(cpu, len(PAIR))
    by_launch = {k: split_rounds(vs, launches) for k, vs in rot.items()}

    def over(m: dict[str, list[float]]) -> float:
        return _ratio(m, DEFAULTS_CHECKSUM, DEFAULTS)

    return {
        "launches": launches, "rotation_rounds": len(PAIR), "untimed_first": True,
        "step_ms": statistics.median(times[DEFAULTS]) * 1e3,
        "step_ms_checksum": statistics.median(times[DEFAULTS_CHECKSUM]) * 1e3,
        "overhead": over(rot),
        "overhead_interval_90": bootstrap_interval(resampled(rot, launches), over),
        "cpu_overhead": over(rot_cpu),
        "cpu_overhead_interval_90": bootstrap_interval(resampled(rot_cpu, launches), over),
        "overhead_per_launch": [over({k: v[i] for k, v in by_launch.items()})
                                for i in range(launches)],
        "round_step_s": {k: [round(v, 9) for v in vs] for k, vs in times.items()},
        "round_cpu_s": {k: [round(v, 9) for v in vs] for k, vs in cpu.items()},
    }


def checksum_launches_md(res: dict[str, Any]) -> list[str]:
    lo, hi = res["overhead_interval_90"]
    clo, chi = res["cpu_overhead_interval_90"]
    n = res["launches"]
    return ["", f"## The checksum check in the defaults, over {n} launches ({res['world']} "
            "ranks x 1 thread)", "",
            "`GuardConfig(checksum=True)` against `GuardConfig()` on the reference MLP (512-1024-"
            f"1024-10), batch {res['batch']}, the exact bound: the two alone, alternated in "
            f"blocks of {res['block']} steps after one untimed step, {res['rounds']} rounds "
            f"in {n} launches of {res['rounds'] // n} rounds (new rank processes each time: "
            "where glibc's trimming faults pages in depends on each process's history, a draw "
            "the rounds of one launch share). The overhead is the median over whole rotations "
            "(2 rounds) of each rotation's ratio of means; its 90% bootstrap interval resamples "
            f"whole {'launches' if n > 1 else 'rotations'}.", "",
            "| step, defaults (ms) | step, defaults + checksum (ms) | overhead | 90% interval | "
            "CPU overhead (90% interval) |", "|---|---|---|---|---|",
            f"| {res['step_ms']:.2f} | {res['step_ms_checksum']:.2f} | "
            f"**{res['overhead'] * 100:+.1f}%** | {lo * 100:+.1f}% .. {hi * 100:+.1f}% | "
            f"{res['cpu_overhead'] * 100:+.1f}% ({clo * 100:+.1f}% .. {chi * 100:+.1f}%) |", "",
            "Each launch's own overhead, in the order they ran: "
            + ", ".join(f"{x * 100:+.1f}%" for x in res["overhead_per_launch"]) + ".", ""]


def _estimate(res: dict[str, Any]) -> str:
    """How the ratios were estimated: over whole rotations, or (runs before them) rounds."""
    n = res.get("rotation_rounds")
    if not n:
        return "the median over rounds of each round's ratio (90% bootstrap interval over rounds)."
    return (f"the median over whole rotations ({n} rounds: every configuration once in every "
            "position of a round, which moves a block's time) of each rotation's ratio of means "
            "(90% bootstrap interval over rotations).")


def checksum_md(res: dict[str, Any]) -> list[str]:
    lines = ["", f"## The checksum check: every nn.Linear product, every step "
             f"({res['world']} ranks x 1 thread)", "",
             "The guard with the checksum check alone against the guard with every check off "
             "on models of its own, which never registered a comm hook: the check's whole "
             "cost, the comm hook it needs included (any hook costs DDP a pass of its own: "
             "docs/architecture.md). The last column compares it with the checks-off guard "
             "on the checksum's own models, whose hook stays registered: the check's own "
             "work, what it adds where another check (the non-finite check, on by default) "
             f"has registered the hook already. Blocks of {res['block']} steps"
             + (" after one untimed step (the first after a switch builds the check: its "
                "hooks, buffers and workspaces, once in a training run)"
                if res.get("untimed_first") else "") + ", "
             f"{res['rounds']} rounds, the order rotating; " + _estimate(res), "",
             "`exact` is the default bound (`ChecksumConfig.bound`); `norm` the looser one, "
             "which on the CPU is also the slower: the C passes serve the exact bound only "
             "(docs/checks/checksum.md).", "",
             "| workload | bound | step, off (ms) | step, checksum (ms) | overhead | 90% interval "
             "| CPU overhead | vs off with the hook registered (90% interval) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, w in res["workloads"].items():
        for bound, b in w["bounds"].items():
            lo, hi = b["overhead_interval_90"]
            hlo, hhi = b["overhead_vs_hooked_interval_90"]
            lines.append(f"| {name} | {bound} | {w['step_ms_off']:.2f} | {b['step_ms']:.2f} | "
                         f"**{b['overhead'] * 100:+.1f}%** | {lo * 100:+.1f}% .. "
                         f"{hi * 100:+.1f}% | {b['cpu_overhead'] * 100:+.1f}% | "
                         f"{b['overhead_vs_hooked'] * 100:+.1f}% ({hlo * 100:+.1f}% .. "
                         f"{hhi * 100:+.1f}%) |")
    if not all("defaults" in w for w in res["workloads"].values()):
        return [*lines, ""]  # a run published before the defaults were timed
    lines += ["", "The check turned on in the guard's default configuration: `GuardConfig("
              "checksum=True)` against `GuardConfig()` (the non-finite and weights checks, "
              "whose comm hook the check then shares), on the same models, the exact bound, "
              "in the same blocks and rounds as above.", "",
              "| workload | step, defaults (ms) | step, defaults + checksum (ms) | overhead "
              "| 90% interval | CPU overhead |", "|---|---|---|---|---|---|"]
    for name, w in res["workloads"].items():
        d = w["defaults"]
        lo, hi = d["overhead_interval_90"]
        lines.append(f"| {name} | {d['step_ms']:.2f} | {d['step_ms_checksum']:.2f} | "
                     f"**{d['overhead'] * 100:+.1f}%** | {lo * 100:+.1f}% .. {hi * 100:+.1f}% | "
                     f"{d['cpu_overhead'] * 100:+.1f}% |")
    own = [(name, w["defaults"]) for name, w in res["workloads"].items()
           if "overhead_own_read" in w["defaults"]]
    if own:  # (runs before the weights check's read took the sums have no such column)
        lines += ["", "The same, the checksum's weight sums taken in a read of its own (its "
                  "forward hook's) instead of in the weights check's fingerprint pass: "
                  + "; ".join(f"{name} **{d['overhead_own_read'] * 100:+.1f}%** "
                              f"({d['overhead_own_read_interval_90'][0] * 100:+.1f}% .. "
                              f"{d['overhead_own_read_interval_90'][1] * 100:+.1f}%)"
                              for name, d in own) + " over the defaults."]
    return [*lines, ""]
