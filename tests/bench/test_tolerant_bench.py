"""``bench.tolerant``'s side-by-side cost run, end to end on 3 gloo ranks (one round), and the
flags that amend an earlier run's results refusing what they cannot amend."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.timing import cpu_name
from bench.tolerant import SIDE_INTERVAL, _side_md, side_by_side

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_the_side_by_side_run_times_every_configuration_in_one_run() -> None:
    res = side_by_side(2, block=2 * SIDE_INTERVAL, launches=2)  # a round in each, pooled
    assert set(res["step_ms"]) == {"off", "ideal", "exact", "tolerant", "k audit", "k other",
                                   "exact k audit", "ideal k"}
    assert res["launches"] == 2 and res["rounds"] == 2
    assert all(v > 0 for v in res["step_ms"].values())
    # On a loaded machine an extra can come out negative and a ratio of two such anything:
    # numbers of either sign, each with its interval around the headline.
    for name in ("exact", "tolerant", "exact k audit", "k audit"):
        r = res[name]
        lo, hi = r["ratio_interval_90"]
        assert not math.isnan(r["ratio_to_ideal"]) and lo <= hi
        clo, chi = r["cpu_ratio_interval_90"]
        assert not math.isnan(r["cpu_ratio_to_ideal"]) and clo <= chi
    assert all(v > 0 for v in res["cpu_ms"].values())
    lines = "\n".join(_side_md(res))
    assert "| tolerant, every step |" in lines and f"every {SIDE_INTERVAL} steps" in lines
    assert f"| exact, every {SIDE_INTERVAL} steps (its audit steps) |" in lines
    assert "2 rounds over 2 launches" in lines
    assert "CPU time: ratio" in lines
    old = {k: {kk: vv for kk, vv in v.items() if not kk.startswith("cpu_")}
           if isinstance(v, dict) else v for k, v in res.items() if k != "cpu_ms"}
    assert "CPU time" not in "\n".join(_side_md(old))  # a run before CPU times were kept


def test_the_amending_flags_refuse_what_they_cannot_amend(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "bench.tolerant", *args, "--out",
                               str(tmp_path)], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)

    both = run("--only-cost", "--only-side-by-side")
    assert both.returncode == 2 and "give one of them" in both.stderr
    both = run("--keep-cost", "--only-cost")
    assert both.returncode == 2 and "give one of them" in both.stderr
    missing = run("--only-side-by-side")
    assert missing.returncode == 2 and "--only-side-by-side amends" in missing.stderr
    (tmp_path / "tolerant.json").write_text(json.dumps({"cpu": "another CPU"}))
    other = run("--only-side-by-side")
    assert other.returncode == 2 and "was measured on another CPU" in other.stderr
    (tmp_path / "tolerant.json").write_text(json.dumps({"cpu": cpu_name()}))
    uncosted = run("--keep-cost")
    assert uncosted.returncode == 2 and "keeps the cost part" in uncosted.stderr
