"""Fingerprint throughput: GiB/s of ``sdc_guard.fingerprint`` beside other ways to summarise a
tensor, and the per-tensor cost for a model's many small tensors."""

from __future__ import annotations

import functools
import hashlib
import statistics
from collections.abc import Callable
from typing import Any

import torch

from bench.timing import alternate
from sdc_guard import fingerprint, fingerprint_tensor, native_enabled, native_kernel
from sdc_guard.internal import ISAS, active_kernel

GIB = 1024**3


def _on_path(native: bool, fn: Callable[[], object]) -> object:
    """``fn()`` with the C kernel on or off, the previous choice restored afterwards."""
    with native_kernel(native):
        return fn()


def _on_isa(isa: str, fn: Callable[[], object]) -> object:
    """``fn()`` on the C kernel's ``isa`` loops, the previous choice restored afterwards."""
    kernel = active_kernel()
    assert kernel is not None
    before = kernel.isa
    kernel.use_isa(isa)
    try:
        return fn()
    finally:
        kernel.use_isa(before)


def fingerprint_throughput(mib: int, rounds: int) -> dict[str, Any]:
    """GiB/s of each way to summarise the same float32 tensor, alternated round by round."""
    x = torch.randn(mib * 1024 * 1024 // 4)
    nbytes = x.numel() * 4
    mv = x.numpy().data.cast("B")
    methods: dict[str, Callable[[], object]] = {
        "torch.sum (one read pass)": lambda: float(x.sum()),
        "sdc_guard.fingerprint (torch ops: no C compiler)":
            lambda: _on_path(False, lambda: fingerprint(x)),
        "torch.hash_tensor (XOR, order-blind)": lambda: torch.hash_tensor(x).view(torch.int64).item(),
        "sha256 over the bytes": lambda: hashlib.sha256(mv).digest(),
    }
    try:
        import xxhash

        methods["xxh3_64 over the bytes"] = lambda: xxhash.xxh3_64_intdigest(mv)
    except ImportError:  # pragma: no cover - xxhash is in the dev extra
        pass
    kernel = active_kernel() if native_enabled() else None
    if kernel is not None:
        methods[f"sdc_guard.fingerprint (C kernel, the default: {kernel.isa})"] = (
            lambda: _on_path(True, lambda: fingerprint(x)))
        # The other instruction sets this CPU has: the same values, their speed.
        for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1]:
            if isa == kernel.isa:
                continue
            methods[f"sdc_guard.fingerprint (C kernel, {isa} forced)"] = (
                functools.partial(_on_isa, isa, lambda: fingerprint(x)))
    times = alternate(methods, rounds)
    base = statistics.median(times["torch.sum (one read pass)"])
    out: dict[str, Any] = {"tensor_mib": mib, "threads": torch.get_num_threads(),
                           "kernel_isa": kernel.isa if kernel else None,
                           "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "methods": {}}
    for name, ts in times.items():
        med = statistics.median(ts)
        out["methods"][name] = {
            "median_s": med,
            "gib_per_s": nbytes / med / GIB,
            "ratio_to_sum": base / med,
        }
    out["many_small"] = many_small_tensors(rounds)
    out["in_cache"] = in_cache_throughput(rounds)
    return out


IN_CACHE_KIB = 1024
"""A tensor small enough to stay in a server core's L2 between passes."""


def in_cache_throughput(rounds: int, reps: int = 50) -> dict[str, Any] | None:
    """GiB/s of the C kernel's word loop on each instruction set this CPU has, on one thread,
    over a float32 tensor that stays in L2 (``IN_CACHE_KIB``), beside ``torch.sum`` on it.

    With no wait for memory this is what each loop's instructions allow: where it is well
    above a machine's one-thread memory bandwidth, the loop is not what binds the
    fingerprint there (the question for machines without AVX-512, measured here on the
    narrower loops). None without the C kernel."""
    kernel = active_kernel() if native_enabled() else None
    if kernel is None:
        return None
    x = torch.randn(IN_CACHE_KIB * 1024 // 4)
    lanes = x.view(torch.int32)

    def repeated(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(reps):
                fn()
        return run

    def loop(isa: str) -> Callable[[], object]:
        assert kernel is not None
        body = repeated(lambda: kernel.words_at(lanes.data_ptr(), lanes.numel(), 0))
        return lambda: _on_isa(isa, body)

    methods: dict[str, Callable[[], object]] = {"torch.sum": repeated(lambda: x.sum())}
    for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1]:
        methods[f"C word loop, {isa}"] = loop(isa)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = alternate(methods, rounds * 3)
    finally:
        torch.set_num_threads(threads)
    nbytes = x.numel() * 4 * reps
    return {"kib": IN_CACHE_KIB, "threads": 1,
            "gib_per_s": {k: nbytes / statistics.median(v) / GIB for k, v in times.items()}}


def many_small_tensors(rounds: int) -> dict[str, Any]:
    """Microseconds per tensor for a model's many small tensors, batched against one by one.

    800 tensors like a transformer's biases, norm weights, their two AdamW moments and
    step counters (200 each of 1024, 1024, 1024 float32 and one scalar).
    """
    tensors: list[torch.Tensor] = []
    for i in range(200):
        tensors += [torch.randn(1024), torch.randn(1024), torch.rand(1024),
                    torch.tensor(float(i))]
    methods: dict[str, Callable[[], object]] = {
        "fingerprint_tensor of the list, torch path (small tensors valued together)":
            lambda: _on_path(False, lambda: fingerprint_tensor(tensors).item()),
        "torch.sum of each tensor": lambda: torch.stack([t.sum() for t in tensors]),
    }
    if native_enabled():
        methods["fingerprint_tensor of the list, C kernel (a call a tensor, mixed on the host)"] = (
            lambda: _on_path(True, lambda: fingerprint_tensor(tensors).item()))
    times = alternate(methods, rounds * 3)
    return {"tensors": len(tensors),
            "us_per_tensor": {k: statistics.median(v) / len(tensors) * 1e6
                              for k, v in times.items()}}
