"""Campaigns: which trials to run, as a deterministic list of frozen ``TrialSpec`` records.

A campaign file names scenario files and one fault space (``[matrix]`` or
``[sample]``, see ``scenarios.spec.FaultSpace``), plus clean trials (no
fault: false positives) and the overhead measurement::

    name = "default"
    scenarios = ["mlp.toml", "cnn_bn.toml"]     # relative to this file
    clean_trials = 3                            # per scenario and replay interval
    overhead_budget = 0.25                      # of the plain-DDP step time

    [matrix]
    sites = ["activation", "weight_storage"]
    fields = ["exponent", "mantissa", "nan"]
    models = ["transient"]
    steps = [3, 11]
    ranks = [1]
    replay_intervals = [0, 2]

    [overhead]
    scenario = "mlp"                            # default: the first scenario
    rounds = 5
    block = 4

    [quick]                                     # overrides for --quick, table by table
    clean_trials = 1
    [quick.matrix]
    fields = ["exponent"]

Trial ids are hashes of what the trial does (scenario, fault, replay interval,
seed), so the same file always yields the same ids: a resumed campaign skips the
ids already in ``trials.csv``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from injectors import Fault
from scenarios.spec import (
    STATE_KEYS,
    FaultSpace,
    Scenario,
    ScenarioError,
    _float,
    _int,
    _known,
    _table,
    _tuples,
    fault_space,
    load_scenario,
    read_toml,
)

CHAOS_ACTIONS: Final = ("raise", "exit", "hang")
Z: Final = {0.9: 1.645, 0.95: 1.96, 0.99: 2.576}
"""Two-sided normal quantiles t for the Leveugle et al. sample size."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Chaos:
    """A harness self-test: make one rank raise, exit or hang at one step (not a data fault)."""

    action: str
    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.action not in CHAOS_ACTIONS:
            raise ScenarioError("chaos.action", self.action, f"one of {list(CHAOS_ACTIONS)}")
        _int("chaos.rank", self.rank, 0)
        _int("chaos.step", self.step, 0)


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
    chaos: Chaos | None = None

    @property
    def kind(self) -> str:
        return "fault" if self.faults else ("chaos" if self.chaos else "clean")


@dataclass(kw_only=True, frozen=True, slots=True)
class OverheadSpec:
    """Step-time overhead: configurations alternated in blocks within one run, medians."""

    scenario: str = ""
    """The scenario to measure on: a campaign scenario's name, or a scenario file (``.toml``,
    relative to the campaign file); empty = the campaign's first scenario."""
    rounds: int = 5
    """How many times each configuration gets a block."""
    block: int = 4
    """Timed steps per block."""
    intervals: tuple[int, ...] = ()
    """Replay intervals to measure; empty = the fault space's (0 excluded) or (1, 2, 4, 8)."""

    def __post_init__(self) -> None:
        _int("overhead.rounds", self.rounds, 1, 1000)
        _int("overhead.block", self.block, 1, 1000)
        for k in self.intervals:
            _int("overhead.intervals", k, 1)


@dataclass(kw_only=True, frozen=True, slots=True)
class CampaignSpec:
    """Scenarios x a fault space, clean trials, and the overhead measurement."""

    name: str
    scenarios: tuple[Scenario, ...]
    space: FaultSpace | None = None
    """The fault matrix / sample; None: each scenario's own ``[[faults]]`` or space."""
    clean_trials: int = 3
    """Fault-free trials per scenario and replay interval (false positives)."""
    overhead: OverheadSpec | None = field(default_factory=OverheadSpec)
    overhead_budget: float = 0.25
    """Acceptable step-time overhead of the replay audit, as a fraction of plain DDP's step
    (the recommended replay interval is the smallest one within it)."""
    overhead_file_scenario: Scenario | None = None
    """The scenario loaded from ``[overhead] scenario = "FILE.toml"``, if given as a file."""
    quick: bool = False

    def __post_init__(self) -> None:
        if not self.scenarios:
            raise ScenarioError("scenarios", [], "a non-empty list of scenario files")
        names = [s.name for s in self.scenarios]
        if len(set(names)) != len(names):
            raise ScenarioError("scenarios", names, "scenarios with distinct names")
        _int("clean_trials", self.clean_trials, 1)  # always measure false positives
        _float("overhead_budget", self.overhead_budget, 0.0, 100.0, lo_open=True)
        if self.overhead is not None and self.overhead.scenario and (
                self.overhead.scenario not in names) and self.overhead_file_scenario is None:
            raise ScenarioError("overhead.scenario", self.overhead.scenario, f"one of {names}")
        if self.space is not None:
            for s in self.scenarios:
                try:
                    self.space.check_against(s)
                except ScenarioError as e:
                    raise ScenarioError(f"{self.space.mode}.{e.field}", e.value, e.allowed,
                                        reason=e.reason) from None

    def scenario(self, name: str) -> Scenario:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise KeyError(name)

    def overhead_scenario(self) -> Scenario:
        if self.overhead_file_scenario is not None:
            return self.overhead_file_scenario
        name = self.overhead.scenario if self.overhead is not None else ""
        return self.scenario(name) if name else self.scenarios[0]

    def overhead_intervals(self) -> tuple[int, ...]:
        if self.overhead is not None and self.overhead.intervals:
            return self.overhead.intervals
        ks = tuple(k for k in (self.space.replay_intervals if self.space else ()) if k > 0)
        return ks or (1, 2, 4, 8)

    def replay_intervals(self) -> tuple[int, ...]:
        if self.space is not None:
            return self.space.replay_intervals
        return tuple(sorted({s.guard.replay_interval for s in self.scenarios}))

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "quick": self.quick, "clean_trials": self.clean_trials,
            "overhead_budget": self.overhead_budget,
            "scenarios": [s.name for s in self.scenarios],
            "replay_intervals": list(self.replay_intervals()),
            "overhead_intervals": list(self.overhead_intervals()),
        }


# -- loading ------------------------------------------------------------------------------------
def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), Mapping) else v
    return out


def campaign_from_dict(data: Mapping[str, Any], *, name: str, base_dir: Path,
                       quick: bool = False) -> CampaignSpec:
    known = ("name", "scenarios", "clean_trials", "overhead_budget", "overhead", "matrix",
             "sample", "quick")
    for key in data:
        if key not in known:
            raise ScenarioError(key, data[key], f"the keys {sorted(known)}", reason="unknown key")
    if quick:
        data = _merge(data, _table(data, "quick"))
    files = data.get("scenarios")
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ScenarioError("scenarios", files, "a non-empty list of scenario file names")
    scenarios = tuple(load_scenario(base_dir / f) for f in files)
    spaces = [m for m in ("matrix", "sample") if m in data]
    if len(spaces) > 1:
        raise ScenarioError("sample", "[matrix] and [sample]", "one of [matrix] or [sample]")
    space = fault_space(data[spaces[0]], spaces[0]) if spaces else None
    ov_table = _table(data, "overhead")
    _known(OverheadSpec, ov_table, "overhead.")
    overhead = OverheadSpec(**_tuples(ov_table))
    ov_file = None
    if overhead.scenario.endswith(".toml"):
        ov_file = load_scenario(base_dir / overhead.scenario)
    return CampaignSpec(
        name=data.get("name", name), scenarios=scenarios, space=space,
        clean_trials=data.get("clean_trials", 3), overhead=overhead,
        overhead_budget=data.get("overhead_budget", 0.25), overhead_file_scenario=ov_file,
        quick=quick,
    )


def load_campaign(path: str | Path, *, quick: bool = False) -> CampaignSpec:
    """Read and validate a campaign file (``quick``: apply its ``[quick]`` overrides)."""
    p = Path(path)
    data = read_toml(p)
    try:
        return campaign_from_dict(data, name=p.stem, base_dir=p.parent, quick=quick)
    except ScenarioError as e:
        raise e.in_file(p) from None


def campaign_for_scenario(scenario: Scenario, *, clean_trials: int = 1) -> CampaignSpec:
    """``python -m scenarios run FILE``: the scenario's own faults, no overhead measurement."""
    return CampaignSpec(name=scenario.name, scenarios=(scenario,), space=None,
                        clean_trials=clean_trials, overhead=None)


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
def _seed_of(*parts: Any) -> int:
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:7], "little")


def _trial_id(scenario: Scenario, *parts: Any) -> str:
    blob = json.dumps([scenario.name, scenario.training_key(), *parts], sort_keys=True,
                      default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def make_fault(scenario: Scenario, *, site: str, field_name: str, model: str, step: int,
               rank: int, seed: int, p: float, sizes: Mapping[str, int]) -> Fault:
    """One fault from matrix axes; target (weighted by elements) and state key drawn from seed."""
    rng = random.Random(seed)
    names = sorted(sizes)
    target = rng.choices(names, weights=[sizes[n] for n in names])[0] if site not in (
        "activation", "activation_grad") else rng.choice(names)
    kw: dict[str, Any] = {"site": site, "rank": rank, "step": step, "target": target,
                          "model": model, "seed": seed % (1 << 31)}
    if field_name in ("nan", "inf"):
        kw.update(kind="set", value=float(field_name))
    else:
        kw.update(kind="bitflip", field=field_name, count=1)
    if site == "optimizer_state":
        kw["state_key"] = rng.choice(STATE_KEYS[scenario.optimizer.kind])
    if model == "intermittent":
        kw["p"] = p
    if model == "permanent" and site in ("activation", "activation_grad"):
        kw["phase"] = "any"  # a broken unit also corrupts the audit's recomputations
    return Fault(**kw)


def _fault_trial(scenario: Scenario, space: FaultSpace, combo: tuple[Any, ...], seed: int,
                 sizes: Mapping[str, int]) -> TrialSpec | None:
    k, site, fld, model, step, rank = combo
    if site == "optimizer_state" and step == 0:
        return None  # no optimizer state exists before the first step
    fault = make_fault(scenario, site=site, field_name=fld, model=model, step=step, rank=rank,
                       seed=seed, p=space.p, sizes=sizes)
    tid = _trial_id(scenario, k, fault.to_dict())
    return TrialSpec(id=tid, scenario=scenario.name, replay_interval=k, faults=(fault,),
                     site=site, field=fld, fault_model=model)


def _space_trials(scenario: Scenario, space: FaultSpace) -> list[TrialSpec]:
    ranks = space.ranks or tuple(range(scenario.world_size))
    steps = space.steps or tuple(range(1, scenario.steps))
    sizes = {site: scenario.target_sizes(site) for site in space.sites}
    out: list[TrialSpec] = []
    if space.mode == "matrix":
        for combo in itertools.product(space.replay_intervals, space.sites, space.fields,
                                       space.models, steps, ranks):
            for rep in range(space.repeat):
                seed = _seed_of(space.seed, scenario.name, combo, rep)
                t = _fault_trial(scenario, space, combo, seed, sizes[combo[1]])
                if t is not None:
                    out.append(t)
        return out
    for site in space.sites:
        n = space.trials_per_site
        if not n:
            population = (sum(sizes[site].values()) * _bits(scenario) * len(steps) * len(ranks)
                          * len(space.models) * len(space.replay_intervals))
            n = leveugle_sample_size(population, space.margin, space.confidence)
        rng = random.Random(_seed_of(space.seed, scenario.name, site))
        site_steps = [s for s in steps if site != "optimizer_state" or s > 0] or [1]
        for i in range(n):
            combo = (rng.choice(space.replay_intervals), site, rng.choice(space.fields),
                     rng.choice(space.models), rng.choice(site_steps), rng.choice(ranks))
            seed = _seed_of(space.seed, scenario.name, site, i)
            trial = _fault_trial(scenario, space, combo, seed, sizes[site])
            if trial is not None:
                out.append(trial)
    return out


def _explicit_trials(scenario: Scenario) -> list[TrialSpec]:
    k = scenario.guard.replay_interval
    return [TrialSpec(id=_trial_id(scenario, k, f.to_dict(), i), scenario=scenario.name,
                      replay_interval=k, faults=(f,), site=f.site,
                      field=f.field or (f.kind if f.kind != "bitflip" else "custom"),
                      fault_model=f.model)
            for i, f in enumerate(scenario.faults)]


def clean_trials(scenario: Scenario, intervals: tuple[int, ...], count: int) -> list[TrialSpec]:
    return [TrialSpec(id=_trial_id(scenario, k, "clean", i), scenario=scenario.name,
                      replay_interval=k)
            for k in intervals for i in range(count)]


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


def plan_trials(campaign: CampaignSpec) -> list[TrialSpec]:
    """Every trial of the campaign, in a fixed order (the same list on every call)."""
    trials: list[TrialSpec] = []
    for scenario in campaign.scenarios:
        space = campaign.space or scenario.space
        if space is not None:
            faults = _space_trials(scenario, space)
            intervals = space.replay_intervals
        else:
            faults = _explicit_trials(scenario)
            intervals = (scenario.guard.replay_interval,)
        clean = clean_trials(scenario, intervals, campaign.clean_trials)
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
