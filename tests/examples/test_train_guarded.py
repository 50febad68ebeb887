"""``examples/train_guarded.py`` as a PyTorchJob runs it: one process per rank (env://), each
on its own node (NODE_NAME), quarantining through the official client on the loopback API
stand-in, and exiting with the code ``restartPolicy: ExitCode`` retries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scenarios.run.kubeapi import StandInAPIServer
from sdc_guard.remediation import EXIT_QUARANTINED

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(kubeconfig: Path, *extra: str) -> list[tuple[int, str]]:
    port = _free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "NODE_NAME": f"gpu-{rank}", "POD_NAME": f"job-{rank}",
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
