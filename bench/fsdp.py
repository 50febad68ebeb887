"""``python -m bench.fsdp`` (``nox -s fsdp_bench``): the guard's cost over plain FSDP2, beside DDP.

The harness's Llama-style model (``scenarios.spec.models``, kind "llama") on 2 gloo ranks,
trained by plain FSDP2 (``fully_shard`` per block and the root), by the guard on FSDP2 with
its checks off, with each check alone and with the defaults; and by plain DDP and the guard
with the defaults on DDP, the same model and batches. Each configuration has a model of its
own, built alike; the configurations alternate step block by step block, their order
rotating round by round, and a barrier brackets every step. The replay audit's
configuration switches torch's deterministic algorithms on for the whole process, so every
configuration runs with them (side by side alike; on the CPU they change little). Medians
per configuration, the ratio of each to its plain baseline and a 90% bootstrap interval
over the rounds (``bench.timing``).

Two ranks share two cores, so a step's wall time carries the other rank's noise (each waits
for the other in every collective, and a core's speed depends on what the other runs) and
the intervals stay a few percent wide: wider than the targets of the guard with its checks
off and of the non-finite check alone. Those two are therefore also measured directly: in
a second two-rank run of the same model, each guarded step is traced, and the time spent
in the work plain FSDP2 does (fetching the batch, the loss function's forward, the
backward from its first gradient to its end, ``zero_grad`` and the optimizer step) is taken
from the step's wall time; the guard's hooks inside the backward (its reduce-scatter
wrapper and what the checks do there, less the reduce-scatter itself) are added back. What
is left is the guard's own time, the wait in any collective of its own included (where
the ranks meet there, the faster waits for the slower: charged to the guard, although
plain FSDP2 would wait as long at its next meeting point). The plain loop is traced alike
(what is left there: its own lines and the ``backward()`` call around the engine), and the
guard's extra is the difference. The non-finite check's veto rides FSDP2's last
reduce-scatter of the step and sends nothing of its own; the word that the replay audit's
and the checksum's vetoes travel in (one int64 all-reduce) is timed alone (a barrier, then
the all-reduce) in the first run. A third run times the replay audit per audit step against
its ideal (``audit``), as ``bench.replay`` does under DDP, and two more the weights check's
verdict per step against its ideal (``weights_verdict``: at rest on FSDP 2, voted on HSDP
2x2), as ``bench`` does under DDP. Results go to
``bench/fsdp.json`` and ``bench/FSDP.md``::

    python -m bench.fsdp [--rounds N] [--block N] [--batch N] [--direct-steps N]
                         [--audit-rounds N] [--checksum-rounds N] [--launches N] [--out bench]

The checksum's budget is set under DDP over launches of new rank processes
(``bench.checksum``); its last run here does the same under FSDP2 (``checksum_launches``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.checksum import DEFAULTS, DEFAULTS_CHECKSUM, PAIR, launch_stats
from bench.reference import classification_batch, cross_entropy_loss, reference_mlp
from bench.timing import bootstrap_interval, cpu_name, launch_rounds, publish, split_rounds
from scenarios.run.launch import run_ranks
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.sharding import shard_model
from sdc_guard import GuardConfig, SDCGuard, fingerprint_tensor, state_tensors
from sdc_guard.internal import fsdp_backend

OFF = GuardConfig(nonfinite=False, weights_interval=0)
CONFIGS: dict[str, tuple[str, GuardConfig | None]] = {
    "plain FSDP2": ("fsdp", None),
    "guard, checks off": ("fsdp", OFF),
    "guard, nonfinite alone": ("fsdp", GuardConfig(weights_interval=0)),
    "guard, weights alone (at rest)": ("fsdp", GuardConfig(nonfinite=False)),
    "guard, checksum alone": ("fsdp", GuardConfig(nonfinite=False, weights_interval=0,
                                                   checksum=True)),
    "guard, replay every 4 alone": ("fsdp", GuardConfig(nonfinite=False, weights_interval=0,
                                                         replay_interval=4, deterministic=True)),
    "guard, defaults": ("fsdp", GuardConfig()),
    "guard, defaults + checksum": ("fsdp", GuardConfig(checksum=True)),
    "plain DDP": ("ddp", None),
    "guard on DDP, defaults": ("ddp", GuardConfig()),
    "guard on DDP, defaults + checksum": ("ddp", GuardConfig(checksum=True)),
    "MLP: plain FSDP2": ("fsdp", None),
    "MLP: guard, defaults": ("fsdp", GuardConfig()),
    "MLP: guard, defaults + checksum": ("fsdp", GuardConfig(checksum=True)),
    "MLP: plain DDP": ("ddp", None),
    "MLP: guard on DDP, defaults": ("ddp", GuardConfig()),
    "MLP: guard on DDP, defaults + checksum": ("ddp", GuardConfig(checksum=True)),
}
"""Each configuration: its parallelism, and the guard's config (None: no guard)."""
BASELINE = {"fsdp": "plain FSDP2", "ddp": "plain DDP"}
OVER = {"guard, defaults + checksum": "guard, defaults",
        "guard on DDP, defaults + checksum": "guard on DDP, defaults",
        "MLP: plain FSDP2": "MLP: plain FSDP2",
        "MLP: guard, defaults": "MLP: plain FSDP2",
        "MLP: guard, defaults + checksum": "MLP: guard, defaults",
        "MLP: plain DDP": "MLP: plain DDP",
        "MLP: guard on DDP, defaults": "MLP: plain DDP",
        "MLP: guard on DDP, defaults + checksum": "MLP: guard on DDP, defaults"}
"""Configurations measured over another than their parallelism's plain baseline: the
checksum over the defaults, in the terms of its DDP budget (on the reference MLP too, the
model that budget is set on), and the MLP's configurations over its plain loops."""
MLP_BATCH = 128
"""The reference MLP's batch per rank (``bench.checksum``'s first workload)."""
SEED = 0


def baseline_of(name: str) -> str:
    return OVER.get(name, BASELINE[CONFIGS[name][0]])


def _runner(rank: int, world: int, parallel: str, config: GuardConfig | None,
            batch: int, width: int = 64, mlp: bool = False) -> Callable[[int], None]:
    """One step of one configuration, on a model of its own: the Llama-style model, or
    (``mlp``) the reference MLP on its classification batches."""
    if mlp:
        model = shard_model(reference_mlp(SEED), parallel=parallel, mesh_shape=(world,))
        loss_fn: Any = cross_entropy_loss

        def batch_for(r: int, step: int) -> Any:
            return classification_batch(r, step, batch=MLP_BATCH)
    else:
        model = shard_model(build_model("llama", width=width, depth=2, seed=SEED),
                            parallel=parallel, mesh_shape=(world,))
        loss_fn = scenario_loss

        def batch_for(r: int, step: int) -> Any:
            return synthetic_batch("llama", SEED, r, step, 0, batch=batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    if config is None:
        def plain(step: int) -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model, batch_for(rank, step)).backward()
            opt.step()
        return plain
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for, config=config)

    def guarded(step: int) -> None:
        guard.step(step)
    return guarded


WORD = "the control word's all-reduce"
"""The word's timing's key: one int64 per check whose veto travels in it."""


def _warm_up(runs: dict[str, Callable[[int], None]]) -> int:
    """Three steps of each configuration (optimizer state exists, caches are hot); the next
    step's number."""
    step = 0
    for run in runs.values():
        for _ in range(3):
            run(step)
            step += 1
    return step


def _bench_rank(rank: int, world: int, rounds: int, block: int,
                batch: int) -> dict[str, dict[str, list[float]]]:
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    runs = {name: _runner(rank, world, parallel, cfg, batch, mlp=name.startswith("MLP"))
            for name, (parallel, cfg) in CONFIGS.items()}
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    word = torch.zeros(1, dtype=torch.int64)
    words: list[float] = []
    step = _warm_up(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(block):
                dist.barrier()
                t0 = time.perf_counter()
                runs[name](step)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                step += 1
        for _ in range(block):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(word)
            words.append(time.perf_counter() - t0)
    return {"wall": times, "word": {WORD: words}}


DIRECT: dict[str, GuardConfig | None] = {
    "plain FSDP2": None,
    "guard, checks off": OFF,
    "guard, nonfinite alone": GuardConfig(weights_interval=0),
}
"""The configurations whose own time is traced."""


class _Trace:
    """Per step, the seconds spent in plain training's own work and in the guard's hooks
    inside the backward (``_own_rank``)."""

    def __init__(self) -> None:
        self.plain = 0.0
        self.hooks = 0.0
        self.backward_from: float | None = None

    def timed(self, fn: Callable[..., Any], into: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, into, getattr(self, into) + time.perf_counter() - t0)
        return call

    def backward_started(self, grad: torch.Tensor) -> None:
        self.backward_from = time.perf_counter()

    def backward_ended(self) -> None:
        if self.backward_from is not None:
            self.plain += time.perf_counter() - self.backward_from
            self.backward_from = None


def _own_rank(rank: int, world: int, steps: int, batch: int) -> dict[str, list[float]]:
    """The guard's own seconds in each of ``steps`` steps, per ``DIRECT`` configuration (the
    configurations alternating step by step after 5 warm-up steps each)."""
    torch.set_num_threads(1)
    trace = _Trace()
    inner = fsdp_backend._REDUCE_SCATTER

    def reduce_scatter(*args: Any, **kwargs: Any) -> Any:  # the collective is not the guard's
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            trace.hooks -= time.perf_counter() - t0

    fsdp_backend._REDUCE_SCATTER = reduce_scatter
    call = fsdp_backend._ReduceScatter.__call__
    fsdp_backend._ReduceScatter.__call__ = trace.timed(call, "hooks")  # type: ignore[method-assign]

    def loss_fn(model: Any, b: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = scenario_loss(model, b)
        trace.plain += time.perf_counter() - t0
        loss.register_hook(trace.backward_started)  # type: ignore[no-untyped-call]
        return loss

    guards: dict[str, Callable[[int], Any]] = {}
    for name, cfg in DIRECT.items():
        model = shard_model(build_model("llama", width=64, depth=2, seed=SEED),
                            parallel="fsdp", mesh_shape=(world,))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt.step = trace.timed(opt.step, "plain")  # type: ignore[method-assign]
        opt.zero_grad = trace.timed(opt.zero_grad, "plain")  # type: ignore[method-assign]

        def batch_for(r: int, step: int) -> Any:
            return synthetic_batch("llama", SEED, r, step, 0, batch=batch)

        fetch = trace.timed(batch_for, "plain")
        if cfg is None:  # the plain loop, traced alike: its own lines and backward() call
            def plain(step: int, model: Any = model, opt: Any = opt, fetch: Any = fetch) -> None:
                opt.zero_grad(set_to_none=True)
                loss_fn(model, fetch(rank, step)).backward()  # type: ignore[no-untyped-call]
                trace.backward_ended()
                opt.step()
            guards[name] = plain
            continue
        guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=fetch, config=cfg)
        after = guard.backend.after_backward
        reduced = guard.backend._reduced

        def after_backward(after: Callable[[], None] = after) -> None:
            trace.backward_ended()
            after()

        backend: Any = guard.backend  # (the FSDP2 backend; its hooks wrapped)
        backend.after_backward = after_backward
        backend._reduced = trace.timed(reduced, "hooks")
        guards[name] = guard.step
    own: dict[str, list[float]] = {n: [] for n in guards}
    step = 0
    for i in range(5 + steps):
        for name, run in guards.items():
            dist.barrier()
            trace.plain = trace.hooks = 0.0
            t0 = time.perf_counter()
            run(step)
            total = time.perf_counter() - t0
            step += 1
            if i >= 5:
                own[name].append(total - trace.plain + trace.hooks)
    fsdp_backend._REDUCE_SCATTER = inner
    fsdp_backend._ReduceScatter.__call__ = call  # type: ignore[method-assign]
    return own


def direct(steps: int, batch: int) -> dict[str, Any]:
    """The guard's own time per step, traced (rank 0's), with checks off and with the
    non-finite check alone, over the plain loop's own (traced alike): medians and 90%
    bootstrap intervals over blocks of 10 steps."""
    own = run_ranks(_own_rank, 2, steps, batch, timeout=3600)[0]
    blocks = {n: split_rounds(vs, steps // 10) for n, vs in own.items()}
    out: dict[str, Any] = {"plain_own_us": statistics.median(own["plain FSDP2"]) * 1e6,
                           "rows": {}}
    for name in list(DIRECT)[1:]:
        def extra(pooled: dict[str, list[float]], n: str = name) -> float:
            return statistics.median(pooled[n]) - statistics.median(pooled["plain FSDP2"])

        lo, hi = bootstrap_interval({k: blocks[k] for k in ("plain FSDP2", name)}, extra)
        out["rows"][name] = {"own_us": statistics.median(own[name]) * 1e6,
                             "extra_us": extra(own) * 1e6, "interval_us": [lo * 1e6, hi * 1e6]}
    return out


AUDIT_EVERY = 4
"""The replay audit's interval in the per-audit measurement (``audit``)."""


AUDIT_ARMS = {
    "replay": GuardConfig(nonfinite=False, weights_interval=0, replay_interval=AUDIT_EVERY,
                          deterministic=True),
    "tolerant": GuardConfig(nonfinite=False, weights_interval=0, replay_interval=AUDIT_EVERY,
                            replay_mode="tolerant", replay_trigger=False),
    "ideal": GuardConfig(nonfinite=False, weights_interval=0, deterministic=True),
}
"""The audit run's configurations: the exact audit, the tolerant one (its trigger off: the
trigger's norm is taken on the other steps, which the extra per audit step is measured
against) and the ideal (the guard with its checks off, plus the recomputation)."""


def _audit_rank(rank: int, world: int, rounds: int, block: int,
                batch: int) -> dict[str, list[tuple[bool, float]]]:
    """Each step's time and whether it audits, for the replay audit every ``AUDIT_EVERY``
    steps, exact and tolerant, and for their ideal: the guard with its checks off plus what
    an audit cannot avoid, the neighbour's micro-batch forward and backward through the
    sharded model with nothing reduced (the backend's ``recomputing``, as the audit runs it),
    at the start of every ``AUDIT_EVERY``-th step. Blocks of ``block`` steps rotate, a
    barrier around each step (the tolerant audit calibrates in the warm-up)."""
    torch.set_num_threads(1)
    neighbour = (rank + 1) % world

    def batch_for(r: int, step: int) -> Any:
        return synthetic_batch("llama", SEED, r, step, 0, batch=batch)

    guards: dict[str, Any] = {}
    for name, cfg in AUDIT_ARMS.items():
        model = shard_model(build_model("llama", width=64, depth=2, seed=SEED),
                            parallel="fsdp", mesh_shape=(world,))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=batch_for, config=cfg)
        if name == "ideal":
            backend: Any = guard.backend
            backend.before.append(lambda chunk: None)  # the reduce-scatters hooked, as the audit's

            def recompute(step: int, model: Any = model, backend: Any = backend) -> None:
                if step % AUDIT_EVERY == 0:
                    with backend.recomputing():
                        scenario_loss(model, batch_for(neighbour, step)).backward()  # type: ignore[no-untyped-call]

            guard.before_step.append(recompute)  # (the guard's zero_grad follows)
        guards[name] = guard
    times: dict[str, list[tuple[bool, float]]] = {n: [] for n in guards}
    step = 0
    for guard in guards.values():  # warm-up
        for _ in range(2 * AUDIT_EVERY):
            guard.step(step)
            step += 1
    names = list(guards)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(block):
                dist.barrier()
                t0 = time.perf_counter()
                guards[name].step(step)
                dist.barrier()
                times[name].append((step % AUDIT_EVERY == 0, time.perf_counter() - t0))
                step += 1
    return times


def _audit_extra(samples: list[tuple[bool, float]]) -> float:
    """An audit step's time over the other steps' (medians)."""
    return (statistics.median(t for a, t in samples if a)
            - statistics.median(t for a, t in samples if not a))


AUDIT_LAUNCHES = 4
"""The audit run's rounds are split over this many launches of the ranks, pooled (as
``bench.tolerant``'s side-by-side run): one launch's layout moved the ratio by more than its
own interval between runs."""


def audit(rounds: int, block: int, batch: int,
          launches: int = AUDIT_LAUNCHES) -> dict[str, Any]:
    """The replay audit's extra time per audit step over its ideal's (rank 0's clock), exact
    and tolerant, and the tolerant's over the exact's: ratios of medians over the rounds of
    ``launches`` launches pooled, and 90% bootstrap intervals over those rounds."""
    launches = max(1, min(launches, rounds))
    per = [rounds // launches + (i < rounds % launches) for i in range(launches)]
    got: dict[str, list[tuple[bool, float]]] = {}
    by_round: dict[str, list[list[tuple[bool, float]]]] = {}
    for n in per:
        one = run_ranks(_audit_rank, 2, n, block, batch, timeout=3600)[0]
        for name, samples in one.items():
            got.setdefault(name, []).extend(samples)
            by_round.setdefault(name, []).extend(split_rounds(samples, n))

    def ratio_of(mode: str, base: str) -> tuple[float, list[float]]:
        def ratio(pooled: dict[str, list[tuple[bool, float]]]) -> float:
            return _audit_extra(pooled[mode]) / _audit_extra(pooled[base])

        return ratio(got), list(bootstrap_interval(by_round, ratio))

    exact, exact_ci = ratio_of("replay", "ideal")
    tolerant, tolerant_ci = ratio_of("tolerant", "ideal")
    over, over_ci = ratio_of("tolerant", "replay")
    return {"every": AUDIT_EVERY, "rounds": rounds, "launches": launches, "block": block,
            "replay_extra_ms": _audit_extra(got["replay"]) * 1e3,
            "ideal_extra_ms": _audit_extra(got["ideal"]) * 1e3,
            "ratio": exact, "interval": exact_ci,
            "tolerant_extra_ms": _audit_extra(got["tolerant"]) * 1e3,
            "tolerant_ratio": tolerant, "tolerant_interval": tolerant_ci,
            "tolerant_over_exact": over, "tolerant_over_exact_interval": over_ci}


def _verdict_rank(rank: int, world: int, shape: tuple[int, ...], rounds: int,
                  batch: int) -> dict[str, list[float]]:
    """The weights check's own time per step (its ``post_step``, and the next step's ``ask``
    and ``pre_step`` that read and judge the vote), beside its ideal timed as one after a
    barrier: what the verdict cannot avoid. Under HSDP: one fingerprint of the same bytes as
    one flat tensor, then one all-reduce of the vote's words; at rest (FSDP): two
    fingerprints (after the optimizer step, and before the next one uses the state), then
    the same all-reduce (every rank learns whose shard changed)."""
    torch.set_num_threads(1)
    model = shard_model(build_model("llama", width=64, depth=2, seed=SEED),
                        parallel="fsdp" if len(shape) == 1 else "hsdp", mesh_shape=shape)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        return synthetic_batch("llama", SEED, r, step, 0, batch=batch)

    guard = SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=batch_for,
                     config=GuardConfig(nonfinite=False, weights_interval=1))
    weights: Any = next(c for c in guard.checks if c.name == "weights")
    spent = [0.0]

    def timing(call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args)
            finally:
                spent[0] += time.perf_counter() - t0
        return timed

    for name in ("post_step", "ask", "pre_step", "veto"):  # (veto: at rest, in the backward)
        setattr(weights, name, timing(getattr(weights, name)))
    passes = 2 if weights.at_rest else 1
    parts = len(guard.backend.layout.sets)
    out: dict[str, list[float]] = {"verdict": [], "ideal": [], "own_ideal": []}
    step = 0
    for _ in range(3):
        guard.step(step)
        step += 1
    for _ in range(rounds):
        dist.barrier()
        spent[0] = 0.0
        guard.step(step)
        step += 1
        out["verdict"].append(spent[0])
        tensors = state_tensors(model, opt)
        flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
        for key, what in (("ideal", [flat]), ("own_ideal", tensors)):
            dist.barrier()
            t0 = time.perf_counter()
            words = [fingerprint_tensor(what).reshape(1) for _ in range(passes)]
            both = torch.full((2 * parts,), -2**63, dtype=torch.int64)
            both[:len(words)] = torch.cat(words)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            out[key].append(time.perf_counter() - t0)
    return out


def weights_verdict(rounds: int, batch: int) -> dict[str, Any]:
    """The weights check's verdict per step over its ideal (rank 0's clock), at rest on
    FSDP 2 and voted on HSDP 2x2: the ratio of medians with a 90% bootstrap interval over
    blocks of 10 steps."""
    out = {}
    for label, shape in (("FSDP 2, at rest", (2,)), ("HSDP 2x2, voted", (2, 2))):
        got = run_ranks(_verdict_rank, math.prod(shape), shape, rounds, batch,
                        timeout=3600)[0]

        blocks = {k: split_rounds(v, rounds // 10) for k, v in got.items()}
        out[label] = {"verdict_us": statistics.median(got["verdict"]) * 1e6}
        for key, prefix in (("ideal", ""), ("own_ideal", "own_")):
            def ratio(pooled: dict[str, list[float]], key: str = key) -> float:
                return statistics.median(pooled["verdict"]) / statistics.median(pooled[key])

            out[label].update({f"{prefix}ideal_us": statistics.median(got[key]) * 1e6,
                               f"{prefix}ratio": ratio(got),
                               f"{prefix}interval": list(bootstrap_interval(blocks, ratio))})
    return out


def _ratios(samples: dict[str, list[float]], rounds: int) -> dict[str, dict[str, Any]]:
    """Each configuration's median and its ratio to its baseline, with a 90% interval."""
    per_round = {n: split_rounds(v, rounds) for n, v in samples.items()}
    out = {}
    for name in CONFIGS:
        base = baseline_of(name)

        def ratio(pooled: dict[str, list[float]], n: str = name, b: str = base) -> float:
            return statistics.median(pooled[n]) / statistics.median(pooled[b])

        low, high = bootstrap_interval({k: per_round[k] for k in (name, base)}, ratio)
        out[name] = {"median_ms": statistics.median(samples[name]) * 1e3,
                     "ratio": ratio(samples), "interval": [low, high]}
    return out


def _checksum_pair_rank(rank: int, world: int, rounds: int,
                        block: int) -> dict[str, dict[str, list[float]]]:
    """One launch of ``checksum_launches``: the reference MLP under FSDP2 with the guard's
    defaults and with the defaults and the checksum, each on a model of its own, timed in
    blocks of ``block`` steps after one untimed step, the order rotating round by round."""
    torch.set_num_threads(1)
    runs = {DEFAULTS: _runner(rank, world, "fsdp", GuardConfig(), 0, mlp=True),
            DEFAULTS_CHECKSUM: _runner(rank, world, "fsdp", GuardConfig(checksum=True), 0,
                                       mlp=True)}
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    step = _warm_up(runs)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            runs[name](step)  # untimed, as bench.checksum's blocks
            step += 1
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                runs[name](step)
                step += 1
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / block)
            cpu[name].append((time.process_time() - c0) / block)
    return {"round_step_s": times, "round_cpu_s": cpu}


def checksum_launches(rounds: int, launches: int, block: int = 10) -> dict[str, Any]:
    """The checksum's DDP budget in its own terms under FSDP2 (``GuardConfig(checksum=True)``
    over ``GuardConfig()`` on the reference MLP, 2 ranks), the rounds split over ``launches``
    runs of new rank processes, as ``bench.checksum`` measures it under DDP: the overhead is
    the median over whole rotations, its interval resamples whole launches."""
    each = launch_rounds(rounds, launches, len(PAIR))
    runs = [run_ranks(_checksum_pair_rank, 2, each, block, timeout=1800)[0]
            for _ in range(launches)]
    times, cpu = ({k: [x for run in runs for x in run[key][k]] for k in PAIR}
                  for key in ("round_step_s", "round_cpu_s"))
    return {"world": 2, "batch": MLP_BATCH, "rounds": rounds, "block": block,
            **launch_stats(times, cpu, launches)}


def fsdp_overhead(rounds: int = 20, block: int = 5, batch: int = 16,
                  direct_steps: int = 300, audit_rounds: int = 200,
                  checksum_rounds: int = 200, launches: int = 10) -> dict[str, Any]:
    """Medians per configuration (rank 0's clock) and each one's ratio to its baseline; the
    control word's all-reduce alone; the guard's own work measured directly on one rank."""
    got = run_ranks(_bench_rank, 2, rounds, block, batch, timeout=3600)[0]
    wall = _ratios(got["wall"], rounds)
    rows = [{"configuration": name, "parallel": parallel, "baseline": baseline_of(name),
             **wall[name]} for name, (parallel, _) in CONFIGS.items()]
    words = got["word"][WORD]
    plain: float = statistics.median(got["wall"][BASELINE["fsdp"]])

    def share(pooled: dict[str, list[float]]) -> float:
        return statistics.median(pooled[WORD]) / plain

    low, high = bootstrap_interval({WORD: split_rounds(words, rounds)}, share)
    own = direct(direct_steps, batch)
    audits = audit(audit_rounds, 2 * AUDIT_EVERY, batch)
    checksum = checksum_launches(checksum_rounds, launches)
    verdicts = weights_verdict(max(100, 10 * rounds), batch)
    word = {"median_us": statistics.median(words) * 1e6, "share_of_plain_step": share({WORD: words}),
            "interval": [low, high]}
    step_us = plain * 1e6
    return {"machine": f"{cpu_name()}, 2 ranks of 1 thread, torch {torch.__version__}",
            "model": "llama (2 blocks, width 64), AdamW", "batch": batch, "rounds": rounds,
            "block": block, "rows": rows, "word": word, "direct_steps": direct_steps,
            "plain_step_ms": plain * 1e3, "audit": audits, "weights_verdict": verdicts,
            "checksum_launches": checksum,
            "direct": {"plain_own_us": own["plain_own_us"], "rows": {
                n: {**v, "share": v["extra_us"] / step_us,
                    "share_interval": [x / step_us for x in v["interval_us"]]}
                for n, v in own["rows"].items()}}}


def markdown(res: dict[str, Any]) -> list[str]:
    def pct(v: float) -> str:
        return f"{100 * v:+.1f}%"

    lines = ["# The guard over plain FSDP2 (and DDP), per step", "",
             f"{res['machine']}; {res['model']}, batch {res['batch']} sequences per rank; "
             f"{res['rounds']} rounds of {res['block']} steps per configuration, alternated, "
             "a barrier around each step; the rows marked MLP: the reference MLP "
             f"(512-1024-1024-10, ReLU), batch {MLP_BATCH} per rank, on which the checksum's "
             "DDP budget is set (<= 3% over the defaults). Generated by "
             "`python -m bench.fsdp`.", "",
             "| configuration | median step (ms) | over | its baseline | 90% interval |",
             "|---|---:|---:|---|---|"]
    for row in res["rows"]:
        low, high = row["interval"]
        base = row["configuration"] == row["baseline"]
        over = "baseline" if base else pct(row["ratio"] - 1)
        lines.append(f"| {row['configuration']} | {row['median_ms']:.2f} | {over} | "
                     f"{'' if base else row['baseline']} | {pct(low - 1)} .. {pct(high - 1)} |")
    w = res["word"]
    d = res["direct"]
    lines += ["", "## The guard's own time, traced", "",
              f"A second two-rank run, {res['direct_steps']} steps per configuration, "
              "alternating step by step: each step's wall time less the time in the work "
              "plain FSDP2 does (batch, forward, backward, zero_grad, optimizer step), plus "
              "the guard's hooks inside the backward (less the reduce-scatter itself); the "
              "plain loop traced alike (its own lines and its backward() call: "
              f"{d['plain_own_us']:.0f} us), and the guard's extra over it; rank 0's, "
              "medians, 90% bootstrap intervals over blocks of 10 steps. The share is of "
              f"the plain FSDP2 step above ({res['plain_step_ms']:.2f} ms).", "",
              "| configuration | own time (us) | extra over plain (us) | 90% interval (us) "
              "| share of the plain step | 90% interval |", "|---|---:|---:|---|---:|---|"]
    for name, row in d["rows"].items():
        lo, hi = row["interval_us"]
        slo, shi = row["share_interval"]
        lines.append(f"| {name} | {row['own_us']:.0f} | {row['extra_us']:+.0f} | "
                     f"{lo:+.0f} .. {hi:+.0f} | **{pct(row['share'])}** | "
                     f"{pct(slo)} .. {pct(shi)} |")
    lines += ["", "The non-finite check's veto rides the step's last reduce-scatter (a "
              "sentinel in its buffer): no collective of its own. The word that carries the "
              "replay audit's and the checksum's vetoes, alone (one int64 all-reduced over "
              f"both ranks after a barrier, in the first run): {w['median_us']:.0f} us, "
              f"{pct(w['share_of_plain_step'])} of the plain step (90%: "
              f"{pct(w['interval'][0])} .. {pct(w['interval'][1])}): gloo's round trip "
              "between two processes on this host."]
    lines += audit_md(res["audit"])
    lines += ["", "## The weights check's verdict, per step", "",
              "Two more runs, the weights check alone, voting every step: its own time per "
              "step (its post_step; at rest its veto, asked in the next step's backward "
              "before the last reduce-scatter, which carries the verdict; the next step's "
              "ask and pre_step that read and judge it) against its ideal timed as one after "
              "a barrier: the fingerprint of the same bytes as one flat tensor (twice at "
              "rest: after the optimizer step and before the next one uses the state), then "
              "one all-reduce of the vote's words; and in the DDP budget's own terms, the "
              "same with the fingerprint of the state's tensors as the check reads them (a "
              "term per tensor). Medians (rank 0's clock), 90% bootstrap intervals over "
              "blocks of 10 steps (the DDP budget: 1.5x).", "",
              "| mesh | verdict (us) | flat ideal (us) | ratio | 90% interval "
              "| per-tensor ideal (us) | ratio | 90% interval |",
              "|---|---:|---:|---:|---|---:|---:|---|"]
    for label, v in res["weights_verdict"].items():
        lines.append(f"| {label} | {v['verdict_us']:.0f} | {v['ideal_us']:.0f} | "
                     f"**{v['ratio']:.2f}x** | {v['interval'][0]:.2f}x .. "
                     f"{v['interval'][1]:.2f}x | {v['own_ideal_us']:.0f} | "
                     f"**{v['own_ratio']:.2f}x** | {v['own_interval'][0]:.2f}x .. "
                     f"{v['own_interval'][1]:.2f}x |")
    if "checksum_launches" in res:
        lines += checksum_launches_md(res["checksum_launches"])
    return lines


def audit_md(a: dict[str, Any]) -> list[str]:
    """``audit``'s section of FSDP.md (a run before the tolerant arm has the exact row only)."""
    over = (f"{a['rounds']} rounds over {a['launches']} launches of the ranks, pooled"
            if a.get("launches", 1) > 1 else f"a third two-rank run, {a['rounds']} rounds")
    lines = ["", "## The replay audit, per audit step", "",
             f"{over[0].upper()}{over[1:]}, blocks of {a['block']} steps, "
             f"rotated, a barrier around each step: the replay audit every {a['every']} "
             "steps (its other checks off), exact (deterministic kernels) and tolerant "
             "(`replay_mode=\"tolerant\"`, its trigger off), and their ideal: the guard with "
             "its checks off plus what an audit cannot avoid, the neighbour's micro-batch "
             "forward and backward through the sharded model with nothing reduced, at the "
             f"start of every {a['every']}th step. Each one's extra time of an audit step over "
             "its other steps (medians, rank 0's clock), and the ratio with its 90% "
             "bootstrap interval over the rounds (the DDP budget: 1.15x).", "",
             "| audit | audit step's extra (ms) | ideal's extra (ms) | ratio | 90% interval |",
             "|---|---:|---:|---:|---|",
             f"| exact | {a['replay_extra_ms']:.2f} | {a['ideal_extra_ms']:.2f} | "
             f"**{a['ratio']:.2f}x** | {a['interval'][0]:.2f}x .. {a['interval'][1]:.2f}x |"]
    if "tolerant_ratio" in a:
        lo, hi = a["tolerant_interval"]
        olo, ohi = a["tolerant_over_exact_interval"]
        lines += [f"| tolerant | {a['tolerant_extra_ms']:.2f} | {a['ideal_extra_ms']:.2f} | "
                  f"**{a['tolerant_ratio']:.2f}x** | {lo:.2f}x .. {hi:.2f}x |", "",
                  f"The tolerant audit's extra over the exact one's: "
                  f"**{a['tolerant_over_exact']:.2f}x** (90%: {olo:.2f}x .. {ohi:.2f}x)."]
    return lines


def checksum_launches_md(c: dict[str, Any]) -> list[str]:
    """``checksum_launches``' section of FSDP.md."""
    def pct(v: float) -> str:
        return f"{100 * v:+.1f}%"

    lo, hi = c["overhead_interval_90"]
    clo, chi = c["cpu_overhead_interval_90"]
    n = c["launches"]
    return ["", f"## The checksum in the defaults under FSDP2, over {n} launches", "",
            "`GuardConfig(checksum=True)` against `GuardConfig()` on the reference MLP "
            f"under FSDP2 (2 ranks x 1 thread, batch {c['batch']} per rank), each on a "
            f"model of its own, alternated in blocks of {c['block']} steps after one "
            f"untimed step, {c['rounds']} rounds in {n} launches of {c['rounds'] // n} "
            "rounds (new rank processes each time), as `bench.checksum` measures the DDP "
            "budget (<= 3%): the median over whole rotations of each rotation's ratio "
            "of means, its 90% bootstrap interval resampling whole launches.", "",
            "| step, defaults (ms) | step, defaults + checksum (ms) | overhead | "
            "90% interval | CPU overhead (90% interval) |", "|---|---|---|---|---|",
            f"| {c['step_ms']:.2f} | {c['step_ms_checksum']:.2f} | "
            f"**{pct(c['overhead'])}** | {pct(lo)} .. {pct(hi)} | "
            f"{pct(c['cpu_overhead'])} ({pct(clo)} .. {pct(chi)}) |", "",
            "Each launch's own overhead, in the order they ran: "
            + ", ".join(pct(x) for x in c["overhead_per_launch"]) + "."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--direct-steps", type=int, default=300,
                    help="traced steps per configuration (default 300)")
    ap.add_argument("--audit-rounds", type=int, default=200,
                    help="rounds of the replay audit's run (default 200)")
    ap.add_argument("--checksum-rounds", type=int, default=200,
                    help="rounds of the checksum's launches, all together (default 200)")
    ap.add_argument("--launches", type=int, default=10,
                    help="launches the checksum's rounds are split over (default 10)")
    ap.add_argument("--only-audit", action="store_true",
                    help="the replay audit's run alone, amending OUT/fsdp.json")
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    if args.only_audit:
        if args.audit_rounds < 1:
            ap.error(f"--audit-rounds must be at least 1; got {args.audit_rounds}")
        path = Path(args.out) / "fsdp.json"
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"--only-audit amends a full run's {path}, which cannot be read ({e}); "
                     "run without --only-audit first")
        machine = str(res.get("machine", ""))
        if not machine.startswith(cpu_name()):
            ap.error(f"--only-audit: {path} was measured on {machine or 'an unnamed CPU'}, "
                     f"this is {cpu_name()}: run the whole benchmark here")
        res["audit"] = audit(args.audit_rounds, 2 * AUDIT_EVERY, int(res.get("batch", 16)))
        lines = markdown(res)
        publish(Path(args.out), "fsdp", res, lines)
        (Path(args.out) / "FSDP.md").write_text("\n".join(lines) + "\n")
        return 0
    if min(args.rounds, args.block, args.batch) < 1 or args.direct_steps < 10:
        ap.error(f"--rounds, --block and --batch must be at least 1 and --direct-steps at "
                 f"least 10 (its intervals resample blocks of 10 steps); got --rounds "
                 f"{args.rounds} --block {args.block} --batch {args.batch} --direct-steps "
                 f"{args.direct_steps}")
    if args.audit_rounds < 1:
        ap.error(f"--audit-rounds must be at least 1; got {args.audit_rounds}")
    try:
        launch_rounds(args.checksum_rounds, args.launches, len(PAIR))
    except ValueError as e:
        ap.error(f"--checksum-rounds {args.checksum_rounds} --launches {args.launches}: {e}")
    res = fsdp_overhead(args.rounds, args.block, args.batch, args.direct_steps,
                        args.audit_rounds, args.checksum_rounds, args.launches)
    lines = markdown(res)
    publish(Path(args.out), "fsdp", res, lines)
    (Path(args.out) / "FSDP.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
