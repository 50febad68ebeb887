"""Per-check step-time overhead on the reference workload, against plain DDP and the guard with
its checks off, with the nonfinite and weights checks' parts timed directly.

The configurations are ``scenarios.spec.overhead``'s; the guard's are alternated on one
model (``bench.reference.switch``), plain DDP runs on a model of its own.
"""

from __future__ import annotations

import ctypes
import functools
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from bench.reference import (
    CHECKS_OFF_COPIED,
    INSTANCES,
    PLAIN_DDP_VIEWS,
    reference_mlp,
    reference_runs,
)
from bench.timing import (
    bootstrap_interval,
    launch_rounds,
    per_rotation,
    resampled,
    seconds,
    split_rounds,
    whole_rotations,
)
from scenarios.run.launch import run_ranks
from scenarios.spec.overhead import (
    ALWAYS_ON,
    CHECKS_OFF,
    NONFINITE,
    NONFINITE_EVERY_STEP,
    PLAIN_DDP,
    WEIGHTS,
    OverheadConfig,
)
from sdc_guard import GuardConfig, fingerprint_tensor, state_tensors
from sdc_guard.internal import PendingSum, check_nonfinite, flag_words, scale_and_check

NF_SCALE = "nonfinite: DDP's 1/world scaling pass alone (paid anyway)"
NF_FUSED = "nonfinite: the same pass with the local check fused in"
NF_RED = ("nonfinite: reduced-result check (one read pass), right after the all-reduce, "
          "where the guard runs it")
NF_WORD = "nonfinite: flags word sent, the previous step's collected"
CONFIGS: tuple[OverheadConfig, ...] = (PLAIN_DDP, PLAIN_DDP_VIEWS, CHECKS_OFF, CHECKS_OFF_COPIED,
                                       NONFINITE, NONFINITE_EVERY_STEP, WEIGHTS, ALWAYS_ON)
"""What the per-step table alternates, in this order."""
BLOCK_CONFIGS: tuple[OverheadConfig, ...] = (PLAIN_DDP, CHECKS_OFF, NONFINITE,
                                             NONFINITE_EVERY_STEP)
GUARD_OFF_CONFIGS: tuple[OverheadConfig, ...] = (PLAIN_DDP, PLAIN_DDP_VIEWS, CHECKS_OFF,
                                                 CHECKS_OFF_COPIED)
"""What the block-timed tables alternate: the checks, and (with more rounds, its target being
small) the guard with its checks off beside plain DDP, each DDP construction on both sides.
The checksum's configurations run in a process of their own (``bench.checksum``): their
large temporaries move the allocator's thresholds for the whole process, which slowed every
configuration after them, plain DDP included."""
GUARD_OFF = CHECKS_OFF.name


def _overhead_rank(rank: int, world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    """Per-step times (a barrier around each step) of ``CONFIGS`` and the direct parts."""
    guards, runner = reference_runs(rank, batch)

    params = sum(p.numel() for p in reference_mlp().parameters())
    times: dict[str, list[float]] = {oc.name: [] for oc in CONFIGS}
    cpu: dict[str, list[float]] = {oc.name: [] for oc in CONFIGS}
    step = 0
    for i in range(INSTANCES):  # warm-up: Adam state exists, caches are hot
        for oc in CONFIGS:
            for _ in range(2):
                runner(oc, i)(step)
                step += 1
    direct: dict[str, list[float]] = {"weights verdict": [],
                                       "weights check, local fingerprint only": [],
                                       "fingerprint of the same bytes (one flat tensor)": [],
                                       "all_gather of 8 bytes": [],
                                       "flat fingerprint, then all_gather of its 8 bytes": [],
                                       NF_SCALE: [], NF_FUSED: [], NF_RED: [],
                                       NF_WORD: []}
    wg = guards[0]
    runner(WEIGHTS, 0)  # the weights check alone on instance 0; its check object is kept
    weights: Any = next(c for c in wg.checks if c.name == "weights")
    flat = torch.cat([t.reshape(-1).float() for t in state_tensors(wg.model, wg.optimizer)])
    word = torch.zeros(1, dtype=torch.int64)
    grads = torch.cat([p.detach().reshape(-1) for p in wg.model.parameters()])
    reduced = torch.zeros_like(grads)  # all-reduced again and again: zeros stay finite
    sent: list[PendingSum] = []

    def send_and_collect() -> None:  # what the non-finite check does on a clean step
        sent.append(PendingSum(torch.tensor(flag_words((False, False), rank, world),
                                            dtype=torch.int64)))
        if len(sent) > 1:
            sent.pop(0).wait_all()
    for r in range(rounds):
        # The order rotates round by round: no configuration always follows another.
        for oc in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
            name = oc.name
            run = runner(oc, r % INSTANCES)
            for _ in range(block):
                dist.barrier()
                t0 = time.perf_counter()
                c0 = time.process_time()
                run(step)
                c1 = time.process_time()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
                step += 1
        for _ in range(block):
            dist.barrier()
            direct["weights verdict"].append(seconds(lambda: weights.post_step(0)))
            dist.barrier()
            direct["weights check, local fingerprint only"].append(
                seconds(lambda: weights.local_fingerprint().item()))
            dist.barrier()
            direct["fingerprint of the same bytes (one flat tensor)"].append(
                seconds(lambda: fingerprint_tensor(flat).item()))
            dist.barrier()
            outs = [torch.empty_like(word) for _ in range(world)]
            direct["all_gather of 8 bytes"].append(
                seconds(functools.partial(dist.all_gather, outs, word)))
            dist.barrier()
            direct["flat fingerprint, then all_gather of its 8 bytes"].append(
                seconds(lambda o=outs: dist.all_gather(o, fingerprint_tensor(flat).reshape(1))))
            dist.barrier()
            # Scale by -1: the same work as 1/world without drifting the values.
            direct[NF_SCALE].append(seconds(lambda: grads.mul_(-1.0)))
            dist.barrier()
            direct[NF_FUSED].append(seconds(lambda: bool(scale_and_check(grads, -1.0))))
            dist.barrier()
            dist.all_reduce(reduced)  # the guard reads the result in the all-reduce's callback
            direct[NF_RED].append(seconds(lambda: bool(check_nonfinite(reduced))))
            dist.barrier()
            direct[NF_WORD].append(seconds(send_and_collect))
    per_round = {k: split_rounds(v, rounds) for k, v in times.items()}
    result = {
        "params": params,
        "overhead_interval_90": {
            k: bootstrap_interval(per_round, lambda m, k=k: statistics.median(m[k])
                         / statistics.median(m[PLAIN_DDP.name]) - 1.0)
            for k in times if k != PLAIN_DDP.name},
        "vs_guard_off_interval_90": {
            k: bootstrap_interval(per_round, lambda m, k=k: statistics.median(m[k])
                         / statistics.median(m[GUARD_OFF]) - 1.0)
            for k in (oc.name for oc in CONFIGS if oc.config is not None) if k != GUARD_OFF},
        "state_bytes": flat.numel() * 4,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "direct_s": {k: statistics.median(v) for k, v in direct.items()},
    }
    return result


def _blocks_rank(rank: int, world: int, rounds: int, block: int, batch: int,
                 configs: tuple[OverheadConfig, ...] = BLOCK_CONFIGS,
                 allocator: dict[int, int] | None = None) -> dict[str, Any]:
    """Step time as a training loop sees it: blocks of ``block`` steps timed as a whole,
    with no barrier between the steps (a barrier per step adds two meeting points of its
    own, and lines the ranks' phases up); the configurations rotate round by round, and
    the ratios are medians over whole rotations (``rounds`` a multiple of ``len(configs)``).
    ``allocator``: glibc ``mallopt`` settings this rank applies first (``NO_TRIM``)."""
    apply_allocator(allocator)
    guards, runner = reference_runs(rank, batch)

    names = [oc.name for oc in configs]
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    main: dict[str, list[float]] = {k: [] for k in names}  # this rank's main thread
    faults: dict[str, list[float]] = {k: [] for k in names}  # minor page faults per step
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        for oc in configs[r % len(configs):] + configs[:r % len(configs)]:
            name = oc.name
            run = runner(oc, r % INSTANCES)
            run(step)  # the first step after a switch is not timed: it builds the checks
            step += 1  # anew (their hooks and buffers), which a training run does once
            dist.barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(block):
                run(step)
                step += 1
            c1, h1 = time.process_time(), time.thread_time()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            dist.barrier()
            if r:
                times[name].append((time.perf_counter() - t0) / block)
                cpu[name].append((c1 - c0) / block)
                main[name].append((h1 - h0) / block)
                faults[name].append((f1 - f0) / block)
    for g in guards:
        if g.config.nonfinite:
            g.flush()
    return block_stats(names, {"times": times, "cpu": cpu, "main": main, "faults": faults})


def block_stats(names: list[str], raw: dict[str, dict[str, list[float]]],
                launches: int = 1) -> dict[str, Any]:
    """The block-timed tables' numbers from each configuration's samples per round (``raw``:
    ``times``, ``cpu``, ``main``, ``faults``), ``launches`` runs of equal rounds one after
    another. With one launch the intervals resample whole rotations; with more, whole
    launches: each launch's processes start with a heap of their own, and where glibc's
    trimming faults pages in depends on that heap's history (docs/usage.md), so rounds of
    one launch share a draw that the rotations of one run cannot sample."""
    times, cpu, main, faults = (raw[k] for k in ("times", "cpu", "main", "faults"))
    # The ratios are taken over whole rotations: a block's position in its round moves its
    # time (two configurations alternated on 3 ranks sharing 2 cores: whichever ran second
    # paid some 0.3% more, whatever it ran), and a rotation puts every configuration in
    # every position once.
    by_cycle = {"times": per_rotation(times, len(names)),
                "main": per_rotation(main, len(names)),
                "cpu": per_rotation(cpu, len(names))}
    per_cycle = resampled(by_cycle["times"], launches)
    main_cycles = resampled(by_cycle["main"], launches)

    def to_plain(m: dict[str, list[float]], k: str, base: str) -> float:
        return statistics.median(a / b for a, b in zip(m[k], m[base], strict=True)) - 1.0

    def ratio(m: dict[str, list[float]], k: str) -> float:
        return to_plain(m, k, GUARD_OFF)

    pairs = [(k, base) for k, base in ((GUARD_OFF, PLAIN_DDP_VIEWS.name),
                                       (CHECKS_OFF_COPIED.name, PLAIN_DDP.name))
             if k in names and base in names]
    """The guard with its checks off beside plain DDP built the same way."""
    guard_off_vs_plain = {
        f"{k} / {base}": (to_plain(by_cycle["times"], k, base),
                          bootstrap_interval(per_cycle, lambda m, k=k, b=base: to_plain(m, k, b)))
        for k, base in pairs}

    def extra_main(m: dict[str, list[float]], k: str, base: str) -> float:
        """Median over rotations of the main thread's extra CPU time per step, in seconds."""
        return statistics.median(a - b for a, b in zip(m[k], m[base], strict=True))

    guard_off_main_cpu = {
        f"{k} / {base}": (extra_main(by_cycle["main"], k, base),
                          bootstrap_interval(main_cycles,
                                             lambda m, k=k, b=base: extra_main(m, k, b)),
                          statistics.median(main[base]))
        for k, base in pairs}
    launch_cycles = {k: split_rounds(vs, launches) for k, vs in by_cycle["times"].items()}
    per_launch = {f"{k} / {base}": [to_plain({n: v[i] for n, v in launch_cycles.items()}, k, base)
                                    for i in range(launches)]
                  for k, base in pairs}
    launch_faults = {k: [statistics.median(v) for v in split_rounds(vs, launches)]
                     for k, vs in faults.items()}
    return {
        "rotation_rounds": len(names),
        "launches": launches,
        "guard_off_vs_plain_per_launch": per_launch,
        "page_faults_per_step_per_launch": launch_faults,
        "round_cpu_s": {k: [round(v, 9) for v in vs] for k, vs in cpu.items()},
        "round_step_s": {k: [round(v, 9) for v in vs] for k, vs in times.items()},
        "round_main_thread_cpu_s": {k: [round(v, 9) for v in vs] for k, vs in main.items()},
        "round_page_faults_per_step": faults,
        "guard_off_vs_plain": guard_off_vs_plain,
        "guard_off_main_thread_cpu_extra_s": guard_off_main_cpu,
        "step_main_thread_cpu_s": {k: statistics.median(v) for k, v in main.items()},
        "page_faults_per_step": {k: statistics.median(v) for k, v in faults.items()},
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "vs_guard_off": {k: ratio(by_cycle["times"], k) for k in names if k != GUARD_OFF},
        "vs_guard_off_interval_90": {k: bootstrap_interval(per_cycle, lambda m, k=k: ratio(m, k))
                                     for k in names if k != GUARD_OFF},
        "cpu_vs_guard_off": {k: ratio(by_cycle["cpu"], k) for k in names if k != GUARD_OFF},
        "untimed_first": True,
    }


def check_overhead_blocks(world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    """``BLOCK_CONFIGS`` timed in blocks of ``block`` steps on ``world`` ranks."""
    whole_rotations(rounds, len(BLOCK_CONFIGS))
    res: dict[str, Any] = run_ranks(_blocks_rank, world, rounds, block, batch, timeout=1800)[0]
    res.update({"world": world, "batch": batch, "rounds": rounds, "block": block})
    return res


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""
NO_TRIM = {M_TRIM_THRESHOLD: (1 << 31) - 1, M_MMAP_THRESHOLD: 32 << 20}
"""glibc's settings docs/usage.md advises for CPU training (there as ``MALLOC_*``
environment variables): freed memory stays with the process, so a step does not fault
its pages back in. Applied by ``mallopt`` in each rank: the ranks are forked from a
server that started before, with the environment of then."""
_MALLOPT_NAMES = {M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD", M_MMAP_THRESHOLD: "M_MMAP_THRESHOLD"}


def apply_allocator(allocator: dict[int, int] | None) -> None:
    """Apply glibc ``mallopt`` settings (``NO_TRIM``) to this process; None: as it comes."""
    if allocator:
        libc = ctypes.CDLL(None)
        for param, value in allocator.items():
            if libc.mallopt(param, value) != 1:
                raise RuntimeError(f"glibc's mallopt({param}, {value}) refused the setting")


def allocator_names(allocator: dict[int, int] | None) -> dict[str, int]:
    """``allocator`` with glibc's names for its parameters (for the results)."""
    return {_MALLOPT_NAMES.get(k, str(k)): v for k, v in (allocator or {}).items()}


def check_guard_off(world: int, rounds: int, block: int, batch: int,
                    configs: tuple[OverheadConfig, ...] = GUARD_OFF_CONFIGS,
                    allocator: dict[int, int] | None = None, launches: int = 1) -> dict[str, Any]:
    """``configs`` timed in blocks, as ``check_overhead_blocks``; ``allocator``: glibc
    ``mallopt`` settings each rank applies before it builds its models (``NO_TRIM``).
    ``launches``: the rounds split over that many runs of new rank processes, one after
    another, the intervals resampling whole launches (``block_stats``)."""
    each = launch_rounds(rounds, launches, len(configs))
    runs = [run_ranks(_blocks_rank, world, each, block, batch, configs, allocator,
                      timeout=3600)[0] for _ in range(launches)]
    names = [oc.name for oc in configs]
    raw = {what: {k: [x for run in runs for x in run[key][k]] for k in names}
           for what, key in (("times", "round_step_s"), ("cpu", "round_cpu_s"),
                             ("main", "round_main_thread_cpu_s"),
                             ("faults", "round_page_faults_per_step"))}
    res = block_stats(names, raw, launches)
    res.update({"world": world, "batch": batch, "rounds": rounds, "block": block,
                "configs": [oc.name for oc in configs],
                "allocator": allocator_names(allocator)})
    return res


def check_overhead(world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    """``CONFIGS`` step by step on ``world`` ranks, and the ratios the README quotes."""
    res: dict[str, Any] = run_ranks(_overhead_rank, world, rounds, block, batch, timeout=1800)[0]
    base = res["step_s"][PLAIN_DDP.name]
    res["overhead_vs_plain_ddp"] = {k: v / base - 1.0 for k, v in res["step_s"].items()}
    cbase = res["step_cpu_s"][PLAIN_DDP.name]
    res["cpu_overhead_vs_plain_ddp"] = {k: v / cbase - 1.0 for k, v in res["step_cpu_s"].items()}
    off = res["step_s"][GUARD_OFF]
    res["overhead_vs_guard_off"] = {k: res["step_s"][k] / off - 1.0
                                    for k in res["vs_guard_off_interval_90"]}
    d = res["direct_s"]
    every = GuardConfig().nonfinite_exchange_interval  # one word per this many steps
    nf = max(0.0, d[NF_FUSED] - d[NF_SCALE]) + d[NF_RED] + d[NF_WORD] / every
    res["nonfinite_exchange_interval"] = every
    res["nonfinite_direct_fraction_of_plain_step"] = nf / base
    d = res["direct_s"]
    ideal = d["fingerprint of the same bytes (one flat tensor)"] + d["all_gather of 8 bytes"]
    res["weights_cost_ratio"] = d["weights verdict"] / ideal
    res["weights_cost_ratio_to_timed_ideal"] = (
        d["weights verdict"] / d["flat fingerprint, then all_gather of its 8 bytes"])
    res["weights_local_cost_ratio"] = (
        d["weights check, local fingerprint only"] + d["all_gather of 8 bytes"]) / ideal
    res.update({"world": world, "batch": batch, "rounds": rounds, "block": block,
                "optimizer": "AdamW", "threads_per_rank": 1})
    return res
