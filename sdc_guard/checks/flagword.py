"""The deferred flag word: every rank's per-step flags, exchanged every few steps, judged later.

A check that names its suspects from a few bits per step and rank (the non-finite and
the checksum checks) adds this rank's bits for each step it looks at to an open window.
When the window holds ``interval`` steps its bits travel as int64 words
(``collectives.flag_words``: rank r owns its own bits, so the SUM all-reduce is every
rank's bits side by side) in one small all-reduce that nobody waits for. The next call
that collects (the check's next step, or ``flush`` after the last one) judges them: they
have long arrived by then, so it rarely waits, and it starts no collective. Every rank
has the same window at the same step, so every rank sends, and collects, the same words.

The same word carries the step agreement: each rank adds, per step of its window, the step
number ``s`` (taken modulo 2**24) and its square. The sums over the ranks equal ``world``
times this rank's own values exactly when every rank had the same steps (the squares make
the ranks' spread zero), so every rank finds a rank at another step in the same
collection, and raises the same named error (``StepsDisagree``) after one gather of the
steps on this rare path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from sdc_guard.collectives import (
    STEPS_FIX,
    PendingSum,
    StepsDisagree,
    all_gather_rows,
    flag_rows,
    flag_words,
    steps_disagree,
    words_on,
)
from sdc_guard.hostread import StepRead
from sdc_guard.report import Detection


class Judge(Protocol):
    """The check that owns a ``DeferredFlags``: it judges a step's bits and keeps its own
    ``clean_through`` (``base.Check.verified`` and ``tainted``)."""

    def judge(self, step: int, rows: list[list[int]]) -> list[Detection]:
        """The detections from every rank's bits for ``step`` (row r: rank r)."""
        ...

    def verified(self, step: int) -> None: ...

    def tainted(self) -> None: ...


_STEP_MOD = 1 << 24
"""Steps enter the agreement words modulo this: a square stays under 2**48, and a SUM over up
to 2**15 ranks stays within int64."""


def step_words(steps: Sequence[int]) -> list[int]:
    """This rank's agreement words for a window of ``steps``: each step modulo 2**24 and its
    square (``DeferredFlags``, module doc)."""
    out = []
    for s in steps:
        t = s % _STEP_MOD
        out += [t, t * t]
    return out


class DeferredFlags:
    """``width`` flags per step and rank, sent every ``interval`` steps in one int64 SUM
    all-reduce and judged when the next ``collect`` (or ``flush``) comes; see the module doc."""

    def __init__(self, width: int, interval: int, *, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> None:
        self.width = width
        """Flags per step and rank (the same for every step)."""
        self.interval = interval
        """Steps per exchange: the window is sent as soon as it holds this many."""
        self.device, self.group = device, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._window: list[tuple[int, Sequence[bool]]] = []
        self._sent: tuple[list[int], PendingSum] | None = None

    def add(self, step: int, flags: Sequence[bool]) -> None:
        """This rank's flags for ``step``. Sends the window once it holds ``interval`` steps
        (collective: every rank adds the same steps)."""
        if len(flags) != self.width:
            raise ValueError(f"DeferredFlags.add: step {step} has {len(flags)} flags, but "
                             f"this word carries {self.width} per step.")
        self._window.append((step, flags))
        if len(self._window) >= self.interval:
            self._send()

    def ask(self, read: StepRead) -> None:
        """Have the words in flight, if any, come in the step's one read (``collect`` judges
        them from it)."""
        if self._sent is not None:
            self._sent[1].ask(read)

    def collect(self, judge: Judge) -> list[Detection]:
        """Judge the words in flight, if any, step by step: ``judge.judge(step, rows)``, then
        ``judge.tainted()`` if it found something, else ``judge.verified(step)``. They were
        sent a step ago, so this rarely waits; it starts no collective."""
        sent, self._sent = self._sent, None
        if sent is None:
            return []
        steps, word = sent
        k = self.width
        totals = word.wait_all()
        agree = totals[-2 * len(steps):]
        if agree != [self.world * w for w in step_words(steps)]:
            self._disagree(steps)
        rows = flag_rows(totals[:-2 * len(steps)], k * len(steps), self.world)
        found: list[Detection] = []
        for i, step in enumerate(steps):
            judged = judge.judge(step, [row[k * i:k * (i + 1)] for row in rows])
            if judged:
                judge.tainted()
            else:
                judge.verified(step)
            found += judged
        return found

    def flush(self, judge: Judge) -> list[Detection]:
        """Send the partial window and judge everything outstanding. Collective when a window
        is open: every rank has the same window, so all of them send."""
        found = self.collect(judge)
        if self._window:
            self._send()
            found += self.collect(judge)
        return found

    def rewind(self) -> None:
        """A restore: the flags in flight and unsent belong to the abandoned timeline. The
        words in flight are waited for (every rank started the all-reduce) and dropped,
        unjudged."""
        sent, self._sent = self._sent, None
        if sent is not None:
            sent[1].wait_all()
        self._window = []

    def _disagree(self, steps: list[int]) -> None:
        """Raise ``StepsDisagree`` naming which rank had which steps: every rank found the
        disagreement in the same word, so every rank gathers here."""
        rows = all_gather_rows(torch.tensor(steps, dtype=torch.int64, device=self.device),
                               self.group).tolist()
        first = next((i for i in range(len(steps)) if len({row[i] for row in rows}) > 1),
                     len(steps) - 1)
        differ = steps_disagree([row[first] for row in rows])
        raise StepsDisagree(f"SDCGuard.step: the ranks are not at one step ({differ}: the "
                            "first call where they differ, found in the word of calls with "
                            f"steps {steps[0]}..{steps[-1]} on this rank); {STEPS_FIX}")

    def _send(self) -> None:
        flags = [f for _, bits in self._window for f in bits]
        words = flag_words(flags, self.rank, self.world)
        words += step_words([s for s, _ in self._window])
        word = PendingSum(words_on(words, self.device), self.group, in_place=True)
        self._sent = ([s for s, _ in self._window], word)
        self._window = []
