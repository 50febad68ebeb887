"""Scenarios under FSDP2 and HSDP on real gloo ranks: trials through the runner, recovery
through DCP checkpoints. Tiny models and few steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from injectors import Fault
from scenarios.run.runner import CampaignRunner, PoolExecutor
from scenarios.spec.campaign import campaign_for_scenario
from scenarios.spec.scenario import scenario_from_dict
from scenarios.spec.trials import TrialSpec
from tests.launch import scaled

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def _trial(label: str, **kw: Any) -> TrialSpec:
    f = Fault(**kw)
    return TrialSpec(id=f"t{kw['site']}{kw['rank']}", scenario="tiny", replay_interval=0,
                     faults=(f,), site=f.site, field="custom", fault_model=f.model,
                     parallel=label)


def test_fsdp_trials_run_through_the_sharded_model(tmp_path: Path) -> None:
    """FSDP 2: the golden run's ranks agree (one fingerprint over every shard), a clean trial
    ends bit-identical to it, a flipped weight shard is named by the at-rest check (in the
    step whose state changed after its optimizer step), a NaN in a local gradient is named
    and contained; every row says fsdp2."""
    sc = scenario_from_dict({"world_size": 2, "steps": 5, "batch": 8, "parallel": "fsdp",
                             "trial_timeout_s": scaled(60), "model": {"kind": "mlp", "width": 16}},
                            name="tiny")
    executor = PoolExecutor()
    runner = CampaignRunner(campaign_for_scenario(sc), tmp_path, executor, progress=False)
    try:
        runner.goldens["tiny"] = golden = runner.golden(sc)
        assert golden.ranks_agree and golden.detections == [] and len(golden.state_fps) == 5
        clean = runner.trial(TrialSpec(id="c", scenario="tiny", replay_interval=0,
                                       parallel=sc.parallel_label))
        assert clean is not None and (clean["outcome"], clean["parallel"]) == ("masked", "fsdp2")
        # rank 1's shard of net.0.weight holds elements 0-127: 100 is in it
        row = runner.trial(_trial("fsdp2", site="weight_storage", rank=1, step=2,
                                  target="net.0.weight", index=100, bits=(29,)))
        assert row is not None
        assert {k: row[k] for k in ("outcome", "check", "detect_step", "suspects",
                                    "parallel")} == {
            "outcome": "detected", "check": "weights", "detect_step": 1, "suspects": [1],
            "parallel": "fsdp2"}, row
        row = runner.trial(_trial("fsdp2", site="gradient_before_allreduce", rank=0, step=3,
                                  target="net.2.weight", kind="set", value=float("nan")))
        assert row is not None
        assert {k: row[k] for k in ("outcome", "check", "detect_step", "suspects",
                                    "contained")} == {
            "outcome": "detected", "check": "nonfinite", "detect_step": 3, "suspects": [0],
            "contained": True}, row
        # a finite flip in one rank's reduced shard under pure FSDP: no replica to compare
        # with, so it trains on, and the run ends apart from golden (gathered parameters)
        row = runner.trial(_trial("fsdp2", site="gradient_after_allreduce", rank=1, step=2,
                                  target="net.0.weight", index=3, bits=(29,)))
        assert row is not None and row["outcome"] == "escaped", row
        assert row["rel_weight_dev"] > 0
    finally:
        executor.close()
