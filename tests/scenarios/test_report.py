"""The report on a fixed trial table: today's numbers, from pandas, SciPy and NumPy.

``test_report_data/{full,small}`` hold a realistic ``trials.csv`` (with ``overhead.json`` and
``campaign.json``) and ``expected_summary.json``: what the hand-written report code (commit
a5b59a6) computed from them. Counts and coverage must match exactly, intervals and fits to
float tolerance, the bootstrap's agreement within Monte-Carlo error.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from scenarios.report.render import summary_text
from scenarios.report.summary import recommendation_agreement, summarize, wilson

DATA = Path(__file__).resolve().parent / "test_report_data"
MC_KEYS = {"recommendation_agreement"}
"""Bootstrap estimates: compared within Monte-Carlo error (``_mc_close``)."""
GROWING_KEYS = {"site_order"}
"""Lists that grow with the library (new fault sites): the snapshot's must be a prefix."""


def _campaign(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    out.mkdir()
    for f in ("trials.csv", "overhead.json", "campaign.json"):
        if (DATA / name / f).exists():
            shutil.copyfile(DATA / name / f, out / f)
    return out


def _mc_close(a: float | None, b: float | None, n: int = 1000) -> bool:
    """Two bootstrap estimates of one proportion, each from n resamples: within 4 standard
    errors of their difference (plus one resample's worth)."""
    if a is None or b is None:
        return a is b
    p = (a + b) / 2
    return abs(a - b) <= 4 * math.sqrt(2 * p * (1 - p) / n) + 1 / n


def _compare(old: Any, new: Any, path: str = "") -> list[str]:
    """Where ``new`` differs from ``old`` (keys only in ``new`` are new fields: allowed)."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{path}: {new!r} is not a mapping"]
        diffs = [f"{path}.{k}: missing" for k in old if k not in new]
        for k in old:
            if k in new:
                sub = f"{path}.{k}"
                if k in GROWING_KEYS:
                    if new[k][:len(old[k])] != old[k]:
                        diffs.append(f"{sub}: {new[k]!r} does not start with {old[k]!r}")
                elif k in MC_KEYS:
                    if not _mc_close(old[k], new[k]):
                        diffs.append(f"{sub}: {new[k]!r} vs {old[k]!r} (Monte-Carlo)")
                else:
                    diffs += _compare(old[k], new[k], sub)
        return diffs
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{path}: {new!r} vs {old!r}"]
        return [d for i, (a, b) in enumerate(zip(old, new, strict=True))
                for d in _compare(a, b, f"{path}[{i}]")]
    if isinstance(old, float) and not isinstance(new, bool) and isinstance(new, (int, float)):
        return [] if new == pytest.approx(old, rel=1e-12, abs=1e-12) else [
            f"{path}: {new!r} vs {old!r}"]
    if isinstance(old, bool) or old is None or isinstance(old, str):
        return [] if new == old and type(new) is type(old) else [f"{path}: {new!r} vs {old!r}"]
    if isinstance(old, int):  # counts: exactly (a median of ints may be a float equal to it)
        return [] if new == old and not isinstance(new, bool) else [f"{path}: {new!r} vs {old!r}"]
    return [] if new == old else [f"{path}: {new!r} vs {old!r}"]


@pytest.mark.parametrize("name", ["full", "small"])
def test_summary_reproduces_the_hand_written_numbers(tmp_path: Path, name: str) -> None:
    expected = json.loads((DATA / name / "expected_summary.json").read_text())
    got = json.loads(json.dumps(summarize(_campaign(tmp_path, name)), sort_keys=True))
    assert _compare(expected, got) == []


def test_counts_and_coverage_are_exact(tmp_path: Path) -> None:
    expected = json.loads((DATA / "full" / "expected_summary.json").read_text())
    got = summarize(_campaign(tmp_path, "full"))
    for table in ("sites", "fields", "fault_models", "scenarios", "replay_intervals"):
        for key, g in expected[table].items():
            for col in ("trials", "detected", "masked", "escaped", "crashed", "hung",
                        "coverage", "escape_rate", "blame_correct", "contained", "not_fired"):
                assert got[table][key][col] == g[col], (table, key, col)
    assert got["outcomes"] == expected["outcomes"] and got["targets"] == expected["targets"]
    assert got["latency_histogram"] == expected["latency_histogram"]


def test_wilson_equals_the_textbook_formula_with_z_196() -> None:
    extra = json.loads((DATA / "full" / "expected_extra.json").read_text())
    for kn, want in extra["wilson"].items():
        k, n = map(int, kn.split("/"))
        got = wilson(k, n)
        assert got is not None and got == pytest.approx(want, abs=1e-12), kn
    assert wilson(0, 0) is None


def test_bootstrap_agreement_within_monte_carlo_error() -> None:
    """At budgets where the resamples disagree too (one sits on an interval's cost)."""
    extra = json.loads((DATA / "full" / "expected_extra.json").read_text())
    ov = json.loads((DATA / "full" / "overhead.json").read_text())
    for budget, want in extra["agreement"].items():
        got = recommendation_agreement(ov, float(budget))
        assert _mc_close(want, got), (budget, got, want)


def test_intervals_sort_as_numbers_in_every_table(tmp_path: Path) -> None:
    from scenarios.report.render import write_report

    out = _campaign(tmp_path, "full")
    write_report(out)
    md = (out / "report.md").read_text()
    at = [md.index(f"| replay every {k} |") for k in (1, 2, 4, 8, 16)]
    assert at == sorted(at)
    at = [md.index(f"| all checks, replay {x} |")
          for x in ("off", "every 1", "every 2", "every 4", "every 8", "every 16")]
    assert at == sorted(at)
    escape = md[md.index("## Escape rate by replay interval"):]
    at = [escape.index(f"\n| {k} |") for k in ("off", "1", "2", "4", "8")]
    assert at == sorted(at)


def test_the_terminal_lines_give_one_answer_and_how_firmly(tmp_path: Path) -> None:
    # Two recommendations of different rules (least expected loss; the smallest interval
    # within the overhead budget) were printed side by side and contradicted each other:
    # the terminal now prints the one recommendation, how sure it is, and the warnings.
    s = summarize(_campaign(tmp_path, "full"))
    text = summary_text(s, tmp_path)
    rec = s["cost"]["recommendation"]
    low, high = rec["band"]
    assert (f"recommended: {rec['name']}, {rec['gpu_hours_per_day']:,.0f} GPU-hours/day "
            f"(band {low:,.0f} to {high:,.0f}; settled: {rec['agreement']:.0%} of 1000 "
            "resamples agree)") in text
    assert "recommended replay interval" not in text
    assert "warning: nonfinite: +1.4% has no interval" in text
