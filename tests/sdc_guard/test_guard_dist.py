"""SDCGuard on real gloo process groups (3 and 4 ranks, one thread each)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests import workers
from tests.launch import run_ranks

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


@pytest.mark.parametrize(("steps", "reported_at"), [(6, []), (10, [(8, "nonfinite", 4)])])
def test_nan_gradient_names_rank_2_and_is_contained(
        steps: int, reported_at: list[tuple[Any, ...]]) -> None:
    fault = {"site": "grad_nan", "rank": 2, "step": 4}
    res = run_ranks(workers.guarded_run, 4, steps, fault)
    for r in res:
        assert r["detections"] == [("nonfinite", 4, (2,))]
        # Withheld on every rank at step 4 (each saw the NaN in its reduced result). The
        # word of steps 0-7 (the default window) that names rank 2 is reported at step 8,
        # or by flush() when training ends before.
        assert r["skipped"] == [4]
        assert r["reported_at"] == reported_at
    # Containment: the NaN never reached the weights, which still agree everywhere.
    assert len({r["final"] for r in res}) == 1


@pytest.mark.parametrize(("checksum", "native"), [(False, True), (True, True), (True, False)],
                         ids=["default", "checksum-c", "checksum-torch"])
def test_a_nan_the_batch_produces_is_reported_without_a_suspect_one_of_the_hardware_with_one(
        checksum: bool, native: bool) -> None:
    # A NaN from the data (a bad sample, an overflow) named the rank that drew it, and a
    # quarantine cordoned that healthy node (then the next, after the restart, on the same
    # batch). On a step with a non-finite reduced result every rank recomputes its
    # neighbour's batch from the same weights: a NaN that comes back is the batch's. The
    # checksum convicted it too (a product of non-finite operands is non-finite without a
    # fault): an entry whose bound is not finite cannot fail.
    for r in run_ranks(workers.nonfinite_origin_run, 3, "data", checksum, native):
        assert [d[:3] for d in r["detections"]] == [("nonfinite", 2, ())], r["detections"]
        assert "rank(s) [0] recomputing the batch of rank(s) [1]" in r["detections"][0][3]
        assert r["skipped"] == [2]
    for r in run_ranks(workers.nonfinite_origin_run, 3, "hardware", checksum, native):
        assert [d[:3] for d in r["detections"]] == [("nonfinite", 2, (1,))], r["detections"]
        assert "recomputing" not in r["detections"][0][3]
        assert r["skipped"] == [2]


def test_a_non_finite_reduction_on_every_rank_is_withheld_everywhere() -> None:
    fault = {"site": "reduced_nan", "ranks": (0, 1, 2), "step": 3}
    res = run_ranks(workers.guarded_run, 3, 5, fault, {"nonfinite_exchange_interval": 1})
    for r in res:
        assert r["detections"] == [("nonfinite", 3, ())]
        assert r["reported_at"] == [(4, "nonfinite", 3)]
        assert r["skipped"] == [3]
    assert len({r["final"] for r in res}) == 1


def test_a_non_finite_result_on_one_rank_only_is_withheld_there_and_reported_everywhere() -> None:
    # Rank 1's copy of the reduced gradients is corrupt; the others' are right. Rank 1
    # withholds its step at once; every rank reports the detection in step 4's report.
    fault = {"site": "reduced_nan", "ranks": (1,), "step": 3}
    cfg = {"weights_interval": 0, "nonfinite_exchange_interval": 1}
    res = run_ranks(workers.guarded_run, 3, 6, fault, cfg)
    for r in res:
        assert r["detections"] == [("nonfinite", 3, (1,))]
        assert r["reported_at"] == [(4, "nonfinite", 3)]
        assert r["skipped"] == ([3] if r["rank"] == 1 else [])
        assert r["flushed"] == []
    # Rank 1 missed step 3's update; the others applied it. The weights check sees it.
    assert res[0]["final"] == res[2]["final"] != res[1]["final"]
    with_weights = run_ranks(workers.guarded_run, 3, 6, fault, {"nonfinite_exchange_interval": 1})
    for r in with_weights:
        # Both in step 4's report: the word of step 3, and the vote of step 3's state, read
        # in step 4 (which every rank withholds: the replicas were apart when it computed).
        assert r["detections"][:2] == [("nonfinite", 3, (1,)), ("weights", 3, (1,))]
        assert r["reported_at"][:2] == [(4, "nonfinite", 3), (4, "weights", 3)]
        assert r["skipped"] == ([3, 4] if r["rank"] == 1 else [4])


def test_ranks_that_stop_at_the_first_detection_stop_together() -> None:
    fault = {"site": "reduced_nan", "ranks": (2,), "step": 2}
    cfg = {"weights_interval": 0, "nonfinite_exchange_interval": 1}
    res = run_ranks(workers.guarded_run, 3, 8, fault, cfg, "adamw", True)
    for r in res:  # the worker meets every rank after its loop: one left alone would hang
        assert r["steps_run"] == 4 and r["detections"] == [("nonfinite", 2, (2,))]


def test_the_last_steps_word_is_collected_by_flush() -> None:
    fault = {"site": "reduced_nan", "ranks": (1,), "step": 4}
    res = run_ranks(workers.guarded_run, 3, 5, fault, {"weights_interval": 0,
                                                       "nonfinite_exchange_interval": 1})
    for r in res:
        assert r["reported_at"] == []
        assert r["flushed"] == [("nonfinite", 4, (1,))]
        assert r["skipped"] == ([4] if r["rank"] == 1 else [])


@pytest.mark.parametrize(("steps", "reported_at", "flushed"), [(9, [(6, "nonfinite", 4)], []),
                                                                (5, [], [("nonfinite", 4, (2,))])])
def test_flags_of_several_steps_travel_in_one_word(steps: int, reported_at: list[tuple[Any, ...]],
                                                   flushed: list[tuple[Any, ...]]) -> None:
    # Windows of 3 steps: [0, 1, 2] [3, 4, 5] [6, 7, 8]. Step 4's NaN is withheld at once on
    # every rank; its word leaves at step 5 and arrives at step 6, or, when training stops
    # at step 4, is sent and judged by flush() (a partial window).
    fault = {"site": "grad_nan", "rank": 2, "step": 4}
    cfg = {"weights_interval": 0, "nonfinite_exchange_interval": 3}
    res = run_ranks(workers.guarded_run, 3, steps, fault, cfg)
    for r in res:
        assert r["skipped"] == [4]
        assert r["reported_at"] == reported_at
        assert r["flushed"] == flushed
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


def test_checks_that_read_no_bucket_leave_ddp_without_a_comm_hook() -> None:
    # With no check reading the gradient buckets, DDP keeps its built-in all-reduce (a comm
    # hook would cost a pass): the guard then trains exactly what plain DDP trains.
    plain = run_ranks(workers.plain_run, 3, 8)
    for cfg in ({"nonfinite": False, "weights_interval": 0},
                {"nonfinite": False, "weights_interval": 1}):
        res = run_ranks(workers.guarded_run, 3, 8, None, cfg)
        assert [(r["losses"], r["final"], r["hooked"], r["detections"]) for r in res] == [
            (p["losses"], p["final"], False, []) for p in plain]
    assert all(r["hooked"] for r in run_ranks(workers.guarded_run, 3, 2))  # nonfinite reads them
    # A fault injector's gradient callback registers the hook, on its rank only: that rank's
    # all-reduce still meets the others' built-in one, bit for bit, until the NaN it plants
    # (no check is on) reaches every rank's weights.
    fault = {"site": "grad_nan", "rank": 2, "step": 4}
    res = run_ranks(workers.guarded_run, 3, 6, fault, {"nonfinite": False, "weights_interval": 0})
    assert [r["hooked"] for r in res] == [False, False, True]
    for r, p in zip(res, plain, strict=True):
        assert r["losses"][:5] == p["losses"][:5]
        assert math.isnan(r["losses"][5])


def test_gradients_as_bucket_views_change_no_bit_and_no_verdict() -> None:
    # The construction the guard recommends (no copy into the buckets) trains the same
    # weights as plain DDP's default, with every check on, and contains the same fault.
    cfg = {"nonfinite_exchange_interval": 1, "replay_interval": 2, "deterministic": True}
    views = run_ranks(workers.guarded_run, 3, 12, None, cfg, "adamw", bucket_view=True)
    copies = run_ranks(workers.guarded_run, 3, 12, None, cfg, "adamw")
    for v, c in zip(views, copies, strict=True):
        assert v["detections"] == [] and v["skipped"] == []
        assert (v["losses"], v["final"]) == (c["losses"], c["final"])
    plain = run_ranks(workers.plain_run, 3, 12)
    guarded = run_ranks(workers.guarded_run, 3, 12, bucket_view=True)
    assert [(g["losses"], g["final"]) for g in guarded] == [(p["losses"], p["final"])
                                                          for p in plain]
    fault = {"site": "grad_nan", "rank": 2, "step": 4}
    for r in run_ranks(workers.guarded_run, 3, 6, fault, cfg, "adamw", bucket_view=True):
        assert r["skipped"] == [4]
        assert ("nonfinite", 4, (2,)) in r["detections"]


def test_guard_composes_with_a_user_comm_hook() -> None:
    res = run_ranks(workers.hooks_run, 3, "user_hook")
    for r in res:
        assert r["detections"] == [("nonfinite", 2, (1,))]
        # Contained: the user hook's reduced result was checked, so every rank withheld
        # step 2 and the NaN never reached the weights.
        assert r["skipped"] == [2]
        assert r["finite"]
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


@pytest.mark.parametrize("replay", [False, True])
def test_a_loss_fn_that_bypasses_ddp_is_named(replay: bool) -> None:
    # loss_fn calling model.module(...) (as model.module.compute_loss(batch) does) bypasses
    # DDP's forward: DDP did not all-reduce the gradients, the replicas trained apart and the
    # weights check reported them at every step; the replay, which gives loss_fn the module
    # inside DDP, failed with an AttributeError. Both are named at the first step now (an
    # evaluation call of the DDP model before it does not hide the bypass).
    for r in run_ranks(workers.bypass_run, 3, replay):
        assert r["at"] == 0 and r["detections"] == [], r  # a ValueError (an AttributeError
        assert "model.module" in r["error"] and "does not all-reduce" in r["error"]  # fails)
        assert ("cannot give" in r["error"]) == replay, r["error"]


@pytest.mark.parametrize("repair", [True, False])
def test_optimizer_settings_that_differ_are_named_not_a_rank_convicted(repair: bool) -> None:
    # A scheduler stepped under `if rank == 0` gave rank 0 another learning rate: its weights
    # left the majority's at every step and the weights check convicted it (repaired, then a
    # permanent fault: a quarantine). On a mismatch the ranks' optimizer settings are
    # gathered first; settings that differ are an error of the loop, raised on every rank
    # (where the vote of step 1's state is read: in step 2).
    for r in run_ranks(workers.rank0_scheduler_run, 3, repair):
        assert r["at"] == 2 and r["detections"] == [], r
        assert "param group 0 'lr': rank 0 0.0081" in r["error"], r["error"]
        assert "rank 1 0.01, rank 2 0.01" in r["error"] and "no rank is blamed" in r["error"]


@pytest.mark.parametrize(("what", "late"), [("parameters", False), ("optimizer", False),
                                            ("parameters", True)])
def test_replicas_that_start_apart_are_named_not_a_rank_convicted(what: str, late: bool) -> None:
    # A checkpoint loaded under `if rank == 0` after DDP's construction broadcast: the
    # weights check convicted rank 0 at the first step and repair by majority overwrote the
    # loaded weights with the others'. The first step compares the replicas' state before
    # anything runs and raises on every rank, naming what differs and where.
    # Late: the weights check turned on after a step with the checks off (reconfigure) asks
    # at its own first step.
    for r in run_ranks(workers.divergent_start_run, 3, what, late):
        assert r["at"] == int(late) and r["detections"] == [], r
        named = "parameters" if what == "parameters" else "optimizer states"
        assert f"their {named} differ before the first step (ranks [0] differ" in r["error"]
        assert "load_state_dict" in r["error"] and "CheckpointManager.restore" in r["error"]


def test_the_step_leaves_the_loss_on_the_device_until_it_is_read() -> None:
    # On a GPU a read waits for the step's queued work; a loop that never reads the loss
    # should not pay for one (the guard read it in every step).
    for r in run_ranks(workers.loss_read_run, 3):
        assert r["in_step"] == 0 and r["in_loss"] == 1, r
        assert r["float"] and r["again"] == r["loss"] and r["loss"] > 0
        assert f"loss={r['loss']}" in r["repr"]
