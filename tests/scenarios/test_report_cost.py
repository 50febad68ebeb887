"""The cost model, the [cluster] table, latency percentiles and the report's first screen."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from scenarios.report.cost import OPTIONAL_CHECKS, configurations, cost_model
from scenarios.report.latency import latency_distribution
from scenarios.report.render import write_report
from scenarios.report.summary import summarize
from scenarios.report.table import read_trials
from scenarios.run.store import TrialTable
from scenarios.spec.campaign import load_campaign
from scenarios.spec.cluster import ClusterSpec, cluster_from_table
from scenarios.spec.errors import ScenarioError

DATA = Path(__file__).resolve().parent / "test_report_data"
CONFIGS = Path(__file__).resolve().parents[2] / "scenarios" / "configs"


def _faults(tmp_path: Path, rows: list[dict[str, Any]]) -> pd.DataFrame:
    t = TrialTable(tmp_path / "trials.csv")
    for i, r in enumerate(rows):
        t.append({"id": f"t{i}", "scenario": "m", "kind": "fault", "site": "weight_storage",
                  "field": "exponent", "fault_model": "transient", **r})
    df = read_trials(tmp_path / "trials.csv")
    return df[df["kind"] == "fault"]


def _det(check: str = "weights", lat: int = 0, k: int = 0) -> dict[str, Any]:
    return {"outcome": "detected", "check": check, "checks": check, "replay_interval": k,
            "latency_from_injection": lat}


def test_known_answer(tmp_path: Path) -> None:
    faults = _faults(tmp_path, [_det(lat=2), _det(lat=0),
                                {"outcome": "escaped", "replay_interval": 0},
                                {"outcome": "masked", "replay_interval": 0}])
    ov = {"guard_checks_off": 0.0, "nonfinite": 0.01, "weights": 0.2}
    # 1 state-changing SDC a day on 10 GPUs; 3.6 s steps; checkpoints every 100 steps.
    cl = ClusterSpec(gpus=10, sdc_per_gpu_hour=1 / 240, step_time_s=3.6,
                     checkpoint_interval_steps=100, restart_s=360, escape_gpu_hours=100)
    rows = {r["name"]: r for r in configurations(faults, ov, None, cl, exchange_interval=8)}
    assert set(rows) == {"replay off +weights", "replay off +weights/2", "replay off +weights/4",
                         "replay off +weights/8", "replay off"}
    on, off = rows["replay off +weights"], rows["replay off"]
    # Every 4th step: a quarter of the overhead; the weights check's detections wait 1.5 more
    # steps on average (both detections here are the weights check's).
    w4 = rows["replay off +weights/4"]
    assert w4["overhead"] == pytest.approx(0.01 + 0.2 / 4) and w4["weights_interval"] == 4
    assert w4["outcomes"]["weights_share"] == pytest.approx(1.0)
    t4 = 3.6 * (1 + w4["overhead"]) / 3600
    assert w4["parts"]["detection_latency"] == pytest.approx(1 * (2 / 3) * 10 * 2.5 * t4)
    f = 0.21
    t_h = 3.6 * (1 + f) / 3600
    assert on["overhead"] == pytest.approx(f)
    assert on["parts"] == pytest.approx({
        "check_overhead": 10 * 24 * f / (1 + f),
        "detection_latency": 1 * (2 / 3) * 10 * 1.0 * t_h,  # mean latency 1 step
        "rollback": 1 * (2 / 3) * 10 * 50 * t_h,
        "restart": 1 * (2 / 3) * 10 * 0.1,
        "escapes": 1 * (1 / 3) * 100,
    })
    assert on["total"] == pytest.approx(sum(on["parts"].values()))
    assert on["total_low"] <= on["total"] <= on["total_high"]
    # Without the weights check its detections are counted as escapes.
    assert off["outcomes"]["escaped"] == pytest.approx(1.0)
    assert off["outcomes"]["detections_lost_to_checks_off"] == 2
    assert off["parts"]["escapes"] == pytest.approx(100.0)
    assert off["overhead"] == pytest.approx(0.01)
    model = cost_model(faults, ov, None, cl, 8)
    assert model["recommendation"]["name"] in rows
    assert model["recommendation"]["name"] == min(rows.values(), key=lambda r: r["total"])["name"]
    assert set(model["sensitivity"]) == {"x0.1", "x10"}


def test_nonfinite_report_delay_and_the_checksum_hook(tmp_path: Path) -> None:
    assert "checksum" in OPTIONAL_CHECKS
    faults = _faults(tmp_path, [_det("nonfinite"), _det("checksum", k=2),
                                {"outcome": "escaped", "replay_interval": 2}])
    cl = ClusterSpec(gpus=1, sdc_per_gpu_hour=1 / 24, step_time_s=3600,
                     checkpoint_interval_steps=2)
    ov = {"guard_checks_off": 0.0, "nonfinite": 0.0, "weights": 0.1, "checksum": 0.05,
          "replay": {"2": 0.3}}
    rows = {r["name"]: r for r in configurations(faults, ov, None, cl, exchange_interval=8)}
    # weights never fired in these trials: not a knob; checksum did.
    assert set(rows) == {"replay off +checksum", "replay off", "replay 2 +checksum", "replay 2"}
    # a non-finite detection is reported (8 + 1) / 2 steps later on average
    assert rows["replay off"]["parts"]["detection_latency"] == pytest.approx(4.5)
    assert rows["replay 2 +checksum"]["overhead"] == pytest.approx(0.35)
    assert rows["replay 2"]["outcomes"]["escaped"] == pytest.approx(1.0)


def test_field_mix_weights_the_coverage(tmp_path: Path) -> None:
    rows = [{"field": "nan", **_det("nonfinite")} for _ in range(3)]
    rows += [{"field": "mantissa", "outcome": "escaped", "replay_interval": 0}] * 3
    faults = _faults(tmp_path, rows)
    from scenarios.report.cost import field_coverage

    fc = field_coverage(faults, ClusterSpec(), ["weight_storage"])
    assert fc is not None and fc["all"]["sampled"] == pytest.approx(0.5)
    nan = dict(ClusterSpec().field_mix)["nan"]
    man = dict(ClusterSpec().field_mix)["mantissa"]
    assert fc["all"]["weighted"] == pytest.approx(nan / (nan + man))
    even = field_coverage(faults, ClusterSpec(field_mix=(("nan", 1.0), ("mantissa", 1.0))),
                          ["weight_storage"])
    assert even is not None and even["all"]["weighted"] == pytest.approx(0.5)


def test_latency_percentiles(tmp_path: Path) -> None:
    faults = _faults(tmp_path, [_det(lat=x) for x in (0, 0, 1, 2, 6)])
    lat = latency_distribution(faults, ["weight_storage"])
    d = lat["from_injection"]["checks"]["weights"]
    assert (d["n"], d["p50"], d["max"]) == (5, 1.0, 6.0)
    assert d["p90"] == pytest.approx(4.4) and d["mean"] == pytest.approx(1.8)
    assert lat["from_injection"]["sites"]["weight_storage"] == d
    assert lat["from_injection"]["check_histogram"]["weights"] == {"0": 2, "1": 1, "2": 1,
                                                                  "6": 1}
    assert lat["nonfinite_report_delay"]["steps_mean"] == pytest.approx(4.5)


def test_cluster_table_from_the_campaign_file_and_the_command_line(tmp_path: Path) -> None:
    text = (CONFIGS / "default.toml").read_text()
    camp = tmp_path / "c.toml"
    for f in ("mlp.toml", "cnn_bn.toml", "mlp_wide.toml", "mlp_hsdp.toml"):
        shutil.copyfile(CONFIGS / f, tmp_path / f)
    camp.write_text(text + "\n[cluster]\ngpus = 512\nrestart_s = 60\n"
                           "[cluster.overhead]\nweights = 0.03\n")
    c = load_campaign(camp)
    assert c.cluster is not None and c.cluster.gpus == 512
    assert c.to_json()["cluster"]["overhead"] == {"weights": 0.03}
    assert "cluster" not in load_campaign(CONFIGS / "default.toml").to_json()  # plans unchanged
    camp.write_text(text + "\n[cluster]\ngpu = 512\n")
    with pytest.raises(ScenarioError, match=r"cluster\.gpu"):
        load_campaign(camp)
    with pytest.raises(ScenarioError, match=r"cluster\.restart_s"):
        cluster_from_table({"restart_s": -1})
    # campaign.json carries the table; the command line wins over it
    out = tmp_path / "out"
    shutil.copytree(DATA / "full", out)
    meta = json.loads((out / "campaign.json").read_text())
    meta["cluster"] = c.to_json()["cluster"]
    (out / "campaign.json").write_text(json.dumps(meta))
    s = summarize(out)
    assert s["cost"]["cluster"]["gpus"] == 512 and s["cost"]["cluster"]["restart_s"] == 60
    s = summarize(out, {"gpus": 8, "overhead": (("nonfinite", 0.0),)})
    assert s["cost"]["cluster"]["gpus"] == 8
    assert s["cost"]["cluster"]["overhead"] == {"weights": 0.03, "nonfinite": 0.0}
    from scenarios.report.__main__ import main

    assert main([str(out), "--gpus", "64", "--check-overhead", "weights=0.5"]) == 0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["cost"]["cluster"]["gpus"] == 64
    assert saved["cost"]["cluster"]["overhead"]["weights"] == 0.5
    assert main([str(out), "--check-overhead", "weights"]) == 2


def test_report_opens_with_the_answer_and_is_self_contained(tmp_path: Path) -> None:
    out = tmp_path / "full"
    shutil.copytree(DATA / "full", out)
    s = write_report(out)
    rec = s["cost"]["recommendation"]
    assert rec["name"] in {r["name"] for r in s["cost"]["configurations"]}
    assert rec["gpu_hours_per_day"] == min(r["total"] for r in s["cost"]["configurations"])
    page = (out / "report.html").read_text()
    answer, evidence = page.index("The answer"), page.index("The evidence")
    assert answer < evidence
    first = page[answer:evidence]
    for needle in (rec["name"], "GPU-hours per day", "false positives", "in the field",
                   "sampled (raw)", "weight_storage", "How sure", "example cluster"):
        assert needle in first, needle
    # one answer: the budget rule is evidence, below it, not a second recommendation
    assert "budget rule" not in first.lower() and "budget rule" in page[evidence:]
    assert page.count("<svg") == 3 and page.count("data:image/png;base64,") == 3
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", page)
    assert "<script" not in page and "<link" not in page and "@import" not in page
    md = (out / "report.md").read_text()
    assert md.index("## The answer") < md.index("## Cost model") < md.index("## Plots")
    for name in ("latency_cdf.svg", "cost.svg"):
        svg = (out / name).read_text()
        assert "GPU-hours per day" in svg or "steps" in svg


def test_report_of_a_campaign_without_fault_trials(tmp_path: Path) -> None:
    TrialTable(tmp_path / "trials.csv").append({"id": "c", "kind": "clean", "scenario": "m",
                                                "replay_interval": 0, "outcome": "masked"})
    s = write_report(tmp_path)
    assert (s["trials"], s["clean_trials"], s["cost"]["recommendation"]) == (0, 1, None)
    assert "No configuration could be priced" in (tmp_path / "report.md").read_text()


def test_a_checksum_axis_prices_each_setting_on_its_own_trials(tmp_path: Path) -> None:
    # checksum on: 2 trials, both caught by it; off: 2 trials, one escaped, one replay-free
    faults = _faults(tmp_path, [{**_det("checksum"), "checksum": True},
                                {**_det("checksum"), "checksum": True},
                                {"outcome": "escaped", "replay_interval": 0, "checksum": False},
                                {**_det("nonfinite"), "checksum": False}])
    cl = ClusterSpec(gpus=1, sdc_per_gpu_hour=1 / 24, step_time_s=36.0,
                     checkpoint_interval_steps=2)
    ov = {"guard_checks_off": 0.0, "nonfinite": 0.0, "checksum": 0.05}
    rows = {r["name"]: r for r in configurations(faults, ov, None, cl, exchange_interval=1)}
    assert set(rows) == {"replay off +checksum", "replay off"}
    assert rows["replay off +checksum"]["outcomes"]["escaped"] == pytest.approx(0.0)
    assert rows["replay off +checksum"]["outcomes"]["trials"] == 2
    off = rows["replay off"]["outcomes"]
    assert off["escaped"] == pytest.approx(0.5) and off["detections_lost_to_checks_off"] == 0


def test_resample_strata_take_trials_with_a_setting_left_empty() -> None:
    """A campaign whose sharded scenario has a space of its own leaves the checksum column
    empty in its trials (NaN beside the DDP trials' booleans): the bootstrap's strata still
    sort, and every trial is drawn within its own."""
    from scenarios.report.decide import trial_draws

    faults = pd.DataFrame({"replay_interval": [0, 0, 2, 0], "site": ["a", "a", "a", "b"],
                           "checksum": [True, False, True, float("nan")],
                           "field": ["sign", "sign", "sign", "sign"]})
    counts = trial_draws(faults, n=50)
    assert counts.shape == (50, 4)
    # each trial is alone in its stratum here: drawn exactly once per resample
    assert (counts == 1).all()
