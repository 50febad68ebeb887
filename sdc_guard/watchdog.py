"""The watchdog: a rank that falls out is named on the others, not waited for in silence.

A rank that stops calling ``SDCGuard.step`` (a bug in one rank's loop, a dead process, a
rank at another step) leaves the others blocked inside their next step, in a collective
(DDP's gradient all-reduce, a check's exchange) that only the process group's own
timeout ends, 30 minutes by default, with an error that names nobody. The guard marks
where each step is (``Watchdog.at``: an assignment, nothing more); a thread of its own
publishes that mark to the process group's store (a few bytes, when it changes, at most a
few times a minute) and reads the others' marks only when this rank has waited longer
than ``GuardConfig.collective_timeout_s`` in one place. When another rank is elsewhere
(an earlier step, between steps, another step) or has gone silent, it logs which rank,
at which step, and what this rank was waiting for, writes that to the event log, and
ends the process with ``EXIT_RANK_LOST``: a collective blocked in a backend cannot be
interrupted from Python, and a restart policy (torchrun's, Kubeflow's ``ExitCode``)
restarts the job from its checkpoint. When every rank is alive at the same place, nobody
fell out (a long first compilation, a hang inside the user's own collectives): it logs
that once and keeps waiting.

The steady step pays nothing for it: no collective, no host synchronisation, no store
access on the training thread.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from sdc_guard.exits import EXIT_RANK_LOST

log = logging.getLogger(__name__)



BETWEEN = "between steps"
"""The mark of a rank outside ``SDCGuard.step`` (it returned from ``step`` and has not yet
called the next one)."""


@dataclass(frozen=True, slots=True)
class Mark:
    """Where one rank was last seen: its step, what it was doing since when, and when it was
    last heard from (its wall clock)."""

    rank: int
    step: int
    doing: str
    since: float
    at: float
    host: str = ""

    def seen(self, now: float) -> str:
        where = (f"{self.doing} after step {self.step}" if self.doing == BETWEEN
                 else f"step {self.step}, in {self.doing}")
        return (f"rank {self.rank} ({self.host}): {where} for {max(0.0, now - self.since):.0f} s, "
                f"last heard {max(0.0, now - self.at):.0f} s ago")


def behind(me: Mark, marks: dict[int, Mark | None], *, silent_after: float, settled_after: float,
           now: float) -> list[str]:
    """What each other rank's mark says when it fell out: elsewhere than ``me`` (another step,
    between steps, another part of the step) for ``settled_after`` seconds or more (a rank that
    has just moved on is progressing, not stuck), silent for ``silent_after`` seconds, or never
    heard from. Empty when none did."""
    out = []
    for rank in sorted(marks):
        m = marks[rank]
        if rank == me.rank:
            continue
        if m is None:
            out.append(f"rank {rank}: never heard from (it never reached a guarded step)")
        elif now - m.at > silent_after:
            out.append(m.seen(now) + " (silent: dead, or hung outside the guard)")
        elif (m.step, m.doing) != (me.step, me.doing) and now - m.since >= settled_after:
            out.append(m.seen(now))
    return out


class Watchdog:
    """Marks where this rank's step is; a thread names the ranks that fell out (module doc).

    ``at(step, doing)`` and ``between()`` run on the training thread and only assign.
    ``fire`` is called once with the message (the guard writes it to the event log) before
    the process ends with ``EXIT_RANK_LOST``; ``exit`` (``os._exit``) can be replaced by a
    test. The thread holds the watchdog (and a bound ``fire``'s object) weakly: a guard that
    is dropped without ``close()`` (a campaign builds one per trial) is freed, and its
    thread ends at its next wake-up. Each watchdog of a process group has its own keys in
    the store (the n-th built on each rank meets the n-th of the others), so an old one's
    marks never speak for a newer one.
    """

    def __init__(self, timeout_s: float, *, group: dist.ProcessGroup | None = None,
                 fire: Callable[[str, dict[str, Any]], None] | None = None,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.timeout_s = float(timeout_s)
        self.period_s = min(30.0, max(0.2, self.timeout_s / 10))
        """How often the thread wakes: to publish a changed mark, to refresh this rank's
        heartbeat, and to look at how long the training thread has waited."""
        self.rank = dist.get_rank()
        self.ranks = (list(range(dist.get_world_size())) if group is None
                      else dist.get_process_group_ranks(group))
        self.host = socket.gethostname()
        self._fire: Callable[[], Callable[[str, dict[str, Any]], None] | None] = (
            (lambda: None) if fire is None
            else weakref.WeakMethod(fire) if inspect.ismethod(fire) else (lambda: fire))
        self._exit = exit
        self._store = _default_store()
        group_key = ",".join(map(str, self.ranks))
        nth = _BUILT.get(group_key, 0)
        _BUILT[group_key] = nth + 1
        self._prefix = f"sdc_guard/watchdog/{group_key}/{nth}/"
        self._mark = (-1, BETWEEN, time.monotonic())
        """(step, doing, since): replaced whole, so the thread never reads half an update."""
        self._published: tuple[int, str] | None = None
        self._last_beat = 0.0
        self._warned = False
        self._store_warned = False
        self._stop = threading.Event()
        self.fired: str | None = None
        self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop,
                                                             self.period_s),
                                        name="sdc-guard-watchdog", daemon=True)
        self._thread.start()

    # -- the training thread --------------------------------------------------------------------
    def at(self, step: int, doing: str) -> None:
        """This rank is now at ``step``, doing ``doing`` (what it may wait for there)."""
        self._mark = (step, doing, time.monotonic())

    @property
    def step(self) -> int:
        """The step of this rank's newest mark (-1: none yet)."""
        return self._mark[0]

    def between(self) -> None:
        """This rank left ``SDCGuard.step``."""
        self._mark = (self._mark[0], BETWEEN, time.monotonic())

    def close(self) -> None:
        """Stop the thread (the guard is closed or replaced)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.period_s + 5.0)

    # -- the thread ---------------------------------------------------------------------------

    def _store_failed(self, e: Exception) -> None:
        """Say once that the store is out of reach (the rank that holds it may be gone)."""
        if not self._store_warned:
            self._store_warned = True
            log.warning("sdc-guard: the watchdog cannot reach the process group's store (%s: "
                        "%s): the rank that holds it may be gone; a rank that falls out will be "
                        "named from this rank's own mark only", type(e).__name__, e)

    def _tick(self) -> None:
        if not dist.is_initialized():  # the process group is gone, and this guard with it
            self._stop.set()
            return
        step, doing, since = self._mark
        now = time.time()
        if self._store is not None and ((step, doing) != self._published
                                        or now - self._last_beat > 4 * self.period_s):
            try:
                self._store.set(self._prefix + str(self.rank), json.dumps(
                    {"step": step, "doing": doing, "at": now, "host": self.host,
                     "since": now - (time.monotonic() - since)}))
                self._published, self._last_beat = (step, doing), now
            except Exception as e:  # (the store's own errors are RuntimeErrors and OSErrors)
                self._store_failed(e)
        waited = time.monotonic() - since
        if doing == BETWEEN or waited < self.timeout_s or self.fired is not None:
            return
        me = Mark(self.rank, step, doing, now - waited, now, self.host)
        try:
            marks = self._marks()
        except Exception as e:
            self._store_failed(e)
            marks = {}
        others = behind(me, marks, silent_after=max(self.timeout_s, 8 * self.period_s),
                        settled_after=self.timeout_s / 2, now=now)
        if not others and marks:
            if not self._warned:
                self._warned = True
                log.warning("sdc-guard: every rank has been at step %d, in %s, for %.0f s; none "
                            "fell out, so the watchdog keeps waiting (a long first compilation, "
                            "or a hang in a collective of the training's own)", step, doing,
                            waited)
            return
        self._name(me, waited, others)

    def _marks(self) -> dict[int, Mark | None]:
        out: dict[int, Mark | None] = {}
        if self._store is None:
            return out
        for rank in self.ranks:
            key = self._prefix + str(rank)
            if not self._store.check([key]):
                out[rank] = None
                continue
            m = json.loads(self._store.get(key))
            out[rank] = Mark(rank, int(m["step"]), str(m["doing"]), float(m["since"]),
                             float(m["at"]), str(m.get("host", "")))
        return out

    def _name(self, me: Mark, waited: float, others: list[str]) -> None:
        seen = "; ".join(others) if others else (
            "the other ranks' marks are unknown (the process group's store is out of reach: "
            "the rank that holds it may be gone)")
        message = (f"sdc-guard: rank {me.rank} has waited {waited:.0f} s at step {me.step} in "
                   f"{me.doing} (GuardConfig.collective_timeout_s={self.timeout_s:g}), and a "
                   f"rank fell out: {seen}. Every rank must call SDCGuard.step with the same "
                   "step, once per step; look at the log of the rank named for why it stopped "
                   f"(an exception, a kill, a loop that skips a step). Ending this process with "
                   f"exit code {EXIT_RANK_LOST} so that the job restarts from its checkpoint.")
        self.fired = message
        log.critical("%s", message)
        fire = self._fire()
        if fire is not None:
            try:
                fire(message, {"step": me.step, "waiting_in": me.doing,
                                     "waited_s": round(waited, 1), "behind": others})
            except Exception as e:  # the message is logged: the exit must not wait on a write
                log.error("sdc-guard: the watchdog's record could not be written (%s)", e)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        self._exit(EXIT_RANK_LOST)


_BUILT: dict[str, int] = {}
"""Watchdogs built in this process, per process group (their ranks): the n-th of each rank
publishes under key n, where the n-th of the other ranks looks."""


def _watch(ref: weakref.ref[Watchdog], stop: threading.Event, period_s: float) -> None:
    """The watchdog's thread: ``_tick`` every ``period_s`` while the watchdog lives and is not
    closed."""
    while not stop.wait(period_s):
        dog = ref()
        if dog is None:
            return
        try:
            dog._tick()
        except Exception as e:  # a bug of its own must not end the training
            log.error("sdc-guard: the watchdog failed (%s: %s); it stops", type(e).__name__, e)
            return
        del dog


def _default_store() -> Any:
    """The default process group's store (every rank's marks meet there), or None where torch
    does not give it."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    return store
