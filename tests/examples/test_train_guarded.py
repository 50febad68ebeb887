"""``examples/train_guarded.py`` as a PyTorchJob runs it: one process per rank (env://), each
on its own node (NODE_NAME), quarantining through the official client on the loopback API
stand-in, and exiting with the code ``restartPolicy: ExitCode`` retries."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kube_standin import StandInAPIServer
from sdc_guard.remediation import EXIT_QUARANTINED

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(kubeconfig: Path, *extra: str,
         nodes: tuple[str, ...] = ("gpu-0", "gpu-1", "gpu-2")) -> list[tuple[int, str]]:
    port = _free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "NODE_NAME": nodes[rank], "POD_NAME": f"job-{rank}",
               "POD_NAMESPACE": "default", "SDC_GUARD_JOB": "example", "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "train_guarded.py"), "--steps", "12",
             "--kubeconfig", str(kubeconfig), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=200)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def test_a_conviction_cordons_the_node_and_every_rank_exits_for_a_restart(tmp_path: Path) -> None:
    with StandInAPIServer() as srv:
        for rank in range(3):
            srv.add_node(f"gpu-{rank}")
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
        out = _run(kubeconfig, "--act", "--plant-fault", "5")
        assert [code for code, _ in out] == [EXIT_QUARANTINED] * 3, out
        assert "suspects ['gpu-1']" in out[0][1]
        assert [n for n in ("gpu-0", "gpu-1", "gpu-2")
                if srv.node(n)["spec"].get("unschedulable")] == ["gpu-1"]


def test_a_dry_run_trains_on(tmp_path: Path) -> None:
    with StandInAPIServer() as srv:
        for rank in range(3):
            srv.add_node(f"gpu-{rank}")
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
        out = _run(kubeconfig, "--plant-fault", "5")
        assert [code for code, _ in out] == [0, 0, 0], out
        assert not any(srv.node(f"gpu-{r}")["spec"].get("unschedulable") for r in range(3))
        assert any(r.dry_run for r in srv.requests if r.method == "PATCH")


def _fingerprints(out: list[tuple[int, str]]) -> set[str]:
    return {m.group(1) for _, o in out for m in re.finditer(r"state fingerprint (\w+)", o)}


def test_the_restarted_job_resumes_from_the_last_clean_checkpoint(tmp_path: Path) -> None:
    # The whole path as a PyTorchJob takes it: rank 1's stuck bit is repaired at step 5 and
    # convicted at step 6; its node is cordoned and every rank exits 200. The job's pods come
    # back on other nodes (gpu-3 for gpu-1) and restore the checkpoint of step 3, the newest
    # before the suspect window (the fault's first sign, step 5: the checkpoint of step 5 is
    # refused), and train on. They end bit for bit where a
    # fault-free job restarted from its checkpoint of step 3 ends (a restart itself rounds the
    # first step's all-reduce differently from a job that never stopped: DDP reorders its
    # buckets after a process's first iteration).
    ckpt = ["--checkpoint-every", "2", "--keep-checkpoints", "10"]
    with StandInAPIServer() as srv:
        for node in ("gpu-0", "gpu-1", "gpu-2", "gpu-3"):
            srv.add_node(node)
        kubeconfig = srv.write_kubeconfig(tmp_path / "kubeconfig")
        run = ["--act", "--checkpoint-dir", str(tmp_path / "ckpt"), *ckpt]
        first = _run(kubeconfig, *run, "--plant-fault", "5")
        assert [code for code, _ in first] == [EXIT_QUARANTINED] * 3, first
        again = _run(kubeconfig, *run, nodes=("gpu-0", "gpu-3", "gpu-2"))
        assert [code for code, _ in again] == [0, 0, 0], again
        assert [n for n in ("gpu-0", "gpu-1", "gpu-2", "gpu-3")
                if srv.node(n)["spec"].get("unschedulable")] == ["gpu-1"]
    assert "not restoring" in again[0][1] and "step-000000005" in again[0][1]
    assert "restored" in again[0][1] and "training resumes at step 4" in again[0][1]
    assert all("trained steps 4 to 11" in o for _, o in again), again
    assert len(_fingerprints(again)) == 1  # every replica agrees

    gold = ["--no-quarantine", "--checkpoint-dir", str(tmp_path / "gold"), *ckpt]
    assert [code for code, _ in _run(kubeconfig, *gold)] == [0, 0, 0]
    for f in (tmp_path / "gold").glob("step-*.json"):  # as if it had stopped after step 3
        if int(f.name.split("-")[1]) > 3:
            f.unlink()
    resumed = _run(kubeconfig, *gold)
    assert all("trained steps 4 to 11" in o for _, o in resumed), resumed
    assert _fingerprints(again) == _fingerprints(resumed)
