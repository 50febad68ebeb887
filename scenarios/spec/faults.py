"""Fault spaces: a campaign's faults as a full matrix of axes or a random sample from them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final

from injectors import MODELS as FAULT_MODELS
from injectors import SITES
from injectors.patterns import PATTERNS
from scenarios.spec.errors import (
    ScenarioError,
    need_choice,
    need_choices,
    need_int,
    need_ints,
    need_number,
)
from scenarios.spec.limits import MAX_SEED, MAX_STEPS, MAX_TRIALS, MAX_WORLD_SIZE
from scenarios.spec.tables import known_keys, tuples

if TYPE_CHECKING:
    from scenarios.spec.scenario import Scenario

FIELDS: Final = ("sign", "exponent", "mantissa", "any", "nan", "inf")
"""Bit fields of a campaign: one random bit of the sign / exponent / mantissa / any field
(a bit flip), or the whole element set to NaN / +Inf (a value fault)."""
BIT_FIELDS: Final = frozenset({"sign", "exponent", "mantissa", "any"})
"""The fields of ``FIELDS`` that flip bits (the others write a value)."""
MODES: Final = ("matrix", "sample")
STATE_KEYS: Final = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",),
                     "muon": ("momentum_buffer", "exp_avg", "exp_avg_sq")}
"""The optimizer state tensors of each optimizer kind (targets of ``optimizer_state`` faults).
``"muon"``: Muon's momentum for the 2-D parameters, AdamW's moments for the rest
(``state_keys``)."""


def state_keys(kind: str, dims: int) -> tuple[str, ...]:
    """The state tensors an optimizer of ``kind`` keeps for a parameter of ``dims``
    dimensions (Muon updates only matrices; AdamW beside it the rest)."""
    if kind == "muon":
        return ("momentum_buffer",) if dims == 2 else ("exp_avg", "exp_avg_sq")
    return STATE_KEYS[kind]


@dataclass(kw_only=True, frozen=True, slots=True)
class FaultSpace:
    """A campaign's faults: a full matrix of its axes, or a random sample from them.

    Each trial gets one fault: a site, a bit field, a fault model, a first step, a
    rank and a replay interval from the axes; its target (a module for activation
    sites, a parameter otherwise) and the element inside it are drawn from the
    trial's seed. ``optimizer_state`` faults at step 0 are left out of a matrix
    (optimizers create their state in the first step).
    """

    mode: str = "matrix"
    """``"matrix"`` (every combination of the axes) or ``"sample"`` (random draws)."""
    sites: tuple[str, ...] = SITES
    fields: tuple[str, ...] = ("sign", "exponent", "mantissa")
    """Bit fields: ``FIELDS`` (sign / exponent / mantissa / any: one random bit; nan / inf)."""
    models: tuple[str, ...] = ("transient",)
    """Fault models: transient, intermittent, permanent."""
    patterns: tuple[str, ...] = ("single",)
    """Shapes of the fault (``injectors.patterns.PATTERNS``): single (one bit), multi_bit,
    burst_same, burst_random, column, whole_value, stuck. Each trial draws one; ``single``
    alone plans the trials a space without the axis plans."""
    steps: tuple[int, ...] = ()
    """First steps; empty = every step from 1 to the scenario's last (sample mode)."""
    ranks: tuple[int, ...] = ()
    """Faulty ranks; empty = every rank."""
    replay_intervals: tuple[int, ...] = (0,)
    """Replay audit intervals to run the trials under (0 = audit off)."""
    checksum: tuple[bool, ...] = ()
    """The checksum check off and/or on (``[false, true]``: each trial draws one, clean trials
    run under each); empty: as each scenario's ``[guard]`` says."""
    deterministic: tuple[bool, ...] = ()
    """Deterministic kernels and the exact replay audit (``true``) and/or kernels that are not
    deterministic and the tolerant audit (``false``: the scenario's ``nondeterministic()``
    testbed, a golden run of its own): each trial draws one, clean trials run under each;
    empty: as each scenario says. DDP scenarios only."""
    p: float = 0.5
    """Intermittent faults: probability of firing at each step."""
    repeat: int = 1
    """Matrix mode: trials per combination (each with its own seed: other targets, elements)."""
    trials_per_site: int = 0
    """Sample mode: trials per site; 0 = sized by ``margin`` (Leveugle et al. 2009)."""
    margin: float = 0.1
    """Sample mode: target margin of error of each site's coverage."""
    confidence: float = 0.95
    """Sample mode: confidence level of ``margin`` (0.90, 0.95 or 0.99)."""
    seed: int = 0
    """Seeds the sample, the targets and the elements: trial ids are a function of it."""

    def __post_init__(self) -> None:
        need_choice("mode", self.mode, MODES)
        need_choices("sites", self.sites, SITES)
        need_choices("fields", self.fields, FIELDS)
        need_choices("models", self.models, FAULT_MODELS)
        need_choices("patterns", self.patterns, tuple(PATTERNS))
        if self.patterns != ("single",) and not set(self.fields) <= BIT_FIELDS:
            raise ScenarioError("fields", list(self.fields), "bit fields only "
                                f"({', '.join(sorted(BIT_FIELDS))}) beside patterns other than "
                                "single: nan and inf are values, not bits a pattern shapes")
        need_ints("steps", self.steps, 0, MAX_STEPS - 1, empty=True)
        need_ints("ranks", self.ranks, 0, MAX_WORLD_SIZE - 1, empty=True)
        need_ints("replay_intervals", self.replay_intervals, 0, MAX_STEPS)
        if not isinstance(self.checksum, tuple) or any(
                not isinstance(c, bool) for c in self.checksum) or len(set(self.checksum)) != len(
                self.checksum):
            raise ScenarioError("checksum", self.checksum, "a list of distinct booleans, e.g. "
                                "[false, true] (or leave it out)")
        if not isinstance(self.deterministic, tuple) or any(
                not isinstance(d, bool) for d in self.deterministic) or len(
                set(self.deterministic)) != len(self.deterministic):
            raise ScenarioError("deterministic", self.deterministic, "a list of distinct "
                                "booleans, e.g. [true, false] (or leave it out)")
        need_number("p", self.p, 0.0, 1.0, lo_open=True)
        need_int("repeat", self.repeat, 1, 1000)
        need_int("trials_per_site", self.trials_per_site, 0, MAX_TRIALS)
        need_number("margin", self.margin, 0.0, 0.5, lo_open=True)
        need_choice("confidence", self.confidence, (0.9, 0.95, 0.99))
        need_int("seed", self.seed, 0, MAX_SEED)
        if self.mode == "matrix" and not self.steps:
            raise ScenarioError("steps", [], "a non-empty list of steps in matrix mode")

    def check_against(self, scenario: Scenario) -> None:
        """Refuse steps and ranks the scenario does not have (fields under the space's
        mode)."""
        for s in self.steps:
            if s >= scenario.steps:
                raise ScenarioError("steps", s, f"steps in [0, {scenario.steps - 1}] "
                                    f"(scenario {scenario.name!r} trains {scenario.steps} steps)"
                                    ).under(self.mode)
        for r in self.ranks:
            if r >= scenario.world_size:
                raise ScenarioError("ranks", r, f"ranks in [0, {scenario.world_size - 1}] "
                                    f"(scenario {scenario.name!r} has {scenario.world_size})"
                                    ).under(self.mode)


def fault_space(table: Mapping[str, Any], mode: str) -> FaultSpace:
    """A ``FaultSpace`` from a ``[matrix]`` or ``[sample]`` table."""
    if not isinstance(table, Mapping):
        raise ScenarioError(mode, table, f"a TOML table ([{mode}])")
    known_keys(table, [f.name for f in fields(FaultSpace)], f"{mode}.")
    if "mode" in table and table["mode"] != mode:
        raise ScenarioError(f"{mode}.mode", table["mode"], f"{mode!r} (or leave it out)")
    try:
        return FaultSpace(**{**tuples(table), "mode": mode})
    except ScenarioError as e:
        raise e.under(mode) from None


def space_of(data: Mapping[str, Any]) -> FaultSpace | None:
    """The ``[matrix]`` or ``[sample]`` table of a scenario or campaign file, if any."""
    spaces = [m for m in MODES if m in data]
    if len(spaces) > 1:
        raise ScenarioError("sample", "[matrix] and [sample]", "one of [matrix] or [sample]")
    return fault_space(data[spaces[0]], spaces[0]) if spaces else None
