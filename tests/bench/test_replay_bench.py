"""``python -m bench.replay`` runs end to end, under glibc's defaults or with trimming off."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the harness runs from the clone's root


@pytest.mark.timeout(300)
def test_the_replay_table_under_the_allocator_it_is_given() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.replay", "--world", "1", "--rounds",
                          "1", "--no-trim"], check=True, capture_output=True, text=True,
                         timeout=300, cwd=ROOT).stdout
    assert "glibc's heap trimming off, 1 rounds" in out
    assert "`mallopt(M_TRIM_THRESHOLD, 2147483647)`" in out
    # The per-audit-step table: its rows by cell. On a loaded machine any extra can come out
    # negative and a ratio of two such extras anything, so the cells are read as numbers of
    # either sign (or nan/inf), not matched to a shape only a quiet machine gives.
    table = out.split("**measured / ideal, per audit step**")[1].split("\n\n")[0]
    cells = [[c.strip() for c in line.strip("|").split("|")]
             for line in table.splitlines()[2:] if line.startswith("| ")]
    rows = [(c[0], c[3].strip("*"), c[5].split(" (")[0]) for c in cells]
    assert [k for k, _, _ in rows] == ["1", "2", "5", "10", "50"], table
    for _, headline, pooled in rows:
        float(headline), float(pooled)  # numbers, whatever their sign
    # One round: the median over rounds of each round's ratio is that round's ratio, the
    # ratio of the pooled medians.
    assert all(headline == pooled for _, headline, pooled in rows)
    # With the heap kept, a step off the audit faults few pages (the interpreter's arenas,
    # new buffers: tens of pages a step on one rank).
    off = int(re.search(r"replay off: (\d+) per step", out).group(1))  # type: ignore[union-attr]
    assert off < 300
    bad = subprocess.run([sys.executable, "-m", "bench.replay", "--rounds", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--world and --rounds must be at least 1" in bad.stderr


def test_a_run_from_before_the_median_over_rounds_renders_as_what_it_measured() -> None:
    """The published results.json may predate the median over rounds: its per-audit-step ratio
    is the pooled one, and the table says so rather than label it the median over rounds."""
    import json
    from pathlib import Path

    from bench.results import replay_md

    results = json.loads((Path(__file__).parents[2] / "bench" / "results.json").read_text())
    rp = results["replay"]
    old = {**rp, "intervals": {k: {n: v for n, v in r.items() if "pooled" not in n}
                               for k, r in rp["intervals"].items()}}
    text = "\n".join(replay_md(old))
    assert "predates the median over rounds" in text and "pooled medians" not in text
