"""What a report says first: the recommended configuration, its expected daily loss,
coverage per site and false positives; and the cost-model and latency tables of the evidence.

Each function returns plain text lines or ``(title, header, rows)`` tables that
``scenarios.report.render`` writes as Markdown and HTML.
"""

from __future__ import annotations

from typing import Any

Table = tuple[str, list[str], list[list[str]]]


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ci(v: Any) -> str:
    return "-" if not v else f"[{100 * v[0]:.0f}, {100 * v[1]:.0f}]%"


def _gh(v: Any) -> str:
    """GPU-hours, to 3 significant digits."""
    return "-" if v is None else f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _where(cost: dict[str, Any]) -> str:
    cl = cost.get("cluster") or {}
    src = cost.get("cluster_sources") or {}
    example = [k for k in ("gpus", "step_time_s", "sdc_per_gpu_hour")
               if src.get(k, "example default") == "example default"]
    what = (f"{cl.get('gpus', 0):,} GPUs, {cl.get('step_time_s', 0):g} s steps, "
            f"{cl.get('sdc_per_gpu_hour', 0):.2g} SDC per GPU-hour")
    if example:
        return (f"on the example cluster ({what}; {', '.join(example)}: the defaults, an "
                "example; set [cluster] or --gpus, --step-time-s, --sdc-per-gpu-hour for yours)")
    return f"on your cluster ({what})"


def _overheads_line(cost: dict[str, Any]) -> str:
    used = cost.get("overheads_used") or {}
    if not used:
        return ""
    parts = []
    for key, e in used.items():
        ci = e["interval_90"]
        parts.append(f"{key} {100 * e['value']:+.1f}%" + (
            f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]%" if ci else " (no interval)"))
    sources = sorted({e["source"] for e in used.values()})
    return ("Overheads priced (fractions of plain DDP's step, 90% intervals): "
            + ", ".join(parts) + "; from " + "; ".join(sources) + ".")


def answer_lines(s: dict[str, Any]) -> list[str]:
    """The answer in a few sentences (Markdown emphasis with ``**``): one recommended
    configuration, how sure it is, what it was priced with, and the warnings."""
    cost = s.get("cost") or {}
    rec = cost.get("recommendation")
    out = []
    if rec:
        out.append(
            f"Recommended configuration: **{rec['name']}** (checks: "
            f"{', '.join(rec['checks'])}; step overhead {_pct(rec.get('overhead'))}), "
            f"expected loss **{_gh(rec['gpu_hours_per_day'])} GPU-hours per day** (band "
            f"{_gh(rec['band'][0])} to {_gh(rec['band'][1])}) {_where(cost)}.")
        n = rec.get("resamples")
        split = rec.get("split") or {}
        if rec.get("settled"):
            out.append(f"How sure: **settled** by the data: the least expected loss in "
                       f"{rec['agreement']:.0%} of {n} bootstrap resamples (seed "
                       f"{rec['seed']}) of the trials and the overhead rounds; a rerun of "
                       "the campaign is expected to recommend the same.")
        elif n:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in list(split.items())[:4])
            out.append(
                f"How sure: **not settled**: the {n} bootstrap resamples (seed {rec['seed']}) "
                f"split ({shares}); the data cannot tell apart "
                f"{', '.join(rec['indistinguishable'])}, and a rerun may recommend another "
                "of them. Tie rule: the cheapest of them (the fewest check runs per step).")
        if rec.get("least_expected_loss") not in (None, rec["name"]):
            out.append(f"The least expected loss at the point estimates is "
                       f"{rec['least_expected_loss']}, within the uncertainty above.")
        budget = s.get("overhead_budget")
        if budget is not None and rec.get("overhead") is not None and rec["overhead"] > budget:
            out.append(f"Its step overhead, {_pct(rec['overhead'])}, is above the campaign's "
                       f"{_pct(budget)} overhead budget on the machine that measured it.")
        sens = cost.get("sensitivity") or {}
        moves = [f"{k.replace('x', '')}x the SDC rate: {v['name']}" for k, v in sens.items() if v]
        if moves:
            out.append("Sensitivity: " + "; ".join(moves) + ".")
        line = _overheads_line(cost)
        if line:
            out.append(line)
    else:
        out.append("No configuration could be priced (no fault trials or no overhead "
                   "measurement).")
    out += [f"Warning: {w}." for w in cost.get("overhead_warnings") or []]
    out.append(f"**{s['false_positives']} false positives** in {s['clean_trials']} clean "
               "trials.")
    lost = (s.get("lost") or {}).get("trials")
    if lost:
        out.append(f"{lost} trial{'s' if lost != 1 else ''} lost twice to a kill from "
                   "outside: listed under \"Lost trials\", in no other number.")
    return out


def coverage_table(s: dict[str, Any]) -> Table:
    """Coverage per site: in the field (weighted by the fault mix) and as sampled."""
    fc = s.get("field_coverage") or {}
    rows = []
    for name, g in [*(fc.get("sites") or {}).items(), ("all", fc.get("all"))]:
        if not g:
            continue
        raw = s["sites"].get(name, s["all"]) if name != "all" else s["all"]
        rows.append([name, _pct(g["weighted"]), _ci(g["weighted_ci95"]), _pct(raw["coverage"]),
                     _ci(raw["coverage_ci95"]), str(raw["trials"] - raw["masked"])])
    return ("Coverage per site: expected in the field (weighted by the fault mix) and as "
            "sampled", ["site", "in the field", "95% CI", "sampled (raw)", "95% CI",
                        "trials not masked"], rows)


def cost_table(s: dict[str, Any]) -> Table | None:
    cost = s.get("cost") or {}
    rows = cost.get("configurations") or []
    if not rows:
        return None
    parts = cost["parts"]
    best = (cost.get("recommendation") or {}).get("name")
    body = []
    for r in sorted(rows, key=lambda r: (r["replay_interval"], -len(r["checks"]))):
        o = r["outcomes"]
        body.append([r["name"] + (" (recommended)" if r["name"] == best else ""),
                     _pct(r["overhead"]), _pct(o["detected"]),
                     f"{_pct(o['escaped'])} {_ci(o['escaped_ci95'])}",
                     *(_gh(r["parts"][p]) for p in parts), _gh(r["total"]),
                     f"{_gh(r['total_low'])} to {_gh(r['total_high'])}"])
    return ("Cost model: expected GPU-hours lost per day (docs/cost-model.md)",
            ["configuration", "step overhead", "detected", "escaped [95% CI]",
             *(p.replace("_", " ") for p in parts), "total", "band"], body)


def cluster_table(s: dict[str, Any]) -> Table | None:
    cost = s.get("cost") or {}
    cl = cost.get("cluster")
    if not cl:
        return None
    src = cost.get("cluster_sources") or {}
    rows = [[k, f"{v} ({src[k]})" if k in src else str(v)]
            for k, v in cl.items() if k not in ("field_mix", "site_mix", "overhead")]
    rows.append(["escape cost used (GPU-hours)", _gh(cost["escape_gpu_hours"])])
    rows.append(["non-finite exchange interval (steps)", str(cost["nonfinite_exchange_interval"])])
    for key, e in (cost.get("overheads_used") or {}).items():
        ci = e["interval_90"]
        rows.append([f"overhead: {key}", f"{100 * e['value']:+.2f}%"
                     + (f" (90%: {100 * ci[0]:+.2f} to {100 * ci[1]:+.2f}%)" if ci else
                        " (no interval)") + f"; {e['source']}"])
    rows.append(["fault mix over bit fields", ", ".join(f"{k} {v:g}" for k, v in
                                                       cl["field_mix"].items()) or "-"])
    rows.append(["fault mix over sites", ", ".join(f"{k} {v:g}" for k, v in
                                                  cl["site_mix"].items()) or "every site alike"])
    return ("Cluster the cost model prices on ([cluster], defaults and sources in "
            "docs/cost-model.md)", ["parameter", "value"], rows)


def lost_table(s: dict[str, Any]) -> Table | None:
    """Trials lost twice to a kill from outside (counted in no other table)."""
    lost = s.get("lost") or {}
    if not lost.get("trials"):
        return None
    cols = ["id", "kind", "scenario", "site", "field", "replay_interval", "error"]
    return ("Lost trials: killed from outside twice, left out of every other number",
            cols, [["-" if r.get(c) in (None, "") else str(r[c]) for c in cols]
                   for r in lost["rows"]])


def latency_table(s: dict[str, Any]) -> Table | None:
    lat = (s.get("latency") or {}).get("from_injection")
    if not lat or not lat.get("all"):
        return None
    ps = s["latency"]["percentiles"]

    def row(name: str, d: dict[str, Any]) -> list[str]:
        return [name, str(d["n"]), f"{d['mean']:.2f}", *(f"{d[f'p{p}']:g}" for p in ps),
                f"{d['max']:g}"]

    rows = [row(f"check {c}", d) for c, d in lat["checks"].items()]
    rows += [row(f"site {k}", d) for k, d in lat["sites"].items()]
    rows.append(row("all", lat["all"]))
    delay = s["latency"].get("nonfinite_report_delay")
    if delay:
        rows.append([f"non-finite report delay (exchange every {delay['exchange_interval']})",
                     "-", f"{delay['steps_mean']:.2f}", "-", "-", "-",
                     str(delay["steps_max"])])
    return ("Detection latency from the injection (steps)",
            ["group", "detected", "mean", *(f"p{p}" for p in ps), "max"], rows)
