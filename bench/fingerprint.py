"""Fingerprint throughput: GiB/s of ``sdc_guard.fingerprint`` beside other ways to summarise a
tensor, the per-tensor cost for a model's many small tensors, and the fingerprint against
``torch.sum`` right after a torch op and after a pause.

``python -m bench.fingerprint [--out bench] [--rounds 40] [--mib 256,64]`` measures the last
alone and puts it into an earlier run's ``results.json`` (the ``fingerprint`` section's
``after_torch_op``, with the CPU, commit and date it was measured on) and ``RESULTS.md``."""

from __future__ import annotations

import functools
import hashlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.timing import alternate, bootstrap_interval, cpu_name, seconds
from sdc_guard import fingerprint, fingerprint_tensor, native_enabled, native_kernel
from sdc_guard.internal import (
    ISAS,
    LANES_V2,
    NativeKernel,
    active_kernel,
    kernel_in_use,
    pthreads_kernel,
    torch_libgomp,
)

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
        methods[f"sdc_guard.fingerprint version 1 (C kernel, {kernel.isa})"] = (
            lambda: _on_path(True, lambda: fingerprint(x, version=1)))
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
    out["after_torch_op"] = after_torch_op(tuple(dict.fromkeys((mib, 64))), rounds * 4)
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

    def loop(isa: str, mode: int) -> Callable[[], object]:
        assert kernel is not None
        body = repeated(lambda: kernel.words_at(lanes.data_ptr(), lanes.numel(), mode))
        return lambda: _on_isa(isa, body)

    methods: dict[str, Callable[[], object]] = {"torch.sum": repeated(lambda: x.sum())}
    for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1]:
        methods[f"C word loop, {isa}"] = loop(isa, LANES_V2)
        methods[f"C word loop, {isa}, version 1"] = loop(isa, 0)
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


HOT, PAUSED = "right after a torch op", "after a pause"
"""The two conditions of ``after_torch_op``: each timed call right after an untimed parallel
torch op (torch's OpenMP workers still spinning, as after ``optimizer.step()``), or after that
op and a pause of ``PAUSE_S`` (its workers asleep)."""
PAUSE_S = 0.05


def after_torch_op(sizes_mib: tuple[int, ...], rounds: int) -> dict[str, Any] | None:
    """The fingerprint against ``torch.sum`` right after a torch op and after a pause, on
    the C kernel's default build (on torch's OpenMP pool where it can) and on the build with
    threads of its own, each on the word loops of AVX2 and of this CPU's widest instruction
    set: per size, condition and configuration, the median seconds, and the ratio
    ``torch.sum / fingerprint`` with a 90% bootstrap interval over the rounds.

    Both sides are timed alike: each timed call (``torch.sum`` or a fingerprint) follows the
    same untimed ``torch.sum`` of the same tensor, and in the paused condition the same
    sleep. The configurations alternate within a round. None without the C kernel."""
    kernel = active_kernel() if native_enabled() else None
    if kernel is None:
        return None
    builds = {kernel.threading.split(" ", 1)[0]: kernel}
    try:
        own = pthreads_kernel()
        builds.setdefault("pthreads", own)
    except RuntimeError:  # pragma: no cover - the default built, so this one builds
        pass
    isas = [i for i in ("avx2", kernel.cpu_isa) if ISAS.index(i) <= ISAS.index(kernel.cpu_isa)]
    isas = list(dict.fromkeys(isas))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out: dict[str, Any] = {"machine": cpu_name(), "threads": torch.get_num_threads(),
                           "rounds": rounds, "pause_s": PAUSE_S, "default_isa": kernel.isa,
                           "builds": {name: _described(k) for name, k in builds.items()},
                           "sizes": {}}
    for mib in sizes_mib:
        out["sizes"][str(mib)] = _conditions(torch.randn(mib * 1024 * 1024 // 4), builds,
                                             isas, rounds)
    if load is not None:  # the machine's other work, from the first round to the last
        out["load_average"] = [load, os.getloadavg()[0]]
    return out


def _conditions(x: torch.Tensor, builds: dict[str, NativeKernel], isas: list[str],
                rounds: int) -> dict[str, Any]:
    """``after_torch_op`` of one tensor."""
    methods: dict[str, Callable[[], object]] = {"torch.sum": lambda: float(x.sum())}
    for name, build in builds.items():
        for isa in isas:
            methods[f"fingerprint, {name}, {isa}"] = functools.partial(
                _on_build, build, isa, lambda: fingerprint(x))
    samples: dict[str, dict[str, list[list[float]]]] = {
        c: {k: [] for k in methods} for c in (HOT, PAUSED)}
    for fn in methods.values():
        fn()  # warm-up
    for _ in range(rounds):
        for cond, per in samples.items():
            for name, fn in methods.items():
                x.sum()
                if cond == PAUSED:
                    time.sleep(PAUSE_S)
                per[name].append([seconds(fn)])
    return {cond: _ratios(per, x.numel() * 4) for cond, per in samples.items()}


def _described(kernel: NativeKernel) -> str:
    """What ``kernel`` runs its passes on, its libgomp named by file name only."""
    if kernel.threading.startswith("openmp"):
        libgomp = torch_libgomp()[0]
        return f"torch's OpenMP pool ({libgomp.name if libgomp else 'libgomp'})"
    return "threads of its own, started per pass"


def _on_build(kernel: NativeKernel, isa: str, fn: Callable[[], object]) -> object:
    """``fn()`` with ``kernel`` in use on its ``isa`` loops, the previous choices restored."""
    before = kernel.isa
    kernel.use_isa(isa)
    try:
        with kernel_in_use(kernel):
            return fn()
    finally:
        kernel.use_isa(before)


def _ratios(per: dict[str, list[list[float]]], nbytes: int) -> dict[str, Any]:
    """Each configuration's median seconds, GiB/s and ratio to ``torch.sum`` (medians), with
    the ratio's 90% bootstrap interval over the rounds."""
    res: dict[str, Any] = {}
    base = statistics.median(s for r in per["torch.sum"] for s in r)
    for name, rounds in per.items():
        med = statistics.median(s for r in rounds for s in r)
        row: dict[str, Any] = {"median_s": med, "gib_per_s": nbytes / med / GIB,
                               "ratio_to_sum": base / med}
        if name != "torch.sum":
            pair = {"sum": per["torch.sum"], "fp": rounds}
            row["ratio_interval_90"] = list(bootstrap_interval(
                pair, lambda m: statistics.median(m["sum"]) / statistics.median(m["fp"])))
        res[name] = row
    return res


def after_torch_op_md(section: dict[str, Any]) -> list[str]:
    """RESULTS.md's lines of ``after_torch_op``: a table per size, the CPU named above it."""
    builds = section["builds"]
    when = f", commit {section['commit']}, {section['date']}" if "commit" in section else ""
    lines = ["", f"Right after a torch op, and after a pause ({section['machine']}, "
             f"{section['threads']} threads{when}): `torch.sum / fingerprint`, medians over "
             f"{section['rounds']} alternated rounds with their 90% intervals. Each timed call "
             "follows an untimed `torch.sum` of the same tensor (torch's OpenMP workers still "
             f"spinning), and after a pause a sleep of {section['pause_s'] * 1e3:.0f} ms too. "
             "The builds: " + "; ".join(f"{k}, {v}" for k, v in builds.items())
             + " (where OpenMP is to be had, the first is the default)."]
    if "load_average" in section:
        start, end = section["load_average"]
        lines[-1] += (f" The machine's load average (1 minute) was {start:.1f} at the start "
                      f"and {end:.1f} at the end.")
    for mib, conds in section["sizes"].items():
        lines += ["", f"| {mib} MiB float32: word loop, threads | {HOT} | {PAUSED} |",
                  "|---|---|---|"]
        for name in conds[HOT]:
            if name == "torch.sum":
                continue
            cells = []
            for cond in (HOT, PAUSED):
                r = conds[cond][name]
                lo, hi = r["ratio_interval_90"]
                cells.append(f"{r['ratio_to_sum']:.2f} ({lo:.2f} .. {hi:.2f})")
            _, build, isa = name.split(", ")
            lines.append(f"| {isa}, {build} | {cells[0]} | {cells[1]} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.fingerprint``: ``after_torch_op`` into an earlier run's results."""
    import argparse
    import json
    from pathlib import Path

    from bench.__main__ import _commit
    from bench.results import markdown

    ap = argparse.ArgumentParser(prog="python -m bench.fingerprint",
                                 description="the fingerprint against torch.sum right after a "
                                             "torch op and after a pause")
    ap.add_argument("--out", default="bench", help="the directory of results.json, RESULTS.md")
    ap.add_argument("--rounds", type=int, default=40, help="alternated rounds (default 40)")
    ap.add_argument("--mib", default="256,64", help="tensor sizes in MiB (default 256,64)")
    args = ap.parse_args(argv)
    try:
        sizes = tuple(int(m) for m in args.mib.split(","))
    except ValueError:
        ap.error(f"--mib {args.mib!r}: give sizes in MiB separated by commas, like 256,64")
    if args.rounds < 2 or min(sizes) < 1:
        ap.error("--rounds must be at least 2 and every --mib size at least 1")
    path = Path(args.out) / "results.json"
    if not path.exists():
        ap.error(f"{path} does not exist: run `python -m bench` first")
    when = {"commit": _commit(), "date": time.strftime("%Y-%m-%d")}
    section = after_torch_op(sizes, args.rounds)
    if section is None:
        ap.error("the C kernel could not be built here: nothing to measure")
    print("\n".join(after_torch_op_md(section)))
    # Its own machine, commit and date (not "measured_later": that names sections measured
    # again on the full run's machine, and this one may have measured on another).
    results = json.loads(path.read_text())
    results["fingerprint"]["after_torch_op"] = {**section, **when}
    path.write_text(json.dumps(results, indent=1) + "\n")
    (path.parent / "RESULTS.md").write_text(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
