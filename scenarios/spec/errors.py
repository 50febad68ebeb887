"""``ScenarioError`` and the small validators every spec record uses in ``__post_init__``.

Each validator raises a ``ScenarioError`` naming the field, the bad value and what
is allowed; the loaders add the file (``ScenarioError.in_file``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


class ScenarioError(ValueError):
    """A scenario or campaign file that cannot be run as written.

    ``file``, ``field`` (a dotted path such as ``optimizer.kind``), ``value`` and
    ``allowed`` say what is wrong and what would be accepted.
    """

    def __init__(self, field: str, value: Any, allowed: str, *, reason: str = "",
                 file: str | Path | None = None) -> None:
        self.file = None if file is None else str(file)
        self.field = field
        self.value = value
        self.allowed = allowed
        self.reason = reason
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"{where}{self.field} = {self.value!r} is not valid{why}; allowed: {self.allowed}"

    def in_file(self, file: str | Path) -> ScenarioError:
        """The same error, located in ``file`` (unless it already names one)."""
        return ScenarioError(self.field, self.value, self.allowed, reason=self.reason,
                             file=self.file or file)

    def under(self, prefix: str) -> ScenarioError:
        """The same error, its field under table ``prefix`` (``steps`` -> ``sample.steps``)."""
        return ScenarioError(f"{prefix}.{self.field}", self.value, self.allowed,
                             reason=self.reason, file=self.file)


def need_int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    """An int (not a bool) in ``[lo, hi]``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ScenarioError(name, v, rng)


def need_number(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """A finite int or float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
          and (v > lo if lo_open else v >= lo) and v <= hi)
    if not ok:
        raise ScenarioError(name, v, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def need_choice(name: str, v: Any, allowed: tuple[Any, ...]) -> None:
    """One of ``allowed``."""
    if v not in allowed:
        raise ScenarioError(name, v, f"one of {list(allowed)}")


def need_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ScenarioError(name, v, "true or false")


def need_choices(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    """A non-empty tuple of distinct values from ``allowed``."""
    if not isinstance(v, tuple) or not v:
        raise ScenarioError(name, v, f"a non-empty list of {list(allowed)}")
    for x in v:
        need_choice(name, x, allowed)
    if len(set(v)) != len(v):
        raise ScenarioError(name, list(v), f"distinct values from {list(allowed)}")


def need_ints(name: str, v: Any, lo: int, hi: int | None = None, *,
              empty: bool = False) -> None:
    """A tuple of ints in ``[lo, hi]`` (non-empty unless ``empty``)."""
    if not isinstance(v, tuple) or (not v and not empty):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ScenarioError(name, v, f"a {'' if empty else 'non-empty '}list of integers {rng}")
    for x in v:
        need_int(name, x, lo, hi)
