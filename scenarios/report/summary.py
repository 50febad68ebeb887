"""A campaign's report: ``summary.json``, ``report.md``, a self-contained ``report.html``, PNGs.

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

import base64
import html
import json
import math
import random
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from injectors import SITES
from scenarios.spec import FIELDS
from scenarios.store import TrialTable, write_json

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

    ``samples``: per-round block times of "plain DDP" and of "replay@<k>" for each k,
    in the same round order (configurations alternate within a round, so round r's
    pair shares the machine's state). None with fewer than two distinct intervals.
    """
    base = samples.get("plain DDP") or []
    xs: list[float] = []
    ys: list[float] = []
    for k in intervals:
        for b, t in zip(base, samples.get(f"replay@{k}") or [], strict=False):
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


# -- rendering --------------------------------------------------------------------------------
def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ci(v: Any) -> str:
    return "-" if not v else f"[{100 * v[0]:.0f}, {100 * v[1]:.0f}]%"


def _num(v: Any) -> str:
    return "-" if v is None else (f"{v:g}" if isinstance(v, (int, float)) else str(v))


def _tables(s: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    head = ["trials", "detected", "masked", "escaped", "crashed", "hung", "coverage", "95% CI",
            "latency p50", "latency max", "blame correct", "contained"]

    def row(name: str, g: dict[str, Any]) -> list[str]:
        return [name, str(g["trials"]), *(str(g[o]) for o in OUTCOMES), _pct(g["coverage"]),
                _ci(g["coverage_ci95"]), _num(g["latency_steps_p50"]),
                _num(g["latency_steps_max"]), _pct(g["blame_correct"]), str(g["contained"])]

    out = [("Coverage by site", ["site", *head],
            [row(k, g) for k, g in s["sites"].items()] + [row("all", s["all"])]),
           ("Coverage by bit field", ["field", *head],
            [row(k, g) for k, g in s["fields"].items()]),
           ("Coverage by fault model", ["model", *head],
            [row(k, g) for k, g in s["fault_models"].items()]),
           ("Coverage by scenario", ["scenario", *head],
            [row(k, g) for k, g in s["scenarios"].items()]),
           ("Escape rate by replay interval", ["interval", "trials", "masked", "escaped",
                                                "escape rate", "coverage"],
            [[("off" if k == "0" else k), str(g["trials"]), str(g["masked"]), str(g["escaped"]),
              _pct(g["escape_rate"]), _pct(g["coverage"])]
             for k, g in s["replay_intervals"].items()])]
    ov = s.get("overhead")
    if ov:
        rows = [["plain DDP step (ms)", f"{ov['baseline_step_ms']:.2f}"],
                ["guard, checks off", _pct(ov["guard_checks_off"])],
                ["nonfinite", _pct(ov["nonfinite"])], ["weights", _pct(ov["weights"])]]
        fit = (ov.get("replay_fit") or {}).get("predicted", {})
        rows += [[f"replay every {k}", _pct(v) + (f" (fit: {_pct(fit[k])})" if k in fit else "")]
                 for k, v in ov["replay"].items()]
        if ov.get("replay_fit"):
            f = ov["replay_fit"]
            rows.append(["replay fit: fixed + per audit / k",
                         f"{_pct(f['fixed'])} + {_pct(f['per_audit'])} / k"])
        rows += [[f"all checks, replay {'off' if k == '0' else 'every ' + k}", _pct(v)]
                 for k, v in ov["total"].items()]
        out.append((f"Step-time overhead vs plain DDP ({ov['scenario']}, {ov['world_size']} "
                    f"ranks, medians of {ov['rounds']} alternated blocks of {ov['block']} "
                    "steps)", ["configuration", "overhead"], rows))
    t = s["targets"]
    st = t["state_sites_detected_within_1_step_blame_correct"]
    nf = t["nonfinite_detected_in_own_step"]
    out.append(("Targets", ["target", "met", "numbers"], [
        ["0 false positives", str(t["zero_false_positives"]["met"]),
         f"{s['false_positives']} of {s['clean_trials']} clean trials"],
        ["weight/optimizer-state/reduced-gradient faults that changed the trajectory: "
         "detected within 1 step, right rank", str(st["met"]),
         f"{st['met_by']} of {st['trials_that_changed_the_trajectory']}"],
        ["non-finite faults detected in their own step", str(nf["met"]),
         f"{nf['met_by']} of {nf['relevant']} ({nf['masked']} masked)"],
    ]))
    return out


def _headline(s: dict[str, Any]) -> list[str]:
    rec = s["recommended_replay_interval"]
    secs = s.get("campaign_seconds")
    return [
        f"{s['trials']} fault trials, {s['clean_trials']} clean trials, "
        f"**{s['false_positives']} false positives**.",
        "Outcomes: " + ", ".join(f"{k} {v}" for k, v in s["outcomes"].items()) + ".",
        f"Overall coverage {_pct(s['all']['coverage'])} {_ci(s['all']['coverage_ci95'])}.",
        f"Recommended replay interval for an overhead budget of {_pct(s['overhead_budget'])}: "
        f"**{rec if rec is not None else 'none fits'}** ({s['recommendation_rule']})"
        + (f"; {s['recommendation_agreement']:.0%} of bootstrap resamples of the overhead "
           "rounds agree." if s.get("recommendation_agreement") is not None else "."),
        f"Campaign time: {secs:.0f} s" + (f", {s['trials_per_minute']:.0f} trials/min."
                                         if s.get("trials_per_minute") else ".")
        if secs else "",
    ]


def render_markdown(s: dict[str, Any], plots: list[Path]) -> str:
    lines = [f"# Fault-injection campaign `{s['campaign']}`" + (" (quick)" if s["quick"] else ""),
             "", *[x for x in _headline(s) if x], ""]
    for title, head, rows in _tables(s):
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["Definitions: see reports/README.md and scenarios/outcome.py.", ""]
    return "\n".join(lines)


def render_html(s: dict[str, Any], plots: list[Path]) -> str:
    def esc(x: str) -> str:
        return html.escape(x).replace("**", "")

    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>Campaign {esc(str(s['campaign']))}</title><style>",
             "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}",
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;",
             "padding:3px 8px;text-align:right}th{background:#eee}td:first-child{text-align:left}",
             "img{max-width:100%}</style></head><body>",
             f"<h1>Fault-injection campaign <code>{esc(str(s['campaign']))}</code></h1>"]
    parts += [f"<p>{esc(x)}</p>" for x in _headline(s) if x]
    for title, head, rows in _tables(s):
        parts.append(f"<h2>{esc(title)}</h2><table><tr>"
                     + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows]
        parts.append("</table>")
    parts.append("<h2>Plots</h2>")
    for p in plots:
        data = base64.b64encode(p.read_bytes()).decode()
        parts.append(f"<p><img alt='{esc(p.stem)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out: str | Path) -> dict[str, Any]:
    """Write summary.json, report.md, report.html and the PNG plots into ``out``."""
    from scenarios.plots import draw_all

    out = Path(out)
    summary = summarize(out)
    write_json(out / "summary.json", summary)
    plots = draw_all(summary, out)
    (out / "report.md").write_text(render_markdown(summary, plots))
    (out / "report.html").write_text(render_html(summary, plots))
    return summary
