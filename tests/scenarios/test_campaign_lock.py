"""One writer per output directory: ``OUT/.lock``, held by a real second process here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from scenarios.cli import main
from scenarios.run.outlock import OutputBusy, hold_output
from tests.launch import scaled

ROOT = Path(__file__).resolve().parents[2]

TINY = f"""
world_size = 3
steps = 2
batch = 4
trial_timeout_s = {scaled(30)}
[model]
kind = "mlp"
width = 4
depth = 1
"""


@contextmanager
def _held_elsewhere(out: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``out``'s lock until the block ends (then it is SIGKILLed)."""
    code = ("import sys, time\nfrom scenarios.run.outlock import hold_output\n"
            "with hold_output(sys.argv[1], command='the other run'):\n"
            "    print('held', flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_second_writer_is_refused_with_the_holder_and_a_killed_holder_blocks_nothing(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _held_elsewhere(out) as other:
        t0 = time.monotonic()
        with pytest.raises(OutputBusy) as err, hold_output(out):
            pass
        assert time.monotonic() - t0 < 5.0  # refused at once, not after waiting
        msg = str(err.value)
        assert f"pid {other.pid} on host {socket.gethostname()} (the other run" in msg
        assert err.value.field == "out" and "pass another --out" in msg
        os.kill(other.pid, signal.SIGKILL)
        other.wait()
    assert (out / ".lock").exists()  # left behind by the killed holder ...
    with hold_output(out), hold_output(out):  # ... and no obstacle; nested holds share it
        assert f"pid {os.getpid()}" in (out / ".lock").read_text().replace('"pid": ', "pid ")


def test_run_and_campaign_on_a_held_out_are_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = tmp_path / "tiny.toml"
    sc.write_text(TINY)
    camp = tmp_path / "camp.toml"
    camp.write_text('scenarios = ["tiny.toml"]\nclean_trials = 1\n[overhead]\nrounds = 1\n'
                    "block = 1\n")
    out = tmp_path / "out"
    with _held_elsewhere(out) as other:
        for argv in (["run", str(sc), "--out", str(out), "--no-progress"],
                     ["campaign", str(camp), "--out", str(out), "--no-progress"]):
            t0 = time.monotonic()
            assert main(argv) == 2
            assert time.monotonic() - t0 < 10.0
            err = capsys.readouterr().err
            assert f"held by pid {other.pid} on host" in err and err.startswith("error: out = ")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no trials.csv, no golden


def test_merge_and_report_refuse_a_directory_another_run_writes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = tmp_path / "shard0"
    shard.mkdir()
    (shard / "trials.csv").write_text("id\n")
    with _held_elsewhere(shard) as other:
        assert main(["merge", str(tmp_path / "merged"), str(shard)]) == 2
        assert f"held by pid {other.pid}" in capsys.readouterr().err
        assert main(["report", str(shard)]) == 2
        assert f"held by pid {other.pid}" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()
