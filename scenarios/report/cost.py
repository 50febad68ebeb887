"""The cost model: expected GPU-hours lost per day for each guard configuration.

Every formula is in ``docs/cost-model.md``; in short, per configuration (a replay interval
k, 0 = off, and each optional check on or off; the non-finite check is always on):

* ``f`` = the step-time overhead (fraction of plain DDP's step): the non-finite check,
  plus each optional check's own cost above the guard's fixed cost, plus the replay
  audit's ``fixed + per_audit / k`` above it (the campaign's fit; its bootstrap 90%
  interval gives the band). ``[cluster.overhead]`` replaces any of them.
* ``F = sdc_per_gpu_hour x gpus x 24``: state-changing corruptions per day.
* Per corruption, from the campaign's fault trials at interval k, weighted by the fault mix
  (``field_mix`` x ``site_mix`` x ``pattern_mix`` over each (site, field, pattern) cell's
  trials): the shares of
  detected, escaped and crashed (or hung) among those not masked. A detection by checks
  that are all off in the configuration counts as escaped (no later check is assumed).
* Parts, with ``t = step_time_s x (1 + f)`` and ``G = gpus``:
  ``check_overhead = G x 24 x f / (1 + f)``;
  ``detection_latency = F x P_det x G x (L + D) x t / 3600`` (L: mean steps from the
  injection to the detection, D: the non-finite check's report delay);
  ``rollback = F x (P_det + P_crash) x G x (C / 2) x t / 3600`` (C: checkpoint interval);
  ``restart = F x (P_det + P_crash) x G x restart_s / 3600``;
  ``escapes = F x P_esc x escape_gpu_hours``.
* The weights check's interval ``kw`` (``WEIGHTS_INTERVALS``): measured at 1; at ``kw`` its
  overhead is divided by ``kw`` and its detections wait ``(kw - 1) / 2`` more steps.
* With a ``checksum`` axis in the campaign, a configuration with the checksum check on (off)
  uses the trials that ran with it on (off), not a counterfactual.
* Band: every part at the ends of the campaign's intervals (escape share: Wilson on the
  weighted trials' effective size; replay overhead: bootstrap); ``total_low`` /
  ``total_high``.

Recommendation: the configuration with the least expected total; ``within_uncertainty``
lists those whose band reaches below its upper end. ``sensitivity``: the choice at 10x
lower and higher SDC rates.

Hook for further checks: ``OPTIONAL_CHECKS``. A check listed there enters the model as soon
as the campaign measures its overhead (``overhead.<name>``, or ``[cluster.overhead]``) and
its name appears in the trials' ``checks`` column: the "checksum" check (fault site
"linear_product") needs no other change here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pandas as pd

from scenarios.report.stats import wilson
from scenarios.spec.cluster import ClusterSpec

OPTIONAL_CHECKS = ("weights", "checksum")
"""Checks the model turns on and off (hook: a new check's name here, its overhead under
``overhead.json``'s key of the same name)."""
ALWAYS_ON = ("nonfinite",)
PARTS = ("check_overhead", "detection_latency", "rollback", "restart", "escapes")
SENSITIVITY = (0.1, 10.0)
WEIGHTS_INTERVALS = (1, 2, 4, 8)
"""The weights check every kw steps: measured at 1; at kw its overhead is the measured one / kw
and a corruption it finds waits (kw - 1) / 2 more steps on average (docs/cost-model.md)."""


def _mix(pairs: tuple[tuple[str, float], ...], present: list[str]) -> dict[str, float]:
    """Weights of the present values: the mix's, or 1 each when the mix is empty."""
    mix = dict(pairs)
    return {v: mix.get(v, 0.0) for v in present} if mix else dict.fromkeys(present, 1.0)


def _patterns(faults: pd.DataFrame) -> pd.Series:
    """Each trial's fault pattern ("single" where the table has none: written before it)."""
    if "pattern" not in faults:
        return pd.Series("single", index=faults.index)
    return faults["pattern"].replace("", "single")


def trial_weights(faults: pd.DataFrame, cluster: ClusterSpec) -> pd.Series:
    """Each fault trial's weight: its (site, field, pattern) cell's share of the mix over the
    trials in that cell (post-stratification; 0 for fields, sites or patterns the mix leaves
    out). The field mix shapes one-bit faults (``single``: its weights normalised over the
    fields present); another pattern's field labels count alike."""
    if faults.empty:
        return pd.Series(dtype=float)
    pattern = _patterns(faults)
    single = pattern == "single"
    sw = _mix(cluster.site_mix, sorted(set(faults["site"])))
    pw = _mix(cluster.pattern_mix, sorted(set(pattern)))
    fw = _mix(cluster.field_mix, sorted(set(faults.loc[single, "field"])))
    total = sum(fw.values()) or 1.0
    field_w = pd.Series(1.0, index=faults.index)
    field_w[single] = faults.loc[single, "field"].map(fw).astype(float) / total
    if (~single).any():
        labels = faults.loc[~single].groupby(pattern[~single])["field"].transform("nunique")
        field_w[~single] = 1.0 / labels.astype(float)
    n = faults.assign(pattern=pattern).groupby(["site", "field", "pattern"])["id"].transform(
        "size")
    return (faults["site"].map(sw).astype(float) * pattern.map(pw).astype(float) * field_w
            / n)


def _shares(g: pd.DataFrame, w: pd.Series, off: set[str]) -> dict[str, Any] | None:
    """Weighted shares of the outcomes among not-masked trials, checks in ``off`` removed."""
    checks = g["checks"].where(g["checks"] != "", g["check"]).str.split("+")
    lost = (g["outcome"] == "detected") & checks.map(lambda cs: set(cs) <= off)
    outcome = g["outcome"].where(~lost, "escaped")
    nm = outcome != "masked"
    total = float(w[nm].sum())
    if total <= 0:
        return None
    det = outcome == "detected"
    crash = outcome.isin(("crashed", "hung"))
    n_eff = total ** 2 / float((w[nm] ** 2).sum())
    p_esc = float(w[outcome == "escaped"].sum()) / total
    ci = wilson(round(p_esc * n_eff), max(1, round(n_eff)))
    wd = w[det]
    lat = g.loc[det, "latency_from_injection"].astype(float).fillna(0.0)
    nf = (g.loc[det, "check"] == "nonfinite").astype(float)
    wt = (g.loc[det, "check"] == "weights").astype(float)
    return {"trials": int(nm.sum()), "effective_trials": n_eff,
            "detected": float(wd.sum()) / total, "escaped": p_esc,
            "escaped_ci95": ci, "crashed": float(w[crash].sum()) / total,
            "latency_steps": float((lat * wd).sum() / wd.sum()) if wd.sum() > 0 else 0.0,
            "nonfinite_share": float((nf * wd).sum() / wd.sum()) if wd.sum() > 0 else 0.0,
            "weights_share": float((wt * wd).sum() / wd.sum()) if wd.sum() > 0 else 0.0,
            "detections_lost_to_checks_off": int(lost.sum())}


def _overheads(overhead: dict[str, Any] | None, fit_ci: dict[str, Any] | None,
               cluster: ClusterSpec, k: int) -> tuple[float, float, float] | None:
    """(point, low, high) overhead of the replay audit at k above the guard's fixed cost."""
    ov = overhead or {}
    user = dict(cluster.overhead)
    g0 = user.get("guard_checks_off", ov.get("guard_checks_off", 0.0))
    if k == 0:
        return 0.0, 0.0, 0.0
    fit = ov.get("replay_fit")
    if "replay_fixed" in user or "replay_per_audit" in user:
        fixed = user.get("replay_fixed", fit["fixed"] if fit else 0.0)
        per = user.get("replay_per_audit", fit["per_audit"] if fit else 0.0)
        v = fixed + per / k - g0
        return v, v, v
    if fit:
        v = fit["fixed"] + fit["per_audit"] / k - g0
        band = ((fit_ci or {}).get("predicted") or {}).get(str(k))
        return (v, band[0] - g0, band[1] - g0) if band else (v, v, v)
    med = (ov.get("replay") or {}).get(str(k))
    return None if med is None else (med - g0, med - g0, med - g0)


def _check_cost(overhead: dict[str, Any] | None, cluster: ClusterSpec, name: str) -> float | None:
    user = dict(cluster.overhead)
    ov = overhead or {}
    v = user.get(name, ov.get(name))
    if v is None:
        return None
    return float(v) - float(user.get("guard_checks_off", ov.get("guard_checks_off", 0.0)))


def _parts(cluster: ClusterSpec, rate: float, f: float, p_det: float, p_esc: float,
           p_crash: float, latency: float, delay: float) -> dict[str, float]:
    g = cluster.gpus
    f = max(f, 0.0)  # a check costs nothing or more: a negative measurement is noise around 0
    per_day = rate * g * 24.0
    t_h = cluster.step_time_s * (1 + f) / 3600.0
    return {
        "check_overhead": g * 24.0 * f / (1 + f),
        "detection_latency": per_day * p_det * g * (latency + delay) * t_h,
        "rollback": per_day * (p_det + p_crash) * g * cluster.checkpoint_interval_steps / 2
        * t_h,
        "restart": per_day * (p_det + p_crash) * g * cluster.restart_s / 3600.0,
        "escapes": per_day * p_esc * cluster.escape_cost,
    }


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration the model prices: which trials stand for it and what is off."""

    name: str
    replay_interval: int
    checks: tuple[str, ...]
    """The optional checks on (``OPTIONAL_CHECKS``)."""
    weights_interval: int
    """The weights check every ``weights_interval`` steps (0: off)."""
    off: frozenset[str]
    """Checks whose detections count as escapes here (off, or the replay audit at k = 0)."""
    trials: pd.Index
    """The fault trials that stand for it: interval k's (and, with a checksum axis, those
    that ran with the checksum check as it is here)."""


def optional_checks(faults: pd.DataFrame, overhead: dict[str, Any] | None,
                    cluster: ClusterSpec) -> list[str]:
    """The optional checks with a measured overhead that fired in some trial (a check the
    trials never ran gives no data)."""
    optional = [c for c in OPTIONAL_CHECKS if _check_cost(overhead, cluster, c) is not None]
    fired = {c for cs in faults["checks"].str.split("+") for c in cs if c}
    return [c for c in optional if c in fired]


def config_list(faults: pd.DataFrame, overhead: dict[str, Any] | None,
                cluster: ClusterSpec) -> list[Config]:
    """Every configuration the campaign measured: each replay interval with a measured
    overhead, each optional check on or off, each weights interval."""
    optional = optional_checks(faults, overhead, cluster)
    intervals = sorted(int(k) for k in faults["replay_interval"].dropna().unique())
    axis = faults["checksum"].dropna() if "checksum" in faults else pd.Series(dtype=bool)
    checksum_axis = axis.nunique() > 1  # trials ran with it on and off: no counterfactual
    out = []
    for k in intervals:
        if _overheads(overhead, None, cluster, k) is None:
            continue
        gk = faults[faults["replay_interval"] == k]
        for on, kw in itertools.product(itertools.product((True, False), repeat=len(optional)),
                                        WEIGHTS_INTERVALS):
            checks = tuple(c for c, o in zip(optional, on, strict=True) if o)
            if kw != 1 and "weights" not in checks:
                continue
            off = {c for c, o in zip(optional, on, strict=True) if not o}
            if k == 0:
                off.add("replay")
            g = gk
            if checksum_axis and "checksum" in optional:
                g = gk[gk["checksum"].fillna(False).astype(bool) == ("checksum" in checks)]
            name = ("replay off" if k == 0 else f"replay {k}") + "".join(
                f" +{c}" + (f"/{kw}" if c == "weights" and kw != 1 else "") for c in checks)
            out.append(Config(name=name, replay_interval=k, checks=checks,
                              weights_interval=kw if "weights" in checks else 0,
                              off=frozenset(off), trials=g.index))
    return out


def configurations(faults: pd.DataFrame, overhead: dict[str, Any] | None,
                   fit_ci: dict[str, Any] | None, cluster: ClusterSpec,
                   exchange_interval: int, rate: float | None = None) -> list[dict[str, Any]]:
    """Every configuration the campaign measured, with its expected daily loss by part."""
    rate = cluster.sdc_per_gpu_hour if rate is None else rate
    if faults.empty:
        return []
    w = trial_weights(faults, cluster)
    if float(w.sum()) <= 0:  # the mix weighs nothing the campaign sampled: raw shares
        w = pd.Series(1.0, index=faults.index)
    ov = overhead or {}
    user = dict(cluster.overhead)
    nonfinite = float(user.get("nonfinite", ov.get("nonfinite", 0.0)))
    delay = (exchange_interval + 1) / 2
    rows: list[dict[str, Any]] = []
    for c in config_list(faults, overhead, cluster):
        replay = _overheads(overhead, fit_ci, cluster, c.replay_interval)
        if replay is None:
            continue
        g = faults.loc[c.trials]
        sh = _shares(g, w.loc[g.index], set(c.off))
        if sh is None:
            continue
        kw = c.weights_interval or 1
        extra = sum((_check_cost(overhead, cluster, x) or 0.0) / (kw if x == "weights" else 1)
                    for x in c.checks)
        f = [nonfinite + extra + r for r in replay]
        p_crash = sh["crashed"]
        esc = [sh["escaped"], *(sh["escaped_ci95"] or [sh["escaped"]] * 2)]
        # every kw-th step: a corruption the weights check finds waits (kw - 1) / 2 steps
        # more on average (the campaign measured kw = 1; the corrupt state persists)
        lat = sh["latency_steps"] + sh["weights_share"] * (kw - 1) / 2
        d = delay * sh["nonfinite_share"]
        point = _parts(cluster, rate, f[0], 1 - esc[0] - p_crash, esc[0], p_crash, lat, d)
        low = _parts(cluster, rate, f[1], max(0.0, 1 - esc[1] - p_crash), esc[1], p_crash,
                     lat, d)
        high = _parts(cluster, rate, f[2], max(0.0, 1 - esc[2] - p_crash), esc[2], p_crash,
                      lat, d)
        lo_t = sum(min(low[p], high[p]) for p in PARTS)
        hi_t = sum(max(low[p], high[p]) for p in PARTS)
        rows.append({"name": c.name, "replay_interval": c.replay_interval,
                     "checks": [*ALWAYS_ON, *c.checks],
                     "weights_interval": c.weights_interval,
                     "overhead": f[0], "overhead_band": [f[1], f[2]],
                     "outcomes": sh, "latency_steps": lat, "parts": point,
                     "total": sum(point.values()),
                     "total_low": min(lo_t, sum(point.values())),
                     "total_high": max(hi_t, sum(point.values()))})
    return rows


def cost_model(faults: pd.DataFrame, overhead: dict[str, Any] | None,
               fit_ci: dict[str, Any] | None, cluster: ClusterSpec,
               exchange_interval: int) -> dict[str, Any]:
    """``summary.json``'s ``cost``: the table, the one recommendation (``decide``: the
    safest of the configurations the data cannot tell apart from the least expected loss,
    with the share of bootstrap resamples that agree) and its sensitivity to the SDC rate."""
    from scenarios.report.decide import TIE_RULE, Resamples, decide

    rows = configurations(faults, overhead, fit_ci, cluster, exchange_interval)
    res = Resamples(faults, overhead, cluster, config_list(faults, overhead, cluster),
                    exchange_interval) if rows else None
    rec = None
    d = decide(rows, res, cluster.sdc_per_gpu_hour) if res else None
    if d is not None:
        best = next(r for r in rows if r["name"] == d["name"])
        rec = {"name": best["name"], "replay_interval": best["replay_interval"],
               "checks": best["checks"], "weights_interval": best["weights_interval"],
               "gpu_hours_per_day": best["total"],
               "band": [best["total_low"], best["total_high"]],
               "overhead": best["overhead"],
               "within_uncertainty": [x for x in d["indistinguishable"] if x != best["name"]],
               **{k: d[k] for k in ("least_expected_loss", "indistinguishable", "agreement",
                                    "settled", "split", "resamples", "seed")}}
    sens = {}
    for factor in SENSITIVITY:
        rate = cluster.sdc_per_gpu_hour * factor
        r2 = configurations(faults, overhead, fit_ci, cluster, exchange_interval, rate)
        b = decide(r2, res, rate) if res else None
        sens[f"x{factor:g}"] = None if b is None else {
            "name": b["name"], "agreement": b["agreement"],
            "gpu_hours_per_day": next(r["total"] for r in r2 if r["name"] == b["name"])}
    return {"cluster": cluster.to_json(), "escape_gpu_hours": cluster.escape_cost,
            "sdc_per_day": cluster.sdc_per_gpu_hour * cluster.gpus * 24.0,
            "nonfinite_exchange_interval": exchange_interval, "parts": list(PARTS),
            "unit": "GPU-hours per day", "configurations": rows, "recommendation": rec,
            "sensitivity": sens, "rule": TIE_RULE + " (docs/cost-model.md)"}


def field_coverage(faults: pd.DataFrame, cluster: ClusterSpec,
                   sites: list[str]) -> dict[str, Any] | None:
    """Coverage weighted by the fault mix, per site and overall, beside the raw sampled one."""
    if faults.empty:
        return None
    w = trial_weights(faults, cluster)
    nm = faults["outcome"] != "masked"
    det = faults["outcome"] == "detected"

    def one(idx: pd.Series) -> dict[str, Any] | None:
        ww = w[idx & nm]
        total = float(ww.sum())
        raw_n = int((idx & nm).sum())
        raw = int((idx & det).sum()) / raw_n if raw_n else None
        if total <= 0:
            return {"weighted": None, "weighted_ci95": None, "sampled": raw}
        p = float(w[idx & det].sum()) / total
        n_eff = total ** 2 / float((ww ** 2).sum())
        return {"weighted": p, "weighted_ci95": wilson(round(p * n_eff), max(1, round(n_eff))),
                "effective_trials": n_eff, "sampled": raw}

    pattern = _patterns(faults)
    fields = sorted(set(faults.loc[pattern == "single", "field"]))
    mix = dict(cluster.field_mix)
    pmix = dict(cluster.pattern_mix)
    sampled = sorted(set(pattern))
    multi = "multi_bit" in sampled
    return {
        "sites": {s: one(faults["site"] == s) for s in sites},
        "all": one(pd.Series(True, index=faults.index)),
        "field_mix": mix, "site_mix": dict(cluster.site_mix) or "every sampled site alike",
        "pattern_mix": pmix,
        "fields_without_weight": [f for f in fields if mix and mix.get(f, 0.0) == 0.0],
        "patterns_without_weight": [p for p in sampled if pmix and pmix.get(p, 0.0) == 0.0],
        "note": "weighted: each (site, field, pattern) cell's trials stand for the cell's "
                "share of the fault mix; sampled: detected / not masked over the campaign's "
                "own sample. " + (
                    "Multi-bit flips (the pattern mix's multi_bit) are sampled." if multi else
                    "Multi-bit flips (over 60% of bit-flip events in arXiv 2605.04213) are "
                    "not sampled and not in either number (a patterns axis samples them: "
                    "scenarios/configs/field.toml)."),
    }
