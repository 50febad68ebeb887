"""``python -m bench --only``: some sections measured again, the rest of the full run kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the harness runs from the clone's root
PUBLISHED = ROOT / "bench" / "results.json"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True,
                          text=True, timeout=240, cwd=ROOT)


@pytest.mark.timeout(300)
def test_only_measures_the_named_sections_again_and_keeps_the_rest(tmp_path: Path) -> None:
    machine = subprocess.run(
        [sys.executable, "-c", "from bench.__main__ import machine_name; print(machine_name())"],
        capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()
    earlier = json.loads(PUBLISHED.read_text())
    earlier.update(machine=machine, quick=True,
                   measured_later={"replay": {"commit": "abc1234", "date": "2026-01-01"}})
    (tmp_path / "results.json").write_text(json.dumps(earlier))
    done = _bench("--quick", "--only", "fingerprint", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    after = json.loads((tmp_path / "results.json").read_text())
    assert after["fingerprint"]["tensor_mib"] == 64  # measured now (the published: 256)
    assert earlier["fingerprint"]["tensor_mib"] == 256
    for key in ("overhead", "checksum", "replay", "replay_no_trim"):
        assert after[key] == earlier[key], key
    assert list(after["measured_later"]) == ["replay", "fingerprint"]  # an earlier one kept
    text = (tmp_path / "RESULTS.md").read_text()
    commit = after["measured_later"]["fingerprint"]["commit"]
    assert f"Measured again later, on the same machine, the rest kept from the full run " \
           f"(`python -m bench --only ...`): replay (commit abc1234, 2026-01-01); " \
           f"fingerprint (commit {commit}, " in text
    assert "| 1 | " in text  # the kept replay tables are rendered too


def test_only_refuses_what_it_cannot_amend(tmp_path: Path) -> None:
    bad = _bench("--only", "replay,replays", "--out", str(tmp_path))
    assert bad.returncode == 2 and "unknown sections ['replays']" in bad.stderr
    missing = _bench("--only", "replay", "--out", str(tmp_path))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "results.json").write_text(json.dumps({"machine": "another CPU", "quick": False}))
    other = _bench("--only", "replay", "--out", str(tmp_path))
    assert other.returncode == 2 and "'another CPU'" in other.stderr
    assert "run the whole bench here" in other.stderr
