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
from bench.tolerant import BF16_BITS, SIDE_INTERVAL, _bf16_md, _side_md, bf16_bits, side_by_side

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
    both = run("--only-bf16", "--only-side-by-side")
    assert both.returncode == 2 and "give one of them" in both.stderr
    missing = run("--only-bf16")
    assert missing.returncode == 2 and "--only-bf16 amends" in missing.stderr
    missing = run("--only-side-by-side")
    assert missing.returncode == 2 and "--only-side-by-side amends" in missing.stderr
    (tmp_path / "tolerant.json").write_text(json.dumps({"cpu": "another CPU"}))
    other = run("--only-side-by-side")
    assert other.returncode == 2 and "was measured on another CPU" in other.stderr
    (tmp_path / "tolerant.json").write_text(json.dumps({"cpu": cpu_name()}))
    uncosted = run("--keep-cost")
    assert uncosted.returncode == 2 and "keeps the cost part" in uncosted.stderr


@pytest.mark.timeout(300)
def test_the_bfloat16_sweep_flips_every_bit_of_each_sites_dtype_in_both_modes() -> None:
    # One flip per bit and site after a short clean start (the tolerance still at its
    # half-precision ceiling): every float32 gradient flip changes the gradients, so the
    # exact audit sees each one; a flip of a float32 gradient's top exponent bit makes a
    # value of magnitude below 2 about 2**128 times larger, far beyond any tolerance.
    res = bf16_bits(1, warmup=8)
    assert res["warmup_detections"] == 0 and res["tolerance"] is not None
    for mode in ("tolerant", "exact"):
        for site, n in BF16_BITS.items():
            assert sorted(res[mode][site], key=int) == [str(b) for b in range(n)]
            assert all(r["n"] == 1 for r in res[mode][site].values())
    assert all(r["detected"] == 1 for r in res["exact"]["gradient_before_allreduce"].values())
    top = res["tolerant"]["gradient_before_allreduce"]["30"]
    assert top["detected"] == 1 and top["named"] == 1
    text = "\n".join(_bf16_md(res))
    assert "in bfloat16 (autocast)" in text and "| 15 |" in text and "| 31 |" in text
