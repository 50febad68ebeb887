"""Replay audit overhead: step time with the audit every k steps, beside replay off and an
"ideal" run that only adds the recomputation the audit cannot avoid."""

from __future__ import annotations

import functools
import resource
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from bench.overhead import NO_TRIM, allocator_names, apply_allocator
from bench.reference import (
    INSTANCES,
    classification_batch,
    cross_entropy_loss,
    guarded_ddp,
    reference_mlp,
    switch,
)
from bench.timing import bootstrap_interval, split_rounds
from scenarios.run.launch import run_ranks
from scenarios.spec.overhead import replay_only
from sdc_guard import GuardConfig, SDCGuard, native_kernel
from sdc_guard.internal import TolerantReplayAudit

REPLAY_INTERVALS = (1, 2, 5, 10, 50)


def _replay_rank(rank: int, world: int, rounds: int, batch: int,
                 native: bool = True, nonfinite: bool = True,
                 allocator: dict[int, int] | None = None, mode: str = "exact") -> dict[str, Any]:
    """``_measure`` with the C kernel on (``native``) or the torch path forced, under glibc's
    ``mallopt`` settings ``allocator`` (``bench.overhead.NO_TRIM``; None: as it comes)."""
    apply_allocator(allocator)
    with native_kernel(native) as native_in_use:
        return _measure(rank, world, rounds, batch, nonfinite=nonfinite,
                        native_in_use=native_in_use, mode=mode)


def _measure(rank: int, world: int, rounds: int, batch: int, *, nonfinite: bool,
             native_in_use: bool, mode: str = "exact") -> dict[str, Any]:
    """Step time with the replay audit at several intervals, beside replay off and the ideal.

    ``nonfinite``: the non-finite check runs in every configuration (replay off and the
    ideal too), as with the guard's default configuration. ``False``: the replay alone.

    The ideal of interval k is a real run, alternated with the others: replay off, plus
    one plain forward+backward of the neighbour's batch at the start of every k-th step
    (what the audit must at least do), so it meets the same contention and the same
    synchronisation pattern as the audit. The cost per step is estimated from the
    medians of the audit (or extra) steps and of the other steps (see
    ``extra_per_step``), for the audit and the ideal alike.

    ``mode="tolerant"``: the tolerant audit (``GuardConfig(replay_mode="tolerant")``, its
    norm trigger on between audits), every configuration without deterministic mode. Each
    model instance's audit calibrates once, at the warm-up, and every audit built after a
    switch takes that tolerance (``restore_tolerance``): the timed audit steps are the
    steady ones.
    """
    batch_for = functools.partial(classification_batch, batch=batch)

    def audit_every(k: int) -> GuardConfig:  # the audit every k steps (0: off), deterministic
        config = replay_only(max(k, 1)).config
        assert config is not None
        if mode == "tolerant":
            config = replace(config, replay_mode="tolerant", deterministic=False)
        return replace(config, replay_interval=k, nonfinite=nonfinite)

    configs = {"off": (audit_every(0), 0),
               **{f"audit {k}": (audit_every(k), 0) for k in REPLAY_INTERVALS},
               **{f"ideal {k}": (audit_every(0), k) for k in REPLAY_INTERVALS}}
    """name -> (the guard's configuration, interval of the ideal's extra forward+backward)"""
    guards: list[SDCGuard] = []
    extra_every = [0]
    for _ in range(INSTANCES):
        model = guarded_ddp(reference_mlp())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=audit_every(1))
        module = model.module
        params = [p for p in module.parameters() if p.requires_grad]

        def extra(step: int, module: torch.nn.Module = module,
                  params: list[torch.Tensor] = params) -> None:
            every = extra_every[0]
            if every and step % every == 0:
                loss = cross_entropy_loss(module, batch_for((rank + 1) % world, step))
                torch.autograd.grad(loss, params)

        g.before_step.append(extra)
        guards.append(g)

    learned: dict[int, float] = {}
    """Each instance's calibrated tolerance (the tolerant mode)."""

    def runner(name: str, i: int) -> SDCGuard:
        config, ideal = configs[name]
        g = guards[i]
        for c in g.checks:
            if isinstance(c, TolerantReplayAudit) and c.tolerance is not None:
                learned.setdefault(i, c.tolerance)
        switch(g, config)
        for c in g.checks:
            if isinstance(c, TolerantReplayAudit) and i in learned:
                c.restore_tolerance(learned[i])
        extra_every[0] = ideal
        return g

    module = reference_mlp()
    params = list(module.parameters())
    steps = {name: 0 for name in configs}
    times: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    thread: dict[str, list[float]] = {name: [] for name in configs}
    step_ids: dict[str, list[int]] = {name: [] for name in configs}
    faults: dict[str, list[int]] = {name: [] for name in configs}
    """Minor page faults per step: memory the C library handed back to the system and
    the step touched again (glibc trims its heap when enough is free at its top)."""
    fwd_bwd: list[float] = []
    for i in range(INSTANCES):  # warm-up
        for name in configs:
            runner(name, i).step(1)
    every = {name: int(name.split()[1]) if " " in name else 1 for name in configs}
    # At least 4 audit (or extra) steps per block, so every interval gets the same count.
    per_block = {name: max(10, 4 * every[name]) for name in configs}
    names = list(configs)
    for r in range(rounds):
        # The order rotates round by round: no configuration always follows another (a
        # configuration that always ran after the audits ran on the heap they left).
        for name in names[r % len(names):] + names[:r % len(names)]:
            g = runner(name, r % INSTANCES)
            g.step(steps[name])  # the block's first step after a switch is not timed
            steps[name] += 1
            for _ in range(per_block[name]):
                dist.barrier()
                t0 = time.perf_counter()
                c0 = time.process_time()
                h0 = time.thread_time()
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                g.step(steps[name])
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                h1 = time.thread_time()
                c1 = time.process_time()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
                thread[name].append(h1 - h0)
                faults[name].append(f1 - f0)
                step_ids[name].append(steps[name])
                steps[name] += 1
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            loss = cross_entropy_loss(module, batch_for(rank, 0))
            torch.autograd.grad(loss, params)
            fwd_bwd.append(time.perf_counter() - t0)

    def extra_per_step(samples: dict[str, list[tuple[int, float]]], name: str) -> float:
        """Robust mean extra time per step of ``name`` over "off": medians by phase.

        Interval k's steps are 1/k audit (or extra) steps and (k-1)/k others; the median
        of each kind, weighted so, is what the mean would be without this machine's
        occasional 100 ms stalls, which would otherwise swamp 1% effects.
        """
        k = every[name]
        base = statistics.median(t for _, t in samples["off"])
        hit = statistics.median(t for st, t in samples[name] if st % k == 0)
        if k == 1:
            return hit - base
        rest = statistics.median(t for st, t in samples[name] if st % k != 0)
        return (hit - base) / k + (rest - base) * (k - 1) / k

    def per_hit(samples: dict[str, list[tuple[int, float]]], name: str) -> float:
        """Extra time of one audit (or extra) step over the same configuration's other steps.

        The other steps of interval k run in the same blocks as its audit steps, so
        this difference does not carry the noise of comparing two configurations;
        for k = 1 (no other steps) it is taken over "off". What interval k costs per
        step is this divided by k, if its other steps cost what "off" costs:
        ``rest_vs_off`` below checks that.
        """
        k = every[name]
        hit = statistics.median(t for st, t in samples[name] if st % k == 0)
        if k == 1:
            return hit - statistics.median(t for _, t in samples["off"])
        return hit - statistics.median(t for st, t in samples[name] if st % k != 0)

    def rest_vs_off(samples: dict[str, list[tuple[int, float]]], name: str) -> float:
        k = every[name]
        if k == 1:
            return 0.0
        return (statistics.median(t for st, t in samples[name] if st % k != 0)
                - statistics.median(t for _, t in samples["off"]))

    tagged = {name: list(zip(step_ids[name], times[name], strict=True)) for name in configs}
    ctagged = {name: list(zip(step_ids[name], cpu[name], strict=True)) for name in configs}
    htagged = {name: list(zip(step_ids[name], thread[name], strict=True)) for name in configs}
    off = statistics.median(times["off"])
    coff = statistics.median(cpu["off"])
    fb = statistics.median(fwd_bwd)
    out: dict[str, Any] = {"step_s_replay_off": off,
                           "page_faults_per_step_replay_off": statistics.mean(faults["off"]),
                           "forward_backward_s": fb,
                           "step_cpu_s_replay_off": coff, "native_kernel": native_in_use,
                           "steps_per_config": len(times["off"]), "rounds": rounds,
                           "intervals": {}}
    per_round = {name: split_rounds(v, rounds) for name, v in tagged.items()}
    for k in REPLAY_INTERVALS:
        a, b = f"audit {k}", f"ideal {k}"
        audit_extra, ideal_extra = extra_per_step(tagged, a), extra_per_step(tagged, b)
        sub = {n: per_round[n] for n in ("off", a, b)}
        # The headline: each round's own ratio (its blocks ran on one model instance, one
        # after another), then the median over rounds, as the checksum table takes its own.
        round_ratios = [per_hit(one, a) / per_hit(one, b)
                        for one in ({n: v[r] for n, v in sub.items()} for r in range(rounds))]
        out["intervals"][str(k)] = {
            "per_audit_step_ratio": statistics.median(round_ratios),
            "per_audit_step_ratio_interval_90": bootstrap_interval(
                {"round": [[x] for x in round_ratios]}, lambda m: statistics.median(m["round"])),
            "per_audit_step_ratio_pooled": per_hit(tagged, a) / per_hit(tagged, b),
            "per_audit_step_ratio_pooled_interval_90": bootstrap_interval(
                sub, lambda m, a=a, b=b: per_hit(m, a) / per_hit(m, b)),
            "per_audit_step_thread_cpu_ratio": per_hit(htagged, a) / per_hit(htagged, b),
            "audit_step_extra_s": per_hit(tagged, a),
            "ideal_step_extra_s": per_hit(tagged, b),
            "audit_rest_vs_off_s": rest_vs_off(tagged, a),
            "audit_rest_vs_off_interval_90": bootstrap_interval(sub, lambda m, a=a: rest_vs_off(m, a)),
            "ideal_rest_vs_off_s": rest_vs_off(tagged, b),
            "ratio_to_ideal_interval_90": bootstrap_interval(
                sub, lambda m, a=a, b=b: extra_per_step(m, a) / extra_per_step(m, b)),
            "step_s": off + audit_extra,
            "ideal_step_s": off + ideal_extra,
            "overhead": audit_extra / off,
            "ideal_overhead": ideal_extra / off,
            "ratio_to_ideal": audit_extra / ideal_extra,
            "formula_overhead": fb / k / off,
            "ratio_to_formula": audit_extra / (fb / k),
            "cpu_ratio_to_ideal": extra_per_step(ctagged, a) / extra_per_step(ctagged, b),
            "page_faults_per_step": {
                n: {kind: statistics.mean(f for st, f in zip(step_ids[n], faults[n], strict=True)
                                          if (st % k == 0) == (kind == "audit"))
                    for kind in (("audit", "other") if k > 1 else ("audit",))}
                for n in (a, b)},
        }
    return out


def replay_overhead(world: int, rounds: int, batch: int, native: bool = True,
                    nonfinite: bool = True,
                    allocator: dict[int, int] | None = None,
                    mode: str = "exact") -> dict[str, Any]:
    """The replay audit's overhead on ``world`` ranks (see ``_measure``); ``allocator``: glibc
    ``mallopt`` settings each rank applies before it builds its models; ``mode``: the
    audit's (``GuardConfig.replay_mode``)."""
    res: dict[str, Any] = run_ranks(_replay_rank, world, rounds, batch, native, nonfinite,
                                    allocator, mode, timeout=3600)[0]
    res.update({"world": world, "batch": batch, "nonfinite": nonfinite,
                "allocator": allocator_names(allocator), "mode": mode})
    return res


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.replay``: the replay table alone (e.g. under other allocator settings)."""
    import argparse

    from bench.results import replay_md

    ap = argparse.ArgumentParser(prog="python -m bench.replay", description=main.__doc__)
    ap.add_argument("--world", type=int, default=3, help="ranks (default 3)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds (default 12)")
    ap.add_argument("--alone", action="store_true", help="the non-finite check off everywhere")
    ap.add_argument("--no-trim", action="store_true",
                    help="each rank keeps its freed memory (glibc mallopt, as docs/usage.md "
                         "advises): no page faults from the allocator's trimming")
    args = ap.parse_args(argv)
    if args.world < 1 or args.rounds < 1:
        ap.error(f"--world and --rounds must be at least 1 (got --world {args.world} "
                 f"--rounds {args.rounds})")
    res = replay_overhead(args.world, rounds=args.rounds, batch=128, nonfinite=not args.alone,
                          allocator=NO_TRIM if args.no_trim else None)
    print("\n".join(replay_md(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
