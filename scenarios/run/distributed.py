"""Running a scenario or campaign under ``torchrun`` (or any launcher that sets RANK / WORLD_SIZE).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m scenarios campaign scenarios/configs/default.toml --out /shared/reports/default

Every process is a rank: it joins the process group from the environment
(``env://``; nccl with its local CUDA device when available, else gloo on CPU)
and runs the same campaign loop as the others, on the same deterministic list
of trials. Rank 0 decides what is left to do (from ``trials.csv``, broadcast to
all), collects each command's answers with ``gather_object``, classifies and
writes every file; golden runs are recomputed in memory (no shared filesystem
is assumed between nodes).

Failures. A rank that dies makes the launcher stop every rank; a rank that
hangs is ended by a watchdog (``os._exit``) after the scenario's
``trial_timeout_s``. Before each trial rank 0 writes ``inflight.json`` (trial id,
attempt count; the watchdog adds "hung"). When the campaign is started again
(by hand, or by ``torchrun --max-restarts N``), a trial found in flight is
recorded as "hung" if the watchdog fired, retried once otherwise, and recorded
as "crashed" if it dies again: a bad trial never blocks the campaign.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from scenarios.run.pool import rank_device
from scenarios.run.rank import Command, RankRunner
from scenarios.spec.errors import ScenarioError
from scenarios.spec.scenario import Scenario


def launched_by_torchrun() -> bool:
    """True when the environment names this process's rank (torchrun, SLURM wrappers, ...)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_backend(requested: str) -> tuple[str, str]:
    """(backend, device type) for this process: nccl + cuda when available (or asked)."""
    if requested == "nccl" or (requested == "auto" and torch.cuda.is_available()):
        return "nccl", "cuda"
    return "gloo", "cpu"


@contextlib.contextmanager
def watchdog(seconds: float, on_fire: Callable[[], None]) -> Iterator[None]:
    """Call ``on_fire`` and end the process if the block takes longer than ``seconds``."""
    def fire() -> None:
        with contextlib.suppress(Exception):
            on_fire()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class DistributedExecutor:
    """This process is one rank of an env:// process group; rank 0 coordinates."""

    shared_files = False
    tracks_inflight = True

    def __init__(self, backend: str = "auto", *, pg_timeout: float = 1800.0) -> None:
        self.backend, device_type = choose_backend(backend)
        if device_type == "cpu":
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = rank_device(device_type, local)
        dist.init_process_group(self.backend, timeout=timedelta(seconds=pg_timeout))
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.coordinator = self.rank == 0
        self.runner = RankRunner(self.rank, self.world, device)
        self.on_hang: Callable[[], None] = lambda: None
        """Set by the campaign runner: what rank 0 records before the watchdog ends it."""

    def run(self, scenario: Scenario, cmd: Command, timeout: float) -> list[Any] | None:
        if scenario.world_size != self.world:
            raise ScenarioError("world_size", scenario.world_size,
                                f"{self.world} (the number of ranks the launcher started)",
                                reason=f"scenario {scenario.name!r}")
        with watchdog(timeout, self.on_hang if self.coordinator else (lambda: None)):
            out = self.runner.execute(cmd)
            gathered: list[Any] | None = [None] * self.world if self.coordinator else None
            dist.gather_object(out, gathered, dst=0)
        return gathered

    def generation(self, scenario: Scenario) -> int:
        return 0  # this process keeps its sessions until it exits

    def agree(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.barrier()
        self.runner.close()
        gc.collect()
        dist.destroy_process_group()
