"""The campaign's ``patterns`` axis: field fault shapes planned, injected and reported."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from injectors import Fault, InjectionContext, arm
from injectors.patterns import PATTERNS, pattern_fields
from scenarios.report.summary import MIN_CELL, pattern_cells
from scenarios.spec.campaign import CampaignSpec
from scenarios.spec.errors import ScenarioError
from scenarios.spec.faults import FaultSpace
from scenarios.spec.scenario import scenario_from_dict
from scenarios.spec.trials import plan_trials

SITES = ("weight_storage", "optimizer_state", "activation", "linear_product")


def _mlp(**kw: Any) -> Any:
    return scenario_from_dict({"steps": 10, **kw}, name="m")


def _plan(**space: Any) -> list[Any]:
    camp = CampaignSpec(name="c", scenarios=(_mlp(),), clean_trials=1,
                        space=FaultSpace(mode="sample", seed=3, **space))
    return [t for t in plan_trials(camp) if t.kind == "fault"]


def test_without_the_axis_the_plan_is_the_one_before_it() -> None:
    # "single" alone draws nothing more: the same trials, ids and faults (so the default
    # campaign's one-bit numbers stay comparable run to run).
    before = _plan(sites=SITES, trials_per_site=20)
    single = _plan(sites=SITES, trials_per_site=20, patterns=("single",))
    assert [t.id for t in before] == [t.id for t in single]
    assert [t.faults for t in before] == [t.faults for t in single]
    assert {t.pattern for t in before} == {"single"}
    assert all(t.faults[0].burst == 1 and t.faults[0].kind in ("bitflip", "set") for t in before)


def test_each_pattern_lays_its_fields_over_the_fault_and_fits_its_target() -> None:
    trials = _plan(sites=SITES, trials_per_site=60, patterns=tuple(PATTERNS),
                   fields=("sign", "exponent", "mantissa"))
    seen = {t.pattern for t in trials}
    assert seen == set(PATTERNS)
    scenario = _mlp()
    for t in trials:
        f: Fault = t.faults[0]
        p = PATTERNS[t.pattern]
        for key, value in p.fields.items():
            assert getattr(f, key) == value, (t.pattern, key)
        if p.model:
            assert f.model == t.fault_model == p.model
        if not p.bit_field:
            assert f.field is None and t.field == "value"
        shapes = scenario.target_shapes(t.site, None, f.product)
        shape = shapes[f.target]
        assert f.span(shape) <= math.prod(shape), (t.pattern, t.site, f.target, shape)
    column = [t for t in trials if t.pattern == "column"]
    assert column and all(t.faults[0].along == "column" for t in column)
    # ids differ from the one-bit trial's with the same draws, and are stable
    again = _plan(sites=SITES, trials_per_site=60, patterns=tuple(PATTERNS),
                  fields=("sign", "exponent", "mantissa"))
    assert [t.id for t in again] == [t.id for t in trials]
    assert len({t.id for t in trials}) == len(trials)


def test_a_matrix_takes_every_pattern() -> None:
    camp = CampaignSpec(name="c", scenarios=(_mlp(),), clean_trials=1, space=FaultSpace(
        sites=("weight_storage",), fields=("exponent",), steps=(2,), ranks=(1,),
        patterns=("single", "burst_same", "stuck")))
    trials = [t for t in plan_trials(camp) if t.kind == "fault"]
    assert [t.pattern for t in trials] == ["single", "burst_same", "stuck"]
    one = CampaignSpec(name="c", scenarios=(_mlp(),), clean_trials=1, space=FaultSpace(
        sites=("weight_storage",), fields=("exponent",), steps=(2,), ranks=(1,)))
    assert [t.id for t in plan_trials(one) if t.kind == "fault"] == [trials[0].id]


def test_bad_patterns_are_named() -> None:
    with pytest.raises(ScenarioError, match="patterns"):
        FaultSpace(mode="sample", patterns=("burst",))
    with pytest.raises(ScenarioError, match=r"fields.*bit fields only"):
        FaultSpace(mode="sample", patterns=("single", "burst_same"), fields=("sign", "nan"))


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_every_pattern_injects_into_a_real_tensor(name: str) -> None:
    # On a plain loop: the record of what changed has the pattern's shape, and only the
    # elements it names changed (a float32 and a bfloat16 weight, a column of 8 rows).
    for dtype in (torch.float32, torch.bfloat16):
        model = torch.nn.Linear(16, 12).to(dtype)
        before = model.weight.detach().clone()
        base = {"site": "weight_storage", "rank": 0, "step": 0, "target": "weight",
                "model": "transient", "seed": 11, "kind": "bitflip", "field": "mantissa",
                "count": 1}
        fault = Fault(**pattern_fields(name, base))
        ctx = InjectionContext.plain(model, rank=0, world_size=1)
        with arm(fault, context=ctx) as handle:
            handle.begin_step(0)
            changed = (model.weight.detach().view(-1).view(torch.int16 if dtype != torch.float32
                                                         else torch.int32)
                       != before.view(-1).view(torch.int16 if dtype != torch.float32
                                              else torch.int32))
            rec = handle.records[0]
        burst, along = PATTERNS[name].span
        stride = 16 if along == "column" else 1
        at = int(rec["index"])
        allowed = {at + j * stride for j in range(burst)}
        assert set(torch.nonzero(changed).view(-1).tolist()) <= allowed
        if name not in ("stuck",):  # a stuck bit changes only where the data held 0
            assert bool(changed.any())


def test_cells_rank_by_escape_rate_and_leave_small_ones_unranked() -> None:
    rows = []
    for pat, site, escaped, detected, masked in (("burst_same", "weight_storage", 10, 110, 5),
                                                 ("column", "linear_product", 40, 80, 0),
                                                 ("stuck", "weight_storage", 1, 20, 3),
                                                 ("single", "weight_storage", 0, 100, 50)):
        for outcome, k in (("escaped", escaped), ("detected", detected), ("masked", masked)):
            rows += [{"pattern": pat, "site": site, "injected_dtype": "float32",
                      "outcome": outcome, "blame_correct": True, "contained": True,
                      "kind": "fault", "injections": 1, "latency_from_injection": 1,
                      "latency_from_divergence": 1}] * k
    cells = pattern_cells(pd.DataFrame(rows))
    assert [(c["pattern"], c["ranked"]) for c in cells] == [
        ("column", True), ("burst_same", True), ("single", True), ("stuck", False)]
    assert cells[0]["not_masked"] == 120 >= MIN_CELL and cells[0]["escape_rate"] == 40 / 120
    lo, hi = cells[0]["escape_rate_ci95"]
    assert lo < 1 / 3 < hi
    assert pattern_cells(pd.DataFrame(rows).assign(pattern="single")) == []


def test_a_campaign_with_patterns_runs_and_reports_them(tmp_path: Path) -> None:
    # Every pattern injected during real distributed training (3 gloo ranks), the table's
    # pattern column filled, and the report's pattern tables written.
    from scenarios.cli import main

    camp = tmp_path / "c.toml"
    (tmp_path / "s.toml").write_text('world_size = 3\nsteps = 4\nbatch = 16\n'
                                     '[model]\nkind = "mlp"\nwidth = 16\ndepth = 2\n')
    camp.write_text('name = "p"\nscenarios = ["s.toml"]\nclean_trials = 1\noverhead = false\n'
                    '[sample]\nsites = ["weight_storage", "linear_product"]\n'
                    'fields = ["exponent"]\n'
                    f'patterns = {list(PATTERNS)!r}\n'.replace("'", '"')
                    + 'trials_per_site = 7\nreplay_intervals = [1]\nchecksum = [true]\nseed = 4\n')
    out = tmp_path / "out"
    assert main(["campaign", str(camp), "--out", str(out), "--no-progress"]) == 0
    df = pd.read_csv(out / "trials.csv", keep_default_na=False)
    faults = df[df["kind"] == "fault"]
    assert set(faults["pattern"]) <= set(PATTERNS) and len(set(faults["pattern"])) >= 4
    assert set(df[df["kind"] == "clean"]["pattern"]) == {""}
    assert not faults["error"].astype(str).str.len().any(), faults["error"].tolist()
    report = (out / "report.md").read_text()
    assert "Coverage by fault pattern" in report and "highest escape rate first" in report
    summary = json.loads((out / "summary.json").read_text())
    checks = summary["pattern_checks"]
    assert set(checks) == set(faults["pattern"])
    for pat, row in checks.items():
        g = faults[(faults["pattern"] == pat) & (faults["outcome"] != "masked")]
        assert row["n"] == len(g)
        assert row["any"] == (None if not len(g) else (g["outcome"] == "detected").mean())
    assert (out / "pattern_checks.svg").read_text().count("<svg") == 1


def test_the_cost_model_weighs_patterns_by_the_cluster_mix() -> None:
    from scenarios.report.cost import trial_weights
    from scenarios.spec.cluster import DEFAULT_PATTERN_MIX, ClusterSpec

    rows = []
    for i, (pat, field) in enumerate([("single", "sign"), ("single", "exponent"),
                                      ("single", "exponent"), ("multi_bit", "any"),
                                      ("burst_same", "exponent"), ("burst_same", "mantissa")]):
        rows.append({"id": str(i), "site": "weight_storage", "field": field, "pattern": pat})
    faults = pd.DataFrame(rows)
    w = trial_weights(faults, ClusterSpec())
    mix = dict(DEFAULT_PATTERN_MIX)
    single = faults["pattern"] == "single"
    assert math.isclose(float(w[single].sum()), mix["single"])
    assert math.isclose(float(w[faults["pattern"] == "multi_bit"].sum()), mix["multi_bit"])
    assert float(w[faults["pattern"] == "burst_same"].sum()) == 0.0  # no share in the study
    # within single, the bit-field mix: exponent weighs 8 bits to the sign's 1
    assert math.isclose(float(w[single & (faults["field"] == "exponent")].sum())
                        / float(w[single & (faults["field"] == "sign")].sum()), 8.0)
    own = ClusterSpec(pattern_mix=(("single", 1.0), ("burst_same", 1.0)))
    w = trial_weights(faults, own)
    assert math.isclose(float(w[faults["pattern"] == "burst_same"].sum()), 1.0)
    assert w[faults["pattern"] == "burst_same"].nunique() == 1  # its fields count alike
    # one-bit faults alone: the weights of before, up to one factor (the shares are ratios)
    only = faults[single]
    before = only["field"].map(dict(ClusterSpec().field_mix)) / only.groupby(
        "field")["id"].transform("size")
    ratio = trial_weights(only, ClusterSpec()) / before
    assert float(ratio.max() - ratio.min()) <= 1e-12 * float(ratio.max())
