"""The tolerant replay audit (``GuardConfig(replay_mode="tolerant")``) on the CPU testbed for
nondeterminism: ranks at 1 and 2 threads and ``LinearNoise`` of up to 4 ulps on every linear
output, with faults defined by site and bit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from injectors.noise import LinearNoise, nudge
from sdc_guard import GuardConfig, native_kernel
from sdc_guard.checks.replay_tolerant import (
    HALF_WINDOWS,
    ROLLING_AUDITS,
    TAIL,
    TRIGGER_FLOOR,
    TRIGGER_MARGIN,
    TRIGGER_WARMUP,
    HalfOutputs,
    TolerantReplayAudit,
    diagnose,
    drift_score,
    trigger_threshold,
)
from sdc_guard.checks.sketch import (
    CEILING,
    CEILING_HALF,
    FLOOR,
    MARGIN,
    GradientSketch,
    calibrated_tolerance,
    distance,
)
from tests.launch import run_ranks
from tests.sdc_guard import tolerant_workers as tw

# -- the sketch ---------------------------------------------------------------------------


def _sketch(seed: int = 3) -> tuple[GradientSketch, list[torch.Tensor]]:
    params = [torch.zeros(7, 5), torch.zeros(13), torch.zeros(1)]
    return GradientSketch([p.numel() for p in params], seed=seed, device=torch.device("cpu")), params


def _vector(sk: GradientSketch, grads: list[torch.Tensor], loss: float = 2.0) -> torch.Tensor:
    return sk.of(torch.tensor(loss), [sk.row(i, g) for i, g in enumerate(grads)])


def test_a_sketch_is_the_same_for_the_same_seed_and_its_projections_see_every_element() -> None:
    a, params = _sketch()
    b, _ = _sketch()
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    va, vb = _vector(a, grads), _vector(b, grads)
    assert torch.equal(va, vb) and va.dtype == torch.float64
    assert not torch.equal(va, _vector(_sketch(seed=4)[0], grads))
    assert va[1] == pytest.approx(float(grads[0].norm()), rel=1e-6)
    assert distance(va, vb, a.width) == 0
    for i, g in enumerate(grads):  # one element changed anywhere, the tail included
        for j in range(g.numel()):
            moved = [h.clone() for h in grads]
            moved[i].view(-1)[j] += 1e-3 * float(g.norm())
            assert float(distance(va, _vector(a, moved), a.width)) > 1e-5, (i, j)


def test_a_gradient_of_another_size_than_the_sketch_was_built_for_is_refused() -> None:
    sk, _ = _sketch()
    with pytest.raises(ValueError, match=r"row\(1\): a gradient of 12 elements, where the "
                       "sketch was built for 13"):
        sk.row(1, torch.zeros(12))
    assert sk.count == 3 and sk.size() == 1 + 3 * sk.width


@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_kernel_sketches_as_torch_does_in_one_read(threads: int) -> None:
    """``sdc_sketch`` (one read of a float32 CPU gradient) and the torch path give the same
    numbers up to the order of their float32 sums: far below any tolerance (at least
    ``FLOOR``), with and without a tail, on one thread or split over two; a gradient that is
    not contiguous, or not float32, takes the torch path; a non-finite gradient sketches
    non-finite on both."""
    shapes = [(1024, 600), (600,), (10, 1024), (10,), (3,), (7, 13), (1,), (257, 33)]
    params = [torch.empty(s) for s in shapes]
    sk = GradientSketch([p.numel() for p in params], seed=3, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    grads[-1][3, 5] = math.nan
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with native_kernel(True) as on:
            if not on:
                pytest.skip("no C compiler: the C kernel cannot be built here")
            fast = [sk.row(i, g) for i, g in enumerate(grads)]
            strided = sk.row(2, grads[2].t().contiguous().t())
            half = sk.row(1, grads[1].to(torch.bfloat16))
        with native_kernel(False):
            slow = [sk.row(i, g) for i, g in enumerate(grads)]
            half_torch = sk.row(1, grads[1].to(torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    for i, (f, t) in enumerate(zip(fast[:-1], slow[:-1], strict=True)):
        assert float((f - t).abs().max()) <= 1e-6 * float(t[0]), (i, f, t)
        assert not torch.equal(f, torch.zeros_like(f))
    assert torch.isnan(fast[-1]).all() and torch.isnan(slow[-1]).all()
    assert float((strided - slow[2]).abs().max()) <= 1e-6 * float(slow[2][0])
    assert torch.equal(half, half_torch)  # not float32: torch's path either way


def test_bucket_norms_come_from_the_scaling_pass_or_a_read_of_their_own() -> None:
    """The trigger's bucket norm (``BucketNorms``): the scaling pass takes it in its read
    (``sdc_scale_sketch`` on zero factors), the same norm as torch's up to its float32 sums;
    a sparse bucket's from its values; a bucket the kernel cannot read takes torch's."""
    from sdc_guard.checks.sketch import BucketNorms
    from sdc_guard.scaling import SketchPlan, SketchRequest

    norms = BucketNorms()
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(100_003, generator=gen)
    want = float(torch.linalg.vector_norm(buf.double()))
    own = norms.row(0, buf)
    assert own.dtype == torch.float64 and own[1] == 0
    assert float(own[0]) == pytest.approx(want, rel=1e-6)
    sparse = torch.sparse_coo_tensor(torch.tensor([[1, 5]]), torch.tensor([3.0, 4.0]), (10,),
                                     check_invariants=True)
    assert float(norms.row(0, sparse)[0]) == 5.0
    assert norms.c_block(0, buf.to(torch.bfloat16)) is None
    with native_kernel(True) as on:
        if not on:
            pytest.skip("no C compiler: the C kernel cannot be built here")
        request = SketchRequest(norms, [(0, buf)])
        plan = SketchPlan.of(buf, request)
        assert plan is not None
        before = buf.clone()
        assert plan.scale(0.5, request) is False
        assert torch.equal(buf, before * 0.5)
        assert float(request.rows[0][0]) == pytest.approx(want, rel=1e-6)
        assert float(request.rows[0][1]) == 0


def test_distance_is_relative_per_component_and_equal_non_finite_values_agree() -> None:
    sk, params = _sketch()
    grads = [torch.ones(p.shape) for p in params]
    base = _vector(sk, grads)
    scaled = _vector(sk, [g * 1e6 for g in grads], loss=2e6)
    # scale free, up to the float32 rounding of the first stage (G b)
    assert float(distance(base * 1e6, scaled, sk.width)) < 1e-6
    w = sk.width
    nan = base.clone()
    nan[0] = math.nan
    assert float(distance(nan, nan.clone(), w)) == 0  # a NaN loss on both sides: the data's
    assert float(distance(nan, base, w)) == math.inf
    inf = base.clone()
    inf[1] = math.inf
    assert float(distance(inf, inf.clone(), w)) == 0
    assert float(distance(inf, base, w)) == math.inf
    zero = _vector(sk, [torch.zeros(p.shape) for p in params])
    assert float(distance(zero, zero.clone(), w)) == 0


def test_the_c_kernel_measures_the_distance_as_torch_does_to_the_bit() -> None:
    """``sdc_sketch_distance`` and torch's operations give the same number for every pair of
    sketch vectors: signed zeros, NaN, infinities, subnormals and zero norms included; a
    vector that is not contiguous float64 takes torch's path."""
    import random

    from sdc_guard.checks.sketch import differences

    w, rng = 5, random.Random(1)
    odd = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e300, 3.0]
    pairs = []
    for _ in range(3000):
        n = 1 + w * rng.randint(0, 4)
        a = [rng.choice(odd) if rng.random() < 0.3 else rng.gauss(0, 1) for _ in range(n)]
        b = [rng.choice(odd) if r < 0.3 else x * (1 + rng.gauss(0, 1e-6)) if r < 0.6 else x
             for x, r in ((x, rng.random()) for x in a)]
        pairs.append((torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)))
    with native_kernel(True) as on:
        if not on:
            pytest.skip("no C compiler: the C kernel cannot be built here")
        fast = [float(distance(a, b, w)) for a, b in pairs]
        wide = torch.stack([pairs[0][0]] * 2, 1)  # column 0: a strided view
        strided = float(distance(wide[:, 0], pairs[0][1], w))
    slow = [float(differences(a, b, w).max()) for a, b in pairs]
    assert [str(x) for x in fast] == [str(x) for x in slow]
    assert {math.inf, 0.0} <= set(fast) and any(0 < x < math.inf for x in fast)
    assert strided == slow[0]


def test_the_tolerance_is_a_median_times_the_margin_between_floor_and_ceiling() -> None:
    assert calibrated_tolerance([0.0] * 6, [0.0] * 4) == FLOOR
    tol = calibrated_tolerance([1e-7, 2e-7, 9e-3], [3e-7, 4e-7, 5e-7])
    assert tol == pytest.approx(MARGIN * 4e-7)  # one wild sample moves no median
    assert calibrated_tolerance([1e-3] * 3, [1e-3]) > CEILING  # refused by the audit


def test_the_trigger_scores_a_norm_in_log_scale_against_the_recent_median() -> None:
    assert drift_score(2.0, [1.0, 2.0, 3.0]) == 0
    assert drift_score(8.0, [1.0, 2.0, 3.0]) == pytest.approx(math.log(4))
    assert drift_score(0.5, [1.0, 2.0, 3.0]) == pytest.approx(math.log(4))
    assert drift_score(math.nan, [1.0]) == math.inf and drift_score(math.inf, [1.0]) == math.inf
    assert drift_score(0.0, [0.0, 0.0]) == 0 and drift_score(0.0, [1.0]) == math.inf
    assert trigger_threshold([5.0] * (TRIGGER_WARMUP - 1)) == TRIGGER_FLOOR
    assert trigger_threshold([0.5] * TRIGGER_WARMUP) == pytest.approx(
        max(TRIGGER_FLOOR, TRIGGER_MARGIN * 0.5))


# -- the testbed's noise ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_noise_moves_each_output_a_few_ulps_never_its_sign_and_replays_its_seed(
        dtype: torch.dtype) -> None:
    x = torch.randn(64, 32).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, math.inf, math.nan])
    gen = torch.Generator().manual_seed(1)
    y = nudge(x, 4, gen)
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    moved = (y.view(itype).to(torch.int64) - x.view(itype).to(torch.int64)).abs()
    finite = torch.isfinite(x)
    assert int(moved[finite].max()) <= 4 and int(moved.max()) <= 4
    assert bool((moved[finite] > 0).any())
    assert torch.equal(torch.signbit(y[finite]), torch.signbit(x[finite]))
    assert y[0, 2] == math.inf and math.isnan(float(y[0, 3]))
    again = nudge(x, 4, torch.Generator().manual_seed(1))
    assert torch.equal(again.view(itype), y.view(itype))  # from its seed
    assert not torch.equal(nudge(x, 4, gen).view(itype), y.view(itype))  # each call afresh


def test_linear_noise_hooks_every_linear_and_its_gradient_flows() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    clean = model(x)
    noise = LinearNoise(model, ulps=4, seed=0, rank=1)
    a, b = model(x), model(x)
    assert noise.calls == 4 and not torch.equal(a, b)
    assert torch.allclose(a, clean, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    assert model[0].weight.grad is not None
    noise.remove()
    assert torch.equal(model(x), clean)
    with pytest.raises(ValueError, match="ulps"):
        LinearNoise(model, ulps=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_linear_noise_in_the_accumulator_rounds_a_half_product_once(autocast: bool) -> None:
    """``where="accumulator"``: a bfloat16 product is taken again in float32, moved by a few
    float32 ulps and rounded once, as a GPU's reordered sum rounds: each output is the
    rounding of a float32 value within 4 float32 ulps of the float32 product, so at most a
    few outputs move, each by one bfloat16 ulp (``"output"`` moves nearly every one by up to
    4); the gradient flows; a float32 model is moved as with ``"output"``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    x = torch.randn(32, 64)
    if not autocast:
        model = model.to(torch.bfloat16)
        x = x.to(torch.bfloat16)

    first = model[0]
    assert isinstance(first, nn.Linear)

    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out: torch.Tensor = first(x)
        return out

    clean = run()
    assert clean.dtype == torch.bfloat16

    def operand(t: torch.Tensor) -> torch.Tensor:  # what the bfloat16 kernel multiplies
        return t.detach().to(torch.bfloat16).float()

    exact = nn.functional.linear(operand(x), operand(first.weight), operand(first.bias))
    noise = LinearNoise(model, ulps=4, seed=0, rank=1, where="accumulator")
    moved = run()
    assert noise.calls == 1
    steps = (moved.view(torch.int16).int() - exact.to(torch.bfloat16).view(torch.int16).int())
    assert int(steps.abs().max()) <= 1  # at most one bfloat16 ulp from the product's rounding
    assert int((steps != 0).sum()) < exact.numel() // 100
    ulp = torch.finfo(torch.float32).eps * exact.abs()
    gap = (moved.float() - exact).abs()
    assert bool((gap <= moved.float().abs() * 2.0**-8 + 4 * ulp).all())
    noise.remove()
    everywhere = LinearNoise(model, ulps=4, seed=0, rank=1)
    loud = run()
    assert int((loud.view(torch.int16) != clean.view(torch.int16)).sum()) > clean.numel() // 2
    everywhere.remove()
    noise = LinearNoise(model, ulps=4, seed=0, rank=1, where="accumulator")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(x).float().sum().backward()
    assert first.weight.grad is not None and bool(first.weight.grad.abs().sum() > 0)
    noise.remove()
    flat = nn.Linear(4, 3)
    xs = torch.randn(5, 4)
    a = LinearNoise(flat, ulps=4, seed=3, rank=0, where="accumulator")
    got = flat(xs)
    a.remove()
    b = LinearNoise(flat, ulps=4, seed=3, rank=0)
    assert torch.equal(got, flat(xs))  # float32: the same draws, the same outputs
    b.remove()
    with pytest.raises(ValueError, match=r"where=\.\.\.\) must be one of output, accumulator"):
        LinearNoise(flat, where="input")


def test_linear_noise_keyed_draws_repeat_a_first_computation_and_vary_every_other() -> None:
    """``begin(key)``: the n-th computation of a batch on a rank draws alike in every run (a
    training pass is reproducible), the next one differently (a recomputation rounds anew);
    another rank draws otherwise; ``forget()`` makes the next computation a first again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)

    def run(noise: LinearNoise, key: int) -> torch.Tensor:
        noise.begin(key)
        out: torch.Tensor = model(x).detach()
        return out

    noise = LinearNoise(model, ulps=4, seed=0, rank=1)
    first = run(noise, 7)
    model(x)  # unkeyed draws in between change nothing of the next keyed one
    second, other = run(noise, 7), run(noise, 8)
    assert not torch.equal(first, second) and not torch.equal(first, other)
    noise.forget()
    assert torch.equal(run(noise, 7), first)
    noise.remove()
    elsewhere = LinearNoise(model, ulps=4, seed=0, rank=2)
    assert not torch.equal(run(elsewhere, 7), first)
    elsewhere.remove()
    again = LinearNoise(model, ulps=4, seed=0, rank=1)  # another run, the same rank
    assert torch.equal(run(again, 7), first)
    with pytest.raises(TypeError, match="key must be an int"):
        again.begin("batch 7")  # type: ignore[arg-type]
    again.remove()


# -- the configuration --------------------------------------------------------------------


def test_tolerant_mode_needs_no_deterministic_kernels_and_exact_mode_names_it() -> None:
    GuardConfig(replay_interval=2, replay_mode="tolerant")
    with pytest.raises(ValueError, match="replay_mode='tolerant'"):
        GuardConfig(replay_interval=2)
    with pytest.raises(ValueError, match="replay_mode must be"):
        GuardConfig(replay_interval=2, replay_mode="loose")
    with pytest.raises(ValueError, match="replay_trigger must be True or False"):
        GuardConfig(replay_trigger=1)  # type: ignore[arg-type]


# -- distributed, on the testbed ----------------------------------------------------------


def test_a_clean_run_on_the_testbed_calibrates_then_rolls_and_never_fires(
        tmp_path: Path) -> None:
    log = str(tmp_path / "events.jsonl")
    steps = ROLLING_AUDITS + 3
    res = run_ranks(tw.tolerant_run, 3, steps, event_log=log, timeout=240)
    assert all(r["detections"] == [] and r["skipped"] == [] for r in res)
    assert len({r["final"] for r in res}) == 1  # the replicas stay equal
    tol = res[0]["tolerance"]
    assert FLOOR < tol < CEILING and all(r["tolerance"] == tol for r in res)
    assert all(r["noise_calls"] > steps * 3 * 2 for r in res)  # own step and replay, 3 layers
    # the own sketch rides the scaling pass: every audit step, every bucket
    assert all(r["fused_sketches"] >= steps or not r["native"] for r in res)
    cal, rolled = tw.records(log, "replay_calibration")
    assert cal["accepted"] and cal["step"] == 0 and "kind" not in cal
    assert cal["same_rank"]["count"] == 3 * 6 and cal["cross_rank"]["count"] == 3 * 4
    first = cal["tolerance"]
    assert 0 < cal["same_rank"]["max"] < first and 0 < cal["cross_rank"]["max"] < first
    # the 32nd clean audit after the calibration: the ranks' median edge distances
    assert rolled["kind"] == "rolling" and rolled["step"] == ROLLING_AUDITS
    assert rolled["accepted"] and rolled["before"] == first and rolled["tolerance"] == tol
    medians = rolled["rank_medians"]
    assert len(medians) == 3 and tol == max(FLOOR, MARGIN * sorted(medians)[1])
    assert all(0 < m < first for m in medians)  # the audits stayed within the tolerance


def test_after_the_tolerance_rolled_a_flip_is_still_named() -> None:
    fault = {"site": "activation", "rank": 1, "step": ROLLING_AUDITS + 2, "target": "act2",
             "bits": (28,)}
    res = run_ranks(tw.tolerant_run, 3, ROLLING_AUDITS + 3, fault=fault, timeout=240)
    for r in res:
        assert r["detections"] == [("replay", ROLLING_AUDITS + 2, (1,), True)]


def test_half_outputs_sees_a_model_computing_in_half_precision_and_changes_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    with HalfOutputs() as watch:
        plain = model(x)
    assert not watch.seen
    assert torch.equal(plain, model(x))
    with HalfOutputs() as watch, torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    assert watch.seen  # autocast's products
    half = model.to(torch.float16)
    with HalfOutputs() as watch:
        half(x.to(torch.float16))
    assert watch.seen  # half-precision parameters


def test_in_half_precision_the_tolerance_starts_at_its_ceiling_then_rolls_on_the_tail(
        tmp_path: Path) -> None:
    """bfloat16 mixed precision under DDP on the testbed (``LinearNoise(where="accumulator")``):
    the calibration finds the products in half precision and the audit compares at
    ``CEILING_HALF`` until the rolling update that closes ``HALF_WINDOWS`` windows, which
    covers the tail of the clean distances (``TAIL`` times the largest of the windows'
    medians of the ranks' largest); no audit fires on the clean run, and an exponent flip of
    an activation after the roll is named on its rank."""
    log = str(tmp_path / "events.jsonl")
    steps = HALF_WINDOWS * ROLLING_AUDITS + 4
    fault = {"site": "activation", "rank": 2, "step": steps - 1, "target": "act2",
             "bits": (14,)}
    res = run_ranks(tw.tolerant_run, 3, steps, bf16=True, where="accumulator", fault=fault,
                    event_log=log, timeout=300)
    for r in res:
        assert r["detections"] == [("replay", steps - 1, (2,), True)], r["details"]
        assert r["injections"] == (1 if r is res[2] else 0)
    cal, *early, rolled = tw.records(log, "replay_calibration")
    assert cal["half_precision"] and cal["accepted"] and cal["ceiling"] == CEILING_HALF
    assert "compares at the ceiling" in cal["detail"] and cal["tolerance"] < CEILING_HALF
    assert len(early) == HALF_WINDOWS - 1
    for i, kept in enumerate(early, 1):  # the tail still measured: the ceiling stays
        assert kept["kind"] == "rolling" and not kept["accepted"] and kept["windows"] == i
        assert kept["before"] == CEILING_HALF and kept["step"] == i * ROLLING_AUDITS
        assert "before the tolerance leaves the ceiling" in kept["detail"]
    assert rolled["kind"] == "rolling" and rolled["half_precision"] and rolled["accepted"]
    assert rolled["before"] == CEILING_HALF and rolled["step"] == HALF_WINDOWS * ROLLING_AUDITS
    tail = max(sorted(r["rank_maxima"])[1] for r in [*early, rolled])
    assert rolled["tail_seen"] == tail and rolled["tail"] == TAIL
    assert rolled["tolerance"] == max(FLOOR, MARGIN * sorted(rolled["rank_medians"])[1],
                                      TAIL * tail)
    assert all(r["tolerance"] == rolled["tolerance"] for r in res)
    # float32 on the same testbed: products in float32, the float32 ceiling
    res = run_ranks(tw.tolerant_run, 2, 2, event_log=str(tmp_path / "f32.jsonl"), timeout=120)
    (cal,) = tw.records(str(tmp_path / "f32.jsonl"), "replay_calibration")
    assert cal["ceiling"] == CEILING and "half_precision" not in cal


def test_a_half_precision_tolerance_is_saved_and_restored_with_its_ceiling() -> None:
    sk = object.__new__(TolerantReplayAudit)
    sk.tolerance, sk.half, sk._tail = None, False, 0.0
    with pytest.raises(ValueError, match="outside"):
        sk.restore_tolerance(4 * CEILING)
    sk.restore_tolerance(4 * CEILING, half=True)
    assert sk.tolerance == 4 * CEILING and sk.half
    with pytest.raises(ValueError, match="outside"):
        sk.restore_tolerance(2 * CEILING_HALF, half=True)
    sk._tail = 1e-3
    state = sk.saved()
    assert state == {"tolerance": 4 * CEILING, "half": True, "tail": 1e-3}
    other = object.__new__(TolerantReplayAudit)
    other.tolerance, other.half, other._tail = None, False, 0.0
    other.load_saved(state)
    assert (other.tolerance, other.half, other._tail) == (4 * CEILING, True, 1e-3)
    assert other._windows == HALF_WINDOWS  # rolled below the ceiling: the tail was measured
    other.load_saved({"tolerance": CEILING / 2})
    assert not other.half


def test_in_half_precision_ddp_compares_per_bucket() -> None:
    """Per bucket (``_grouped``): the loss, then per bucket the norm of its gradients together
    and the sums of their projections; a NaN stays in its bucket. Only in half precision,
    once the buckets are known."""
    sk, params = _sketch()
    audit = object.__new__(TolerantReplayAudit)
    audit.sketch, audit.device, audit.half, audit.names = sk, torch.device("cpu"), False, [
        "w", "b", "c"]
    audit._groups, audit._group_of, audit._step_groups = None, {}, {1: [2], 0: [1, 0]}
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    v = _vector(sk, grads)
    assert not audit._per_group()
    audit._settle_groups()
    assert audit._groups is None and not audit._per_group()  # float32: per parameter
    audit.half = True
    audit._settle_groups()
    assert audit._groups == ((1, 0), (2,)) and audit._per_group()
    w = sk.width
    got = audit._grouped(v)
    rows = v[1:].reshape(3, w)
    assert got.shape == (1 + 2 * w,) and got[0] == v[0]
    assert torch.allclose(got[1], rows[:2, 0].square().sum().sqrt(), rtol=1e-15)
    assert torch.allclose(got[2:1 + w], rows[:2, 1:].sum(0), rtol=1e-15)
    assert torch.equal(got[1 + w:], rows[2])
    nan = v.clone()
    nan[1 + 2 * w + 1] = math.nan  # parameter 2's first projection
    assert torch.isnan(audit._grouped(nan)[1 + w:]).any()
    assert not torch.isnan(audit._grouped(nan)[:1 + w]).any()
    # a change of parameter 0's projection shows in its bucket's component
    moved = v.clone()
    moved[2] += 0.5 * float(rows[:2, 0].square().sum().sqrt())
    assert float(audit._apart(v, moved)) > 0.1
    assert audit._component(v, moved) == "bucket 0's gradients (b, w): projection 1"


def test_recomputations_noisier_than_the_ceiling_warn_once(
        caplog: pytest.LogCaptureFixture) -> None:
    audit = object.__new__(TolerantReplayAudit)
    audit.rank, audit.half, audit._warned = 0, True, False
    with caplog.at_level("WARNING", logger="sdc_guard.checks.replay_tolerant"):
        audit._warn_noisy(0.08, CEILING_HALF)
        audit._warn_noisy(0.09, CEILING_HALF)
    (record,) = caplog.records
    assert "differ by 0.08" in record.getMessage() and "half precision" in record.getMessage()
    assert "replay_mode='exact', or replay_interval=0" in record.getMessage()
    caplog.clear()
    elsewhere = object.__new__(TolerantReplayAudit)
    elsewhere.rank, elsewhere.half, elsewhere._warned = 1, False, False
    with caplog.at_level("WARNING", logger="sdc_guard.checks.replay_tolerant"):
        elsewhere._warn_noisy(0.08, CEILING)
    assert not caplog.records  # rank 0 speaks for the job


def test_the_exact_audit_refuses_the_testbed_where_the_tolerant_one_runs() -> None:
    with pytest.raises(Exception, match="CPU threads"):
        run_ranks(tw.tolerant_run, 2, 2, mode="exact", ulps=0, timeout=120)


@pytest.mark.parametrize("site,target,bit", [("activation", "act2", 30),
                                             ("activation", "fc2", 28),
                                             ("gradient_before_allreduce", "fc2.weight", 29)])
def test_a_transient_exponent_flip_is_named_transient_on_its_rank_and_contained(
        site: str, target: str, bit: int) -> None:
    fault = {"site": site, "rank": 1, "step": 3, "target": target, "bits": (bit,)}
    res = run_ranks(tw.tolerant_run, 3, 6, fault=fault, timeout=240)
    assert res[1]["injections"] == 1
    for r in res:
        assert r["detections"] == [("replay", 3, (1,), True)]
        assert r["skipped"] == [3]
    assert len({r["final"] for r in res}) == 1


def test_a_permanent_fault_comes_back_and_is_named_lasting() -> None:
    fault = {"site": "activation", "rank": 2, "step": 2, "target": "act2", "bits": (30,),
             "model": "permanent", "phase": "any"}
    res = run_ranks(tw.tolerant_run, 3, 4, fault=fault, timeout=240)
    assert res[0]["detections"] == [("replay", 2, (2,), False), ("replay", 3, (2,), False)]
    diagnosis = res[0]["evidence"][0]
    assert diagnosis["rank 2"]["own_rerun_came_back"] is True


def test_with_two_ranks_a_transient_is_named_and_a_lasting_disagreement_is_not() -> None:
    flip = {"site": "activation", "rank": 1, "step": 3, "target": "act2", "bits": (30,)}
    res = run_ranks(tw.tolerant_run, 2, 5, fault=flip, timeout=240)
    assert res[0]["detections"] == [("replay", 3, (1,), True)]
    lasting = {**flip, "model": "permanent", "phase": "any"}
    res = run_ranks(tw.tolerant_run, 2, 5, fault=lasting, timeout=240)
    assert res[0]["detections"] == [("replay", 3, (), False), ("replay", 4, (), False)]


def test_a_second_transient_within_the_repair_window_is_lasting() -> None:
    # wrong in every own step from step 2, right in every recomputation
    fault = {"site": "activation", "rank": 0, "step": 2, "target": "act2", "bits": (30,),
             "model": "permanent"}
    res = run_ranks(tw.tolerant_run, 3, 4, fault=fault, window=1000, timeout=240)
    assert res[0]["detections"] == [("replay", 2, (0,), True), ("replay", 3, (0,), False)]
    assert "a lasting fault" in res[0]["details"][1]
    res = run_ranks(tw.tolerant_run, 3, 4, fault=fault, window=1, timeout=240)
    assert res[0]["detections"] == [("replay", 2, (0,), True), ("replay", 3, (0,), True)]


def test_the_trigger_audits_a_step_between_audits_and_names_the_rank(tmp_path: Path) -> None:
    log = str(tmp_path / "events.jsonl")
    fault = {"site": "activation", "rank": 1, "step": 13, "target": "act2", "bits": (30,)}
    res = run_ranks(tw.tolerant_run, 3, 16, fault=fault, interval=10, event_log=log,
                    timeout=240)
    for r in res:
        assert r["detections"] == [("replay", 13, (1,), True)]
        assert r["skipped"] == [13] and r["triggered"] == [13]
        # every step's bucket took the sketching scaling pass: the own sketch on the audit
        # steps, the trigger's norm (BucketNorms) on the others
        assert r["fused_sketches"] == 16 or not r["native"]
    (rec,) = tw.records(log, "replay_trigger")
    assert rec["step"] == 13 and rec["outcome"] == "fault found" and rec["votes"] == [1]
    # without containment no vote may leave its sentinel in a step that is applied
    res = run_ranks(tw.tolerant_run, 3, 16, fault=fault, interval=10, contain=False,
                    timeout=240)
    assert all(r["triggered"] == [] and r["skipped"] == [] for r in res)


def test_a_spike_or_nan_the_batch_makes_is_reported_with_no_suspect(tmp_path: Path) -> None:
    log = str(tmp_path / "events.jsonl")
    res = run_ranks(tw.tolerant_run, 3, 15, interval=10, odd_batch=(1, 13, 1e4),
                    event_log=log, timeout=240)
    for r in res:  # withheld: the vote's sentinel is in the step's reduced gradients
        assert r["detections"] == [] and r["skipped"] == [13] and r["triggered"] == [13]
    (rec,) = tw.records(log, "replay_trigger")
    assert rec["outcome"].startswith("reproduced on every rank") and rec["votes"] == [1]
    res = run_ranks(tw.tolerant_run, 3, 12, interval=10, odd_batch=(1, 10, math.nan),
                    timeout=240)  # on an audit step: the sketches are NaN alike
    assert res[0]["detections"] == [("nonfinite", 10, (), False)]
    assert "not that hardware" in res[0]["details"][0]


def test_the_tolerance_is_kept_in_the_checkpoint_and_restored_without_recalibrating(
        tmp_path: Path) -> None:
    log = str(tmp_path / "events.jsonl")
    res = run_ranks(tw.checkpoint_run, 3, str(tmp_path / "ckpt"), log, timeout=240)
    for r in res:
        assert r["first_start_tolerance"] is None and r["first_detections"] == []
        assert r["restarted_start_tolerance"] == r["first_tolerance"] is not None
        assert r["restarted_tolerance"] == r["first_tolerance"]
        assert r["restarted_detections"] == []
    assert len(tw.records(log, "replay_calibration")) == 1  # the restarted job did not


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    return bool(torch.equal(x, y))


# -- under FSDP2 and HSDP, on the testbed -------------------------------------------------


def _act(rank: int, step: int, *bits: int, **more: Any) -> dict[str, Any]:
    """A flip of ``bits`` in the second GELU's output (``replay_fsdp_workers.build``)."""
    return {"site": "activation", "rank": rank, "step": step, "target": "4", "bits": bits,
            **more}


@pytest.mark.parametrize(("shape", "micro"), [((3,), 1), ((2, 2), 2)])
def test_under_fsdp2_a_clean_run_calibrates_once_and_never_fires(
        tmp_path: Path, shape: tuple[int, ...], micro: int) -> None:
    log = str(tmp_path / "events.jsonl")
    world = math.prod(shape)
    res = run_ranks(tw.fsdp_run, world, shape, 12, micro=micro, event_log=log, timeout=240)
    tol = res[0]["tolerance"]
    for r in res:
        assert r["detections"] == [] and r["skipped"] == [] and r["alike"]
        assert r["tolerance"] == tol
        assert r["noise_calls"] >= 12 * 3 * 2 * micro  # own step and replay, 3 layers
        # every audit step's edge is compared in the step's last reduce-scatter (the veto
        # rides it): the first posts its exchange after the replay, the others with the
        # step's first reduce-scatter
        assert r["compared_in_hook"] == list(range(12)), r["compared_in_hook"]
    assert FLOOR < tol < CEILING
    (cal,) = tw.records(log, "replay_calibration")
    assert cal["accepted"] and cal["step"] == 0
    assert 0 < cal["same_rank"]["max"] < tol and 0 < cal["cross_rank"]["max"] < tol


@pytest.mark.parametrize(("shape", "micro", "fault"), [
    ((3,), 1, _act(1, 3, 28)),  # finite: the value shrinks
    ((3,), 1, {"site": "gradient_before_allreduce", "rank": 1, "step": 3,
               "target": "3.weight", "bits": (29,)}),
    ((2,), 1, _act(1, 3, 29)),
    ((2, 2), 2, _act(2, 3, 30)),  # (overflows: the non-finite check names it too)
])
def test_under_fsdp2_a_transient_flip_is_named_transient_and_contained(
        shape: tuple[int, ...], micro: int, fault: dict[str, Any]) -> None:
    res = run_ranks(tw.fsdp_run, math.prod(shape), shape, 5, micro=micro, fault=fault,
                    timeout=240)
    target = fault["rank"]
    assert res[target]["injections"] == micro
    for r in res:
        assert r["detections"][0] == ("replay", 3, (target,), True)
        assert r["skipped"] == [3] and r["alike"]
        edge = r["evidence"][0]["diagnosis"][f"edge {(target - 1) % len(res)}"]
        assert edge["blames"] == target and "did not come back" in edge["verdict"]


def test_under_fsdp2_a_permanent_fault_is_lasting_and_without_containment_nothing_is_held(
        ) -> None:
    fault = _act(2, 2, 30, model="permanent", phase="any")
    res = run_ranks(tw.fsdp_run, 3, (3,), 4, fault=fault, timeout=240)
    assert [d for d in res[0]["detections"] if d[0] == "replay"] == [
        ("replay", 2, (2,), False), ("replay", 3, (2,), False)]
    assert res[0]["evidence"][0]["diagnosis"]["rank 2"]["own_rerun_came_back"] is True
    res = run_ranks(tw.fsdp_run, 3, (3,), 5, fault=_act(1, 3, 29), contain=False, timeout=240)
    assert all(r["detections"] == [("replay", 3, (1,), True)] and r["skipped"] == []
               for r in res)


def test_under_fsdp2_the_trigger_audits_a_step_and_a_spike_the_batch_makes_names_no_one(
        tmp_path: Path) -> None:
    log = str(tmp_path / "events.jsonl")  # (bits 30, 29 of 2^-63 < |x| < 1: up 2^64)
    res = run_ranks(tw.fsdp_run, 3, (3,), 16, interval=10, fault=_act(1, 13, 30, 29),
                    event_log=log, timeout=240)
    for r in res:
        assert r["detections"] == [("replay", 13, (1,), True)]
        assert r["skipped"] == [13] and r["triggered"] == [13] and r["alike"]
    (rec,) = tw.records(log, "replay_trigger")
    assert rec["outcome"] == "fault found" and rec["votes"] == [1]
    res = run_ranks(tw.fsdp_run, 3, (3,), 15, interval=10, odd_batch=(1, 13, 1e4),
                    timeout=240)
    for r in res:  # withheld: the vote's sentinel rode the step's last reduce-scatter
        assert r["detections"] == [] and r["skipped"] == [13] and r["triggered"] == [13]



@pytest.mark.parametrize(("shape", "micro", "step", "by"), [((3,), 1, 10, 0),
                                                          ((2, 2), 2, 13, 3)])
def test_under_fsdp2_a_nan_the_batch_makes_is_reported_with_no_suspect(
        shape: tuple[int, ...], micro: int, step: int, by: int) -> None:
    """On an audit step (10) or between audits (13): every rank recomputes another's batch
    through the sharded model (the non-finite check's collective recomputation), and the NaN
    comes back on the rank that recomputed rank 1's: its ring neighbour 0 under FSDP, under
    HSDP 2x2 rank 3, which holds rank 1's shards in the other replica. No one is named."""
    res = run_ranks(tw.fsdp_run, math.prod(shape), shape, step + 2, micro=micro,
                    interval=10, odd_batch=(1, step, math.nan), timeout=240)
    for r in res:
        assert r["detections"] == [("nonfinite", step, (), False)]
        assert "not that hardware" in r["details"][0] and r["skipped"] == [step]
        assert r["evidence"][0]["reproduced_by"] == {"1": by}


X, Y, Z = torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([3.0])


@pytest.mark.parametrize("reruns,expected", [
    # edge 0 -> 1, third rank 2; b's own result X, a's replay Y
    ([(1, Y), (1, Y), (0, Y), (0, Y), (2, Y), (2, Y)], (1, False)),  # b's did not come back
    ([(1, X), (1, X), (0, Y), (0, Y), (2, Y), (2, Y)], (1, True)),   # b's, on b alone: lasting
    ([(1, X), (1, Y), (0, Y), (0, Y), (2, Y), (2, Y)], (1, False)),  # b's, not at every rerun
    ([(1, X), (1, X), (0, X), (0, X), (2, X), (2, X)], (0, False)),  # a's did not come back
    ([(1, X), (1, X), (0, Y), (0, Y), (2, X), (2, X)], (0, True)),   # a's, on a alone: lasting
    ([(1, X), (1, Y), (0, Y), (0, X), (2, Y), (2, X)], (None, False)),  # a knife edge
    ([(1, Z), (1, Z), (0, Z), (0, Z), (2, Z), (2, Z)], (None, False)),  # neither recurs
])
def test_the_diagnosis_names_a_rank_only_when_one_result_recurs_on_no_other_rank(
        reruns: list[tuple[int, torch.Tensor]], expected: tuple[int | None, bool]) -> None:
    who, lasting, verdict = diagnose(0, 1, X, Y, reruns, _same)
    assert (who, lasting) == expected, verdict
    if who is None:
        assert verdict in ("unstable", "undecided")


def test_with_two_ranks_the_diagnosis_names_only_a_transient() -> None:
    # no third rank: a result that comes back on its own rank alone is not enough
    assert diagnose(0, 1, X, Y, [(1, X), (1, X), (0, Y), (0, Y)], _same)[:2] == (None, False)
    assert diagnose(0, 1, X, Y, [(1, Y), (1, Y), (0, Y), (0, Y)], _same)[:2] == (1, False)
