"""The ring replay audit on real gloo groups: detection, localisation, arbitration, containment."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import workers
from tests.launch import run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("world", [3, 4])
def test_clean_run_every_step_audited_has_no_false_positive(world: int) -> None:
    res = run_ranks(workers.replay_run, world, 40)
    assert all(r["detections"] == [] for r in res)
    assert len({r["final"] for r in res}) == 1


def test_clean_audit_steps_make_no_collective_of_their_own() -> None:
    # The replayed words travel point to point and the owner compares: no agreement, no
    # gather, on 6 clean audit steps; a fault costs one gather (and the arbitration's).
    clean = run_ranks(workers.replay_run, 3, 6)
    assert all(r["detections"] == [] for r in clean)
    assert all(r["collectives"] == {"agreements": 0, "gathers": 0, "veto_words": 0}
               for r in clean)
    fault = {"rank": 1, "step": 2, "phase": "train", "bit": 2}
    for r in run_ranks(workers.replay_run, 3, 4, fault=fault):
        assert ("replay", 2, (1,)) in r["detections"] and r["skipped"] == [2]
        assert r["collectives"]["agreements"] == 0 and r["collectives"]["gathers"] >= 1
    # Where the veto sentinel cannot travel (a user's comm hook: the backend carries the
    # veto in a word of its own) or must not be written (report only: the audit's own
    # agreement), one one-word all-reduce per audit step, and the same verdicts.
    for kwargs in ({"user_hook": True}, {"contain": False}):
        res = run_ranks(workers.replay_run, 3, 4, fault=fault, **kwargs)
        for r in res:
            assert ("replay", 2, (1,)) in r["detections"], (kwargs, r["detections"])
            words = r["collectives"]
            assert (words["veto_words"], words["agreements"]) == (
                (4, 0) if kwargs.get("user_hook") else (0, 4)), (kwargs, words)
            assert r["skipped"] == ([2] if kwargs.get("user_hook") else [])


def test_replay_on_and_off_end_bit_identical() -> None:
    on = run_ranks(workers.replay_run, 3, 12)
    off = run_ranks(workers.replay_run, 3, 12, interval=0)
    assert on[0]["final"] == off[0]["final"]


def test_without_the_c_kernel_the_audit_is_as_clean_and_as_sharp() -> None:
    # The torch path everywhere (no fused digest in the scaling pass): same training, same
    # verdicts.
    clean = run_ranks(workers.replay_run, 3, 8, native=False)
    assert all(r["detections"] == [] for r in clean)
    assert clean[0]["final"] == run_ranks(workers.replay_run, 3, 8)[0]["final"]
    fault = {"rank": 1, "step": 4, "phase": "train", "bit": 2}
    for r in run_ranks(workers.replay_run, 3, 6, fault=fault, native=False):
        assert ("replay", 4, (1,)) in r["detections"], r["detections"]


@pytest.mark.parametrize("nonfinite", [True, False], ids=["shared-word", "replay-alone"])
@pytest.mark.parametrize("phase", ["train", "replay"])
def test_transient_activation_flip_on_rank_1_is_localised(phase: str, nonfinite: bool) -> None:
    fault = {"rank": 1, "step": 4, "phase": phase, "bit": 2}
    res = run_ranks(workers.replay_run, 3, 6, fault=fault, nonfinite=nonfinite)
    for r in res:
        assert ("replay", 4, (1,)) in r["detections"], r["detections"]
        assert r["skipped"] == [4]
        assert [d for d in r["detections"] if d[0] == "weights"] == []


def test_clean_run_with_the_replay_alone_has_no_false_positive() -> None:
    res = run_ranks(workers.replay_run, 3, 20, nonfinite=False)
    assert all(r["detections"] == [] for r in res)
    assert len({r["final"] for r in res}) == 1


def test_nan_on_an_audit_step_is_named_by_both_checks_from_one_word() -> None:
    # The flags and the words share one word and one gather; the replay's single bad edge
    # 1 -> 2 is then arbitrated by rank 0, which confirms rank 1's replay of rank 2's batch.
    fault = {"site": "grad_nan", "rank": 2, "step": 3}
    res = run_ranks(workers.replay_run, 3, 5, fault=fault)
    for r in res:
        assert ("nonfinite", 3, (2,)) in r["detections"], r["detections"]
        assert ("replay", 3, (2,)) in r["detections"], r["detections"]
        assert r["skipped"] == [3]
    assert len({r["final"] for r in res}) == 1


def test_flip_on_non_audit_step_is_a_documented_blind_spot() -> None:
    fault = {"rank": 1, "step": 3, "phase": "train", "bit": 2}
    res = run_ranks(workers.replay_run, 3, 6, interval=2, fault=fault)
    for r in res:
        assert r["detections"] == []


def test_permanent_fault_on_rank_2_caught_at_first_audit_step() -> None:
    fault = {"rank": 2, "step": 2, "phase": "any", "bit": 9, "permanent": True}
    res = run_ranks(workers.replay_run, 4, 9, interval=3, fault=fault)
    for r in res:
        first = next(d for d in r["detections"] if d[0] == "replay")
        assert first == ("replay", 3, (2,))


def test_a_fault_in_both_computations_of_a_rank_is_one_replay_detection() -> None:
    # Rank 1 computes its own batch and its replay of rank 2's wrong: ranks 1 and 2 both
    # veto. Their sentinels lie in slots of their own, so the reduced gradients stay finite
    # and the non-finite check does not report a fault in the reduction.
    fault = {"rank": 1, "step": 2, "phase": "any", "bit": 9, "permanent": True}
    for r in run_ranks(workers.replay_run, 3, 3, fault=fault):
        assert r["detections"] == [("replay", 2, (1,))], r["detections"]
        assert r["skipped"] == [2]


def test_a_parameter_without_gradient_is_an_error_naming_the_fix_not_a_detection() -> None:
    # Without find_unused_parameters its bucket never reaches the comm hook: the own word is
    # incomplete and every edge would disagree (every rank a suspect). Every rank raises.
    for r in run_ranks(workers.unused_without_find_run, 3):
        assert r["detections"] == []
        assert r["error"] is not None and "find_unused_parameters=True" in r["error"]
        assert "held 0 of the 6 parameters" in r["error"], r["error"]  # one bucket, never ready


def test_ranks_that_compute_otherwise_are_refused_by_the_replay_never_convicted() -> None:
    # Torch's CPU kernels split reductions by thread: a rank with 2 threads among ranks with
    # 1 computes the same batch to other gradient bits, and every audit step convicted it
    # (both its ring edges disagree), a healthy node cordoned. The guard gathers each rank's
    # compute signature with its place and refuses the replay, on every rank alike.
    for r in run_ranks(workers.mixed_threads_run, 3, [1, 2, 1]):
        for refusal in (r["built"], r["reconfigured"]):
            assert refusal is not None and "CPU threads: 1 (ranks 0, 2) vs 2 (rank 1)" in refusal
            assert "torch.set_num_threads(n)" in refusal and "replay_interval=0" in refusal
        assert r["mismatch"].startswith("CPU threads: 1 (ranks 0, 2) vs 2 (rank 1)")
        assert r["checks"] == ["nonfinite", "weights", "checksum"]  # the refused config not built
        assert r["detections"] == []
    for r in run_ranks(workers.mixed_threads_run, 3, [1, 1, 1]):
        assert r["built"] is None and r["reconfigured"] is None and r["mismatch"] is None
        assert r["checks"] == ["nonfinite", "replay", "weights"] and r["detections"] == []


def test_ranks_that_compute_other_fingerprints_are_refused_at_construction() -> None:
    # A rank of a release before fingerprint version 2 (or after it) would lose every vote:
    # the versions are gathered with the ranks' places and the guard is refused on every rank.
    for msg in run_ranks(workers.fingerprint_version_run, 3, [2, 1, 2]):
        assert msg is not None and "version 2 on ranks 0, 2; version 1 on ranks 1" in msg
        assert "Install one sdc_guard release on every rank" in msg
    assert run_ranks(workers.fingerprint_version_run, 2, [2, 2]) == [None, None]


def test_ranks_at_other_steps_are_an_error_of_the_loop_never_a_conviction() -> None:
    # A rank that resumed from another step (a per-rank checkpoint one rank failed to write)
    # trains on in lockstep under DDP; every audit step convicted it, healthy. The first
    # step asks every rank's step (once), and the audit's gather carries it.
    for r in run_ranks(workers.step_offset_run, 3, [0, 1, 0], 0):
        assert r["at"] == 0 and r["detections"] == [], r
        assert r["error"].startswith("SDCGuard.step: the ranks are not at one step (step 0 on "
                                     "ranks 0, 2; step 1 on rank 1); every rank must call")
    for r in run_ranks(workers.step_offset_run, 3, [0, 1, 0], 2):  # drifts later
        assert r["at"] == 2 and r["detections"] == [], r
        assert r["error"].startswith("replay audit: the ranks are not at one step (step 2 on "
                                     "ranks 0, 2; step 3 on rank 1)")
    assert all(r["error"] is None for r in run_ranks(workers.step_offset_run, 3, [5, 5, 5], 0))


def test_a_batch_for_that_ignores_its_rank_is_named_not_every_rank_convicted() -> None:
    # batch_for(rank, step) built from dist.get_rank(): each rank "replays" its own batch,
    # every edge disagrees, and every audit step convicted every rank. The gathered words
    # show each replay equal to its own rank's step: an error naming batch_for instead.
    for r in run_ranks(workers.own_batch_run, 3):
        assert r["at"] == 0 and r["detections"] == [], r
        assert "batch_for(rank, step) returns this process's batch whatever rank" in r["error"]


@pytest.mark.timeout(120)
def test_a_refusal_at_the_first_audit_leaves_no_receive_for_the_next_guard() -> None:
    # The audit step posts the receive of its neighbour's replay before recomputing; a
    # refusal raised on every rank then must not leave it posted, or the next audit's send
    # would land in it and the next guard's own receive wait for ever.
    for r in run_ranks(workers.refused_then_audited_run, 3):
        assert "returned a different batch" in r["error"], r["error"]
        assert r["detections"] == [[], [], []]


def test_parameters_ddp_ignores_are_left_out_or_refused_never_a_detection() -> None:
    # DDP neither broadcasts nor all-reduces them: trained, each rank's drift apart. The
    # weights check convicted at every step, and the replay every rank at every audit step.
    res = run_ranks(workers.ignored_params_run, 3)
    for r in res:
        assert "DDP ignores the parameters ['2.weight', '2.bias']" in r["trained"]
        assert r["trained_detections"] == []  # weights and checksum, the ignored layer apart
        assert r["weight_grads_checked"] == ["0", "4"]  # "2": in no bucket, not containable
        assert r["frozen_equal"] is None and r["frozen_equal_detections"] == []
        assert "they differ between ranks" in r["frozen_differ"], r["frozen_differ"]
    assert len({r["trained_ignored"] for r in res}) == 3  # they did drift apart
    assert len({r["frozen_equal_ignored"] for r in res}) == 1


def test_a_guard_over_a_process_group_of_its_own_names_its_ranks_and_nodes() -> None:
    # Two replica sets in a job of 6 (ranks 0-2, 3-5), each guarded over its own group. A
    # fault on global rank 4 is rank 1 of the second group: named there, with its node,
    # and withheld there only; the first group trains on, unaware.
    res = run_ranks(workers.subgroup_run, 6, 5, 4, 3, timeout=300)
    for r in res[:3]:
        assert r["detections"] == [] and r["skipped"] == []
    for r in res[3:]:
        assert r["detections"] == [("replay", 3, (1,), ("node-4",))], r["detections"]
        assert r["skipped"] == [3]
    assert len({r["final"] for r in res[:3]}) == 1 and len({r["final"] for r in res[3:]}) == 1


def test_contained_detection_equals_run_that_never_saw_the_step() -> None:
    fault = {"rank": 1, "step": 4, "phase": "train", "bit": 2}
    faulty = run_ranks(workers.replay_run, 3, 8, fault=fault)
    oracle = run_ranks(workers.replay_run, 3, 8, skip_steps=(4,))
    assert faulty[0]["skipped"] == [4]
    assert {r["final"] for r in faulty} == {oracle[0]["final"]}


@pytest.mark.parametrize("variant", [{"batchnorm": True}, {"micro": 3}, {"running": True},
                                     {"host_random": True, "micro": 2}],
                         ids=["batchnorm", "micro", "running-buffer", "host-random"])
def test_batchnorm_and_gradient_accumulation(variant: dict[str, Any]) -> None:
    # running-buffer: a buffer the training forward reads. The owner's forward computes with
    # rank 0's (DDP broadcasts them first); the replay computed with its own rank's, and
    # every audit step convicted rank 2 (healthy). The arbitration (the fault below: one bad
    # edge) ran with buffers its own forward had updated. host-random: a layer that draws
    # from Python's random and NumPy's global generator, which the replay drew anew: healthy
    # ranks convicted; deterministic mode gives them the (rank, step, micro-batch) stream.
    clean = run_ranks(workers.replay_run, 3, 10, **variant)
    assert all(r["detections"] == [] for r in clean)
    fault = {"rank": 1, "step": 5, "phase": "replay", "bit": 2}
    hit = run_ranks(workers.replay_run, 3, 7, fault=fault, **variant)
    for r in hit:
        assert ("replay", 5, (1,)) in r["detections"], r["detections"]
    off = run_ranks(workers.replay_run, 3, 10, interval=0, **variant)
    assert clean[0]["final"] == off[0]["final"]


@pytest.mark.parametrize(("micro", "ddp_kwargs", "why"), [
    (3, {}, "with micro_batches > 1 the owner's first micro-batches run under no_sync()"),
    (1, {"broadcast_buffers": False}, "DDP does not broadcast them before the forward"),
], ids=["micro", "no-broadcast"])
def test_a_forward_read_buffer_no_rank_can_recompute_is_refused_not_convicted(
        micro: int, ddp_kwargs: dict[str, Any], why: str) -> None:
    # The owner computes with buffers no other rank holds (its own, or rank 0's after rank 0's
    # first micro-batches): every audit step convicted a healthy rank. The first audit step
    # sees the training forward change a buffer outside the norm layers and refuses, on every
    # rank alike (one all-reduce, once); with one micro-batch and the broadcast it audits
    # (test_batchnorm_and_gradient_accumulation[running-buffer]).
    for r in run_ranks(workers.running_buffer_run, 3, micro, ddp_kwargs):
        assert r["at"] == 0 and r["detections"] == [], r
        assert "the training forward updates buffers ['norm.mean'] outside the norm" in r["error"]
        assert why in r["error"] and "replay_interval=0" in r["error"]


@pytest.mark.parametrize("replay", [True, False])
def test_a_forward_that_writes_its_parameters_is_refused_not_convicted(replay: bool) -> None:
    # nn.Embedding(max_norm=...) renormalises the rows it looks up, in place. The replay of
    # the neighbour's batch changed this rank's weights before its own step, and every audit
    # step convicted every rank; without the replay each replica renormalised the rows of its
    # own batch and the weights check found replicas that differ at every step. The first
    # step sees a parameter's version move during the forwards and refuses on every rank
    # alike, naming it.
    for r in run_ranks(workers.max_norm_run, 3, replay):
        assert r["at"] == 0 and r["detections"] == [], r
        assert "writes parameters ['emb.weight'] in place" in r["error"], r["error"]
        assert "max_norm" in r["error"] and "weights_interval=0" in r["error"]


@pytest.mark.parametrize("kind", ["counter", "generator", "tensor in place", "tensor rebound",
                                  "list", "lazy buffer"])
@pytest.mark.parametrize("interval", [1, 2])
def test_a_forward_that_keeps_state_is_replayed_from_the_owners(interval: int, kind: str) -> None:
    # A warm-up kept as a call counter in the forward: the replay's forward advanced it, so the
    # neighbour recomputed the step at another count than the owner (every rank convicted at
    # every audit step of the warm-up), and training warmed up twice as fast as unguarded. A
    # module's own torch.Generator likewise: the replay drew from it first. The recomputation
    # now leaves the module's plain attributes and generators as it found them, tensors
    # kept as plain attributes (a step count as a tensor), rebound or updated in place, and
    # the lists it appends to (a log of the training calls, whose length the warm-up reads).
    # A buffer the first forward registers (a lazily built table): the replay, the first
    # forward of all, registered it and then raised on the buffers' count; it is removed
    # again, and the owner's forward builds it as unguarded.
    for r in run_ranks(workers.warm_up_run, 3, interval, kind):
        assert r["detections"] == [], r["detections"]
        assert r["calls"] == (12, 12) and r["same"], r


def test_state_kept_per_rank_outside_buffers_is_named_when_every_edge_disagrees() -> None:
    # A tensor attribute (not a buffer) that each rank updates from its own batches: no rank
    # can recompute another's step, so every edge disagrees from the second step on. No rank
    # is convicted, and the detection names the attribute and the fix.
    for r in run_ranks(workers.rank_state_run, 3):
        assert r["suspects"] and all(s == () for s in r["suspects"]), r
        assert all(k == ["seen"] for k in r["kept"]), r["kept"]
        assert all("['seen']" in d and "register them as buffers" in d
                   for d in r["details"]), r["details"]


def test_a_loss_that_communicates_is_refused_by_the_replay_not_convicted() -> None:
    # A contrastive loss all-gathers every rank's embeddings (SimCLR, CLIP): a recomputation
    # of the neighbour's batch gathered the other ranks' recomputations, and every audit step
    # convicted every rank. A collective issued during a recomputation (the process groups'
    # sequence numbers move) is named instead, on every rank; without the replay the loss
    # trains clean under the other checks.
    for r in run_ranks(workers.contrastive_run, 3, True):
        assert r["at"] == 0 and r["detections"] == [], r
        assert "communicates with the other ranks" in r["error"], r["error"]
        assert "replay_interval=0" in r["error"]
    for r in run_ranks(workers.contrastive_run, 3, False):
        assert r["error"] is None and r["detections"] == [], r


def test_every_edge_disagreeing_names_no_rank() -> None:
    # A loss that depends on the process (targets shifted by dist.get_rank()): every edge of
    # the ring disagreed at every audit step and every rank was convicted (a quarantine of the
    # whole job). A fault breaks only its own rank's two edges: with every edge bad the
    # detection names no rank and says why; the step is still withheld.
    for r in run_ranks(workers.rank_loss_run, 3):
        assert r["detections"] == [("replay", s, ()) for s in range(3)], r["detections"]
        assert all("every ring edge disagrees" in d for d in r["details"]), r["details"]


def test_with_several_buckets_the_exchange_rides_the_first_and_still_contains() -> None:
    # A tiny bucket cap: several buckets. Until an audit step has seen them (DDP rebuilds its
    # buckets after its first step) the words go right after the replay; then the exchange is
    # posted from the comm hook, with the first bucket. A flip on such a step is localised
    # and contained as before.
    fault = {"rank": 1, "step": 4, "phase": "train", "bit": 2}
    faulty = run_ranks(workers.replay_run, 3, 6, fault=fault, bucket_mb=0.001)
    oracle = run_ranks(workers.replay_run, 3, 6, skip_steps=(4,), bucket_mb=0.001)
    for r in faulty:
        assert r["sent_with_first_bucket"] == [2, 3, 4, 5]
        assert ("replay", 4, (1,)) in r["detections"], r["detections"]
        assert r["skipped"] == [4]
    assert {r["final"] for r in faulty} == {oracle[0]["final"]}
    # One bucket: the first is the last, so the words go right after the replay; and so they
    # do with several when asked (the placement before, which the benchmark times beside).
    for r in run_ranks(workers.replay_run, 3, 3):
        assert r["sent_with_first_bucket"] == [] and r["detections"] == []
    for r in run_ranks(workers.replay_run, 3, 6, fault=fault, bucket_mb=0.001,
                       first_bucket=False):
        assert r["sent_with_first_bucket"] == []
        assert ("replay", 4, (1,)) in r["detections"] and r["skipped"] == [4]


def test_a_new_audit_learns_the_buckets_from_the_steps_before_its_first_audit() -> None:
    # The audit is built anew by SDCGuard(...) and by every reconfigure(); its first audit
    # step came after steps without one (here 1 and 2; step 0 is left out). It posted that
    # step's exchange right after the replay, having seen no bucket of its own yet: the
    # placement that costs an oversubscribed machine ~15% of an audit, paid by every
    # benchmark block at intervals of 2 and more. The steps before count now. A flip on
    # that step is still localised and contained.
    fault = {"rank": 2, "step": 3, "phase": "train", "bit": 2}
    for r in run_ranks(workers.replay_run, 3, 5, interval=3, skip_steps=(0,), fault=fault,
                       bucket_mb=0.001):
        assert r["sent_with_first_bucket"] == [3], r["sent_with_first_bucket"]
        assert ("replay", 3, (2,)) in r["detections"], r["detections"]
        assert r["skipped"] == [3]


@pytest.mark.parametrize("variant", [{"batchnorm": True}, {"micro": 3}])
def test_batchnorm_and_accumulation_localise_contain_and_keep_the_blind_spot(
        variant: dict[str, Any]) -> None:
    # The rest of the audit's tests on the BatchNorm and gradient-accumulation models: a flip
    # in the own computation, contained (the weights equal a run that never saw the step) ...
    fault = {"rank": 1, "step": 4, "phase": "train", "bit": 2}
    faulty = run_ranks(workers.replay_run, 3, 6, fault=fault, **variant)
    oracle = run_ranks(workers.replay_run, 3, 6, skip_steps=(4,), **variant)
    for r in faulty:
        assert ("replay", 4, (1,)) in r["detections"], r["detections"]
        assert r["skipped"] == [4]
    assert {r["final"] for r in faulty} == {oracle[0]["final"]}
    # ... a permanent fault caught at the first audit step (4 ranks) ...
    permanent = {"rank": 2, "step": 2, "phase": "any", "bit": 9, "permanent": True}
    for r in run_ranks(workers.replay_run, 4, 5, interval=3, fault=permanent, **variant):
        assert next(d for d in r["detections"] if d[0] == "replay") == ("replay", 3, (2,))
    # ... and a flip on a step that is not audited goes unseen, as documented.
    blind = {"rank": 1, "step": 3, "phase": "train", "bit": 2}
    for r in run_ranks(workers.replay_run, 3, 5, interval=2, fault=blind, **variant):
        assert r["detections"] == []


@pytest.mark.parametrize(("width", "unused", "as_view", "flat"),
                         [(32, False, False, True), (33, False, False, False),
                          (32, True, False, True), (32, False, True, True)])
def test_gradient_word_is_the_same_from_flat_buckets_and_separate_gradients(
        width: int, unused: bool, as_view: bool, flat: bool) -> None:
    # Several buckets (a tiny cap), aligned or not, with an unused parameter or not,
    # gradients as bucket views or not: the bucket-level word equals the per-gradient
    # one, and clean audits stay clean.
    res = run_ranks(workers.replay_layout_run, 3, 6, width=width, unused=unused,
                    bucket_mb=0.002, as_view=as_view)
    for r in res:
        assert r["detections"] == []
        assert all(r["same"]) and bool(r["same"]) is flat
        assert len(r["summed"]) == 6 and all(r["summed"])
        assert any(r["flat_buckets"]) is flat
        # Flat float32 buckets on the CPU: the scaling pass computes their share.
        assert (r["fused"] > 0) is (flat and r["native"])


def test_a_sparse_embedding_gradient_is_audited_and_its_fault_contained() -> None:
    # nn.Embedding(sparse=True): its COO gradient broke the audit's digest (a reshape of a
    # sparse tensor) and, in the step's last bucket, left the veto no dense slot. The audit
    # digests the coalesced indices and values; the veto goes by a word of its own there.
    clean = run_ranks(workers.sparse_embedding_run, 3, 4, None)
    assert all(r["detections"] == [] for r in clean), clean
    assert len({r["state"] for r in clean}) == 1
    fault = {"rank": 1, "step": 2, "factor": 3.0}
    res = run_ranks(workers.sparse_embedding_run, 3, 4, fault)
    for r in res:
        assert r["detections"] == [("replay", 2, (1,), True)], r["detections"]
    assert len({r["state"] for r in res}) == 1  # withheld on every rank: no replica diverged


def test_a_layer_frozen_during_training_is_left_out_of_the_replay() -> None:
    # Progressive freezing: requires_grad_(False) on a layer mid-training (DDP with
    # find_unused_parameters=True takes it). The replay still asked autograd for that
    # layer's gradients and every rank raised "One of the differentiated Tensors does not
    # require grad" at the next audit step. A frozen middle layer still runs its product's
    # backward (the input gradient, for the layers before it, when they train) and DDP's
    # bucket holds zeros for its weight: the checksum's weight-gradient identity convicted
    # every rank at every step.
    for r in run_ranks(workers.freeze_run, 3):
        assert r["detections"] == [] and r["same"], r


def test_the_nonfinite_recomputation_skips_a_layer_frozen_since(one_rank: None) -> None:
    # The non-finite check's recomputation of a rank's batch (bad data, or a fault?) raised
    # on a layer frozen since the guard was built; it gave up, and the rank the batch came
    # from stayed the suspect.
    from sdc_guard.checks.nonfinite import NeighbourRecompute

    model: Any = workers.make_mlp()
    again = NeighbourRecompute(model, loss_fn=workers.loss_fn, batch_for=workers.batch_for,
                               micro_batches=1, seed=0, device=torch.device("cpu"))
    for p in model[0].parameters():
        p.requires_grad_(False)
    assert again.nonfinite(0, 3) is False
    with torch.no_grad():
        model[2].weight[0, 0] = float("inf")  # (a forward that overflows: found non-finite)
    assert again.nonfinite(0, 3) is True


def test_quantisation_aware_training_is_replayed() -> None:
    # The fake quantisers' observers keep their per-channel ranges in buffers that start
    # empty and are resized by the first forward: the replay (the first forward of all)
    # restored the buffers by copying and every rank raised a size mismatch at step 0.
    # Buffers a forward resized are resized back.
    for r in run_ranks(workers.qat_run, 3):
        assert r["detections"] == [] and r["same"], r
        assert r["ranges"] == (32,), r
