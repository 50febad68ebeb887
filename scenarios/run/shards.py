"""Campaigns in shards: a deterministic 1/N of the trials per process, and the merge.

``python -m scenarios campaign FILE --shard I/N --out DIR`` runs its share of the campaign's
plan (``plan_trials``: the same list on every machine; ``shard_of``: equal work per shard,
each shard's trials spread evenly over the plan), with the golden runs its trials need;
shard 0 also measures the overhead, and gets fewer trials for it (``overhead_share``). A
shard writes no report: ``merge`` writes the campaign's. ``--shard N`` takes
``I`` from ``JOB_COMPLETION_INDEX`` (a Kubernetes Indexed Job sets it, 0-based). A shard
resumes like any campaign.

``python -m scenarios merge OUT DIR...`` checks that every directory is a shard of the same
plan (``plan_key``: a hash of the campaign's settings and of every planned trial id), that no
trial appears twice and none is missing, then writes ``OUT/trials.csv`` in plan order,
``OUT/campaign.json``, shard 0's ``overhead.json``, and the report.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from scenarios.run.store import TrialTable, write_json
from scenarios.spec.campaign import CampaignSpec
from scenarios.spec.errors import ScenarioError
from scenarios.spec.overhead import campaign_configs
from scenarios.spec.trials import TrialSpec


def parse_shard(text: str, environ: dict[str, str] | None = None) -> tuple[int, int]:
    """``"I/N"`` or ``"N"`` (``I`` from ``JOB_COMPLETION_INDEX``) -> ``(I, N)``, 0-based."""
    env = os.environ if environ is None else environ
    index_text, _, count_text = text.rpartition("/")
    if not index_text:
        index_text = env.get("JOB_COMPLETION_INDEX", "")
        if not index_text:
            raise ScenarioError("--shard", text, "I/N (0 <= I < N), or N with the index in "
                                "$JOB_COMPLETION_INDEX", reason="JOB_COMPLETION_INDEX is not set")
    try:
        index, count = int(index_text), int(count_text)
    except ValueError:
        raise ScenarioError("--shard", text, "I/N with integers 0 <= I < N, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise ScenarioError("--shard", text, "I/N with integers 0 <= I < N, e.g. 0/4")
    return index, count


def plan_key(campaign_json: dict[str, Any], trials: list[TrialSpec]) -> str:
    """What makes two shards parts of one campaign: its settings and its planned trials."""
    blob = json.dumps({"campaign": campaign_json, "ids": [t.id for t in trials]},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def overhead_share(campaign: CampaignSpec) -> float:
    """Shard 0's head start, in trials: the overhead measurement it runs alone, estimated as
    its timed steps over a trial's steps (``rounds x configurations x block`` against the
    campaign's mean scenario length; a trial step also pays the comparison with golden and
    the checkpoints, an overhead step does not, so this leans to the cautious side)."""
    spec = campaign.overhead
    if spec is None or not campaign.scenarios:
        return 0.0
    ks = campaign.overhead_intervals()
    lcm = math.lcm(*ks) if ks else 1
    block = lcm * max(1, math.ceil(spec.block / lcm))  # as the overhead rounds round it
    steps = spec.rounds * len(campaign_configs(ks)) * block
    return steps / (sum(s.steps for s in campaign.scenarios) / len(campaign.scenarios))


def shard_of(trials: list[TrialSpec], index: int, count: int,
             head_start: float = 0.0) -> list[TrialSpec]:
    """Shard ``index`` of ``count``. Each shard's share of the plan is equal work: shard 0,
    which also measures the overhead (``head_start`` trials' worth, ``overhead_share``), gets
    ``(M + head_start) / count - head_start`` of the ``M`` trials, the others
    ``(M + head_start) / count`` each. Trial by trial in plan order, each goes to the shard
    least far through its share (``(dealt + 1) / share``; ties: the lowest index), so every
    shard's trials are spread evenly over the plan and each gets the plan's mix of scenarios,
    sites and replay intervals (a cheap and a costly part of the plan never fall to different
    shards). The shards together are the plan, each trial once; without a head start shard
    ``index`` gets every ``count``-th trial from position ``index``."""
    total = len(trials) + max(0.0, head_start)
    share = [total / count - max(0.0, head_start)] + [total / count] * (count - 1)
    dealt = [0] * count
    mine = []
    for t in trials:
        i = min((j for j in range(count) if share[j] > 0),
                key=lambda j: ((dealt[j] + 1) / share[j], j))
        dealt[i] += 1
        if i == index:
            mine.append(t)
    return mine


def merge(out: Path, dirs: list[Path]) -> dict[str, Any]:
    """Merge shard directories into ``out`` (see the module doc); returns the merged meta."""
    if not dirs:
        raise ScenarioError("DIR", [], "one or more shard output directories")
    metas = []
    for d in dirs:
        path = d / "campaign.json"
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ScenarioError("DIR", str(d), "a shard's output directory (with campaign.json)",
                                reason=str(e)) from None
        if not isinstance(meta.get("shard"), dict):
            raise ScenarioError("DIR", str(d), "the output of `campaign --shard I/N`",
                                reason="its campaign.json has no shard record")
        metas.append(meta)
    key = metas[0]["shard"]["plan_key"]
    for d, m in zip(dirs, metas, strict=True):
        if m["shard"]["plan_key"] != key:
            raise ScenarioError("DIR", str(d), f"a shard of the same campaign as {dirs[0]}",
                                reason=f"its plan ({m['shard']['plan_key']}, campaign "
                                       f"{m.get('name')!r}) differs from {key}: another "
                                       "campaign file or version")
    plan: list[str] = metas[0]["shard"]["plan_ids"]
    rows: dict[str, dict[str, str]] = {}
    where: dict[str, Path] = {}
    doubled: list[str] = []
    for d in dirs:
        for row in TrialTable(d / "trials.csv").rows():
            if row["id"] in rows:
                doubled.append(f"{row['id']} ({where[row['id']]} and {d})")
                continue
            rows[row["id"]] = row
            where[row["id"]] = d
    if doubled:
        raise ScenarioError("DIR", [str(d) for d in dirs], "shards that do not overlap",
                            reason=f"{len(doubled)} trial(s) in two directories: "
                                   + ", ".join(doubled[:10]))
    missing = [i for i in plan if i not in rows]
    if missing:
        have = sorted({m["shard"]["index"] for m in metas})
        raise ScenarioError("DIR", [str(d) for d in dirs], "every shard, each run to its end",
                            reason=f"{len(missing)} planned trial(s) missing (shards given: "
                                   f"{have} of {metas[0]['shard']['count']}): "
                                   + ", ".join(missing[:10]))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "trials.csv").exists():
        raise ScenarioError("OUT", str(out), "a new directory for the merged campaign",
                            reason="it already has a trials.csv")
    table = TrialTable(out / "trials.csv")
    for i in plan:
        table.append(rows[i])
    first = next(m for m in metas if m["shard"]["index"] == 0) if any(
        m["shard"]["index"] == 0 for m in metas) else metas[0]
    merged = {k: v for k, v in first.items() if k not in ("shard", "planned_ids")}
    merged.update({
        "planned_ids": plan,
        "merged_from": [{"dir": str(d), "index": m["shard"]["index"],
                         "trials": len(m["planned_ids"]), "seconds": m.get("seconds")}
                        for d, m in zip(dirs, metas, strict=True)],
        "runs": [r for m in metas for r in m.get("runs", [])],
        "goldens": {k: v for m in metas for k, v in (m.get("goldens") or {}).items()},
        "trials_per_minute": None,
    })
    write_json(out / "campaign.json", merged)
    shard0 = next((d for d, m in zip(dirs, metas, strict=True) if m["shard"]["index"] == 0),
                  None)
    if shard0 is not None and (shard0 / "overhead.json").exists():
        shutil.copyfile(shard0 / "overhead.json", out / "overhead.json")
    return merged
