"""The tests' own launcher: N ranks on gloo over 127.0.0.1, one thread each, results by rank.

The library's tests use this, not the harness (``scenarios``). Results come back
through a queue before a rank tears down, so the known gloo teardown race (a DDP
reducer joining a gloo thread that waits for the GIL) cannot hang a test: ranks
that do not exit in time are killed.

Every timeout that guards a test against a hang is stated for the machine the suite was
tuned on and multiplied by the suite's speed factor (``speed_factor``): a slower or busier
machine waits longer, a hang still fails. ``tests/conftest.py`` measures the factor once per
session (``measure_speed_factor``) and hands it to every process it starts through the
environment variable ``SDC_GUARD_TEST_SPEED``, which a user may also set to impose one.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SPEED_ENV = "SDC_GUARD_TEST_SPEED"
"""The environment variable that carries the speed factor to every process of the suite."""

SPEED_CAP = 10.0
"""The largest measured factor: a hang still fails within ten times its stated timeout."""

REFERENCE_S = 0.22
"""Seconds ``_workload`` takes, as the median of ``measure_speed_factor``'s rounds, on the
machine kind the timeouts were tuned on (2 cores, nothing else running): the factor is the
time measured here over this one."""

_WORKLOAD_THREADS = 2
"""Copies of the workload run at once: the suite runs two test workers (``nox -s tests``), so
a machine whose cores are partly taken by another job runs them slower by about as much."""


class RankFailure(RuntimeError):
    """A rank raised, died or did not answer in time."""


def parse_speed(raw: str, source: str = SPEED_ENV) -> float:
    """A speed factor given as text (the environment variable): a number > 0."""
    try:
        factor = float(raw)
    except ValueError:
        factor = float("nan")
    if not factor > 0 or factor == float("inf"):
        raise ValueError(f"{source}={raw!r}: the tests' speed factor must be a number > 0 "
                         f"(e.g. {source}=3 to wait three times as long before a test counts "
                         f"as hung); unset it to have the suite measure the machine.")
    return factor


def speed_factor() -> float:
    """The factor every timeout that guards against a hang is multiplied by (1.0 if unset)."""
    raw = os.environ.get(SPEED_ENV)
    return 1.0 if raw is None else parse_speed(raw)


def scaled(seconds: float) -> float:
    """``seconds`` stated for the reference machine, as long as this machine needs."""
    return seconds * speed_factor()


def factor_from(measured_s: float, reference_s: float = REFERENCE_S,
                cap: float = SPEED_CAP) -> float:
    """The speed factor of a workload that took ``measured_s`` where the reference took
    ``reference_s``: never below 1 (a faster machine keeps the stated timeouts), at most
    ``cap``."""
    return min(cap, max(1.0, measured_s / reference_s))


def _workload() -> None:
    """A fixed CPU load: float32 matrix products on one thread (the ranks' own setting)."""
    a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    for _ in range(1500):
        b = torch.mm(a, b)
        b = b / b.abs().max()


def measure_speed_factor(rounds: int = 5) -> float:
    """Run ``_workload`` in ``_WORKLOAD_THREADS`` threads at once, ``rounds`` times, and
    compare the median time with ``REFERENCE_S`` (``factor_from``)."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(rounds):
            workers = [threading.Thread(target=_workload) for _ in range(_WORKLOAD_THREADS)]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads_before)
    return factor_from(statistics.median(times))


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
    a rank raises, dies or gives no result within ``timeout`` seconds times the suite's
    ``speed_factor()`` (the process group's own timeout is scaled alike).
    """
    factor = speed_factor()
    limit = timeout * factor
    ctx = mp.get_context("forkserver")
    # torch._dynamo: DDP's constructor imports it, seconds of CPU in every rank otherwise
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"])
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sdc-guard-test-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(fn, r, world_size, store, args, kwargs, results, limit))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + limit
        try:
            while len(out) < world_size:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(out))
                    raise RankFailure(f"no result within {limit:.0f}s (timeout={timeout:g}s "
                                      f"x speed factor {factor:g}) from ranks {missing}")
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a store that processes of their own open (``MASTER_PORT``),
    free when asked, drawn below the kernel's ephemeral range: a port the kernel hands out
    (binding port 0) is in that range, where every outgoing connection of the suite's gloo
    ranks also takes its local port, and one of them may take it before the store binds."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    draw = random.Random()
    for _ in range(200):
        port = draw.randrange(10_000, max(10_001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (every draw taken: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
