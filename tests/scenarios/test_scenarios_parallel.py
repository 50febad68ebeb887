"""A scenario's parallelism (``parallel``, ``mesh``) in files, campaign plans and the trial
table (no ranks spawned; the sharded runs are in ``test_scenarios_sharded.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from scenarios.run.store import COLUMNS
from scenarios.spec.campaign import load_campaign
from scenarios.spec.errors import ScenarioError
from scenarios.spec.scenario import load_scenario, scenario_from_dict, shard_numel
from scenarios.spec.trials import plan_trials

HSDP = {"world_size": 6, "parallel": "hsdp", "mesh": [3, 2], "steps": 8,
        "model": {"kind": "mlp", "width": 16}}


def _error(data: dict[str, Any]) -> ScenarioError:
    with pytest.raises(ScenarioError) as e:
        scenario_from_dict(data, name="s")
    return e.value


@pytest.mark.parametrize(("data", "field", "fix"), [
    ({"parallel": "tp"}, "parallel", "'ddp', 'fsdp', 'hsdp'"),
    ({"world_size": 6, "parallel": "hsdp"}, "mesh", "e.g. [2, 3]"),
    ({"world_size": 6, "parallel": "hsdp", "mesh": [6]}, "mesh", "replicas * shards"),
    ({"world_size": 6, "parallel": "hsdp", "mesh": [2, 2]}, "mesh", "== world_size (6)"),
    ({"world_size": 6, "parallel": "hsdp", "mesh": [1, 6]}, "mesh", "replicas >= 2"),
    ({"world_size": 4, "parallel": "fsdp", "mesh": [2, 2]}, "mesh", "[4] (world_size)"),
    ({"world_size": 4, "mesh": [3]}, "mesh", "[4] (world_size)"),
    ({"world_size": 4, "parallel": "fsdp", "mesh": [0]}, "mesh", "positive ints"),
    ({"model": {"kind": "llama", "width": 60}}, "model.width", "a multiple of 8 for llama"),
])
def test_bad_parallelism_names_the_field_and_the_fix(data: dict[str, Any], field: str,
                                                     fix: str) -> None:
    e = _error(data)
    assert e.field == field and fix in str(e), str(e)


def test_mesh_defaults_and_labels() -> None:
    ddp = scenario_from_dict({"world_size": 4}, name="s")
    fsdp = scenario_from_dict({"world_size": 4, "parallel": "fsdp"}, name="s")
    hsdp = scenario_from_dict(HSDP, name="s")
    assert (ddp.mesh_shape, ddp.parallel_label, ddp.sharded) == ((4,), "ddp", False)
    assert (fsdp.mesh_shape, fsdp.parallel_label, fsdp.sharded) == ((4,), "fsdp4", True)
    assert (hsdp.mesh_shape, hsdp.parallel_label) == ((3, 2), "hsdp3x2")
    assert [hsdp.shard_of(r) for r in range(6)] == [(0, 2), (1, 2)] * 3
    # the golden run's key tells the parallelisms apart, and a DDP key has no new fields
    assert len({ddp.training_key(), fsdp.training_key(),
                scenario_from_dict({**HSDP, "world_size": 4, "mesh": [2, 2]},
                                   name="s").training_key()}) == 3


def test_shard_sizes_follow_fsdp2s_split_of_dim_0() -> None:
    # torch.chunk: ceil(rows / shards) rows each, the last shard fewer or none
    assert [shard_numel((5, 3), i, 2) for i in range(2)] == [9, 6]
    assert [shard_numel((2,), i, 4) for i in range(4)] == [1, 1, 0, 0]
    sc = scenario_from_dict({**HSDP, "world_size": 8, "mesh": [2, 4]}, name="s")
    full = sc.target_sizes("weight_storage")
    for site in ("weight_storage", "optimizer_state", "gradient_after_allreduce"):
        shards = [sc.target_sizes(site, r) for r in range(4)]
        assert {n: sum(s[n] for s in shards) for n in full} == full
    # the local gradients before the reduce-scatter are whole on every rank
    assert sc.target_sizes("gradient_before_allreduce", 3) == full


def test_an_explicit_fault_must_fit_the_faulty_ranks_shard() -> None:
    fault = {"site": "weight_storage", "rank": 1, "step": 2, "target": "net.0.weight",
             "bits": [3]}
    scenario_from_dict({**HSDP, "faults": [{**fault, "index": 127}]}, name="s")  # 256 / 2
    e = _error({**HSDP, "faults": [{**fault, "index": 128}]})
    assert e.field == "faults[0].index" and "rank 1's shard of 'net.0.weight' has 128" in str(e)
    # a DDP rank holds all 256
    scenario_from_dict({**HSDP, "parallel": "ddp", "mesh": [], "faults": [{**fault, "index": 200}]},
                       name="s")
    # an 8-way shard of a 4-row bias is empty on ranks 4 to 7
    e = _error({**HSDP, "world_size": 8, "parallel": "fsdp", "mesh": [],
                "faults": [{**fault, "rank": 5, "target": "net.4.bias"}]})
    assert e.field == "faults[0].target" and "not empty" in str(e)


def _campaign(tmp_path: Path, extra: str, hsdp_space: str = "") -> Path:
    (tmp_path / "ddp.toml").write_text('world_size = 3\nsteps = 8\n[model]\nwidth = 16\n')
    (tmp_path / "hsdp.toml").write_text(
        'world_size = 6\nsteps = 8\nparallel = "hsdp"\nmesh = [3, 2]\n[model]\nwidth = 16\n'
        + hsdp_space)
    camp = tmp_path / "c.toml"
    camp.write_text('scenarios = ["ddp.toml", "hsdp.toml"]\nclean_trials = 1\n' + extra)
    return camp


SPACE = ('[sample]\nsites = ["weight_storage", "gradient_after_allreduce"]\n'
         'trials_per_site = 3\nreplay_intervals = [0, 2]\n')


def test_a_sharded_scenario_keeps_its_own_space_in_a_campaign(tmp_path: Path) -> None:
    space = SPACE
    # the campaign's space applies to a sharded scenario too (every check guards FSDP2)
    shared = [t for t in plan_trials(load_campaign(_campaign(tmp_path, space)))
              if t.scenario == "hsdp" and t.kind == "fault"]
    assert {t.replay_interval for t in shared} == {0, 2}
    own = '[sample]\nsites = ["weight_storage"]\ntrials_per_site = 2\nseed = 7\n'
    camp = load_campaign(_campaign(tmp_path, space, own))
    trials = plan_trials(camp)
    hsdp = [t for t in trials if t.scenario == "hsdp"]
    ddp = [t for t in trials if t.scenario == "ddp"]
    # the scenario's own space: 2 trials of its one site at interval 0, one clean trial
    assert sorted((t.kind, t.site, t.replay_interval) for t in hsdp) == [
        ("clean", "", 0), ("fault", "weight_storage", 0), ("fault", "weight_storage", 0)]
    assert {t.parallel for t in hsdp} == {"hsdp3x2"} and {t.parallel for t in ddp} == {"ddp"}
    # the DDP scenario's trials are those of a campaign without the sharded scenario
    (tmp_path / "alone.toml").write_text(
        'scenarios = ["ddp.toml"]\nclean_trials = 1\n' + space)
    assert [t.id for t in plan_trials(load_campaign(tmp_path / "alone.toml"))] == [
        t.id for t in ddp]
    # sampled shard faults target the faulty rank's own shard: no index past it
    for t in hsdp:
        for f in t.faults:
            assert f.index is None


def test_the_overhead_measurement_needs_a_ddp_scenario(tmp_path: Path) -> None:
    own = '[sample]\nsites = ["weight_storage"]\ntrials_per_site = 1\n'
    with pytest.raises(ScenarioError) as e:
        load_campaign(_campaign(tmp_path, '[overhead]\nscenario = "hsdp"\n', own))
    assert e.value.field == "overhead.scenario" and "overhead = false" in str(e.value)
    camp = load_campaign(_campaign(tmp_path, "overhead = false\n", own))
    assert camp.overhead is None


def test_the_trial_table_names_the_parallelism() -> None:
    assert "parallel" in COLUMNS
    sc = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "configs"
                       / "mlp.toml")
    assert sc.parallel == "ddp" and sc.mesh_shape == (sc.world_size,)


def test_the_report_splits_coverage_by_parallelism(tmp_path: Path) -> None:
    """Coverage per parallelism and per site and parallelism, Wilson intervals as elsewhere;
    a row without the parallel column (an older table) counts as DDP."""
    from scenarios.report.render import write_report
    from scenarios.run.store import TrialTable

    t = TrialTable(tmp_path / "trials.csv")
    rows = [("ddp", "weight_storage", "detected"), ("ddp", "weight_storage", "escaped"),
            ("", "weight_storage", "detected"), ("hsdp3x2", "weight_storage", "detected"),
            ("hsdp3x2", "weight_storage", "masked"), ("hsdp3x2", "optimizer_state", "detected"),
            ("fsdp4", "optimizer_state", "escaped")]
    for i, (par, site, outcome) in enumerate(rows):
        t.append({"id": f"f{i}", "scenario": par or "old", "kind": "fault", "site": site,
                  "field": "exponent", "fault_model": "transient", "replay_interval": 0,
                  "outcome": outcome, "parallel": par or None,
                  "check": "weights" if outcome == "detected" else None,
                  "detect_step": 3 if outcome == "detected" else None, "first_injection": 3,
                  "latency_from_injection": 0 if outcome == "detected" else None,
                  "blame_correct": True if outcome == "detected" else None,
                  "nonfinite_injected": False})
    t.append({"id": "c0", "scenario": "hsdp3x2", "kind": "clean", "replay_interval": 0,
              "outcome": "masked", "parallel": "hsdp3x2"})
    (tmp_path / "campaign.json").write_text('{"name": "p"}')
    s = write_report(tmp_path)
    assert list(s["parallels"]) == ["ddp", "fsdp4", "hsdp3x2"]
    ddp, hsdp = s["parallels"]["ddp"], s["parallels"]["hsdp3x2"]
    assert (ddp["trials"], ddp["detected"], ddp["escaped"]) == (3, 2, 1)
    assert ddp["coverage_ci95"] == s["by_site_parallel"]["weight_storage"]["ddp"]["coverage_ci95"]
    assert (hsdp["trials"], hsdp["masked"], hsdp["coverage"]) == (3, 1, 1.0)
    assert s["by_site_parallel"]["optimizer_state"] == {
        "fsdp4": s["by_site_parallel"]["optimizer_state"]["fsdp4"],
        "hsdp3x2": s["by_site_parallel"]["optimizer_state"]["hsdp3x2"]}
    assert s["by_site_parallel"]["optimizer_state"]["fsdp4"]["coverage"] == 0.0
    assert s["clean_by_parallel"] == {"hsdp3x2": {"trials": 1, "false_positives": 0}}
    md = (tmp_path / "report.md").read_text()
    assert "## Coverage by parallelism" in md and "## Coverage by site and parallelism" in md
    assert "| weight_storage | hsdp3x2 | 2 | 1 | 1 |" in md
