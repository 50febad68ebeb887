"""The harness's Llama-style model (``scenarios.spec.models.TinyLlama``) and the ways
``scenarios.spec.sharding`` spreads the campaigns' models over ranks: DDP, FSDP2, HSDP, with
mixed precision and activation checkpointing. Multi-rank runs use real gloo groups
(``tests.launch.run_ranks``, rank functions in ``tests.scenarios.llama_workers``); each is
started once per module and read by several tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from scenarios.spec.models import (
    MODEL_KINDS,
    LlamaBlock,
    RotaryAttention,
    TinyLlama,
    activation_targets,
    build_model,
    linear_targets,
    parameter_targets,
    scenario_loss,
    swiglu_hidden,
    synthetic_batch,
)
from scenarios.spec.scenario import parameter_count
from scenarios.spec.sharding import apply_activation_checkpointing, is_checkpointed, shard_units
from tests.launch import run_ranks
from tests.scenarios import llama_workers

pytestmark = pytest.mark.timeout(300)


def _llama(seed: int = 0) -> TinyLlama:
    model = build_model("llama", width=64, depth=2, seed=seed)
    assert isinstance(model, TinyLlama)
    return model


def _blocks(model: TinyLlama) -> list[LlamaBlock]:
    blocks = [b for b in model.blocks if isinstance(b, LlamaBlock)]
    assert len(blocks) == len(model.blocks)
    return blocks


def _train(model: nn.Module, steps: int, *, batch: int = 8) -> list[float]:
    """``steps`` AdamW steps on the llama's synthetic batches (rank 0); the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = scenario_loss(model, synthetic_batch("llama", 0, 0, step, 0, batch=batch))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- the model, in one process -----------------------------------------------------------------
def test_llama_has_the_shape_of_torchtitans() -> None:
    model = _llama()
    assert "llama" in MODEL_KINDS
    blocks = _blocks(model)
    assert len(blocks) == 2
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 7 * 2 + 1 and all(m.bias is None for m in linears)  # no biases
    assert sum(isinstance(m, nn.RMSNorm) for m in model.modules()) == 2 * 2 + 1
    attn = blocks[0].attention
    assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 2, 16)  # grouped-query
    assert attn.wk.out_features == attn.wv.out_features == 2 * 16
    assert blocks[0].feed_forward.w1.out_features == swiglu_hidden(64) == 192
    assert swiglu_hidden(96) == 256 and swiglu_hidden(64) % 32 == 0
    assert model.output.weight is not model.tok_embeddings.weight  # untied
    # rotary tables: buffers that travel with the module, never in a checkpoint
    buffers = {n for n, _ in model.named_buffers()}
    assert "blocks.0.attention.rope_cos" in buffers and "blocks.1.attention.rope_sin" in buffers
    assert not any("rope" in k for k in model.state_dict())
    x, _ = synthetic_batch("llama", 0, 0, 0, 0, batch=3)
    assert model(x).shape == (3, x.shape[1], 16)


def test_llama_targets_and_meta_count() -> None:
    model = _llama()
    lin = linear_targets(model)
    assert len(lin) == 15 and "blocks.1.feed_forward.w3" in lin and "output" in lin
    acts = activation_targets(model)
    for name in ("tok_embeddings", "blocks.0.attention_norm", "blocks.0.feed_forward.act",
                 "blocks.1.attention.wo", "norm", "output"):
        assert name in acts
    assert "blocks.0.attention" not in acts  # not a leaf: its output is not one layer's
    params = parameter_targets(model)
    assert len(params) == 21 and "blocks.0.ffn_norm.weight" in params
    # the scenario limits count it on the meta device, as the real one
    assert parameter_count("llama", 64, 2) == sum(p.numel() for p in model.parameters())


def test_llama_refuses_a_width_its_heads_cannot_split() -> None:
    with pytest.raises(ValueError, match=r"llama width must be a multiple of 8 .* got 60; use e\.g\. 56"):
        build_model("llama", width=60, depth=2, seed=0)
    with pytest.raises(ValueError, match="kv_heads must divide heads=4, got 3"):
        TinyLlama(64, 2, kv_heads=3)


def test_llama_batches_are_the_transformers_sequences() -> None:
    x, y = synthetic_batch("llama", 7, 1, 3, 0, batch=5)
    tx, ty = synthetic_batch("transformer", 7, 1, 3, 0, batch=5)
    assert torch.equal(x, tx) and torch.equal(y, ty)
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
    other, _ = synthetic_batch("llama", 7, 1, 4, 0, batch=5)
    assert not torch.equal(x, other)  # another step, another batch


def test_llama_is_causal() -> None:
    """A token changes no logit before its own position."""
    model = _llama()
    x, _ = synthetic_batch("llama", 0, 0, 0, 0, batch=2)
    changed = x.clone()
    changed[:, 7] = (changed[:, 7] + 5) % 16
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :7], b[:, :7])
    assert not torch.equal(a[:, 7:], b[:, 7:])


def test_rotary_scores_depend_on_the_offset_only() -> None:
    """q at position i and k at position j score as q at i + s and k at j + s; the rotation
    keeps lengths; without it every offset would score the same."""
    attn = RotaryAttention(64, heads=4, kv_heads=2, max_seq=12)
    g = torch.Generator().manual_seed(3)
    q0, k0 = torch.randn(16, generator=g), torch.randn(16, generator=g)
    q = attn.rotate(q0.expand(1, 1, 12, 16))[0, 0]
    k = attn.rotate(k0.expand(1, 1, 12, 16))[0, 0]
    scores = q @ k.T
    for offset in (0, 1, 5):
        diag = torch.diagonal(scores, offset=-offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.norm(dim=-1), q0.norm().expand(12), rtol=1e-5, atol=1e-6)
    assert len({round(float(torch.diagonal(scores, -o)[0]), 4) for o in range(6)}) == 6


def test_llama_trains() -> None:
    losses = _train(_llama(), 20)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses


def test_llama_same_seed_same_bits() -> None:
    a, b, c = _llama(seed=5), _llama(seed=5), _llama(seed=6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.output.weight, c.output.weight)
    assert _train(a, 4) == _train(b, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_llama_in_bfloat16() -> None:
    """A bfloat16 model trains; its rotation runs in float32 and hands back bfloat16."""
    model = _llama()
    model.to(torch.bfloat16)
    z = torch.randn(1, 4, 12, 16).to(torch.bfloat16)
    assert _blocks(model)[0].attention.rotate(z).dtype == torch.bfloat16
    losses = _train(model, 3)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


# -- sharding helpers, in one process ----------------------------------------------------------
def test_shard_units_of_every_model_kind() -> None:
    def units(kind: str) -> list[str]:
        model = build_model(kind, width=8, depth=2, seed=0)
        names = {id(m): n for n, m in model.named_modules()}
        return [names[id(u)] for u in shard_units(model)]

    assert units("llama") == units("transformer") == ["blocks.0", "blocks.1"]
    assert units("mlp") == ["net.0", "net.2", "net.4"]
    assert units("cnn") == ["conv1", "conv2", "head"]
    assert units("cnn_bn") == ["conv1", "norm1", "conv2", "norm2", "head"]


def test_activation_checkpointing_recomputes_and_changes_nothing_else() -> None:
    """Checkpointed blocks keep their names and class, give the same loss and gradients bit
    for bit, and run their layers a second time in the backward."""
    plain, ckpt = _llama(), _llama()
    apply_activation_checkpointing(ckpt)
    apply_activation_checkpointing(ckpt)  # twice: still one recomputation
    assert all(is_checkpointed(b) and isinstance(b, LlamaBlock) for b in ckpt.blocks)
    assert not any(is_checkpointed(b) for b in plain.blocks)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
    calls = {"plain": 0, "ckpt": 0}
    for key, model in (("plain", plain), ("ckpt", ckpt)):
        def count(*_: Any, key: str = key) -> None:
            calls[key] += 1
        _blocks(model)[0].feed_forward.w1.register_forward_hook(count)
    batch = synthetic_batch("llama", 0, 0, 0, 0, batch=4)
    lp, lc = scenario_loss(plain, batch), scenario_loss(ckpt, batch)
    lp.backward()  # type: ignore[no-untyped-call]
    lc.backward()  # type: ignore[no-untyped-call]
    assert torch.equal(lp, lc)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad), name
    assert calls == {"plain": 1, "ckpt": 2}


# -- FSDP2 and DDP on two ranks ------------------------------------------------------------
STEPS = 3


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, dict[str, Any]]]:
    """DDP, FSDP2 twice, FSDP2 + activation checkpointing, FSDP2 + mixed precision: the same
    three steps of the llama on 2 ranks, each rank its own batches."""
    results: list[dict[str, dict[str, Any]]] = run_ranks(llama_workers.two_rank_runs, 2, STEPS)
    return results


def test_fsdp_equals_ddp_bit_for_bit_on_two_ranks(two_ranks: list[dict[str, Any]]) -> None:
    """FSDP2 reduce-scatters where DDP all-reduces, in another order and with the division
    by the world placed elsewhere; with 2 ranks neither changes a bit: a sum of two float32
    numbers is the same in either order, and halving is exact (barring subnormals). So the
    tolerance here is zero; on 4 ranks (HSDP below) it is not."""
    for rank, runs in enumerate(two_ranks):
        ddp, fsdp = runs["ddp"], runs["fsdp"]
        assert ddp["parallel_of"] == ("ddp", (2,)) and fsdp["parallel_of"] == ("fsdp", (2,))
        assert fsdp["losses"] == ddp["losses"], rank
        assert fsdp["full"] == ddp["full"], rank
        assert ddp["losses"][-1] < ddp["losses"][0]
    assert two_ranks[0]["fsdp"]["losses"] != two_ranks[1]["fsdp"]["losses"]  # own batches
    # each rank holds its own half of every parameter, and the halves make the whole
    r0, r1 = two_ranks[0]["fsdp"], two_ranks[1]["fsdp"]
    for name, full in r0["full"].items():
        assert r0["local"][name] + r1["local"][name] == full, name


def test_fsdp_is_bit_identical_twice(two_ranks: list[dict[str, Any]]) -> None:
    for runs in two_ranks:
        assert runs["fsdp_again"]["losses"] == runs["fsdp"]["losses"]
        assert runs["fsdp_again"]["full"] == runs["fsdp"]["full"]


def test_fsdp_with_activation_checkpointing(two_ranks: list[dict[str, Any]]) -> None:
    """Recomputing each block in the backward changes no bit, and does recompute."""
    for runs in two_ranks:
        plain, ckpt = runs["fsdp"], runs["fsdp_ac"]
        assert plain["checkpointed"] == [False, False] and ckpt["checkpointed"] == [True, True]
        assert ckpt["losses"] == plain["losses"] and ckpt["full"] == plain["full"]
        assert (plain["probe_calls"], ckpt["probe_calls"]) == (STEPS, 2 * STEPS)


def test_fsdp_with_mixed_precision(two_ranks: list[dict[str, Any]]) -> None:
    """bfloat16 parameters in the forward and backward move the losses by about bfloat16's
    resolution (2**-8 relative), no more; the sharded parameters stay float32."""
    for runs in two_ranks:
        exact, mixed = runs["fsdp"], runs["fsdp_mp"]
        assert mixed["dtypes"] == ["torch.float32"] and mixed["parallel_of"] == ("fsdp", (2,))
        assert mixed["losses"] != exact["losses"]  # the policy took effect
        torch.testing.assert_close(torch.tensor(mixed["losses"]), torch.tensor(exact["losses"]),
                                   rtol=2**-6, atol=0)


def test_fsdp_equals_ddp_for_every_other_model_kind() -> None:
    """The campaigns' other models under FSDP2 (each parameterised layer a unit, then the root)
    train as under DDP, bit for bit on 2 ranks (see above). The BatchNorm model's running
    statistics are buffers, not compared: DDP overwrites them with rank 0's each forward,
    FSDP2 leaves each rank its own, and in training neither changes a loss."""
    kinds = [k for k in MODEL_KINDS if k != "llama"]
    ranks = run_ranks(llama_workers.every_kind, 2, kinds, 2)
    for rank, runs in enumerate(ranks):
        for kind in kinds:
            ddp, fsdp = runs[f"{kind}/ddp"], runs[f"{kind}/fsdp"]
            assert fsdp["parallel_of"] == ("fsdp", (2,)), kind
            assert fsdp["losses"] == ddp["losses"] and fsdp["full"] == ddp["full"], (rank, kind)


# -- HSDP on four ranks --------------------------------------------------------------------
def test_hsdp_trains_as_ddp_does() -> None:
    """HSDP on a (2, 2) mesh: each parameter sharded over a row, its shards replicated across
    the rows. Replicas hold the same bits. Against DDP on the same 4 ranks the gradients are
    summed in another order (two pairs, then the pairs, vs gloo's ring of four), so float32
    rounding differs in the last bits: losses agree to 1e-5 relative; parameters to 1e-4
    absolute, a hundredth of one AdamW step (lr 1e-2: AdamW moves each element by at most
    about lr, and a gradient rounded differently moves that by a small part of it)."""
    ranks = run_ranks(llama_workers.hsdp_runs, 4, 2)
    for rank, runs in enumerate(ranks):
        ddp, hsdp = runs["ddp"], runs["hsdp"]
        assert hsdp["parallel_of"] == ("hsdp", (2, 2)) and ddp["parallel_of"] == ("ddp", (4,))
        torch.testing.assert_close(torch.tensor(hsdp["losses"]), torch.tensor(ddp["losses"]),
                                   rtol=1e-5, atol=0)
        for name, full in hsdp["full"].items():
            torch.testing.assert_close(torch.tensor(full), torch.tensor(ddp["full"][name]),
                                       rtol=0, atol=1e-4, msg=f"rank {rank} {name}")
    # mesh rows (0, 1) and (2, 3) shard; columns (0, 2) and (1, 3) replicate
    assert ranks[0]["hsdp"]["local"] == ranks[2]["hsdp"]["local"]
    assert ranks[1]["hsdp"]["local"] == ranks[3]["hsdp"]["local"]
    assert ranks[0]["hsdp"]["local"] != ranks[1]["hsdp"]["local"]


# -- refusals ------------------------------------------------------------------------------
def test_bad_arguments_are_refused_by_name() -> None:
    messages = run_ranks(llama_workers.refusals, 1)[0]
    assert messages[0].startswith("parallel='tp' is not a way to spread a model; use one of "
                                  "['ddp', 'fsdp', 'hsdp']")
    assert messages[1] == ("mesh_shape=(2,) covers 2 ranks but the process group has 1; give a "
                           "mesh_shape whose product is 1: (1,).")
    assert messages[2] == ("mesh_shape=(1,) has 1 dimension(s); parallel='hsdp' takes 2: use "
                           "(replicas, shards).")
    assert messages[3] == ("mesh_shape=(2, 2) covers 4 ranks but the process group has 1; give "
                           "a mesh_shape whose product is 1, e.g. (1, 1).")
    assert messages[4].startswith("mesh_shape=[1] must be a tuple of positive ints")
    assert messages[5].startswith("mixed_precision=True is FSDP2's policy")
    assert messages[6].startswith("model: a TinyLlama with no DTensor parameters is not wrapped")
    assert len(messages) == 7
