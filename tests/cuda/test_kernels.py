"""The device paths of the comm hook's fused scale-and-check, of the replay's words and of the
replay's random stream."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from sdc_guard import internal
from tests.cuda.support import fill, on

SPECIALS = [0.0, -0.0, 1e-45, 6e-8, 65504.0, 3.0e38, -3.0e38, float("inf"), float("-inf"),
            float("nan")]


def _scaling(dev: torch.device, g: torch.Generator, mismatches: list[str]) -> None:
    """``scale_and_check(buf, 1/world)`` leaves the bits of ``buf.mul_(1/world)`` (what the
    built-in hook does) and flags exactly the buffers holding a NaN or Inf."""
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        as_int = internal.INT_OF_SIZE[dtype.itemsize]
        for world in (1, 2, 3, 4, 6, 7, 8):
            for special in (None, *SPECIALS):
                x = (torch.randn(70_001, generator=g) * 4.0 ** torch.randint(
                    -8, 8, (70_001,), generator=g)).to(dtype)
                if special is not None:
                    x[12_345] = special
                d = x.to(dev)
                ref = d.clone().mul_(1 / world)
                flag = bool(internal.scale_and_check(d, 1 / world))
                expected = not bool(torch.isfinite(x).all())
                if not torch.equal(ref.view(as_int), d.view(as_int)):
                    mismatches.append(f"scale_and_check != mul_: {dtype} world {world} "
                                      f"special {special}")
                if flag != expected:
                    mismatches.append(f"scale_and_check flag {flag}, expected {expected}: "
                                      f"{dtype} world {world} special {special}")


def _words(dev: torch.device, g: torch.Generator, mismatches: list[str]) -> None:
    """The step-word term and the loss word computed on the device equal the host's."""
    rows = torch.randint(-2**63, 2**63 - 1, (64, 4), generator=g, dtype=torch.int64)
    rows[0] = 0
    rows[1] = torch.tensor([-1, 2**63 - 1, -2**63, 1])
    for i, row in enumerate(rows):
        # Looked up on the module at each call: a test replaces it to see this test fail.
        on_device = int(internal.replay_term_device(row.to(dev)))
        if on_device != int(internal.replay_term_host(row)):
            mismatches.append(f"step-word term, row {i}")
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        losses = list(torch.randn(3, generator=g).to(dtype))
        on_device = int(internal.loss_word([loss.to(dev) for loss in losses]))
        if on_device != int(internal.loss_word(losses)):
            mismatches.append(f"loss_word {dtype}")


def _gradient_words(dev: torch.device, g: torch.Generator, mismatches: list[str]) -> None:
    """A bucket's share of the gradient word (``BucketPlan.digest``) and the word of separate
    gradients (``grads_digest``) equal the CPU values."""
    odd: list[tuple[int, ...]] = [(1024, 512), (1024,), (7,), (3, 3), (10, 1024), (0,), (10,)]
    # whole 8-byte words; many spans (the cumulative-sum path)
    whole: list[tuple[int, ...]] = [(1024, 512), (1024,), (8,), (4, 4), (10, 1024), (0,), (12,)]
    many: list[tuple[int, ...]] = [(64, 4 * i) for i in range(1, 21)]
    for dtype, sizes in itertools.product((torch.float32, torch.float16, torch.bfloat16),
                                          (whole, many)):
        unit = torch.empty((), dtype=dtype).element_size()
        for shapes in (odd, sizes):
            grads = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            words = [-(-(t.numel() * unit) // 8) for t in grads]
            offsets = [sum(words[:i]) for i in range(len(grads))]
            want = int(internal.grads_digest(grads, offsets, torch.device("cpu")))
            got = int(internal.grads_digest([t.to(dev) for t in grads], offsets, dev))
            if got != want:
                mismatches.append(f"grads_digest {dtype} {shapes}: device {got}, cpu {want}")
        # A DDP-like bucket: the same gradients as views of one flat buffer, in reverse order.
        order = list(reversed(range(len(grads))))
        buf = torch.cat([grads[i].reshape(-1) for i in order]).to(dev)
        views, at = [], 0
        for i in order:
            views.append(buf[at:at + grads[i].numel()].view(grads[i].shape))
            at += grads[i].numel()
        plan = internal.BucketPlan.of(buf, views, order, offsets)
        if plan is None:
            mismatches.append(f"BucketPlan.of refused an aligned {dtype} bucket")
        elif (got := int(plan.digest(buf))) != want:
            mismatches.append(f"bucket digest {dtype}, {len(sizes)} gradients: device {got}, "
                              f"cpu {want}")


def test_scaling_and_replay_words_equal_the_cpu(device: str = "cuda",
                                                record: dict[str, Any] | None = None) -> None:
    """The fused scale-and-check, the step-word term, the loss word and the gradient words on
    the device; the record says which dtypes take the fused unscale kernel there."""
    dev, out = on(device), fill(record)
    g = torch.Generator().manual_seed(1)
    mismatches: list[str] = []
    _scaling(dev, g, mismatches)
    fused = {str(t).removeprefix("torch."): internal.fused_unscale_ok(dev.type, t)
             for t in (torch.float32, torch.float16, torch.bfloat16)}
    _words(dev, g, mismatches)
    _gradient_words(dev, g, mismatches)
    out.update(mismatches=mismatches, fused_unscale_kernel_used=any(fused.values()),
               fused_unscale_kernel=fused)
    assert not mismatches, mismatches[:20]


def test_rng_stream_replays_and_restores_the_generators(
        device: str = "cuda", record: dict[str, Any] | None = None) -> None:
    """``rng_stream`` gives the same draws on the device twice and the generators their state
    back."""
    dev, out = on(device), fill(record)
    draws = []
    for _ in range(2):
        with internal.rng_stream(7, 1, 3, 0, dev):
            draws.append(torch.rand(1000, device=dev).cpu())

    def states() -> list[torch.Tensor]:
        return [torch.get_rng_state(),
                *([torch.cuda.get_rng_state(dev)] if dev.type == "cuda" else [])]

    before = states()
    with internal.rng_stream(7, 1, 3, 0, dev):
        torch.rand(1000, device=dev)
    restored = all(torch.equal(a, b) for a, b in zip(before, states(), strict=True))
    same = torch.equal(draws[0], draws[1])
    out.update(same_draws=same, state_restored=restored)
    assert same, "rng_stream drew different numbers for the same stream"
    assert restored, "rng_stream left the generators in another state"
