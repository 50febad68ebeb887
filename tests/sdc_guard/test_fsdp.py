"""The guard under FSDP2 (``fully_shard``): FSDP on 2 and 4 ranks, HSDP 2x2 and 3x2, on gloo.

Every test trains a real sharded model through ``SDCGuard`` in real process groups
(``tests.launch.run_ranks``); the rank functions live in ``fsdp_workers``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.launch import run_ranks
from tests.sdc_guard import fsdp_workers as w

SHAPES = {"fsdp2": (2,), "fsdp4": (4,), "hsdp2x2": (2, 2), "hsdp3x2": (3, 2)}


def _world(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@pytest.mark.parametrize(("name", "micro_batches"), [("fsdp2", 1), ("fsdp2", 2),
                                                     ("hsdp2x2", 1)])
def test_guarded_training_is_bit_identical_to_plain_fsdp2(name: str, micro_batches: int) -> None:
    """The guard's own reduce-scatter and its hooks change nothing FSDP2 computes: every
    shard of the weights and optimizer state equals unguarded FSDP2's bit for bit."""
    shape = SHAPES[name]
    assert run_ranks(w.same_as_plain, _world(shape), shape, micro_batches) == [True] * _world(shape)


@pytest.mark.parametrize("name", ["fsdp2", "fsdp4", "hsdp2x2", "hsdp3x2"])
def test_nonfinite_local_gradient_names_its_rank_and_is_withheld_everywhere(name: str) -> None:
    """A NaN in rank r's local gradients lands in another rank's shard after the
    reduce-scatter: every rank withholds that step (the veto word), and the detection names r
    on every rank."""
    shape = SHAPES[name]
    world = _world(shape)
    target = world - 1
    results = run_ranks(w.faults, world, shape, "local_nan", target, 3)
    for res in results:
        assert res["withheld"] == [(3, ("nonfinite",))]  # by the check that vetoed alone
        assert res["detections"] == [("nonfinite", 3, (target,), False)]
        assert res["alike"]


def test_nonfinite_reduced_shard_is_withheld_everywhere_without_a_suspect() -> None:
    """An Inf in one rank's reduced shard, its local gradients finite: withheld on every rank
    (the other ranks' shards are finite), no rank named (the reduction is every rank's)."""
    results = run_ranks(w.faults, 2, (2,), "reduced_inf", 0, 2)
    for res in results:
        assert res["withheld"] == [2]
        assert res["detections"] == [("nonfinite", 2, (), False)]


@pytest.mark.parametrize(("name", "weights", "checksum"),
                         [("fsdp2", 0, False), ("hsdp2x2", 0, False), ("fsdp2", 1, False),
                          ("fsdp2", 1, True)])
def test_the_veto_rides_the_last_reduce_scatter_and_adds_no_collective(
        name: str, weights: int, checksum: bool) -> None:
    """With the non-finite check (and under FSDP the weights check at rest, every step, and
    the checksum check), a guarded step issues the collectives plain FSDP2's step issues and
    no more: the step's veto, the weights' verdict on the state the step before left and the
    checksum's on the step's products included, rides its last reduce-scatter (from the
    second step on: the first learns which reduction is the last, and sends the veto in a
    word)."""
    shape = SHAPES[name]
    for res in run_ranks(w.collectives_per_step, _world(shape), shape, 5, weights,
                         checksum):
        assert res["guard"][1:] == res["plain"][1:], res
        assert res["guard"][0] > res["plain"][0], res  # (and the step agreement)
        assert res["identical"] == [1]


def test_a_device_flag_rides_the_last_reduce_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C kernel the flags are tensors (as on a GPU): the sentinel is written on
    the device, with no host read, and still withholds the step on every rank."""
    monkeypatch.setenv("SDC_GUARD_NATIVE", "0")
    for res in run_ranks(w.faults, 2, (2,), "local_nan", 1, 3):
        assert res["withheld"] == [(3, ("nonfinite",))]
        assert res["detections"] == [("nonfinite", 3, (1,), False)]


@pytest.mark.parametrize("name", ["fsdp2", "hsdp3x2"])
def test_a_fault_in_the_last_reduced_shard_is_withheld_on_its_rank(name: str) -> None:
    """An Inf in one rank's reduced shard of the step's last reduction (no local gradient
    carried it, so nothing that travels with the reductions knows it): that rank withholds
    its step alone, as under DDP, and the others apply theirs; the detection comes on every
    rank (not contained: the ranks' states now differ by that update). Under HSDP the
    weights vote then finds the replica that missed the update and repairs it from its
    shard's majority (the replicas end alike), with no collective on the step itself that
    only one rank would have entered."""
    shape = SHAPES[name]
    world = _world(shape)
    target = world - 1
    for rank, res in enumerate(run_ranks(w.faults, world, shape, "reduced_inf_last", target, 2)):
        after = [] if name == "fsdp2" else [3]  # (a repair withholds the next step)
        assert res["withheld"] == ([2] if rank == target else []) + after, res
        named = () if name == "fsdp2" else (target,)
        assert [d for d in res["detections"] if d[0] == "nonfinite"] == [
            ("nonfinite", 2, named, False)], res
        if name == "hsdp3x2":
            assert [d for d in res["detections"] if d[0] == "weights"] == [
                ("weights", 2, (target,), True)], res
        assert res["alike"]


def test_hsdp_state_fault_is_named_and_repaired_from_the_shards_majority() -> None:
    """HSDP 3x2: rank 2's shard of the optimizer state changes after step 4's vote; step
    5's vote finds rank 2 outside its shard's majority (ranks 0, 2, 4), withholds step 6 on
    every rank and repairs it from rank 0; at the end every shard's replicas agree."""
    results = run_ranks(w.faults, 6, (3, 2), "state", 2, 4)
    for res in results:
        assert res["detections"] == [("weights", 5, (2,), True)]
        assert res["withheld"] == [6]
        assert res["alike"]


def test_hsdp_two_replicas_differ_without_a_suspect() -> None:
    """HSDP 2x2: two replicas of a shard that differ have no majority: a detection without
    a suspect, not repaired (as two DDP ranks: each later vote finds them apart again, and
    withholds, until a rollback)."""
    results = run_ranks(w.faults, 4, (2, 2), "state", 3, 4)
    for res in results:
        assert res["detections"] == [("weights", s, (), False) for s in (5, 6, 7)]
        assert res["withheld"] == [6, 7]


@pytest.mark.parametrize("name", ["fsdp2", "fsdp4"])
def test_fsdp_shard_changed_at_rest_names_its_rank(name: str) -> None:
    """Pure FSDP has no replica: rank r's weight shard changed after step 4's optimizer step
    and before step 5's is caught in step 5 (named as the state after step 4), that step
    withheld on every rank, nothing repaired (a rollback's)."""
    shape = SHAPES[name]
    world = _world(shape)
    results = run_ranks(w.faults, world, shape, "at_rest", 1, 5)
    for res in results:
        assert res["detections"] == [("weights", 4, (1,), False)]
        assert res["withheld"] == [5]


def test_a_nan_written_into_a_shard_at_rest_is_named_though_it_hides_the_carried_answer(
        ) -> None:
    """FSDP 2: a NaN written into rank 1's weight shard before step 5 spreads into every
    rank's gradients, and so into the sentinel slots that carry the at-rest verdict: no
    rank can read it there. The non-finite check withholds the step on every rank, and the
    weights check then gathers every rank's own comparison: rank 1 named (the state after
    step 4), the non-finite detection narrowed to it."""
    for res in run_ranks(w.faults, 2, (2,), "at_rest_nan", 1, 5):
        assert res["withheld_by"][0] == (5, ("nonfinite",))
        assert res["detections"][:2] == [("weights", 4, (1,), False), ("nonfinite", 5, (1,), False)]


def test_with_two_replicas_a_nan_shard_keeps_its_shard_group_suspect() -> None:
    """HSDP 2x2: a NaN written into rank 3's weight shard makes the gradients of its shard
    group (ranks 2 and 3) non-finite. The non-finite check's recomputation of each owner's
    batch runs on the rank holding its shards in the other replica (another copy of every
    shard): it comes out finite, so neither owner is cleared as the batch's doing, and the
    two-replica vote, which has no majority, cannot narrow it: ranks 2 and 3 are named."""
    for res in run_ranks(w.faults, 4, (2, 2), "at_rest_nan", 3, 3):
        assert ("nonfinite", 3, (2, 3), False) in res["detections"]
        assert ("weights", 3, (), False) in res["detections"]


@pytest.mark.parametrize(("site", "replay", "first"), [("at_rest", 1, "replay"),
                                                     ("at_rest_nan", 0, "nonfinite")])
def test_hsdp_weight_shard_fault_is_pinned_to_its_rank_not_its_shard_group(
        site: str, replay: int, first: str) -> None:
    """HSDP 3x2: rank 4's weight shard changes before step 2's forward. Ranks 4 and 5 (its
    shard group) both compute with it, so the replay audit (a finite change) or the
    non-finite check (a NaN: the word of step 2 comes later) sees their whole row, and
    withholds step 2 on every rank; the weights vote taken at once in that step names rank
    4 alone and repairs it, and the other check's suspects are narrowed to rank 4."""
    for res in run_ranks(w.faults, 6, (3, 2), site, 4, 2, replay):
        assert sorted(res["detections"]) == sorted([(first, 2, (4,), False),
                                                    ("weights", 2, (4,), True)])
        assert res["withheld"] == [2]
        assert res["alike"]


def test_a_reconfigured_guard_does_not_narrow_with_an_earlier_runs_vote() -> None:
    """The narrowing belongs to the run whose vote found the changed shard: after
    ``reconfigure`` (a harness starting its next trial over at step 0), a replay detection
    at the same step number that names rank 5 (its own gradients) stays rank 5's."""
    for res in run_ranks(w.reconfigured, 6, (3, 2)):
        assert sorted(res[0]) == [("replay", 2, (4,)), ("weights", 2, (4,))]
        assert res[1] == [("replay", 2, (5,))]


def test_what_the_guard_cannot_guard_under_fsdp2_is_refused_with_the_fix() -> None:
    got = run_ranks(w.refusals, 2)[0]
    hook, block, plain, compiled, meshes, flat = got
    assert "compiled" in compiled and "'2'" in compiled
    assert "meshes" in meshes and "one data-parallel mesh" in meshes
    assert "comm_hook" in hook
    assert "ValueError" in block and "root" in block
    assert "TypeError" in plain and "fully_shard" in plain
    assert "shard dimension of 1" in flat and "DistributedDataParallel" in flat


NAN = float("nan")


@pytest.mark.parametrize(("name", "fault", "expected"), [
    # a NaN in rank 1's local gradient of the middle layer: named, withheld everywhere
    ("fsdp2", {"site": "gradient_before_allreduce", "rank": 1, "step": 2, "target": "2.weight",
               "kind": "set", "value": NAN}, [("nonfinite", 2, (1,), False)]),
    # a NaN activation on rank 0: its local gradients, named
    ("fsdp2", {"site": "activation", "rank": 0, "step": 3, "target": "1", "kind": "set",
               "value": NAN}, [("nonfinite", 3, (0,), False)]),
    # a NaN out of rank 1's product of the last layer (the root's own)
    ("fsdp2", {"site": "linear_product", "rank": 1, "step": 1, "target": "4", "kind": "set",
               "value": NAN, "product": "forward"}, [("nonfinite", 1, (1,), False)]),
    # rank 1's weight shard flipped at the start of step 3: changed at rest after step 2
    ("fsdp2", {"site": "weight_storage", "rank": 1, "step": 3, "target": "0.weight",
               "bits": (22,)}, [("weights", 2, (1,), False)]),
    # HSDP 3x2: rank 3's reduced shard (after the replicate all-reduce): its replica alone
    # is updated apart; the vote of step 2 names it, the repair makes it whole
    ("hsdp3x2", {"site": "gradient_after_allreduce", "rank": 3, "step": 2,
                 "target": "2.weight", "bits": (29,)}, [("weights", 2, (3,), True)]),
    # HSDP 3x2: rank 4's shard of the optimizer state
    ("hsdp3x2", {"site": "optimizer_state", "rank": 4, "step": 2, "target": "0.weight",
                 "state_key": "exp_avg", "bits": (29,)}, [("weights", 2, (4,), True)]),
])
def test_injected_faults_under_fsdp2(name: str, fault: dict[str, Any],
                                     expected: list[Any]) -> None:
    """Every site of ``injectors`` reaches its tensor under FSDP2 (a shard, a local gradient
    before the reduce-scatter, a reduced shard, an activation, a product) and the check
    that sees it names the rank that holds it."""
    shape = SHAPES[name]
    world = _world(shape)
    results = run_ranks(w.injected, world, shape, fault)
    assert results[fault["rank"]]["records"] == 1
    for res in results:
        assert res["detections"] == expected


def test_fsdp_rollback_through_dcp_ends_bit_identical_to_the_fault_free_run(
        tmp_path: Path) -> None:
    """FSDP 2: a shard changed at rest is named in its step; the guard marks the suspect
    window in the ShardedCheckpointManager, the run restores the DCP checkpoint before it
    (after step 3: the one after step 5 was saved before the state after step 5 was
    verified) and trains on to the end, bit for bit the fault-free run's."""
    golden = run_ranks(w.rollback, 2, (2,), str(tmp_path / "golden"), False)
    faulty = run_ranks(w.rollback, 2, (2,), str(tmp_path / "faulty"), True)
    for g, f in zip(golden, faulty, strict=True):
        assert g["detections"] == [] and g["resumed"] == []
        assert f["detections"] == [("weights", 5, (1,))]
        assert f["resumed"] == [4]
        assert g["state"] == f["state"]  # (float lists: equal floats are equal bits here)


@pytest.mark.parametrize(("name", "nan_at"), [("fsdp2", None), ("fsdp2", 2), ("hsdp2x2", 2)])
def test_mixed_precision_and_activation_checkpointing(name: str, nan_at: int | None) -> None:
    """FSDP2 as users run it: bf16 parameters in the forward, float32 reductions, each block
    recomputed in the backward (the harness's Llama-style model). Clean: no detection, and
    bit for bit plain FSDP2's run; a NaN in rank 1's local gradients: named, withheld on
    every rank."""
    shape = SHAPES[name]
    for res in run_ranks(w.llama_as_users_run_it, _world(shape), shape, nan_at):
        assert res["dtype"] == "torch.float32"  # the sharded parameters keep the model's dtype
        if nan_at is None:
            assert res["detections"] == [] and res["withheld"] == []
            assert res["same_as_plain"]
        else:
            assert res["detections"] == [("nonfinite", nan_at, (1,))]
            assert res["withheld"] == [nan_at]


def test_fsdp_optimizer_state_shard_changed_at_rest_names_its_rank() -> None:
    """FSDP 4: rank 2's shard of the Adam state changes after step 4's optimizer step: the
    at-rest check (the optimizer state is fingerprinted with the weights) names rank 2 in
    step 5, withheld on every rank."""
    for res in run_ranks(w.faults, 4, (4,), "state", 2, 4):
        assert res["detections"] == [("weights", 4, (2,), False)]
        assert res["withheld"] == [5]


def test_hsdp_reduced_shard_nonfinite_on_one_replica_names_it() -> None:
    """HSDP 3x2: an Inf in rank 3's reduced shard (after the replicate all-reduce), its
    replicas' (ranks 1 and 5) finite: the shard's replicas reduce alike, so rank 3 is the
    odd one out and named; the step withheld on every rank."""
    for res in run_ranks(w.faults, 6, (3, 2), "reduced_inf", 3, 2):
        assert res["detections"] == [("nonfinite", 2, (3,), False)]
        assert res["withheld"] == [2]
        assert res["alike"]
