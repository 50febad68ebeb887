"""An API server that answers every request with 500, 403 or 409 while a guarded 3-rank run
quarantines a faulty rank: the quarantine fails and says why, no node is cordoned, and no
training step waits for the server (the hanging and the killed server are attacked in
``tests/sdc_guard/test_quarantine_dist.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kube_standin import StandInAPIServer
from tests import workers
from tests.launch import run_ranks, scaled

pytestmark = pytest.mark.timeout(240)

NODES = ["gpu-a", "gpu-b", "gpu-c"]
WEIGHT_FLIP = {"site": "weight_bitflip", "rank": 1, "step": 3, "bit": 0}
NO_REPAIR = {"repair_by_majority": False}  # the first detection quarantines


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[StandInAPIServer, Path]]:
    with StandInAPIServer() as srv:
        for n in NODES:
            srv.add_node(n)
        srv.add_namespace("ml")
        yield srv, srv.write_kubeconfig(tmp_path / "kubeconfig")


def _errors_500(srv: StandInAPIServer) -> None:
    srv.fail("*", ".", 500, times=10_000)


def _forbidden(srv: StandInAPIServer) -> None:
    srv.forbid("*", "*")


def _conflicts(srv: StandInAPIServer) -> None:
    for method in ("PATCH", "PUT"):
        srv.fail(method, ".", 409, times=10_000)


@pytest.mark.parametrize(("attack", "named"), [
    (_errors_500, "500"),
    (_forbidden, "deploy/rbac.yaml"),
    (_conflicts, "409"),
], ids=["500", "403", "409"])
def test_an_api_server_that_refuses_every_request_never_slows_training(
        server: tuple[StandInAPIServer, Path], attack: Callable[[StandInAPIServer], None],
        named: str) -> None:
    srv, kubeconfig = server
    attack(srv)
    quarantine = {"nodes": NODES, "kwargs": {
        "kubeconfig": str(kubeconfig), "job": "attack-job", "max_nodes": 1,
        "max_fraction": 0.5, "backoff_s": 0.05, "request_timeout_s": 1.0, "retries": 1,
        "deadline_s": 0.5, "dry_run": False}}
    res = run_ranks(workers.guarded_run, 3, 10, WEIGHT_FLIP, NO_REPAIR, "adamw", False,
                    quarantine)
    assert all(r["steps_run"] == 10 for r in res)
    assert all(r["detections"][0] == ("weights", 3, (1,)) for r in res)
    after = [t for r in res for t in r["step_s"][4:]]
    assert max(after) < scaled(1.0), f"a step waited for the API server: {max(after):.2f} s"
    actions = [a for r in res for a in r["actions"]]
    assert actions and {a["action"] for a in actions} == {"error"}, actions
    assert any(named in a["detail"] for a in actions), [a["detail"] for a in actions]
    assert not any(srv.node(n)["spec"].get("unschedulable") for n in NODES)
