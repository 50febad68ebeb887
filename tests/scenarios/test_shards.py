"""Campaign shards without ranks: the shard argument, the deal, shard 0's head start."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenarios.run.shards import overhead_share, parse_shard, shard_of
from scenarios.spec.campaign import load_campaign
from scenarios.spec.errors import ScenarioError
from scenarios.spec.trials import TrialSpec, plan_trials

CONFIGS = Path(__file__).resolve().parents[2] / "scenarios" / "configs"


def _plan(n: int) -> list[TrialSpec]:
    return [TrialSpec(id=f"t{i:03d}", scenario="s", replay_interval=0) for i in range(n)]


def test_parse_shard_from_the_argument_or_the_job_index() -> None:
    assert parse_shard("2/5", {}) == (2, 5)
    assert parse_shard("5", {"JOB_COMPLETION_INDEX": "3"}) == (3, 5)
    for bad in ("5/5", "-1/3", "a/3", "1/0"):
        with pytest.raises(ScenarioError):
            parse_shard(bad, {})
    with pytest.raises(ScenarioError, match="JOB_COMPLETION_INDEX"):
        parse_shard("4", {})


@pytest.mark.parametrize(("n", "count", "head"), [(90, 2, 19.2), (91, 3, 0.0), (40, 4, 7.5),
                                                  (10, 3, 25.0), (0, 2, 3.0)])
def test_the_shards_together_are_the_plan_each_trial_once(n: int, count: int,
                                                          head: float) -> None:
    plan = _plan(n)
    shards = [shard_of(plan, i, count, head_start=head) for i in range(count)]
    ids = [t.id for s in shards for t in s]
    assert sorted(ids) == [t.id for t in plan] and len(ids) == len(set(ids))
    for s in shards:  # each in plan order
        assert [t.id for t in s] == sorted(t.id for t in s)


def test_without_a_head_start_every_count_th_trial() -> None:
    plan = _plan(23)
    for i in range(3):
        assert shard_of(plan, i, 3) == plan[i::3]


def test_the_head_start_makes_equal_work_and_is_spread_over_the_plan() -> None:
    """Shard 0 gets (M + h) / N - h trials, the others (M + h) / N; every shard's trials are
    spread over the whole plan (a plan's costly end does not fall to one shard)."""
    plan = _plan(90)
    s0, s1 = (shard_of(plan, i, 2, head_start=19.2) for i in range(2))
    assert (len(s0), len(s1)) == (35, 55)  # (90 + 19.2) / 2 - 19.2 = 35.4; 54.6
    pos = {t.id: k for k, t in enumerate(plan)}
    for part, share in ((s0, 35.4 / 90), (s1, 54.6 / 90)):
        for lo in range(0, 90, 15):  # in every sixth of the plan, its share of the trials
            got = sum(lo <= pos[t.id] < lo + 15 for t in part)
            assert abs(got - 15 * share) <= 1.0, (lo, got)
    assert shard_of(plan, 0, 2, head_start=200.0) == []  # all its time goes to the overhead
    assert shard_of(plan, 1, 2, head_start=200.0) == plan


def test_overhead_share_of_the_default_campaign() -> None:
    """The overhead rounds' timed steps over a trial's: 2 rounds x 12 configurations x 16
    steps against 20-step scenarios in the quick default campaign."""
    camp = load_campaign(CONFIGS / "default.toml", quick=True)
    assert overhead_share(camp) == pytest.approx(2 * 12 * 16 / 20)
    plan = plan_trials(camp)
    sizes = [len(shard_of(plan, i, 2, overhead_share(camp))) for i in range(2)]
    assert sizes == [40, 59]  # 99 trials: 87 DDP, 12 from the HSDP scenario's own space
