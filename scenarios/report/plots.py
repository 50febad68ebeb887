"""Plots of a campaign summary (matplotlib, Agg backend: no display needed).

The three PNGs of earlier reports, and SVGs (``SVG_PLOTS``) that ``report.html`` inlines:
the detection-latency CDFs and the cost model's stacked daily loss.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

SVG_METADATA: dict[str, Any] = {"Date": None}
"""SVGs without a creation date, and (``svg.hashsalt``) with the same ids on every run."""
matplotlib.rcParams["svg.hashsalt"] = "sdc-guard"

PLOTS = ("coverage_heatmap.png", "latency.png", "replay_interval.png")
SVG_PLOTS = ("latency_cdf.svg", "cost.svg", "checksum_bits.svg")
PATTERN_PLOT = "pattern_checks.svg"
"""Drawn when the campaign has a patterns axis (``pattern_checks``)."""
LATENCY_CAP = 5
"""Latencies of this many steps or more share the last bin."""


def coverage_heatmap(summary: dict[str, Any], path: Path) -> None:
    """Detection coverage by site (rows) and bit field (columns); n = trials that were not masked."""
    grid = summary["by_site_field"]
    sites = [s for s in summary["site_order"] if s in grid]
    fields = summary["field_order"]
    data = [[grid[s].get(f, {}).get("coverage") for f in fields] for s in sites]
    fig, ax = plt.subplots(figsize=(1.4 * len(fields) + 3, 0.6 * len(sites) + 1.6))
    if not sites or not fields:  # no fault trials (yet): an empty figure that says so
        ax.text(0.5, 0.5, "no fault trials", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    values = [[math.nan if v is None else v for v in row] for row in data]
    im = ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, s in enumerate(sites):
        for j, f in enumerate(fields):
            cell = grid[s].get(f)
            if not cell:
                continue
            n = cell["trials"] - cell["masked"]
            text = "-" if cell["coverage"] is None else f"{cell['coverage']:.0%}"
            ax.text(j, i, f"{text}\nn={n}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(fields)), fields)
    ax.set_yticks(range(len(sites)), sites)
    ax.set_title("Detection coverage (detected / not masked)")
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency(summary: dict[str, Any], path: Path) -> None:
    """Detection latency in steps, from the injection and from the divergence, per site."""
    lat = summary["latency_histogram"]
    order = summary["site_order"]
    colors = {site: plt.get_cmap("tab10")(i) for i, site in enumerate(order)}
    bins = list(range(LATENCY_CAP + 1))
    labels = [str(b) for b in bins[:-1]] + [f"{LATENCY_CAP}+"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, key, title in ((axes[0], "from_injection", "from the injection step"),
                           (axes[1], "from_divergence", "from the first divergent step")):
        sites = [s for s in order if s in lat[key]]
        width = 0.8 / max(1, len(sites))
        for i, site in enumerate(sites):
            counts = [0] * len(bins)
            for b, n in lat[key][site].items():
                counts[min(int(b), LATENCY_CAP)] += n
            xs = [b + (i - len(sites) / 2 + 0.5) * width for b in bins]
            ax.bar(xs, counts, width=width, color=colors[site], label=site)
        ax.set_xticks(bins, labels)
        ax.set_xlabel("latency (steps)")
        ax.set_title(title)
    axes[0].set_ylabel("detected trials")
    handles = [Rectangle((0, 0), 1, 1, color=colors[s]) for s in order
               if s in lat["from_injection"] or s in lat["from_divergence"]]
    names = [s for s in order if s in lat["from_injection"] or s in lat["from_divergence"]]
    if handles:
        fig.legend(handles, names, loc="upper right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replay_interval(summary: dict[str, Any], path: Path) -> None:
    """Guard overhead and escape rate against the replay interval; budget and recommendation."""
    ov = summary.get("overhead") or {}
    total = ov.get("total", {})
    replay = ov.get("replay", {})
    esc = summary["replay_intervals"]
    ks = sorted({int(k) for k in total} | {int(k) for k in replay} | {int(k) for k in esc})
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    pos = {k: i for i, k in enumerate(ks)}
    label = ["off" if k == 0 else str(k) for k in ks]
    ov_k = [k for k in ks if str(k) in replay]
    if ov_k:
        ax.plot([pos[k] for k in ov_k], [100 * replay[str(k)] for k in ov_k], "o-",
                color="tab:blue", label="replay audit overhead (median)")
    fit = (ov.get("replay_fit") or {}).get("predicted", {})
    fit_k = [k for k in ks if str(k) in fit]
    if fit_k:
        ax.plot([pos[k] for k in fit_k], [100 * fit[str(k)] for k in fit_k], "x--",
                color="tab:cyan", label="replay overhead, fit: fixed + per audit / k")
    tot_k = [k for k in ks if str(k) in total]
    if tot_k:
        ax.plot([pos[k] for k in tot_k], [100 * total[str(k)] for k in tot_k], "o:",
                color="tab:purple", label="all checks (nonfinite + weights + replay)")
    budget = summary.get("overhead_budget")
    if budget is not None:
        ax.axhline(100 * budget, color="tab:blue", ls="--", lw=1,
                   label=f"overhead budget {budget:.0%}")
    ax.set_ylabel("step-time overhead vs plain DDP (%)", color="tab:blue")
    ax.set_xticks(range(len(ks)), label)
    ax.set_xlabel("replay audit interval (steps)")
    ax2 = ax.twinx()
    esc_k = [k for k in ks if str(k) in esc and esc[str(k)]["escape_rate"] is not None]
    if esc_k:
        ax2.plot([pos[k] for k in esc_k], [100 * esc[str(k)]["escape_rate"] for k in esc_k],
                 "s-", color="tab:red", label="escape rate (escaped / not masked)")
    ax2.set_ylabel("escape rate (%)", color="tab:red")
    ax2.set_ylim(bottom=0)
    rec = summary.get("recommended_replay_interval")
    if rec is not None and rec in pos:
        ax.axvline(pos[rec], color="tab:green", lw=2, alpha=0.6,
                   label=f"recommended interval: {rec}")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    fig.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="lower center",
               ncol=2)
    ax.set_title("Overhead and escape rate against the replay interval")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax: Any, counts: dict[str, int], label: str, color: Any) -> None:
    """Empirical CDF of latencies given as {steps: trials}, as a step line."""
    xs = sorted(int(k) for k in counts)
    total = sum(counts.values())
    ys = []
    acc = 0
    for x in xs:
        acc += counts[str(x)]
        ys.append(acc / total)
    ax.step([xs[0] - 0.5, *xs, max(xs[-1], LATENCY_CAP) + 0.5], [0.0, *ys, 1.0], where="post",
            color=color, label=f"{label} (n={total})")


def latency_cdf(summary: dict[str, Any], path: Path) -> None:
    """Share of detections within x steps of the injection: per check and per site."""
    lat = summary.get("latency") or {}
    by_check = (lat.get("from_injection") or {}).get("check_histogram") or {}
    by_site = summary["latency_histogram"]["from_injection"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.0), sharey=True)
    cmap = plt.get_cmap("tab10")
    for i, (check, counts) in enumerate(sorted(by_check.items())):
        _cdf(axes[0], counts, check, cmap(i))
    for i, site in enumerate(summary["site_order"]):
        if site in by_site:
            _cdf(axes[1], by_site[site], site, cmap(i))
    for ax, title in ((axes[0], "per check (the first to fire)"), (axes[1], "per fault site")):
        ax.set_xlabel("detection latency from the injection (steps)")
        ax.set_title(title)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("share of detected trials detected within x steps")
    fig.suptitle("Detection latency, cumulative distribution")
    fig.tight_layout()
    fig.savefig(path, metadata=SVG_METADATA)
    plt.close(fig)


def cost(summary: dict[str, Any], path: Path) -> None:
    """Expected GPU-hours lost per day by configuration, stacked by part, with the band."""
    model = summary.get("cost") or {}
    rows = sorted(model.get("configurations") or [],
                  key=lambda r: (r["replay_interval"], -len(r["checks"])))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 3), 4.6))
    if rows:
        names = [r["name"] for r in rows]
        bottom = [0.0] * len(rows)
        for part, color in zip(model["parts"], ("tab:blue", "tab:orange", "tab:green",
                                                "tab:red", "tab:purple"), strict=False):
            vals = [r["parts"][part] for r in rows]
            ax.bar(names, vals, bottom=bottom, color=color, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        lo = [r["total"] - r["total_low"] for r in rows]
        hi = [r["total_high"] - r["total"] for r in rows]
        ax.errorbar(names, [r["total"] for r in rows], yerr=[lo, hi], fmt="none", ecolor="k",
                    capsize=3, lw=1, label="uncertainty band (campaign intervals)")
        best = (model.get("recommendation") or {}).get("name")
        if best in names:
            ax.get_xticklabels()[names.index(best)].set_fontweight("bold")
        ax.tick_params(axis="x", labelrotation=30)
        ax.legend(fontsize=7)
    ax.set_xlabel("configuration (replay audit interval in steps; optional checks)")
    ax.set_ylabel("expected loss (GPU-hours per day)")
    ax.set_title("Cost model: expected daily loss by part")
    fig.tight_layout()
    fig.savefig(path, metadata=SVG_METADATA)
    plt.close(fig)


def checksum_bits(summary: dict[str, Any], path: Path) -> None:
    """Faults in linear products, bit by bit: the fraction detected (of those not masked) with
    the checksum check on and off. Low bits hide under the rounding bound."""
    bits = (summary.get("checksum") or {}).get("linear_product_bits") or {}
    fig, ax = plt.subplots(figsize=(8.0, 3.8))
    xs = sorted(int(b) for b in bits)
    for name, color, dx in (("on", "tab:green", 0.2), ("off", "tab:gray", -0.2)):
        pts = [(b, bits[str(b)][name]["detected"]) for b in xs]
        pts = [(b, d) for b, d in pts if d["of"]]
        if not pts:
            continue
        ax.bar([b + dx for b, _ in pts], [100 * d["rate"] for _, d in pts], width=0.4,
               color=color, label=f"checksum {name}")
        for b, d in pts:
            ax.text(b + dx, 100 * d["rate"] + 1, str(d["of"]), ha="center", fontsize=6)
    ax.set_xlim(-1, 32)
    ax.set_ylim(0, 110)
    ax.set_xlabel("flipped bit of the float32 entry (0 = least significant; 23-30 exponent, "
                  "31 sign)")
    ax.set_ylabel("detected (% of faults not masked)")
    ax.set_title("Faults inside nn.Linear products, bit by bit (numbers: trials)")
    if xs:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, metadata=SVG_METADATA)
    plt.close(fig)


def pattern_checks(summary: dict[str, Any], path: Path) -> None:
    """Each fault pattern (rows) against each check (columns): the share of its not-masked
    trials the check saw, and any check: where a check stops seeing a shape of fault."""
    grid = summary.get("pattern_checks") or {}
    cols = ["nonfinite", "weights", "replay", "checksum", "any"]
    fig, ax = plt.subplots(figsize=(7.5, 0.5 * max(len(grid), 1) + 1.8))
    if grid:
        rows = list(grid)
        values = [[math.nan if grid[r][c] is None else grid[r][c] for c in cols] for r in rows]
        ax.imshow(values, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                v = grid[r][c]
                ax.text(j, i, "-" if v is None else f"{v:.0%}", ha="center", va="center",
                        fontsize=8)
        ax.set_xticks(range(len(cols)), cols)
        ax.set_yticks(range(len(rows)), [f"{r} (n={grid[r]['n']})" for r in rows])
        ax.set_title("Who sees each fault pattern (share of not-masked trials)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, metadata=SVG_METADATA)
    plt.close(fig)


def draw_all(summary: dict[str, Any], out: Path) -> list[Path]:
    """Every plot into ``out``: the PNGs (``PLOTS``), then the SVGs (``SVG_PLOTS``, and
    ``PATTERN_PLOT`` for a campaign with fault patterns)."""
    paths = [out / name for name in (*PLOTS, *SVG_PLOTS)]
    coverage_heatmap(summary, paths[0])
    latency(summary, paths[1])
    replay_interval(summary, paths[2])
    latency_cdf(summary, paths[3])
    cost(summary, paths[4])
    checksum_bits(summary, paths[5])
    if summary.get("pattern_checks"):
        paths.append(out / PATTERN_PLOT)
        pattern_checks(summary, paths[-1])
    return paths
