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
