"""The suite's speed factor: hang timeouts wait longer on a slower machine, a hang still fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import (
    SPEED_CAP,
    SPEED_ENV,
    RankFailure,
    factor_from,
    parse_speed,
    run_ranks,
    scaled,
    speed_factor,
)

ROOT = Path(__file__).resolve().parents[1]


def _sleep_then_answer(rank: int, world: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def test_run_ranks_waits_its_timeout_times_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank that answers after 2 s with timeout=1: only a scaled deadline (30 s) lets it in.
    monkeypatch.setenv(SPEED_ENV, "30")
    assert run_ranks(_sleep_then_answer, 1, 2.0, timeout=1) == [0]


def test_a_hang_still_fails_and_the_message_names_the_factor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPEED_ENV, "2")
    with pytest.raises(RankFailure, match=r"within 3s \(timeout=1.5s x speed factor 2\)"):
        run_ranks(_sleep_then_answer, 1, 3600.0, timeout=1.5)


@pytest.mark.timeout(50)
def test_timeout_marks_are_multiplied_by_the_factor(request: pytest.FixtureRequest) -> None:
    mark = request.node.get_closest_marker("timeout")
    assert mark is not None and mark.args[0] == pytest.approx(50 * speed_factor())


def test_the_default_timeout_is_multiplied_too(request: pytest.FixtureRequest) -> None:
    mark = request.node.get_closest_marker("timeout")
    default = float(request.config.getini("timeout"))
    if speed_factor() == 1.0:
        assert mark is None
    else:
        assert mark is not None and mark.args[0] == pytest.approx(default * speed_factor())


def test_the_factor_is_the_measured_time_over_the_reference_kept_within_bounds() -> None:
    assert factor_from(0.5, reference_s=0.25) == 2.0
    assert factor_from(0.1, reference_s=0.25) == 1.0  # a faster machine keeps the timeouts
    assert factor_from(100.0, reference_s=0.25) == SPEED_CAP


def test_scaled_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPEED_ENV, "2.5")
    assert speed_factor() == 2.5 and scaled(120) == 300
    monkeypatch.delenv(SPEED_ENV)
    assert speed_factor() == 1.0


@pytest.mark.parametrize("raw", ["fast", "0", "-2", "nan", "inf", ""])
def test_a_bad_factor_names_the_variable_and_the_fix(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{SPEED_ENV}=.*number > 0.*unset it"):
        parse_speed(raw)


def _pytest(env_speed: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != SPEED_ENV}
    if env_speed is not None:
        env[SPEED_ENV] = env_speed
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=scaled(240), check=False)


def test_the_header_names_an_imposed_factor() -> None:
    run = _pytest("2.5", "--co", "tests/test_speed.py::test_scaled_reads_the_environment")
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"sdc-guard test speed factor: 2.5 (set by {SPEED_ENV})" in run.stdout


def test_the_header_names_a_measured_factor() -> None:
    run = _pytest(None, "--co", "tests/test_speed.py::test_scaled_reads_the_environment")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "sdc-guard test speed factor: " in run.stdout and "(measured;" in run.stdout


def test_a_bad_factor_stops_the_session_with_the_fix() -> None:
    run = _pytest("fast", "--co", "tests/test_speed.py")
    assert run.returncode != 0
    assert f"{SPEED_ENV}='fast'" in run.stderr
