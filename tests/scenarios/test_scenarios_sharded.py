"""Scenarios under FSDP2 and HSDP on real gloo ranks: trials through the runner, recovery
through DCP checkpoints. Tiny models and few steps."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest

from injectors import Fault
from scenarios.cli import main
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


def test_recovery_under_hsdp_ends_bit_identical_to_the_fault_free_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m scenarios run scenarios/configs/recovery_hsdp.toml``: HSDP 3x2, a weight
    bit of rank 1's shard flipped at every step from step 9. The vote names rank 1 and
    repairs it; the second repair convicts it: node-1 (and only it) is cordoned on the API
    stand-in, the run restores the DCP checkpoint from before the fault and trains to the
    end, every shard of every replica bit-identical to the golden run's."""
    out = tmp_path / "out"
    code = main(["run", str(ROOT / "scenarios" / "configs" / "recovery_hsdp.toml"), "--out",
                 str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rec = summary["recovery"]
    assert {k: rec[k] for k in ("check", "fault_rank", "suspect_nodes", "cordoned_nodes",
                                "first_detection_repaired", "rolled_back",
                                "final_matches_golden")} == {
        "check": "weights", "fault_rank": 1, "suspect_nodes": ["node-1"],
        "cordoned_nodes": ["node-1"], "first_detection_repaired": True, "rolled_back": True,
        "final_matches_golden": True}, rec
    # restored from a checkpoint written before the fault's first step (9)
    assert rec["rollback_step"] <= 9 and rec["wasted_steps"] > 0, rec
    assert summary["false_positives"] == 0 and summary["clean_not_bit_identical"] == 0
    rows = list(csv.DictReader(io.StringIO((out / "trials.csv").read_text())))
    assert {r["parallel"] for r in rows} == {"hsdp3x2"}
