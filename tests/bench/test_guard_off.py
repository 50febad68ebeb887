"""``python -m bench.guard_off`` runs end to end and writes what it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_guard_off_writes_its_table_and_json(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.guard_off", "--rounds", "2", "--block",
                          "1", "--out", str(tmp_path)], check=True, capture_output=True,
                         text=True, timeout=300).stdout
    res = json.loads((tmp_path / "guard_off.json").read_text())
    assert set(res["models"]) == {"reference MLP (512-1024-1024-10), batch 128",
                                  "tiny MLP (16-16-10), batch 8"}
    for m in res["models"].values():
        lo, hi = m["extra_cpu_interval_90_s"]
        assert m["plain_step_cpu_s"] > 0 and lo <= hi
    assert "guard's extra (us)" in out and "does not grow with the model" in out
    bad = subprocess.run([sys.executable, "-m", "bench.guard_off", "--rounds", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--rounds and --block must be at least 1" in bad.stderr


def test_the_three_rank_guard_off_table_runs_under_the_allocator_it_is_given() -> None:
    # bench.overhead.check_guard_off starts its ranks with the environment it is given
    # (glibc reads MALLOC_* at start) and restores this process's; the page gets a
    # section of its own for that run, with the page faults per step.
    import os

    from bench.overhead import NO_TRIM, check_guard_off
    from bench.reference import PLAIN_DDP_VIEWS
    from bench.results import guard_off_md
    from scenarios.spec.overhead import CHECKS_OFF

    before = {k: os.environ.get(k) for k in NO_TRIM}
    res = check_guard_off(2, rounds=2, block=1, batch=8, configs=(PLAIN_DDP_VIEWS, CHECKS_OFF),
                          allocator=NO_TRIM)
    assert {k: os.environ.get(k) for k in NO_TRIM} == before
    assert res["allocator"] == NO_TRIM and res["configs"] == [PLAIN_DDP_VIEWS.name,
                                                              CHECKS_OFF.name]
    assert set(res["page_faults_per_step"]) == set(res["configs"])
    (pair, (ratio, (lo, hi))), = res["guard_off_vs_plain"].items()
    assert pair == f"{CHECKS_OFF.name} / {PLAIN_DDP_VIEWS.name}" and lo <= hi
    assert -1.0 < ratio < 1.0
    page = "\n".join(guard_off_md(res, reference=True))
    assert "glibc's heap trimming off" in page and "MALLOC_TRIM_THRESHOLD_=4294967296" in page
    assert "Minor page faults per step" in page
