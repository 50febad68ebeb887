"""The fingerprint's version 2 against version 1 and a ``torch.sum`` pass, side by side.

Version 2 weights each 32-bit lane ``2**8 (2k+1) + 2**rho(k)`` where version 1 weighed it
``2k+1`` (docs/fingerprint.md): the same read pass, a few more additions. Measured in
alternated rounds on one tensor, per instruction set of the C kernel this CPU has, and on the
torch path (no C compiler): a float32 tensor of ``--mib`` MiB on torch's threads (what memory
allows), with the replay digest (version 2's lanes, unmixed) beside them; and the word loops
alone over 1 MiB on one thread, ``REPS`` passes a call (it stays in L2: what each loop's
instructions allow).

    python -m bench.versions [--mib 256] [--rounds 30] [--out bench]

writes ``OUT/versions.json`` and ``OUT/VERSIONS.md``: medians, ratios to ``torch.sum`` with a
95% bootstrap interval over the rounds.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.fingerprint import _on_isa
from bench.timing import alternate, cpu_name, publish
from sdc_guard import fingerprint, native_enabled, native_kernel
from sdc_guard.internal import ISAS, LANES_V2, active_kernel, digest_value

GIB = 1024**3


def _torch_path(fn: Callable[[], object]) -> object:
    with native_kernel(False):
        return fn()


def _methods(x: torch.Tensor, torch_path: bool) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {"torch.sum": lambda: float(x.sum())}
    kernel = active_kernel() if native_enabled() else None
    if kernel is not None:
        for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1]:
            for version in (2, 1):
                out[f"C kernel, {isa}, version {version}"] = functools.partial(
                    _on_isa, isa, functools.partial(fingerprint, x, version=version))
            out[f"C kernel, {isa}, replay digest"] = functools.partial(
                _on_isa, isa, functools.partial(digest_value, x))
    if torch_path:
        for version in (2, 1):
            out[f"torch path, version {version}"] = functools.partial(
                _torch_path, functools.partial(fingerprint, x, version=version))
    return out


def _ratio_interval(base: list[float], ts: list[float], n: int = 1000) -> tuple[float, float]:
    """A 95% bootstrap interval of ``median(base) / median(ts)``, the rounds resampled (a
    round times both, one after the other: the unit of resampling). Seeded."""
    rng = random.Random(0)
    k = len(base)
    stats = []
    for _ in range(n):
        pick = [rng.randrange(k) for _ in range(k)]
        stats.append(statistics.median(base[i] for i in pick)
                     / statistics.median(ts[i] for i in pick))
    stats.sort()
    return stats[int(0.025 * n)], stats[int(0.975 * n) - 1]


REPS = 20
"""In cache, each timed call repeats the pass this many times (one pass is tens of
microseconds: the clock and the call would weigh)."""


def _loops(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The C kernel's word loop over ``x``'s lanes, version 2 and version 1, per instruction
    set, ``REPS`` passes a call (no Python between them), beside ``REPS`` ``torch.sum``."""
    lanes = x.view(torch.int32)

    def reps(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> None:
            for _ in range(REPS):
                fn()
        return run

    out: dict[str, Callable[[], object]] = {"torch.sum": reps(lambda: x.sum())}
    kernel = active_kernel() if native_enabled() else None
    if kernel is not None:
        for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1]:
            for version, mode in ((2, LANES_V2), (1, 0)):
                out[f"C word loop, {isa}, version {version}"] = functools.partial(
                    _on_isa, isa, reps(functools.partial(kernel.words_at, lanes.data_ptr(),
                                                      lanes.numel(), mode)))
    return out


def _table(x: torch.Tensor, rounds: int, threads: int, torch_path: bool,
           loops: bool = False) -> dict[str, Any]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = alternate(_loops(x) if loops else _methods(x, torch_path), rounds)
    finally:
        torch.set_num_threads(before)
    base = times["torch.sum"]
    nbytes = x.numel() * x.element_size() * (REPS if loops else 1)
    rows = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        low, high = _ratio_interval(base, ts)
        rows[name] = {"median_s": med, "gib_per_s": nbytes / med / GIB,
                      "ratio_to_sum": statistics.median(base) / med,
                      "ratio_to_sum_ci95": [low, high]}
    return {"mib": x.numel() * x.element_size() / 2**20, "threads": threads, "rounds": rounds,
            "methods": rows}


def versions(mib: int, rounds: int) -> dict[str, Any]:
    big = torch.randn(mib * 2**20 // 4)
    small = torch.randn(2**20 // 4)
    t0 = time.perf_counter()
    memory = _table(big, rounds, torch.get_num_threads(), torch_path=True)
    cache = _table(small, rounds * 5, 1, torch_path=False, loops=True)
    kernel = active_kernel() if native_enabled() else None
    return {"machine": cpu_name(), "torch": torch.__version__,
            "default_isa": kernel.isa if kernel else None,
            "threading": kernel.threading if kernel else None,
            "seconds": time.perf_counter() - t0, "memory": memory, "in_cache": cache}


def markdown(res: dict[str, Any]) -> list[str]:
    lines = ["# The fingerprint's version 2 beside version 1 and torch.sum", "",
             f"{res['machine']}, torch {res['torch']}; the C kernel's default loop "
             f"{res['default_isa']} ({res['threading']}). Alternated rounds, medians; the "
             "ratio is torch.sum's time over the method's (1.00: as fast as one torch.sum "
             "pass; above: faster), with a 95% bootstrap interval over the rounds. Generated "
             "by `python -m bench.versions`.", ""]
    for key, title in (("memory", "From memory"), ("in_cache", "In cache, the word loops")):
        t = res[key]
        lines += [f"## {title}: {t['mib']:.0f} MiB float32, {t['threads']} thread(s), "
                  f"{t['rounds']} rounds", "",
                  "| method | GiB/s | ratio to torch.sum | 95% interval |", "|---|---:|---:|---|"]
        for name, m in t["methods"].items():
            low, high = m["ratio_to_sum_ci95"]
            lines.append(f"| {name} | {m['gib_per_s']:.2f} | {m['ratio_to_sum']:.2f} | "
                         f"{low:.2f} .. {high:.2f} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.versions",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="the large tensor, MiB (default 256)")
    ap.add_argument("--rounds", type=int, default=30, help="alternated rounds (default 30)")
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.rounds < 2:
        ap.error("--mib must be at least 1 and --rounds at least 2")
    res = versions(args.mib, args.rounds)
    lines = markdown(res)
    publish(Path(args.out), "versions", res, lines)
    (Path(args.out) / "VERSIONS.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
