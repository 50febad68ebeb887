"""The tests' own launcher: N ranks on gloo over 127.0.0.1, one thread each, results by rank.

The library's tests use this, not the harness (``scenarios``). Results come back
through a queue before a rank tears down, so the known gloo teardown race (a DDP
reducer joining a gloo thread that waits for the GIL) cannot hang a test: ranks
that do not exit in time are killed.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time."""


def _entry(fn: Callable[..., Any], rank: int, world: int, store: str, args: tuple[Any, ...],
           kwargs: dict[str, Any], results: Any, timeout: float) -> None:
    torch.set_num_threads(1)  # several threads per rank on few cores: an order slower
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        results.put((rank, "ok", fn(rank, world, *args, **kwargs)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    results.close()
    results.join_thread()
    try:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              **kwargs: Any) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; results by rank.

    ``fn`` lives at module level and returns picklable data. Raises ``RankFailure`` when
    a rank raises, dies or gives no result within ``timeout`` seconds.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdc-guard-test-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(fn, r, world_size, store, args, kwargs, results, timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailure(f"no result within {timeout:.0f}s from ranks {missing}")
                try:
                    rank, status, value = results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs)
                            if r not in out and p.exitcode not in (0, None)]
                    if dead:
                        try:  # its traceback may still be on its way
                            rank, status, value = results.get(timeout=2.0)
                        except queue.Empty:
                            raise RankFailure(f"rank {dead[0]} died with exit code "
                                              f"{procs[dead[0]].exitcode}") from None
                    else:
                        continue
                if status == "error":
                    raise RankFailure(f"rank {rank} raised:\n{value}")
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
        return [out[r] for r in range(world_size)]
