"""The checksum check on 3 gloo ranks: no false positive on any shipped model in float32 or
bfloat16; a fault inside any product of a linear layer is detected in its step, on the right
rank and layer, and contained on every rank, with or without the non-finite check, a
GradScaler or a comm hook of the user's."""

from __future__ import annotations

import shutil
from typing import Any

import pytest

from sdc_guard import ChecksumConfig
from tests.launch import run_ranks
from tests.sdc_guard import checksum_workers as W

PRODUCTS = ("forward", "input_grad", "weight_grad")
TOP_BITS = (30, 29, 28)


def _faults(target: str = "net.2", bits: tuple[int, ...] = TOP_BITS) -> list[dict[str, Any]]:
    return [{"site": "linear_product", "product": p, "rank": 1, "target": target, "bits": (b,),
             "step": 0} for p in PRODUCTS for b in bits]


def _assert_caught(results: list[list[dict[str, Any]]], faults: list[dict[str, Any]],
                   layer: str) -> None:
    for i, f in enumerate(faults):
        on = [r[i] for r in results]
        steps = {s for s, _ in on[1]["fired"]}  # one step (each micro-batch's forward fires)
        assert len(steps) == 1, (f, on[1]["fired"])
        step = steps.pop()
        for r in on:  # every rank reports it, once, as the checksum's, naming rank 1
            assert r["detections"] == [("checksum", step, (1,))], (f, r["detections"])
            assert r["skipped"] == [step], (f, r["skipped"])  # withheld on every rank
            assert r["layers"][0]["1"] == {"products": [f["product"]], "layer": layer}
        assert on[1]["entries"][0][0]["product"] == f["product"]  # the suspect's own evidence
        assert on[0]["entries"] == [None]
        assert len({tuple(r["states"]) for r in on}) == 1  # replicas identical throughout


@pytest.mark.parametrize("nonfinite", [True, False])
def test_top_exponent_flips_in_every_product_are_caught_and_contained(nonfinite: bool) -> None:
    faults = _faults()
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": nonfinite,
                                              "weights_interval": 1}, timeout=300)
    _assert_caught(res, faults, "net.2")


def test_transformer_attention_projection_and_micro_batches() -> None:
    faults = _faults("blocks.0.attn.qkv", (30,))
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True}, kind="transformer", micro=2,
                    timeout=300)
    _assert_caught(res, faults, "blocks.0.attn.qkv")


def test_grad_scaler_keeps_its_scale_and_user_comm_hook_still_contains() -> None:
    faults = _faults(bits=(30,))
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": False},
                    scaler=True, timeout=300)
    _assert_caught(res, faults, "net.2")
    assert {r["scale"] for rank in res for r in rank} == {256.0}  # no overflow seen
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": False},
                    user_hook=True, timeout=300)
    _assert_caught(res, faults, "net.2")


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad-scaler"])
def test_two_ranks_vetoing_in_one_step_make_one_detection(scaler: bool) -> None:
    # Ranks 1 and 2 fail a product in the same step: each writes its own slot of the veto
    # sentinel, so the reduced gradients stay finite. One checksum detection names both;
    # the non-finite check reports nothing and a GradScaler keeps its scale.
    both = [{**f, "rank": r} for r in (1, 2) for f in _faults(bits=(30,))[:1]]
    res = run_ranks(W.fault_runs, 3, [both], {"checksum": True, "nonfinite": True},
                    scaler=scaler, timeout=300)
    step = res[1][0]["fired"][0][0]
    for rank in res:
        r = rank[0]
        assert r["detections"] == [("checksum", step, (1, 2))], r["detections"]
        assert r["skipped"] == [step]
        assert r["scale"] == (256.0 if scaler else None)
    assert len({tuple(rank[0]["states"]) for rank in res}) == 1


def test_report_only_leaves_the_gradients_alone() -> None:
    faults = _faults(bits=(29,))[:1]
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": False,
                                              "skip_step_on_detection": False}, timeout=300)
    for r in res:
        assert r[0]["detections"] and r[0]["skipped"] == []
        assert r[0]["moved"]


def test_no_false_positive_on_any_model_in_float32_or_bfloat16() -> None:
    runs = [(k, d) for k in ("mlp", "cnn", "cnn_bn", "transformer")
            for d in ("float32", "bfloat16")]
    res = run_ranks(W.clean_run, 3, runs, 100, timeout=900)
    for key, r in res[0].items():
        assert r["detections"] == [] and r["skipped"] == [], (key, r)
        assert r["layers"], key
        assert 0 < r["worst_fraction_of_tolerance"] < 1, (key, r)


def test_layer_choice_subclasses_and_reconfigure() -> None:
    res = run_ranks(W.hooks_and_subclasses, 3, timeout=120)[0]
    assert res["default"] == (["0", "4"], ["2"])  # the LoRA subclass: a forward of its own
    assert res["named"] == ["0", "4"]
    assert res["detections"] == []  # in-place ReLUs after the checked layers: no false alarm
    assert res["hooks_left"] == 0 and res["weight_hooks_left"] == 0
    assert "'nope' matches no floating-point nn.Linear" in res["error"]


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_a_compiled_module_with_checksum_and_replay_has_no_false_positive() -> None:
    # Traced by torch.compile, the checksum's hooks read whether the checks are on: the step
    # and the replay (checks idle) compiled to different graphs whose kernels disagreed in
    # the last bits, and the first audit convicted every rank. Run eagerly, they split both
    # alike.
    for r in run_ranks(W.compiled_run, 3, 4, timeout=600):
        assert r["clean"] == [], r
        assert r["fault"] == [("replay", 4, (1,)), ("checksum", 4, (1,))] and r["skipped"], r


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_products_are_checked_once(reentrant: bool) -> None:
    # Without reentry, the recomputation inside the backward ran the layer's forward
    # pre-hook again (and stopped before its forward hook): that call took the place of the
    # forward's own, and a flipped input gradient went unseen. With reentry the recomputed
    # graph is the one the backward runs through, and is checked.
    faults = [{"site": "linear_product", "product": p, "rank": 1, "target": t, "bits": (30,)}
              for p in PRODUCTS for t in ("blocks.0.0", "blocks.1.2")]
    for r in run_ranks(W.checkpointed_run, 3, reentrant, faults, timeout=300):
        assert r[0] == [], r[0]
        for i, (f, found) in enumerate(zip(faults, r[1:], strict=True)):
            assert found == [("checksum", 2 + i, (1,))], (f, found)


def test_the_replay_names_reentrant_checkpointing_and_audits_the_other() -> None:
    # torch.autograd.grad, which the replay needs, cannot run through the reentrant form:
    # torch's error from deep inside the audit now names the fix.
    for r in run_ranks(W.checkpointed_run, 3, True, [], True):
        assert "use_reentrant=True" in r[0] and "Pass use_reentrant=False" in r[0], r[0]
    assert run_ranks(W.checkpointed_run, 3, False, [], True) == [[[]]] * 3


def test_an_expert_without_tokens_a_vector_and_a_strided_input() -> None:
    # An expert no token was routed to multiplies an empty input: the C backward pass
    # refused its sizes and the step raised. Such a call has no product to check, and no
    # element for a fault to hit (the fault waits for a call that has one).
    faults = [{"site": "linear_product", "product": "forward", "rank": 1, "target": "expert",
               "bits": (30,)},
              {"site": "activation", "rank": 1, "target": "expert", "bits": (30,)}]
    faults += [{"site": "linear_product", "product": p, "rank": 1, "target": t, "bits": (30,)}
               for p in PRODUCTS for t in ("vec", "heads")]
    for r in run_ranks(W.odd_calls_run, 3, faults, timeout=300):
        assert r["clean"] == [], r["clean"]
        assert r["faults"][:2] == [{"detections": [], "fired": 0}] * 2
        for i, (f, got) in enumerate(zip(faults[2:], r["faults"][2:], strict=True)):
            assert got["detections"][-1] == ("checksum", 5 + i, (1,)), (f, got)


def test_parametrized_weights_are_left_out_and_training_is_unchanged() -> None:
    # spectral_norm computes the weight anew at each access and runs its power iteration
    # each time: the checksum's hooks, reading m.weight, ran it again in the training
    # forward and not in the replay, and every audit step convicted every rank; the guarded
    # run also trained differently from the plain one. Such layers are not checked.
    for r in run_ranks(W.parametrized_run, 3, 4, timeout=300):
        assert r["detections"] == [], r["detections"]
        assert r["layers"] == ["4"], r["layers"]
        assert all(r["same"].values()), r["same"]


@pytest.mark.parametrize("native", [True, False])
def test_a_gradient_taken_inside_the_loss_turns_the_weight_identity_off(native: bool) -> None:
    # A physics-informed loss takes du/dx with create_graph=True: the layers' backward ran
    # inside loss_fn and their weight gradients got that gradient's terms, and the
    # weight-gradient identity convicted every rank at every step. The check sees a backward
    # before loss_fn returns and stops checking weight gradients; a flip in a forward or
    # input-gradient product is still caught in its step.
    for r in run_ranks(W.physics_run, 3, native, None):
        assert r["detections"] == [] and r["skipped"] == [] and r["inner_backward"], r
    for product in ("forward", "input_grad"):
        fault = {"site": "linear_product", "product": product, "rank": 1, "target": "2",
                 "bits": (30,), "step": 2}
        for r in run_ranks(W.physics_run, 3, native, fault):
            assert ("checksum", 2, (1,)) in r["detections"] and 2 in r["skipped"], (product, r)


def test_parameters_laid_out_otherwise_are_read_in_their_own_order() -> None:
    # DDP lays a gradient out in its bucket with its parameter's strides (a column-major
    # linear weight, a channels_last convolution, a transposed matrix), and the bucket's
    # gradients() views it as row-major: the checksum's weight-gradient row sums and the
    # replay's own gradient word read the elements in another order than the
    # recomputation, and every rank was convicted at every step. Read with the parameters'
    # strides, clean steps pass and a weight-gradient flip is still caught in its step.
    for r in run_ranks(W.strided_run, 3, None):
        assert r["detections"] == [] and r["skipped"] == [], r
    fault = {"site": "linear_product", "product": "weight_grad", "rank": 1, "target": "lin",
             "bits": (30,), "step": 2}
    for r in run_ranks(W.strided_run, 3, fault):
        assert ("checksum", 2, (1,)) in r["detections"] and 2 in r["skipped"], r


def test_the_users_own_hooks_are_no_fault_of_the_product() -> None:
    # Hooks a user puts on the layers change what comes out after the product: a gradient
    # clamp on every parameter (a common idiom), a forward hook replacing or scaling the
    # output, a full backward hook halving the input gradient, a post-accumulate hook. The
    # checksum compared W.grad, the hooked output and the hooked input gradient with the
    # product and convicted every rank at every step. It now reads the product's own output
    # (its forward hook runs first), the gradients its node passes on, and a hooked weight's
    # gradient at the node. Training is the plain loop's, bit for bit.
    for post_accumulate in (False, True):
        for r in run_ranks(W.user_hooks_run, 3, post_accumulate, None):
            assert r["detections"] == [] and r["skipped"] == [], (post_accumulate, r)
            assert r["same"], post_accumulate
            assert r["at_node"] == [True, True, True], r
    # A fault in the kernel of a hooked weight's gradient product is caught in its step.
    for r in run_ranks(W.user_hooks_run, 3, False, 2):
        assert r["detections"] == [("checksum", 2, (1,))] and r["skipped"] == [2], r
    # And one in a product of its own node (the injector's): read at the node that passes
    # the weight its gradient (it escaped: seen on a GPU's device check).
    for r in run_ranks(W.user_hooks_run, 3, False, 1, True):
        assert r["detections"] == [("checksum", 1, (1,))] and r["skipped"] == [1], r


def test_a_global_forward_hook_of_the_users_runs_after_the_check() -> None:
    # torch runs global forward hooks before a module's own: one that changed a linear
    # layer's output made every product of every step a mismatch (and every step withheld).
    for in_place in (False, True):
        for r in run_ranks(W.global_hook_run, 3, in_place, None):
            assert r["detections"] == [] and r["skipped"] == [], (in_place, r)
            assert r["same"] and r["front_while_hooked"], r
            # Gone with the user's hook: a global hook takes every call off torch's fast path.
            assert not r["front_after"] and r["global_hooks_left"] == 0, r
        for r in run_ranks(W.global_hook_run, 3, in_place, 2):
            assert r["detections"] == [("checksum", 2, (1,))] and r["skipped"] == [2], r
    # Two guards: each check's global hook ahead of the user's.
    assert run_ranks(W.two_guards_global_hook_run, 3) == [{"detections": []}] * 3


def test_the_replay_names_a_post_accumulate_hook() -> None:
    # torch.autograd.grad, which the replay takes its gradients with, runs no post-accumulate
    # hook: every edge disagreed at every audit step.
    for r in run_ranks(W.post_accumulate_replay_refused, 3):
        assert "['0.weight'] have post-accumulate-grad hooks" in r["built"], r
        assert "['2.bias'] have post-accumulate-grad hooks" in r["later"], r
        assert "replay_interval=0" in r["later"]


def test_under_autocast_the_checks_own_sides_stay_float32() -> None:
    # A forward hook runs inside the user's autocast region: the check's own products (its
    # right-hand sides) must not be cast down with the model's, or they would carry
    # bfloat16's rounding the tolerance does not allow for.
    for r in run_ranks(W.autocast_run, 3, 6, timeout=300):
        assert r["detections"] == []
        assert not r["native"]  # bfloat16 outputs: the torch path
        assert r["forward_entries"] >= 6 * 3
        assert r["worst"] < 1e-5, r["worst"]  # float32 sums: ~1e-6; bfloat16's: ~2e-3


def test_the_fused_sides_catch_every_product_fault_and_stay_quiet_when_clean() -> None:
    # The sides a GPU may take fused (sdc_guard.checks.sides), on the CPU, run as written:
    # each agreed with the eager form on its first use, then carried the check alone.
    faults = _faults(bits=(30,))
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True, "nonfinite": False},
                    native=False, fused=True, timeout=300)
    _assert_caught(res, faults, "net.2")
    assert res[0][-1]["fused"] == {"forward": True, "gx+gw": True, "gw": True, "weight": True}
    faults = _faults("blocks.0.attn.qkv", (29,))
    res = run_ranks(W.fault_runs, 3, faults, {"checksum": True}, kind="transformer", micro=2,
                    native=False, fused=True, timeout=300)
    _assert_caught(res, faults, "blocks.0.attn.qkv")
    runs = [("mlp", "bfloat16"), ("transformer", "float32"), ("cnn", "float32")]
    for key, r in run_ranks(W.clean_run, 3, runs, 60, True, timeout=600)[0].items():
        assert r["detections"] == [] and r["skipped"] == [], (key, r)
        assert 0 < r["worst_fraction_of_tolerance"] < 1, (key, r)
        assert set(r["fused"].values()) == {True}, (key, r)  # every one that ran agreed
        assert {"forward", "gx+gw", "weight"} <= set(r["fused"]), (key, r)


@pytest.mark.parametrize("products,bound", [
    (("input_grad", "weight_grad"), "exact"), (("forward",), "exact"),
    (("forward", "input_grad", "weight_grad"), "norm")])
def test_the_torch_path_checks_the_products_asked_for_with_either_bound(
        products: tuple[str, ...], bound: str) -> None:
    faults = [f for f in _faults(bits=(30,)) if f["product"] in products]
    cfg = {"checksum": ChecksumConfig(products=products, bound=bound),
           "nonfinite": False}
    res = run_ranks(W.fault_runs, 3, faults, cfg, native=False, timeout=300)
    _assert_caught(res, faults, "net.2")
    others = [f for f in _faults(bits=(30,)) if f["product"] not in products][:1]
    if others:  # a product not asked for is not the checksum's to name
        for rank in run_ranks(W.fault_runs, 3, others, cfg, native=False, timeout=300):
            assert [d for d in rank[0]["detections"] if d[0] == "checksum"] == []
