"""A campaign's numbers (``summary.json``): coverage, latency, overhead, the recommendation.

Everything is computed from the output directory alone (``trials.csv``,
``overhead.json``, ``campaign.json``), so ``python -m scenarios report DIR``
can rebuild it at any time, also from a partial (killed) campaign. The trials are
one pandas DataFrame (``scenarios.report.table``); every table is a group-by of it.

Groups: by site, bit field, fault model, scenario, replay interval, and by parallelism
(``parallels``: ddp, fsdp4, hsdp3x2, ... from the scenario's ``parallel`` and ``mesh``; a
table written before that column existed is all DDP) and by site and parallelism
(``by_site_parallel``).

Coverage of a group of fault trials = detected / (trials - masked): a masked
fault left the run bit-identical to golden, so there was nothing to detect.
Its 95% interval is Wilson's score interval (``scenarios.report.stats.wilson``). Escape
rate = escaped / (trials - masked), with its Wilson interval too.

Recommended replay interval (``recommended_replay_interval``, the budget rule; the cost
model's recommendation is ``cost.recommendation``, ``scenarios.report.cost``): the
*smallest* measured interval k >= 1 whose
replay-audit overhead (the guard with only the replay audit, every k steps,
against plain DDP) fits ``overhead_budget``. The overhead used is the fit
``fixed + per_audit / k`` (``overhead.replay_fit``: least squares over every
round's paired measurement at every interval, the per-step cost of deterministic
mode plus one audit's cost spread over k steps), not each interval's own median:
the fit pools every measurement, so an interval near the budget does not flip
the recommendation from run to run on one noisy median, and the recommendation
is monotone in the budget. ``recommendation_agreement`` is the share of 1000
bootstrap resamples of the rounds (``scipy.stats.bootstrap``) that recommend the same
interval (1.0: the data settle it; near 0.5: the budget sits on an interval's cost);
``overhead_fit_ci90`` holds the bootstrap's 90% intervals of the fit. Without
per-round samples (an ``overhead.json`` from an older version) the medians
``overhead.replay.<k>`` are used. The interval
only changes the audit's cost; the always-on checks (non-finite, weights) cost
the same at every interval and are reported on their own (``overhead.nonfinite``,
``overhead.weights``) and together with the audit (``overhead.total.<k>``).
Smaller intervals audit more steps, so of the intervals the budget allows the
smallest has the fewest escapes by construction; the measured escape rates are
shown next to it. None when no interval fits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from injectors import SITES
from injectors.patterns import PATTERNS
from scenarios.report.checksum import checksum_summary
from scenarios.report.cost import cost_model, field_coverage
from scenarios.report.determinism import determinism_summary
from scenarios.report.latency import latency_distribution, step_counts
from scenarios.report.overheads import noise_warnings, read_overhead_file, round_draws, rounds_of
from scenarios.report.overheads import used as overheads_used
from scenarios.report.stats import bootstrap_rounds, fit_interval, fit_replay_overhead, wilson
from scenarios.report.table import json_list, py, read_trials
from scenarios.spec.cluster import SCALARS, ClusterSpec, cluster_from_table
from scenarios.spec.faults import FIELDS
from sdc_guard import GuardConfig

__all__ = ["OUTCOMES", "STATE_SITES", "fit_replay_overhead", "recommend",
           "recommendation_agreement", "summarize", "wilson"]

OUTCOMES = ("detected", "masked", "escaped", "crashed", "hung")
LOST = "lost"
"""A trial lost twice to a kill from outside: listed on its own, in no other number."""
STATE_SITES = ("weight_storage", "optimizer_state", "gradient_after_allreduce")
EXTRA_FIELDS = ("custom", "set", "random", "zero")
"""Fault kinds that are not a bit field, in the report's order after ``FIELDS``."""


def _median(col: pd.Series) -> Any:
    col = col.dropna()
    return py(col.median()) if len(col) else None


def _max(col: pd.Series) -> Any:
    col = col.dropna()
    return py(col.max()) if len(col) else None


def _ratio(k: int, n: int) -> float | None:
    return k / n if n else None


def _group(g: pd.DataFrame) -> dict[str, Any]:
    counts = g["outcome"].value_counts()
    c = {o: int(counts.get(o, 0)) for o in OUTCOMES}
    relevant = len(g) - c["masked"]
    det = g[g["outcome"] == "detected"]
    blame = int(det["blame_correct"].fillna(False).sum())
    return {
        "trials": len(g), **c,
        "coverage": _ratio(c["detected"], relevant),
        "coverage_ci95": wilson(c["detected"], relevant),
        "escape_rate": _ratio(c["escaped"], relevant),
        "escape_rate_ci95": wilson(c["escaped"], relevant),
        "latency_steps_p50": _median(det["latency_from_injection"]),
        "latency_steps_max": _max(det["latency_from_injection"]),
        "latency_from_divergence_p50": _median(det["latency_from_divergence"]),
        "latency_from_divergence_max": _max(det["latency_from_divergence"]),
        "blame_correct": _ratio(blame, len(det)),
        "blame_correct_count": blame,
        "contained": int(det["contained"].fillna(False).sum()),
        "not_fired": int(((g["kind"] == "fault") & (g["injections"] == 0)).fillna(False).sum()),
    }


def _groups(faults: pd.DataFrame, by: str, order: list[Any]) -> dict[str, dict[str, Any]]:
    """``_group`` of every value of ``by`` in ``order`` (the values present, as strings)."""
    groups = dict(iter(faults.groupby(by, sort=False, dropna=False)))
    return {str(k): _group(groups[k]) for k in order if k in groups}


MIN_CELL = 100
"""Not-masked trials a (pattern, site, dtype) cell needs to be ranked: fewer give an interval
too wide to order it by."""


def pattern_cells(faults: pd.DataFrame) -> list[dict[str, Any]]:
    """Coverage of every (pattern, site, dtype) cell of the fault trials, those with at least
    ``MIN_CELL`` not-masked trials first, by escape rate (highest first), then the others
    (``"ranked": False``). Empty when every trial is a one-bit fault (the report's other
    tables say it all)."""
    if set(faults["pattern"]) <= {"single"}:
        return []
    cells = []
    dtype = faults["injected_dtype"].replace("", "?")
    for (pat, site, dt), g in faults.assign(injected_dtype=dtype).groupby(
            ["pattern", "site", "injected_dtype"], sort=False):
        row = {"pattern": pat, "site": site, "dtype": dt, **_group(g)}
        row["not_masked"] = row["trials"] - row["masked"]
        row["ranked"] = row["not_masked"] >= MIN_CELL
        if row["not_masked"]:  # (faults that never fired have no dtype and no outcome)
            cells.append(row)
    return sorted(cells, key=lambda c: (not c["ranked"], -(c["escape_rate"] or 0.0),
                                        c["pattern"], c["site"], c["dtype"]))


CHECKS = ("nonfinite", "weights", "replay", "checksum")
"""The checks a trial's ``checks`` column names, in the order ``pattern_checks`` lists them."""


def pattern_checks(faults: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per pattern present (none when every trial is a one-bit fault): its not-masked trials
    ``n`` and the share of them each check saw at the first detection step (``checks``), and
    any check: where a check stops seeing a shape of fault."""
    if set(faults["pattern"]) <= {"single"}:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for pat in [p for p in PATTERNS if p in set(faults["pattern"])]:
        g = faults[(faults["pattern"] == pat) & (faults["outcome"] != "masked")]
        seen = g["checks"].map(lambda v: set(str(v).split("+")) if v else set())
        n = len(g)
        out[pat] = {"n": n, **{c: _ratio(int(seen.map(lambda x, c=c: c in x).sum()), n)
                               for c in CHECKS},
                    "any": _ratio(int((g["outcome"] == "detected").sum()), n)}
    return out


def _smallest_within(values: dict[str, float], budget: float) -> int | None:
    fits = [int(k) for k, v in values.items() if int(k) > 0 and v <= budget]
    return min(fits) if fits else None


def recommend(overhead: dict[str, Any] | None, budget: float) -> int | None:
    """The smallest replay interval >= 1 whose replay overhead fits the budget (see module doc)."""
    if not overhead:
        return None
    fit = overhead.get("replay_fit")
    if fit:
        return _smallest_within(fit["predicted"], budget)
    return _smallest_within(overhead.get("replay", {}), budget)


def recommendation_agreement(overhead: dict[str, Any] | None, budget: float,
                             n: int = 1000) -> float | None:
    """Share of bootstrap resamples of the rounds whose fit recommends what all rounds do."""
    if not overhead or not overhead.get("replay_fit") or not overhead.get("samples_ms"):
        return None
    intervals = [int(k) for k in overhead["replay_fit"]["predicted"]]
    want = recommend(overhead, budget)

    def same(line: tuple[float, float] | None) -> float:
        got = None if line is None else _smallest_within(
            {str(k): line[0] + line[1] / k for k in intervals}, budget)
        return float(got == want)

    res = bootstrap_rounds(overhead["samples_ms"], intervals, same, n=n)
    return float(res.bootstrap_distribution.mean())


def _prompt(df: pd.DataFrame) -> pd.Series:
    """Detected within 1 step of the first step at which the fault changed the state (its
    first divergence); a contained detection (nothing changed) in a step in which it fired."""
    div = df["latency_from_divergence"]
    fallback = df["same_step"].fillna(False) | (df["latency_from_injection"].fillna(0) <= 1)
    return pd.Series((div <= 1).where(div.notna(), fallback), dtype="boolean").fillna(False)


def _targets(faults: pd.DataFrame, clean_fp: int) -> dict[str, Any]:
    state = faults[faults["site"].isin(STATE_SITES) & (faults["outcome"] != "masked")]
    detected = state[(state["outcome"] == "detected") & state["blame_correct"].fillna(False)]
    ok = detected[_prompt(detected)]
    strict = detected[detected["latency_from_injection"].fillna(0) <= 1]
    nonfinite = faults[faults["nonfinite_injected"].fillna(False)]
    nf_relevant = nonfinite[nonfinite["outcome"] != "masked"]
    nf_ok = nf_relevant[(nf_relevant["outcome"] == "detected")
                        & nf_relevant["same_step"].fillna(False)]
    return {
        "zero_false_positives": {"met": clean_fp == 0, "false_positives": clean_fp},
        "state_sites_detected_within_1_step_blame_correct": {
            "met": len(ok) == len(state), "trials_that_changed_the_trajectory": len(state),
            "met_by": len(ok), "misses": state.loc[~state.index.isin(ok.index), "id"]
            .tolist()[:50],
            "rule": "detected with the right rank blamed, at most 1 step after the first step "
                    "at which the fault changed the state (or, contained, in a step in which "
                    "it fired)",
            "within_1_step_of_first_injection": len(strict),
        },
        "nonfinite_detected_in_own_step": {
            "met": len(nf_ok) == len(nf_relevant), "nonfinite_faults": len(nonfinite),
            "masked": len(nonfinite) - len(nf_relevant), "relevant": len(nf_relevant),
            "met_by": len(nf_ok),
            "misses": nf_relevant.loc[~nf_relevant.index.isin(nf_ok.index), "id"].tolist()[:50],
        },
    }


def _quarantine(faults: pd.DataFrame, clean: pd.DataFrame) -> dict[str, Any] | None:
    """Cordons per site (scenarios with ``[quarantine]``; None when no trial had one)."""
    qf = faults[faults["cordon_correct"].notna()]
    qc = clean[clean["cordon_correct"].notna()]
    if qf.empty and qc.empty:
        return None

    def group(g: pd.DataFrame) -> dict[str, Any]:
        cordoned = g[json_list(g["cordoned_nodes"]).map(bool).astype(bool)]
        return {
            "trials": len(g), "detected": int((g["outcome"] == "detected").sum()),
            "cordoned": len(cordoned),
            "cordoned_right_nodes": int(cordoned["cordon_correct"].fillna(False).sum()),
            "breaker_tripped": int(g["breaker_tripped"].fillna(False).sum()),
            "api_errors": int(g["quarantine_errors"].fillna(0).sum()),
            "fault_to_cordon_s_p50": _median(g["fault_to_cordon_s"]),
            "fault_to_cordon_s_max": _max(g["fault_to_cordon_s"]),
        }

    by_site = dict(iter(qf.groupby("site", sort=False)))
    return {"sites": {s: group(by_site[s]) for s in SITES if s in by_site},
            "all": group(qf), "clean": group(qc)}


def _recovery(faults: pd.DataFrame) -> dict[str, Any] | None:
    """What was detected, cordoned, rolled back or repaired, and whether the run ended
    bit-identical to golden: the record of the one fault trial, or counts per site."""
    ran = faults[faults["final_matches_golden"].notna()]
    if ran.empty:
        return None
    rolled = ran["rollback_step"].notna()
    first_repaired = ran["repaired"].fillna(False).astype(bool)
    if len(ran) == 1:
        r = ran.iloc[0]
        return {
            "site": r["site"], "fault_rank": py(r["fault_rank"]),
            "detected_step": py(r["detect_step"]), "check": r["check"] or None,
            "suspect_nodes": [f"node-{x}" for x in json_list(ran["suspects"]).iloc[0]],
            "cordoned_nodes": json_list(ran["cordoned_nodes"]).iloc[0],
            "first_detection_repaired": bool(first_repaired.iloc[0]),
            "repaired": bool(first_repaired.iloc[0]) and not bool(rolled.iloc[0]),
            "rolled_back": bool(rolled.iloc[0]),
            "rollback_step": py(r["rollback_step"]),
            "wasted_steps": py(r["wasted_steps"]),
            "saves_refused": py(r["saves_refused"]),
            "fault_to_resume_s": py(r["fault_to_resume_s"]),
            "final_matches_golden": py(r["final_matches_golden"]),
        }
    ran = ran.assign(rolled_back=rolled, repaired_only=first_repaired & ~rolled)

    def group(g: pd.DataFrame) -> dict[str, Any]:
        return {"trials": len(g), "detected": int(g["detect_step"].notna().sum()),
                "final_matches_golden": int(g["final_matches_golden"].fillna(False).sum()),
                "repaired": int(g["repaired_only"].sum()),
                "rolled_back": int(g["rolled_back"].sum()),
                "wasted_steps_p50": _median(g.loc[g["rolled_back"], "wasted_steps"]),
                "wasted_steps_max": _max(g.loc[g["rolled_back"], "wasted_steps"]),
                "fault_to_resume_s_p50": _median(g["fault_to_resume_s"])}

    by_site = dict(iter(ran.groupby("site", sort=False)))
    return {"sites": {s: group(by_site[s]) for s in SITES if s in by_site}, "all": group(ran)}


def _histogram(faults: pd.DataFrame, sites: list[str]) -> dict[str, dict[str, dict[str, int]]]:
    det = faults[faults["outcome"] == "detected"]
    hist: dict[str, dict[str, dict[str, int]]] = {"from_injection": {}, "from_divergence": {}}
    for key, col in (("from_injection", "latency_from_injection"),
                     ("from_divergence", "latency_from_divergence")):
        for s in sites:
            counts = det.loc[det["site"] == s, col].dropna().value_counts(sort=False)
            if len(counts):
                hist[key][s] = step_counts(counts)
    return hist


def cluster_of(meta: dict[str, Any], overrides: dict[str, Any] | None = None) -> ClusterSpec:
    """The cost model's cluster: the defaults, the campaign's ``[cluster]`` table (in
    ``campaign.json``), then ``overrides`` (the command line; None values ignored)."""
    table = meta.get("cluster")
    cluster = cluster_from_table(table, "campaign.json cluster.") if table else ClusterSpec()
    changes = dict(overrides or {})
    if "overhead" in changes:  # one check's overhead on the command line keeps the others
        changes["overhead"] = tuple({**dict(cluster.overhead), **dict(changes["overhead"])}
                                    .items())
    return cluster.with_overrides(**changes)


def _lost(df: pd.DataFrame) -> dict[str, Any]:
    """Trials lost twice to a kill from outside: listed, counted in no other number."""
    cols = ["id", "kind", "scenario", "site", "field", "replay_interval", "error"]
    rows = [{c: py(r[c]) if c in r else None for c in cols} for _, r in df.iterrows()]
    return {"trials": len(df), "rows": rows,
            "note": "lost twice to a kill from outside the campaign (the harness retries a "
                    "lost trial once): left out of coverage, detection and false-positive "
                    "numbers"}


def _cluster_sources(meta: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, str]:
    """Where each ``[cluster]`` scalar comes from: the command line, the campaign file, or
    the default, which is an example (Llama 3 405B's cluster, docs/cost-model.md)."""
    table = meta.get("cluster") or {}
    cli = {k for k, v in (overrides or {}).items() if v is not None}
    return {k: "command line" if k in cli else "campaign [cluster]" if table.get(k) is not None
            else "example default" for k in SCALARS}


def _overhead_inputs(meta: dict[str, Any], cluster: dict[str, Any] | None,
                     overhead_file: str | Path | None
                     ) -> tuple[dict[str, Any], dict[str, str], dict[str, list[float]]]:
    """The cluster overrides with the overhead file folded in, each overhead's source and
    the file's intervals: the campaign's ``[cluster.overhead]``, then the file, then the
    command line (each wins over the one before)."""
    changes = dict(cluster or {})
    sources = {k: "campaign [cluster.overhead] (yours)"
               for k in ((meta.get("cluster") or {}).get("overhead") or {})}
    intervals: dict[str, list[float]] = {}
    pairs: dict[str, float] = {}
    if overhead_file is not None:
        values, intervals, desc = read_overhead_file(overhead_file)
        pairs.update(values)
        sources.update(dict.fromkeys(values, f"--overhead-file {desc}"))
    cli = dict(changes.get("overhead") or ())
    for k in cli:
        intervals.pop(k, None)
    pairs.update(cli)
    sources.update(dict.fromkeys(cli, "command line (--check-overhead)"))
    if pairs:
        changes["overhead"] = tuple(pairs.items())
    return changes, sources, intervals


def summarize(out: Path, cluster: dict[str, Any] | None = None,
              overhead_file: str | Path | None = None) -> dict[str, Any]:
    """Every number of the report; ``cluster``: overrides of the cost model's ``[cluster]``
    fields (``scenarios.spec.cluster.ClusterSpec``), e.g. from the command line;
    ``overhead_file``: your hardware's per-check overheads
    (``scenarios.report.overheads.read_overhead_file``)."""

    df = read_trials(out / "trials.csv")
    meta = _load(out / "campaign.json") or {}
    planned = set(meta.get("planned_ids") or [])
    in_plan = df["id"].isin(planned) if planned else pd.Series(True, index=df.index)
    stale = int((~in_plan).sum())
    df = df[in_plan]
    lost = df[df["outcome"] == LOST]
    df = df[df["outcome"] != LOST]
    overhead = _load(out / "overhead.json")
    budget = float(meta.get("overhead_budget", 0.25))
    # a table written before the parallel column existed holds DDP trials only
    df = df.assign(parallel=df["parallel"].replace("", "ddp"))
    faults = df[df["kind"] == "fault"]
    # a table written before the pattern column existed holds one-bit faults only
    faults = faults.assign(pattern=faults["pattern"].replace("", "single"))
    clean = df[df["kind"] == "clean"]
    fp = int((clean["outcome"] == "detected").sum())
    present_sites = set(faults["site"])
    sites = [s for s in SITES if s in present_sites]
    present_fields = set(faults["field"])
    fields = [f for f in (*FIELDS, *EXTRA_FIELDS) if f in present_fields]
    by_site_field: dict[str, dict[str, Any]] = {}
    for (s, f), g in faults.groupby(["site", "field"], sort=False):
        if s in sites and f in fields:
            by_site_field.setdefault(s, {})[f] = _group(g)
    by_site_field = {s: {f: by_site_field[s][f] for f in fields if f in by_site_field[s]}
                     for s in sites if s in by_site_field}
    parallels = sorted(set(df["parallel"]), key=lambda x: (x != "ddp", x))
    by_site_parallel: dict[str, Any] = {}
    for (s, par), g in faults.groupby(["site", "parallel"], sort=False):
        if s in sites:
            by_site_parallel.setdefault(s, {})[par] = _group(g)
    by_site_parallel = {s: {x: by_site_parallel[s][x] for x in parallels
                            if x in by_site_parallel[s]}
                        for s in sites if s in by_site_parallel}
    intervals = sorted(int(k) for k in faults["replay_interval"].dropna().unique())
    det = faults[faults["outcome"] == "detected"]
    runs = meta.get("runs", [])
    fit_ci = fit_interval(overhead) if overhead else None
    changes, sources, user_ci = _overhead_inputs(meta, cluster, overhead_file)
    spec = cluster_of(meta, changes)
    used = overheads_used(overhead, dict(spec.overhead), sources, user_ci,
                          round_draws(rounds_of(overhead)))
    summary: dict[str, Any] = {
        "campaign": meta.get("name"), "quick": meta.get("quick"),
        "trials": len(faults), "clean_trials": len(clean), "false_positives": fp,
        "planned": len(planned) or None,
        "stale_rows": stale,
        "clean_not_bit_identical": int(clean["outcome"].isin(("escaped", "crashed",
                                                              "hung")).sum()),
        "outcomes": {o: int((faults["outcome"] == o).sum()) for o in OUTCOMES},
        "all": _group(faults),
        "sites": _groups(faults, "site", sites),
        "fields": _groups(faults, "field", fields),
        "fault_models": _groups(faults, "fault_model", sorted(set(faults["fault_model"]))),
        "patterns": _groups(faults, "pattern", [p for p in PATTERNS if p in set(faults["pattern"])]),
        "pattern_cells": pattern_cells(faults),
        "pattern_checks": pattern_checks(faults),
        "scenarios": _groups(faults, "scenario", sorted(set(faults["scenario"]))),
        "replay_intervals": _groups(faults, "replay_interval", intervals),
        "by_site_field": by_site_field,
        "parallels": _groups(faults, "parallel", parallels),
        "by_site_parallel": by_site_parallel,
        "clean_by_parallel": {x: {"trials": int((clean["parallel"] == x).sum()),
                                  "false_positives": int(((clean["parallel"] == x)
                                                          & (clean["outcome"] == "detected"))
                                                         .sum())}
                              for x in parallels if (clean["parallel"] == x).any()},
        "first_check": {str(k): int(v) for k, v in det["check"].value_counts().items()},
        "latency_histogram": _histogram(faults, sites),
        "latency": latency_distribution(faults, sites),
        "overhead": overhead,
        "overhead_fit_ci90": fit_ci,
        "cost": {**cost_model(faults, overhead, fit_ci, spec,
                              GuardConfig().nonfinite_exchange_interval),
                 "cluster_sources": _cluster_sources(meta, cluster),
                 "overheads_used": used,
                 "overhead_warnings": noise_warnings(used, overhead, budget)},
        "lost": _lost(lost),
        "field_coverage": field_coverage(faults, spec, sites),
        "overhead_budget": budget,
        "recommended_replay_interval": recommend(overhead, budget),
        "recommendation_agreement": recommendation_agreement(overhead, budget),
        "recommendation_rule": (
            "smallest replay interval >= 1 whose replay-audit overhead vs plain DDP, "
            "fitted as fixed + per_audit / k over every round and interval "
            "(overhead.replay_fit), is within overhead_budget"
            if overhead and overhead.get("replay_fit") else
            "smallest replay interval >= 1 whose replay-audit overhead "
            "(overhead.replay.<k>, vs plain DDP) is within overhead_budget"),
        "targets": _targets(faults, fp),
        "quarantine": _quarantine(faults, clean),
        "checksum": checksum_summary(df),
        "determinism": determinism_summary(df),
        "recovery": _recovery(faults),
        "site_order": list(SITES), "field_order": fields,
        "campaign_seconds": sum(r.get("seconds", 0.0) for r in runs) or meta.get("seconds"),
        "trials_per_minute": meta.get("trials_per_minute"),
        "pool_restarts": meta.get("pool_restarts"),
        "goldens": meta.get("goldens"),
    }
    return summary


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
