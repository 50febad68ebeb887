"""``python -m bench.replay`` runs end to end, under glibc's defaults or with trimming off."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_the_replay_table_under_the_allocator_it_is_given() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.replay", "--world", "1", "--rounds",
                          "1", "--no-trim"], check=True, capture_output=True, text=True,
                         timeout=300).stdout
    assert "glibc's heap trimming off, 1 rounds" in out
    assert "`mallopt(M_TRIM_THRESHOLD, 2147483647)`" in out
    rows = re.findall(r"^\| (\d+) \| [\d.]+ \| [\d.]+ \| \*\*([\d.]+)\*\* \|", out, re.M)
    assert [k for k, _ in rows] == ["1", "2", "5", "10", "50"]
    # With the heap kept, a step off the audit faults few pages (the interpreter's arenas,
    # new buffers: tens of pages a step on one rank).
    off = int(re.search(r"replay off: (\d+) per step", out).group(1))  # type: ignore[union-attr]
    assert off < 300
    bad = subprocess.run([sys.executable, "-m", "bench.replay", "--rounds", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--world and --rounds must be at least 1" in bad.stderr
