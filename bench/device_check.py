"""One prepared run for a machine with an accelerator: the device tests, then the timings.

    python -m bench.device_check [--out DIR] [--device cuda] [--mib 256 4096]

No pytest needed (the machine may lack it): the tests of ``tests/cuda`` are plain functions,
imported and called here one by one (``device_tests``), each recorded as passed or failed with
what it found (its ``record``) and, when it failed, the assertion or the traceback. Without
CUDA the script says so and exits 2; ``--device cpu`` runs the same tests on the CPU, with
gloo for the guarded steps, as a dry run (``tests/bench/test_device_check.py`` runs it).

The tests (``tests/cuda``; ``pytest -m cuda`` runs the same ones where a GPU is):

* ``values``: the fingerprint and the replay's word digest give the same value on the device
  as on the CPU, for every dtype, odd sizes, non-contiguous views, empty tensors and a tensor
  larger than one device chunk; the result stays on the device;
* ``rng_stream``: the replay's random stream gives the same numbers on the device twice and
  the generators their state back;
* ``kernels``: the comm hook's fused scale-and-check leaves the bits of ``mul_(1/world)`` and
  flags exactly the non-finite buffers; the step-word term and the replay's gradient words
  computed on the device equal the host values;
* ``telemetry``: the NVML snapshot of the suspect rank reads the health fields;
* ``nccl_guard`` (``gloo_guard`` in the dry run): guarded DDP steps with nccl, one rank per
  GPU (the ring of one on a single GPU), nonfinite, weights and replay every step with no
  detection, and a NaN written into a local gradient named and its optimizer step withheld
  on every rank;
* ``checksum``: the checksum check's torch path (the C passes serve the CPU): every model the
  campaign ships trains clean in float32 (TF32 off and on), bfloat16 and under autocast, with
  the eager sides and the fused ones; an exponent flip inside each product of a linear layer
  (forward, input gradient, weight gradient) on the last rank is named in its step, that
  rank, and the step withheld on every rank.

The timings (``bench.device``, public API and ``sdc_guard.internal`` only):

* the checksum check's step time beside the guard without it, its fused sides, each check
  alone and plain DDP, on the reference MLP, a wider MLP and the transformer, with the
  profiler's count of launches, syncs, copies and ``.item()`` reads per step: written into
  the ``checksum`` record as ``timing`` (the ``checksum_timing`` entry says how it ran);
* throughput on the device: fingerprint, word digest, ``torch.hash_tensor`` beside one
  ``torch.sum`` pass over the same float32 tensor (``throughput_<mib>mib``).

Results go to ``DIR/device_check.json`` and ``DIR/DEVICE.md`` (its tables, ``device_md``)
and are printed; ``bench/DEVICE.md`` and ``bench/device_check.json`` hold the last run on a
GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Section = Callable[[dict[str, Any]], None]
"""A test or a timing: fills the dict it is given; a test raises ``AssertionError`` when it
fails."""


def device_tests(device: torch.device) -> dict[str, Section]:
    """The tests of ``tests/cuda`` this device runs, by their name in the JSON, with their
    arguments bound: on a GPU every test on every GPU; on the CPU (the dry run) three gloo
    ranks, and 20 steps a clean checksum run."""
    from tests.cuda.test_checksum import test_checksum_is_clean_and_names_each_fault as checksum
    from tests.cuda.test_guard import test_guarded_ddp_names_a_nan_and_withholds_its_step as guard
    from tests.cuda.test_kernels import (
        test_rng_stream_replays_and_restores_the_generators as rng,
    )
    from tests.cuda.test_kernels import test_scaling_and_replay_words_equal_the_cpu as kernels
    from tests.cuda.test_telemetry import test_nvml_snapshot_reads_the_health_fields as nvml
    from tests.cuda.test_values import test_fingerprint_and_digest_equal_the_cpu as values

    d = str(device)
    tests: dict[str, Section] = {
        "values": lambda rec: values(d, record=rec),
        "rng_stream": lambda rec: rng(d, record=rec),
        "kernels": lambda rec: kernels(d, record=rec),
    }
    if device.type == "cuda":
        tests["telemetry"] = lambda rec: nvml(d, record=rec)
        tests["nccl_guard"] = lambda rec: guard(d, record=rec)
        tests["checksum"] = lambda rec: checksum(d, record=rec)
    else:
        tests["gloo_guard"] = lambda rec: guard("cpu", 3, record=rec)
        tests["checksum"] = lambda rec: checksum("cpu", 3, steps=20, record=rec)
    return tests


def device_timings(device: torch.device, mib: list[int]) -> dict[str, Section]:
    """The timings of ``bench.device`` by their name in the JSON: on the CPU (the dry run) the
    checksum's on one workload, 4 steps a block, and no throughput."""
    from bench.device import CHECKSUM_TIMED, checksum_timing, throughput

    def timed(rec: dict[str, Any], **kwargs: Any) -> None:
        rec.update(checksum_timing(device.type, **kwargs))

    def size(rec: dict[str, Any], mib: int) -> None:
        rec.update(throughput(device, mib))

    if device.type == "cpu":
        return {"checksum_timing": functools.partial(
            timed, world=3, timed_steps=4, timed=[next(iter(CHECKSUM_TIMED))])}
    return {"checksum_timing": functools.partial(timed, world=torch.cuda.device_count()),
            **{f"throughput_{m}mib": functools.partial(size, mib=m) for m in mib}}


def run_section(section: Section) -> dict[str, Any]:
    """``section`` run with a fresh record: ``passed`` (a test: no assertion failed; a
    timing: it ran), what it recorded, ``failure`` (the assertion) or ``error`` (the
    traceback), and ``seconds``."""
    record: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        section(record)
        out = {"passed": True, **record}
    except AssertionError as e:
        out = {"passed": False, **record, "failure": str(e)[:3000] or traceback.format_exc()[-3000:]}
    except Exception:
        out = {"passed": False, **record, "error": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


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
            problems = (v.get("problems") or v.get("mismatches") or v.get("failure")
                        or v.get("error") or [])
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
    for name, section in {**device_tests(device), **device_timings(device, args.mib)}.items():
        report[name] = run_section(section)
        print(name, json.dumps(report[name], default=str)[:2000], flush=True)
    if "timing" in report["checksum_timing"]:  # where the checksum's step times always were
        report["checksum"]["timing"] = report["checksum_timing"].pop("timing")
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
