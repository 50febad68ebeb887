"""The per-check overheads the cost model uses: each value, its interval, where it came from.

A campaign measures step times on the machine it ran on (``overhead.json``: the median
block time of each configuration over alternated rounds against plain DDP's). On a shared
CPU those medians move by several percent from run to run, so each overhead is given with
the 90% interval of a bootstrap over the rounds (rounds drawn with replacement, every
configuration of a round kept together, as the rounds were timed), and the report warns
when a measurement cannot be told from noise: its interval spans zero, or plain DDP's own
step varies between rounds by more than the overhead budget.

Your own hardware's numbers replace the campaign's: ``[cluster.overhead]`` in the campaign
file, ``--check-overhead KEY=FRACTION`` on the command line, or ``--overhead-file FILE``,
either the ``bench/results.json`` that ``python -m bench`` writes on your machine or a JSON
mapping of ``OVERHEAD_KEYS`` to fractions (``read_overhead_file``). Later sources win:
the campaign's ``[cluster.overhead]``, then the file, then the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from scenarios.spec.cluster import OVERHEAD_KEYS
from scenarios.spec.errors import ScenarioError
from scenarios.spec.overhead import HEADLINE, PLAIN_DDP, replay_only

RESAMPLES = 1000
"""Bootstrap resamples of the overhead rounds (and of the trials, ``scenarios.report.decide``)."""
SEED = 0
"""Fixed, so that the same directory always gives the same report."""
CONFIDENCE = 0.90
CHECK_NAMES = {oc.key: oc.name for oc in HEADLINE}
"""``overhead.json`` key -> the configuration's name in ``samples_ms``."""
CAMPAIGN = "campaign"
"""Source label of a number measured by this campaign (``overhead.json``)."""


def rounds_of(overhead: dict[str, Any] | None) -> int:
    """The rounds every configuration in ``samples_ms`` has (0 without samples)."""
    samples = (overhead or {}).get("samples_ms") or {}
    return min((len(v) for v in samples.values()), default=0)


def round_draws(rounds: int, n: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``n`` x ``rounds`` round indices drawn with replacement (a fixed seed)."""
    rng = np.random.default_rng([seed, 1])
    return rng.integers(0, max(rounds, 1), size=(n, rounds))


def _rows(samples: dict[str, list[float]], names: list[str]) -> np.ndarray | None:
    """The named configurations' per-round times as one array (rounds that all have)."""
    if not all(samples.get(x) for x in names):
        return None
    m = min(len(samples[x]) for x in names)
    return np.asarray([samples[x][:m] for x in names], dtype=float)


def ratio_draws(samples: dict[str, list[float]], name: str, draws: np.ndarray,
                point: float | None = None) -> np.ndarray | None:
    """Each resample's overhead of ``name`` vs plain DDP: ``point`` (the campaign's value,
    the ratio of the two medians; default that ratio over all rounds) moved by how far the
    resample's mean paired overhead (round r: ``name_r / plain_r - 1``) lies from the mean
    over all rounds. The mean's spread, not the median's: with a handful of rounds a
    resampled median takes only a few values and understates the spread. None without
    per-round samples of ``name``."""
    arr = _rows(samples, [PLAIN_DDP.name, name])
    if arr is None or arr.shape[1] == 0:
        return None
    paired = arr[1] / arr[0] - 1.0
    if point is None:
        point = float(np.median(arr[1]) / np.median(arr[0]) - 1.0)
    idx = draws % arr.shape[1]
    out: np.ndarray = point + paired[idx].mean(axis=1) - paired.mean()
    return out


def replay_draws(samples: dict[str, list[float]], intervals: list[int],
                 draws: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The fit ``fixed + per_audit / k`` (least squares over every round's paired overhead,
    as ``scenarios.report.stats.fit_replay_overhead``) in each resample of the rounds:
    (fixed, per_audit), one value a resample; None without samples at two intervals."""
    ks = [k for k in intervals if samples.get(replay_only(k).name)]
    if len(ks) < 2:
        return None
    arr = _rows(samples, [PLAIN_DDP.name, *(replay_only(k).name for k in ks)])
    if arr is None or arr.shape[1] == 0:
        return None
    rounds = arr.shape[1]
    y = arr[1:] / arr[0] - 1.0  # intervals x rounds
    ok = arr[0] > 0
    x = 1.0 / np.asarray(ks, dtype=float)
    # how often each round is drawn in each resample
    counts = np.stack([np.bincount(row % rounds, minlength=rounds) for row in draws]) * ok
    n = counts.sum(1) * len(ks)
    sx = counts.sum(1) * x.sum()
    sxx = counts.sum(1) * (x ** 2).sum()
    sy = counts @ np.nan_to_num(y).sum(0)
    sxy = counts @ (x[:, None] * np.nan_to_num(y)).sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = (n * sxy - sx * sy) / (n * sxx - sx ** 2)
        intercept = (sy - slope * sx) / n
    return intercept, slope


def interval(values: np.ndarray) -> list[float]:
    """The percentile ``CONFIDENCE`` interval of bootstrap values."""
    half = 100 * (1 - CONFIDENCE) / 2
    lo, hi = np.nanpercentile(values, [half, 100 - half])
    return [float(lo), float(hi)]


def plain_step_spread(overhead: dict[str, Any] | None) -> float | None:
    """How much plain DDP's step varies between rounds: (max - min) / median of its
    per-round block times; None without per-round samples."""
    base = ((overhead or {}).get("samples_ms") or {}).get(PLAIN_DDP.name) or []
    if len(base) < 2:
        return None
    arr = np.asarray(base, dtype=float)
    return float((arr.max() - arr.min()) / np.median(arr))


def read_overhead_file(path: str | Path) -> tuple[dict[str, float], dict[str, list[float]], str]:
    """Your hardware's overheads from a file: (values, 90% intervals where given, what the
    file says it was measured on).

    Two forms: ``bench/results.json`` from ``python -m bench`` (its ``overhead`` section's
    overheads vs plain DDP for the guard with its checks off, ``nonfinite`` and ``weights``;
    ``checksum_launches``' checksum over the defaults; the replay audit's overhead per
    interval, fitted as ``fixed + per_audit / k``), or a JSON mapping of ``OVERHEAD_KEYS``
    to a fraction of plain DDP's step or to ``{"value": x, "interval_90": [lo, hi]}``.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ScenarioError("--overhead-file", str(path), "a readable JSON file: "
                            "bench/results.json from python -m bench, or {\"weights\": 0.05}",
                            reason=str(e)) from None
    if not isinstance(data, dict):
        raise ScenarioError("--overhead-file", str(path), "a JSON object")
    if "overhead" in data and isinstance(data["overhead"], dict) and \
            "overhead_vs_plain_ddp" in data["overhead"]:
        return _from_bench(data, path)
    values: dict[str, float] = {}
    intervals: dict[str, list[float]] = {}
    for key, v in data.items():
        if key not in OVERHEAD_KEYS:
            raise ScenarioError(f"--overhead-file {path}: {key}", v, f"one of {OVERHEAD_KEYS}",
                                reason="unknown key")
        if isinstance(v, dict):
            ci = v.get("interval_90")
            v = v.get("value")
            if ci is not None:
                intervals[key] = [float(ci[0]), float(ci[1])]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -1.0 <= v <= 100.0:
            raise ScenarioError(f"--overhead-file {path}: {key}", v,
                                "a fraction of plain DDP's step, e.g. 0.05 for 5%")
        values[key] = float(v)
    return values, intervals, str(path)


def _from_bench(data: dict[str, Any], path: Path) -> tuple[dict[str, float],
                                                           dict[str, list[float]], str]:
    ov = data["overhead"]
    vs = ov["overhead_vs_plain_ddp"]
    ci = ov.get("overhead_interval_90") or {}
    values: dict[str, float] = {}
    intervals: dict[str, list[float]] = {}
    for key, name in CHECK_NAMES.items():
        if name in vs:
            values[key] = float(vs[name])
            if name in ci:
                intervals[key] = [float(x) for x in ci[name]]
    g0 = values.get("guard_checks_off", 0.0)
    cl = data.get("checksum_launches") or {}
    if "checksum" not in values and cl.get("overhead") is not None:
        # the checksum over the defaults: its own cost, above the guard's fixed cost g0
        values["checksum"] = g0 + float(cl["overhead"])
        if cl.get("overhead_interval_90"):
            intervals["checksum"] = [g0 + float(x) for x in cl["overhead_interval_90"]]
    rep = ((data.get("replay") or {}).get("intervals")) or {}
    pts = [(int(k), float(v["overhead"])) for k, v in rep.items() if "overhead" in v]
    if len({k for k, _ in pts}) >= 2:
        # overhead vs replay off at every k: fixed above the guard + per_audit / k
        fit = stats.linregress([1.0 / k for k, _ in pts], [v for _, v in pts])
        values["replay_fixed"] = g0 + float(fit.intercept)
        values["replay_per_audit"] = float(fit.slope)
    return values, intervals, f"{path} ({data.get('machine', 'machine not recorded')})"


def _campaign_source(ov: dict[str, Any]) -> str:
    return (f"this campaign's overhead.json ({ov.get('scenario')}, {ov.get('world_size')} "
            f"ranks, medians of {ov.get('rounds')} alternated rounds, on the machine the "
            "campaign ran on)")


def used(overhead: dict[str, Any] | None, user: dict[str, float], sources: dict[str, str],
         user_intervals: dict[str, list[float]], draws: np.ndarray) -> dict[str, Any]:
    """Every overhead the cost model uses: ``value``, ``interval_90`` (None: unknown) and
    ``source``, per key of ``OVERHEAD_KEYS``; the replay audit's as its fit's two terms."""
    ov = overhead or {}
    samples = ov.get("samples_ms") or {}
    fit = ov.get("replay_fit")
    rep = replay_draws(samples, [int(k) for k in (fit or {}).get("predicted", {})], draws) \
        if fit else None
    out: dict[str, Any] = {}
    for key in OVERHEAD_KEYS:
        if key in user:
            out[key] = {"value": user[key], "interval_90": user_intervals.get(key),
                        "source": sources.get(key, "yours")}
            continue
        if key in CHECK_NAMES:
            if ov.get(key) is None:
                continue
            d = ratio_draws(samples, CHECK_NAMES[key], draws, float(ov[key]))
            out[key] = {"value": float(ov[key]), "interval_90": None if d is None else interval(d)}
        elif fit:
            i = 0 if key == "replay_fixed" else 1
            out[key] = {"value": float(fit["fixed" if i == 0 else "per_audit"]),
                        "interval_90": None if rep is None else interval(rep[i])}
        else:
            continue
        out[key]["source"] = _campaign_source(ov)
    return out


def draw_values(overhead: dict[str, Any] | None, user: dict[str, float],
                draws: np.ndarray) -> tuple[dict[str, np.ndarray], dict[int, np.ndarray]]:
    """Each resample's overheads: the per-check ones (``CHECK_NAMES`` keys) and the replay
    audit's at every measured interval k (vs plain DDP). Your numbers, and the campaign's
    where it kept no per-round samples, are the same in every resample."""
    ov = overhead or {}
    n = draws.shape[0]
    samples = ov.get("samples_ms") or {}
    checks: dict[str, np.ndarray] = {}
    for key, name in CHECK_NAMES.items():
        v = user.get(key, ov.get(key))
        if v is None:
            continue
        d = None if key in user else ratio_draws(samples, name, draws, float(v))
        checks[key] = np.full(n, float(v)) if d is None else d
    replay: dict[int, np.ndarray] = {}
    fit = ov.get("replay_fit")
    ks = sorted({int(k) for k in (fit or {}).get("predicted", {})}
                | {int(k) for k in ov.get("replay") or {}})
    if "replay_fixed" in user or "replay_per_audit" in user:
        fixed = user.get("replay_fixed", fit["fixed"] if fit else 0.0)
        per = user.get("replay_per_audit", fit["per_audit"] if fit else 0.0)
        return checks, {k: np.full(n, fixed + per / k) for k in ks}
    rep = replay_draws(samples, ks, draws) if fit else None
    for k in ks:
        if rep is not None:
            replay[k] = rep[0] + rep[1] / k
        elif fit:
            replay[k] = np.full(n, fit["fixed"] + fit["per_audit"] / k)
        elif str(k) in (ov.get("replay") or {}):
            replay[k] = np.full(n, float(ov["replay"][str(k)]))
    return checks, replay


def noise_warnings(table: dict[str, Any], overhead: dict[str, Any] | None,
                   budget: float | None) -> list[str]:
    """Where the overhead measurement is noise on the machine that took it (see module doc)."""
    out = []
    spread = plain_step_spread(overhead)
    if spread is not None and budget is not None and spread > budget:
        out.append(f"plain DDP's own step varied by {spread:.1%} between rounds, more than "
                   f"the {budget:.0%} overhead budget: on this machine a step-time difference "
                   "that small is noise")
    for key, e in table.items():
        ci = e["interval_90"]
        mine = e["source"].startswith("this campaign")
        if ci is None and mine:
            out.append(f"{key}: {e['value']:+.1%} has no interval (overhead.json kept no "
                       "per-round samples of it): how sure it is is unknown")
        elif ci is not None and ci[0] <= 0.0 <= ci[1] and key != "replay_per_audit":
            out.append(f"{key}: {e['value']:+.1%}, 90% interval {ci[0]:+.1%} to {ci[1]:+.1%}, "
                       "spans zero: it cannot be told from no cost"
                       + (" on this machine" if mine else ""))
        elif ci is None and e["value"] < 0:
            out.append(f"{key}: {e['value']:+.1%} is below zero: a measurement within noise")
    return out
