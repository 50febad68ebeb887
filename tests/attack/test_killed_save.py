"""``kill -9`` of a training process while it saves a checkpoint: a restarted job restores
the newest committed checkpoint, with exactly the state saved at that step, and its next save
leaves nothing of the killed one behind.

The saver is a real process (one gloo rank) saving a model of some megabytes every step; it
is killed with SIGKILL at the moment a temporary file of a save appears (the data is being
written), or a moment after a save returned (in the next step or the next save).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from sdc_guard import CheckpointManager
from tests.launch import scaled

pytestmark = pytest.mark.timeout(240)

JOB = "attack-killed-save"
ROOT = Path(__file__).resolve().parents[2]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))


def _state(model: DDP, opt: torch.optim.Optimizer) -> int:
    return sdc_guard.fingerprint(sdc_guard.state_tensors(model.module, opt))


def saver(work: str) -> None:
    """The process killed: train a step, record its state's fingerprint, save, forever."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{work}/store-saver", rank=0,
                            world_size=1)
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    ckpt = CheckpointManager(Path(work) / "ckpt", keep=2, job_id=JOB)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(1))
    with open(Path(work) / "states", "a") as states:
        for step in range(10_000):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            states.write(f"{step} {_state(model, opt)}\n")
            states.flush()
            print(f"saving {step}", flush=True)
            ckpt.save(step, model, opt, verified_through=step)
            print(f"saved {step}", flush=True)


def _left_behind(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith(".") or (p.suffix == ".pt"
                                                and not p.with_suffix(".json").exists()))


@pytest.mark.parametrize("moment", ["writing-data", "a-moment-later"])
def test_kill_9_during_a_save_restores_the_newest_committed_checkpoint(
        one_rank: None, tmp_path: Path, moment: str) -> None:
    ckpt_dir = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from tests.attack.test_killed_save import saver; "
                               f"saver({str(tmp_path)!r})"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    saved = -1
    try:
        deadline = time.monotonic() + scaled(120)
        while saved < 2:  # a few committed checkpoints first
            line = proc.stdout.readline()
            assert line, f"the saver ended before its third save (exit {proc.wait()})"
            if line.startswith("saved "):
                saved = int(line.split()[1])
        if moment == "writing-data":  # SIGKILL the moment a save's temporary file exists
            while not any(p.name.startswith(".step-") for p in ckpt_dir.iterdir()):
                assert time.monotonic() < deadline, "no save's temporary file was ever seen"
        else:
            time.sleep(0.037)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        rest, _ = proc.communicate(timeout=scaled(30))
    assert proc.returncode == -signal.SIGKILL
    for line in rest.splitlines():
        if line.startswith("saved "):
            saved = int(line.split()[1])
    states: dict[int, int] = {}
    for line in (tmp_path / "states").read_text().splitlines():
        if line.count(" ") == 1:  # a line the kill cut short is not a state
            step, state = line.split()
            states[int(step)] = int(state)

    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    fresh = _state(model, opt)
    again = CheckpointManager(ckpt_dir, keep=2, job_id=JOB)  # the restarted job
    resumed = again.restore(model, opt)
    restored = resumed - 1
    assert restored >= saved >= 2, (restored, saved)  # every committed save is usable
    assert _state(model, opt) == states[restored] != fresh  # the very state of that step
    again.save(resumed, model, opt, verified_through=resumed)
    assert _left_behind(ckpt_dir) == []
    assert next(c.step for c in again.checkpoints()) == resumed
