"""PNG plots of a campaign summary (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PLOTS = ("coverage_heatmap.png", "latency.png", "replay_interval.png")
LATENCY_CAP = 5
"""Latencies of this many steps or more share the last bin."""


def coverage_heatmap(summary: dict[str, Any], path: Path) -> None:
    """Detection coverage by site (rows) and bit field (columns); n = trials that were not masked."""
    grid = summary["by_site_field"]
    sites = [s for s in summary["site_order"] if s in grid]
    fields = summary["field_order"]
    data = [[grid[s].get(f, {}).get("coverage") for f in fields] for s in sites]
    fig, ax = plt.subplots(figsize=(1.4 * len(fields) + 3, 0.6 * len(sites) + 1.6))
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
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in order
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


def draw_all(summary: dict[str, Any], out: Path) -> list[Path]:
    paths = [out / name for name in PLOTS]
    coverage_heatmap(summary, paths[0])
    latency(summary, paths[1])
    replay_interval(summary, paths[2])
    return paths
