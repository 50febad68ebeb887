"""Start N ranks on this machine (gloo on 127.0.0.1, or nccl with one GPU per rank), run a
function on each, collect results.

Every rank runs with one thread (``torch.set_num_threads(1)``; several threads
per rank on few cores is an order of magnitude slower). Results come back
through a queue as soon as a rank finishes, *before* its teardown, so the
known gloo teardown race (a DDP reducer joining a gloo thread that waits for
the GIL) can never hang the caller: ranks that do not exit in time are killed.
"""

from __future__ import annotations

import gc
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
import torch.multiprocessing  # torch's reductions for the result queue

from scenarios.run import forkserver


def mp_context() -> Any:
    """A forkserver context that has torch (and DDP's lazy imports) loaded once.

    A fresh ``spawn`` costs every rank several seconds of imports; forking from a
    server that already imported them costs about a second. Falls back to spawn
    where forkserver does not exist. The same server as the worker pool's
    (``scenarios.run.forkserver``).
    """
    return forkserver.context()


class RankFailure(RuntimeError):
    """A rank raised, died or hung. ``rank`` and ``reason`` say which and why."""

    def __init__(self, reason: str, *, rank: int | None = None) -> None:
        super().__init__(reason if rank is None else f"rank {rank}: {reason}")
        self.rank = rank
        self.reason = reason


def _flush(results: Any) -> None:
    """Wait until the queue's feeder thread has written everything (os._exit would drop it)."""
    results.close()
    results.join_thread()


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
    timeout_s: float,
    backend: str,
) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(rank, world, *args, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        _flush(results)
        os._exit(1)
    _flush(results)
    try:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be importable (module level) and return picklable data; it should drop
    its DDP model and optimizer before returning. Raises ``RankFailure`` if a rank
    raises, dies or does not answer within ``timeout`` seconds. ``backend``: "gloo"
    (CPU), or "nccl", where rank r runs on GPU ``r % device_count`` (set before the
    process group starts).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"run_ranks: backend must be 'gloo' or 'nccl', got {backend!r}.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("run_ranks: backend 'nccl' needs CUDA, which this machine lacks; "
                         "use backend='gloo'.")
    ctx = mp_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdc-guard-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, store, args, kwargs, results, timeout, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailure(f"no result within {timeout:.0f}s from ranks {missing}")
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    for r, p in enumerate(procs):
                        if r not in out and not p.is_alive() and p.exitcode not in (0, None):
                            # Give its message a moment to arrive through the queue.
                            try:
                                rank, status, value = results.get(timeout=2.0)
                            except queue.Empty:
                                raise RankFailure(
                                    f"died with exit code {p.exitcode} and no result", rank=r
                                ) from None
                            break
                    else:
                        continue
                if status == "error":
                    raise RankFailure(f"raised:\n{value}", rank=rank)
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5.0)
        return [out[r] for r in range(world_size)]
