"""Campaigns: which trials to run, as a deterministic list of frozen ``TrialSpec`` records.

A campaign file names scenario files and one fault space (``[matrix]`` or
``[sample]``, see ``scenarios.spec.faults.FaultSpace``), plus clean trials (no
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

    [overhead]                                  # or overhead = false: none measured
    scenario = "mlp"                            # default: the first scenario (a DDP one)
    rounds = 5
    block = 4

    [quick]                                     # overrides for --quick, table by table
    clean_trials = 1
    [quick.matrix]
    fields = ["exponent"]

Which trials it runs: ``scenarios.spec.trials.plan_trials``.
"""


from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from scenarios.spec.cluster import ClusterSpec, cluster_from_table
from scenarios.spec.errors import ScenarioError, need_int, need_number
from scenarios.spec.faults import FaultSpace, space_of
from scenarios.spec.limits import MAX_STEPS, MAX_TRIALS
from scenarios.spec.paths import need_name
from scenarios.spec.scenario import Scenario, load_scenario
from scenarios.spec.tables import known_keys, merge, read_toml, table_of, tuples


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
        need_int("overhead.rounds", self.rounds, 1, 1000)
        need_int("overhead.block", self.block, 1, 1000)
        for k in self.intervals:
            need_int("overhead.intervals", k, 1, MAX_STEPS)


@dataclass(kw_only=True, frozen=True, slots=True)
class CampaignSpec:
    """Scenarios x a fault space, clean trials, and the overhead measurement."""

    name: str
    scenarios: tuple[Scenario, ...]
    space: FaultSpace | None = None
    """The fault matrix / sample of every scenario that gives none of its own (a scenario's
    own ``[[faults]]``, ``[matrix]`` or ``[sample]`` wins: ``space_for``)."""
    clean_trials: int = 3
    """Fault-free trials per scenario and replay interval (false positives)."""
    overhead: OverheadSpec | None = field(default_factory=OverheadSpec)
    overhead_budget: float = 0.25
    """Acceptable step-time overhead of the replay audit, as a fraction of plain DDP's step
    (the recommended replay interval is the smallest one within it)."""
    overhead_file_scenario: Scenario | None = None
    """The scenario loaded from ``[overhead] scenario = "FILE.toml"``, if given as a file."""
    quick: bool = False
    cluster: ClusterSpec | None = None
    """The ``[cluster]`` table the report's cost model prices on (``scenarios.spec.cluster``);
    None: its documented defaults."""

    def __post_init__(self) -> None:
        need_name("name", self.name)
        if not self.scenarios:
            raise ScenarioError("scenarios", [], "a non-empty list of scenario files")
        names = [s.name for s in self.scenarios]
        if len(set(names)) != len(names):
            raise ScenarioError("scenarios", names, "scenarios with distinct names")
        need_int("clean_trials", self.clean_trials, 1, MAX_TRIALS)  # false positives, always
        need_number("overhead_budget", self.overhead_budget, 0.0, 100.0, lo_open=True)
        if self.overhead is not None and self.overhead.scenario and (
                self.overhead.scenario not in names) and self.overhead_file_scenario is None:
            raise ScenarioError("overhead.scenario", self.overhead.scenario, f"one of {names}")
        for s in self.scenarios:
            if self.space is not None and self.space_for(s) is self.space:
                self.space.check_against(s)
            space = self.space_for(s)
            if space is not None and False in space.deterministic and (
                    s.nondeterministic().name in names and s.noise_ulps == 0):
                raise ScenarioError("scenarios", names, "scenario names that are not another's "
                                    "testbed name", reason=f"the deterministic axis runs "
                                    f"{s.name!r}'s false trials as {s.nondeterministic().name!r}, "
                                    "a scenario of the campaign's own: rename it")
        if self.overhead is not None and self.overhead_scenario().parallel != "ddp":
            raise ScenarioError("overhead.scenario", self.overhead_scenario().name,
                                "a scenario with parallel = 'ddp' (name one, or set "
                                "overhead = false)", reason="the overhead measurement compares "
                                "the guard's checks, the replay audit among them, with plain DDP")

    def space_for(self, scenario: Scenario) -> FaultSpace | None:
        """The fault space ``scenario``'s trials are drawn from: its own (a scenario file with
        ``[matrix]``/``[sample]``, or ``[[faults]]``: then None, the explicit list) when it
        gives one, else the campaign's. So a campaign can hold a scenario with a space of its
        own, e.g. a sharded one, whose guard refuses some of the campaign's axes."""
        if scenario.space is not None or scenario.faults:
            return scenario.space
        return self.space

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
            **({"cluster": self.cluster.to_json()} if self.cluster is not None else {}),
        }


# -- loading ------------------------------------------------------------------------------------
def campaign_from_dict(data: Mapping[str, Any], *, name: str, base_dir: Path,
                       quick: bool = False, full: bool = False) -> CampaignSpec:
    """Build a ``CampaignSpec`` from a parsed campaign file (scenario files relative to
    ``base_dir``; ``quick``: with its ``[quick]`` overrides applied; ``full``: with its
    ``[full]`` ones, the larger campaign a file may describe beside its default)."""
    known_keys(data, ("name", "scenarios", "clean_trials", "overhead_budget", "overhead",
                      "matrix", "sample", "quick", "full", "cluster"), "")
    if quick and full:
        raise ScenarioError("--full", "with --quick", "one of --quick or --full")
    if quick:
        data = merge(data, table_of(data, "quick"))
    if full:
        if "full" not in data:
            raise ScenarioError("--full", "no [full] table", "a campaign file with a [full] "
                                "table of overrides (scenarios/configs/field.toml has one)")
        data = merge(data, table_of(data, "full"))
    files = data.get("scenarios")
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ScenarioError("scenarios", files, "a non-empty list of scenario file names")
    scenarios = tuple(load_scenario(base_dir / f) for f in files)
    space = space_of(data)
    overhead: OverheadSpec | None = None
    ov_file = None
    if data.get("overhead") is not False:  # overhead = false: no overhead measurement
        ov_table = table_of(data, "overhead")
        known_keys(ov_table, [f.name for f in fields(OverheadSpec)], "overhead.")
        overhead = OverheadSpec(**tuples(ov_table))
        if overhead.scenario.endswith(".toml"):
            ov_file = load_scenario(base_dir / overhead.scenario)
    return CampaignSpec(
        name=data.get("name", name), scenarios=scenarios, space=space,
        clean_trials=data.get("clean_trials", 3), overhead=overhead,
        overhead_budget=data.get("overhead_budget", 0.25), overhead_file_scenario=ov_file,
        quick=quick,
        cluster=cluster_from_table(table_of(data, "cluster")) if "cluster" in data else None,
    )


def load_campaign(path: str | Path, *, quick: bool = False, full: bool = False) -> CampaignSpec:
    """Read and validate a campaign file (``quick`` / ``full``: apply its ``[quick]`` /
    ``[full]`` overrides)."""
    p = Path(path)
    data = read_toml(p)
    try:
        return campaign_from_dict(data, name=p.stem, base_dir=p.parent, quick=quick,
                                  full=full)
    except ScenarioError as e:
        raise e.in_file(p) from None


def campaign_for_scenario(scenario: Scenario, *, clean_trials: int = 1) -> CampaignSpec:
    """``python -m scenarios run FILE``: the scenario's own faults, no overhead measurement."""
    return CampaignSpec(name=scenario.name, scenarios=(scenario,), space=None,
                        clean_trials=clean_trials, overhead=None)
