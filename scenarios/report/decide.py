"""One recommended configuration, with how sure it is.

The cost model (``scenarios.report.cost``) prices every configuration; the least expected
loss alone is not an answer, because two configurations often differ by less than the
campaign can measure (a weights check every 2 or every 8 steps on a CPU whose step varies
by more than their difference), and the least of them moves from run to run. So:

1. **Resamples.** ``RESAMPLES`` bootstrap resamples with a fixed seed (the report is
   deterministic): the fault trials drawn with replacement within each stratum (replay
   interval, checksum setting, site, bit field: the strata keep their sizes, so the fault
   mix's weights stay as they are) and the overhead rounds drawn with replacement (a round
   keeps every configuration's block together). Each resample prices every configuration
   again: T[r, c] GPU-hours a day.
2. **The set the data cannot tell apart.** b = the configuration with the least expected
   loss; c is *indistinguishable* from b when T[c] - T[b] <= ``Z_ONE_SIDED`` x the
   standard deviation of T[r, c] - T[r, b] over the resamples (not significantly worse,
   one-sided 5%).
3. **Tie rule: the safest of them.** Among the indistinguishable configurations the
   recommendation is the one with the fewest expected escapes (the fault mix's weighted
   escape share), then the shortest detection latency, then the least step overhead, then
   the name. Escapes and latency come from the trials, which a rerun of the same campaign
   reproduces bit for bit; only the overheads are timed, and they decide only within the
   set.
4. **Agreement.** The same rule applied to each resample (its own least, its own set with
   the same standard deviations): ``agreement`` is the share of resamples that recommend
   the same configuration, ``split`` how the others divide. Below ``SETTLED`` the report
   says a rerun may recommend one of the others, and why.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from scenarios.report.cost import Config, _check_cost, trial_weights
from scenarios.report.overheads import RESAMPLES, SEED, draw_values, round_draws, rounds_of
from scenarios.spec.cluster import ClusterSpec

SETTLED = 0.9
"""Share of resamples at or above which their most frequent least-loss configuration is the
answer, settled by the data."""
PLAUSIBLE = 0.05
"""Share of resamples a configuration must have the least expected loss in to be one the
data cannot rule out."""
TIE_RULE = ("the configuration with the least expected loss in at least 90% of the bootstrap "
            "resamples; when the resamples split, the cheapest of those with the least loss in "
            "at least 5% of them: the fewest check runs per step (a check every k steps counts "
            "1/k), then the least measured step overhead")


def trial_draws(faults: pd.DataFrame, n: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """``n`` x trials counts: how often each fault trial is drawn in each resample, drawn
    with replacement within its stratum (replay interval, checksum setting, site, field)."""
    counts = np.zeros((n, len(faults)))
    rng = np.random.default_rng([seed, 2])
    # (each value as text, a missing one as "nan": pandas' str dtype keeps NaN as a float)
    keys = [np.array([str(v) for v in faults[c]]) if c in faults else np.full(len(faults), "")
            for c in ("replay_interval", "checksum", "site", "field")]
    strata: dict[tuple[str, ...], list[int]] = {}
    for i, key in enumerate(zip(*keys, strict=True)):
        strata.setdefault(key, []).append(i)
    for key in sorted(strata):
        pos = np.asarray(strata[key])
        pick = pos[rng.integers(0, len(pos), size=(n, len(pos)))]
        np.add.at(counts, (np.repeat(np.arange(n), len(pos)), pick.ravel()), 1.0)
    return counts


def _columns(faults: pd.DataFrame, w: pd.Series, c: Config) -> np.ndarray:
    """7 x trials: each trial's weighted share of (not masked, detected, escaped, crashed,
    latency x detected, non-finite first x detected, weights first x detected) in ``c``."""
    mask = faults.index.isin(c.trials)
    checks = faults["checks"].where(faults["checks"] != "", faults["check"]).str.split("+")
    lost = (faults["outcome"] == "detected") & checks.map(lambda cs: set(cs) <= c.off)
    outcome = faults["outcome"].where(~lost, "escaped")
    det = (outcome == "detected").to_numpy(float)
    lat = faults["latency_from_injection"].astype(float).fillna(0.0).to_numpy()
    ww = w.to_numpy(float) * mask
    return np.stack([
        ww * (outcome != "masked").to_numpy(float), ww * det,
        ww * (outcome == "escaped").to_numpy(float),
        ww * outcome.isin(("crashed", "hung")).to_numpy(float), ww * det * lat,
        ww * det * (faults["check"] == "nonfinite").to_numpy(float),
        ww * det * (faults["check"] == "weights").to_numpy(float)])


def _totals(cluster: ClusterSpec, rate: float, f: np.ndarray, sums: np.ndarray, kw: int,
            delay: float) -> np.ndarray:
    """Expected GPU-hours a day per resample (``scenarios.report.cost._parts``, summed)."""
    tot, det, esc, crash, lat, nf, wt = sums.T
    with np.errstate(invalid="ignore", divide="ignore"):
        p_esc = np.where(tot > 0, esc / tot, 0.0)
        p_crash = np.where(tot > 0, crash / tot, 0.0)
        p_det = np.where(tot > 0, 1 - p_esc - p_crash, 0.0)
        mean_lat = np.where(det > 0, lat / det, 0.0) + np.where(det > 0, wt / det, 0.0) * (
            kw - 1) / 2
        d = delay * np.where(det > 0, nf / det, 0.0)
    g = cluster.gpus
    f = np.maximum(f, 0.0)
    per_day = rate * g * 24.0
    t_h = cluster.step_time_s * (1 + f) / 3600.0
    out: np.ndarray = (g * 24.0 * f / (1 + f) + per_day * p_det * g * (mean_lat + d) * t_h
            + per_day * (p_det + p_crash) * g * cluster.checkpoint_interval_steps / 2 * t_h
            + per_day * (p_det + p_crash) * g * cluster.restart_s / 3600.0
            + per_day * p_esc * cluster.escape_cost)
    return out


class Resamples:
    """Every configuration's trial sums and overhead in each resample (rate-free), so that
    pricing at another SDC rate costs one vectorised pass."""

    def __init__(self, faults: pd.DataFrame, overhead: dict[str, Any] | None,
                 cluster: ClusterSpec, configs: list[Config], exchange_interval: int) -> None:
        self.cluster = cluster
        self.configs = configs
        self.delay = (exchange_interval + 1) / 2
        w = trial_weights(faults, cluster)
        if float(w.sum()) <= 0:
            w = pd.Series(1.0, index=faults.index)
        counts = trial_draws(faults)
        user = dict(cluster.overhead)
        checks, replay = draw_values(overhead, user, round_draws(rounds_of(overhead)))
        n = counts.shape[0]
        g0 = checks.get("guard_checks_off", np.zeros(n))
        self.sums: list[np.ndarray] = []
        self.point_sums: list[np.ndarray] = []
        self.f: list[np.ndarray] = []
        for c in configs:
            cols = _columns(faults, w, c)
            self.sums.append(counts @ cols.T)
            self.point_sums.append(cols.sum(1)[None, :])
            kw = c.weights_interval or 1
            f = checks.get("nonfinite", np.zeros(n)).copy()
            for x in c.checks:
                if _check_cost(overhead, cluster, x) is not None:
                    f += (checks[x] - g0) / (kw if x == "weights" else 1)
            if c.replay_interval:
                f += replay[c.replay_interval] - g0
            self.f.append(f)

    def totals(self, rate: float) -> np.ndarray:
        """resamples x configurations: expected GPU-hours a day at ``rate``."""
        cols = [_totals(self.cluster, rate, f, s, c.weights_interval or 1, self.delay)
                for c, f, s in zip(self.configs, self.f, self.sums, strict=True)]
        return np.stack(cols, axis=1)


def checks_per_step(row: dict[str, Any]) -> float:
    """How much checking a configuration does: check runs per step beyond the non-finite
    check (the replay audit every k steps counts 1/k, the weights check every kw 1/kw, the
    checksum 1). It follows from the configuration alone, not from a timing."""
    k, kw = row["replay_interval"], row["weights_interval"]
    return ((1 / k if k else 0.0) + (1 / kw if kw else 0.0)
            + (1.0 if "checksum" in row["checks"] else 0.0))


def decide(rows: list[dict[str, Any]], res: Resamples, rate: float) -> dict[str, Any] | None:
    """The recommendation among the priced ``rows`` (``cost.configurations``, at ``rate``)."""
    by_name = {r["name"]: r for r in rows}
    keep = [i for i, c in enumerate(res.configs) if c.name in by_name]
    if not keep:
        return None
    names = [res.configs[i].name for i in keep]
    boot = res.totals(rate)[:, keep]
    point = np.array([by_name[x]["total"] for x in names])
    wins = pd.Series([names[i] for i in np.argmin(boot, axis=1)]).value_counts() / len(boot)
    wins = wins.reindex(names, fill_value=0.0)
    cheapest = sorted(names, key=lambda x: (checks_per_step(by_name[x]),
                                            round(by_name[x]["overhead"], 12), x))
    least = names[int(np.argmin(point))]
    top = max(names, key=lambda x: (wins[x], -cheapest.index(x)))
    settled = bool(wins[top] >= SETTLED)
    plausible = [x for x in cheapest if wins[x] >= PLAUSIBLE or x == top]
    name = top if settled else plausible[0]
    return {
        "name": name, "least_expected_loss": least, "settled": settled,
        "agreement": float(wins[name]), "indistinguishable": plausible,
        "split": {x: float(wins[x]) for x in sorted(names, key=lambda x: -wins[x])
                  if wins[x] > 0},
        "resamples": len(boot), "seed": SEED, "rule": TIE_RULE,
    }
