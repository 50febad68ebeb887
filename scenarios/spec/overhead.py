"""The guard configurations whose step-time overhead is measured, declared once.

The campaign's overhead rounds (``scenarios.run.rank``), its report
(``scenarios.report``) and the benchmark (``bench``) all measure and name these
same records. Each is a ``sdc_guard.GuardConfig`` (``None``: plain DDP, no guard);
``for_scenario`` fills in what a scenario decides (seed, micro-batches, whether
the weights check covers the optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sdc_guard import ChecksumConfig, GuardConfig

if TYPE_CHECKING:
    from scenarios.spec.scenario import Scenario


@dataclass(frozen=True, slots=True, kw_only=True)
class OverheadConfig:
    """One configuration whose step time is measured against plain DDP."""

    name: str
    """Its label in ``overhead.json``, ``bench/results.json`` and the tables."""
    config: GuardConfig | None
    """The guard's configuration; None: plain DDP without a guard (the baseline)."""
    key: str = ""
    """Its key among the campaign's headline overheads (``overhead.<key>`` in
    ``summary.json``); empty for configurations reported only by name."""

    def for_scenario(self, scenario: Scenario) -> GuardConfig | None:
        """The configuration with the scenario's seed, micro-batches and optimizer-state
        choice (the other fields are what is being measured)."""
        if self.config is None:
            return None
        return replace(self.config, seed=scenario.seed, micro_batches=scenario.micro_batches,
                       include_optimizer_state=scenario.guard.include_optimizer_state)


PLAIN_DDP = OverheadConfig(name="plain DDP", config=None)
CHECKS_OFF = OverheadConfig(name="guard, checks off", key="guard_checks_off",
                            config=GuardConfig(nonfinite=False, weights_interval=0))
"""The guard with every check off: its own fixed cost (the step loop). No check reads the
gradient buckets, so the guard registers no comm hook and DDP keeps its built-in all-reduce."""
NONFINITE = OverheadConfig(name="nonfinite", key="nonfinite",
                           config=GuardConfig(nonfinite=True, weights_interval=0))
NONFINITE_EVERY_STEP = OverheadConfig(
    name="nonfinite, flags sent every step (exchange interval 1)",
    config=GuardConfig(nonfinite=True, weights_interval=0, nonfinite_exchange_interval=1))
WEIGHTS = OverheadConfig(name="weights", key="weights",
                         config=GuardConfig(nonfinite=False, weights_interval=1))
CHECKSUM = OverheadConfig(name="checksum", key="checksum",
                          config=GuardConfig(nonfinite=False, weights_interval=0, checksum=True))
"""Every ``nn.Linear`` product checked every step (``sdc_guard.checks.checksum``)."""
CHECKSUM_NORM = OverheadConfig(
    name="checksum, norm bound",
    config=GuardConfig(nonfinite=False, weights_interval=0,
                       checksum=ChecksumConfig(bound="norm")))
"""The same with the cheaper, looser bound (``ChecksumConfig.bound``)."""
NONFINITE_CHECKSUM = OverheadConfig(
    name="nonfinite + checksum",
    config=GuardConfig(nonfinite=True, weights_interval=0, checksum=True))
ALWAYS_ON = OverheadConfig(name="nonfinite + weights",
                           config=GuardConfig(nonfinite=True, weights_interval=1))
"""The default checks without the replay audit."""

HEADLINE = (CHECKS_OFF, NONFINITE, WEIGHTS, CHECKSUM)
"""The campaign's per-check overheads, in the report's order."""


def replay_only(k: int) -> OverheadConfig:
    """The replay audit alone, every ``k`` steps (deterministic mode, which it needs)."""
    return OverheadConfig(name=f"replay@{k}", config=GuardConfig(
        nonfinite=False, weights_interval=0, replay_interval=k, deterministic=True))


def all_checks(k: int) -> OverheadConfig:
    """Non-finite and weights, and the replay audit every ``k`` steps (0: off)."""
    if k == 0:
        return ALWAYS_ON
    return OverheadConfig(name=f"{ALWAYS_ON.name} + replay@{k}", config=GuardConfig(
        nonfinite=True, weights_interval=1, replay_interval=k, deterministic=True))


def campaign_configs(intervals: tuple[int, ...]) -> tuple[OverheadConfig, ...]:
    """What a campaign's overhead rounds alternate, in this order."""
    out = [PLAIN_DDP, CHECKS_OFF, NONFINITE, WEIGHTS, CHECKSUM, ALWAYS_ON]
    for k in intervals:
        out += [replay_only(k), all_checks(k)]
    return tuple(out)
