"""Scenario files, campaign plans, outcomes, the trial table and the report (no ranks spawned)."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from scenarios.cli import main
from scenarios.report.outcome import classify, failed_row
from scenarios.report.render import write_report
from scenarios.report.summary import (
    fit_replay_overhead,
    recommend,
    recommendation_agreement,
    wilson,
)
from scenarios.run.runner import overhead_matches
from scenarios.run.store import COLUMNS, GoldenRun, TrialTable
from scenarios.spec.campaign import CampaignSpec, load_campaign
from scenarios.spec.errors import ScenarioError
from scenarios.spec.faults import FaultSpace
from scenarios.spec.scenario import load_scenario, scenario_from_dict
from scenarios.spec.trials import (
    TrialSpec,
    count_trials,
    leveugle_sample_size,
    plan_trials,
    scenario_of,
)
from tests.launch import scaled

CONFIGS = Path(__file__).resolve().parents[2] / "scenarios" / "configs"


def _write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# -- scenario files ---------------------------------------------------------------------------
def test_every_shipped_config_loads() -> None:
    for p in sorted(CONFIGS.glob("*.toml")):
        if p.name == "default.toml":
            camp = load_campaign(p)
            assert {s.model.kind for s in camp.scenarios} >= {"mlp", "cnn_bn"}
            assert all(s.world_size >= 3 for s in camp.scenarios)
            assert set(camp.space.sites) == {  # type: ignore[union-attr]
                "activation", "activation_grad", "gradient_before_allreduce",
                "gradient_after_allreduce", "optimizer_state", "weight_storage",
                "linear_product"}
            assert camp.space.checksum == (False, True)  # type: ignore[union-attr]
            # a few HSDP 3x2 trials, from the scenario's own space (no replay, no checksum)
            hsdp = [s for s in camp.scenarios if s.sharded]
            assert [s.parallel_label for s in hsdp] == ["hsdp3x2"]
            assert camp.space_for(hsdp[0]) is hsdp[0].space
        elif p.name == "fsdp.toml":
            camp = load_campaign(p)
            assert [s.parallel_label for s in camp.scenarios] == ["fsdp4", "hsdp3x2", "hsdp2x2"]
            assert {s.model.kind for s in camp.scenarios} == {"llama"}
            # every check on: the replay audit every 2 steps and the checksum
            assert camp.overhead is None and camp.space.replay_intervals == (2,)  # type: ignore[union-attr]
            assert camp.space.checksum == (True,)  # type: ignore[union-attr]
        elif p.name == "checksum.toml":
            camp = load_campaign(p)
            assert {s.model.kind for s in camp.scenarios} == {"mlp", "transformer", "cnn_bn"}
            assert camp.space.sites == ("linear_product",)  # type: ignore[union-attr]
        elif p.name == "tolerant.toml":  # the exact and the tolerant audit, side by side
            camp = load_campaign(p)
            assert camp.space is not None and camp.space.deterministic == (True, False)
            assert all(not s.sharded and s.guard.replay_interval for s in camp.scenarios)
            assert "any" in camp.space.fields and 0 not in camp.space.replay_intervals
        elif p.name == "tolerant_fsdp.toml":  # the same, under FSDP2 and HSDP
            camp = load_campaign(p)
            assert camp.space is not None and camp.space.deterministic == (True, False)
            assert [s.parallel_label for s in camp.scenarios] == ["fsdp4", "hsdp2x2"]
        elif p.name == "field.toml":
            # at most 15 (pattern, site, dtype) cells by default; --full: the cross product
            camp = load_campaign(p)
            space = camp.space
            assert space is not None
            dtypes = {s.dtype for s in camp.scenarios}
            assert len(space.patterns) * len(space.sites) * len(dtypes) <= 15
            full = load_campaign(p, full=True)
            assert full.space is not None and len(full.space.sites) == 7
            assert {s.dtype for s in full.scenarios} == {"float32", "bfloat16"}
            with pytest.raises(ScenarioError, match="one of --quick or --full"):
                load_campaign(p, quick=True, full=True)
            with pytest.raises(ScenarioError, match=r"\[full\] table"):
                load_campaign(CONFIGS / "checksum.toml", full=True)
        else:
            load_scenario(p)


@pytest.mark.parametrize(("text", "field", "value"), [
    ('[model]\nkind = "resnet"\n', "model.kind", "resnet"),
    ("world_size = 0\n", "world_size", 0),
    ('dtype = "float16"\n', "dtype", "float16"),
    ('[optimizer]\nkind = "adam"\n', "optimizer.kind", "adam"),
    ("stepz = 3\n", "stepz", 3),
    ('[guard]\nreplay_interval = -1\n', "guard.replay_interval", -1),
    ('[guard]\nbogus = 1\n', "guard.bogus", 1),  # not a GuardConfig field
    ('[guard]\nseed = 3\n', "guard.seed", 3),  # the scenario's own
    ('[guard]\nreplay_interval = 2\ndeterministic = false\n', "guard.replay_interval", 2),
    ('[sample]\nsites = ["weights"]\n', "sample.sites", "weights"),
    ('[matrix]\nsteps = [40]\n', "matrix.steps", 40),
    ('[[faults]]\nsite = "weight_storage"\nrank = 5\nstep = 1\ntarget = "net.0.weight"\n'
     'bits = [3]\n', "faults[0].rank", 5),
    ('[[faults]]\nsite = "weight_storage"\nrank = 1\nstep = 1\ntarget = "net.7.weight"\n'
     'bits = [3]\n', "faults[0].target", "net.7.weight"),
    ('[[faults]]\nsite = "optimizer_state"\nrank = 1\nstep = 0\ntarget = "net.0.weight"\n'
     'state_key = "exp_avg"\nbits = [3]\n', "faults[0].step", 0),
    ('[[faults]]\nsite = "optimizer_state"\nrank = 1\nstep = 2\ntarget = "net.0.weight"\n'
     'state_key = "momentum_buffer"\nbits = [3]\n', "faults[0].state_key", "momentum_buffer"),
])
def test_bad_scenario_names_file_field_value_and_allowed(tmp_path: Path, text: str, field: str,
                                                        value: Any) -> None:
    p = _write(tmp_path, text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(p)
    e = info.value
    assert (e.file, e.field, e.value) == (str(p), field, value)
    assert e.allowed and str(p) in str(e) and field in str(e) and "allowed:" in str(e)


def test_faults_and_sample_are_exclusive(tmp_path: Path) -> None:
    p = _write(tmp_path, '[sample]\ntrials_per_site = 2\n[[faults]]\nsite = "weight_storage"\n'
               'rank = 1\nstep = 1\ntarget = "net.0.weight"\nbits = [3]\n')
    with pytest.raises(ScenarioError, match="either"):
        load_scenario(p)


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _write(tmp_path, '[optimizer]\nkind = "lion"\n')
    assert main(["run", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "optimizer.kind = 'lion'" in err and "['adamw', 'sgd', 'muon']" in err
    camp = _write(tmp_path, 'scenarios = ["missing.toml"]\n[sample]\n', "c.toml")
    assert main(["campaign", str(camp)]) == 2
    assert "missing.toml" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() >= 3, reason="three CUDA devices: nccl can run")
def test_nccl_without_a_device_per_rank_is_named(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # It was a ZeroDivisionError from the ranks (no CUDA device to take one modulo of).
    p = _write(tmp_path, 'backend = "nccl"\n')
    assert main(["run", str(p), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "backend = 'nccl' is not valid (nccl runs one rank per CUDA device" in err, err
    assert "allowed: 'auto' or 'gloo' on this machine" in err


def test_cli_subprocess_has_no_traceback(tmp_path: Path) -> None:
    p = _write(tmp_path, "steps = 'many'\n")
    r = subprocess.run([sys.executable, "-m", "scenarios", "check", str(p)], capture_output=True,
                       text=True, timeout=scaled(120), cwd=CONFIGS.parents[1])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and "steps = 'many'" in r.stderr


def test_guard_section_maps_to_guard_config() -> None:
    sc = scenario_from_dict({"micro_batches": 2, "seed": 5,
                             "guard": {"weights_interval": 2, "include_optimizer_state": False}},
                            name="g")
    cfg = sc.guard_config(4)
    assert (cfg.weights_interval, cfg.replay_interval, cfg.deterministic, cfg.seed,
            cfg.micro_batches, cfg.include_optimizer_state) == (2, 4, True, 5, 2, False)
    assert sc.guard_config(0).deterministic is False
    assert cfg.nonfinite_exchange_interval == 8  # GuardConfig's default
    one = scenario_from_dict({"guard": {"nonfinite_exchange_interval": 1}}, name="g1")
    assert one.guard_config(0).nonfinite_exchange_interval == 1
    with pytest.raises(ScenarioError, match=r"guard\.nonfinite_exchange_interval"):
        scenario_from_dict({"guard": {"nonfinite_exchange_interval": 0}}, name="g0")
    # The replay audit turns deterministic mode on unless the file says otherwise.
    audited = scenario_from_dict({"seed": 3, "guard": {"replay_interval": 2}}, name="r")
    assert (audited.guard.deterministic, audited.guard.seed, audited.guard_config().replay_interval
            ) == (True, 3, 2)


def test_overhead_configurations_are_declared_once() -> None:
    from dataclasses import replace

    from scenarios.spec.overhead import CHECKS_OFF, HEADLINE, PLAIN_DDP, campaign_configs

    configs = campaign_configs((1, 4))
    names = [oc.name for oc in configs]
    assert len(set(names)) == len(names) and names[0] == PLAIN_DDP.name
    assert [oc.key for oc in HEADLINE] == ["guard_checks_off", "nonfinite", "weights",
                                             "checksum"]
    sc = scenario_from_dict({"seed": 7, "micro_batches": 2,
                             "guard": {"include_optimizer_state": False}}, name="o")
    cfg = CHECKS_OFF.for_scenario(sc)
    assert CHECKS_OFF.config is not None
    assert cfg == replace(CHECKS_OFF.config, seed=7, micro_batches=2,
                          include_optimizer_state=False)
    assert PLAIN_DDP.for_scenario(sc) is None


# -- campaign plans ---------------------------------------------------------------------------
def test_leveugle_sample_size() -> None:
    assert leveugle_sample_size(10**12, 0.05) == 385
    assert leveugle_sample_size(10**12, 0.14) == 49
    assert leveugle_sample_size(100, 0.05) == 80  # 100 / (1 + 0.0025 * 99 / 0.9604)
    assert leveugle_sample_size(10, 0.01) == 10
    n = 5000
    expect = n / (1 + 0.1**2 * (n - 1) / (2.576**2 * 0.25))
    assert leveugle_sample_size(n, 0.1, 0.99) == math.ceil(expect)


def _mlp(**kw: Any) -> Any:
    return scenario_from_dict({"steps": 10, **kw}, name="m")


def test_matrix_is_the_full_product_and_ids_are_stable() -> None:
    space = FaultSpace(sites=("weight_storage", "optimizer_state"), fields=("sign", "nan"),
                       models=("transient", "permanent"), steps=(0, 3), ranks=(1, 2),
                       replay_intervals=(0, 2))
    camp = CampaignSpec(name="c", scenarios=(_mlp(),), space=space, clean_trials=2)
    trials = plan_trials(camp)
    faults = [t for t in trials if t.kind == "fault"]
    # optimizer_state at step 0 is left out: no optimizer state exists before the first step
    assert len(faults) == 2 * 2 * 2 * 2 * 2 * 2 - 2 * 2 * 2 * 2
    assert sum(t.kind == "clean" for t in trials) == 2 * 2
    assert [t.id for t in plan_trials(camp)] == [t.id for t in trials]
    assert len({t.id for t in trials}) == len(trials)
    ws = next(t for t in faults if t.site == "weight_storage" and t.field == "nan")
    f = ws.faults[0]
    assert (f.kind, math.isnan(f.value or 0.0), f.target.startswith("net.")) == ("set", True, True)


def test_sample_is_sized_per_site_and_seeded() -> None:
    space = FaultSpace(mode="sample", sites=("activation", "weight_storage"), margin=0.2,
                       replay_intervals=(0, 1))
    camp = CampaignSpec(name="c", scenarios=(_mlp(),), space=space, clean_trials=1)
    trials = [t for t in plan_trials(camp) if t.kind == "fault"]
    assert sum(t.site == "activation" for t in trials) == leveugle_sample_size(10**9, 0.2)
    other = CampaignSpec(name="c", scenarios=(_mlp(),), clean_trials=1,
                         space=FaultSpace(mode="sample", sites=("activation", "weight_storage"),
                                          margin=0.2, replay_intervals=(0, 1), seed=1))
    assert {t.id for t in plan_trials(other)} != {t.id for t in trials}
    assert all(1 <= t.faults[0].step < 10 for t in trials)


def test_quick_overrides(tmp_path: Path) -> None:
    full = load_campaign(CONFIGS / "default.toml")
    quick = load_campaign(CONFIGS / "default.toml", quick=True)
    assert quick.quick and len(plan_trials(quick)) < len(plan_trials(full)) / 4
    assert quick.scenarios == full.scenarios


# -- the trial table ----------------------------------------------------------------------------
def test_trial_table_appends_and_repairs_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "trials.csv"
    t = TrialTable(path)
    t.append({"id": "a", "outcome": "masked", "suspects": [1], "contained": True})
    t.append({"id": "b", "outcome": "detected", "error": 'say "hi", twice\nplease'})
    with path.open("ab") as fh:
        fh.write(b"c,m,fault,weight_sto")  # a kill in the middle of a write
    t2 = TrialTable(path)
    assert t2.done_ids() == {"a", "b"}
    t2.append({"id": "c", "outcome": "escaped"})
    rows = t2.rows()
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert rows[0]["suspects"] == "[1]" and rows[0]["contained"] == "true"
    assert rows[1]["error"] == 'say "hi", twice\nplease'
    assert path.read_text().count("id,scenario") == 1
    assert list(rows[0]) == list(COLUMNS)
    with pytest.raises(KeyError):
        t2.append({"nope": 1})


# -- outcomes -----------------------------------------------------------------------------------
GOLD = GoldenRun(key="k", scenario="m", initial_fp=100, state_fps=[101, 102, 103, 104],
                 weight_fps=[1, 2, 3, 4], losses=[[1.0] * 4] * 3, detections=[],
                 ranks_agree=True, seconds=0.1)
def _fault() -> Any:
    from injectors import Fault

    return Fault(site="activation", rank=1, step=2, target="net.1", bits=(3,))


def _trial() -> TrialSpec:
    return TrialSpec(id="t", scenario="m", replay_interval=1, faults=(_fault(),),
                     site="activation", field="custom", fault_model="transient")


def _res(rank: int, fps: list[int], *, dets: Any = (), skipped: Any = (),
         losses: Any = None, rec: bool | str = False) -> dict[str, Any]:
    records = [{"rank": 1, "step": 2, "dtype": "float32", "after": [0x7FC00000 if rec == "nan"
                                                                   else 5]}] if rec else []
    return {"rank": rank, "state_fps": fps, "losses": losses or [1.0] * len(fps),
            "detections": list(dets), "skipped": list(skipped), "records": records,
            "rel_weight_dev": 0.5}


def test_contained_detection() -> None:
    det = [("replay", 2, (1,)), ("weights", 2, (1,))]
    # step 2 withheld: every rank still holds golden's state from before step 2
    res = [_res(r, [101, 102, 102], dets=det, skipped=[2], rec=r == 1) for r in range(3)]
    row = classify(_trial(), GOLD, res, 0.1)
    assert row["outcome"] == "detected" and row["contained"] is True
    assert (row["check"], row["checks"], row["blame_correct"]) == ("replay", "replay+weights", True)
    assert row["latency_from_injection"] == 0 and row["latency_from_divergence"] is None


def test_uncontained_detection_latency_from_divergence() -> None:
    det = [("weights", 3, (0,))]
    res = [_res(r, [101, 102, 999, 998], dets=det, rec=r == 1) for r in range(3)]
    row = classify(_trial(), GOLD, res, 0.1)
    assert row["contained"] is False and row["blame_correct"] is False
    assert (row["first_divergence"], row["latency_from_divergence"],
            row["latency_from_injection"]) == (2, 1, 1)


def test_masked_escaped_crashed() -> None:
    masked = classify(_trial(), GOLD, [_res(r, [101, 102, 103, 104], rec=r == 1)
                                       for r in range(3)], 0.1)
    assert masked["outcome"] == "masked"
    esc = classify(_trial(), GOLD, [_res(r, [101, 102, 7, 8], rec=r == 1,
                                         losses=[1.0, 1.0, 1.5, 1.25]) for r in range(3)], 0.1)
    assert (esc["outcome"], esc["rel_weight_dev"], esc["loss_diff"]) == ("escaped", 0.5, 0.25)
    assert esc["first_divergence"] == 2
    nan = classify(_trial(), GOLD, [_res(r, [101, 102, 7, 8], rec="nan" if r == 1 else False,
                                         losses=[1.0, 1.0, math.nan, math.nan])
                                    for r in range(3)], 0.1)
    assert nan["outcome"] == "crashed" and nan["nonfinite_injected"] is True
    hung = failed_row(_trial(), "hung", "no answer within 5s", 5.0)
    assert (hung["outcome"], hung["site"], hung["fault_rank"]) == ("hung", "activation", 1)


# -- report -------------------------------------------------------------------------------------
def test_wilson_and_recommendation() -> None:
    lo, hi = wilson(8, 10) or [0, 0]
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    assert wilson(0, 0) is None
    ov = {"replay": {"1": 0.9, "2": 0.45, "4": 0.2, "8": 0.1}}  # no per-round samples: medians
    assert recommend(ov, 0.25) == 4 and recommend(ov, 0.05) is None and recommend(None, 1) is None


def _overhead_rounds(fixed: float, per_audit: float, noise: float, rounds: int = 6,
                     ks: tuple[int, ...] = (1, 2, 4, 8, 16)) -> dict[str, Any]:
    rng = random.Random(1)
    base = [10.0 * (1 + 0.05 * rng.random()) for _ in range(rounds)]  # drifting machine
    samples = {"plain DDP": base}
    for k in ks:
        samples[f"replay@{k}"] = [b * (1 + fixed + per_audit / k + rng.gauss(0, noise))
                                  for b in base]
    fit = fit_replay_overhead(samples, list(ks))
    med = {str(k): statistics.median(t / b - 1
                                     for t, b in zip(samples[f"replay@{k}"], base, strict=True))
           for k in ks}
    return {"replay": med, "replay_fit": fit, "samples_ms": samples}


def test_replay_overhead_fit_and_its_recommendation() -> None:
    exact = _overhead_rounds(0.1, 0.6, noise=0.0)
    fit = exact["replay_fit"]
    assert fit["fixed"] == pytest.approx(0.1) and fit["per_audit"] == pytest.approx(0.6)
    assert fit["points"] == 30 and fit["predicted"]["4"] == pytest.approx(0.25)
    # 0.1 + 0.6/k: 0.7, 0.4, 0.25, 0.175, 0.1375
    assert recommend(exact, 0.3) == 4 and recommend(exact, 0.71) == 1
    assert recommend(exact, 0.05) is None
    assert recommendation_agreement(exact, 0.3) == 1.0
    # Noisy rounds: the fit still finds the model, and where the budget sits right on an
    # interval's cost the resamples disagree, which the agreement says.
    noisy = _overhead_rounds(0.1, 0.6, noise=0.03, rounds=8)
    assert noisy["replay_fit"]["per_audit"] == pytest.approx(0.6, abs=0.05)
    agreement = recommendation_agreement(noisy, 0.3)
    assert recommend(noisy, 0.3) == 4 and agreement is not None and agreement > 0.9
    edge = recommendation_agreement(noisy, noisy["replay_fit"]["predicted"]["2"])
    assert edge is not None and 0.2 < edge < 0.8
    # One interval only: nothing to fit; the medians decide.
    assert fit_replay_overhead(exact["samples_ms"], [4]) is None


def test_a_resumed_campaign_keeps_an_overhead_json_only_for_the_overhead_it_measured() -> None:
    # The runner measures again when the overhead section changed (another scenario, world
    # size, model, replay intervals, rounds or block; the quick variant), rather than report
    # another configuration's numbers beside the new trials.
    c = load_campaign(CONFIGS / "default.toml")
    assert c.overhead is not None
    sc = c.overhead_scenario()
    ov = {"scenario": sc.name, "world_size": sc.world_size, "model": sc.model.kind,
          "rounds": c.overhead.rounds, "block": c.overhead.block,
          "replay": {str(k): 0.1 for k in reversed(c.overhead_intervals())}}
    assert overhead_matches(ov, c)
    for change in ({"scenario": "other"}, {"world_size": sc.world_size + 1}, {"model": "cnn"},
                   {"rounds": c.overhead.rounds + 1}, {"block": c.overhead.block + 1},
                   {"replay": {"1": 0.1}}, {"replay": None}):
        assert not overhead_matches({**ov, **change}, c), change
    assert not overhead_matches(ov, load_campaign(CONFIGS / "default.toml", quick=True))
    assert not overhead_matches(None, c) and not overhead_matches([ov], c)


def test_report_from_a_trial_table(tmp_path: Path) -> None:
    t = TrialTable(tmp_path / "trials.csv")
    sites = ["weight_storage", "activation"]
    for i in range(12):
        site = sites[i % 2]
        outcome = ["detected", "masked", "escaped", "detected"][i % 4]
        t.append({"id": f"f{i}", "scenario": "m", "kind": "fault", "site": site,
                  "field": ["sign", "exponent"][i % 3 % 2], "fault_model": "transient",
                  "replay_interval": [0, 2][i % 2], "outcome": outcome,
                  "check": "weights" if outcome == "detected" else None,
                  "detect_step": 3 if outcome == "detected" else None, "first_injection": 3,
                  "latency_from_injection": 0 if outcome == "detected" else None,
                  "blame_correct": True if outcome == "detected" else None,
                  "nonfinite_injected": False})
    t.append({"id": "c0", "scenario": "m", "kind": "clean", "replay_interval": 0,
              "outcome": "masked"})
    (tmp_path / "overhead.json").write_text(json.dumps({
        "scenario": "m", "world_size": 3, "rounds": 2, "block": 4, "baseline_step_ms": 2.0,
        "guard_checks_off": 0.05, "nonfinite": 0.1, "weights": 0.2,
        "replay": {"1": 0.8, "2": 0.4}, "total": {"0": 0.3, "1": 1.1, "2": 0.7},
        **{k: v for k, v in _overhead_rounds(0.0, 0.8, 0.0, ks=(1, 2)).items()
           if k != "replay"}}))
    (tmp_path / "campaign.json").write_text(json.dumps({"name": "m", "overhead_budget": 0.5}))
    s = write_report(tmp_path)
    assert (s["trials"], s["clean_trials"], s["false_positives"]) == (12, 1, 0)
    ws = s["sites"]["weight_storage"]
    assert ws["trials"] == 6 and ws["coverage"] == ws["detected"] / (6 - ws["masked"])
    assert set(ws) >= {"trials", "detected", "masked", "escaped", "crashed", "coverage",
                       "coverage_ci95", "latency_steps_p50", "latency_steps_max", "blame_correct"}
    assert s["overhead"]["replay"]["2"] == 0.4 and s["recommended_replay_interval"] == 2
    assert s["recommendation_agreement"] == 1.0 and "replay_fit" in s["recommendation_rule"]
    md = (tmp_path / "report.md").read_text()
    assert "100% of bootstrap resamples" in md and "fit: 40.0%" in md
    for name in ("summary.json", "report.md", "report.html", "coverage_heatmap.png",
                 "latency.png", "replay_interval.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "src='http" not in html
    assert json.loads((tmp_path / "summary.json").read_text())["sites"].keys() == set(sites)


# -- torchrun failure handling ------------------------------------------------------------------
def test_watchdog_ends_a_hung_process() -> None:
    code = ("import time\nfrom scenarios.run.distributed import watchdog\n"
            "with watchdog(0.5, lambda: print('fired', flush=True)):\n    time.sleep(60)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=scaled(120), cwd=CONFIGS.parents[1])
    assert (r.returncode, r.stdout.strip()) == (3, "fired")


def test_a_trial_in_flight_when_the_ranks_went_down_is_recorded(tmp_path: Path) -> None:
    from scenarios.run.runner import CampaignRunner, PoolExecutor
    from scenarios.run.store import write_json

    space = FaultSpace(sites=("weight_storage",), fields=("sign", "exponent"), steps=(2,),
                       ranks=(1,))
    camp = CampaignSpec(name="c", scenarios=(_mlp(),), space=space, clean_trials=1)
    trials = {t.id: t for t in plan_trials(camp)}
    a, b = [t for t in trials.values() if t.kind == "fault"]
    runner = CampaignRunner(camp, tmp_path, PoolExecutor())  # starts nothing until used
    table = TrialTable(tmp_path / "trials.csv")
    write_json(tmp_path / "inflight.json", {"id": a.id, "attempts": 1})
    runner._resolve_inflight(table, trials)
    assert table.done_ids() == set()  # first time: retried
    write_json(tmp_path / "inflight.json", {"id": a.id, "attempts": 2})
    runner._resolve_inflight(table, trials)
    write_json(tmp_path / "inflight.json", {"id": b.id, "attempts": 1,
                                             "reason": "hung: no answer within 9s (watchdog)"})
    runner._resolve_inflight(table, trials)
    runner._resolve_inflight(table, trials)  # already recorded: not twice
    rows = {r["id"]: r for r in table.rows()}
    assert len(table.rows()) == 2
    assert rows[a.id]["outcome"] == "crashed" and rows[b.id]["outcome"] == "hung"
    assert rows[b.id]["site"] == "weight_storage" and "watchdog" in rows[b.id]["error"]


def test_checksum_axis_and_linear_product_site() -> None:
    sc = _mlp(guard={"checksum": {"products": ["forward", "weight_grad"], "interval": 2}})
    assert sc.guard.checksum_config is not None
    assert sc.guard.checksum_config.products == ("forward", "weight_grad")
    assert sc.guard_config(0, False).checksum is False
    assert sc.guard_config(0, True).checksum == sc.guard.checksum  # keeps the table's choice
    with pytest.raises(ScenarioError, match=r"guard\.checksum"):
        _mlp(guard={"checksum": {"interval": 0}})
    assert sc.targets("linear_product") == ["net.0", "net.2", "net.4"]
    plain = CampaignSpec(name="c", scenarios=(sc,), clean_trials=1, space=FaultSpace(
        mode="sample", sites=("linear_product",), trials_per_site=30, seed=3))
    axis = CampaignSpec(name="c", scenarios=(sc,), clean_trials=1, space=FaultSpace(
        mode="sample", sites=("linear_product",), trials_per_site=30, seed=3,
        checksum=(False, True)))
    a, b = plan_trials(plain), plan_trials(axis)
    fa = [t for t in a if t.faults]
    fb = [t for t in b if t.faults]
    # the axis is drawn last: every other draw (and each fault) is the same without it
    assert [t.faults for t in fa] == [t.faults for t in fb]
    assert {t.checksum for t in fa} == {None} and {t.checksum for t in fb} == {False, True}
    assert {t.faults[0].product for t in fb} == {"forward", "input_grad", "weight_grad"}
    assert len([t for t in b if not t.faults]) == 2 * len([t for t in a if not t.faults])
    with pytest.raises(ScenarioError, match="checksum"):
        FaultSpace(mode="sample", checksum=(True, True))


def test_determinism_axis_plans_the_same_faults_on_the_testbed() -> None:
    sc = _mlp(guard={"replay_interval": 2})
    plain = CampaignSpec(name="c", scenarios=(sc,), clean_trials=2, space=FaultSpace(
        mode="sample", sites=("activation",), trials_per_site=30, seed=5,
        replay_intervals=(1, 2)))
    axis = CampaignSpec(name="c", scenarios=(sc,), clean_trials=2, space=FaultSpace(
        mode="sample", sites=("activation",), trials_per_site=30, seed=5,
        replay_intervals=(1, 2), deterministic=(True, False)))
    a, b = plan_trials(plain), plan_trials(axis)
    fa, fb = [t for t in a if t.faults], [t for t in b if t.faults]
    # drawn on a stream of its own: every fault as without the axis; a `true` trial is the
    # very trial the plan without the axis runs (same id: a campaign keeps its ids)
    assert [t.faults for t in fa] == [t.faults for t in fb]
    assert {t.deterministic for t in fa} == {None} and {t.deterministic for t in fb} == {
        True, False}
    same = {t.id for t in fa}
    assert {t.id for t in fb if t.deterministic} <= same
    assert not {t.id for t in fb if t.deterministic is False} & same
    assert len([t for t in b if not t.faults]) == 2 * len([t for t in a if not t.faults])
    assert len(b) == sum(count_trials(axis).values())
    # a `false` trial runs on the testbed: its own name and golden key, the tolerant audit
    bed = scenario_of(axis, next(t for t in fb if t.deterministic is False))
    assert (bed.name, bed.noise_ulps) == ("m-nondet", 4)
    assert bed.training_key() != sc.training_key()
    assert bed.nondeterministic() is bed
    assert scenario_of(axis, next(t for t in fb if t.deterministic)) is sc
    cfg = bed.guard_config(2)
    assert (cfg.replay_mode, cfg.deterministic, cfg.replay_interval) == ("tolerant", False, 2)
    assert sc.guard_config(2).deterministic and sc.guard_config(2).replay_mode == "exact"
    assert bed.guard_config(0).replay_interval == 0
    twin = replace(sc, name="m-nondet")  # a scenario named as the other's testbed
    with pytest.raises(ScenarioError, match="testbed name"):
        CampaignSpec(name="c", scenarios=(sc, twin), space=axis.space)


def test_an_fsdp2_scenario_takes_the_determinism_axis_on_its_testbed() -> None:
    sc = scenario_from_dict({"world_size": 4, "parallel": "fsdp", "guard": {"replay_interval": 2},
                             "sample": {"deterministic": [True, False],
                                        "sites": ["activation"]}}, name="f")
    bed = sc.nondeterministic()
    assert (bed.name, bed.noise_ulps, bed.parallel) == ("f-nondet", 4, "fsdp")
    cfg = bed.guard_config(2)
    assert (cfg.replay_mode, cfg.deterministic) == ("tolerant", False)


@pytest.mark.parametrize(("build", "field"), [
    (lambda: FaultSpace(mode="sample", deterministic=(False, False)), "deterministic"),
    (lambda: FaultSpace(mode="sample", deterministic=(0, 1)), "deterministic"),  # type: ignore[arg-type]
    (lambda: scenario_from_dict({"noise_ulps": 65}, name="m"), "noise_ulps"),
])
def test_determinism_axis_refuses_what_cannot_run(build: Any, field: str) -> None:
    with pytest.raises(ScenarioError) as e:
        build()
    assert e.value.field == field, e.value


def test_muon_state_keys_follow_the_parameter(tmp_path: Path) -> None:
    # Muon keeps a momentum buffer for each matrix; AdamW beside it the moments of the rest.
    sc = scenario_from_dict({"optimizer": {"kind": "muon"}}, name="m")
    assert sc.state_keys("net.0.weight") == ("momentum_buffer",)
    assert sc.state_keys("net.0.bias") == ("exp_avg", "exp_avg_sq")
    p = _write(tmp_path, '[optimizer]\nkind = "muon"\n[[faults]]\nsite = "optimizer_state"\n'
               'rank = 1\nstep = 1\ntarget = "net.0.bias"\nstate_key = "momentum_buffer"\n'
               'bits = [3]\n')
    with pytest.raises(ScenarioError, match=r"one of \['exp_avg', 'exp_avg_sq'\] for optimizer "
                       "'muon' on 'net.0.bias'"):
        load_scenario(p)


def test_the_harness_names_the_extra_when_a_dependency_is_missing() -> None:
    # A dependency of the harness extra made unfindable: one line naming the extra, no
    # traceback, a non-zero exit.
    import subprocess
    import sys

    import scenarios.__main__ as entry

    assert "pandas" in entry.HARNESS and entry.missing_harness() == []
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c",
         "import sys, runpy; sys.modules['pandas'] = None; "
         "import importlib.util as u; real = u.find_spec; "
         "u.find_spec = lambda n, *a: None if n == 'pandas' else real(n, *a); "
         "runpy.run_module('scenarios', run_name='__main__')",
         "campaign", "scenarios/configs/default.toml", "--quick"],
        cwd=root, capture_output=True, text=True, timeout=scaled(120), check=False)
    assert run.returncode != 0
    assert "pip install -e '.[harness]'" in run.stderr and "pandas" in run.stderr
    assert "Traceback" not in run.stderr


# -- the report command's overhead file ---------------------------------------------------------
def test_report_command_takes_an_overhead_file_given_or_named_by_the_campaign(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m scenarios report DIR --overhead-file FILE`` prices the file's overheads;
    without the option, ``[cluster] overhead_file`` (relative to the campaign file, made
    absolute in campaign.json) is read; the option replaces it; a missing or empty one is
    refused naming the field."""
    import shutil

    from scenarios.cli import _load_campaign
    from scenarios.spec.cluster import ClusterSpec

    out = tmp_path / "out"
    out.mkdir()
    full = Path(__file__).resolve().parent / "test_report_data" / "full"
    for f in ("trials.csv", "campaign.json", "overhead.json"):
        shutil.copyfile(full / f, out / f)
    given = tmp_path / "given.json"
    given.write_text(json.dumps({"weights": 0.031}))

    def weights() -> dict[str, Any]:
        used = json.loads((out / "summary.json").read_text())["cost"]["overheads_used"]
        return dict(used["weights"])

    assert main(["report", str(out), "--overhead-file", str(given)]) == 0
    assert weights()["value"] == 0.031 and weights()["source"] == f"--overhead-file {given}"

    conf = tmp_path / "conf"
    (conf / "hw").mkdir(parents=True)
    (conf / "hw" / "mine.json").write_text(json.dumps({"weights": 0.047}))
    (conf / "tiny.toml").write_text('world_size = 3\nsteps = 2\n[model]\nwidth = 4\n')
    camp = conf / "camp.toml"
    camp.write_text('scenarios = ["tiny.toml"]\n[cluster]\noverhead_file = "hw/mine.json"\n')
    assert main(["check", str(camp)]) == 0
    spec = _load_campaign(str(camp)).cluster
    assert spec is not None and spec.overhead_file == str((conf / "hw" / "mine.json").resolve())
    meta = json.loads((out / "campaign.json").read_text())
    meta["cluster"] = spec.to_json()  # as the campaign writes it
    (out / "campaign.json").write_text(json.dumps(meta))
    assert main(["report", str(out)]) == 0
    assert weights()["value"] == 0.047
    assert main(["report", str(out), "--overhead-file", str(given)]) == 0
    assert weights()["value"] == 0.031
    capsys.readouterr()

    camp.write_text('scenarios = ["tiny.toml"]\n[cluster]\noverhead_file = "hw/gone.json"\n')
    assert main(["check", str(camp)]) == 2
    err = capsys.readouterr().err
    assert "cluster.overhead_file = 'hw/gone.json'" in err and "no such file" in err, err
    assert str(camp) in err
    for bad in ("", 3):
        with pytest.raises(ScenarioError, match="relative to the campaign file") as e:
            ClusterSpec(overhead_file=bad)  # type: ignore[arg-type]
        assert e.value.field == "cluster.overhead_file"
