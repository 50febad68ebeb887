"""The checksum check under FSDP2 (``fully_shard``) on gloo: FSDP on 2 ranks, HSDP 2x2.

Every ``nn.Linear`` of a sharded model is checked as under DDP: the forward product and the
input gradient in the hooks on the gathered weight, the weight gradient on this rank's local
gradients before the reduce-scatter. Clean runs of the campaign's models (the MLP, whose
rows FSDP2 pads, and the Llama-style model in float32 and in bf16 mixed precision with
activation checkpointing) detect nothing and equal plain FSDP2 bit for bit; a fault in any
product on one rank is reported once, as "checksum", naming that rank, and the step is
withheld on every rank. The rank functions live in ``checksum_fsdp_workers``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.launch import run_ranks
from tests.sdc_guard import checksum_fsdp_workers as w

SHAPES = {"fsdp2": (2,), "hsdp2x2": (2, 2)}


def _fault(product: str, target: str, step: int, rank: int = 1,
           bits: tuple[int, ...] = (29,)) -> dict[str, Any]:
    return {"site": "linear_product", "product": product, "rank": rank, "target": target,
            "bits": bits, "step": step}


@pytest.mark.parametrize(("name", "kind", "micro", "how"), [
    ("hsdp2x2", "mlp", 2, {}),
    ("fsdp2", "llama", 1, {}),
    ("fsdp2", "llama", 1, {"mixed_precision": True, "checkpointing": True}),
], ids=["mlp-hsdp2x2-micro2", "llama-fsdp2-float32", "llama-fsdp2-bf16-checkpointed"])
def test_clean_runs_detect_nothing_and_equal_plain_fsdp2(name: str, kind: str, micro: int,
                                                         how: dict[str, bool]) -> None:
    """25 clean steps: every linear layer found and run through the check (the C passes in
    float32), no detection, nothing withheld, and every shard of the weights and optimizer
    state bit for bit plain FSDP2's (the check only reads). The long clean runs are the
    soak's (``python -m bench.soak``)."""
    shape = SHAPES[name]
    results = run_ranks(w.guarded, math.prod(shape), shape, kind, 25, micro=micro,
                        compare_plain=True, timeout=300, **how)
    for res in results:
        assert res["gathered"]
        assert res["layers"] == res["linears"] and res["skipped"] == []
        assert res["uncalled"] == []
        assert res["detections"] == [] and res["withheld"] == []
        assert res["same_as_plain"]
        assert res["replicas_alike"]
        assert (res["native_calls"] > 0) == (not how.get("mixed_precision"))


def _assert_caught(results: list[dict[str, Any]], faults: list[dict[str, Any]]) -> None:
    """Each fault: one "checksum" detection in its step naming its rank, layer and product,
    on every rank; that step withheld on every rank (no shard moved in it), the others not;
    the suspect's own evidence names the product."""
    steps = [f["step"] for f in faults]
    for r, res in enumerate(results):
        assert res["detections"] == [("checksum", f["step"], (f["rank"],)) for f in faults]
        assert res["ranks"] == [{str(f["rank"]): {"products": [f["product"]],
                                                  "layer": f["target"]}} for f in faults]
        assert res["withheld"] == steps
        assert not set(res["moved"]) & set(steps)
        assert len(res["moved"]) == res["steps"] - len(steps)
        assert res["replicas_alike"]
        assert res["fired"] == [f["step"] for f in faults if f["rank"] == r]
        for f, entries in zip(faults, res["entries"], strict=True):
            if f["rank"] == r:
                assert entries is not None
                assert {e["product"] for e in entries} == {f["product"]}


@pytest.mark.parametrize(("name", "micro", "native", "nonfinite", "bound"), [
    ("fsdp2", 1, True, True, "exact"),
    ("fsdp2", 1, False, False, "exact"),
    ("fsdp2", 1, False, True, "norm"),
    ("hsdp2x2", 2, True, False, "exact"),
], ids=["fsdp2", "fsdp2-torch-ops-checksum-alone", "fsdp2-torch-ops-norm-bound",
        "hsdp2x2-micro2-checksum-alone"])
def test_a_fault_in_each_product_is_named_and_withheld_on_every_rank(
        name: str, micro: int, native: bool, nonfinite: bool, bound: str) -> None:
    """The MLP 16-15-15-4 (two layers FSDP2 pads, each layer its own ``fully_shard``): a
    flipped exponent bit in the forward product, the input gradient and the weight gradient
    of rank 1's (or rank 3's) layers, each in its own step: found in that step, named, and
    contained on every rank, by the checksum's word alone when the non-finite check is
    off, in the C passes and in torch operations alike, with either bound."""
    shape = SHAPES[name]
    world = math.prod(shape)
    last = world - 1
    faults = [_fault("forward", "net.0", 2), _fault("input_grad", "net.2", 4, rank=last),
              _fault("weight_grad", "net.4", 6), _fault("weight_grad", "net.2", 8, rank=0)]
    results = run_ranks(w.guarded, world, shape, "mlp", 10, faults=tuple(faults),
                        micro=micro, native=native, nonfinite=nonfinite, bound=bound,
                        timeout=300)
    _assert_caught(results, faults)


def test_mixed_precision_and_checkpointing_faults_in_the_llama() -> None:
    """The Llama-style model as users run FSDP2 (bf16 parameters, float32 reductions, each
    block recomputed in the backward), two micro-batches a step (FSDP2 accumulates their
    bf16 weight gradients in float32): a flipped exponent bit in a bf16 product of a block's
    layer and of the root's output layer (its weight gradient shares the root's reduce-
    scatter with the embeddings and the norm), each named in its step and withheld; the
    clean steps between them pass."""
    faults = [_fault("forward", "blocks.0.attention.wq", 2, bits=(14,)),
              _fault("input_grad", "blocks.1.feed_forward.w2", 4, bits=(14,)),
              _fault("weight_grad", "output", 6, bits=(14,)),
              _fault("weight_grad", "blocks.0.feed_forward.w3", 8, rank=0, bits=(14,))]
    results = run_ranks(w.guarded, 2, (2,), "llama", 10, faults=tuple(faults), micro=2,
                        mixed_precision=True, checkpointing=True, timeout=300)
    _assert_caught(results, faults)


def test_every_layers_weight_gradient_is_checked_before_the_reduce_scatter() -> None:
    """The Llama-style model in float32: rank 1's weight gradient of each of its 15 linear
    layers corrupted in a step of its own (its rows lie in its module's reduce-scatter input
    beside the other parameters', split between the shard ranks): each found in its step,
    naming the layer."""
    names = w.llama_linears()
    faults = [_fault("weight_grad", n, 1 + i) for i, n in enumerate(names)]
    results = run_ranks(w.guarded, 2, (2,), "llama", len(names) + 2, faults=tuple(faults),
                        timeout=300)
    _assert_caught(results, faults)
