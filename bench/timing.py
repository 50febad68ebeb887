"""Timing helpers of the benchmarks: alternated repetitions and bootstrap intervals."""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
Rounds = dict[str, list[list[T]]]
"""Per configuration, per round, the samples measured in that round (seconds, or samples
tagged with their step)."""


def seconds(fn: Callable[..., object]) -> float:
    """Wall seconds of one call of ``fn`` (with no arguments; a lambda may bind some as
    defaults)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def alternate(methods: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each method: one warm-up call each, then ``rounds`` alternated rounds."""
    times: dict[str, list[float]] = {k: [] for k in methods}
    for fn in methods.values():
        fn()
    for _ in range(rounds):
        for name, fn in methods.items():
            times[name].append(seconds(fn))
    return times


def bootstrap_interval(rounds: Rounds[T], stat: Callable[..., float],
                       n: int = 1000) -> tuple[float, float]:
    """A 90% bootstrap interval of ``stat`` over the measurement rounds.

    ``stat`` takes the pooled samples, ``{configuration: samples}`` (the lambdas that
    call it bind their other arguments as defaults, which ``Callable[[...], float]``
    cannot express).

    The configurations alternate inside a round, so a round is the unit of
    resampling: each resample pools the samples of randomly drawn rounds and applies
    the same ``stat`` as the headline number. Seeded, so reproducible.
    """
    rng = random.Random(0)
    count = len(next(iter(rounds.values())))
    stats = []
    for _ in range(n):
        pick = [rng.randrange(count) for _ in range(count)]
        pooled = {k: [x for i in pick for x in v[i]] for k, v in rounds.items()}
        try:
            stats.append(stat(pooled))
        except (ZeroDivisionError, statistics.StatisticsError):
            continue
    stats.sort()
    return stats[int(0.05 * len(stats))], stats[int(0.95 * len(stats)) - 1]


def per_rotation(m: dict[str, list[float]], n: int) -> dict[str, list[float]]:
    """Each configuration's mean over each whole rotation of its ``n`` configurations:
    ``n`` consecutive rounds whose order rotates by one each round, so every configuration
    runs once in every position of a round. A block's position in its round moves its time,
    whatever the block runs; the rotation's mean carries every position's share equally."""
    return {k: [statistics.fmean(v[i:i + n]) for i in range(0, len(v), n)] for k, v in m.items()}


def launch_rounds(rounds: int, launches: int, n: int) -> int:
    """The rounds of each of ``launches`` runs of new rank processes that share ``rounds``
    (whole rotations of ``n`` configurations each), or a clear error."""
    if launches < 1 or rounds % launches:
        raise ValueError(f"launches={launches}: give a positive divisor of rounds={rounds}")
    whole_rotations(rounds // launches, n)
    return rounds // launches


def whole_rotations(rounds: int, n: int) -> None:
    """Refuse a block-timed run whose ``rounds`` are not whole rotations of ``n``
    configurations."""
    if rounds < 1 or rounds % n:
        raise ValueError(f"rounds={rounds}: give a positive multiple of {n} (the "
                         "configurations alternated), so that every configuration runs in every "
                         "position of a round equally often")


def split_rounds(samples: list[Any], rounds: int) -> list[list[Any]]:
    """``samples`` of ``rounds`` equal rounds, as one list per round."""
    per = len(samples) // rounds
    return [samples[i * per:(i + 1) * per] for i in range(rounds)]


def resampled(rotations: dict[str, list[float]], launches: int) -> dict[str, list[list[float]]]:
    """Each configuration's per-rotation values grouped into the units a bootstrap
    interval resamples: whole launches when the run had several (each launch's processes
    share a draw the rotations of one launch cannot sample), else single rotations."""
    units = launches if launches > 1 else len(next(iter(rotations.values())))
    return {k: split_rounds(vs, units) for k, vs in rotations.items()}


def publish(out: str | Path, name: str, res: dict[str, Any], lines: list[str]) -> None:
    """A stand-alone benchmark's ending: ``res`` to ``OUT/name.json``, its table printed."""
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")
    print("\n".join(lines))


def cpu_name() -> str:
    """The CPU model and its widest vector extension (throughput depends on both)."""
    model, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == platform.machine():
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "baseline"
    return f"{model} ({isa}), {platform.machine()}"
