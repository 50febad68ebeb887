"""A campaign's numbers (``summary.json``): coverage, latency, overhead, the recommendation.

Everything is computed from the output directory alone (``trials.csv``,
``overhead.json``, ``campaign.json``), so ``python -m scenarios report DIR``
can rebuild it at any time, also from a partial (killed) campaign.

Coverage of a group of fault trials = detected / (trials - masked): a masked
fault left the run bit-identical to golden, so there was nothing to detect.
Its 95% interval is Wilson's score interval. Escape rate = escaped / (trials -
masked).

Recommended replay interval: the *smallest* measured interval k >= 1 whose
replay-audit overhead (the guard with only the replay audit, every k steps,
against plain DDP) fits ``overhead_budget``. The overhead used is the fit
``fixed + per_audit / k`` (``overhead.replay_fit``: least squares over every
round's paired measurement at every interval, the per-step cost of deterministic
mode plus one audit's cost spread over k steps), not each interval's own median:
the fit pools every measurement, so an interval near the budget does not flip
the recommendation from run to run on one noisy median, and the recommendation
is monotone in the budget. ``recommendation_agreement`` is the share of 1000
bootstrap resamples of the rounds that recommend the same interval (1.0: the
data settle it; near 0.5: the budget sits on an interval's cost). Without
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
import math
import random
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from injectors import SITES
from scenarios.run.store import TrialTable
from scenarios.spec.faults import FIELDS
from scenarios.spec.overhead import PLAIN_DDP, replay_only

OUTCOMES = ("detected", "masked", "escaped", "crashed", "hung")
STATE_SITES = ("weight_storage", "optimizer_state", "gradient_after_allreduce")


def wilson(k: int, n: int, z: float = 1.96) -> list[float] | None:
    """Wilson score interval of a proportion k/n."""
    if n <= 0:
        return None
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return [max(0.0, mid - half), min(1.0, mid + half)]


def _int(v: str) -> int | None:
    return int(v) if v not in ("", None) else None


def _float(v: str) -> float | None:
    return float(v) if v not in ("", None) else None


def _bool(v: str) -> bool | None:
    return {"true": True, "false": False}.get(v)


def _group(rows: list[dict[str, str]]) -> dict[str, Any]:
    c = Counter(r["outcome"] for r in rows)
    n = len(rows)
    relevant = n - c["masked"]
    det = [r for r in rows if r["outcome"] == "detected"]
    lat = [x for x in (_int(r["latency_from_injection"]) for r in det) if x is not None]
    lat_div = [x for x in (_int(r["latency_from_divergence"]) for r in det) if x is not None]
    blame = [r for r in det if _bool(r["blame_correct"])]
    return {
        "trials": n, **{o: c[o] for o in OUTCOMES},
        "coverage": len(det) / relevant if relevant else None,
        "coverage_ci95": wilson(len(det), relevant),
        "escape_rate": c["escaped"] / relevant if relevant else None,
        "latency_steps_p50": statistics.median(lat) if lat else None,
        "latency_steps_max": max(lat) if lat else None,
        "latency_from_divergence_p50": statistics.median(lat_div) if lat_div else None,
        "latency_from_divergence_max": max(lat_div) if lat_div else None,
        "blame_correct": len(blame) / len(det) if det else None,
        "blame_correct_count": len(blame),
        "contained": sum(1 for r in det if _bool(r["contained"])),
        "not_fired": sum(1 for r in rows if r["kind"] == "fault" and r["injections"] == "0"),
    }


def fit_replay_overhead(samples: dict[str, list[float]],
                        intervals: list[int]) -> dict[str, Any] | None:
    """Least-squares fit of ``overhead(k) = fixed + per_audit / k`` (fractions of plain DDP).

    ``samples``: per-round block times of plain DDP and of the replay audit alone every k
    steps (``scenarios.spec.overhead``: "plain DDP", "replay@<k>"), in the same round order
    (configurations alternate within a round, so round r's pair shares the machine's
    state). None with fewer than two distinct intervals.
    """
    base = samples.get(PLAIN_DDP.name) or []
    xs: list[float] = []
    ys: list[float] = []
    for k in intervals:
        for b, t in zip(base, samples.get(replay_only(k).name) or [], strict=False):
            if b > 0:
                xs.append(1.0 / k)
                ys.append(t / b - 1.0)
    if len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    per_audit = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    fixed = my - per_audit * mx
    return {"fixed": fixed, "per_audit": per_audit, "points": len(xs),
            "predicted": {str(k): fixed + per_audit / k for k in intervals}}


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
    samples: dict[str, list[float]] = overhead["samples_ms"]
    intervals = [int(k) for k in overhead["replay_fit"]["predicted"]]
    rounds = min(len(v) for v in samples.values())
    want = recommend(overhead, budget)
    rng = random.Random(0)
    same = 0
    for _ in range(n):
        pick = [rng.randrange(rounds) for _ in range(rounds)]
        fit = fit_replay_overhead({k: [v[i] for i in pick] for k, v in samples.items()},
                                  intervals)
        got = _smallest_within(fit["predicted"], budget) if fit else None
        same += got == want
    return same / n


def _prompt(r: dict[str, str]) -> bool:
    """Detected within 1 step of the first step at which the fault changed the state (its
    first divergence); a contained detection (nothing changed) in a step in which it fired."""
    div = _int(r["latency_from_divergence"])
    if div is not None:
        return div <= 1
    return bool(_bool(r.get("same_step", ""))) or (_int(r["latency_from_injection"]) or 0) <= 1


def _targets(faults: list[dict[str, str]], clean_fp: int) -> dict[str, Any]:
    state = [r for r in faults if r["site"] in STATE_SITES and r["outcome"] != "masked"]
    detected = [r for r in state if r["outcome"] == "detected" and _bool(r["blame_correct"])]
    ok = [r for r in detected if _prompt(r)]
    strict = [r for r in detected if (_int(r["latency_from_injection"]) or 0) <= 1]
    nonfinite = [r for r in faults if _bool(r["nonfinite_injected"])]
    nf_relevant = [r for r in nonfinite if r["outcome"] != "masked"]
    nf_ok = [r for r in nf_relevant if r["outcome"] == "detected"
             and _bool(r.get("same_step", ""))]
    return {
        "zero_false_positives": {"met": clean_fp == 0, "false_positives": clean_fp},
        "state_sites_detected_within_1_step_blame_correct": {
            "met": len(ok) == len(state), "trials_that_changed_the_trajectory": len(state),
            "met_by": len(ok), "misses": [r["id"] for r in state if r not in ok][:50],
            "rule": "detected with the right rank blamed, at most 1 step after the first step "
                    "at which the fault changed the state (or, contained, in a step in which "
                    "it fired)",
            "within_1_step_of_first_injection": len(strict),
        },
        "nonfinite_detected_in_own_step": {
            "met": len(nf_ok) == len(nf_relevant), "nonfinite_faults": len(nonfinite),
            "masked": len(nonfinite) - len(nf_relevant), "relevant": len(nf_relevant),
            "met_by": len(nf_ok), "misses": [r["id"] for r in nf_relevant if r not in nf_ok][:50],
        },
    }


def _quarantine(faults: list[dict[str, str]], clean: list[dict[str, str]]) -> dict[str, Any] | None:
    """Cordons per site (scenarios with ``[quarantine]``; None when no trial had one)."""
    ran = [r for r in (*faults, *clean) if r.get("cordon_correct", "") != ""]
    if not ran:
        return None

    def group(rows: list[dict[str, str]]) -> dict[str, Any]:
        det = [r for r in rows if r["outcome"] == "detected"]
        cordoned = [r for r in rows if json.loads(r["cordoned_nodes"] or "[]")]
        secs = [float(r["fault_to_cordon_s"]) for r in rows if r["fault_to_cordon_s"] != ""]
        return {
            "trials": len(rows), "detected": len(det), "cordoned": len(cordoned),
            "cordoned_right_nodes": sum(1 for r in cordoned if _bool(r["cordon_correct"])),
            "breaker_tripped": sum(1 for r in rows if _bool(r["breaker_tripped"])),
            "api_errors": sum(int(r["quarantine_errors"] or 0) for r in rows),
            "fault_to_cordon_s_p50": statistics.median(secs) if secs else None,
            "fault_to_cordon_s_max": max(secs) if secs else None,
        }

    qf = [r for r in faults if r.get("cordon_correct", "") != ""]
    qc = [r for r in clean if r.get("cordon_correct", "") != ""]
    return {"sites": {s: group([r for r in qf if r["site"] == s])
                      for s in SITES if any(r["site"] == s for r in qf)},
            "all": group(qf), "clean": group(qc)}


def _recovery(faults: list[dict[str, str]]) -> dict[str, Any] | None:
    """What was detected, cordoned, rolled back or repaired, and whether the run ended
    bit-identical to golden: the record of the one fault trial, or counts per site."""
    ran = [r for r in faults if r.get("final_matches_golden", "") != ""]
    if not ran:
        return None

    def one(r: dict[str, str]) -> dict[str, Any]:
        suspects = json.loads(r["suspects"] or "[]")
        return {
            "site": r["site"], "fault_rank": _int(r["fault_rank"]),
            "detected_step": _int(r["detect_step"]), "check": r["check"] or None,
            "suspect_nodes": [f"node-{x}" for x in suspects],
            "cordoned_nodes": json.loads(r.get("cordoned_nodes") or "[]"),
            "first_detection_repaired": _bool(r.get("repaired", "")) or False,
            "repaired": bool(_bool(r.get("repaired", ""))) and _int(r["rollback_step"]) is None,
            "rolled_back": _int(r["rollback_step"]) is not None,
            "rollback_step": _int(r["rollback_step"]),
            "wasted_steps": _int(r["wasted_steps"]),
            "fault_to_resume_s": _float(r["fault_to_resume_s"]),
            "final_matches_golden": _bool(r["final_matches_golden"]),
        }

    if len(ran) == 1:
        return one(ran[0])

    def group(rows: list[dict[str, str]]) -> dict[str, Any]:
        xs = [one(r) for r in rows]
        wasted = [x["wasted_steps"] for x in xs if x["rolled_back"]]
        secs = [x["fault_to_resume_s"] for x in xs if x["fault_to_resume_s"] is not None]
        return {"trials": len(xs),
                "detected": sum(1 for x in xs if x["detected_step"] is not None),
                "final_matches_golden": sum(1 for x in xs if x["final_matches_golden"]),
                "repaired": sum(1 for x in xs if x["repaired"]),
                "rolled_back": sum(1 for x in xs if x["rolled_back"]),
                "wasted_steps_p50": statistics.median(wasted) if wasted else None,
                "wasted_steps_max": max(wasted) if wasted else None,
                "fault_to_resume_s_p50": statistics.median(secs) if secs else None}

    return {"sites": {site: group([r for r in ran if r["site"] == site])
                      for site in SITES if any(r["site"] == site for r in ran)},
            "all": group(ran)}


def summarize(out: Path) -> dict[str, Any]:
    rows = TrialTable(out / "trials.csv").rows()
    meta = _load(out / "campaign.json") or {}
    planned = set(meta.get("planned_ids") or [])
    stale = [r for r in rows if planned and r["id"] not in planned]
    rows = [r for r in rows if not planned or r["id"] in planned]
    overhead = _load(out / "overhead.json")
    budget = float(meta.get("overhead_budget", 0.25))
    faults = [r for r in rows if r["kind"] == "fault"]
    clean = [r for r in rows if r["kind"] == "clean"]
    fp = sum(1 for r in clean if r["outcome"] == "detected")
    sites = [s for s in SITES if any(r["site"] == s for r in faults)]
    fields = [f for f in (*FIELDS, "custom", "set", "random", "zero")
              if any(r["field"] == f for r in faults)]
    by_site_field: dict[str, dict[str, Any]] = defaultdict(dict)
    for s in sites:
        for f in fields:
            grp = [r for r in faults if r["site"] == s and r["field"] == f]
            if grp:
                by_site_field[s][f] = _group(grp)
    hist: dict[str, dict[str, dict[str, int]]] = {"from_injection": {}, "from_divergence": {}}
    for s in sites:
        det = [r for r in faults if r["site"] == s and r["outcome"] == "detected"]
        for key, col in (("from_injection", "latency_from_injection"),
                         ("from_divergence", "latency_from_divergence")):
            c = Counter(str(_int(r[col])) for r in det if r[col] != "")
            if c:
                hist[key][s] = dict(c)
    intervals = sorted({int(r["replay_interval"]) for r in faults})
    runs = meta.get("runs", [])
    summary: dict[str, Any] = {
        "campaign": meta.get("name"), "quick": meta.get("quick"),
        "trials": len(faults), "clean_trials": len(clean), "false_positives": fp,
        "planned": len(planned) or None,
        "stale_rows": len(stale),
        "clean_not_bit_identical": sum(1 for r in clean if r["outcome"] in ("escaped",
                                                                             "crashed", "hung")),
        "outcomes": {o: sum(1 for r in faults if r["outcome"] == o) for o in OUTCOMES},
        "all": _group(faults),
        "sites": {s: _group([r for r in faults if r["site"] == s]) for s in sites},
        "fields": {f: _group([r for r in faults if r["field"] == f]) for f in fields},
        "fault_models": {m: _group([r for r in faults if r["fault_model"] == m])
                         for m in sorted({r["fault_model"] for r in faults})},
        "scenarios": {sc: _group([r for r in faults if r["scenario"] == sc])
                      for sc in sorted({r["scenario"] for r in faults})},
        "replay_intervals": {str(k): _group([r for r in faults if int(r["replay_interval"]) == k])
                             for k in intervals},
        "by_site_field": dict(by_site_field),
        "first_check": dict(Counter(r["check"] for r in faults if r["outcome"] == "detected")),
        "latency_histogram": hist,
        "overhead": overhead,
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
