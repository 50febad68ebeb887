"""A persistent pool of rank processes: spawned once, kept in their process group across trials.

Spawning ranks and importing torch costs seconds; a trial of a small model costs
tens of milliseconds. So the pool starts ``world_size`` processes once (gloo on
127.0.0.1 with one thread each, or nccl with one CUDA device each), and every
command (golden run, trial, overhead measurement) is sent to all of them; each
rank runs it with its ``scenarios.run.rank.RankRunner`` and answers on a result
queue.

A trial can go wrong in ways that leave the process group unusable. ``run``
never waits forever:

* a rank raises: the others are probably blocked in a collective, so after a
  short grace period the pool is killed and ``PoolError("crashed")`` raised;
* a rank dies (exit, or a signal of its own failure: SIGSEGV, SIGABRT, ...):
  ``PoolError("crashed")`` naming it and its code;
* a rank is killed by a signal the pool did not send (``OUTSIDE_SIGNALS``: SIGKILL,
  SIGTERM, ... from a person, a scheduler or the OOM killer): ``PoolError("lost")``,
  whatever the other ranks did next (they fail in the collective it left). The pool
  sends SIGKILL itself only after it has decided a command's end (a hang, another
  rank's error), so a rank found dead of such a signal before that was killed from
  outside: the trial says nothing about the fault, and the campaign retries it;
* no answer within the timeout: the pool is killed, ``PoolError("hung")``.

The next ``run`` starts a fresh pool (``restarts`` counts them). Ranks are forked
from a server that has torch and DDP's lazy imports loaded
(``scenarios.run.forkserver``: about 2 s of CPU a rank saved on every start and
restart). Each rank watches the coordinator (a pidfd on Linux, else its pid every
second) and ends when it does, so killing a campaign with SIGKILL leaves no
orphans behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import multiprocessing
import os
import queue
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
import torch.multiprocessing  # torch's reductions for the queues

from scenarios.run import forkserver
from scenarios.run.rank import Command, Ping, RankRunner
from scenarios.spec.errors import ScenarioError
from sdc_guard import CheckpointManager

OUTSIDE_SIGNALS: Final = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT,
                                    signal.SIGHUP, signal.SIGQUIT})
"""Signals that end a rank from outside (a person, a scheduler, the OOM killer), not by a
failure of its own (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT: those are ``crashed``)."""


class PoolError(RuntimeError):
    """A command did not complete on every rank. ``kind``: "crashed", "hung", or "lost" (a
    rank was killed by a signal the pool did not send, ``OUTSIDE_SIGNALS``)."""

    def __init__(self, kind: str, reason: str, *, rank: int | None = None,
                 detail: str = "") -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason
        self.rank = rank
        self.detail = detail


def pick_backend(requested: str, world_size: int) -> tuple[str, str]:
    """(backend, device type): nccl + cuda when asked or available for every rank, else gloo.
    Asked for nccl without a CUDA device per rank (nccl runs one rank per device): a
    ``ScenarioError`` naming ``backend``."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl" and gpus < world_size:
        raise ScenarioError(
            "backend", requested, "'auto' or 'gloo' on this machine",
            reason=f"nccl runs one rank per CUDA device, world_size = {world_size} needs "
                   f"{world_size} and this machine has {gpus}")
    if requested == "nccl" or (requested == "auto" and gpus >= world_size):
        return "nccl", "cuda"
    return "gloo", "cpu"


def rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - exists, another user's (pid reused)
        return False
    return True


def _die_with_coordinator(pid: int) -> None:
    """End this rank (``os._exit``) as soon as the coordinator process ``pid`` ends, SIGKILL
    included: a thread waits on a pidfd (Linux), else checks the pid every second. The rank's
    parent is the fork server, which outlives a killed coordinator while ranks hold it open,
    so its death signal alone (``PR_SET_PDEATHSIG``, also set) would not do."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the parent (fork server)
    fd: int | None = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
    if not _alive(pid):  # it ended before the watch began
        os._exit(0)

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:  # pragma: no cover - no pidfd (not Linux, or an old kernel)
            while _alive(pid):
                time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="sdc-watch-coordinator", daemon=True).start()


def _worker(rank: int, world: int, store: str, backend: str, device_type: str,
            commands: Any, results: Any, coordinator: int, pg_timeout: float,
            environ: dict[str, str]) -> None:
    _die_with_coordinator(coordinator)
    # What came from the fork server (torch's modules: hundreds of thousands of objects) is
    # never garbage: keep every collection, the teardown's included, from walking it again.
    gc.freeze()
    os.environ.clear()  # the coordinator's now, not the fork server's from when it started
    os.environ.update(environ)
    logging.getLogger("sdc_guard").setLevel(logging.ERROR)  # detections go to the results
    # and so does a rollback to step 0 (the trial's rollback_step): no line per trial
    logging.getLogger("sdc_guard.checkpoint").addFilter(
        lambda record: getattr(record, "sdc_event", None) != CheckpointManager.FROM_SCRATCH)
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        device = rank_device(device_type, rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        runner = RankRunner(rank, world, device)
    except BaseException:
        results.put((rank, 0, "error", traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    while True:
        try:
            seq, cmd = commands.get(timeout=1.0)
        except queue.Empty:
            continue
        if cmd is None:
            break
        try:
            results.put((rank, seq, "ok", runner.execute(cmd)))
        except BaseException:
            results.put((rank, seq, "error", traceback.format_exc()))
    results.close()
    results.join_thread()
    try:  # the documented clean teardown: barrier, drop DDP models, gc, then destroy
        dist.barrier()
        runner.close()
        del runner
        gc.collect()
        dist.destroy_process_group()
    finally:
        os._exit(0)


class WorkerPool:
    """``world_size`` rank processes that run ``scenarios.run.rank`` commands until closed."""

    def __init__(self, world_size: int, *, backend: str = "auto", start_timeout: float = 300.0,
                 pg_timeout: float = 600.0, grace: float = 3.0,
                 start_method: str = "forkserver") -> None:
        """``start_method``: "forkserver" (``scenarios.run.forkserver``), or "spawn" (each rank
        imports torch itself; ``bench.throughput`` measures that as a baseline)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got "
                             f"{start_method!r}.")
        self.world_size = world_size
        self.backend, self.device_type = pick_backend(backend, world_size)
        self.start_timeout = start_timeout
        self.pg_timeout = pg_timeout
        self.grace = grace
        self.restarts = -1
        """How many times the pool was started after the first (crashes, hangs)."""
        self._ctx = (forkserver.context() if start_method == "forkserver"
                     else multiprocessing.get_context("spawn"))
        self._procs: list[Any] = []
        self._commands: list[Any] = []
        self._results: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._seq = 0

    # -- life cycle ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        if self._procs:
            return
        self.restarts += 1
        self._tmp = tempfile.TemporaryDirectory(prefix="sdc-pool-")
        store = os.path.join(self._tmp.name, "store")
        self._results = self._ctx.Queue()
        self._commands = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                args=(r, self.world_size, store, self.backend, self.device_type,
                      self._commands[r], self._results, os.getpid(), self.pg_timeout,
                      dict(os.environ)),
                daemon=True, name=f"sdc-rank-{r}")
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self._send_and_wait(Ping(), self.start_timeout)

    def kill(self) -> None:
        """End every rank now (SIGKILL) and drop the queues."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5.0)
        self._drop()

    def close(self, timeout: float = 15.0) -> None:
        """Ask every rank to tear down cleanly; kill those that do not exit in time."""
        if not self._procs:
            return
        for q in self._commands:
            with contextlib.suppress(Exception):
                q.put((0, None))
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()

    def _drop(self) -> None:
        for q in [*self._commands, self._results]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._procs, self._commands, self._results = [], [], None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commands -------------------------------------------------------------------------------
    def run(self, cmd: Command, timeout: float) -> list[Any]:
        """Run ``cmd`` on every rank; the answers by rank. ``PoolError`` if any rank fails."""
        self.start()
        return self._send_and_wait(cmd, timeout)

    def _killed_from_outside(self) -> PoolError | None:
        """A ``PoolError("lost")`` for the first rank found dead of one of ``OUTSIDE_SIGNALS``
        (asked before the pool kills anything itself), or None."""
        for r, p in enumerate(self._procs):
            code = None if p.is_alive() else p.exitcode
            if code is not None and code < 0 and -code in OUTSIDE_SIGNALS:
                name = signal.Signals(-code).name
                return PoolError("lost", f"rank {r} was killed by {name}, a signal the harness "
                                 "did not send", rank=r)
        return None

    def _send_and_wait(self, cmd: Command, timeout: float) -> list[Any]:
        self._seq += 1
        seq = self._seq
        for q in self._commands:
            q.put((seq, cmd))
        got: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        first_error = 0.0
        while len(got) + len(errors) < self.world_size:
            now = time.monotonic()
            if errors and now > first_error + self.grace:
                break  # the others are blocked in a collective the failed rank never joined
            if now > deadline:
                missing = sorted(set(range(self.world_size)) - set(got) - set(errors))
                lost = self._killed_from_outside()
                self.kill()
                if lost is not None:
                    raise lost
                raise PoolError("hung", f"no answer within {timeout:.0f}s from rank(s) "
                                f"{missing}", rank=missing[0] if missing else None)
            try:
                rank, s, status, payload = self._results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(self._procs)
                        if r not in got and r not in errors and not p.is_alive()]
                if dead:
                    r, code = dead[0]
                    lost = self._killed_from_outside()
                    self.kill()
                    if lost is not None:
                        raise lost from None
                    raise PoolError("crashed", f"rank {r} died (exit code {code})",
                                    rank=r) from None
                continue
            except (EOFError, OSError, ValueError):
                lost = self._killed_from_outside()
                self.kill()
                if lost is not None:
                    raise lost from None
                raise PoolError("crashed", "the result queue broke") from None
            if s != seq and s != 0:
                continue  # an answer to a command that timed out earlier
            if status == "ok":
                got[rank] = payload
            else:
                if not errors:
                    first_error = time.monotonic()
                errors[rank] = payload
        if errors:
            lost = self._killed_from_outside()  # the others then fail in its collective
            self.kill()  # some ranks may be stuck mid-collective: start over
            if lost is not None:
                raise lost
            r = min(errors)
            last = errors[r].strip().splitlines()[-1] if errors[r].strip() else "error"
            raise PoolError("crashed", f"rank {r} raised {last}", rank=r, detail=errors[r])
        return [got[r] for r in range(self.world_size)]
