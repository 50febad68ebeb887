"""The ring replay audit under FSDP2 and HSDP, on real gloo ranks.

Every test trains a ``fully_shard`` model with dropout through ``SDCGuard`` with the replay
audit (``sdc_guard.checks.replay_fsdp``); faults are armed through ``injectors``. The rank
functions live in ``replay_fsdp_workers``, which also runs the soak of >= 100 clean
audits (``python -m tests.sdc_guard.replay_fsdp_workers``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.launch import run_ranks
from tests.sdc_guard import replay_fsdp_workers as w

SHAPES = {"fsdp2": (2,), "fsdp3": (3,), "hsdp2x2": (2, 2), "hsdp3x2": (3, 2)}


def _world(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _flip(rank: int, step: int, phase: str = "train") -> dict[str, object]:
    """A finite flip of the top mantissa bit of the last Linear's first output on ``rank``
    at ``step`` (the loss and every gradient of that micro-batch change)."""
    return {"site": "activation", "rank": rank, "step": step, "target": "6",
            "kind": "bitflip", "bits": (22,), "index": 0, "phase": phase}


@pytest.mark.parametrize(("name", "micro", "steps"), [("fsdp3", 1, 20), ("hsdp2x2", 2, 8)])
def test_clean_audits_find_nothing_and_training_is_bit_identical_without_them(
        name: str, micro: int, steps: int) -> None:
    """An audit at every step finds no bad edge, withholds nothing, and ends with every
    shard of the weights and the optimizer state bit for bit as the same run without the
    audit (the recomputation leaves no gradient, buffer or random state behind)."""
    shape = SHAPES[name]
    audited = run_ranks(w.train, _world(shape), shape, steps, micro=micro)
    plain = run_ranks(w.train, _world(shape), shape, steps, micro=micro, interval=0)
    for a, p in zip(audited, plain, strict=True):
        assert a["detections"] == [] and a["withheld"] == []
        assert a["alike"]
        assert a["state"] == p["state"]


@pytest.mark.parametrize(("name", "micro", "target"), [("fsdp3", 1, 1), ("hsdp2x2", 2, 2)])
def test_a_flip_in_one_ranks_step_is_named_and_withheld_on_every_rank(
        name: str, micro: int, target: int) -> None:
    """Rank ``target``'s own step computes wrong at audit step 4: the edge into it is bad,
    the arbiter (the rank after it) confirms the replay, and every rank names ``target``
    in step 4 and withholds that step (the shards' replicas stay alike)."""
    shape = SHAPES[name]
    world = _world(shape)
    results = run_ranks(w.train, world, shape, 6, micro=micro, fault=_flip(target, 4))
    assert results[target]["records"] == micro  # the flip hit each micro-batch of step 4
    for res in results:
        # the first audit step posts the ring exchange after its replay, not yet knowing the
        # model's reduce-scatters; the later ones with the step's first (several modules)
        assert res["sent_with_first_chunk"] == [1, 2, 3, 4, 5]
        assert res["detections"] == [("replay", 4, (target,))]
        assert res["withheld"] == [4]
        assert res["withheld_by"] == [("replay",)]  # (the non-finite check took part: no veto)
        assert res["alike"]
        (evidence,) = res["evidence"]
        assert evidence["bad_edges"] == [[(target - 1) % world, target]]


def test_a_flip_in_a_replay_is_arbitrated_to_the_rank_that_replayed() -> None:
    """FSDP 3: rank 1's recomputation of rank 2's batch is hit: the single bad edge 1 -> 2 is
    arbitrated by rank 0, which replays rank 2's batch (every rank recomputes it with rank 0,
    the forward communicates) and confirms rank 2: rank 1 is named, the step withheld."""
    results = run_ranks(w.train, 3, (3,), 5, fault=_flip(1, 3, "replay"))
    for res in results:
        assert res["detections"] == [("replay", 3, (1,))]
        assert res["withheld"] == [3]
        (evidence,) = res["evidence"]
        assert evidence["arbitration"]["1"]["arbiter"] == 0
        assert evidence["arbitration"]["1"]["blames"] == 1


def test_two_ranks_detect_a_mismatch_without_a_suspect() -> None:
    """FSDP 2: no third rank to arbitrate: the mismatch is reported with no suspect and the
    step withheld on both ranks."""
    for res in run_ranks(w.train, 2, (2,), 4, fault=_flip(1, 2)):
        assert res["detections"] == [("replay", 2, ())]
        assert res["withheld"] == [2]


def test_report_only_names_the_rank_without_withholding() -> None:
    """``skip_step_on_detection=False``: the audit agrees through its own one-word all-reduce
    instead of the veto word; the rank is named, no step withheld."""
    for res in run_ranks(w.train, 3, (3,), 4, fault=_flip(2, 2), contain=False):
        assert res["detections"] == [("replay", 2, (2,))]
        assert res["withheld"] == []


def test_hsdp_3x2_names_the_faulty_rank() -> None:
    """HSDP 3x2: the ring spans every rank of both dimensions; a flip in rank 4's step is
    named on all six."""
    results = run_ranks(w.train, 6, (3, 2), 4, fault=_flip(4, 2))
    for res in results:
        assert res["detections"] == [("replay", 2, (4,))]
        assert res["withheld"] == [2]
        assert res["alike"]


def test_the_audits_veto_rides_the_last_reduce_scatter() -> None:
    """From the second step on (the first learns which reduction is the step's last) an
    audit step issues one collective fewer than with the veto in a word of its own, and
    trains the same."""
    for res in run_ranks(w.veto_collectives, 2, 4):
        assert [c + 1 for c in res["carried"][1:]] == res["word"][1:], res
        assert res["carried"][0] == res["word"][0], res
        assert res["identical"] == [1]


def test_the_recomputation_runs_no_replicate_all_reduce() -> None:
    """HSDP 2x2 with 2 micro-batches: turning the gradient sync back on after the first
    micro-batch must not turn HSDP's all-reduce back on inside the recomputation."""
    for counts in run_ranks(w.replicate_collectives_in_replay, 4, 2):
        assert counts == [0]


def test_as_users_run_fsdp2_bf16_and_activation_checkpointing() -> None:
    """The Llama-style model, bf16 parameters in the forward, float32 reductions, each block
    recomputed in the backward, FSDP 3, an audit every step: steps 0-2 are clean, and a flip
    in a bf16 activation of rank 1's step 3 is named and withheld on every rank. The run
    ends bit for bit as 3 steps without audits: the clean audits changed nothing, and the
    withheld step left no trace."""
    fault = {"site": "activation", "rank": 1, "step": 3, "target": "blocks.1.feed_forward.w2",
             "kind": "bitflip", "bits": (6,), "index": 5}
    # (bf16's top mantissa bit of an element the residual add does not round away; that of
    # element 0 at this step is masked: it changes nothing the loss or a gradient sees)
    audited = run_ranks(w.llama, 3, (3,), 4, fault=fault)
    plain = run_ranks(w.llama, 3, (3,), 3, interval=0)
    for a, p in zip(audited, plain, strict=True):
        assert a["detections"] == [("replay", 3, (1,))]
        assert a["withheld"] == [3]
        assert a["state"] == p["state"]


def test_a_buffer_the_forward_updates_is_refused_with_the_fix() -> None:
    """FSDP2 keeps each rank's buffers its own: a running mean outside the norm layers drifts
    apart with the ranks' batches, and no rank could recompute another's step. The first
    audit step names the buffer and the fix on every rank instead of convicting one."""
    for msg in run_ranks(w.running_buffer_refusal, 2):
        assert "['0.mean']" in msg and "replay_interval=0" in msg, msg


@pytest.mark.parametrize(("phase", "expected"), [
    ("replay", [("replay", 2, (1,))]),
    ("train", [("replay", 2, (1,)), ("nonfinite", 2, (1,))]),
])
def test_a_nan_in_a_replay_is_the_replays_alone(phase: str, expected: list[Any]) -> None:
    """FSDP 3: a NaN in rank 1's recomputation of rank 2's batch is a replay detection only
    (rank 1's own gradients were finite: the non-finite check flags a step's gradients, not
    a recomputation's); a NaN in rank 1's own step is named by both checks."""
    fault = {"site": "activation", "rank": 1, "step": 2, "target": "6", "kind": "set",
             "value": float("nan"), "index": 0, "phase": phase}
    for res in run_ranks(w.train, 3, (3,), 3, fault=fault):
        assert res["detections"] == expected
        assert res["withheld"] == [2]


def test_a_local_gradient_fault_hits_the_step_not_the_recomputation() -> None:
    """FSDP 3: a flip in rank 1's local gradient before the reduce-scatter (the injectors'
    site, armed at an audit step) hits rank 1's own step once, as under DDP, not also its
    recomputation of rank 2's batch: the one bad edge 0 -> 1, arbitrated by rank 2, names 1."""
    fault = {"site": "gradient_before_allreduce", "rank": 1, "step": 2, "target": "3.weight",
             "kind": "bitflip", "bits": (22,), "index": 3}
    results = run_ranks(w.train, 3, (3,), 3, fault=fault)
    assert results[1]["records"] == 1
    for res in results:
        assert res["detections"] == [("replay", 2, (1,))]
        assert res["evidence"][0]["bad_edges"] == [[0, 1]]
        assert res["withheld"] == [2]


def test_beside_the_checksum_check_an_arbitration_convicts_only_the_replay() -> None:
    """FSDP 3 with the checksum check on too: its hooks watch the step while the replay's
    arbitration recomputes (after the step's backward); the clean audit steps stay silent,
    and a flip in rank 1's replay at step 2 is one replay detection naming rank 1."""
    fault = _flip(1, 2, "replay")
    for res in run_ranks(w.train, 3, (3,), 4, fault=fault, checksum=True):
        assert res["detections"] == [("replay", 2, (1,))]
        assert res["withheld"] == [2]
