"""Detection latency as a distribution: per check and per site, in steps.

``latency_from_injection = detect_step - first_injection`` and ``latency_from_divergence =
detect_step - first_divergence`` (``scenarios.report.outcome``), over the detected fault
trials. For each group: the count, mean, the percentiles ``PERCENTILES`` (linear
interpolation between order statistics, ``pandas.Series.quantile``) and the maximum.
The check is the first that fired at the first detection (``check``); ``check_histogram``
holds each check's counts per latency (the per-site counts are ``latency_histogram``), from
which the report draws the CDFs (``latency_cdf.svg``).

``detect_step`` is the step a detection belongs to. The non-finite check *reports* it
later: its flags travel every ``GuardConfig.nonfinite_exchange_interval`` (N) steps, so the
report comes 1 to N steps after the faulty step (N - (s mod N) for a fault at step s,
uniform over 1..N for a uniform step: mean (N + 1) / 2). ``nonfinite_report_delay`` gives
that distribution for the library's default N; it delays the rollback, not containment
(a rank withholds its own step at once).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from scenarios.report.table import py

PERCENTILES = (50, 90, 99)
MEASURES = ("latency_from_injection", "latency_from_divergence")


def step_counts(counts: pd.Series) -> dict[str, int]:
    """A ``value_counts`` of latencies in steps as ``{"<steps>": trials}``, in its order."""
    return {str(int(v)): int(n) for v, n in zip(counts.index.to_numpy(dtype=float),
                                                 counts.to_numpy(), strict=True)}


def _describe(col: pd.Series) -> dict[str, Any] | None:
    col = col.dropna().astype(float)
    if col.empty:
        return None
    q = col.quantile([p / 100 for p in PERCENTILES])
    return {"n": len(col), "mean": py(col.mean()),
            **{f"p{p}": py(v) for p, v in zip(PERCENTILES, q, strict=True)},
            "max": py(col.max())}


def report_delay(interval: int) -> dict[str, Any]:
    """The non-finite check's report delay in steps for exchange interval N (module doc)."""
    return {"exchange_interval": interval, "steps_min": 1, "steps_max": interval,
            "steps_mean": (interval + 1) / 2,
            "rule": "a fault at step s is reported at the end of its N-step window plus one "
                    "step: N - (s mod N) steps later, uniform over 1..N"}


def latency_distribution(faults: pd.DataFrame, sites: list[str]) -> dict[str, Any]:
    """Percentiles per check, per site and per (check, site), from the injection and from the
    divergence (``summary.json`` key ``latency``)."""
    from sdc_guard import GuardConfig

    det = faults[faults["outcome"] == "detected"]
    out: dict[str, Any] = {"percentiles": list(PERCENTILES), "unit": "steps"}
    for measure in MEASURES:
        key = measure.removeprefix("latency_")
        by_check = {str(c): d for c, g in det.groupby("check", sort=True)
                    if (d := _describe(g[measure])) is not None}
        by_site = {s: d for s in sites
                   if (d := _describe(det.loc[det["site"] == s, measure])) is not None}
        cells: dict[str, dict[str, Any]] = {}
        for (c, s), g in det.groupby(["check", "site"], sort=True):
            d = _describe(g[measure])
            if d is not None:
                cells.setdefault(str(c), {})[str(s)] = d
        hist = {str(c): step_counts(g[measure].dropna().value_counts().sort_index())
                for c, g in det.groupby("check", sort=True)}
        out[key] = {"all": _describe(det[measure]), "checks": by_check, "sites": by_site,
                    "check_site": cells,
                    "check_histogram": {c: h for c, h in hist.items() if h}}
    out["nonfinite_report_delay"] = report_delay(GuardConfig().nonfinite_exchange_interval)
    return out
