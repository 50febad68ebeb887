"""The report's statistics, from SciPy and NumPy: Wilson intervals, the overhead fit, bootstrap.

* ``wilson``: the Wilson score interval of a proportion (``scipy.stats.binomtest``), at the
  confidence level whose normal quantile is exactly ``Z = 1.96`` (0.9500042), the value
  every earlier report used: the interval equals the textbook formula with z = 1.96 to
  float precision (SciPy's exact 95% quantile, 1.959964, would move bounds by up to 1e-5).
* ``fit_replay_overhead``: least squares (``scipy.stats.linregress``) of
  ``overhead(k) = fixed + per_audit / k`` over every round's paired measurement.
* ``fit_bootstrap``: ``scipy.stats.bootstrap`` over the overhead rounds: the
  recommendation's agreement and 90% intervals of the fit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import stats

from scenarios.spec.overhead import PLAIN_DDP, replay_only

Z = 1.96
CONFIDENCE = float(2 * stats.norm.cdf(Z) - 1)
"""Two-sided level whose normal quantile is ``Z``: 0.950004..."""
RESAMPLES = 1000
"""Bootstrap resamples of the overhead rounds."""
SEED = 0


def wilson(k: int, n: int) -> list[float] | None:
    """Wilson score interval of a proportion k/n at ``CONFIDENCE``; None when n = 0."""
    if n <= 0:
        return None
    ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=CONFIDENCE,
                                                       method="wilson")
    return [float(ci.low), float(ci.high)]


def _points(samples: dict[str, list[float]], intervals: list[int],
            rounds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(1/k, overhead) of every round (in ``rounds`` order, default all) and interval."""
    base = np.asarray(samples.get(PLAIN_DDP.name) or [], dtype=float)
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for k in intervals:
        t = np.asarray(samples.get(replay_only(k).name) or [], dtype=float)
        m = min(len(base), len(t))
        b, t = base[:m], t[:m]
        if rounds is not None:
            pick = rounds[rounds < m]
            b, t = b[pick], t[pick]
        ok = b > 0
        xs.append(np.full(int(ok.sum()), 1.0 / k))
        ys.append(t[ok] / b[ok] - 1.0)
    return np.concatenate(xs or [np.empty(0)]), np.concatenate(ys or [np.empty(0)])


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """(fixed, per_audit) by least squares; None with fewer than two distinct x."""
    if np.unique(x).size < 2:
        return None
    r = stats.linregress(x, y)
    return float(r.intercept), float(r.slope)


def fit_replay_overhead(samples: dict[str, list[float]],
                        intervals: list[int]) -> dict[str, Any] | None:
    """Least-squares fit of ``overhead(k) = fixed + per_audit / k`` (fractions of plain DDP).

    ``samples``: per-round block times of plain DDP and of the replay audit alone every k
    steps (``scenarios.spec.overhead``: "plain DDP", "replay@<k>"), in the same round order
    (configurations alternate within a round, so round r's pair shares the machine's
    state). None with fewer than two distinct intervals.
    """
    x, y = _points(samples, intervals)
    line = _line(x, y)
    if line is None:
        return None
    fixed, per_audit = line
    return {"fixed": fixed, "per_audit": per_audit, "points": int(x.size),
            "predicted": {str(k): fixed + per_audit / k for k in intervals}}


def bootstrap_rounds(samples: dict[str, list[float]], intervals: list[int],
                     statistic: Callable[[tuple[float, float] | None], Any],
                     confidence: float = 0.90, n: int = RESAMPLES) -> Any:
    """``scipy.stats.bootstrap`` over the overhead rounds: each resample draws rounds with
    replacement (a round keeps every configuration's block together), refits the line and
    hands it (None when it cannot be fitted) to ``statistic`` (a number or a vector)."""
    rounds = min(len(v) for v in samples.values())

    def stat(idx: np.ndarray) -> Any:
        return statistic(_line(*_points(samples, intervals, idx.astype(int))))

    with warnings.catch_warnings():  # a constant statistic (all resamples agree) is fine
        warnings.simplefilter("ignore")
        return stats.bootstrap((np.arange(rounds),), stat, vectorized=False, n_resamples=n,
                               confidence_level=confidence, method="percentile",
                               rng=np.random.default_rng(SEED))


def fit_interval(overhead: dict[str, Any], confidence: float = 0.90) -> dict[str, Any] | None:
    """Bootstrap interval of the fit's terms and of its prediction at every interval."""
    fit = overhead.get("replay_fit")
    samples = overhead.get("samples_ms")
    if not fit or not samples:
        return None
    ks = [int(k) for k in fit["predicted"]]

    def terms(line: tuple[float, float] | None) -> np.ndarray:
        if line is None:
            return np.full(2 + len(ks), np.nan)
        return np.array([line[0], line[1], *(line[0] + line[1] / k for k in ks)])

    res = bootstrap_rounds(samples, ks, terms, confidence)
    lo, hi = res.confidence_interval.low, res.confidence_interval.high
    pair = [[float(a), float(b)] for a, b in zip(lo, hi, strict=True)]
    return {"confidence": confidence, "resamples": RESAMPLES, "fixed": pair[0],
            "per_audit": pair[1], "predicted": {str(k): pair[2 + i] for i, k in enumerate(ks)}}
