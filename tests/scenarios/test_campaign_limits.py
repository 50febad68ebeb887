"""Seeds, steps, sizes and trial counts are bounded, each refused naming its field and limit;
``scenarios check`` answers in seconds whatever a file asks for."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scenarios.cli import main
from scenarios.spec.limits import MAX_PARAMETERS, MAX_SEED, MAX_TRIALS
from scenarios.spec.scenario import load_scenario

SCENARIO = """
name = "tiny"
world_size = 3
steps = 6
batch = 4
seed = {seed}
[model]
kind = "mlp"
width = {width}
depth = {depth}
"""

FAULT = """
[[faults]]
site = "weight_storage"
rank = 1
step = 2
target = "net.0.weight"
bits = [3]
"""


def _scenario(tmp_path: Path, extra: str = "", *, seed: int = 0, width: int = 4,
              depth: int = 1, name: str = "tiny.toml") -> Path:
    p = tmp_path / name
    p.write_text(SCENARIO.format(seed=seed, width=width, depth=depth) + extra)
    return p


def _check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    t0 = time.monotonic()
    code = main(["check", str(path)])
    assert time.monotonic() - t0 < 30.0, "check took too long"
    got = capsys.readouterr()
    return code, got.err + got.out


@pytest.mark.parametrize(("extra", "seed", "field", "limit"), [
    ("", 2**64, "seed", f"[0, {MAX_SEED}]"),
    ("", 2**63, "seed", f"[0, {MAX_SEED}]"),
    (FAULT + "seed = 18446744073709551616\n", 0, "faults[0].seed", f"[0, {MAX_SEED}]"),
    (FAULT + "seed = -1\n", 0, "faults[0].seed", f"[0, {MAX_SEED}]"),
    (FAULT + "burst = 99999999999999999999\n", 0, "faults[0].burst", "[1, 64]"),
    ("[sample]\nsites = [\"weight_storage\"]\ntrials_per_site = 2\nseed = 9223372036854775808\n",
     0, "sample.seed", f"[0, {MAX_SEED}]"),
    ("[sample]\nsites = [\"weight_storage\"]\ntrials_per_site = 2\n"
     "replay_intervals = [99999999999999999999]\n", 0, "sample.replay_intervals",
     "[0, 100000]"),
])
def test_seeds_and_sizes_beyond_their_limit_are_refused_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, seed: int, field: str,
        limit: str) -> None:
    code, out = _check(_scenario(tmp_path, extra, seed=seed), capsys)
    assert code == 2, out
    assert f": {field} = " in out and limit in out, out


def test_the_largest_seed_builds_and_trains_its_model_data(tmp_path: Path) -> None:
    sc = load_scenario(_scenario(tmp_path, FAULT.replace("bits = [3]", "bits = [3]\nseed = "
                                                         f"{MAX_SEED}"), seed=MAX_SEED))
    assert sc.seed == MAX_SEED and sc.faults[0].seed == MAX_SEED
    assert sc.targets("weight_storage")  # builds the model from the seed


def test_a_model_beyond_the_parameter_limit_is_refused_without_building_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _check(_scenario(tmp_path, FAULT, width=4096, depth=64), capsys)
    assert code == 2
    assert "model.width = 4096 is not valid (a mlp of width 4096 and depth 64 has " in out
    assert f"at most {MAX_PARAMETERS:,} parameters" in out


CAMPAIGN = 'scenarios = ["tiny.toml"]\n'


@pytest.mark.parametrize(("text", "field"), [
    ("clean_trials = 1000000000\n", "clean_trials"),
    ("clean_trials = 12000\n[matrix]\nsites = [\"weight_storage\"]\nsteps = [1]\n"
     "replay_intervals = [0, 1]\n", "clean_trials"),
    ("[sample]\ntrials_per_site = 1000000000\n", "sample.trials_per_site"),
    ("[sample]\nmargin = 0.000001\n", "sample"),
    ("[matrix]\nsteps = [1, 2, 3, 4, 5]\nrepeat = 1000\n", "matrix"),
])
def test_trial_counts_beyond_the_limit_are_refused_in_seconds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str) -> None:
    _scenario(tmp_path)
    camp = tmp_path / "camp.toml"
    camp.write_text(CAMPAIGN + text)
    code, out = _check(camp, capsys)
    assert code == 2, out
    assert f": {field} = " in out and str(MAX_TRIALS) in out.replace(",", ""), out


def test_a_campaign_at_the_limit_is_checked_and_planned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _scenario(tmp_path)
    camp = tmp_path / "camp.toml"
    camp.write_text(CAMPAIGN + "clean_trials = 1\n[sample]\nsites = [\"weight_storage\"]\n"
                    f"trials_per_site = {MAX_TRIALS - 1}\n")
    code, out = _check(camp, capsys)
    assert code == 0 and f"{MAX_TRIALS} trials" in out, out
