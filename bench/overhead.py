"""Benchmarks behind ``nox -s bench``: fingerprint throughput and per-check step-time overhead.

Every number is a median over alternated repetitions measured in one run, and
is written next to the ratio it is judged by. Results go to
``bench/results.json`` and ``bench/RESULTS.md`` (quoted in the README).

    python -m scenarios.bench [--quick] [--out bench]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard.fingerprints as fpmod
from scenarios.launch import run_ranks
from scenarios.models import classification_batch, cross_entropy_loss, reference_mlp
from sdc_guard import GuardConfig, SDCGuard, fingerprint, fingerprint_tensor
from sdc_guard.checks import state_tensors
from sdc_guard.comm_hook import _check, _scale_and_check
from sdc_guard.vote import PendingSum, flag_words

GIB = 1024**3


# -- fingerprint throughput ------------------------------------------------------------------
def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _on_path(native: bool, fn: Callable[[], object]) -> object:
    """``fn()`` with the C kernel on or off, the module's choice restored afterwards."""
    saved = fpmod._native, fpmod._native_resolved
    if native:
        fpmod.enable_native()
    else:
        fpmod.disable_native()
    try:
        return fn()
    finally:
        fpmod._native, fpmod._native_resolved = saved


def _alternate(methods: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each method: one warm-up call each, then ``rounds`` alternated rounds."""
    times: dict[str, list[float]] = {k: [] for k in methods}
    for fn in methods.values():
        fn()
    for _ in range(rounds):
        for name, fn in methods.items():
            times[name].append(_time(fn))
    return times


def fingerprint_throughput(mib: int, rounds: int) -> dict[str, Any]:
    """GiB/s of each way to summarise the same float32 tensor, alternated round by round."""
    x = torch.randn(mib * 1024 * 1024 // 4)
    nbytes = x.numel() * 4
    mv = memoryview(x.numpy()).cast("B")
    methods: dict[str, Callable[[], object]] = {
        "torch.sum (one read pass)": lambda: float(x.sum()),
        "sdc_guard.fingerprint (torch ops: no C compiler)":
            lambda: _on_path(False, lambda: fingerprint(x)),
        "torch.hash_tensor (XOR, order-blind)": lambda: torch.hash_tensor(x).view(torch.int64).item(),
        "sha256 over the bytes": lambda: hashlib.sha256(mv).digest(),
    }
    try:
        import xxhash

        methods["xxh3_64 over the bytes"] = lambda: xxhash.xxh3_64_intdigest(mv)
    except ImportError:  # pragma: no cover - xxhash is in the dev extra
        pass
    if fpmod.native_enabled():
        methods["sdc_guard.fingerprint (C kernel, the default)"] = (
            lambda: _on_path(True, lambda: fingerprint(x)))
    times = _alternate(methods, rounds)
    base = statistics.median(times["torch.sum (one read pass)"])
    out: dict[str, Any] = {"tensor_mib": mib, "threads": torch.get_num_threads(), "methods": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        out["methods"][name] = {
            "median_s": med,
            "gib_per_s": nbytes / med / GIB,
            "ratio_to_sum": base / med,
        }
    out["many_small"] = many_small_tensors(rounds)
    return out


def many_small_tensors(rounds: int) -> dict[str, Any]:
    """Microseconds per tensor for a model's many small tensors, batched against one by one.

    800 tensors like a transformer's biases, norm weights, their two AdamW moments and
    step counters (200 each of 1024, 1024, 1024 float32 and one scalar).
    """
    tensors: list[torch.Tensor] = []
    for i in range(200):
        tensors += [torch.randn(1024), torch.randn(1024), torch.rand(1024),
                    torch.tensor(float(i))]
    cpu = torch.device("cpu")
    methods: dict[str, Callable[[], object]] = {
        "values batched (the default for a list)": lambda: fpmod._values(tensors, cpu),
        "values one tensor at a time": lambda: torch.stack(
            [fpmod._tensor_value(t) for t in tensors]),
        "torch.sum of each tensor": lambda: torch.stack([t.sum() for t in tensors]),
        "fingerprint_tensor of the list": lambda: fingerprint_tensor(tensors).item(),
    }
    times = _alternate(methods, rounds * 3)
    return {"tensors": len(tensors),
            "us_per_tensor": {k: statistics.median(v) / len(tensors) * 1e6
                              for k, v in times.items()}}


Rounds = dict[str, list[list[float]]]
"""Per configuration, per round, the samples measured in that round."""


def _interval(rounds: Rounds, stat: Callable[[dict[str, list[float]]], float],
              n: int = 1000) -> tuple[float, float]:
    """A 90% bootstrap interval of ``stat`` over the measurement rounds.

    The configurations alternate inside a round, so a round is the unit of
    resampling: each resample pools the samples of randomly drawn rounds and applies
    the same ``stat`` as the headline number. Seeded, so reproducible.
    """
    rng = random.Random(0)
    count = len(next(iter(rounds.values())))
    stats = []
    for _ in range(n):
        pick = [rng.randrange(count) for _ in range(count)]
        pooled = {k: [x for i in pick for x in v[i]] for k, v in rounds.items()}
        try:
            stats.append(stat(pooled))
        except (ZeroDivisionError, statistics.StatisticsError):
            continue
    stats.sort()
    return stats[int(0.05 * len(stats))], stats[int(0.95 * len(stats)) - 1]


def _rounds(samples: list[Any], rounds: int) -> list[list[Any]]:
    per = len(samples) // rounds
    return [samples[i * per:(i + 1) * per] for i in range(rounds)]


# -- per-check overhead ---------------------------------------------------------------------
NF_SCALE = "nonfinite: DDP's 1/world scaling pass alone (paid anyway)"
NF_FUSED = "nonfinite: the same pass with the local check fused in"
NF_RED = ("nonfinite: reduced-result check (one read pass), right after the all-reduce, "
          "where the guard runs it")
NF_WORD = "nonfinite: flags word sent, the previous step's collected"
GUARD_OFF = "guard, all checks off"
NF_EVERY = "nonfinite, flags sent every step (exchange interval 1)"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "plain DDP": None,
    GUARD_OFF: {"nonfinite": False, "weights_interval": 0},
    "nonfinite": {"nonfinite": True, "weights_interval": 0},
    NF_EVERY: {"nonfinite": True, "weights_interval": 0, "nonfinite_exchange_interval": 1},
    "weights (+ AdamW state)": {"nonfinite": False, "weights_interval": 1},
    "nonfinite + weights": {"nonfinite": True, "weights_interval": 1},
}


INSTANCES = 3
"""Model instances of each kind, used in turn round by round (the round counts in ``main``
are multiples of it). Two instances of the same model can differ in speed by 1-2%
(where their memory landed), as much as the cheapest check costs: with every
configuration of a kind on one instance and the instances rotated, that difference
neither biases a comparison nor hides from the bootstrap intervals."""


def _set_checks(guard: SDCGuard, *, nonfinite: bool, weights_interval: int,
                replay_interval: int = 0,
                nonfinite_exchange_interval: int = GuardConfig().nonfinite_exchange_interval,
                ) -> None:
    """Switch the guard's checks for the next steps: the benchmark alternates them on one model."""
    guard.config.nonfinite = nonfinite
    guard.comm.check_nonfinite = nonfinite
    guard.config.nonfinite_exchange_interval = nonfinite_exchange_interval
    guard.nonfinite.exchange_interval = nonfinite_exchange_interval
    guard.config.weights_interval = weights_interval
    if replay_interval and guard.replay is None:
        raise ValueError("_set_checks: this guard was built without the replay audit")
    guard.config.replay_interval = replay_interval


Runner = Callable[[str, int], Callable[[int], object]]


def _reference_runs(rank: int, batch: int) -> tuple[list[SDCGuard], Runner]:
    """``INSTANCES`` plain DDP loops and guarded models of the reference scenario: the
    guards, and ``runner(config name, instance)``, the step function with that ``CONFIGS``
    entry set (a plain loop for "plain DDP")."""
    batch_for = functools.partial(classification_batch, batch=batch, d_in=512, n_out=10)
    plains: list[Callable[[int], None]] = []
    guards: list[SDCGuard] = []
    for _ in range(INSTANCES):
        model = DDP(reference_mlp())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def plain(step: int, model: DDP = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            cross_entropy_loss(model, batch_for(rank, step)).backward()
            opt.step()

        plains.append(plain)
        gmodel = DDP(reference_mlp())
        gopt = torch.optim.AdamW(gmodel.parameters(), lr=1e-3)
        guards.append(SDCGuard(gmodel, gopt, loss_fn=cross_entropy_loss, batch_for=batch_for))

    def runner(name: str, i: int) -> Callable[[int], object]:
        cfg = CONFIGS[name]
        if cfg is None:
            return plains[i]
        _set_checks(guards[i], **cfg)
        return guards[i].step

    return guards, runner


def _overhead_rank(rank: int, world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    guards, runner = _reference_runs(rank, batch)

    params = sum(p.numel() for p in reference_mlp().parameters())
    times: dict[str, list[float]] = {k: [] for k in CONFIGS}
    cpu: dict[str, list[float]] = {k: [] for k in CONFIGS}
    step = 0
    for i in range(INSTANCES):  # warm-up: Adam state exists, caches are hot
        for name in CONFIGS:
            for _ in range(2):
                runner(name, i)(step)
                step += 1
    direct: dict[str, list[float]] = {"weights verdict": [],
                                       "weights check, local fingerprint only": [],
                                       "fingerprint of the same bytes (one flat tensor)": [],
                                       "all_gather of 8 bytes": [],
                                       "flat fingerprint, then all_gather of its 8 bytes": [],
                                       NF_SCALE: [], NF_FUSED: [], NF_RED: [],
                                       NF_WORD: []}
    wg = guards[0]
    _set_checks(wg, nonfinite=False, weights_interval=1)
    flat = torch.cat([t.reshape(-1).float() for t in state_tensors(wg.model, wg.optimizer)])
    word = torch.zeros(1, dtype=torch.int64)
    grads = torch.cat([p.detach().reshape(-1) for p in wg.model.parameters()])
    reduced = torch.zeros_like(grads)  # all-reduced again and again: zeros stay finite
    sent: list[PendingSum] = []

    def send_and_collect() -> None:  # what NonFiniteCheck.verdict does on a clean step
        sent.append(PendingSum(torch.tensor(flag_words((False, False), rank, world),
                                            dtype=torch.int64)))
        if len(sent) > 1:
            sent.pop(0).wait_all()
    names = list(CONFIGS)
    for r in range(rounds):
        # The order rotates round by round: no configuration always follows another.
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = runner(name, r % INSTANCES)
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
            direct["weights verdict"].append(_time(lambda: wg.weights.verdict(0, word.device)))
            dist.barrier()
            direct["weights check, local fingerprint only"].append(
                _time(lambda: wg.weights.local_fingerprint().item()))
            dist.barrier()
            direct["fingerprint of the same bytes (one flat tensor)"].append(
                _time(lambda: fingerprint_tensor(flat).item()))
            dist.barrier()
            outs = [torch.empty_like(word) for _ in range(world)]
            direct["all_gather of 8 bytes"].append(
                _time(functools.partial(dist.all_gather, outs, word)))
            dist.barrier()
            direct["flat fingerprint, then all_gather of its 8 bytes"].append(
                _time(lambda o=outs: dist.all_gather(o, fingerprint_tensor(flat).reshape(1))))
            dist.barrier()
            # Scale by -1: the same work as 1/world without drifting the values.
            direct[NF_SCALE].append(_time(lambda: grads.mul_(-1.0)))
            dist.barrier()
            direct[NF_FUSED].append(_time(lambda: bool(_scale_and_check(grads, -1.0))))
            dist.barrier()
            dist.all_reduce(reduced)  # the guard reads the result in the all-reduce's callback
            direct[NF_RED].append(_time(lambda: bool(_check(reduced))))
            dist.barrier()
            direct[NF_WORD].append(_time(send_and_collect))
    per_round = {k: _rounds(v, rounds) for k, v in times.items()}
    result = {
        "params": params,
        "overhead_interval_90": {
            k: _interval(per_round, lambda m, k=k: statistics.median(m[k])
                         / statistics.median(m["plain DDP"]) - 1.0)
            for k in times if k != "plain DDP"},
        "vs_guard_off_interval_90": {
            k: _interval(per_round, lambda m, k=k: statistics.median(m[k])
                         / statistics.median(m[GUARD_OFF]) - 1.0)
            for k in times if CONFIGS[k] is not None and k != GUARD_OFF},
        "state_bytes": flat.numel() * 4,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "direct_s": {k: statistics.median(v) for k, v in direct.items()},
    }
    return result


BLOCK_CONFIGS = ("plain DDP", GUARD_OFF, "nonfinite", NF_EVERY)


def _blocks_rank(rank: int, world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    """Step time as a training loop sees it: blocks of ``block`` steps timed as a whole,
    with no barrier between the steps (a barrier per step adds two meeting points of its
    own, and lines the ranks' phases up); the configurations rotate round by round."""
    guards, runner = _reference_runs(rank, batch)

    names = list(BLOCK_CONFIGS)
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = runner(name, r % INSTANCES)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                run(step)
                step += 1
            c1 = time.process_time()
            dist.barrier()
            if r:
                times[name].append((time.perf_counter() - t0) / block)
                cpu[name].append((c1 - c0) / block)
    for g in guards:
        g.flush()
    per_round = {k: [[v] for v in vs] for k, vs in times.items()}

    def ratio(m: dict[str, list[float]], k: str) -> float:
        return statistics.median(a / b for a, b in zip(m[k], m[GUARD_OFF], strict=True)) - 1.0

    return {
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "vs_guard_off": {k: ratio(times, k) for k in names if k != GUARD_OFF},
        "vs_guard_off_interval_90": {k: _interval(per_round, lambda m, k=k: ratio(m, k))
                                     for k in names if k != GUARD_OFF},
        "cpu_vs_guard_off": {k: ratio(cpu, k) for k in names if k != GUARD_OFF},
    }


def check_overhead_blocks(world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    res = run_ranks(_blocks_rank, world, rounds, block, batch, timeout=1800)[0]
    res.update({"world": world, "batch": batch, "rounds": rounds, "block": block})
    return res


REPLAY_INTERVALS = (1, 2, 5, 10, 50)


def _replay_rank(rank: int, world: int, rounds: int, batch: int,
                 native: bool = True, nonfinite: bool = True) -> dict[str, Any]:
    """Step time with the replay audit at several intervals, beside replay off and the ideal.

    ``nonfinite``: the non-finite check runs in every configuration (replay off and the
    ideal too), as with the guard's default configuration; on audit steps the replay's
    words then share its gather. ``False``: the replay alone, with a gather of its own.

    The ideal of interval k is a real run, alternated with the others: replay off, plus
    one plain forward+backward of the neighbour's batch at the start of every k-th step
    (what the audit must at least do), so it meets the same contention and the same
    synchronisation pattern as the audit. The cost per step is estimated from the
    medians of the audit (or extra) steps and of the other steps (see
    ``extra_per_step``), for the audit and the ideal alike.
    """
    if not native:
        fpmod.disable_native()
    native_in_use = fpmod.native_enabled()
    d_in, n_out = 512, 10
    batch_for = functools.partial(classification_batch, batch=batch, d_in=d_in, n_out=n_out)
    configs = {"off": (0, 0, False), **{f"audit {k}": (k, 0, False) for k in REPLAY_INTERVALS},
               **{f"ideal {k}": (0, k, False) for k in REPLAY_INTERVALS}}
    if world > 1:
        configs.update({f"agree {k}": (0, k, True) for k in REPLAY_INTERVALS})
    """name -> (replay interval, interval of the ideal's extra forward+backward, whether the
    ideal also agrees on an 8-byte word before the optimizer step, as an audit must)"""
    guards: list[SDCGuard] = []
    extra_every = [0]
    agree_on = [False]
    agreeing: list[PendingSum] = []

    def wait_agreeing(_: SDCGuard) -> None:
        for p in agreeing:
            p.wait()
    for _ in range(INSTANCES):
        model = DDP(reference_mlp())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=GuardConfig(nonfinite=nonfinite, weights_interval=0,
                                        deterministic=True, replay_interval=1),
                     before_optimizer_step=wait_agreeing)
        module = model.module
        params = [p for p in module.parameters() if p.requires_grad]
        pending_agree = [False]

        def extra(step: int, module: torch.nn.Module = module,
                  params: list[torch.Tensor] = params, pending: list[bool] = pending_agree) -> None:
            agreeing.clear()
            every = extra_every[0]
            if every and step % every == 0:
                loss = cross_entropy_loss(module, batch_for((rank + 1) % world, step))
                torch.autograd.grad(loss, params)
                pending[0] = agree_on[0]

        def send(pending: list[bool] = pending_agree) -> None:
            # Where the audit starts its word: in the last gradient all-reduce's shadow.
            if pending[0]:
                pending[0] = False
                agreeing.append(PendingSum(torch.zeros(1, dtype=torch.int64)))

        g.before_step.append(extra)
        g.comm.before_last_allreduce.append(send)
        guards.append(g)

    def runner(name: str, i: int) -> SDCGuard:
        replay, ideal, agree = configs[name]
        _set_checks(guards[i], nonfinite=nonfinite, weights_interval=0, replay_interval=replay)
        extra_every[0] = ideal
        agree_on[0] = agree
        return guards[i]

    module = reference_mlp()
    params = list(module.parameters())
    steps = {k: 0 for k in configs}
    times: dict[str, list[float]] = {k: [] for k in configs}
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    thread: dict[str, list[float]] = {k: [] for k in configs}
    step_ids: dict[str, list[int]] = {k: [] for k in configs}
    fwd_bwd: list[float] = []
    for i in range(INSTANCES):  # warm-up
        for name in configs:
            runner(name, i).step(1)
    every = {name: int(name.split()[1]) if " " in name else 1 for name in configs}
    # At least 4 audit (or extra) steps per block, so every interval gets the same count.
    per_block = {name: max(10, 4 * every[name]) for name in configs}
    for r in range(rounds):
        for name in configs:
            g = runner(name, r % INSTANCES)
            for _ in range(per_block[name]):
                dist.barrier()
                t0 = time.perf_counter()
                c0 = time.process_time()
                h0 = time.thread_time()
                g.step(steps[name])
                h1 = time.thread_time()
                c1 = time.process_time()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(c1 - c0)
                thread[name].append(h1 - h0)
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

    tagged = {k: list(zip(step_ids[k], times[k], strict=True)) for k in configs}
    ctagged = {k: list(zip(step_ids[k], cpu[k], strict=True)) for k in configs}
    htagged = {k: list(zip(step_ids[k], thread[k], strict=True)) for k in configs}
    off = statistics.median(times["off"])
    coff = statistics.median(cpu["off"])
    fb = statistics.median(fwd_bwd)
    out: dict[str, Any] = {"step_s_replay_off": off, "forward_backward_s": fb,
                           "step_cpu_s_replay_off": coff, "native_kernel": native_in_use,
                           "steps_per_config": len(times["off"]), "rounds": rounds,
                           "intervals": {}}
    per_round = {k: _rounds(v, rounds) for k, v in tagged.items()}
    for k in REPLAY_INTERVALS:
        a, i = f"audit {k}", f"ideal {k}"
        audit, ideal = extra_per_step(tagged, a), extra_per_step(tagged, i)
        sub = {n: per_round[n] for n in ("off", a, i)}
        g = f"agree {k}"
        if g in configs:
            sub_g = {n: per_round[n] for n in ("off", a, g)}
            out.setdefault("agree", {})[str(k)] = {
                "per_audit_step_ratio": per_hit(tagged, a) / per_hit(tagged, g),
                "per_audit_step_ratio_interval_90": _interval(
                    sub_g, lambda m, a=a, g=g: per_hit(m, a) / per_hit(m, g)),
                "agree_step_extra_s": per_hit(tagged, g),
            }
        out["intervals"][str(k)] = {
            "per_audit_step_ratio": per_hit(tagged, a) / per_hit(tagged, i),
            "per_audit_step_ratio_interval_90": _interval(
                sub, lambda m, a=a, i=i: per_hit(m, a) / per_hit(m, i)),
            "per_audit_step_thread_cpu_ratio": per_hit(htagged, a) / per_hit(htagged, i),
            "audit_step_extra_s": per_hit(tagged, a),
            "ideal_step_extra_s": per_hit(tagged, i),
            "audit_rest_vs_off_s": rest_vs_off(tagged, a),
            "audit_rest_vs_off_interval_90": _interval(sub, lambda m, a=a: rest_vs_off(m, a)),
            "ideal_rest_vs_off_s": rest_vs_off(tagged, i),
            "ratio_to_ideal_interval_90": _interval(
                sub, lambda m, a=a, i=i: extra_per_step(m, a) / extra_per_step(m, i)),
            "step_s": off + audit,
            "ideal_step_s": off + ideal,
            "overhead": audit / off,
            "ideal_overhead": ideal / off,
            "ratio_to_ideal": audit / ideal,
            "formula_overhead": fb / k / off,
            "ratio_to_formula": audit / (fb / k),
            "cpu_ratio_to_ideal": extra_per_step(ctagged, a) / extra_per_step(ctagged, i),
        }
    return out


def replay_overhead(world: int, rounds: int, batch: int, native: bool = True,
                    nonfinite: bool = True) -> dict[str, Any]:
    res = run_ranks(_replay_rank, world, rounds, batch, native, nonfinite, timeout=3600)[0]
    res.update({"world": world, "batch": batch, "nonfinite": nonfinite})
    return res


def check_overhead(world: int, rounds: int, block: int, batch: int) -> dict[str, Any]:
    res = run_ranks(_overhead_rank, world, rounds, block, batch, timeout=1800)[0]
    base = res["step_s"]["plain DDP"]
    res["overhead_vs_plain_ddp"] = {k: v / base - 1.0 for k, v in res["step_s"].items()}
    cbase = res["step_cpu_s"]["plain DDP"]
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


# -- report ---------------------------------------------------------------------------------
def _overhead_md(ov: dict[str, Any], *, reference: bool) -> list[str]:
    lines = ["", f"## Step-time overhead: {ov['world']} ranks x 1 thread, MLP of "
             f"{ov['params']/1e6:.2f}M parameters, batch {ov['batch']}, AdamW", "",
             "Wall time is the target metric; CPU time (the rank's process, all threads) is the "
             "work the check adds, without the waits.", "",
             f"Plain DDP and the guard run on separate models; the guard's configurations "
             f"share one, switched block by block; {INSTANCES} instances of each are used in "
             "turn, round by round, so that the speed difference between two instances of the "
             "same model (1-2% here) is sampled by the intervals rather than hidden in them. "
             "The order of the configurations rotates round by round. "
             "The last column compares each check with the guard's own model, checks off.", "",
             "| configuration | median step (ms) | overhead vs plain DDP | 90% interval (bootstrap "
             "over rounds) | median CPU per step (ms) | CPU overhead | vs guard, checks off "
             "(90% interval) |",
             "|---|---|---|---|---|---|---|"]
    for name, s in ov["step_s"].items():
        lo, hi = ov["overhead_interval_90"].get(name, (0.0, 0.0))
        same = ""
        if name in ov.get("overhead_vs_guard_off", {}):
            glo, ghi = ov["vs_guard_off_interval_90"][name]
            same = (f"{ov['overhead_vs_guard_off'][name]*100:+.1f}% "
                    f"({glo*100:+.1f}% .. {ghi*100:+.1f}%)")
        lines.append(f"| {name} | {s*1e3:.2f} | {ov['overhead_vs_plain_ddp'][name]*100:+.1f}% | "
                     f"{lo*100:+.1f}% .. {hi*100:+.1f}% | {ov['step_cpu_s'][name]*1e3:.2f} | "
                     f"{ov['cpu_overhead_vs_plain_ddp'][name]*100:+.1f}% | {same} |")
    d = ov["direct_s"]
    lines += ["", "Parts measured directly (after a barrier; parameters + AdamW state = "
              f"{ov['state_bytes']/2**20:.1f} MiB):", "", "| part | median (ms) |", "|---|---|"]
    for name, s in d.items():
        lines.append(f"| {name} | {s*1e3:.3f} |")
    target = " (target <= 2%)" if reference else ""
    lines += ["", "nonfinite, measured directly (the fused pass minus the scaling pass, the "
              "reduced-result check, and sending the flags word, once every "
              f"{ov.get('nonfinite_exchange_interval', 1)} steps) = "
              f"**{ov['nonfinite_direct_fraction_of_plain_step']*100:.1f}%** of a plain DDP step"
              f"{target}; in step time **{ov['overhead_vs_plain_ddp']['nonfinite']*100:+.1f}%**"
              " vs plain DDP and "
              f"**{ov['overhead_vs_guard_off']['nonfinite']*100:+.1f}%** vs the guard with its "
              "checks off (same model), in CPU time "
              f"**{ov['cpu_overhead_vs_plain_ddp']['nonfinite']*100:+.1f}%**."]
    if NF_EVERY in ov["overhead_vs_guard_off"]:
        lines += ["With its flags sent every step (`nonfinite_exchange_interval=1`: a word nobody "
                  "waits for, but a collective all the same): "
                  f"**{ov['overhead_vs_guard_off'][NF_EVERY]*100:+.1f}%** vs the guard with its "
                  "checks off."]
    lines.append("")
    bl = ov.get("blocks")
    if bl:
        lines += [f"Timed as a training loop runs: blocks of {bl['block']} steps with no barrier "
                  f"between the steps, {bl['rounds']} rounds, the order rotating; the median over "
                  "rounds of each round's ratio to the guard with its checks off (a barrier per "
                  "step, as in the table above, adds two meeting points per step and lines the "
                  "ranks' phases up, which on 3 ranks sharing 2 cores magnifies any extra work):",
                  "", "| configuration | median step (ms) | vs guard, checks off | 90% interval "
                  "(bootstrap over rounds) | CPU vs guard, checks off |", "|---|---|---|---|---|"]
        for name, sec in bl["step_s"].items():
            if name == GUARD_OFF:
                lines.append(f"| {name} | {sec*1e3:.2f} | | | |")
                continue
            lo, hi = bl["vs_guard_off_interval_90"][name]
            lines.append(f"| {name} | {sec*1e3:.2f} | **{bl['vs_guard_off'][name]*100:+.1f}%** | "
                         f"{lo*100:+.1f}% .. {hi*100:+.1f}% | "
                         f"{bl['cpu_vs_guard_off'][name]*100:+.1f}% |")
        lines.append("")
    target = " (target <= 1.5x)" if reference else ""
    lines += ["weights verdict / (fingerprint then all_gather, timed as one) = "
              f"**{ov['weights_cost_ratio_to_timed_ideal']:.2f}x**{target}; / (sum of the two "
              f"medians) = {ov['weights_cost_ratio']:.2f}x; (local fingerprint + all_gather) / "
              f"(flat fingerprint + all_gather) = {ov['weights_local_cost_ratio']:.2f}x.", ""]
    return lines


def _replay_md(rp: dict[str, Any]) -> list[str]:
    kernel = "" if rp.get("native_kernel") else ", digests on the torch path (no C kernel)"
    checks = ("the non-finite check on in every configuration" if rp.get("nonfinite", False)
              else "the replay alone")
    lines = [f"## Replay audit overhead ({rp['world']} rank(s), batch {rp['batch']}, {checks}, "
             f"{rp.get('rounds', rp['steps_per_config'] // 10)} rounds, alternated{kernel})", "",
             f"Replay off: {rp['step_s_replay_off']*1e3:.2f} ms/step (median) "
             f"({rp['step_cpu_s_replay_off']*1e3:.2f} ms CPU). Ideal run: replay off plus one "
             "plain forward+backward of the neighbour's batch every k steps, alternated with the "
             "others. Every configuration runs on the same model, switched block by block "
             f"({INSTANCES} instances used in turn, round by round). For reference, one "
             "forward+backward timed alone: "
             f"{rp['forward_backward_s']*1e3:.2f} ms. Interval k runs blocks of max(10, 4k) "
             "steps, so every interval has the same number of audit (or extra) steps.", "",
             "**Per audit step** (the target: what an audit adds beyond its recomputation): the "
             "extra time of an audit step over the other steps of the same configuration "
             "(over \"off\" for k = 1), against the same for the ideal's extra "
             "forward+backward. Comparing steps within one configuration keeps the noise "
             "between configurations out, which at long intervals is larger than the whole "
             "effect. The main-thread CPU column is the same ratio in the rank's main-thread "
             "CPU time: the work an audit adds, without the waits of 3 ranks sharing 2 cores. "
             "The last column checks the premise: the audit configuration's other "
             "steps cost what \"off\" costs.", "",
             "| interval | audit step extra (ms) | ideal step extra (ms) | **measured / ideal, per "
             "audit step** | 90% interval (bootstrap over rounds) | main-thread CPU, measured / "
             "ideal | audit's other steps vs off (ms, 90% interval) |",
             "|---|---|---|---|---|---|---|"]
    for k, r in rp["intervals"].items():
        lo, hi = r["per_audit_step_ratio_interval_90"]
        rlo, rhi = r["audit_rest_vs_off_interval_90"]
        rest = ("-" if k == "1" else f"{r['audit_rest_vs_off_s']*1e3:+.2f} "
                f"({rlo*1e3:+.2f} .. {rhi*1e3:+.2f})")
        lines.append(f"| {k} | {r['audit_step_extra_s']*1e3:.2f} | "
                     f"{r['ideal_step_extra_s']*1e3:.2f} | **{r['per_audit_step_ratio']:.2f}** | "
                     f"{lo:.2f} .. {hi:.2f} | "
                     f"{r.get('per_audit_step_thread_cpu_ratio', float('nan')):.2f} | {rest} |")
    if rp.get("agree"):
        lines += ["", "The audit must also agree before the optimizer step: one small all-reduce "
                  "per audit step, the only collective the guard's default checks make before "
                  "it (the non-finite check contains without one). On this machine, where 3 "
                  "ranks share 2 cores, any collective costs a few ms of wall time. The same "
                  "ratio against the ideal plus that agreement (the ideal's extra step also "
                  "starts an 8-byte all-reduce before its last gradient all-reduce and waits "
                  "for it before the optimizer step):", "",
                  "| interval | ideal + agreement, step extra (ms) | measured / (ideal + "
                  "agreement), per audit step | 90% interval |", "|---|---|---|---|"]
        for k, r in rp["agree"].items():
            lo, hi = r["per_audit_step_ratio_interval_90"]
            lines.append(f"| {k} | {r['agree_step_extra_s']*1e3:.2f} | "
                         f"{r['per_audit_step_ratio']:.2f} | {lo:.2f} .. {hi:.2f} |")
    lines += ["", "Per step, over the whole run (robust means: the median of the audit (or "
              "extra) steps and of the other steps, weighted 1/k and (k-1)/k, so that this "
              "machine's occasional 100 ms stalls do not swamp effects of 1%; at long "
              "intervals the difference between two configurations' other steps, pure noise "
              "here, outweighs the audit):", "",
              "| interval | audit step (ms) | audit overhead | ideal step (ms) | ideal overhead "
              "| measured / ideal | 90% interval (bootstrap over rounds) | CPU measured / ideal "
              "| measured / (fwd+bwd alone / k) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for k, r in rp["intervals"].items():
        lo, hi = r["ratio_to_ideal_interval_90"]
        lines.append(f"| {k} | {r['step_s']*1e3:.2f} | {r['overhead']*100:+.1f}% | "
                     f"{r['ideal_step_s']*1e3:.2f} | {r['ideal_overhead']*100:+.1f}% | "
                     f"{r['ratio_to_ideal']:.2f} | {lo:.2f} .. {hi:.2f} | "
                     f"{r['cpu_ratio_to_ideal']:.2f} | {r['ratio_to_formula']:.2f} |")
    lines.append("")
    return lines


def _markdown(results: dict[str, Any]) -> str:
    lines = [f"# Benchmark results ({results['machine']})", "",
             "Produced by `nox -s bench` (`python -m scenarios.bench`). Medians of alternated "
             "repetitions in one run.", ""]
    fp = results["fingerprint"]
    lines += [f"## Fingerprint throughput: {fp['tensor_mib']} MiB float32, "
              f"{fp['threads']} threads", "",
              "| method | GiB/s | ratio to torch.sum |", "|---|---|---|"]
    for name, m in fp["methods"].items():
        lines.append(f"| {name} | {m['gib_per_s']:.2f} | {m['ratio_to_sum']:.2f} |")
    small = fp.get("many_small")
    if small:
        lines += ["", f"Many small tensors ({small['tensors']}: a model's biases, norms, their "
                  "AdamW moments and step counters), 1 list, microseconds per tensor:", "",
                  "| method | us per tensor |", "|---|---|"]
        lines += [f"| {k} | {v:.2f} |" for k, v in small["us_per_tensor"].items()]
    lines += _overhead_md({**results["overhead"], "blocks": results.get("overhead_blocks")},
                          reference=True)
    if results.get("replay"):
        lines += _replay_md(results["replay"])
    if results.get("replay_alone"):
        lines += ["## The replay audit alone", "",
                  "The same, with the non-finite check off everywhere: the audit's words then "
                  "need a gather of their own (started in the comm hook before the last gradient "
                  "all-reduce), one more synchronisation point on audit steps.", ""]
        lines += _replay_md(results["replay_alone"])
    if results.get("overhead_world2"):
        lines += ["## The same with 2 ranks on the 2 cores (no oversubscription)", "",
                  "With 3 ranks on 2 cores every synchronisation point makes the ranks' next "
                  "compute phases collide, which costs wall time that is not work. These runs "
                  "show the checks without that effect.", ""]
        lines += _overhead_md(results["overhead_world2"], reference=False)
        if results.get("replay_world2"):
            lines += _replay_md(results["replay_world2"])
    if results.get("replay_world1"):
        lines += ["## The audit's own cost: one rank alone", "",
                  "A single rank replays its own batch (the ring of one): no other process "
                  "competes for the cores and no rank waits for another, so this is the work the "
                  "audit adds, against one forward+backward.", ""]
        lines += _replay_md(results["replay_world1"])
    fallback = [k for k in ("replay_world1_torch",)
                if k in results and not results[k].get("native_kernel")]
    if fallback:
        lines += ["## The same audit on the torch path", "",
                  "`SDC_GUARD_NATIVE=0` (what a machine without a C compiler runs): the "
                  "gradient digests take torch ops instead of the C kernel.", ""]
    for key in fallback:
        lines += _replay_md(results[key])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller tensor")
    ap.add_argument("--out", default="bench", help="directory for results.json and RESULTS.md")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
                   f"torch {torch.__version__}",
        "quick": args.quick,
    }
    results["fingerprint"] = fingerprint_throughput(64 if args.quick else 256,
                                                    3 if args.quick else 9)
    print(json.dumps(results["fingerprint"], indent=1))
    q = args.quick
    runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("overhead", lambda: check_overhead(3, rounds=3 if q else 24, block=3 if q else 8,
                                            batch=128)),
        ("overhead_blocks", lambda: check_overhead_blocks(3, rounds=4 if q else 48,
                                                          block=8 if q else 24, batch=128)),
        ("replay", lambda: replay_overhead(3, rounds=3 if q else 12, batch=128)),
        ("replay_alone", lambda: replay_overhead(3, rounds=3 if q else 12, batch=128,
                                                 nonfinite=False)),
        ("overhead_world2", lambda: check_overhead(2, rounds=3 if q else 6, block=3 if q else 8,
                                                   batch=128)),
        ("replay_world2", lambda: replay_overhead(2, rounds=3 if q else 12, batch=128)),
        ("replay_world1", lambda: replay_overhead(1, rounds=3 if q else 12, batch=128)),
        ("replay_world1_torch", lambda: replay_overhead(1, rounds=3 if q else 12, batch=128,
                                                        native=False)),
    ]
    for key, measure in runs:
        results[key] = measure()
        print(json.dumps(results[key], indent=1))
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "RESULTS.md").write_text(_markdown(results))
    print((out / "RESULTS.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
