"""One prepared run for a machine with an accelerator: CUDA/nccl paths and fingerprint throughput.

    python -m bench.device_check [--out DIR] [--device cuda] [--mib 256]

Checks, each recorded as passed or failed with its numbers (nothing is skipped
silently; without CUDA the script says so and exits 2; ``--device cpu`` runs the
same checks on the CPU, with gloo for the guarded steps, as a dry run):

* ``fingerprint`` and the replay's word digest give the same value on the device
  as on the CPU, for every dtype, odd sizes, non-contiguous views, empty tensors
  and a tensor larger than one device chunk; the result stays on the device;
* ``rng_stream`` replays the same random numbers on the device and gives the generators
  their state back;
* the comm hook's fused scale-and-check leaves the bits of ``mul_(1/world)`` and
  flags exactly the non-finite buffers; the step-word term and the replay's
  gradient words computed on the device equal the host values;
* guarded DDP steps on the device with nccl (one rank per GPU; the ring of one
  when there is a single GPU) run nonfinite, weights and replay every step with
  no detection, and a NaN written into a local gradient is named and its
  optimizer step withheld on every rank;
* the checksum check on the device (its torch path: the C passes serve the CPU): every
  model the campaign ships trains clean in float32 (TF32 off and on) and bfloat16 with
  no detection; an exponent flip inside each product of a linear layer (forward, input
  gradient, weight gradient) on the last rank is named in its step, that rank, and the
  step withheld on every rank; its step time beside the guard without it, on the
  reference MLP, a wider MLP and the transformer;
* throughput on the device: fingerprint, word digest, ``torch.hash_tensor``
  beside one ``torch.sum`` pass over the same float32 tensor.

Results go to ``DIR/device_check.json`` and ``DIR/DEVICE.md`` (its tables, ``device_md``)
and are printed; ``bench/DEVICE.md`` and ``bench/device_check.json`` hold the last run on a
GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from sdc_guard import GuardConfig, internal

CASE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


def _cases(g: torch.Generator) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for dtype in CASE_DTYPES:
        for n in (0, 1, 7, 1023, 65_537, 300_001):
            raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),),
                                generator=g, dtype=torch.uint8)
            t = raw.view(dtype) if dtype != torch.bool else raw.remainder(2).to(torch.bool)
            out.append(t)
    base = torch.randn(64, 48, generator=g)
    out += [base.t(), base[::3, 5:], torch.empty(0, 3)]
    return out


@contextlib.contextmanager
def _weighted_path(path: str) -> Iterator[None]:
    """The weighted sums under the fingerprint and the digest on one path: ``"compiled"``
    (the fused kernel from ``SMALL`` values up, ``weighted._fused``), ``"torch"`` (torch
    ops only) or ``"default"`` (the library's choice)."""
    from sdc_guard.fingerprints import weighted

    kept = (set(weighted.FUSED_DEVICES), weighted.FUSED_MIN)
    if path == "torch":
        weighted.FUSED_DEVICES.clear()
    elif path == "compiled":
        weighted.FUSED_MIN = weighted.SMALL + 1
    try:
        yield
    finally:
        weighted.FUSED_DEVICES.update(kept[0])
        weighted.FUSED_MIN = kept[1]


def check_values(device: torch.device) -> dict[str, Any]:
    """Fingerprints and digests on the device equal the CPU's, on each of the device's
    paths (the compiled pass where the device has one, and the torch ops)."""
    from sdc_guard import fingerprint, fingerprint_tensor

    g = torch.Generator().manual_seed(0)
    mismatches = []
    cases = _cases(g)
    for path, (i, t) in itertools.product(("compiled", "torch"), enumerate(cases)):
        d = t.to(device)
        with _weighted_path(path):
            if fingerprint(t) != fingerprint(d):
                mismatches.append(f"fingerprint case {i} {t.dtype} {tuple(t.shape)}, {path}")
            if int(internal.digest_value(t)) != int(internal.digest_value(d)):
                mismatches.append(f"digest case {i} {t.dtype} {tuple(t.shape)}, {path}")
    big = torch.randn(internal.DEVICE_CHUNK + 12_345, generator=g)  # more than one device chunk
    for path in ("compiled", "torch"):
        with _weighted_path(path):
            if fingerprint(big) != fingerprint(big.to(device)):
                mismatches.append(f"fingerprint of a tensor larger than one device chunk, {path}")
    stays = fingerprint_tensor(big.to(device)).device == device
    return {"passed": not mismatches and stays, "mismatches": mismatches,
            "result_stays_on_device": stays}


def check_kernels(device: torch.device) -> dict[str, Any]:
    """The device paths of the comm hook's fused check and of the replay's words.

    * ``scale_and_check(buf, 1/world)`` leaves the same bits as ``buf.mul_(1/world)``
      (what the built-in hook does) and flags exactly the buffers holding a NaN or Inf;
    * the step-word term and the loss word computed on the device equal the host
      computations;
    * a bucket's share of the gradient word (``BucketPlan.digest``) and the word of
      separate gradients (``grads_digest``) equal the CPU values.
    """
    from sdc_guard.internal import INT_OF_SIZE, BucketPlan, grads_digest, loss_word

    g = torch.Generator().manual_seed(1)
    mismatches: list[str] = []
    specials = [0.0, -0.0, 1e-45, 6e-8, 65504.0, 3.0e38, -3.0e38, float("inf"), float("-inf"),
                float("nan")]
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        as_int = INT_OF_SIZE[dtype.itemsize]
        for world in (1, 2, 3, 4, 6, 7, 8):
            for special in (None, *specials):
                x = (torch.randn(70_001, generator=g) * 4.0 ** torch.randint(
                    -8, 8, (70_001,), generator=g)).to(dtype)
                if special is not None:
                    x[12_345] = special
                d = x.to(device)
                ref = d.clone().mul_(1 / world)
                flag = bool(internal.scale_and_check(d, 1 / world))
                expected = not bool(torch.isfinite(x).all())
                if not torch.equal(ref.view(as_int), d.view(as_int)):
                    mismatches.append(f"scale_and_check != mul_: {dtype} world {world} "
                                      f"special {special}")
                if flag != expected:
                    mismatches.append(f"scale_and_check flag {flag}, expected {expected}: "
                                      f"{dtype} world {world} special {special}")
    fused = {str(t).removeprefix("torch."): internal.fused_unscale_ok(device.type, t)
             for t in (torch.float32, torch.float16, torch.bfloat16)}
    rows = torch.randint(-2**63, 2**63 - 1, (64, 4), generator=g, dtype=torch.int64)
    rows[0] = 0
    rows[1] = torch.tensor([-1, 2**63 - 1, -2**63, 1])
    for i, row in enumerate(rows):
        # Looked up on the module at each call: a test replaces it to see this check fail.
        on_device = int(internal.replay_term_device(row.to(device)))
        if on_device != int(internal.replay_term_host(row)):
            mismatches.append(f"step-word term, row {i}")
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        losses = list(torch.randn(3, generator=g).to(dtype))
        on_device = int(loss_word([loss.to(device) for loss in losses]))
        if on_device != int(loss_word(losses)):
            mismatches.append(f"loss_word {dtype}")
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
            want = int(grads_digest(grads, offsets, torch.device("cpu")))
            got = int(grads_digest([t.to(device) for t in grads], offsets, device))
            if got != want:
                mismatches.append(f"grads_digest {dtype} {shapes}: device {got}, cpu {want}")
        # A DDP-like bucket: the same gradients as views of one flat buffer, in reverse order.
        order = list(reversed(range(len(grads))))
        buf = torch.cat([grads[i].reshape(-1) for i in order]).to(device)
        views, at = [], 0
        for i in order:
            views.append(buf[at:at + grads[i].numel()].view(grads[i].shape))
            at += grads[i].numel()
        plan = BucketPlan.of(buf, views, order, offsets)
        if plan is None:
            mismatches.append(f"BucketPlan.of refused an aligned {dtype} bucket")
        elif (got := int(plan.digest(buf))) != want:
            mismatches.append(f"bucket digest {dtype}, {len(sizes)} gradients: device {got}, "
                              f"cpu {want}")
    return {"passed": not mismatches, "mismatches": mismatches,
            "fused_unscale_kernel_used": any(fused.values()), "fused_unscale_kernel": fused}


def check_rng(device: torch.device) -> dict[str, Any]:
    from sdc_guard.internal import rng_stream

    draws = []
    for _ in range(2):
        with rng_stream(7, 1, 3, 0, device):
            draws.append(torch.rand(1000, device=device).cpu())

    def states() -> list[torch.Tensor]:
        return [torch.get_rng_state(),
                *([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])]

    before = states()
    with rng_stream(7, 1, 3, 0, device):
        torch.rand(1000, device=device)
    restored = all(torch.equal(a, b) for a, b in zip(before, states(), strict=True))
    same = torch.equal(draws[0], draws[1])
    return {"passed": same and restored, "same_draws": same, "state_restored": restored}


def _guarded_rank(rank: int, world: int, device_type: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.reference import classification_batch, cross_entropy_loss, reference_mlp
    from sdc_guard import GuardConfig, SDCGuard

    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # set by run_ranks
        model = DDP(reference_mlp().to(device), device_ids=[device.index])
    else:
        device = torch.device("cpu")
        model = DDP(reference_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        x, y = classification_batch(r, step, batch=128)
        return x.to(device), y.to(device)

    guard = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=GuardConfig(deterministic=True, replay_interval=1))

    def nan(bucket: Any) -> None:
        if guard.comm.step == 6 and rank == world - 1:
            bucket.buffer()[0] = float("nan")

    guard.comm.before.append(nan)
    reports = [guard.step(s) for s in range(8)]
    flushed = guard.flush()  # the non-finite flags of steps 0-7 travel in one word
    dist.barrier()
    out = {"detections": [(d.check, d.step, list(d.suspect_ranks))
                          for d in [*(d for r in reports for d in r.detections), *flushed]],
           "skipped": [r.step for r in reports if r.skipped],
           "device": str(device), "backend": dist.get_backend()}
    return out


def check_guard(device_type: str, world: int) -> dict[str, Any]:
    """Guarded DDP steps on ``world`` ranks: nccl on GPUs, or gloo on the CPU (a dry run)."""
    from scenarios.run.launch import run_ranks

    backend = "nccl" if device_type == "cuda" else "gloo"
    results = run_ranks(_guarded_rank, world, device_type, timeout=600, backend=backend)
    # The NaN is written into the local gradient before the hook digests it, so the
    # replay audit sees rank world-1's own gradient disagree with its replay as well:
    # blamed by the arbitration (a ring of one: by its own replay), nobody with 2 ranks.
    expected = [("nonfinite", 6, [world - 1]), ("replay", 6, [] if world == 2 else [world - 1])]
    ok = all(sorted(tuple(d) for d in r["detections"]) == expected and r["skipped"] == [6]
             for r in results)
    return {"passed": ok, "world": world, "backend": backend, "expected": expected,
            "expected_skipped": [6], "ranks": results}


CHECKSUM_RUNS = [(kind, dtype, tf32) for kind in ("mlp", "mlp_hooked", "cnn", "cnn_bn",
                                                  "transformer")
                 for dtype, tf32 in (("float32", False), ("float32", True), ("bfloat16", False))
                 ] + [("mlp", "autocast", False), ("transformer", "autocast", False)]
"""(model kind, dtype, TF32 allowed): the clean runs of ``check_checksum``; ``mlp_hooked`` is
the MLP with the user's hooks of ``_users_hooks``; dtype ``autocast``: a float32 model whose
loss runs under CUDA autocast to bfloat16 (the check's own sides must stay float32 there:
``AUTOCAST_SIDES``)."""
CHECKSUM_FUSED_RUNS = [("mlp", "float32"), ("transformer", "bfloat16"),
                       ("transformer", "autocast")]
"""Clean runs again with the sides' fused expressions (``_fused_sides``)."""
AUTOCAST_SIDES = 1e-4
"""The largest error the autocast runs may show in a forward identity's right-hand side
against float64, as a fraction of its magnitude sum: float32 sums keep to about
``k 2^-24`` (``k`` <= 257 here: 1.5e-5 at worst, typically far less); sums cast to bfloat16
show ~2^-9."""
CHECKSUM_FAULTS: list[dict[str, Any]] = [
    {"site": "linear_product", "product": p, "target": "net.2", "bits": (b,)}
    for p in ("forward", "input_grad", "weight_grad") for b in (30, 29, 28)]
"""Exponent flips inside the MLP's middle layer, each product (fired on the last rank), in
the MLP and in ``mlp_hooked``."""


def _clamped(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.02, 0.02)


def _doubled(m: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _halved_in_place(m: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
    out.mul_(0.5)


def _halved_input_grad(m: torch.nn.Module, grad_in: Any, grad_out: Any) -> Any:
    return tuple(None if g is None else g * 0.5 for g in grad_in)


def _users_hooks(module: torch.nn.Module) -> torch.nn.Module:
    """The hooks users put on their layers, on an MLP: every parameter's gradient clamped by
    a tensor hook, the middle linear layer's output replaced by a forward hook, the last
    one's output scaled in place and its input gradient halved by a full backward hook
    (the checksum reads each product past them)."""
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    for p in module.parameters():
        p.register_hook(_clamped)  # type: ignore[no-untyped-call]
    linears[1].register_forward_hook(_doubled)
    linears[-1].register_forward_hook(_halved_in_place)
    linears[-1].register_full_backward_hook(_halved_input_grad)
    return module
CHECKSUM_TIMED = {
    "reference MLP (512-1024-1024-10), batch 128": ("reference", 128, 0, "float32"),
    "MLP 16-4096-4096-4, batch 4096": ("mlp", 4096, 4096, "float32"),
    "transformer (width 128, 2 blocks), batch 64": ("transformer", 64, 128, "float32"),
    "MLP 16-4096-4096-4 in bfloat16, batch 8192": ("mlp", 8192, 4096, "bfloat16")}
"""name -> (model kind, batch, width, dtype) timed with the checksum on and off. The last is
where the sides' reads weigh (64 MiB activations, each read four to six times by the eager
sides, widened and copied, once by the fused ones) and a compiled call's fixed cost does not."""


CHECK_CONFIGS = {
    "guard, checks off": GuardConfig(nonfinite=False, weights_interval=0),
    "nonfinite": GuardConfig(nonfinite=True, weights_interval=0),
    "weights (with optimizer state), every step": GuardConfig(nonfinite=False),
    "weights every 8 steps": GuardConfig(nonfinite=False, weights_interval=8),
}
"""The guard's checks one by one, timed beside plain DDP and the defaults (``_checksum_rank``)."""


def _checksum_rank(rank: int, world: int, device_type: str, steps: int, timed_steps: int,
                   timed: list[str]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bench.reference import classification_batch, cross_entropy_loss, reference_mlp
    from injectors import Fault, arm
    from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
    from sdc_guard import GuardConfig, SDCGuard
    from sdc_guard.fingerprints.native import disable_native

    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    if device.type == "cpu":  # the dry run takes the device's path: torch ops, no C passes
        disable_native()
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "autocast": torch.float32}

    def guard_for(kind: str, dtype: str, config: GuardConfig, *, batch: int = 32,
                  width: int = 64) -> SDCGuard:
        if kind == "reference":
            module = reference_mlp().to(device)

            def batch_for(r: int, step: int) -> Any:
                x, y = classification_batch(r, step, batch=batch)
                return x.to(device), y.to(device)

            loss: Any = cross_entropy_loss
        else:
            model_kind = kind.removesuffix("_hooked")
            module = build_model(model_kind, width=width, depth=2, seed=0).to(device,
                                                                             dtypes[dtype])
            if kind.endswith("_hooked"):
                _users_hooks(module)

            def batch_for(r: int, step: int) -> Any:
                x, y = synthetic_batch(model_kind, 0, r, step, 0, batch=batch, dtype=dtypes[dtype])
                return x.to(device), y.to(device)

            loss = scenario_loss
        if dtype == "autocast":
            def loss(m: torch.nn.Module, b: Any) -> torch.Tensor:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    return scenario_loss(m, b)

        model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return SDCGuard(model, opt, loss_fn=loss, batch_for=batch_for, config=config)

    def _profiled(label: str, g: SDCGuard) -> dict[str, Any]:
        with _fused_sides(device) if label == "fused" else contextlib.nullcontext():
            return _step_profile(g, 7 * timed_steps, 5)

    def dets(found: list[Any]) -> list[tuple[str, int, list[int]]]:
        return [(d.check, d.step, list(d.suspect_ranks)) for d in found]

    on = GuardConfig(checksum=True)
    out: dict[str, Any] = {"device": str(device), "backend": dist.get_backend(), "clean": {},
                           "faults": [], "timing": {}}
    def clean(kind: str, dtype: str) -> dict[str, Any]:
        guard = guard_for(kind, dtype, on)
        worst = _sides_error(guard) if dtype == "autocast" else None
        reports = [guard.step(s) for s in range(steps)]
        found = [d for r in reports for d in r.detections] + guard.flush()
        return {"detections": dets(found), "skipped": [r.step for r in reports if r.skipped],
                **({} if worst is None else {"sides_error": worst[0]})}

    tf32 = torch.backends.cuda.matmul.allow_tf32
    for kind, dtype, allow in CHECKSUM_RUNS:
        torch.backends.cuda.matmul.allow_tf32 = allow
        try:
            out["clean"][f"{kind}/{dtype}{'/tf32' if allow else ''}"] = clean(kind, dtype)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        dist.barrier()
    for kind, dtype in CHECKSUM_FUSED_RUNS:
        with _fused_sides(device):
            out["clean"][f"{kind}/{dtype}/fused"] = clean(kind, dtype)
        dist.barrier()
    for kind in ("mlp", "mlp_hooked", "mlp/fused"):
        fused = kind.endswith("/fused")
        guard = guard_for(kind.removesuffix("/fused"), "float32", on)
        step = 0
        for f in CHECKSUM_FAULTS:
            guard.reconfigure(guard.config)
            handle = arm(Fault(**f, rank=world - 1, step=step + 1), guard=guard)
            with _fused_sides(device) if fused else contextlib.nullcontext():
                reports = [guard.step(step + i) for i in range(4)]
            step += 4
            found = [d for r in reports for d in r.detections] + guard.flush()
            handle.remove()
            out["faults"].append({"fault": f, "model": kind,
                                  "fired": [rec["step"] for rec in handle.records],
                                  "detections": dets(found),
                                  "skipped": [r.step for r in reports if r.skipped]})
    dist.barrier()
    for name in timed:
        kind, batch, width, dtype = CHECKSUM_TIMED[name]
        guards = {label: guard_for(kind, dtype, GuardConfig(checksum=c), batch=batch,
                                   width=width)
                  for label, c in (("off", False), ("on", True), ("fused", True))}
        single = {label: guard_for(kind, dtype, config, batch=batch, width=width)
                  for label, config in CHECK_CONFIGS.items()}
        # Plain DDP: a plain loop on a model of its own (a guard with every check off
        # registers no comm hook: its model is DDP's as it is).
        bare = guard_for(kind, dtype, GuardConfig(nonfinite=False, weights_interval=0),
                         batch=batch, width=width)
        plain_opt = torch.optim.AdamW(bare.model.parameters(), lr=1e-3)

        def plain(step: int, bare: SDCGuard = bare, opt: torch.optim.Optimizer = plain_opt) -> None:
            opt.zero_grad(set_to_none=True)
            batch = bare.batch_for
            assert batch is not None
            bare.loss_fn(bare.model, batch(rank, step)).backward()  # type: ignore[no-untyped-call]
            opt.step()

        def fused_step(step: int, g: SDCGuard = guards["fused"]) -> None:
            with _fused_sides(device):
                g.step(step)

        steppers: dict[str, Callable[[int], object]] = {
            "plain": plain, **{k: g.step for k, g in guards.items()}, "fused": fused_step,
            **{k: g.step for k, g in single.items()}}
        times: dict[str, list[float]] = {label: [] for label in steppers}
        for r in range(7):  # rotated blocks, the first round warms up
            at = r % len(steppers)
            labels = list(steppers)[at:] + list(steppers)[:at]
            for label in labels:
                dist.barrier()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for s in range(timed_steps):
                    steppers[label](r * timed_steps + s)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if r:
                    times[label].append((time.perf_counter() - t0) / timed_steps)
        off, on_t = statistics.median(times["off"]), statistics.median(times["on"])
        fused_t = statistics.median(times["fused"])
        base = statistics.median(times["plain"])
        out["timing"][name] = {"step_ms_plain": base * 1e3, "step_ms_off": off * 1e3,
                               "step_ms_checksum": on_t * 1e3, "overhead": on_t / off - 1.0,
                               "step_ms_fused": fused_t * 1e3,
                               "overhead_fused": fused_t / off - 1.0,
                               "guard_vs_plain": off / base - 1.0,
                               "by_check_ms": {label: statistics.median(times[label]) * 1e3
                                               for label in single},
                               "per_step": {label: _profiled(label, g)
                                            for label, g in guards.items()}}
        for g in (*guards.values(), *single.values()):
            g.flush()
        dist.barrier()
    out["fused_checked"] = _fused_checked()
    return out


@contextlib.contextmanager
def _fused_sides(device: torch.device) -> Iterator[None]:
    """The checksum's sides by their fused expressions (``sdc_guard.checks.sides``) on
    ``device`` while the block runs: compiled on a GPU; run as written on the CPU (the dry
    run: its tests compile them once, ``test_checksum_sides``)."""
    from sdc_guard.checks import sides

    if device.type == "cpu":
        sides._FUSED.fns.setdefault("forward", sides._forward_math)
        sides._FUSED.fns.setdefault("weight", sides._weight_math)
        for name, form in sides.GY_FORMS.items():
            sides._FUSED.fns.setdefault(name, form)
    was = set(sides.FUSED_DEVICES)
    sides.FUSED_DEVICES.add(device.type)
    try:
        yield
    finally:
        sides.FUSED_DEVICES.intersection_update(was)


def _fused_checked() -> dict[str, bool]:
    from sdc_guard.checks import sides

    return {"/".join(key): ok for key, ok in sides._FUSED.checked.items()}


def _sides_error(guard: Any) -> list[float]:
    """Watch the guard's checksum check: the largest error of a forward identity's right-hand
    side (``X (W^T e) + sum b``, which the check computes) against float64, as a fraction of
    ``|X| (|W|^T e) + sum |b|``, kept in the list returned, as steps run."""
    from sdc_guard.checks.checksum import ChecksumCheck

    check = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
    inputs: dict[torch.nn.Module, torch.Tensor] = {}
    for layer in check.layers:
        layer.module.register_forward_pre_hook(
            lambda mod, args: inputs.__setitem__(mod, args[0].detach()))
    record = check._record
    worst = [0.0]

    def spy(layer: Any, product: str, micro: int, lhs: torch.Tensor, rhs: torch.Tensor,
            bound: torch.Tensor) -> None:
        if product == "forward":
            m, x = layer.module, inputs[layer.module]
            x = x.reshape(-1, x.shape[-1]).double()
            w = m.weight.detach().double()
            b = (m.bias.detach().double() if m.bias is not None
                 else torch.zeros((), dtype=torch.float64, device=w.device))
            want = x @ w.sum(0) + b.sum()
            mag = (x.abs() @ w.abs().sum(0) + b.abs().sum()).clamp_min(1e-300)
            worst[0] = max(worst[0], float(((rhs.double() - want).abs() / mag).max()))
        record(layer, product, micro, lhs, rhs, bound)

    check._record = spy  # type: ignore[method-assign,assignment]
    return worst


def _step_profile(guard: Any, first: int, steps: int) -> dict[str, Any]:
    """Where a guarded step's host time goes, per step over ``steps`` profiled steps: the
    kernel launches, the stream and device syncs, the copies (``cudaMemcpy*`` in any
    direction: one from or to pageable host memory waits, one between device buffers does
    not), the ``.item()`` reads, and the ten operators taking the most host time of their
    own."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and guard.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for s in range(2):
        guard.step(first + s)
    with profile(activities=activities) as prof:
        for s in range(steps):
            guard.step(first + 2 + s)
        if guard.device.type == "cuda":
            torch.cuda.synchronize(guard.device)
    events = prof.key_averages()

    def count(match: Callable[[str], bool]) -> float:
        return float(sum(e.count for e in events if match(e.key))) / steps

    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "kernel_launches": count(lambda k: k.startswith(("cudaLaunch", "cuLaunch"))),
        "stream_syncs": count(lambda k: "Synchronize" in k),
        "memcpy_calls": count(lambda k: k.startswith("cudaMemcpy")),  # any direction
        "item_reads": count(lambda k: k == "aten::_local_scalar_dense"),
        "aten_ops": count(lambda k: k.startswith("aten::")),
        "top_self_host_us": [(e.key, round(e.self_cpu_time_total / steps, 1),
                              e.count / steps) for e in top],
    }


def checksum_problems(results: list[dict[str, Any]]) -> list[str]:
    """What ``_checksum_rank``'s results (by rank) show going wrong: a detection or a withheld
    step in a clean run; a fault that did not fire in exactly one step, or that every rank
    did not report once, as the checksum's, naming the last rank, with that step withheld."""
    world = len(results)
    problems = []
    for r, res in enumerate(results):
        given_up = [k for k, ok in res.get("fused_checked", {}).items() if not ok]
        if given_up:
            problems.append(f"rank {r}: fused sides given up (failed or disagreed): {given_up}")
        for run, v in res["clean"].items():
            if v["detections"] or v["skipped"] or v.get("sides_error", 0.0) > AUTOCAST_SIDES:
                problems.append(f"rank {r}: {run} clean: {v}")
        for i, v in enumerate(res["faults"]):
            fired = sorted(set(results[-1]["faults"][i]["fired"]))
            want = [("checksum", fired[0], [world - 1])] if len(fired) == 1 else None
            if want is None or [tuple(d) for d in v["detections"]] != want or v["skipped"] != fired:
                problems.append(f"rank {r}: {v.get('model', 'mlp')} {v['fault']}: fired {fired}, "
                                f"detections {v['detections']}, skipped {v['skipped']}")
    return problems


def check_checksum(device_type: str, world: int, steps: int = 300, timed_steps: int = 20,
                   timed: list[str] | None = None) -> dict[str, Any]:
    """The checksum check on ``world`` ranks of the device (``_checksum_rank``): no detection
    in any clean run; each fault named in the step it fired, on the last rank, withheld.
    ``timed``: the ``CHECKSUM_TIMED`` workloads to time (all by default)."""
    from scenarios.run.launch import run_ranks

    backend = "nccl" if device_type == "cuda" else "gloo"
    results = run_ranks(_checksum_rank, world, device_type, steps, timed_steps,
                        list(CHECKSUM_TIMED) if timed is None else timed, timeout=1800,
                        backend=backend)
    problems = checksum_problems(results)
    return {"passed": not problems, "world": world, "backend": backend,
            "problems": problems[:20], "timing": results[0]["timing"],
            "clean_runs": len(results[0]["clean"]), "faults": len(results[0]["faults"]),
            "autocast_sides_error": max(v["sides_error"] for r in results
                                        for v in r["clean"].values() if "sides_error" in v),
            "fused_checked": results[0].get("fused_checked", {})}


def _median_time(fn: Callable[[], object], device: torch.device, reps: int = 9) -> float:
    fn()
    torch.cuda.synchronize(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def throughput(device: torch.device, mib: int) -> dict[str, Any]:
    from sdc_guard import fingerprint_tensor
    def on(path: str, fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with _weighted_path(path):
                return fn()
        return run

    x = torch.randn(mib * 2**20 // 4, device=device)
    methods: dict[str, Callable[[], object]] = {
        "torch.sum (one read pass)": lambda: x.sum(),
        "sdc_guard.fingerprint_tensor": lambda: fingerprint_tensor(x),
        "fingerprint_tensor, compiled pass": on("compiled", lambda: fingerprint_tensor(x)),
        "fingerprint_tensor, torch ops": on("torch", lambda: fingerprint_tensor(x)),
        "replay word digest": lambda: internal.digest_value(x),
        "replay word digest, compiled pass": on("compiled", lambda: internal.digest_value(x)),
        "replay word digest, torch ops": on("torch", lambda: internal.digest_value(x)),
        "torch.hash_tensor (XOR)": lambda: torch.hash_tensor(x),
    }
    times = {k: _median_time(f, device) for k, f in methods.items()}
    base = times["torch.sum (one read pass)"]
    return {"tensor_mib": mib, "methods": {
        k: {"median_s": t, "gib_per_s": mib / 1024 / t, "ratio_to_sum": base / t}
        for k, t in times.items()}}


def check_telemetry(device: torch.device) -> dict[str, Any]:
    """The suspect rank's NVML snapshot (``sdc_guard.telemetry``) on this device: available,
    with the ECC, row-remapping, clock and power fields read (or the reason NVML refused)."""
    from sdc_guard.telemetry import gpu_snapshot

    snap = gpu_snapshot(device)
    wanted = ("ecc_errors", "remapped_rows", "retired_pages", "temperature_c", "sm_clock_mhz",
              "power_w")
    read = [k for k in wanted if snap.get(k) is not None]
    return {"passed": bool(snap.get("available")) and bool(read), "fields_read": read,
            "snapshot": snap}


def _commit() -> str | None:
    """The checkout's commit, where this runs in one (a copied working tree has none)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).parent, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_md(report: dict[str, Any]) -> str:
    """The tables of a ``device_check.json``: what passed, the checksum's step times and where
    the host's time goes, the fingerprint's throughput beside one ``torch.sum`` pass."""
    lines = [f"# Device check: {report.get('name', report['device'])}", "",
             f"torch {report['torch']}, CUDA {report.get('cuda') or '-'}, driver "
             f"{report.get('driver') or '-'}; host CPU {report.get('host_cpu', '-')}. "
             "Generated by `python -m bench.device_check` (docs/harness.md); one rank per GPU"
             + (f"; at commit {report['commit']}" if report.get("commit") else "") + "."
             + (f" {report['note']}" if report.get("note") else ""), "",
             "| check | passed | seconds | problems |", "|---|---|---|---|"]
    for name, v in report.items():
        if isinstance(v, dict) and "passed" in v:
            problems = v.get("problems") or v.get("mismatches") or v.get("error") or []
            text = "; ".join(problems[:3]) if isinstance(problems, list) else str(problems)
            lines.append(f"| {name} | {'yes' if v['passed'] else '**no**'} | "
                         f"{v.get('seconds', '')} | {text[:300].replace('|', '/')} |")
    checksum = report.get("checksum", {})
    if "clean_runs" in checksum:
        lines += ["", f"The checksum check: {checksum['clean_runs']} clean runs (each model in "
                  "float32, with TF32, in bfloat16, and the MLP and transformer in float32 under "
                  "autocast to bfloat16; three again with the fused sides), "
                  f"{checksum['faults']} faults in linear products"
                  + (f"; under autocast its own right-hand sides kept within "
                     f"{checksum['autocast_sides_error']:.1e} of their magnitude sums (float32; "
                     "sides cast to bfloat16 would show about 2e-3)"
                     if "autocast_sides_error" in checksum else "") + "."]
    timing = checksum.get("timing", {})
    if timing:
        lines += ["", "## The checksum check's step time (every nn.Linear, every step)", "",
                  "Medians of 6 rotated blocks of steps: plain DDP (a plain loop), the guard "
                  "with its default checks (off: the checksum off) and the same with the "
                  "checksum. Per guarded step, from torch's profiler over 5 steps: kernel "
                  "launches, stream syncs, copies (`cudaMemcpy*`, any direction: device to "
                  "device too) and `.item()` reads, off / on (/ fused).", "",
                  "The fused columns: the same with the sides' fused expressions "
                  "(`sdc_guard.checks.sides`, compiled; off by default).", "",
                  "| workload | plain DDP (ms) | guard, default (ms) | guard vs plain | "
                  "with the checksum (ms) | checksum overhead | fused (ms) | fused overhead | "
                  "launches | stream syncs | copies | .item() |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, t in timing.items():
            prof = t.get("per_step", {})
            off, on = prof.get("off", {}), prof.get("on", {})

            fused = prof.get("fused", {})

            def pair(key: str, off: dict[str, Any] = off, on: dict[str, Any] = on,
                     fused: dict[str, Any] = fused) -> str:
                if key not in off:
                    return "-"
                return f"{off.get(key, 0):.0f} / {on.get(key, 0):.0f}" + (
                    f" / {fused[key]:.0f}" if key in fused else "")

            # (an older run counted syncs and copies together, as host_syncs)
            together = "host_syncs" in off and "stream_syncs" not in off
            lines.append(f"| {name} | {t['step_ms_plain']:.2f} | {t['step_ms_off']:.2f} | "
                         f"{t['guard_vs_plain'] * 100:+.1f}% | {t['step_ms_checksum']:.2f} | "
                         f"{t['overhead'] * 100:+.1f}% | "
                         + (f"{t['step_ms_fused']:.2f} | {t['overhead_fused'] * 100:+.1f}% | "
                            if "step_ms_fused" in t else "- | - | ")
                         + f"{pair('kernel_launches')} | "
                         + (f"{pair('host_syncs')} (with the copies) | - | " if together else
                            f"{pair('stream_syncs')} | {pair('memcpy_calls')} | ")
                         + f"{pair('item_reads')} |")
    if timing:
        labels = list(next(iter(timing.values())).get("by_check_ms", {}))
        lines += ["", "## The guard's checks one by one on the device (ms per step)", "",
                  "The same rounds: plain DDP, the guard with each check alone, the defaults "
                  "(nonfinite, and weights with the optimizer state every step) and the "
                  "defaults with the checksum.", "",
                  "| workload | plain DDP | " + " | ".join(labels) + " | defaults | defaults + "
                  "checksum |", "|---" * (len(labels) + 4) + "|"]
        for name, t in timing.items():
            lines.append(f"| {name} | {t['step_ms_plain']:.2f} | " + " | ".join(
                f"{t['by_check_ms'][k]:.2f}" for k in labels) + f" | {t['step_ms_off']:.2f} | "
                f"{t['step_ms_checksum']:.2f} |")
    rows = [(k, v) for k, v in report.items() if k.startswith("throughput_") and "methods" in v]
    if rows:
        lines += ["", "## Throughput on the device (float32, medians of 9)", "",
                  "| tensor | method | GiB/s | vs one torch.sum pass |", "|---|---|---|---|"]
        for _, v in rows:
            for method, m in v["methods"].items():
                lines.append(f"| {v['tensor_mib']} MiB | {method} | {m['gib_per_s']:.0f} | "
                             f"{m['ratio_to_sum']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=int, nargs="*", default=[256, 4096])
    args = ap.parse_args(argv)
    try:
        torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a torch device; use cuda, cuda:N or cpu.")
    if any(m <= 0 for m in args.mib):
        ap.error(f"--mib takes tensor sizes in MiB > 0, got {args.mib}.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("device_check: CUDA is not available on this machine; nothing was checked.",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # what tensors there report
        device = torch.device("cuda", torch.cuda.current_device())
    from bench.timing import cpu_name

    report: dict[str, Any] = {"torch": torch.__version__, "device": str(device),
                              "cuda": torch.version.cuda, "host_cpu": cpu_name(),
                              "commit": _commit()}
    if device.type == "cuda":
        report["name"] = torch.cuda.get_device_name(device)
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "values": lambda: check_values(device),
        "rng_stream": lambda: check_rng(device),
        "kernels": lambda: check_kernels(device),
    }
    if device.type == "cuda":
        steps["telemetry"] = lambda: check_telemetry(device)
        steps["nccl_guard"] = lambda: check_guard("cuda", torch.cuda.device_count())
        steps["checksum"] = lambda: check_checksum("cuda", torch.cuda.device_count())
        for mib in args.mib:
            steps[f"throughput_{mib}mib"] = functools.partial(throughput, device, mib)
    else:  # the guarded steps with gloo: a dry run of this script's plumbing
        steps["gloo_guard"] = lambda: check_guard("cpu", 3)
        steps["checksum"] = lambda: check_checksum(
            "cpu", 3, steps=20, timed_steps=4, timed=[next(iter(CHECKSUM_TIMED))])
    for name, fn in steps.items():
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:
            report[name] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(report[name], default=str)[:2000], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(report.get("telemetry"), dict):
        report["driver"] = report["telemetry"].get("snapshot", {}).get("driver")
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "DEVICE.md").write_text(device_md(report))
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("passed") is False]
    print("failed:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
