"""Every path a spec names stays inside --out: names, [guard] event_log, symbolic links."""

from __future__ import annotations

from pathlib import Path

import pytest

from scenarios.cli import main
from scenarios.run.runner import CampaignRunner, PoolExecutor
from scenarios.spec.campaign import campaign_for_scenario, campaign_from_dict
from scenarios.spec.errors import ScenarioError
from scenarios.spec.scenario import scenario_from_dict
from sdc_guard import read_events
from tests.launch import scaled

TINY = {"world_size": 3, "steps": 2, "batch": 4, "trial_timeout_s": scaled(30),
        "model": {"kind": "mlp", "width": 4, "depth": 1}}


@pytest.mark.parametrize("name", ["..", ".", "../x", "/etc", "a/b", ".hidden", "x" * 129, "é"])
def test_scenario_and_campaign_names_are_one_file_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ScenarioError, match=r"name = .* letters, digits") as err:
        scenario_from_dict(TINY, name=name)
    assert err.value.field == "name"
    (tmp_path / "tiny.toml").write_text('world_size = 3\nsteps = 2\n[model]\nwidth = 4\n')
    with pytest.raises(ScenarioError, match="letters, digits") as err:
        campaign_from_dict({"name": name, "scenarios": ["tiny.toml"]}, name="c",
                           base_dir=tmp_path)
    assert err.value.field == "name"


def test_a_name_that_would_leave_the_output_tree_is_refused_by_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "s.toml"
    p.write_text('name = ".."\nworld_size = 3\nsteps = 2\n')
    assert main(["check", str(p)]) == 2
    assert "name = '..' is not valid" in capsys.readouterr().err


@pytest.mark.parametrize(("log", "why"), [
    ("/tmp/events.jsonl", "an absolute path leaves the output directory"),
    ("../events.jsonl", "'..' leaves the output directory"),
    ("logs/../../events.jsonl", "'..' leaves the output directory"),
])
def test_an_event_log_outside_out_is_refused_naming_the_field(log: str, why: str) -> None:
    with pytest.raises(ScenarioError, match="written under --out") as err:
        scenario_from_dict({**TINY, "guard": {"event_log": log}}, name="tiny")
    assert err.value.field == "guard.event_log" and err.value.reason == why


def test_an_event_log_behind_a_symlink_leading_out_is_refused_when_the_run_starts(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (out / "logs").symlink_to(tmp_path / "elsewhere")
    sc = scenario_from_dict({**TINY, "guard": {"event_log": "logs/events.jsonl"}}, name="tiny")
    with pytest.raises(ScenarioError, match="outside") as err:
        CampaignRunner(campaign_for_scenario(sc), out, PoolExecutor(), progress=False)
    assert err.value.field == "guard.event_log" and "scenario 'tiny'" in str(err.value)
    assert str(tmp_path / "elsewhere" / "events.jsonl") in str(err.value)


def test_the_ranks_write_the_event_log_under_out(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # where a relative event_log went before: the ranks' directory
    sc = scenario_from_dict({**TINY, "guard": {"event_log": "logs/events.jsonl"},
                             "faults": [{"site": "weight_storage", "rank": 1, "step": 1,
                                         "target": "net.0.weight", "bits": [30]}]}, name="tiny")
    out = tmp_path / "out"
    executor = PoolExecutor()
    try:
        CampaignRunner(campaign_for_scenario(sc), out, executor, progress=False).run()
    finally:
        executor.close()
    assert (out / "logs" / "events.jsonl").is_file()
    injections = [e for e in read_events(out / "logs" / "events.jsonl")
                  if e.get("event") == "injection"]
    assert [(e["rank"], e["step"], e["site"]) for e in injections] == [(1, 1, "weight_storage")]
    assert not (cwd / "logs").exists()
