"""The runner on real gloo ranks: the persistent pool, crashes and hangs, resume after SIGKILL,
and torchrun. Tiny models and few steps: each test takes seconds to a minute on 2 cores."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from injectors import Fault
from scenarios.run.runner import CampaignRunner, PoolExecutor
from scenarios.spec.campaign import campaign_for_scenario, load_campaign
from scenarios.spec.scenario import scenario_from_dict
from scenarios.spec.trials import Chaos, TrialSpec, plan_trials
from tests.launch import free_port, scaled

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = f"""
world_size = 3
steps = 6
batch = 16
trial_timeout_s = {scaled(30)}
[model]
kind = "mlp"
width = 16
[optimizer]
kind = "adamw"
lr = 0.01
[guard]
replay_interval = 1
"""


def _fault(**kw: Any) -> TrialSpec:
    f = Fault(**kw)
    return TrialSpec(id=f"t{kw['site']}{kw['rank']}", scenario="tiny", replay_interval=1,
                     faults=(f,), site=f.site, field="custom", fault_model=f.model)


def test_pool_trials_crashes_and_hangs(tmp_path: Path) -> None:
    sc = scenario_from_dict({"world_size": 3, "steps": 6, "batch": 16, "trial_timeout_s": scaled(10),
                             "model": {"kind": "mlp", "width": 16}}, name="tiny")
    executor = PoolExecutor()
    runner = CampaignRunner(campaign_for_scenario(sc), tmp_path, executor, progress=False)
    try:
        runner.goldens["tiny"] = golden = runner.golden(sc)
        assert golden.ranks_agree and golden.detections == [] and len(golden.state_fps) == 6
        clean = TrialSpec(id="c", scenario="tiny", replay_interval=1)
        assert runner.trial(clean)["outcome"] == "masked"  # type: ignore[index]
        ws = runner.trial(_fault(site="weight_storage", rank=1, step=2, target="net.2.weight",
                                 bits=(30,)))
        assert ws is not None
        assert (ws["outcome"], ws["detect_step"], ws["suspects"], ws["blame_correct"],
                ws["latency_from_injection"]) == ("detected", 2, [1], True, 0)
        # at the last step (no replay audit): the weights vote of the state it left is
        # judged by flush, and its repair is reported like any other
        f = Fault(site="weight_storage", rank=1, step=5, target="net.2.weight", bits=(30,))
        last = runner.trial(TrialSpec(id="last", scenario="tiny", replay_interval=0,
                                      faults=(f,), site=f.site, field="custom",
                                      fault_model=f.model))
        assert last is not None
        assert (last["detect_step"], last["suspects"], last["repaired"]) == (5, [1], True)
        nan = runner.trial(_fault(site="gradient_before_allreduce", rank=2, step=3,
                                  target="net.0.weight", kind="set", value=float("nan")))
        assert nan is not None
        assert (nan["check"], nan["contained"], nan["nonfinite_injected"]) == (
            "nonfinite", True, True)
        act = runner.trial(_fault(site="activation", rank=0, step=4, target="net.1",
                                  index=0, bits=(22,)))
        assert act is not None and act["outcome"] in ("detected", "masked")
        pids = executor.pools[(3, "auto")].pids
        for action, outcome in (("raise", "crashed"), ("exit", "crashed"), ("hang", "hung")):
            row = runner.trial(TrialSpec(id=action, scenario="tiny", replay_interval=1,
                                         chaos=Chaos(action=action, rank=1, step=2)))
            assert row is not None and row["outcome"] == outcome, row
            assert row["fault_rank"] == 1 and row["error"]
            # the pool was killed; the next trial starts a fresh one and still matches golden
            assert runner.trial(clean)["outcome"] == "masked"  # type: ignore[index]
        assert executor.restarts == 3
        assert not set(pids) & set(executor.pools[(3, "auto")].pids)
    finally:
        executor.close()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid)



def test_overhead_rounds_keep_samples_for_every_configuration(tmp_path: Path) -> None:
    """``overhead.json`` holds per-round times for every configuration the rounds alternate,
    so the report gives every check's overhead an interval, not only the replay audit's."""
    from dataclasses import replace

    from scenarios.report.overheads import CHECK_NAMES, round_draws, rounds_of, used
    from scenarios.spec.campaign import OverheadSpec
    from scenarios.spec.overhead import campaign_configs

    sc = scenario_from_dict({"world_size": 3, "steps": 2, "batch": 4,
                             "trial_timeout_s": scaled(30),
                             "model": {"kind": "mlp", "width": 4, "depth": 1}}, name="tiny")
    campaign = replace(campaign_for_scenario(sc),
                       overhead=OverheadSpec(rounds=2, block=1, intervals=(1,)))
    executor = PoolExecutor()
    try:
        ov = CampaignRunner(campaign, tmp_path, executor, progress=False).overhead()
    finally:
        executor.close()
    assert ov is not None
    names = {oc.name for oc in campaign_configs((1,))}
    assert set(ov["samples_ms"]) == set(ov["step_ms"]) == names
    assert all(len(v) == 2 and min(v) > 0 for v in ov["samples_ms"].values()), ov["samples_ms"]
    priced = used(ov, {}, {}, {}, round_draws(rounds_of(ov)))
    for key in CHECK_NAMES:
        assert priced[key]["interval_90"] is not None, (key, priced[key])


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("variant", [
    {"model": {"kind": "cnn_bn", "width": 4}, "dtype": "bfloat16", "micro_batches": 2,
     "optimizer": {"kind": "sgd", "lr": 0.05}},
    {"model": {"kind": "transformer", "width": 16, "depth": 1}, "batch": 4},
])
def test_other_models_dtypes_and_accumulation(tmp_path: Path, variant: dict[str, Any]) -> None:
    sc = scenario_from_dict({"world_size": 3, "steps": 4, "batch": 8, "trial_timeout_s": scaled(60),
                             **variant}, name="tiny")
    param = sc.targets("weight_storage")[0]
    executor = PoolExecutor()
    runner = CampaignRunner(campaign_for_scenario(sc), tmp_path, executor, progress=False)
    try:
        runner.goldens["tiny"] = golden = runner.golden(sc)
        assert golden.ranks_agree and golden.detections == []
        for k in (0, 2):  # clean trials with and without the replay audit match one golden run
            row = runner.trial(TrialSpec(id=f"c{k}", scenario="tiny", replay_interval=k))
            assert row is not None and row["outcome"] == "masked", row
        row = runner.trial(_fault(site="weight_storage", rank=2, step=1, target=param,
                                  field="exponent"))
        assert row is not None
        assert (row["outcome"], row["detect_step"], row["suspects"]) == ("detected", 1, [2])
    finally:
        executor.close()


def test_muon_with_adamw_trains_clean_and_its_states_are_covered(tmp_path: Path) -> None:
    # optimizer.kind = "muon": Muon for the matrices, AdamW for the rest, both under the
    # guard; a flip in either one's state is caught on its rank.
    sc = scenario_from_dict({"world_size": 3, "steps": 4, "batch": 8, "trial_timeout_s": scaled(60),
                             "model": {"kind": "mlp", "width": 16},
                             "optimizer": {"kind": "muon", "lr": 0.02}}, name="tiny")
    executor = PoolExecutor()
    runner = CampaignRunner(campaign_for_scenario(sc), tmp_path, executor, progress=False)
    try:
        runner.goldens["tiny"] = golden = runner.golden(sc)
        assert golden.ranks_agree and golden.detections == []
        for k in (0, 2):
            row = runner.trial(TrialSpec(id=f"c{k}", scenario="tiny", replay_interval=k))
            assert row is not None and row["outcome"] == "masked", row
        for target, key in (("net.0.weight", "momentum_buffer"), ("net.2.bias", "exp_avg")):
            row = runner.trial(_fault(site="optimizer_state", rank=1, step=2, target=target,
                                      state_key=key, field="exponent"))
            assert row is not None
            assert (row["outcome"], row["suspects"]) == ("detected", [1]), (target, row)
    finally:
        executor.close()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: the ranks are the fork server's children, not the
    campaign's."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(stat.parent.name)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _campaign(tmp_path: Path) -> Path:
    (tmp_path / "tiny.toml").write_text(SCENARIO)
    camp = tmp_path / "camp.toml"
    camp.write_text("""
scenarios = ["tiny.toml"]
clean_trials = 1
[matrix]
sites = ["weight_storage", "gradient_before_allreduce", "activation"]
fields = ["sign", "exponent"]
steps = [2]
ranks = [1]
replay_intervals = [0, 1]
[overhead]
intervals = [1]
rounds = 1
block = 2
""")
    return camp


def _ids(path: Path) -> list[str]:
    with path.open() as fh:
        return [r["id"] for r in csv.DictReader(fh)]


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """``python -m scenarios ARGV`` in this process: its exit status and what it printed to
    stderr. The tests start a separate interpreter only where that process is the point (it
    is killed, or several run at once as the Indexed Job's pods do); elsewhere the command's
    own code in this process proves the same and saves the start of an interpreter with
    torch, scipy and matplotlib (``test_cli_subprocess_has_no_traceback`` runs the entry
    point itself)."""
    from scenarios.cli import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_killed_campaign_resumes_without_loss_or_duplicates(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    camp = _campaign(tmp_path)
    planned = [t.id for t in plan_trials(load_campaign(camp))]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "scenarios", "campaign", str(camp), "--out", str(out),
           "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    csv_path = out / "trials.csv"
    deadline = time.monotonic() + scaled(200)
    while time.monotonic() < deadline and proc.poll() is None:
        if csv_path.exists() and csv_path.read_text().count("\n") >= 4:
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the campaign finished before it could be killed"
    ranks = _descendants(proc.pid)
    assert len(ranks) >= 3  # the ranks (and the fork server)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=scaled(30))
    killed_with = _ids(csv_path)
    assert 3 <= len(killed_with) < len(planned)
    with csv_path.open("a") as fh:  # as if the kill had torn the last write
        fh.write(planned[-1][:5])
    # The ranks end with the coordinator (they watch its pid), then the server: seconds on an
    # idle machine, longer on a loaded one, but they end.
    alive = ranks
    deadline = time.monotonic() + scaled(60)
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in ranks if Path(f"/proc/{p}").exists() and not _zombie(p)]
    assert alive == []
    code, err = _cli(capsys, *cmd[3:])  # the same command again: it resumes
    assert code == 0, err[-2000:]
    ids = _ids(csv_path)
    assert sorted(ids) == sorted(planned) and len(ids) == len(set(ids))
    assert ids[:len(killed_with)] == killed_with  # nothing before the kill was rewritten
    for name in ("summary.json", "report.md", "report.html", "overhead.json", "campaign.json"):
        assert (out / name).exists(), name


def test_quarantine_cordons_the_faulty_ranks_node_and_nothing_on_clean_trials(
        tmp_path: Path) -> None:
    """``[quarantine]``: each trial gets its own API stand-in with a node per rank; the row
    says which nodes were cordoned, whether they are the injected rank's, and how long after
    the fault's step began."""
    sc = scenario_from_dict({"world_size": 3, "steps": 6, "batch": 16, "trial_timeout_s": scaled(30),
                             "model": {"kind": "mlp", "width": 16},
                             "quarantine": {"max_nodes": 1}}, name="tiny")
    executor = PoolExecutor()
    runner = CampaignRunner(campaign_for_scenario(sc), tmp_path, executor, progress=False)
    try:
        runner.goldens["tiny"] = runner.golden(sc)
        clean = runner.trial(TrialSpec(id="c", scenario="tiny", replay_interval=1))
        assert clean is not None and clean["outcome"] == "masked"
        assert (clean["cordoned_nodes"], clean["breaker_tripped"]) == ([], False)
        for rank in (1, 2):  # a fresh stand-in per trial: the second is not a breaker trip
            row = runner.trial(_fault(site="weight_storage", rank=rank, step=2,
                                      target="net.2.weight", bits=(30,)))
            assert row is not None and row["outcome"] == "detected"
            assert row["cordoned_nodes"] == [f"node-{rank}"] and row["cordon_correct"] is True
            assert row["breaker_tripped"] is False and row["quarantine_errors"] == 0
            assert 0 < row["fault_to_cordon_s"] < sc.trial_timeout_s
    finally:
        executor.close()


@pytest.mark.parametrize(("config", "expect"), [
    ("recovery.toml", {"rolled_back": True, "repaired": False, "cordoned_nodes": ["node-1"],
                       "suspect_nodes": ["node-1"]}),
    ("recovery_repair.toml", {"rolled_back": False, "repaired": True, "cordoned_nodes": [],
                              "wasted_steps": 0, "final_matches_golden": False}),
])
def test_recovery_scenarios_end_bit_identical_to_the_fault_free_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str,
        expect: dict[str, Any]) -> None:
    """``python -m scenarios run`` of the shipped recovery scenarios: a permanent fault is
    quarantined and rolled back, and the run ends bit-identical to the golden run; a transient
    one in one replica's state is repaired in place, and the run ends with its replicas whole
    but without the update of the step the vote was read in (withheld on every rank: it
    computed on the odd replica), so not as the golden run ends."""
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", str(ROOT / "scenarios" / "configs" / config), "--out",
                     str(out), "--no-progress")
    assert code == 0, err[-3000:]
    import json

    rec = json.loads((out / "summary.json").read_text())["recovery"]
    assert {k: rec[k] for k in {"final_matches_golden", *expect}} == {
        "final_matches_golden": True, **expect}, rec
    if rec["rolled_back"]:
        assert rec["rollback_step"] <= rec["detected_step"] and rec["wasted_steps"] > 0
        assert rec["fault_to_resume_s"] > 0
    assert "## Recovery" in (out / "report.md").read_text()


def test_three_shards_merged_equal_the_unsharded_campaign(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Shards in separate processes (at once, as an Indexed Job runs them), merged: the same
    trials, outcomes and report as the campaign run whole. Overlaps, gaps and a shard of
    another campaign are refused by name."""
    import json

    camp = _campaign(tmp_path)

    def cmd(out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "scenarios", "campaign", str(camp), "--out", str(out),
                "--no-progress", *extra]

    whole = subprocess.run(cmd(tmp_path / "whole"), cwd=ROOT, capture_output=True, text=True,
                           timeout=scaled(280))
    assert whole.returncode == 0, whole.stderr[-2000:]
    env = {**os.environ}
    shards = []
    for i in range(3):  # the index from JOB_COMPLETION_INDEX, as in the Indexed Job
        shards.append(subprocess.Popen(cmd(tmp_path / f"s{i}", "--shard", "3"), cwd=ROOT,
                                       env={**env, "JOB_COMPLETION_INDEX": str(i)},
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                       text=True))
    for p in shards:
        _, err = p.communicate(timeout=scaled(280))
        assert p.returncode == 0, err[-2000:]
    dirs = [str(tmp_path / f"s{i}") for i in range(3)]

    def merge(out: str, *ds: str) -> tuple[int, str]:
        return _cli(capsys, "merge", out, *ds)

    code, err = merge(str(tmp_path / "m1"), *dirs[:2])
    assert code == 2 and "missing" in err, err
    code, err = merge(str(tmp_path / "m2"), *dirs, dirs[0])
    assert code == 2 and "two directories" in err, err
    code, err = merge(str(tmp_path / "merged"), *dirs)
    assert code == 0, err[-2000:]

    def rows(d: Path) -> dict[str, tuple[str, ...]]:
        with (d / "trials.csv").open() as fh:
            return {r["id"]: (r["outcome"], r["check"], r["detect_step"], r["suspects"],
                              r["first_divergence"], r["cordoned_nodes"])
                    for r in csv.DictReader(fh)}

    assert rows(tmp_path / "merged") == rows(tmp_path / "whole")
    assert _ids(tmp_path / "merged" / "trials.csv") == _ids(tmp_path / "whole" / "trials.csv")
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("merged", "whole"))
    for key in ("trials", "clean_trials", "false_positives", "outcomes", "sites", "fields",
                "replay_intervals", "by_site_field"):
        assert a[key] == b[key], key
    assert (tmp_path / "merged" / "overhead.json").exists()  # measured by shard 0 only
    assert not (tmp_path / "s1" / "overhead.json").exists()
    # A shard of another campaign: the same scenario, one clean trial more and a single fault
    # cell, so that its shard 2/3 runs a trial or two rather than a third of the campaign.
    other = tmp_path / "other.toml"
    other.write_text(camp.read_text().replace("clean_trials = 1", "clean_trials = 2")
                     .replace('"activation"]', ']').replace('"sign", ', "")
                     .replace("steps = [2, 4]", "steps = [2]"))
    assert len(plan_trials(load_campaign(other))) < len(plan_trials(load_campaign(camp)))
    code, err = _cli(capsys, "campaign", str(other), "--out", str(tmp_path / "x"), "--shard",
                     "2/3", "--no-progress")
    assert code == 0, err[-2000:]
    code, err = merge(str(tmp_path / "m3"), *dirs[:2], str(tmp_path / "x"))
    assert code == 2 and "same campaign" in err, err


def test_torchrun_on_two_nodes_reports_what_one_launcher_reports(tmp_path: Path) -> None:
    """``torchrun`` ranks run one scenario: one launcher of 4 ranks finds each fault with the
    right check, step and rank and writes the report; two launchers with ``--nnodes 2`` on
    loopback (2 ranks each, as two machines would run them, NODE_NAME per node) run it to the
    end too, and their trials' outcomes, checks, steps and suspects equal the one
    launcher's."""
    (tmp_path / "s.toml").write_text(SCENARIO.replace("world_size = 3", "world_size = 4") + """
[[faults]]
site = "weight_storage"
rank = 3
step = 2
target = "net.0.weight"
bits = [30]
[[faults]]
site = "gradient_before_allreduce"
rank = 1
step = 3
target = "net.2.bias"
kind = "set"
value = nan
[[faults]]
site = "gradient_after_allreduce"
rank = 2
step = 3
target = "net.2.bias"
kind = "set"
value = inf
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run"]
    args = ["-m", "scenarios", "run", str(tmp_path / "s.toml"), "--no-progress"]
    one = subprocess.run([*run, "--standalone", "--nproc-per-node", "4", *args, "--out",
                          str(tmp_path / "one")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=scaled(250))
    assert one.returncode == 0, one.stderr[-3000:]
    port = free_port()
    nodes = [subprocess.Popen([*run, "--nnodes", "2", "--node-rank", str(n),
                               "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), *args, "--out",
                               str(tmp_path / "two")],
                              cwd=ROOT, env={**env, "NODE_NAME": f"host-{n}"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for n in range(2)]
    for p in nodes:
        _, err = p.communicate(timeout=scaled(250))
        assert p.returncode == 0, err[-3000:]

    def rows(d: Path) -> dict[str, tuple[str, ...]]:
        with (d / "trials.csv").open() as fh:
            return {r["id"]: (r["outcome"], r["check"], r["checks"], r["detect_step"],
                              r["suspects"], r["skipped"]) for r in csv.DictReader(fh)}

    with (tmp_path / "one" / "trials.csv").open() as fh:
        by = {row["kind"] + row["site"]: row for row in csv.DictReader(fh)}
    assert by["clean"]["outcome"] == "masked"
    ws = by["faultweight_storage"]
    assert (ws["outcome"], ws["detect_step"], ws["suspects"]) == ("detected", "2", "[3]")
    gb = by["faultgradient_before_allreduce"]
    assert (gb["outcome"], gb["check"], gb["suspects"], gb["nonfinite_injected"]) == (
        "detected", "nonfinite", "[1]", "true")
    ga = by["faultgradient_after_allreduce"]
    assert (ga["outcome"], ga["check"], ga["suspects"], ga["nonfinite_injected"]) == (
        "detected", "nonfinite", "[2]", "true")
    assert (tmp_path / "one" / "report.html").exists()
    got, want = rows(tmp_path / "two"), rows(tmp_path / "one")
    assert got == want and len(got) == 4


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_determinism_axis_runs_the_tolerant_audit_on_a_testbed_with_its_own_golden(
        tmp_path: Path, parallel: str) -> None:
    """``deterministic = false`` trials run on the scenario's noise testbed: its golden run is
    another trajectory, clean trials reproduce it bit for bit at every replay interval (the
    keyed draws keep the training pass apart from the audit's recomputations, which the
    calibration and the audits still see round differently), a flip is caught by the tolerant
    audit and named transient (no cordon), and the rollback ends bit-identical to that golden
    run; the report puts both modes side by side. Under DDP and under FSDP2 (the collective
    recomputation, the sketch per module, a rollback through DCP)."""
    from scenarios.report.summary import summarize
    from scenarios.spec.campaign import CampaignSpec
    from scenarios.spec.faults import FaultSpace
    from scenarios.spec.trials import scenario_of

    sc = scenario_from_dict({"world_size": 3, "steps": 8, "batch": 16, "parallel": parallel,
                             "trial_timeout_s": scaled(60), "model": {"kind": "mlp", "width": 16},
                             "guard": {"replay_interval": 1}, "quarantine": {"max_nodes": 1},
                             "recovery": {"checkpoint_every": 2, "keep": 2}}, name="tiny")
    camp = CampaignSpec(name="det", scenarios=(sc,), clean_trials=1, overhead=None,
                        space=FaultSpace(mode="sample", sites=("activation",), fields=("exponent",),
                                         replay_intervals=(1, 2), trials_per_site=4, seed=2,
                                         deterministic=(True, False)))
    bed = sc.nondeterministic()
    executor = PoolExecutor()
    runner = CampaignRunner(camp, tmp_path, executor, progress=False)
    try:
        runner.run()
        exact, noisy = runner.goldens["tiny"], runner.goldens["tiny-nondet"]
        assert exact.key != noisy.key and noisy.ranks_agree and not noisy.detections
        assert exact.state_fps[0] != noisy.state_fps[0]  # the noise is in the trajectory
        for k in (1, 2):
            row = runner.trial(TrialSpec(id=f"c{k}", scenario="tiny", replay_interval=k,
                                         deterministic=False))
            assert row is not None and row["outcome"] == "masked", row
        flip = TrialSpec(id="f", scenario="tiny", replay_interval=1, deterministic=False,
                         faults=(Fault(site="activation", rank=1, step=3, target="net.4",
                                       bits=(27,)),),
                         site="activation", field="custom", fault_model="transient")
        assert scenario_of(camp, flip) == bed
        row = runner.trial(flip)
        assert row is not None and row["outcome"] == "detected", row
        assert (row["check"], row["suspects"], row["transient"]) == ("replay", [1], True), row
        assert row["contained"] and row["same_step"] and row["deterministic"] is False
        assert row["cordoned_nodes"] == [] and row["cordon_correct"] is True
        assert row["final_matches_golden"] is True and row["rollback_step"] is not None
    finally:
        executor.close()
    d = summarize(tmp_path)["determinism"]
    assert set(d["modes"]) == {"exact", "tolerant"}
    for mode in d["modes"].values():
        fp = mode["false_positives"]
        assert fp["clean_trials"] == 2 and fp["detected"] == 0 and fp["not_bit_identical"] == 0
