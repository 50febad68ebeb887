"""Writes the fixed campaign directories the report's regression test reads (run once).

``python tests/scenarios/test_report_data/make_fixture.py`` regenerates ``full/`` and
``small/`` (``trials.csv``, ``overhead.json``, ``campaign.json``) from a seeded generator:
a realistic table in the shape of the default campaign (two scenarios, every site, four bit
fields, three fault models, replay intervals 0-8, quarantine and recovery columns; clean
trials with one false positive; one stale row). ``expected_summary.json`` beside them is
what the report code of commit a5b59a6 (hand-written statistics) computed from them; the
test asserts the current code reproduces it.

``rerun/a`` and ``rerun/b`` hold the overhead measurement of the same campaign taken twice
(``rerun_overhead``: the same true costs, different timing noise, per-round samples of every
configuration): with ``full/``'s trials they are the same campaign run twice.
``python make_fixture.py rerun`` rewrites only those.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from scenarios.run.store import TrialTable

HERE = Path(__file__).resolve().parent
SITES = ("activation", "activation_grad", "gradient_before_allreduce",
         "gradient_after_allreduce", "optimizer_state", "weight_storage")
FIELDS = ("sign", "exponent", "mantissa", "nan")
MODELS = ("transient", "intermittent", "permanent")
INTERVALS = (0, 1, 2, 4, 8)
SCENARIOS = ("mlp", "cnn_bn")
STATE = ("weight_storage", "optimizer_state", "gradient_after_allreduce")


def _fault_row(rng: random.Random, i: int, *, recovery: bool = True,
               quarantine: bool = True) -> dict[str, Any]:
    site = SITES[i % len(SITES)]
    field = FIELDS[(i // len(SITES)) % len(FIELDS)]
    model = MODELS[rng.randrange(3)]
    k = INTERVALS[rng.randrange(len(INTERVALS))]
    sc = SCENARIOS[i % 2]
    rank, step = rng.randrange(3), rng.randrange(2, 16)
    nan = field == "nan"
    if nan:
        outcome = rng.choices(["detected", "masked", "crashed"], [8, 1, 1])[0]
    elif site in STATE:
        outcome = rng.choices(["detected", "masked", "escaped"], [7, 2, 1 + (k == 0) * 3])[0]
    else:
        outcome = rng.choices(["detected", "masked", "escaped", "hung"],
                              [4, 4, 2 + (k == 0) * 2, 0.2])[0]
    row: dict[str, Any] = {
        "id": f"t{i:04d}", "scenario": sc, "kind": "fault", "site": site, "field": field,
        "fault_model": model, "fault_rank": rank, "fault_step": step,
        "target": "net.0", "state_key": "exp_avg" if site == "optimizer_state" else None,
        "replay_interval": k, "outcome": outcome,
        "fault": [{"site": site, "rank": rank, "step": step}],
    }
    if outcome == "hung" or i in (17, 101):
        row["outcome"] = "hung"
        row.update(error="no answer within 60s", seconds=60.0)
        return row
    n_inj = 0 if rng.random() < 0.03 else (1 if model == "transient" else rng.randrange(2, 6))
    row.update(injections=n_inj, first_injection=step if n_inj else None,
               injected_ranks=[rank] if n_inj else [], nonfinite_injected=nan and n_inj > 0,
               steps_run=20, seconds=round(rng.uniform(0.3, 0.9), 4))
    if outcome == "detected":
        check = ("nonfinite" if nan else
                 rng.choice(["weights", "replay"] if k else ["weights", "weights", "nonfinite"]))
        lat = rng.choices([0, 1, 2, 3, 4, 6], [10, 5, 2, 1, 1, 1])[0]
        if check == "nonfinite":
            lat = rng.choices([0, 1], [9, 1])[0]
        contained = lat == 0 and rng.random() < 0.6
        blame = rng.random() < 0.9
        first_div = None if contained else step + rng.randrange(0, lat + 1)
        suspects = [rank] if blame else [rank, (rank + 1) % 3]
        row.update(check=check, checks=check + ("+weights" if rng.random() < 0.2 else ""),
                   detect_step=step + lat, suspects=suspects, blame_correct=blame,
                   contained=contained, same_step=lat == 0, skipped=[step + lat],
                   first_divergence=first_div, latency_from_injection=lat,
                   latency_from_divergence=None if first_div is None else step + lat - first_div,
                   repaired=rng.random() < 0.2)
    else:
        row["first_divergence"] = None if outcome == "masked" else step
        if outcome == "escaped":
            row.update(rel_weight_dev=rng.uniform(1e-7, 1e-2), loss_diff=rng.gauss(0, 1e-3))
        if outcome == "crashed":
            row["error"] = "non-finite training loss on rank(s) [0, 1, 2]"
    det = outcome == "detected"
    if quarantine:
        cordoned = [f"node-{rank}"] if det and not row.get("repaired") and rng.random() < 0.95 \
            else []
        row.update(cordoned_nodes=cordoned, cordon_correct=rng.random() < 0.97,
                   breaker_tripped=det and rng.random() < 0.05,
                   quarantine_errors=int(rng.random() < 0.03))
        if cordoned:
            row["fault_to_cordon_s"] = round(rng.uniform(0.02, 0.4), 4)
    if recovery:
        rolled = det and not row.get("repaired")
        back = step - rng.randrange(0, 4) if rolled else None
        row.update(final_matches_golden=det or outcome == "masked", rollback_step=back,
                   wasted_steps=(row["detect_step"] + 1 - back) if rolled else 0)
        if det:
            row["fault_to_resume_s"] = round(rng.uniform(0.1, 2.5), 4)
    return row


def _clean_row(i: int, sc: str, k: int, *, fp: bool, quarantine: bool = True) -> dict[str, Any]:
    row: dict[str, Any] = {"id": f"c{i:03d}", "scenario": sc, "kind": "clean",
                           "replay_interval": k, "outcome": "detected" if fp else "masked",
                           "injections": 0, "injected_ranks": [], "nonfinite_injected": False,
                           "steps_run": 20, "seconds": 0.5}
    if quarantine:
        row.update(cordoned_nodes=[], cordon_correct=True, breaker_tripped=False,
                   quarantine_errors=0)
    if fp:
        row.update(check="weights", checks="weights", detect_step=7, suspects=[2],
                   contained=False, same_step=False, blame_correct=None)
    return row


def _overhead(rng: random.Random, ks: tuple[int, ...], rounds: int,
              samples: bool) -> dict[str, Any]:
    base = [13.0 * (1 + 0.04 * rng.random()) for _ in range(rounds)]
    s: dict[str, list[float]] = {"plain DDP": base}
    for k in ks:
        s[f"replay@{k}"] = [b * (1 + 0.089 + 0.497 / k + rng.gauss(0, 0.02)) for b in base]
    med = {str(k): sorted(t / b - 1 for t, b in zip(s[f"replay@{k}"], base, strict=True))
           [rounds // 2] for k in ks}
    out: dict[str, Any] = {
        "scenario": "mlp_wide", "world_size": 3, "model": "mlp", "rounds": rounds, "block": 16,
        "seconds": 41.2, "baseline_step_ms": sorted(base)[rounds // 2],
        "guard_checks_off": 0.021, "nonfinite": 0.014, "weights": 0.255,
        "replay": med, "total": {"0": 0.29, **{str(k): 0.29 + v for k, v in med.items()}},
    }
    if samples:
        from scenarios.report.summary import fit_replay_overhead

        out["replay_fit"] = fit_replay_overhead(s, list(ks))
        out["samples_ms"] = s
    return out


RERUN_COSTS = {"guard, checks off": 0.003, "nonfinite": 0.015, "weights": 0.11,
               "checksum": 0.05}
"""True per-configuration overheads of the rerun fixtures (fractions of plain DDP's step)."""


def rerun_overhead(seed: int, rounds: int = 7, noise: float = 0.03,
                   costs: dict[str, float] | None = None) -> dict[str, Any]:
    """An ``overhead.json`` with per-round samples of every configuration: the true costs
    ``RERUN_COSTS`` and the replay audit's ``0.089 + 0.497 / k``, each round's block time
    off by a Gaussian of ``noise`` (a shared 2-core machine); ``costs`` replaces some of them."""
    from scenarios.report.stats import fit_replay_overhead
    from scenarios.spec.overhead import HEADLINE, PLAIN_DDP, all_checks, replay_only

    rng = random.Random(seed)
    ks = (1, 2, 4, 8, 16)
    base = [13.0 * (1 + 0.04 * rng.random()) for _ in range(rounds)]
    true = {**RERUN_COSTS, **(costs or {}), **{replay_only(k).name: 0.089 + 0.497 / k for k in ks}}
    true.update({all_checks(k).name: 0.003 + 0.012 + 0.107 + (0.086 + 0.497 / k if k else 0)
                 for k in (0, *ks)})
    s = {PLAIN_DDP.name: base}
    for name, cost in true.items():
        s[name] = [b * (1 + cost + rng.gauss(0, noise)) for b in base]
    med = {n: sorted(v)[rounds // 2] for n, v in s.items()}
    over = {n: med[n] / med[PLAIN_DDP.name] - 1 for n in s}
    return {
        "scenario": "mlp_wide", "world_size": 3, "model": "mlp", "rounds": rounds, "block": 16,
        "seconds": 41.2, "baseline_step_ms": med[PLAIN_DDP.name],
        "step_ms": med, **{oc.key: over[oc.name] for oc in HEADLINE},
        "replay": {str(k): over[replay_only(k).name] for k in ks},
        "total": {str(k): over[all_checks(k).name] for k in (0, *ks)},
        "replay_fit": fit_replay_overhead(s, list(ks)), "samples_ms": s,
    }


def rerun() -> None:
    for name, seed in (("a", 11), ("b", 12)):
        d = HERE / "rerun" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "overhead.json").write_text(json.dumps(rerun_overhead(seed), indent=1,
                                                    sort_keys=True) + "\n")


def _write(d: Path, rows: list[dict[str, Any]], overhead: dict[str, Any] | None,
           meta: dict[str, Any]) -> None:
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t = TrialTable(d / "trials.csv")
    for r in rows:
        t.append(r)
    if overhead is not None:
        (d / "overhead.json").write_text(json.dumps(overhead, indent=1, sort_keys=True) + "\n")
    (d / "campaign.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


def main() -> None:
    rng = random.Random(2026)
    faults = [_fault_row(rng, i) for i in range(240)]
    clean = [_clean_row(j, sc, k, fp=(j == 3))
             for j, (sc, k) in enumerate((sc, k) for sc in SCENARIOS for k in INTERVALS)]
    stale = {**_fault_row(rng, 999), "id": "stale0"}
    rows = faults + clean + [stale]
    meta = {"name": "default", "quick": False, "overhead_budget": 0.4,
            "planned_ids": [r["id"] for r in faults + clean],
            "runs": [{"seconds": 400.5}, {"seconds": 21.25}], "trials_per_minute": 88.0,
            "pool_restarts": 1, "goldens": {"mlp": "cached", "cnn_bn": "computed"}}
    _write(HERE / "full", rows, _overhead(rng, (1, 2, 4, 8, 16), 5, samples=True), meta)
    # One recovery trial, no quarantine, overhead medians only (an older overhead.json).
    small = [_fault_row(rng, i, recovery=(i == 5), quarantine=False) for i in range(12)]
    small.append(_clean_row(0, "mlp", 0, fp=False, quarantine=False))
    _write(HERE / "small", small, _overhead(rng, (1, 4, 16), 2, samples=False),
           {"name": "small", "quick": True, "overhead_budget": 0.25})


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["rerun"]:
        rerun()
    else:
        main()
        rerun()
