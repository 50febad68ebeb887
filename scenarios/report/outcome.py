"""Outcomes: a trial's per-rank results compared with its scenario's golden run.

Definitions (each trial gets exactly one outcome, checked in this order):

``hung``
    Some rank did not answer within the scenario's ``trial_timeout_s``.
``crashed`` (from an exception)
    Some rank raised or died, and no check had fired before (the pool reports it).
``detected``
    At least one check fired. ``detect_step`` is the first step with a detection (the
    step it happened at: the non-finite check reports a few steps later);
    ``check`` is the first check that fired there, in the order the checks run within
    a step (nonfinite, checksum, replay, weights), and ``checks`` all of them.
    ``blame_correct``: the union of the suspect ranks of the detections at
    ``detect_step`` is exactly the set of ranks where an injection fired.
``crashed`` (non-finite)
    No detection, but some rank's training loss was NaN or Inf at some step.
``masked``
    No detection, finite losses, and every rank's final state fingerprint equals
    the golden run's: the run ended bit-identical to golden.
``escaped``
    None of the above: the final state differs from golden and no check fired.
    ``rel_weight_dev`` (max over ranks of ``||w - w_golden|| / ||w_golden||``)
    and ``loss_diff`` (mean over ranks of the final loss minus golden's) say by how much.

State = parameters + optimizer state (``sdc_guard.state_tensors``: what
the weights check compares); BatchNorm running statistics are not part of it
(DDP re-broadcasts them from rank 0 at every forward).

Divergence: step ``s`` *diverged* when some rank's state after step ``s``
differs from the expected state: golden's state after ``s``, or, at a step
the guard withheld (``skipped``), golden's state *before* ``s`` (a withheld
step must leave the state untouched). ``first_divergence`` is the first such step.

Containment: a detection is *contained* when its step was withheld on every
rank and no step up to and including it diverged: every rank's weights and
optimizer state are still exactly golden's from before the faulty step, so
the corruption never reached them (the state equals that of a run that
skipped the step).

Same step: ``same_step`` is true when the first detection came in a step at which an
injection fired and nothing diverged before that step: every firing that had an
effect was caught in its own step (earlier firings of an intermittent or permanent
fault may have been masked, e.g. a NaN gradient at a ReLU's inactive input, which
its backward replaces by 0).

Quarantine (scenarios with ``[quarantine]``): ``cordoned_nodes`` are the nodes the trial's
``KubeQuarantine`` cordoned on the API stand-in (or, in a dry run, would have); each rank
``r`` stands for node ``node-<r>``. ``cordon_correct``: they are nodes of ranks where an
injection fired, and there are some exactly when a detection convicted a rank (an unrepaired
detection with suspects that is not ``transient``; a first repair in place does not
quarantine, nor does a fault the tolerant replay audit found transient). ``breaker_tripped``: the circuit
breaker refused a detection. ``fault_to_cordon_s``: wall seconds from the start of the first
step an injection fired in (on the injected rank) to the first cordon.
``quarantine_errors``: API calls that failed for good, over all ranks. Empty without ``[quarantine]``.

Recovery (scenarios with ``[recovery]``): trials train to the last step; at the first
unrepaired detection the faults are disarmed (the node replaced) and the run restored from the
newest checkpoint before the suspect window. ``rollback_step``: the step training resumed at;
``wasted_steps``: steps trained and thrown away (the reporting step + 1 - ``rollback_step``;
0 without a rollback); ``fault_to_resume_s``: wall seconds from the start of the first
faulty step to the resumed training; ``final_matches_golden``: every rank's final parameters
and optimizer state are bit-identical to the golden run's (under FSDP2: every shard of every
replica); ``saves_refused``: checkpoints the manager refused to write (a sharded save whose
HSDP replicas differ, a fault not reported yet: an older checkpoint serves the rollback). The
outcome and the other columns describe the run as it first went, up to the rollback.

Latency: ``latency_from_injection = detect_step - first_injection`` (the first
step at which an injection fired) and ``latency_from_divergence = detect_step -
first_divergence`` (empty when contained: nothing diverged).
"""

from __future__ import annotations

import json
import math
from typing import Any

from injectors.bits import dtype_from_name, value_of
from scenarios.run.store import GoldenRun
from scenarios.spec.trials import TrialSpec

_CHECK_ORDER = {"nonfinite": 0, "checksum": 1, "replay": 2, "weights": 3}
"""The order in which the checks reach their verdicts within a step (the checksum's entries are
verified during the backward pass, before the replay audit's pre-step vote)."""


def _nonfinite_records(records: list[dict[str, Any]]) -> bool:
    """Whether any injection wrote a NaN or an Inf (decoded from the recorded raw words)."""
    for rec in records:
        dtype = dtype_from_name(rec["dtype"])
        if not dtype.is_floating_point:
            continue
        for word in rec["after"]:
            v = value_of(word, dtype)
            if isinstance(v, float) and not math.isfinite(v):
                return True
    return False


def base_row(trial: TrialSpec) -> dict[str, Any]:
    """The columns known before the trial runs (what was injected where)."""
    f = trial.faults[0] if trial.faults else None
    return {
        "id": trial.id, "scenario": trial.scenario, "kind": trial.kind,
        "site": trial.site or None, "field": trial.field or None,
        "fault_model": trial.fault_model or None,
        "pattern": trial.pattern if trial.faults else None,
        "fault_rank": f.rank if f else (trial.chaos.rank if trial.chaos else None),
        "fault_step": f.step if f else (trial.chaos.step if trial.chaos else None),
        "target": f.target if f else None, "state_key": f.state_key if f else None,
        "replay_interval": trial.replay_interval,
        "checksum": trial.checksum,
        "deterministic": trial.deterministic,
        "product": f.product if f else None,
        "parallel": trial.parallel,
        "fault": [x.to_dict() for x in trial.faults] if trial.faults else (
            {"chaos": trial.chaos.action} if trial.chaos else None),
    }


def failed_row(trial: TrialSpec, kind: str, reason: str, seconds: float) -> dict[str, Any]:
    """A trial that ended without answers from every rank: "crashed", "hung" or "lost" (a
    rank killed by a signal the harness did not send; the runner retries it once, and a
    second loss stays "lost": listed apart and left out of every number of the report)."""
    return {**base_row(trial), "outcome": kind, "error": reason[:500], "seconds": seconds}


def _quarantine(results: list[dict[str, Any]], records: list[dict[str, Any]],
                first_inj: int | None, injected_ranks: list[int]) -> dict[str, Any]:
    """The quarantine columns (see the module doc); {} when the trial ran without one."""
    if all(r.get("quarantine") is None for r in results):
        return {}
    actions = [a for r in results for a in r.get("quarantine") or []]
    cordons = [a for a in actions if a["action"] == "cordon"]
    nodes = sorted({a["node"] for a in cordons})
    acquitted = {(c, s) for c, s in [*results[0].get("repaired", []),
                                     *results[0].get("transient", [])]}
    convicted = any(sus and (c, s) not in acquitted for c, s, sus in results[0]["detections"])
    out: dict[str, Any] = {
        "cordoned_nodes": nodes,
        # Only the injected ranks' nodes, and some exactly when a detection convicted a rank.
        "cordon_correct": set(nodes) <= {f"node-{r}" for r in injected_ranks}
        and bool(nodes) == convicted,
        "breaker_tripped": any(a["action"] == "breaker" for a in actions),
        "quarantine_errors": sum(1 for a in actions if a["action"] == "error"),
    }
    started = _fault_started(results, records, first_inj)
    if cordons and started is not None:
        out["fault_to_cordon_s"] = round(min(a["time"] for a in cordons) - started, 4)
    return out


def _fault_started(results: list[dict[str, Any]], records: list[dict[str, Any]],
                   first_inj: int | None) -> float | None:
    """Wall time at which the first faulty step began, on the rank the injection fired on."""
    if first_inj is None:
        return None
    rank = next(int(x["rank"]) for x in records if int(x["step"]) == first_inj)
    return float(next(r for r in results if r["rank"] == rank)["step_started"][first_inj])


def _recovery(results: list[dict[str, Any]], golden: GoldenRun, records: list[dict[str, Any]],
              first_inj: int | None) -> dict[str, Any]:
    """The recovery columns (see the module doc); {} when the trial ran without ``[recovery]``."""
    rec: list[dict[str, Any]] = [r["recovery"] for r in results if r.get("recovery") is not None]
    if len(rec) < len(results):
        return {}
    out: dict[str, Any] = {
        "final_matches_golden": all(x["final_fp"] == golden.state_fps[-1] for x in rec),
        "rollback_step": rec[0].get("rollback_step"),
        "wasted_steps": rec[0].get("wasted_steps", 0),
        "saves_refused": len(rec[0].get("saves_refused", [])),
    }
    started = _fault_started(results, records, first_inj)
    if "resumed_at" in rec[0] and started is not None:
        out["fault_to_resume_s"] = round(rec[0]["resumed_at"] - started, 4)
    return out


def classify(trial: TrialSpec, golden: GoldenRun, results: list[dict[str, Any]],
             seconds: float) -> dict[str, Any]:
    """The outcome row of a trial whose ranks all answered."""
    row = base_row(trial)
    steps_total = len(golden.state_fps)
    records = [rec for r in results for rec in r["records"]]
    injected_ranks = sorted({int(rec["rank"]) for rec in records})
    inj_steps = sorted({int(rec["step"]) for rec in records})
    first_inj = inj_steps[0] if inj_steps else None
    dets = [tuple(d) for d in results[0]["detections"]]
    if any([tuple(d) for d in r["detections"]] != dets for r in results):
        row["error"] = "ranks disagree on the detections: " + json.dumps(
            [r["detections"] for r in results])
    skipped = set(results[0]["skipped"])
    n = min(len(r["state_fps"]) for r in results)

    def expected(s: int) -> int:
        if s in skipped:
            return golden.state_fps[s - 1] if s > 0 else golden.initial_fp
        return golden.state_fps[s]

    diverged = [s for s in range(n) if any(r["state_fps"][s] != expected(s) for r in results)]
    first_div = diverged[0] if diverged else None
    nonfinite_loss = [r["rank"] for r in results if any(not math.isfinite(x) for x in r["losses"])]
    repaired_at = {(c, s) for c, s in results[0].get("repaired", [])}
    first = min((step for _, step, _ in dets), default=None)
    repaired = first is not None and all((c, s) in repaired_at for c, s, _ in dets if s == first)
    transient_at = {(c, s) for c, s in results[0].get("transient", [])}
    transient = first is not None and all((c, s) in transient_at for c, s, _ in dets
                                          if s == first)
    row.update(_quarantine(results, records, first_inj, injected_ranks))
    row.update(_recovery(results, golden, records, first_inj))
    if records:  # the first firing's flipped bits and the value it hit (the per-bit tables)
        rec0 = min(records, key=lambda rec: (int(rec["step"]), int(rec["rank"])))
        row["bits"] = list(rec0.get("bits") or [])
        row["injected_dtype"] = rec0.get("dtype")
        if rec0.get("before"):
            row["injected_value"] = value_of(int(rec0["before"][0]),
                                             dtype_from_name(rec0["dtype"]))
    row.update({
        "injections": len(records), "first_injection": first_inj,
        "injected_ranks": injected_ranks, "nonfinite_injected": _nonfinite_records(records),
        "first_divergence": first_div, "steps_run": n, "seconds": round(seconds, 4),
        "skipped": sorted(skipped),
    })
    if dets:
        d = min(step for _, step, _ in dets)
        # In the order the checks run within a step (the non-finite check reports its
        # detections a few steps later, but they are of this step all the same).
        at = sorted((x for x in dets if x[1] == d), key=lambda x: _CHECK_ORDER.get(x[0], 99))
        suspects = sorted({r for _, _, sus in at for r in sus})
        contained = d in skipped and (first_div is None or first_div > d)
        row.update({
            "outcome": "detected", "check": at[0][0], "checks": "+".join(c for c, _, _ in at),
            "repaired": repaired, "transient": transient,
            "detect_step": d, "suspects": suspects,
            "blame_correct": (suspects == injected_ranks) if injected_ranks else None,
            "contained": contained,
            "same_step": d in inj_steps and (first_div is None or first_div >= d),
            "latency_from_injection": d - first_inj if first_inj is not None else None,
            "latency_from_divergence": (d - first_div if first_div is not None
                                        and first_div <= d else None),
        })
        return row
    if nonfinite_loss:
        row.update({"outcome": "crashed",
                    "error": f"non-finite training loss on rank(s) {nonfinite_loss}"})
        return row
    final_ok = n == steps_total and all(r["state_fps"][n - 1] == golden.state_fps[-1]
                                        for r in results)
    if final_ok:
        row["outcome"] = "masked"
        return row
    devs = [r["rel_weight_dev"] for r in results if r.get("rel_weight_dev") is not None]
    finals = [(r["losses"][-1], golden.losses[r["rank"]][-1]) for r in results if r["losses"]]
    row.update({
        "outcome": "escaped",
        "rel_weight_dev": max(devs) if devs else None,
        "loss_diff": (sum(a - b for a, b in finals) / len(finals)) if finals else None,
    })
    return row
