"""Several optimizers stepped as one (Muon for the matrices, AdamW for the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from sdc_guard.optimizers import as_optimizers, load_state_dict, state_dict
from tests import workers
from tests.launch import run_ranks


def test_several_optimizers_train_as_the_plain_loop_and_are_checked(tmp_path: Path) -> None:
    # Muon updates 2-D weights only, so a model trained with it has a second optimizer for
    # the rest. Every check runs over both (the weights check fingerprints both states): the
    # guarded run is the plain one bit for bit, a checkpoint holds both and restores both.
    results = run_ranks(workers.two_optimizers_run, 3, None, str(tmp_path / "clean"))
    for r in results:
        assert r["detections"] == [] and r["same"], r
        assert r["start"] == 6 and r["restored"], r
        assert "holds the state of 2 optimizers" in r["refused"], r["refused"]
    # Parameters (6) and state: Muon's momentum per matrix (3), AdamW's step, exp_avg and
    # exp_avg_sq per bias (3 x 3): the second optimizer's state is in the fingerprint.
    assert results[0]["states"] == 6 + 3 + 9


def test_a_flip_in_the_second_optimizers_state_is_caught_on_its_rank(tmp_path: Path) -> None:
    # The injector finds the optimizer that holds its target among the guard's optimizers.
    for r in run_ranks(workers.two_optimizers_run, 3, 3, str(tmp_path / "flip")):
        assert ("weights", 3, (1,)) in r["detections"], r["detections"]
        assert all(d[2] == (1,) for d in r["detections"]), r["detections"]


def test_optimizers_are_checked_up_front() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    sgd_a = torch.optim.SGD(a.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"SDCGuard\(optimizer=...\) must be a torch.optim.Optimizer or a "
                       "non-empty list of them"):
        as_optimizers([], "SDCGuard(optimizer=...)")
    with pytest.raises(TypeError, match="got SGD, Linear"):
        as_optimizers([sgd_a, a], "SDCGuard(optimizer=...)")
    with pytest.raises(ValueError, match=r"optimizers 0 and 1 both hold a parameter of shape \(2, 2\)"):
        as_optimizers([sgd_a, torch.optim.Adam(a.parameters())], "SDCGuard(optimizer=...)")
    sgd_b = torch.optim.SGD(b.parameters(), lr=0.2)
    assert as_optimizers((sgd_a, sgd_b), "x") == (sgd_a, sgd_b)
    saved = state_dict([sgd_a, sgd_b])
    assert isinstance(saved, list) and len(saved) == 2
    with pytest.raises(ValueError, match=r"holds the state of 2 optimizer\(s\), and 1 were given"):
        load_state_dict([sgd_a], saved, "restore")
    with pytest.raises(ValueError, match="holds the state of 2 optimizers; pass the same 2"):
        load_state_dict(sgd_a, saved, "restore")
    load_state_dict([sgd_b, sgd_a], saved, "restore")  # in the order given: lr swapped
    assert [sgd_b.param_groups[0]["lr"], sgd_a.param_groups[0]["lr"]] == [0.1, 0.2]


def test_several_optimizers_under_a_grad_scaler() -> None:
    # The scaler steps each optimizer (each unscaled for clipping first) and updates once.
    for r in run_ranks(workers.two_optimizers_scaler_run, 3):
        assert r["detections"] == [] and r["same"], r
