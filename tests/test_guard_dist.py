"""SDCGuard on real gloo process groups (3 and 4 ranks, one thread each)."""

from __future__ import annotations

import pytest

from scenarios.launch import run_ranks
from tests import workers

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("world", [3, 4])
def test_clean_steps_give_no_detection(world: int) -> None:
    res = run_ranks(workers.guarded_run, world, 30)
    assert all(r["detections"] == [] for r in res)
    assert all(r["skipped"] == [] for r in res)
    assert len({r["final"] for r in res}) == 1


def test_weight_bitflip_names_rank_1() -> None:
    fault = {"site": "weight_bitflip", "rank": 1, "step": 5, "bit": 0}
    res = run_ranks(workers.guarded_run, 3, 8, fault)
    for r in res:
        assert r["detections"][0] == ("weights", 5, (1,))


def test_nan_gradient_names_rank_2_and_is_contained() -> None:
    fault = {"site": "grad_nan", "rank": 2, "step": 4}
    res = run_ranks(workers.guarded_run, 4, 6, fault)
    for r in res:
        assert r["detections"] == [("nonfinite", 4, (2,))]
        assert r["skipped"] == [4]
    # Containment: the NaN never reached the weights, which still agree everywhere.
    assert len({r["final"] for r in res}) == 1


@pytest.mark.parametrize(("ranks", "suspects"), [((1,), (1,)), ((0, 1, 2), ())])
def test_non_finite_reduced_result_is_judged_the_same_on_every_rank(
        ranks: tuple[int, ...], suspects: tuple[int, ...]) -> None:
    fault = {"site": "reduced_nan", "ranks": ranks, "step": 3}
    res = run_ranks(workers.guarded_run, 3, 5, fault)
    for r in res:
        assert r["detections"] == [("nonfinite", 3, suspects)]
        assert r["skipped"] == [3]
    assert len({r["final"] for r in res}) == 1


def test_world_size_two_reports_mismatch_without_suspect() -> None:
    fault = {"site": "weight_bitflip", "rank": 1, "step": 3, "bit": 5}
    res = run_ranks(workers.guarded_run, 2, 5, fault)
    for r in res:
        assert r["detections"][0] == ("weights", 3, ())


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_guarded_training_equals_plain_ddp_bit_for_bit(opt: str) -> None:
    guarded = run_ranks(workers.guarded_run, 3, 20, None, None, opt)
    plain = run_ranks(workers.plain_run, 3, 20, opt)
    for g, p in zip(guarded, plain, strict=True):
        assert g["losses"] == p["losses"]
        assert g["final"] == p["final"]


def test_guard_composes_with_a_user_comm_hook() -> None:
    res = run_ranks(workers.hooks_run, 3, "user_hook")
    for r in res:
        assert r["detections"] == [("nonfinite", 2, (1,))]
    assert len({r["final"] for r in res}) == 1


def test_grad_scaler_overflow_is_not_reported_and_the_scaler_skips() -> None:
    res = run_ranks(workers.hooks_run, 3, "scaler")
    for r in res:
        assert r["detections"] == []
        assert r["scale"] < 2.0**10  # the scaler saw the overflow and lowered the scale
    assert len({r["final"] for r in res}) == 1


@pytest.mark.parametrize("words", [
    [7, 7, 7],
    [-(2**63), -(2**63), -(2**63)],  # the complement trick must not overflow at the ends
    [2**63 - 1, 2**63 - 1, 2**63 - 1],
    [5, -(2**63), 5],
    [-1, 0, -1],
    [1, 2, 3],
])
def test_gather_if_different_agrees_on_every_rank(words: list[int]) -> None:
    res = run_ranks(workers.vote_run, 3, words)
    expected = None if len(set(words)) == 1 else words
    assert res == [expected] * 3


@pytest.mark.parametrize("words", [
    [7, 7], [-(2**63), -(2**63)], [2**63 - 1, 2**63 - 1],
    [5, -(2**63)], [-1, 0], [2**63 - 1, -(2**63)], [0, 2**63 - 1], [1, 2],
    [2**62, -(2**62)],
])
def test_gather_if_different_agrees_with_two_ranks(words: list[int]) -> None:
    res = run_ranks(workers.vote_run, 2, words)
    expected = None if len(set(words)) == 1 else words
    assert res == [expected] * 2
