"""``python -m bench.tolerant`` (``nox -s tolerant_bench``): the tolerant replay audit on the
CPU testbed for nondeterminism, beside the exact audit.

The testbed: 3 gloo ranks at 1, 2 and 1 torch threads, and ``injectors.noise.LinearNoise``
moving every ``nn.Linear`` output by -4..4 ulps, drawn afresh at every call, so every
recomputation of a batch rounds otherwise, on its own rank and on another
(``GuardConfig(replay_mode="tolerant")``, no deterministic kernels). The exact audit runs
where it can: deterministic mode, one thread on every rank, no noise. The model: an MLP
16 -> 64 -> 64 -> 4 with GELU and dropout (the RNG streams must replay), AdamW, batches of
32; the clean part runs a ReLU twin too (a knife edge at the ReLU's gate: the report). Only
the replay audit runs (the non-finite and weights checks off), the step withheld on a
detection; ``repair_window_steps=1``, so that a rank named transient again (the faults come
one a step) is still reported transient and the table shows the diagnosis itself.

Parts (each one run of the three ranks, faults armed one per step at the step's start):

- **clean**: ``--clean`` steps audited every step, no fault: the false positives (the
  target: none over at least 1,000 audits), the calibrated tolerance and its event.
- **exponent**: ``--exponent`` transient flips of one bit among 27-30 (the float32
  exponent's top four), one per audited step, in turn on each rank, in an activation (the
  output of each layer and ReLU) or a local gradient (each parameter's, before the
  all-reduce), the element drawn from the fault's seed: detected (any detection at the
  step), named (the suspects are exactly the faulty rank) and named transient, for both
  modes on the same faults.
- **bits**: ``--per-bit`` flips of each bit 0..31 per site, both modes: what escapes, by bit.
- **bits in bfloat16**: the same sweep on the model under ``torch.autocast`` in bfloat16
  (``bf16_bits``: every bit of a bfloat16 activation and of a float32 local gradient), the
  testbed's noise in each linear product's float32 accumulator, after ``BF16_WARMUP`` clean
  audits (the tolerance then off its half-precision ceiling).
- **trigger**: the same bit sweep with the audit every ``TRIGGER_INTERVAL`` steps and the
  faults on the steps between: what the norm trigger catches (and what it misses), and how
  often it fires on the clean steps between.

- **cost**: first a side-by-side run (``side_by_side``: replay off, the ideal, the exact and
  the tolerant audit alternated block by block on one model per rank, with the guard's
  default checks, its rounds over ``LAUNCHES`` launches pooled: the ratios the target is read
  from), then ``bench.replay``'s measurement of the audit per audit step against its ideal
  (the same run plus one plain forward and backward of the neighbour's batch every k steps)
  on the reference MLP (3 ranks, batches of 128, no testbed noise), for the exact and the
  tolerant audit, one run each (``--cost-rounds`` rounds; 0 leaves it out). The tolerant
  run's other steps carry the norm trigger: their time over replay off is its cost.

Results: ``bench/tolerant.json`` and ``bench/TOLERANT.md``::

    python -m bench.tolerant [--clean N] [--exponent N] [--per-bit N] [--cost-rounds N]
                             [--only-cost | --only-side-by-side | --only-bf16] [--out bench]

``--only-cost`` measures the cost part alone and amends ``OUT/tolerant.json`` (and the
table) of an earlier full run; ``--only-side-by-side`` its side-by-side run alone;
``--only-bf16`` the bfloat16 sweep alone.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.replay import replay_overhead
from bench.timing import bootstrap_interval, cpu_name, publish
from injectors import Fault, InjectionHandle, arm
from injectors.noise import LinearNoise
from scenarios.run.launch import run_ranks
from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.internal import TolerantReplayAudit

WORLD = 3
THREADS = (1, 2)
"""Rank r's torch threads on the testbed: ``THREADS[r % 2]``."""
ULPS = 4
ACTIVATIONS = ("fc1", "act1", "fc2", "act2", "fc3")
GRADIENTS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias")
SITES = {"activation": ACTIVATIONS, "gradient_before_allreduce": GRADIENTS}
EXPONENT_BITS = (27, 28, 29, 30)
TRIGGER_INTERVAL = 1000
"""The audit's interval in the trigger part: step 0 calibrates, every other step is left to
the trigger."""


ACTS: dict[str, type[nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU}


class TestbedMLP(nn.Module):
    """16 -> 64 -> 64 -> 4 with GELU (as transformers use) or ReLU, and dropout."""

    def __init__(self, act: str = "gelu") -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.act1 = ACTS[act]()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(64, 64)
        self.act2 = ACTS[act]()
        self.fc3 = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc3(self.act2(self.fc2(self.drop(self.act1(self.fc1(x))))))
        return y


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def bf16_loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``loss_fn`` under ``torch.autocast`` in bfloat16, as DDP trains in mixed precision: the
    linear products and what follows them in bfloat16, the weights and gradients in float32."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return loss_fn(model, batch)


def _rank(rank: int, world: int, mode: str, steps: int, interval: int,
          faults: list[dict[str, Any] | None], act: str = "gelu",
          bf16: bool = False) -> dict[str, Any]:
    """One rank of one part: ``steps`` guarded steps, ``faults[s]`` (or None) armed at step s.
    ``bf16``: under ``torch.autocast`` in bfloat16, the testbed's noise in the float32
    accumulator of each linear product before its rounding (as a GPU's reduction order moves
    it: 4 bfloat16 ulps on every output would be far more)."""
    tolerant = mode == "tolerant"
    torch.set_num_threads(THREADS[rank % len(THREADS)] if tolerant else 1)
    torch.manual_seed(0)
    model = DDP(TestbedMLP(act))
    if tolerant:
        LinearNoise(model.module, ulps=ULPS, seed=11, rank=rank,
                    where="accumulator" if bf16 else "output")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = GuardConfig(replay_interval=interval, replay_mode=mode, deterministic=not tolerant,
                      nonfinite=False, weights_interval=0, repair_window_steps=1)
    guard = SDCGuard(model, opt, loss_fn=bf16_loss_fn if bf16 else loss_fn,
                     batch_for=batch_for, config=cfg)
    armed: list[InjectionHandle | None] = [None]
    injections: list[dict[str, Any]] = []

    def arm_step(step: int) -> None:
        if armed[0] is not None:
            injections.extend(armed[0].records)
            armed[0].remove()
            armed[0] = None
        f = faults[step] if step < len(faults) else None
        if f is not None and f["rank"] == rank:
            armed[0] = arm(Fault(**f), guard=guard)

    guard.before_step.append(arm_step)
    found: dict[int, list[tuple[tuple[int, ...], bool]]] = {}
    times = []
    gaps: list[float] = []
    """Per audited step: the distance between this rank's own sketch and the previous rank's
    replay of its batch, in units of the tolerance (the clean runs' spread)."""
    audit = guard.checks[0]
    for s in range(steps):
        t0 = time.perf_counter()
        report = guard.step(s)
        times.append(time.perf_counter() - t0)
        if isinstance(audit, TolerantReplayAudit) and audit.due(s):
            gap = audit.gap()
            if gap is not None:
                gaps.append(gap)
        for d in report.detections:
            found.setdefault(d.step, []).append((d.suspect_ranks, d.transient))
    arm_step(steps)
    out = {"gaps": gaps, "found": {str(k): v for k, v in found.items()},
           "injections": [{k: r[k] for k in ("step", "site", "target", "bits", "before",
                                             "after")} for r in injections],
           "step_s": statistics.median(times)}
    if isinstance(audit, TolerantReplayAudit):
        out.update(tolerance=audit.tolerance, triggered=audit.triggered)
    guard.close()
    return out


def _faults(bits: list[int], start: int, seed: int) -> list[dict[str, Any] | None]:
    """One transient flip per step from ``start``: bit ``bits[i]``, site and target in turn,
    rank ``i % WORLD``."""
    targets = [(site, t) for site, names in SITES.items() for t in names]
    out: list[dict[str, Any] | None] = [None] * start
    for i, b in enumerate(bits):
        site, target = targets[i % len(targets)]
        out.append({"site": site, "target": target, "rank": i % WORLD, "step": start + i,
                    "bits": (b,), "seed": seed + i})
    return out


def _score(faults: list[dict[str, Any] | None], res: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fault: site, bit, detected (any detection at its step), named (exactly its rank),
    named transient, and whether the norm trigger audited its step."""
    found = {int(k): v for r in res for k, v in r["found"].items()}
    rows = []
    for f in faults:
        if f is None:
            continue
        hits = found.get(f["step"], [])
        named = [t for suspects, t in hits if suspects == (f["rank"],)]
        rows.append({"site": f["site"], "target": f["target"], "bit": f["bits"][0],
                     "detected": bool(hits), "named": bool(named),
                     "transient": bool(named) and all(named),
                     "triggered": f["step"] in res[0].get("triggered", [])})
    return rows


def _rates(rows: list[dict[str, Any]], key: str = "detected") -> dict[str, float]:
    return {"n": len(rows), "detected": sum(r["detected"] for r in rows) / max(1, len(rows)),
            "named": sum(r["named"] for r in rows) / max(1, len(rows)),
            "transient": sum(r["transient"] for r in rows) / max(1, len(rows))}


def _part(mode: str, faults: list[dict[str, Any] | None], interval: int = 1,
          act: str = "gelu", bf16: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = run_ranks(_rank, WORLD, mode, len(faults), interval, faults, act, bf16,
                    timeout=7200)
    rows = _score(faults, res)
    gaps = sorted(g for r in res for g in r["gaps"])
    return {"rows": rows, "seconds": time.perf_counter() - t0,
            "gaps": {"n": len(gaps), **({"median": gaps[len(gaps) // 2],
                                         "p99": gaps[int(0.99 * len(gaps))], "max": gaps[-1],
                                         "above_1": sum(g > 1 for g in gaps)} if gaps else {})},
            "found": res[0]["found"],
            "tolerance": res[0].get("tolerance"), "triggered": res[0].get("triggered", []),
            "detections": sum(len(v) for v in res[0]["found"].values()),
            "step_s": res[0]["step_s"], "injections": sum(len(r["injections"]) for r in res)}


def tolerant_bench(clean: int, exponent: int, per_bit: int, cost_rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": cpu_name(), "torch": torch.__version__, "world": WORLD,
                           "threads": list(THREADS), "ulps": ULPS}
    out["clean"] = {}
    for act in ACTS:
        calm = _part("tolerant", [None] * clean, act=act)
        out["clean"][act] = {"audits": clean, "false_positives": calm["detections"],
                             "found": calm["found"], "gaps": calm["gaps"],
                             "tolerance": calm["tolerance"], "step_s": calm["step_s"],
                             "seconds": calm["seconds"]}
    bits = [EXPONENT_BITS[i % 4] for i in range(exponent)]
    out["exponent"] = {}
    parts = {mode: _part(mode, _faults(bits, 1, 10_000)) for mode in ("exact", "tolerant")}
    seen = [r["detected"] for r in parts["exact"]["rows"]]  # the same faults, in order
    for mode, part in parts.items():
        rows = part["rows"]
        effective = [r for r, e in zip(rows, seen, strict=True) if e]
        out["exponent"][mode] = {
            "all": _rates(rows), "injections": part["injections"], "seconds": part["seconds"],
            "changed_bits": _rates(effective),
            **{site: _rates([r for r in rows if r["site"] == site]) for site in SITES},
            **{f"{site} changed_bits": _rates([r for r in effective if r["site"] == site])
               for site in SITES}}
    sweep = [b for b in range(32) for _ in range(per_bit * len(SITES))]
    out["bits"] = {}
    for mode in ("tolerant", "exact"):
        rows = _part(mode, _faults(sweep, 1, 20_000))["rows"]
        out["bits"][mode] = {site: {str(b): _rates([r for r in rows if r["site"] == site
                                                    and r["bit"] == b]) for b in range(32)}
                             for site in SITES}
    trig = _part("tolerant", _faults(sweep, 1, 20_000), interval=TRIGGER_INTERVAL)
    rows = trig["rows"]
    out["trigger"] = {site: {str(b): {"n": len(sel := [r for r in rows if r["site"] == site
                                                       and r["bit"] == b]),
                                      "triggered": sum(r["triggered"] for r in sel) / max(1, len(sel)),
                                      "named": sum(r["named"] for r in sel) / max(1, len(sel))}
                             for b in range(32)} for site in SITES}
    out["bits_bf16"] = bf16_bits(per_bit)
    calm_trig = _part("tolerant", [None] * clean, interval=TRIGGER_INTERVAL)
    out["trigger_clean"] = {"steps": clean - 1, "triggered": len(calm_trig["triggered"]),
                            "false_positives": calm_trig["detections"]}
    if cost_rounds:
        out["cost"] = cost(cost_rounds)
    return out


BF16_WARMUP = 160
"""Clean audited steps before the bfloat16 sweep's faults: in half precision the tolerance
leaves its ceiling at the rolling update that closes ``HALF_WINDOWS`` windows of clean audits
(128), and the sweep measures the tolerance a run settles at."""
BF16_BITS = {"activation": 16, "gradient_before_allreduce": 32}
"""Under autocast the activations are bfloat16 and the gradients float32."""


def bf16_bits(per_bit: int, warmup: int = BF16_WARMUP) -> dict[str, Any]:
    """Every bit of a bfloat16 activation and of a float32 local gradient, ``per_bit`` flips
    each, on audited steps of the model under ``torch.autocast`` after ``warmup`` clean ones,
    both modes on the same faults: the share detected and named, by bit."""
    sweep = [(site, b) for site, n in BF16_BITS.items() for b in range(n)
             for _ in range(per_bit)]
    out: dict[str, Any] = {"per_bit": per_bit, "warmup": warmup}
    for mode in ("tolerant", "exact"):
        faults: list[dict[str, Any] | None] = [None] * (warmup + 1)
        for i, (site, b) in enumerate(sweep):
            names = SITES[site]
            faults.append({"site": site, "target": names[i % len(names)], "rank": i % WORLD,
                           "step": warmup + 1 + i, "bits": (b,), "seed": 30_000 + i})
        part = _part(mode, faults, bf16=True)
        rows = part["rows"]
        out[mode] = {site: {str(b): _rates([r for r in rows if r["site"] == site
                                            and r["bit"] == b]) for b in range(n)}
                     for site, n in BF16_BITS.items()}
        out[mode]["injections"] = part["injections"]
        if mode == "tolerant":
            out["tolerance"] = part["tolerance"]
            out["warmup_detections"] = sum(len(v) for k, v in part["found"].items()
                                           if int(k) <= warmup)
    return out


SIDE_INTERVAL = 4
"""The side-by-side run's tolerant configuration with the trigger on (interval > 1)."""


def _side_rank(rank: int, world: int, rounds: int, block: int) -> dict[str, Any]:
    """One rank of ``side_by_side``: per configuration and round, each timed step's (step,
    seconds)."""
    import functools

    import torch.distributed as dist

    from bench.reference import classification_batch, cross_entropy_loss, guarded_ddp, switch
    from bench.reference import reference_mlp as ref_mlp
    from scenarios.spec.overhead import all_checks

    batch_for = functools.partial(classification_batch, batch=128)
    base = all_checks(1).config
    assert base is not None
    exact = base
    tolerant = replace(base, replay_mode="tolerant", deterministic=False)
    configs = {"off": (replace(tolerant, replay_interval=0), 0), "ideal": (
        replace(tolerant, replay_interval=0), 1), "exact": (exact, 0), "tolerant": (tolerant, 0),
        f"tolerant {SIDE_INTERVAL}": (replace(tolerant, replay_interval=SIDE_INTERVAL), 0),
        f"exact {SIDE_INTERVAL}": (replace(exact, replay_interval=SIDE_INTERVAL), 0),
        f"ideal {SIDE_INTERVAL}": (replace(tolerant, replay_interval=0), SIDE_INTERVAL)}
    model = guarded_ddp(ref_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=tolerant)
    module = model.module
    params = [p for p in module.parameters() if p.requires_grad]
    ideal = [0]

    def extra(step: int) -> None:  # the ideal: one plain forward and backward more
        if ideal[0] and step % ideal[0] == 0:  # (every step, or every SIDE_INTERVAL steps)
            loss = cross_entropy_loss(module, batch_for((rank + 1) % world, step))
            torch.autograd.grad(loss, params)

    guard.before_step.append(extra)
    guard.step(0)  # calibrates; every tolerant configuration after a switch takes it
    tol = next(c.tolerance for c in guard.checks if isinstance(c, TolerantReplayAudit))
    assert tol is not None
    names = list(configs)
    times: dict[str, list[list[tuple[int, float, float]]]] = {n: [] for n in names}
    step = 1
    for rnd in range(rounds + 1):  # round 0 warms up
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in order:
            config, ideal[0] = configs[name]
            switch(guard, config)
            for c in guard.checks:
                if isinstance(c, TolerantReplayAudit):
                    c.restore_tolerance(tol)
            first = step + (-step) % SIDE_INTERVAL  # every block starts at an audit step
            while step < first:  # (the same count of audit steps in each)
                guard.step(step)
                step += 1
            dist.barrier()
            got = []
            for _ in range(block):
                t0, c0 = time.perf_counter(), time.process_time()
                guard.step(step)
                got.append((step, time.perf_counter() - t0, time.process_time() - c0))
                step += 1
            if rnd:
                times[name].append(got)
    return {"times": times}


LAUNCHES = 4
"""The side-by-side run's rounds are split over this many launches of the ranks, pooled: what
a launch fixes (where its memory lies, which core each rank starts on) moves one
configuration's time against another's by more than the rounds of one launch vary."""


def side_by_side(rounds: int, block: int = 16, launches: int = LAUNCHES) -> dict[str, Any]:
    """The exact and the tolerant audit (every step, and every ``SIDE_INTERVAL`` steps: the
    tolerant one with the trigger between) beside replay off and the ideal (one plain forward
    and backward more each step, and every ``SIDE_INTERVAL`` steps for the audits at that
    cadence), on one guarded model of each rank, alternated block by block in rotated order
    within one run: each mode's extra time per audit step over the ideal's extra, median
    over the pooled rounds, with a 90% bootstrap interval over the rounds. The deterministic
    setting stays on once the exact audit ran (process-wide; on the CPU it changes none of
    this model's kernels)."""
    launches = max(1, min(launches, rounds))
    per = [rounds // launches + (i < rounds % launches) for i in range(launches)]
    ranks: list[dict[str, list[list[tuple[int, float, float]]]]] = []
    for n in per:  # rank r of every launch pools into ranks[r]
        got = [r["times"] for r in run_ranks(_side_rank, WORLD, n, block, timeout=1800)]
        if not ranks:
            ranks = got
        else:
            for mine, more in zip(ranks, got, strict=True):
                for name in mine:
                    mine[name] += more[name]

    def med(pool: dict[str, list[float]], name: str) -> float:
        return statistics.median(pool[name])

    def pooled(rounds_of: dict[str, list[list[tuple[int, float, float]]]], name: str,
               audit: bool | None = None, col: int = 1) -> list[list[float]]:
        return [[t[col] for t in got if audit is None or (t[0] % SIDE_INTERVAL == 0) == audit]
                for got in rounds_of[name]]

    k, ek = f"tolerant {SIDE_INTERVAL}", f"exact {SIDE_INTERVAL}"
    parts = {"off": ("off", None), "ideal": ("ideal", None), "exact": ("exact", None),
             "tolerant": ("tolerant", None), "k audit": (k, True), "k other": (k, False),
             "exact k audit": (ek, True), "ideal k": (f"ideal {SIDE_INTERVAL}", True)}
    res = ranks[0]
    samples = {n: pooled(res, name, audit) for n, (name, audit) in parts.items()}
    cpu = {n: [r for times in ranks for r in pooled(times, name, audit, col=2)]
           for n, (name, audit) in parts.items()}
    """Every rank's CPU time per step (a round of each rank a sample of the bootstrap)."""

    def ratio(pool: dict[str, list[float]], name: str) -> float:
        ideal = "ideal k" if name.endswith("k audit") else "ideal"  # at the audits' cadence
        return (med(pool, name) - med(pool, "off")) / (med(pool, ideal) - med(pool, "off"))

    def extra_ms(pool: dict[str, list[float]], name: str) -> float:
        return 1e3 * (med(pool, name) - med(pool, "off"))

    whole = {n: [x for r in v for x in r] for n, v in samples.items()}
    out: dict[str, Any] = {"rounds": rounds, "launches": launches, "block": block,
                           "interval": SIDE_INTERVAL,
                           "step_ms": {n: 1e3 * statistics.median(v) for n, v in whole.items()}}
    cpu_whole = {n: [x for r in v for x in r] for n, v in cpu.items()}
    out["cpu_ms"] = {n: 1e3 * statistics.median(v) for n, v in cpu_whole.items()}
    for name in ("exact", "tolerant", "exact k audit", "k audit"):
        out[name] = {"ratio_to_ideal": ratio(whole, name),
                     "ratio_interval_90": bootstrap_interval(
                         samples, lambda p, n=name: ratio(p, n)),
                     "extra_ms": extra_ms(whole, name),
                     "cpu_ratio_to_ideal": ratio(cpu_whole, name),
                     "cpu_ratio_interval_90": bootstrap_interval(
                         cpu, lambda p, n=name: ratio(p, n))}
    out["k other"] = {"extra_ms": extra_ms(whole, "k other"),
                      "extra_ms_interval_90": bootstrap_interval(
                          samples, lambda p: extra_ms(p, "k other"))}
    return out


def cost(rounds: int) -> dict[str, Any]:
    """The cost part: the side-by-side run, and ``bench.replay``'s run for each mode (every
    interval)."""
    out: dict[str, Any] = {"side_by_side": side_by_side(rounds + 4)}
    out.update({mode: replay_overhead(3, rounds=rounds, batch=128, mode=mode)
                for mode in ("exact", "tolerant")})
    return out


def _side_md(sb: dict[str, Any]) -> list[str]:
    """The side-by-side run's table."""
    k = sb["interval"]

    def row(name: str, label: str) -> str:
        r = sb[name]
        lo, hi = r["ratio_interval_90"]
        line = (f"| {label} | {r['extra_ms']:.2f} | **{r['ratio_to_ideal']:.3f}** | "
                f"{lo:.3f} .. {hi:.3f} |")
        if "cpu_ratio_to_ideal" in r:
            clo, chi = r["cpu_ratio_interval_90"]
            line += f" {r['cpu_ratio_to_ideal']:.3f} | {clo:.3f} .. {chi:.3f} |"
        return line

    lo, hi = sb["k other"]["extra_ms_interval_90"]
    cpu = "cpu_ms" in sb
    return ["", "### Side by side", "",
            f"One guarded model per rank (3 ranks, reference MLP, batches of 128; the "
            f"guard's default checks, non-finite and weights every step, in every "
            f"configuration), its configurations alternated in blocks of {sb['block']} "
            "steps in rotated order, "
            f"{sb['rounds']} rounds over {sb.get('launches', 1)} launches of the ranks, "
            f"pooled: replay off ({sb['step_ms']['off']:.2f} ms a step), the "
            f"ideal (one plain forward and backward of the neighbour's batch more each step: "
            f"{sb['step_ms']['ideal'] - sb['step_ms']['off']:.2f} ms), the exact audit and the "
            f"tolerant one every step, and every {k} steps (the tolerant one with the trigger "
            "between). Extra time per audit step over replay off, and its ratio to the ideal's "
            "extra (median of the pooled steps; 90% bootstrap interval over the rounds). The "
            f"audits every {k} steps are held against the ideal at their cadence (one plain "
            f"forward and backward more every {k} steps: "
            f"{sb['step_ms'].get('ideal k', math.nan) - sb['step_ms']['off']:.2f} ms on its "
            "steps): a recomputation after plain steps finds colder caches and memory than "
            "one every step. The target: at most 1.15x." + (
                " Beside it the same ratio of CPU time (every rank's own, per step: what the "
                "audit costs a rank in work, without the waiting that three ranks sharing two "
                "cores add to the wall time)." if cpu else ""), "",
            "| audit | extra per audit step, ms | ratio to the ideal | 90% |"
            + (" CPU time: ratio | 90% |" if cpu else ""),
            "|---|---|---|---|" + ("---|---|" if cpu else ""),
            row("exact", "exact, every step"), row("tolerant", "tolerant, every step"),
            *([row("exact k audit", f"exact, every {k} steps (its audit steps)")]
              if "exact k audit" in sb else []),
            row("k audit", f"tolerant, every {k} steps (its audit steps)"), "",
            f"The tolerant audit's other steps at interval {k} (the trigger's norm and vote): "
            f"{sb['k other']['extra_ms']:+.2f} ms over replay off (90%: {lo:+.2f} .. "
            f"{hi:+.2f})."]


def _cost_md(cost: dict[str, Any]) -> list[str]:
    """The per-audit-step ratios of both modes, side by side."""
    ex, to = cost["exact"], cost["tolerant"]
    lines = ["", "## Cost per audit step"]
    if "side_by_side" in cost:
        lines += _side_md(cost["side_by_side"])
        lines += ["", "### Every interval, one run per mode"]
    lines += ["",
             f"`bench.replay`'s measurement, one run per mode ({ex['rounds']} rounds each; "
             f"reference MLP 512 -> 1024 -> 1024 -> 10, batches of {ex['batch']}, 3 ranks, the "
             "non-finite check on): the audit's extra time per audit step over its ideal's "
             "(one plain forward and backward of the neighbour's batch), median over rounds "
             "and 90% bootstrap interval; and the other steps of interval k over replay off "
             "(the tolerant audit's norm trigger), in ms.", "",
             "| interval | exact: ratio | 90% | tolerant: ratio | 90% | tolerant: other steps "
             "over off, ms | 90% |", "|---|---|---|---|---|---|---|"]
    for k in ex["intervals"]:
        e, t = ex["intervals"][k], to["intervals"][k]
        lo, hi = e["per_audit_step_ratio_interval_90"]
        tlo, thi = t["per_audit_step_ratio_interval_90"]
        rlo, rhi = t["audit_rest_vs_off_interval_90"]
        lines.append(f"| {k} | {e['per_audit_step_ratio']:.3f} | {lo:.3f} .. {hi:.3f} | "
                     f"**{t['per_audit_step_ratio']:.3f}** | {tlo:.3f} .. {thi:.3f} | "
                     f"{1e3 * t['audit_rest_vs_off_s']:.3f} | {1e3 * rlo:.3f} .. "
                     f"{1e3 * rhi:.3f} |")
    lines += ["", f"Replay off: {1e3 * ex['step_s_replay_off']:.2f} ms a step (exact run), "
              f"{1e3 * to['step_s_replay_off']:.2f} ms (tolerant run); one forward and backward "
              f"{1e3 * ex['forward_backward_s']:.2f} ms. What the tolerant audit adds to the "
              "exact one's work per audit step: the sketches of its own and of the replayed "
              "gradients (each parameter's norm and four projections; on float32 CPU "
              "gradients one read each in the C kernel: the own one in the comm hook's "
              "scaling pass, sdc_scale_sketch, the replayed one after the recomputation, "
              "sdc_sketch) in place of the C kernel's digests. Its other steps carry the "
              "trigger: one norm per bucket and a vote on the veto channel."]
    return lines


def _found(found: dict[str, Any]) -> str:
    """The detections of a clean run, in words."""
    return "; ".join(
        f"step {k}: " + ", ".join(f"rank(s) {list(s)} {'transient' if t else 'lasting'}"
                                  if s else "no suspect" for s, t in v)
        for k, v in sorted(found.items(), key=lambda kv: int(kv[0]))) or "none"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def markdown(res: dict[str, Any]) -> list[str]:
    c = res["clean"]["gelu"]
    r = res["clean"]["relu"]
    lines = [
        "# The tolerant replay audit on the CPU testbed", "",
        f"Generated by `python -m bench.tolerant` (`nox -s tolerant_bench`) on {res['cpu']}, "
        f"torch {res['torch']}: {res['world']} gloo ranks at {res['threads']} threads in turn, "
        f"LinearNoise of -{res['ulps']}..{res['ulps']} ulps on every linear output; the exact "
        "audit with deterministic kernels, one thread, no noise (it refuses ranks at other "
        "thread counts). How it runs: the module doc of `bench/tolerant.py`.", "",
        "## False positives", "",
        f"GELU model: {c['audits']} clean steps, each audited: **{c['false_positives']} "
        f"detections**. Tolerance at the end {c['tolerance']:.3g} (relative, per component; "
        "calibrated at the first audit, rolled every 32 clean audits). Each rank's own "
        "sketch against the replay of its batch, in units of the tolerance of its step, "
        f"over the {c['gaps']['n']} comparisons: median {c['gaps']['median']:.3f}, 99th "
        f"percentile {c['gaps']['p99']:.3f}, largest {c['gaps']['max']:.3f}.", "",
        f"ReLU model: {r['audits']} clean steps: **{r['false_positives']} detections** "
        f"({_found(r['found'])}); median {r['gaps']['median']:.3f}, 99th percentile "
        f"{r['gaps']['p99']:.3f}, largest {r['gaps']['max']:.4g} tolerances, "
        f"{r['gaps']['above_1']} above 1. A ReLU whose input lies within a rounding of zero "
        "passes its gradient in one computation and not in the other: the gradients differ by "
        "one sample's share through one unit (a knife edge), which in a 64-element bias of "
        "this tiny model is percents of its gradient's norm. The rerun diagnosis cannot tell "
        "a rare outcome of a knife edge from a transient fault. In wide layers and large "
        "batches one sample's share is a small part of the gradient and such flips are part "
        "of the noise the calibration measures; smooth activations (GELU, SiLU) have no "
        "knife edge.", "",
        f"Trigger, GELU model: "
        f"between audits ({res['trigger_clean']['steps']} clean steps) it fired "
        f"{res['trigger_clean']['triggered']} times, "
        f"{res['trigger_clean']['false_positives']} detections.", "",
        "## Exponent flips (bits 27-30) on audited steps", "",
        "On the GELU model:", "",
        "| mode | site | injections | detected | named (the faulty rank alone) | named transient |",
        "|---|---|---|---|---|---|"]
    for mode, parts in res["exponent"].items():
        for site in ("all", *SITES, "changed_bits", *(f"{s} changed_bits" for s in SITES)):
            r = parts[site]
            lines.append(f"| {mode} | {site} | {r['n']} | {_pct(r['detected'])} | "
                         f"{_pct(r['named'])} | {_pct(r['transient'])} |")
    lines += ["", "\"changed_bits\": the flips the exact audit detected, i.e. those that changed "
              "a bit of the loss or of the local gradients (the same faults, element and step, "
              "in both runs). A flip of bit 27, 28 or 29 of a float32 below 2 in magnitude clears an "
              "exponent bit (the value shrinks by 2^16, 2^32 or 2^64); of a zero (a ReLU's "
              "output) it makes a number too small to move anything. Neither audit sees a "
              "flip that changes no bit of the loss or the gradients.", "",
              "## Detected, by bit (every bit, both sites)", "",
              "| bit | activation: tolerant detected | named | exact detected | gradient: "
              "tolerant detected | named | exact detected | trigger between audits: "
              "activation | gradient |", "|---|---|---|---|---|---|---|---|---|"]
    for b in range(32):
        cells = []
        for site in SITES:
            tol = res["bits"]["tolerant"][site][str(b)]
            cells += [_pct(tol["detected"]), _pct(tol["named"]),
                      _pct(res["bits"]["exact"][site][str(b)]["detected"])]
        cells += [_pct(res["trigger"][site][str(b)]["triggered"]) for site in SITES]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    n = res["bits"]["tolerant"]["activation"]["0"]["n"]
    lines += ["", f"{n} flips per bit and site; named: the faulty rank alone. The trigger: "
              "the audit at step 0 only, the faults on the steps after it (the first 8, before "
              "a rank has a history of norms to vote against, included), the share of them "
              "that the norm trigger audited (each trigger's audit named the faulty rank or "
              "nobody)."]
    if "bits_bf16" in res:
        lines += _bf16_md(res["bits_bf16"])
    if "cost" in res:
        lines += _cost_md(res["cost"])
    return lines


def _bf16_md(b: dict[str, Any]) -> list[str]:
    """``bf16_bits``' section of TOLERANT.md."""
    lines = ["", "## Detected, by bit, in bfloat16 (autocast)", "",
             "The GELU model under `torch.autocast` in bfloat16 (the linear products and the "
             "activations after them in bfloat16, the weights and local gradients in float32), "
             "the testbed's noise in the float32 accumulator of each linear product before its "
             f"rounding (`LinearNoise(where=\"accumulator\")`); {b['warmup']} clean audited "
             "steps first, so that the tolerance has left its half-precision ceiling "
             f"({b['warmup_detections']} detections among them; the tolerance then: "
             f"{b['tolerance']:.3g}), then one flip per audited step, both modes on the same "
             f"faults, {b['per_bit']} per bit and site. bfloat16: bit 15 the sign, 7-14 the "
             "exponent, 0-6 the mantissa.", "",
             "| bit | activation (bfloat16): tolerant detected | named | exact detected | "
             "gradient (float32): tolerant detected | named | exact detected |",
             "|---|---|---|---|---|---|---|"]
    for bit in range(max(BF16_BITS.values())):
        cells = []
        for site in SITES:
            tol = b["tolerant"][site].get(str(bit))
            cells += (["", "", ""] if tol is None else
                      [_pct(tol["detected"]), _pct(tol["named"]),
                       _pct(b["exact"][site][str(bit)]["detected"])])
        lines.append(f"| {bit} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tolerant",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--clean", type=int, default=3000, help="clean audited steps (3000)")
    ap.add_argument("--exponent", type=int, default=1200,
                    help="exponent flips per mode (1200)")
    ap.add_argument("--per-bit", type=int, default=16, help="flips per bit and site (16)")
    ap.add_argument("--cost-rounds", type=int, default=12,
                    help="rounds of each mode's cost run (12; 0: none)")
    ap.add_argument("--only-cost", action="store_true",
                    help="the cost part alone, amending OUT/tolerant.json")
    ap.add_argument("--only-bf16", action="store_true",
                    help="the bfloat16 bit sweep alone, amending OUT/tolerant.json")
    ap.add_argument("--only-side-by-side", action="store_true",
                    help="the cost part's side-by-side run alone, amending OUT/tolerant.json")
    ap.add_argument("--keep-cost", action="store_true",
                    help="every part but the cost, keeping OUT/tolerant.json's cost part")
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    if min(args.clean, args.exponent, args.per_bit) < 1 or args.cost_rounds < 0:
        ap.error("--clean, --exponent and --per-bit must be at least 1, --cost-rounds at "
                 "least 0")
    amend = {"--only-cost": args.only_cost, "--only-side-by-side": args.only_side_by_side,
             "--keep-cost": args.keep_cost, "--only-bf16": args.only_bf16}
    if sum(amend.values()) > 1:
        ap.error(f"{', '.join(amend)} each amend another part: give one of them")
    if any(amend.values()):
        flag = next(k for k, v in amend.items() if v)
        path = Path(args.out) / "tolerant.json"
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{flag} amends a full run's {path}, which cannot be read ({e}); run "
                     f"without {flag} first")
        if res.get("cpu") != cpu_name():
            ap.error(f"{flag}: {path} was measured on {res.get('cpu')}, this is "
                     f"{cpu_name()}: run the whole benchmark here")
        if args.only_bf16:
            res["bits_bf16"] = bf16_bits(args.per_bit)
        elif args.keep_cost:
            if not isinstance(res.get("cost"), dict):
                ap.error(f"{flag} keeps the cost part of {path}, which has none: run without "
                         f"{flag}")
            kept = {k: res[k] for k in ("cost", "cost_note") if k in res}
            res = {**tolerant_bench(args.clean, args.exponent, args.per_bit, 0), **kept}
        elif args.only_side_by_side:
            if not isinstance(res.get("cost"), dict):
                ap.error(f"{flag} amends the cost part of {path}, which has none: run with "
                         "--only-cost first")
            res["cost"]["side_by_side"] = side_by_side((args.cost_rounds or 12) + 4)
        else:
            res["cost"] = cost(args.cost_rounds or 12)
    else:
        res = tolerant_bench(args.clean, args.exponent, args.per_bit, args.cost_rounds)
    lines = markdown(res)
    publish(Path(args.out), "tolerant", res, lines)
    (Path(args.out) / "TOLERANT.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
