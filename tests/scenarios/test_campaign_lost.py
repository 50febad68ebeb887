"""Trials lost to a kill from outside the harness: retried once, then ``lost`` (real gloo ranks,
really killed: by the test, or by a chaos rank that SIGKILLs itself as an outsider would)."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from scenarios.run.rank import Command, Trial
from scenarios.run.runner import CampaignRunner, PoolExecutor
from scenarios.spec.campaign import campaign_for_scenario
from scenarios.spec.scenario import Scenario, scenario_from_dict
from scenarios.spec.trials import Chaos, TrialSpec, plan_trials
from tests.launch import scaled

pytestmark = pytest.mark.timeout(300)


def _tiny() -> Scenario:
    return scenario_from_dict({"world_size": 3, "steps": 4, "batch": 8, "trial_timeout_s": scaled(30),
                               "model": {"kind": "mlp", "width": 8, "depth": 1}}, name="tiny")


def test_a_rank_killed_mid_trial_is_retried_once_then_lost_and_crashed_keeps_its_meaning(
        tmp_path: Path) -> None:
    sc = _tiny()
    executor = PoolExecutor()
    runner = CampaignRunner(campaign_for_scenario(sc), tmp_path, executor, progress=False)
    try:
        runner.goldens["tiny"] = runner.golden(sc)
        clean = TrialSpec(id="c", scenario="tiny", replay_interval=0)
        assert runner.trial(clean)["outcome"] == "masked"  # type: ignore[index]
        before = executor.restarts
        row = runner.trial(TrialSpec(id="k", scenario="tiny", replay_interval=0,
                                     chaos=Chaos(action="kill", rank=1, step=2)))
        assert row is not None and row["outcome"] == "lost", row
        assert row["error"].startswith("lost twice: rank 1 was killed by SIGKILL, a signal the "
                                       "harness did not send"), row["error"]
        assert executor.restarts == before + 1  # ran twice: two pools, the second restarted
        assert runner.trial(clean)["outcome"] == "masked"  # type: ignore[index]
        assert executor.restarts == before + 2
        # A rank that fails by itself (an exit of its own) is crashed, and not run again.
        row = runner.trial(TrialSpec(id="x", scenario="tiny", replay_interval=0,
                                     chaos=Chaos(action="exit", rank=2, step=1)))
        assert row is not None and row["outcome"] == "crashed" and "exit code 17" in row["error"]
        assert executor.restarts == before + 2  # that pool died once; no second attempt
    finally:
        executor.close()


class _Outsider(PoolExecutor):
    """A pool whose rank 1 the test SIGKILLs before a trial's command reaches it, as often as
    ``kills`` says for that trial (the kill comes from this process, not from the pool)."""

    def __init__(self, kills: dict[str, int]) -> None:
        super().__init__()
        self.kills = kills

    def run(self, scenario: Scenario, cmd: Command, timeout: float) -> list[Any]:
        if isinstance(cmd, Trial) and self.kills.get(cmd.trial.id, 0) > 0:
            self.kills[cmd.trial.id] -= 1
            pool = self.pool(scenario)
            pool.start()
            victim = pool.pids[1]
            os.kill(victim, signal.SIGKILL)
        return super().run(scenario, cmd, timeout)


def test_the_campaign_writes_lost_rows_lists_them_and_a_retry_that_runs_keeps_its_outcome(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    campaign = campaign_for_scenario(_tiny(), clean_trials=2)
    twice, once = (t.id for t in plan_trials(campaign))
    executor = _Outsider({twice: 2, once: 1})
    try:
        meta = CampaignRunner(campaign, tmp_path, executor, progress=False).run()
    finally:
        executor.close()
    with (tmp_path / "trials.csv").open() as fh:
        rows = {r["id"]: r for r in csv.DictReader(fh)}
    assert (rows[twice]["outcome"], rows[once]["outcome"]) == ("lost", "masked")
    assert "rank 1 was killed by SIGKILL" in rows[twice]["error"] and rows[once]["error"] == ""
    assert meta["lost_this_run"] == [twice] and meta["outcomes_this_run"] == {
        "lost": 1, "masked": 1}
    err = capsys.readouterr().err
    assert f"trial {twice}: rank 1 was killed by SIGKILL" in err  # each retry is announced
    assert f"1 trial(s) lost: a rank was killed by a signal the harness did not send, twice " \
           f"(outcome 'lost' in trials.csv, left out of coverage): {twice}" in err
