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


def answer_lines(s: dict[str, Any]) -> list[str]:
    """The answer in a few sentences (Markdown emphasis with ``**``)."""
    cost = s.get("cost") or {}
    rec = cost.get("recommendation")
    cl = cost.get("cluster") or {}
    out = []
    if rec:
        out.append(
            f"Recommended configuration: **{rec['name']}** (checks: "
            f"{', '.join(rec['checks'])}), expected loss **{_gh(rec['gpu_hours_per_day'])} "
            f"GPU-hours per day** (band {_gh(rec['band'][0])} to {_gh(rec['band'][1])}) on "
            f"{cl.get('gpus', 0):,} GPUs at {cl.get('sdc_per_gpu_hour', 0):.2g} SDC per "
            f"GPU-hour ({cost.get('sdc_per_day', 0):.2g} per day), the least of "
            f"{len(cost.get('configurations') or [])} measured configurations.")
        near = rec.get("within_uncertainty") or []
        out.append("Within its uncertainty: " + (", ".join(near) if near else "none") + ".")
        sens = cost.get("sensitivity") or {}
        moves = [f"{k.replace('x', '')}x the SDC rate: {v['name']}" for k, v in sens.items() if v]
        if moves:
            out.append("Sensitivity: " + "; ".join(moves) + ".")
    else:
        out.append("No configuration could be priced (no fault trials or no overhead "
                   "measurement).")
    budget = s.get("recommended_replay_interval")
    out.append(f"Budget rule (second line): smallest replay interval within "
               f"{_pct(s.get('overhead_budget'))} overhead: "
               f"**{budget if budget is not None else 'none fits'}**.")
    out.append(f"**{s['false_positives']} false positives** in {s['clean_trials']} clean "
               "trials.")
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
    rows = [[k, str(v)] for k, v in cl.items() if k not in ("field_mix", "site_mix",
                                                            "overhead")]
    rows.append(["escape cost used (GPU-hours)", _gh(cost["escape_gpu_hours"])])
    rows.append(["non-finite exchange interval (steps)", str(cost["nonfinite_exchange_interval"])])
    rows.append(["per-check overheads from your hardware",
                 ", ".join(f"{k} {_pct(v)}" for k, v in cl["overhead"].items()) or
                 "none (the campaign's)"])
    rows.append(["fault mix over bit fields", ", ".join(f"{k} {v:g}" for k, v in
                                                       cl["field_mix"].items()) or "-"])
    rows.append(["fault mix over sites", ", ".join(f"{k} {v:g}" for k, v in
                                                  cl["site_mix"].items()) or "every site alike"])
    return ("Cluster the cost model prices on ([cluster], defaults and sources in "
            "docs/cost-model.md)", ["parameter", "value"], rows)


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
