"""Which trials a campaign runs: a deterministic list of frozen ``TrialSpec`` records.

Each scenario of the campaign gets its fault trials (its fault space, sampled or
as a full matrix, or its own ``[[faults]]``) and clean trials (no fault: false
positives), spread evenly among them. Every choice is seeded by
``scenarios.spec.seeds.seed_of``, and trial ids are hashes of what the trial does
(scenario, fault, replay interval, seed), so the same file always yields the same
ids: a resumed campaign skips the ids already in ``trials.csv``.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from injectors import Fault
from injectors.fault import PRODUCTS
from injectors.patterns import PATTERNS, pattern_fields
from scenarios.spec.campaign import CampaignSpec
from scenarios.spec.errors import ScenarioError, need_int
from scenarios.spec.faults import FaultSpace
from scenarios.spec.limits import MAX_STEPS, MAX_TRIALS, MAX_WORLD_SIZE
from scenarios.spec.scenario import SHARDED_SITES, Scenario
from scenarios.spec.seeds import seed_of

CHAOS_ACTIONS: Final = ("raise", "exit", "hang", "kill")
"""What a ``Chaos`` rank does: raise, exit (status 17), hang, or SIGKILL itself (standing in
for a kill from outside the harness: a person, a scheduler, the OOM killer)."""
Z: Final = {0.9: 1.645, 0.95: 1.96, 0.99: 2.576}
"""Two-sided normal quantiles t for the Leveugle et al. sample size."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Chaos:
    """A harness self-test: make one rank raise, exit, hang or be killed at one step (not a
    data fault)."""

    action: str
    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.action not in CHAOS_ACTIONS:
            raise ScenarioError("chaos.action", self.action, f"one of {list(CHAOS_ACTIONS)}")
        need_int("chaos.rank", self.rank, 0, MAX_WORLD_SIZE - 1)
        need_int("chaos.step", self.step, 0, MAX_STEPS - 1)


@dataclass(kw_only=True, frozen=True, slots=True)
class TrialSpec:
    """One trial: a scenario, the faults armed for it (none: a clean trial), a replay interval."""

    id: str
    scenario: str
    replay_interval: int
    faults: tuple[Fault, ...] = ()
    site: str = ""
    """Label for tables: the (first) fault's site; empty for clean trials."""
    field: str = ""
    """Label: the bit field (sign / exponent / mantissa / any / nan / inf), or "custom"."""
    fault_model: str = ""
    pattern: str = "single"
    """Label: the fault's shape (``injectors.patterns``; "single" for one bit, and for clean
    and explicit trials)."""
    chaos: Chaos | None = None
    checksum: bool | None = None
    """The checksum check on or off in this trial (the campaign's ``checksum`` axis); None:
    as the scenario's ``[guard]`` says."""
    deterministic: bool | None = None
    """False: the trial runs on the scenario's ``nondeterministic()`` testbed with the tolerant
    replay audit (the campaign's ``deterministic`` axis); None or True: as the scenario says."""
    parallel: str = "ddp"
    """Label for tables: the scenario's parallelism and mesh (``Scenario.parallel_label``:
    ddp, fsdp4, hsdp3x2, ...)."""

    @property
    def kind(self) -> str:
        return "fault" if self.faults else ("chaos" if self.chaos else "clean")


# -- sample size --------------------------------------------------------------------------------
def leveugle_sample_size(population: int, margin: float, confidence: float = 0.95,
                         p: float = 0.5) -> int:
    """Statistical fault injection (Leveugle et al., DATE 2009): trials for a margin of error.

    ``n = N / (1 + e^2 (N - 1) / (t^2 p (1 - p)))`` for a population of ``N`` faults,
    margin ``e``, the normal quantile ``t`` of the confidence level and the expected
    proportion ``p`` (0.5: the worst case). Rounded up.
    """
    if population < 1:
        return 0
    t = Z[confidence]
    n = population / (1 + margin**2 * (population - 1) / (t**2 * p * (1 - p)))
    return min(population, math.ceil(n - 1e-9))


def _bits(scenario: Scenario) -> int:
    return 32 if scenario.dtype == "float32" else 16


# -- building trials ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=64)
def _training_key(scenario: Scenario) -> str:
    """``scenario.training_key()``, computed once per scenario (every trial id hashes it)."""
    return scenario.training_key()


def _trial_id(scenario: Scenario, *parts: Any) -> str:
    blob = json.dumps([scenario.name, _training_key(scenario), *parts], sort_keys=True,
                      default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _fits(pattern: str, shape: tuple[int, ...]) -> bool:
    """Does ``pattern``'s span fit a tensor of ``shape``?"""
    burst, along = PATTERNS[pattern].span
    stride = shape[-1] if along == "column" and shape else 1
    return (burst - 1) * stride + 1 <= math.prod(shape)


def make_fault(scenario: Scenario, *, site: str, field_name: str, model: str, step: int,
               rank: int, seed: int, p: float, sizes: Mapping[str, int],
               pattern: str = "single") -> Fault:
    """One fault from matrix axes; target (weighted by elements) and state key drawn from seed.

    A ``pattern`` other than "single" (``injectors.patterns``) lays its fields over the
    one-bit fault, and its target is drawn among those its span fits (the product, for a
    linear product, drawn first: on its own stream, as for "single")."""
    rng = random.Random(seed)
    names = sorted(sizes)
    product = random.Random(f"{seed}/product").choice(PRODUCTS)
    if pattern != "single":
        rank_of = rank if scenario.sharded and site in SHARDED_SITES else None
        shapes = _target_shapes(scenario, site, rank_of,
                                product if site == "linear_product" else None)
        names = [n for n in names if _fits(pattern, shapes[n])]
        if not names:
            raise ScenarioError("patterns", pattern, f"a pattern whose span fits a {site} target "
                                f"of scenario {scenario.name!r}", reason="none of its targets "
                                f"holds {PATTERNS[pattern].span[0]} elements "
                                f"along a {PATTERNS[pattern].span[1]}")
    target = rng.choices(names, weights=[sizes[n] for n in names])[0] if site not in (
        "activation", "activation_grad") else rng.choice(names)  # linear_product: by weight size
    kw: dict[str, Any] = {"site": site, "rank": rank, "step": step, "target": target,
                          "model": model, "seed": seed % (1 << 31)}
    if field_name in ("nan", "inf"):
        kw.update(kind="set", value=float(field_name))
    else:
        kw.update(kind="bitflip", field=field_name, count=1)
    if site == "optimizer_state":
        kw["state_key"] = rng.choice(scenario.state_keys(target))
    if model == "intermittent":
        kw["p"] = p
    if site == "linear_product":
        kw["product"] = product
    if pattern != "single":
        kw = pattern_fields(pattern, kw)
    if kw["model"] == "permanent" and site in ("activation", "activation_grad", "linear_product"):
        kw["phase"] = "any"  # a broken unit also corrupts the audit's recomputations
    return Fault(**kw)


@functools.lru_cache(maxsize=256)
def _target_shapes(scenario: Scenario, site: str, rank: int | None,
                   product: str | None) -> dict[str, tuple[int, ...]]:
    """``scenario.target_shapes(site, rank, product)``, once per scenario and arguments."""
    return scenario.target_shapes(site, rank, product)


def _fault_trial(scenario: Scenario, space: FaultSpace, combo: tuple[Any, ...], seed: int,
                 sizes: Mapping[str, int], pattern: str = "single") -> TrialSpec | None:
    k, site, fld, model, step, rank, checksum, deterministic = combo
    if site == "optimizer_state" and step == 0:
        return None  # no optimizer state exists before the first step
    if scenario.sharded and site in SHARDED_SITES:  # the faulty rank's shards, none empty
        sizes = {n: v for n, v in _shard_sizes(scenario, site, rank).items() if v}
    fault = make_fault(scenario, site=site, field_name=fld, model=model, step=step, rank=rank,
                       seed=seed, p=space.p, sizes=sizes, pattern=pattern)
    tid = _trial_id(scenario, k, fault.to_dict(), *_axis_parts(checksum, deterministic))
    label = fld if pattern == "single" else (fault.field or "value")
    return TrialSpec(id=tid, scenario=scenario.name, replay_interval=k, faults=(fault,),
                     site=site, field=label, fault_model=fault.model, checksum=checksum,
                     deterministic=deterministic, parallel=scenario.parallel_label,
                     pattern=pattern)


def _axis_parts(checksum: bool | None, deterministic: bool | None) -> tuple[Any, ...]:
    """What the checksum and determinism axes add to a trial's id: nothing where a trial runs
    as it would without them (so ids stay as they were)."""
    return ((() if checksum is None else ({"checksum": checksum},))
            + (({"deterministic": False},) if deterministic is False else ()))


def scenario_of(campaign: CampaignSpec, trial: TrialSpec) -> Scenario:
    """The scenario ``trial`` runs on: its campaign scenario, or that scenario's
    ``nondeterministic()`` testbed for a ``deterministic = false`` trial."""
    sc = campaign.scenario(trial.scenario)
    return sc.nondeterministic() if trial.deterministic is False else sc


@functools.lru_cache(maxsize=256)
def _shard_sizes(scenario: Scenario, site: str, rank: int) -> dict[str, int]:
    """``scenario.target_sizes(site, rank)``, once per scenario, site and rank."""
    return scenario.target_sizes(site, rank)


def _space_trials(scenario: Scenario, space: FaultSpace) -> list[TrialSpec]:
    ranks = space.ranks or tuple(range(scenario.world_size))
    steps = space.steps or tuple(range(1, scenario.steps))
    sizes = {site: scenario.target_sizes(site) for site in space.sites}
    out: list[TrialSpec] = []
    if space.mode == "matrix":
        for combo in itertools.product(space.replay_intervals, space.sites, space.fields,
                                       space.models, steps, ranks, space.checksum or (None,),
                                       space.deterministic or (None,)):
            for pattern in space.patterns:
                for rep in range(space.repeat):
                    key: Any = (combo[:6] + (() if combo[6] is None else (combo[6],))
                                + (() if combo[7] is None else ({"deterministic": combo[7]},)))
                    seed = (seed_of(space.seed, scenario.name, key, rep) if pattern == "single"
                            else seed_of(space.seed, scenario.name, key, rep, pattern))
                    t = _fault_trial(scenario, space, combo, seed, sizes[combo[1]], pattern)
                    if t is not None:
                        out.append(t)
        return out
    for site in space.sites:
        n = space.trials_per_site
        if not n:
            population = (sum(sizes[site].values()) * _bits(scenario) * len(steps) * len(ranks)
                          * len(space.models) * len(space.replay_intervals))
            n = leveugle_sample_size(population, space.margin, space.confidence)
        rng = random.Random(seed_of(space.seed, scenario.name, site))
        site_steps = [s for s in steps if site != "optimizer_state" or s > 0] or [1]
        for i in range(n):
            seed = seed_of(space.seed, scenario.name, site, i)
            combo = (rng.choice(space.replay_intervals), site, rng.choice(space.fields),
                     rng.choice(space.models), rng.choice(site_steps), rng.choice(ranks),
                     # a stream of its own: the other draws stay as they were without the axis
                     random.Random(f"{seed}/checksum").choice(space.checksum)
                     if space.checksum else None,
                     random.Random(f"{seed}/deterministic").choice(space.deterministic)
                     if space.deterministic else None)
            # a stream of its own too: without the axis every draw is as it was
            pattern = (random.Random(f"{seed}/pattern").choice(space.patterns)
                       if space.patterns != ("single",) else "single")
            trial = _fault_trial(scenario, space, combo, seed, sizes[site], pattern)
            if trial is not None:
                out.append(trial)
    return out


def _explicit_trials(scenario: Scenario) -> list[TrialSpec]:
    k = scenario.guard.replay_interval
    return [TrialSpec(id=_trial_id(scenario, k, f.to_dict(), i), scenario=scenario.name,
                      replay_interval=k, faults=(f,), site=f.site,
                      field=f.field or (f.kind if f.kind != "bitflip" else "custom"),
                      fault_model=f.model, parallel=scenario.parallel_label)
            for i, f in enumerate(scenario.faults)]


def clean_trials(scenario: Scenario, intervals: tuple[int, ...], count: int,
                 checksum: tuple[bool, ...] = (),
                 deterministic: tuple[bool, ...] = ()) -> list[TrialSpec]:
    return [TrialSpec(id=_trial_id(scenario, k, "clean", i, *_axis_parts(c, d)),
                      scenario=scenario.name, replay_interval=k, checksum=c, deterministic=d,
                      parallel=scenario.parallel_label)
            for k in intervals for c in (checksum or (None,)) for d in (deterministic or (None,))
            for i in range(count)]


def _interleave(faults: list[TrialSpec], clean: list[TrialSpec]) -> list[TrialSpec]:
    """Clean trials spread evenly among the fault trials (each checks the reset after faults)."""
    if not clean:
        return faults
    out: list[TrialSpec] = []
    every = max(1, len(faults) // len(clean))
    it = iter(clean)
    for i, t in enumerate(faults):
        if i % every == 0:
            c = next(it, None)
            if c is not None:
                out.append(c)
        out.append(t)
    out.extend(it)
    return out


def count_trials(campaign: CampaignSpec) -> dict[str, int]:
    """How many trials ``plan_trials`` builds at most, by part (``"<scenario>: clean_trials"``,
    ``"<scenario>: [matrix]"``, ...), counted without building them."""
    parts: dict[str, int] = {}
    for scenario in campaign.scenarios:
        space = campaign.space_for(scenario)
        if space is None:
            parts[f"{scenario.name}: [[faults]]"] = len(scenario.faults)
            intervals = 1
        else:
            intervals = len(space.replay_intervals)
            axes = max(1, len(space.checksum)) * max(1, len(space.deterministic))
            ranks = len(space.ranks) or scenario.world_size
            steps = len(space.steps) or scenario.steps - 1
            if space.mode == "matrix":
                parts[f"{scenario.name}: [matrix]"] = (
                    intervals * len(space.sites) * len(space.fields) * len(space.models) * steps
                    * ranks * axes * space.repeat * len(space.patterns))
            else:
                parts[f"{scenario.name}: [sample]"] = sum(
                    space.trials_per_site or leveugle_sample_size(
                        sum(scenario.target_sizes(site).values()) * _bits(scenario) * steps
                        * ranks * len(space.models) * intervals, space.margin,
                        space.confidence)
                    for site in space.sites)
            intervals *= axes
        parts[f"{scenario.name}: clean_trials"] = intervals * campaign.clean_trials
    return parts


def check_trial_count(campaign: CampaignSpec) -> int:
    """The planned trials' count (``count_trials``), or a ``ScenarioError`` naming the part
    that pushes it past ``MAX_TRIALS`` (before any trial is built)."""
    parts = count_trials(campaign)
    total = sum(parts.values())
    if total > MAX_TRIALS:
        part, n = max(parts.items(), key=lambda kv: kv[1])
        table = part.split(": ", 1)[1]
        field = {"[matrix]": "matrix", "[sample]": "sample", "[[faults]]": "faults"}.get(
            table, table)
        raise ScenarioError(field, f"{total:,} trials", f"at most {MAX_TRIALS:,} trials in a "
                            "campaign (scenarios.spec.limits.MAX_TRIALS)",
                            reason=f"the largest part, {part}, plans {n:,}; fewer axes values, "
                                   "repeat, trials_per_site or clean_trials, or a larger margin")
    return total


def plan_trials(campaign: CampaignSpec) -> list[TrialSpec]:
    """Every trial of the campaign, in a fixed order (the same list on every call); a
    ``ScenarioError`` when it would be more than ``MAX_TRIALS`` (``check_trial_count``)."""
    check_trial_count(campaign)
    trials: list[TrialSpec] = []
    for scenario in campaign.scenarios:
        space = campaign.space_for(scenario)
        if space is not None:
            faults = _space_trials(scenario, space)
            intervals = space.replay_intervals
        else:
            faults = _explicit_trials(scenario)
            intervals = (scenario.guard.replay_interval,)
        clean = clean_trials(scenario, intervals, campaign.clean_trials,
                             space.checksum if space is not None else (),
                             space.deterministic if space is not None else ())
        trials += _interleave(faults, clean)
    ids = [t.id for t in trials]
    if len(set(ids)) != len(ids):  # two combinations drew the very same fault: run it once
        unique: dict[str, TrialSpec] = {}
        for t in trials:
            unique.setdefault(t.id, t)
        trials = list(unique.values())
    return trials


def describe(campaign: CampaignSpec, trials: list[TrialSpec]) -> dict[str, Any]:
    """Counts per scenario / site / kind, for the log and the report."""
    by: dict[str, int] = {}
    for t in trials:
        key = f"{t.scenario}/{t.site or t.kind}"
        by[key] = by.get(key, 0) + 1
    return {"campaign": campaign.name, "trials": len(trials), "by_scenario_site": by}
