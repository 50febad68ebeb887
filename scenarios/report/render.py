"""A campaign's report: ``summary.json``, ``report.md``, a self-contained ``report.html``, PNGs.

Everything is computed from the output directory alone (``scenarios.report.summary``),
so ``python -m scenarios report DIR`` can rebuild it at any time, also from a
partial (killed) campaign.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from scenarios.report.answer import (
    answer_lines,
    cluster_table,
    cost_table,
    coverage_table,
    latency_table,
    lost_table,
)
from scenarios.report.overheads import interval, ratio_draws, round_draws, rounds_of
from scenarios.report.summary import OUTCOMES, summarize
from scenarios.run.store import write_json
from scenarios.spec.overhead import HEADLINE, all_checks


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ci(v: Any) -> str:
    return "-" if not v else f"[{100 * v[0]:.0f}, {100 * v[1]:.0f}]%"


def _ci90(v: Any) -> str:
    return f"{100 * v[0]:+.1f}% to {100 * v[1]:+.1f}%"


def _num(v: Any) -> str:
    return "-" if v is None else (f"{v:g}" if isinstance(v, (int, float)) else str(v))


def _by_interval(d: dict[str, Any]) -> list[tuple[str, Any]]:
    """A mapping keyed by replay interval (``"0"``, ``"1"``, ``"16"``...) in numeric order."""
    return sorted(d.items(), key=lambda kv: int(kv[0]))


def _tables(s: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    head = ["trials", "detected", "masked", "escaped", "crashed", "hung", "coverage", "95% CI",
            "latency p50", "latency max", "blame correct", "contained"]

    def row(name: str, g: dict[str, Any]) -> list[str]:
        return [name, str(g["trials"]), *(str(g[o]) for o in OUTCOMES), _pct(g["coverage"]),
                _ci(g["coverage_ci95"]), _num(g["latency_steps_p50"]),
                _num(g["latency_steps_max"]), _pct(g["blame_correct"]), str(g["contained"])]

    out = [("Coverage by site", ["site", *head],
            [row(k, g) for k, g in s["sites"].items()] + [row("all", s["all"])]),
           ("Coverage by parallelism", ["parallel", *head],
            [row(k, g) for k, g in s.get("parallels", {}).items()]),
           *([("Coverage by site and parallelism", ["site", "parallel", *head],
               [[site, *row(par, g)] for site, by in s["by_site_parallel"].items()
                for par, g in by.items()])] if len(s.get("parallels", {})) > 1 else []),
           ("Coverage by bit field", ["field", *head],
            [row(k, g) for k, g in s["fields"].items()]),
           ("Coverage by fault model", ["model", *head],
            [row(k, g) for k, g in s["fault_models"].items()]),
           *([("Coverage by fault pattern", ["pattern", *head],
               [row(k, g) for k, g in s["patterns"].items()]),
              ("Fault patterns by site and dtype, highest escape rate first (cells with "
               "fewer than 100 not-masked trials last, unranked)",
               ["pattern", "site", "dtype", "not masked", "escaped", "escape rate", "95% CI",
                "coverage", "95% CI", "ranked"],
               [[c["pattern"], c["site"], c["dtype"], str(c["not_masked"]), str(c["escaped"]),
                 _pct(c["escape_rate"]), _ci(c["escape_rate_ci95"]), _pct(c["coverage"]),
                 _ci(c["coverage_ci95"]), "yes" if c["ranked"] else "no"]
                for c in s["pattern_cells"]])]
             if s.get("pattern_cells") else []),
           ("Coverage by scenario", ["scenario", *head],
            [row(k, g) for k, g in s["scenarios"].items()]),
           ("Escape rate by replay interval", ["interval", "trials", "masked", "escaped",
                                                "escape rate", "coverage"],
            [[("off" if k == "0" else k), str(g["trials"]), str(g["masked"]), str(g["escaped"]),
              _pct(g["escape_rate"]), _pct(g["coverage"])]
             for k, g in _by_interval(s["replay_intervals"])])]
    ov = s.get("overhead")
    if ov:
        draws = round_draws(rounds_of(ov))
        samples = ov.get("samples_ms") or {}

        def ci(name: str, value: Any) -> str:
            d = None if value is None else ratio_draws(samples, name, draws, float(value))
            return "no per-round samples" if d is None else _ci90(interval(d))

        rows = [["plain DDP step (ms)", f"{ov['baseline_step_ms']:.2f}", "-"],
                *([oc.name, _pct(ov.get(oc.key)), ci(oc.name, ov.get(oc.key))]
                  for oc in HEADLINE)]
        fit = (ov.get("replay_fit") or {}).get("predicted", {})
        band = ((s.get("overhead_fit_ci90") or {}).get("predicted")) or {}
        rows += [[f"replay every {k}", _pct(v) + (f" (fit: {_pct(fit[k])})" if k in fit else ""),
                  _ci90(band[k]) + " (fit)" if k in band else "no per-round samples"]
                 for k, v in _by_interval(ov["replay"])]
        if ov.get("replay_fit"):
            f = ov["replay_fit"]
            rows.append(["replay fit: fixed + per audit / k",
                         f"{_pct(f['fixed'])} + {_pct(f['per_audit'])} / k", "-"])
        rows += [[f"all checks, replay {'off' if k == '0' else 'every ' + k}", _pct(v),
                  ci(all_checks(int(k)).name, v)] for k, v in _by_interval(ov["total"])]
        out.append((f"Step-time overhead vs plain DDP ({ov['scenario']}, {ov['world_size']} "
                    f"ranks, medians of {ov['rounds']} alternated blocks of {ov['block']} "
                    "steps; measured on the machine the campaign ran on)",
                    ["configuration", "overhead", "90% interval (bootstrap over rounds)"],
                    rows))
    q = s.get("quarantine")
    if q:
        def qrow(name: str, g: dict[str, Any]) -> list[str]:
            return [name, str(g["trials"]), str(g["detected"]), str(g["cordoned"]),
                    str(g["cordoned_right_nodes"]), str(g["breaker_tripped"]),
                    str(g["api_errors"]), _num(g["fault_to_cordon_s_p50"]),
                    _num(g["fault_to_cordon_s_max"])]

        out.append(("Quarantine (a node per rank, on the loopback Kubernetes API stand-in)",
                    ["site", "trials", "detected", "cordoned", "the injected ranks' nodes",
                     "breaker tripped", "API errors", "fault to cordon p50 (s)", "max (s)"],
                    [qrow(k, g) for k, g in q["sites"].items()] + [qrow("all", q["all"]),
                                                                    qrow("clean", q["clean"])]))
    rec = s.get("recovery")
    if rec and "sites" not in rec:
        out.append(("Recovery (rollback to the last clean checkpoint, or repair by majority)",
                    ["site", "detected", "check", "cordoned", "repaired (no rollback)",
                     "resumed at step", "steps lost", "fault to resumed training (s)",
                     "final state bit-identical to golden"],
                    [[str(rec["site"]), _num(rec["detected_step"]), str(rec["check"]),
                      ", ".join(rec["cordoned_nodes"]) or "-", str(rec["repaired"]),
                      _num(rec["rollback_step"]), _num(rec["wasted_steps"]),
                      _num(rec["fault_to_resume_s"]), str(rec["final_matches_golden"])]]))
    elif rec:
        def rrow(name: str, g: dict[str, Any]) -> list[str]:
            return [name, str(g["trials"]), str(g["detected"]), str(g["repaired"]),
                    str(g["rolled_back"]), _num(g["wasted_steps_p50"]),
                    _num(g["wasted_steps_max"]), _num(g["fault_to_resume_s_p50"]),
                    f"{g['final_matches_golden']} of {g['trials']}"]

        out.append(("Recovery (rollback to the last clean checkpoint, or repair by majority)",
                    ["site", "trials", "detected", "repaired (no rollback)", "rolled back",
                     "steps lost p50", "max", "fault to resumed training p50 (s)",
                     "final state bit-identical to golden"],
                    [rrow(k, g) for k, g in rec["sites"].items()] + [rrow("all", rec["all"])]))
    out += checksum_tables(s)
    out += determinism_tables(s)
    out += [t for t in (cost_table(s), cluster_table(s), latency_table(s), lost_table(s)) if t]
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


def determinism_tables(s: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The exact and the tolerant replay audit side by side (``scenarios.report.determinism``),
    when the campaign has the ``deterministic`` axis."""
    d = s.get("determinism")
    if not d:
        return []
    ex, tol = d["modes"]["exact"], d["modes"]["tolerant"]

    def rate(r: dict[str, Any]) -> str:
        return "-" if not r["of"] else f"{_pct(r['rate'])} {_ci(r['ci95'])} of {r['of']}"

    def esc(r: dict[str, Any]) -> str:
        return "-" if not r["of"] else f"{r['count']} of {r['of']}"

    fp = [[name, str(m["false_positives"]["clean_trials"]), str(m["false_positives"]["detected"]),
           str(m["false_positives"]["not_bit_identical"]), rate(m["all"]["detected"]),
           rate(m["all"]["right_rank"]), str(m["all"]["transient"]),
           rate(m["top_exponent_on_audit_steps"])] for name, m in (("exact", ex),
                                                                   ("tolerant", tol))]
    sites = [[site, rate(g["detected"]), rate(tol["sites"][site]["detected"]),
              rate(g["escaped"]), rate(tol["sites"][site]["escaped"])]
             for site, g in ex["sites"].items()]
    bits = [[site, group, esc(g["escaped"]), esc(tol["escapes_by_bits"][site][group]["escaped"])]
            for site, groups in ex["escapes_by_bits"].items() for group, g in groups.items()
            if g["escaped"]["of"] or tol["escapes_by_bits"][site][group]["escaped"]["of"]]
    return [
        ("Determinism: the exact replay audit (deterministic kernels) and the tolerant one "
         "(kernels that are not deterministic: the testbed) on the same fault space",
         ["mode", "clean trials", "false positives", "clean runs not bit-identical to their "
          "golden", "detected (of trials not masked)", "right rank named", "named transient",
          "exponent bits 27-30 at an audit step (not masked): same step, right rank"], fp),
        ("Determinism: coverage by site (95% CI; of trials not masked)",
         ["site", "detected, exact", "detected, tolerant", "escaped, exact",
          "escaped, tolerant"], sites),
        ("Determinism: escapes by bit (escaped of the trials not masked)",
         ["site", "bits", "exact", "tolerant"], bits),
    ]


def checksum_tables(s: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """The checksum check's tables (``scenarios.report.checksum``), when trials ran it."""
    c = s.get("checksum")
    if not c:
        return []

    def rate(g: dict[str, Any], key: str) -> str:
        r = g[key]
        return "-" if not r["of"] else f"{_pct(r['rate'])} {_ci(r['ci95'])} of {r['of']}"

    sites = [[site, rate(g["off"], "detected"), rate(g["on"], "detected"),
              rate(g["off"], "escaped"), rate(g["on"], "escaped"), str(g["on"]["by_checksum"])]
             for site, g in c["sites"].items()]
    by_k = [[("off" if k == "0" else k), rate(g["off"], "escaped"), rate(g["on"], "escaped"),
             rate(g["linear_product_off"], "escaped"), rate(g["linear_product_on"], "escaped"),
             rate(g["linear_product_above_bound_on"], "escaped")]
            for k, g in _by_interval(c["replay_intervals"])]
    ab = c["above_bound"]
    top = ab["top_exponent_bits"]["same_step_contained_right_rank"]
    fp = c["false_positives"]
    return [
        ("Checksum check: coverage by site, off and on (95% CI; of trials not masked)",
         ["site", "detected, off", "detected, on", "escaped, off", "escaped, on",
          "detected by the checksum"], sites),
        ("Escape rate by replay interval: replay alone and checksum + replay (finite bit "
         "flips at activation, activation_grad and linear_product)",
         ["interval", "replay alone", "checksum + replay", "linear products, replay alone",
          "linear products, checksum + replay", "linear products above the bound, "
          "checksum + replay"], by_k),
        ("Checksum targets", ["target", "numbers"], [
            ["0 false positives with the checksum on",
             f"{fp['detected']} detections in {fp['clean_trials']} clean trials"],
            ["exponent bits 28-30 of a linear product: detected in their step, contained, "
             "right rank (>= 99%)", f"{_pct(top['rate'])} {_ci(top['ci95'])} of {top['of']}"],
            [f"faults above the rounding bound ({ab['definition']}) escaping (<= 1%)",
             rate(ab, "escaped")],
        ]),
    ]


def _headline(s: dict[str, Any]) -> list[str]:
    rec = s["recommended_replay_interval"]
    secs = s.get("campaign_seconds")
    return [
        f"{s['trials']} fault trials, {s['clean_trials']} clean trials, "
        f"**{s['false_positives']} false positives**.",
        "Outcomes: " + ", ".join(f"{k} {v}" for k, v in s["outcomes"].items()) + ".",
        f"Overall coverage {_pct(s['all']['coverage'])} {_ci(s['all']['coverage_ci95'])}.",
        f"The budget rule (a constraint, not the recommendation above): the smallest replay "
        f"interval whose replay-audit overhead fits {_pct(s['overhead_budget'])}: "
        f"{rec if rec is not None else 'none fits'} ({s['recommendation_rule']})"
        + (f"; {s['recommendation_agreement']:.0%} of bootstrap resamples of the overhead "
           "rounds agree." if s.get("recommendation_agreement") is not None else "."),
        f"Campaign time: {secs:.0f} s" + (f", {s['trials_per_minute']:.0f} trials/min."
                                         if s.get("trials_per_minute") else ".")
        if secs else "",
    ]


def render_markdown(s: dict[str, Any], plots: list[Path]) -> str:
    lines = [f"# Fault-injection campaign `{s['campaign']}`" + (" (quick)" if s["quick"] else ""),
             "", "## The answer", "", *(f"- {x}" for x in answer_lines(s)), ""]
    answer = coverage_table(s)
    lines += ["| " + " | ".join(answer[1]) + " |", "|" + "---|" * len(answer[1])]
    lines += ["| " + " | ".join(r) + " |" for r in answer[2]]
    lines += ["", "## The evidence", "", *[x for x in _headline(s) if x], ""]
    for title, head, rows in _tables(s):
        lines += [f"## {title}", "", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    lines += ["Definitions: see reports/README.md and scenarios/report/outcome.py.", ""]
    return "\n".join(lines)


def _strong(x: str) -> str:
    """``**text**`` (already escaped) as ``<strong>text</strong>``."""
    return re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", x)


def _inline_svg(path: Path) -> str:
    """An SVG file's ``<svg>`` element, for inlining (no XML prolog, DOCTYPE or metadata)."""
    text = path.read_text()
    return re.sub(r"<metadata>.*?</metadata>", "", text[text.index("<svg"):], flags=re.S)


def render_html(s: dict[str, Any], plots: list[Path]) -> str:
    def esc(x: str) -> str:
        return html.escape(x).replace("**", "")

    parts = ["<!doctype html><html><head><meta charset='utf-8'>",
             f"<title>Campaign {esc(str(s['campaign']))}</title><style>",
             "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}",
             "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;",
             "padding:3px 8px;text-align:right}th{background:#eee}td:first-child{text-align:left}",
             "img,svg{max-width:100%;height:auto}.answer{background:#f3f8f3;",
             "border:1px solid #9c9;padding:0.5em 1.2em;margin:1em 0}</style></head><body>",
             f"<h1>Fault-injection campaign <code>{esc(str(s['campaign']))}</code></h1>",
             "<section class='answer'><h2>The answer</h2>"]

    def table(title: str, head: list[str], rows: list[list[str]], level: int = 2) -> None:
        parts.append(f"<h{level}>{esc(title)}</h{level}><table><tr>"
                     + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>")
        parts.extend("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in rows)
        parts.append("</table>")

    parts += [f"<p>{_strong(html.escape(x))}</p>" for x in answer_lines(s)]
    table(*coverage_table(s), level=3)
    parts.append("</section><h2>The evidence</h2>")
    parts += [f"<p>{esc(x)}</p>" for x in _headline(s) if x]
    for title, head, rows in _tables(s):
        table(title, head, rows)
    parts.append("<h2>Plots</h2>")
    for p in plots:
        if p.suffix == ".svg":
            parts.append(f"<figure aria-label='{esc(p.stem)}'>{_inline_svg(p)}</figure>")
            continue
        data = base64.b64encode(p.read_bytes()).decode()
        parts.append(f"<p><img alt='{esc(p.stem)}' src='data:image/png;base64,{data}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(out: str | Path, cluster: dict[str, Any] | None = None,
                 overhead_file: str | Path | None = None) -> dict[str, Any]:
    """Write summary.json, report.md, report.html and the plots into ``out`` (``cluster``:
    overrides of the cost model's ``[cluster]`` fields, e.g. from the command line;
    ``overhead_file``: your hardware's overheads, ``scenarios.report.overheads``)."""
    from scenarios.report.plots import draw_all

    out = Path(out)
    summary = summarize(out, cluster, overhead_file)
    write_json(out / "summary.json", summary)
    plots = draw_all(summary, out)
    (out / "report.md").write_text(render_markdown(summary, plots))
    (out / "report.html").write_text(render_html(summary, plots))
    return summary


def summary_text(s: dict[str, Any], out: Path) -> str:
    """A few lines for the terminal: outcomes, coverage per site, where the report is."""
    lines = [f"{s['trials']} fault trials, {s['clean_trials']} clean, "
             f"{s['false_positives']} false positives; outcomes {s['outcomes']}"]
    for site, g in (s.get("sites") or {}).items():
        cov = g["coverage"]
        lines.append(f"  {site:<26} coverage {'-' if cov is None else f'{cov:.1%}'} "
                     f"(detected {g['detected']}, masked {g['masked']}, escaped {g['escaped']}, "
                     f"crashed {g['crashed']}, hung {g['hung']})")
    lost = (s.get("lost") or {}).get("trials")
    if lost:
        lines.append(f"  lost (killed from outside twice; in no other number): {lost}")
    rec = (s.get("cost") or {}).get("recommendation")
    if rec:
        low, high = rec["band"]
        how = (f"settled: {rec['agreement']:.0%} of {rec['resamples']} resamples agree"
               if rec["settled"] else
               f"not settled: the resamples split, the data cannot tell apart "
               f"{', '.join(rec['indistinguishable'])}")
        lines.append(f"recommended: {rec['name']}, {rec['gpu_hours_per_day']:,.0f} "
                     f"GPU-hours/day (band {low:,.0f} to {high:,.0f}; {how})")
    for w in (s.get("cost") or {}).get("overhead_warnings") or []:
        lines.append(f"warning: {w}")
    lines.append(f"report: {out / 'report.html'}")
    return "\n".join(lines)
