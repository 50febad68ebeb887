"""``examples/train_guarded.py`` as a PyTorchJob runs it: one process per rank (env://), each
on its own node (NODE_NAME), quarantining through the official client on the loopback API
stand-in and exiting with the code ``restartPolicy: ExitCode`` retries; and without a
quarantine, rolling back in process, or ending with ``EXIT_CONVICTED`` and what to do when it
cannot roll back, never training on past a conviction."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kube_standin import StandInAPIServer
from sdc_guard import EXIT_CONVICTED, EXIT_QUARANTINED
from tests.launch import free_port, scaled

pytestmark = pytest.mark.timeout(360)  # scaled by conftest

ROOT = Path(__file__).resolve().parents[2]


def _run(kubeconfig: Path | None, *extra: str,
         nodes: tuple[str, ...] = ("gpu-0", "gpu-1", "gpu-2")) -> list[tuple[int, str]]:
    port = free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "NODE_NAME": nodes[rank], "POD_NAME": f"job-{rank}",
               "POD_NAMESPACE": "default", "SDC_GUARD_JOB": "example", "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "train_guarded.py"), "--steps", "12",
             *([] if kubeconfig is None else ["--kubeconfig", str(kubeconfig)]), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=scaled(200))[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


CKPT = ("--checkpoint-every", "2", "--keep-checkpoints", "10")
"""The checkpoints of the runs a restart starts from (the state after steps 1, 3, 5, ...)."""


class Quarantined:
    """The job of ``--act --plant-fault 5`` with checkpoints, on nodes gpu-0..gpu-3 of a live
    stand-in API server: what every rank printed and where its checkpoints are."""

    def __init__(self, srv: StandInAPIServer, kubeconfig: Path, ckpt: Path,
                 out: list[tuple[int, str]]) -> None:
        self.srv, self.kubeconfig, self.ckpt, self.out = srv, kubeconfig, ckpt, out


@pytest.fixture(scope="module")
def quarantined(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Quarantined]:
    """One faulted job, quarantined for real: the conviction's test looks at how it ended, the
    restart's starts the job again from its checkpoints (one launch of three interpreters for
    both)."""
    tmp = tmp_path_factory.mktemp("quarantined")
    with StandInAPIServer() as srv:
        for node in ("gpu-0", "gpu-1", "gpu-2", "gpu-3"):
            srv.add_node(node)
        kubeconfig = srv.write_kubeconfig(tmp / "kubeconfig")
        out = _run(kubeconfig, "--act", "--checkpoint-dir", str(tmp / "ckpt"), *CKPT,
                   "--plant-fault", "5")
        yield Quarantined(srv, kubeconfig, tmp / "ckpt", out)


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[tuple[int, str]]]:
    """A job that never meets the fault, with checkpoints as the faulted runs take them: its
    final state is where a rollback must end, its checkpoints what a fault-free restart
    starts from. Its directory and output; shared by the tests that compare with it."""
    ckpt = tmp_path_factory.mktemp("fault-free") / "ckpt"
    out = _run(None, "--no-quarantine", "--checkpoint-dir", str(ckpt), *CKPT)
    assert [code for code, _ in out] == [0, 0, 0], out
    return ckpt, out


def test_a_conviction_cordons_the_node_and_every_rank_exits_for_a_restart(
        quarantined: Quarantined) -> None:
    out = quarantined.out
    assert [code for code, _ in out] == [EXIT_QUARANTINED] * 3, out
    assert "suspects ['gpu-1']" in out[0][1]
    assert [n for n in ("gpu-0", "gpu-1", "gpu-2")
            if quarantined.srv.node(n)["spec"].get("unschedulable")] == ["gpu-1"]


def _detection_lines(out: str) -> int:
    return len(re.findall(r"SDC detection at step", out))


def test_a_dry_run_that_convicts_and_cannot_roll_back_ends_with_exit_convicted(
        tmp_path: Path) -> None:
    # A dry run cordons nothing, so the convicted rank stays in the job; without checkpoints
    # there is nothing to roll back to: every rank ends with the permanent code and says what
    # to do, right after the conviction (repaired at step 5, convicted at the next step the bit
    # changes a weight), instead of training on with a detection at every step and exiting 0.
    with StandInAPIServer() as srv:
        for rank in range(3):
            srv.add_node(f"gpu-{rank}")
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
        out = _run(kubeconfig, "--plant-fault", "5")
        assert [code for code, _ in out] == [EXIT_CONVICTED] * 3, out
        assert not any(srv.node(f"gpu-{r}")["spec"].get("unschedulable") for r in range(3))
        assert any(r.dry_run for r in srv.requests if r.method == "PATCH")
    for rank, (_, o) in enumerate(out):
        assert re.search(rf"rank {rank}: \w+ detection at step \d+, suspects \['gpu-1'\], not "
                         rf"quarantined, and no checkpoint to roll back to: exiting "
                         rf"{EXIT_CONVICTED}; a person must look", o), o
        assert "trained steps" not in o
    assert _detection_lines(out[0][1]) <= 3  # the repair; the conviction (weights, replay)


def test_without_a_quarantine_a_conviction_rolls_back_and_the_run_ends_as_if_fault_free(
        tmp_path: Path, fault_free: tuple[Path, list[tuple[int, str]]]) -> None:
    # --no-quarantine: repaired at step 5, convicted a few steps later, rolled back in process to the
    # checkpoint of step 3 (the newest before the window), and trained on: the planted part is
    # replaced by the rollback. An in-process rollback is exact, so every rank ends bit for bit
    # where a run that never met the fault ends (``fault_free``: checkpoints every 2 steps too).
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    out = _run(None, "--no-quarantine", *ckpt, "--plant-fault", "5")
    assert [code for code, _ in out] == [0, 0, 0], out
    for rank, (_, o) in enumerate(out):
        assert re.search(rf"rank {rank}: \w+ detection at step \d+, suspects \['gpu-1'\]; rolled "
                         r"back, resuming at step 4", o), o
    assert "restored" in out[0][1] and "step-000000003" in out[0][1]
    assert _detection_lines(out[0][1]) <= 3  # the repair, the conviction (weights, replay)
    _, golden = fault_free
    assert len(_fingerprints(out)) == 1
    assert _fingerprints(out) == _fingerprints(golden)


def test_a_fault_that_comes_back_after_the_rollback_ends_with_exit_convicted(
        tmp_path: Path) -> None:
    # The faulty bit survives the rollback (--fault-persists): rank 1 is convicted again before a
    # new clean checkpoint exists, and a second rollback to the same checkpoint would loop.
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2",
            "--keep-checkpoints", "10"]
    out = _run(None, "--no-quarantine", *ckpt, "--plant-fault", "5", "--fault-persists")
    assert [code for code, _ in out] == [EXIT_CONVICTED] * 3, out
    for rank, (_, o) in enumerate(out):
        assert "rolled back, resuming at step 4" in o, o
        assert re.search(rf"rank {rank}: \w+ detection at step \d+, suspects \['gpu-1'\], "
                         r"not quarantined, and the fault came back after the rollback to step "
                         rf"4: exiting {EXIT_CONVICTED}; a person must look", o), o
        assert "trained steps" not in o


def _fingerprints(out: list[tuple[int, str]]) -> set[str]:
    return {m.group(1) for _, o in out for m in re.finditer(r"state fingerprint (\w+)", o)}


def test_the_restarted_job_resumes_from_the_last_clean_checkpoint(
        tmp_path: Path, quarantined: Quarantined,
        fault_free: tuple[Path, list[tuple[int, str]]]) -> None:
    # The whole path as a PyTorchJob takes it: rank 1's faulty bit is repaired at step 5 (read
    # in step 6) and convicted at step 7 (in 8); its node is cordoned and every rank exits 200
    # (``quarantined``). The
    # job's pods come back on other nodes (gpu-3 for gpu-1) and restore the checkpoint of step
    # 3, the newest before the suspect window (the fault's first sign, step 5: the checkpoint of
    # step 5 is refused), and train on. They end bit for bit where a fault-free job restarted
    # from its checkpoint of step 3 ends (a restart itself rounds the first step's all-reduce
    # differently from a job that never stopped: DDP reorders its buckets after a process's
    # first iteration).
    first, srv = quarantined.out, quarantined.srv
    assert [code for code, _ in first] == [EXIT_QUARANTINED] * 3, first
    run = ["--act", "--checkpoint-dir", str(quarantined.ckpt), *CKPT]
    again = _run(quarantined.kubeconfig, *run, nodes=("gpu-0", "gpu-3", "gpu-2"))
    assert [code for code, _ in again] == [0, 0, 0], again
    assert [n for n in ("gpu-0", "gpu-1", "gpu-2", "gpu-3")
            if srv.node(n)["spec"].get("unschedulable")] == ["gpu-1"]
    assert "not restoring" in again[0][1] and "step-000000005" in again[0][1]
    assert "restored" in again[0][1] and "training resumes at step 4" in again[0][1]
    assert all("trained steps 4 to 11" in o for _, o in again), again
    assert len(_fingerprints(again)) == 1  # every replica agrees

    gold = tmp_path / "gold"  # the fault-free job's checkpoints, as if it had stopped after step 3
    shutil.copytree(fault_free[0], gold)
    for f in gold.glob("step-*.json"):
        if int(f.name.split("-")[1]) > 3:
            f.unlink()
    resumed = _run(None, "--no-quarantine", "--checkpoint-dir", str(gold), *CKPT)
    assert all("trained steps 4 to 11" in o for _, o in resumed), resumed
    assert _fingerprints(again) == _fingerprints(resumed)
