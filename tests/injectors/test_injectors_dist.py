"""Every fault site on real 3-rank gloo runs: its record, its effect, and what the guard sees.

Each test spawns 3 ranks once and runs several independent trials in them
(``tests/workers.py``); a trial without faults is the golden run.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from injectors import Fault
from sdc_guard import read_events
from tests import workers
from tests.launch import run_ranks

pytestmark = pytest.mark.timeout(240)

WORLD = 3
STEPS = 4
AUDIT = {"replay_interval": 1, "deterministic": True}


def _records(res: list[list[dict[str, Any]]], trial: int) -> list[list[dict[str, Any]]]:
    return [res[r][trial]["records"] for r in range(WORLD)]


def _only_on(res: list[list[dict[str, Any]]], trial: int, rank: int, n: int = 1) -> dict[str, Any]:
    """The trial's records exist on ``rank`` only (``n`` of them); return the first."""
    recs = _records(res, trial)
    assert [len(r) for r in recs] == [n if q == rank else 0 for q in range(WORLD)]
    assert [res[q][trial]["armed"][0] for q in range(WORLD)] == [q == rank for q in range(WORLD)]
    return recs[rank][0]


def _clean(res: list[list[dict[str, Any]]]) -> None:
    assert all(t["clean"] for per_rank in res for t in per_rank)


def test_weight_state_and_reduced_gradient_sites_are_caught_by_the_weights_check(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    report = {"repair_by_majority": False}  # report only: the corruption stays, every step
    trials: list[dict[str, Any]] = [
        {"steps": STEPS, "cfg": {"event_log": str(log), **report},
         "faults": [Fault(site="weight_storage", rank=1, step=2, target="2.weight", index=5,
                          bits=(0,))]},
        {"steps": STEPS, "cfg": report,
         "faults": [Fault(site="gradient_after_allreduce", rank=2, step=2, target="4.bias",
                          index=1, bits=(22,))]},
        {"steps": STEPS, "cfg": {"include_optimizer_state": True, **report},
         "faults": [Fault(site="optimizer_state", rank=0, step=2, target="0.weight",
                          state_key="exp_avg_sq", index=7, bits=(20,))]},
        {"steps": STEPS, "opt": "sgd", "cfg": {"include_optimizer_state": True, **report},
         "faults": [Fault(site="optimizer_state", rank=1, step=2, target="0.bias",
                          state_key="momentum_buffer", bits=(20,))]},
    ]
    res = run_ranks(workers.guard_trials, WORLD, trials)
    _clean(res)
    for trial, rank in enumerate([1, 2, 0, 1]):
        rec = _only_on(res, trial, rank)
        fault = trials[trial]["faults"][0]
        assert (rec["site"], rec["step"], rec["target"]) == (fault.site, 2, fault.target)
        assert rec["dtype"] == "float32" and rec["before"] != rec["after"]
        for r in range(WORLD):
            dets = res[r][trial]["detections"]
            # Silent until the fault, then the weights check names the faulty rank every step.
            assert dets == [("weights", s, (rank,)) for s in range(2, STEPS)], (trial, r, dets)
    # The weight-storage flip of bit 0 is the smallest change a float32 can take.
    rec = _records(res, 0)[1][0]
    assert rec["bits"] == [0] and rec["before"][0] ^ rec["after"][0] == 1
    # The record names the optimizer state entry (index drawn from the seed for SGD).
    assert _records(res, 2)[0][0]["state_key"] == "exp_avg_sq"
    sgd = _records(res, 3)[1][0]
    assert sgd["state_key"] == "momentum_buffer" and 0 <= sgd["index"] < 32
    # Ground truth in the guard's event log, next to the detections.
    events = read_events(log)
    injections = [e for e in events if e["event"] == "injection"]
    assert len(injections) == 1 and injections[0]["rank"] == 1
    assert injections[0]["before"] == rec["before"]
    assert any(e["event"] == "detection" for e in events)


def test_gradient_before_allreduce_nonfinite_is_caught_finite_is_averaged_in() -> None:
    trials = [
        {"steps": STEPS},  # golden
        {"steps": STEPS,
         "faults": [Fault(site="gradient_before_allreduce", rank=1, step=1, target="2.weight",
                          kind="set", value=float("nan"))]},
        # Every exponent bit of an exactly-zero gradient (an always-zero input feature): ±Inf.
        {"steps": STEPS,
         "faults": [Fault(site="gradient_before_allreduce", rank=2, step=1, target="0.weight",
                          index=workers.PADDING_FEATURE, field="exponent", count=None)]},
        # A finite flip (top mantissa bit of a logit bias gradient).
        {"steps": STEPS,
         "faults": [Fault(site="gradient_before_allreduce", rank=0, step=1, target="4.bias",
                          index=0, bits=(22,))]},
    ]
    res = run_ranks(workers.guard_trials, WORLD, trials)
    _clean(res)
    golden = [res[r][0] for r in range(WORLD)]
    assert all(g["detections"] == [] for g in golden)
    for trial, rank in ((1, 1), (2, 2)):
        _only_on(res, trial, rank)
        for r in range(WORLD):
            assert res[r][trial]["detections"] == [("nonfinite", 1, (rank,))]
            assert res[r][trial]["skipped"] == [1]  # contained: the step was withheld
        assert len({res[r][trial]["final"] for r in range(WORLD)}) == 1
    inf = _records(res, 2)[2][0]
    assert inf["bits"] == list(range(23, 31))
    assert inf["before"][0] in (0, 0x8000_0000) and inf["after"][0] in (0x7F80_0000, 0xFF80_0000)
    nan = _records(res, 1)[1][0]
    assert nan["after"] == [0x7FC0_0000]
    # The finite flip is averaged into every rank: weights stay identical (no detection),
    # yet all of them left the golden trajectory. Only the replay audit can see this.
    _only_on(res, 3, 0)
    finite = [res[r][3] for r in range(WORLD)]
    assert all(t["detections"] == [] for t in finite)
    assert len({t["final"] for t in finite}) == 1
    assert finite[0]["final"] != golden[0]["final"]
    assert finite[0]["grads"][1] != golden[0]["grads"][1]
    assert [finite[r]["grads"][1] == golden[r]["grads"][1] for r in (1, 2)] == [True, True]


def test_activation_sites_change_only_the_faulty_ranks_local_computation() -> None:
    trials = [
        {"steps": STEPS},  # golden
        {"steps": STEPS,
         "faults": [Fault(site="activation", rank=1, step=1, target="4", index=2, bits=(23,))]},
        {"steps": STEPS,
         "faults": [Fault(site="activation_grad", rank=2, step=1, target="4", index=2,
                          bits=(23,))]},
        {"steps": STEPS,
         "faults": [Fault(site="activation", rank=0, step=2, target="2", kind="random",
                          model="permanent", burst=3, seed=11)]},
        # Without a replay audit there is no replay phase: the fault never fires.
        {"steps": STEPS,
         "faults": [Fault(site="activation", rank=0, step=0, target="4", bits=(30,),
                          model="permanent", phase="replay")]},
        # With the audit: a fault in rank 1's own step, then one in its replay of rank 2's
        # batch. Both are localised to rank 1 and the step is withheld.
        *({"steps": 3, "cfg": AUDIT,
           "faults": [Fault(site="activation", rank=1, step=1, target="4", index=2, bits=(23,),
                            phase=phase)]} for phase in ("train", "replay")),
    ]
    res = run_ranks(workers.guard_trials, WORLD, trials)
    _clean(res)
    golden = [res[r][0] for r in range(WORLD)]
    # activation: rank 1's loss at step 1 changes, nobody else's; then the averaged
    # gradient moves every rank off the golden run, identically (no detection).
    act = [res[r][1] for r in range(WORLD)]
    assert _only_on(res, 1, 1)["phase"] == "train"
    for r in range(WORLD):
        assert act[r]["losses"][0] == golden[r]["losses"][0]
        assert (act[r]["losses"][1] == golden[r]["losses"][1]) == (r != 1)
        assert act[r]["detections"] == []
    assert len({a["final"] for a in act}) == 1 and act[0]["final"] != golden[0]["final"]
    # activation_grad: losses unchanged at the step, rank 2's local gradients changed.
    agr = [res[r][2] for r in range(WORLD)]
    rec = _only_on(res, 2, 2)
    assert rec["before"][0] ^ rec["after"][0] == 1 << 23
    for r in range(WORLD):
        assert agr[r]["losses"][1] == golden[r]["losses"][1]
        assert (agr[r]["grads"][1] == golden[r]["grads"][1]) == (r != 2)
        assert agr[r]["detections"] == []
    # permanent: one record per step from step 2 on, same elements every time.
    perm = _records(res, 3)[0]
    assert [p["step"] for p in perm] == [2, 3]
    assert len({p["index"] for p in perm}) == 1 and all(len(p["after"]) == 3 for p in perm)
    # phase="replay" without an audit: nothing fired, bit-identical to golden.
    assert all(not recs for recs in _records(res, 4))
    assert [res[r][4]["final"] for r in range(WORLD)] == [g["final"] for g in golden]
    # Under the replay audit, the fault's phase picks which computation it corrupts.
    for trial, phase in ((5, "train"), (6, "replay")):
        assert _only_on(res, trial, 1)["phase"] == phase
        for r in range(WORLD):
            assert res[r][trial]["detections"] == [("replay", 1, (1,))], (phase, r)
            assert res[r][trial]["skipped"] == [1]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_faults_in_a_compiled_module_are_seen_in_their_step_only() -> None:
    # A hook on the faulty rank alone, traced by torch.compile, was recompiled at every step
    # and then fell back to eager kernels there: the replay told that rank's results apart
    # from its neighbours' at every audit step, before and after a transient fault. The
    # hooks now run eagerly, and the other ranks hold an inert one at the same place.
    faults = [Fault(site="activation", rank=1, step=3, target="_orig_mod.3", index=2,
                    bits=(30,)),
              Fault(site="linear_product", rank=1, step=3, target="_orig_mod.2", index=2,
                    bits=(30,))]
    res = run_ranks(workers.guard_trials, WORLD,
                    [{"steps": 8, "cfg": AUDIT, "compile": True, "gelu": True, "faults": [f]}
                     for f in faults],
                    timeout=600)
    _clean(res)
    for trial, _ in enumerate(faults):
        assert _only_on(res, trial, 1)["step"] == 3
        for r in range(WORLD):
            assert res[r][trial]["detections"] == [("replay", 3, (1,))], (trial, r)
            assert res[r][trial]["skipped"] == [3]


# Arming checks the fault against the model on every rank, not only on the fault's rank.
BAD_FAULTS = [
    Fault(site="weight_storage", rank=3, step=0, target="0.weight", bits=(1,)),
    Fault(site="activation", rank=1, step=0, target="5", bits=(1,)),
    Fault(site="gradient_after_allreduce", rank=2, step=0, target="4.bais", bits=(1,)),
    Fault(site="gradient_before_allreduce", rank=1, step=0, target="4.bias", index=4,
          bits=(1,)),
    Fault(site="optimizer_state", rank=0, step=0, target="0.bias", state_key="exp_avg",
          bits=(1,)),
    Fault(site="weight_storage", rank=1, step=0, target="module.0.weight", bits=(1,)),
]


def test_plain_loop_without_a_guard_and_arming_validates_on_every_rank(tmp_path: Path) -> None:
    log = tmp_path / "plain.jsonl"
    intermittent = Fault(site="gradient_before_allreduce", rank=0, step=1, target="4.bias",
                         kind="zero", burst=4, model="intermittent", p=0.5, seed=7)
    steps = 8
    trials = [
        {"steps": STEPS},  # golden
        {"steps": STEPS, "events": str(log),
         "faults": [Fault(site="gradient_after_allreduce", rank=1, step=1, target="2.weight",
                          bits=(22,), index=3),
                    Fault(site="weight_storage", rank=2, step=2, target="4.bias", bits=(22,))]},
        {"steps": steps, "faults": [intermittent]},
    ]
    out = run_ranks(workers.plain_trials, WORLD, trials, BAD_FAULTS)
    res = [trials_of_rank for trials_of_rank, _ in out]
    _clean(res)
    golden = [res[r][0] for r in range(WORLD)]
    two = [res[r][1] for r in range(WORLD)]
    # Step 1: rank 1's reduced gradient is corrupted (its weights only); step 2: rank 2's
    # weights are. The step-2 losses show exactly those two ranks off the golden run;
    # rank 2's gradients are averaged into everyone, so at the end all three differ.
    for r in range(WORLD):
        assert two[r]["losses"][:2] == golden[r]["losses"][:2]
        assert (two[r]["losses"][2] == golden[r]["losses"][2]) == (r == 0)
    assert len({t["final"] for t in two}) == 3
    assert two[0]["records"] == []
    assert [(r["site"], r["step"]) for r in two[1]["records"]] == [("gradient_after_allreduce", 1)]
    assert [(r["site"], r["step"]) for r in two[2]["records"]] == [("weight_storage", 2)]
    assert two[1]["armed"] == [True, False] and two[2]["armed"] == [False, True]
    logged = sorted((e["rank"], e["site"]) for e in read_events(log))
    assert logged == [(1, "gradient_after_allreduce"), (2, "weight_storage")]
    # Intermittent: fires exactly at the steps its seed says, on rank 0 only.
    recs = res[0][2]["records"]
    expected = [s for s in range(steps) if intermittent.active_at(s)]
    assert [r["step"] for r in recs] == expected and 0 < len(expected) < steps - 1
    assert res[0][2]["sink"] == recs
    assert all(r["after"] == [0, 0, 0, 0] for r in recs)
    assert res[1][2]["records"] == [] and res[2][2]["records"] == []
    for r, (_, errors) in enumerate(out):
        assert "Fault.rank: rank 3 does not exist" in errors[0]
        assert "no module '5'" in errors[1]
        assert "close matches: ['4.bias'" in errors[2]
        assert "Fault.index: element 4" in errors[3]
        assert "Fault.site: 'optimizer_state' needs the optimizer" in errors[4]
        assert errors[5] == f"armed={r == 1}"  # a DDP-qualified name; inert off rank 1
