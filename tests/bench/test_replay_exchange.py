"""``python -m bench.replay_exchange`` runs end to end and writes what it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.replay_exchange import table
from bench.results import markdown

ROOT = Path(__file__).resolve().parents[2]  # the harness runs from the clone's root


def test_replay_exchange_writes_its_table_and_json(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.replay_exchange", "--world", "2",
                          "--rounds", "2", "--block", "1", "--out", str(tmp_path)],
                         check=True, capture_output=True, text=True, timeout=300, cwd=ROOT).stdout
    res = json.loads((tmp_path / "replay_exchange.json").read_text())
    assert set(res["placements"]) == {"first bucket", "after the replay"}
    for e in res["placements"].values():
        for kind in ("wall", "cpu"):
            lo, hi = e[f"{kind}_interval_90"]
            assert lo <= hi
    assert set(res["step_ms"]) == {"off", "ideal", "first bucket", "after the replay"}
    assert "| first bucket |" in out and "| after the replay |" in out
    # python -m bench writes the same table into RESULTS.md
    results = json.loads((Path(__file__).parents[2] / "bench" / "results.json").read_text())
    results.pop("replay_exchange", None)
    assert "Where the replay audit posts" not in markdown(results)
    page = markdown({**results, "replay_exchange": res})
    assert "## Where the replay audit posts its ring exchange" in page
    assert "\n".join(table(res)) in page
    bad = subprocess.run([sys.executable, "-m", "bench.replay_exchange", "--rounds", "1"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "needs --world >= 2, --rounds >= 2" in bad.stderr
