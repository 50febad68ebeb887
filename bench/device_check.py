"""One prepared run for a machine with an accelerator: the GPT-2-small timings and counts, the
fingerprint's throughput, then the device tests, within a time budget.

    python -m bench.device_check [--out DIR] [--device cuda] [--mib 64 256 1024 4096]
                                 [--budget-s 270]

No pytest needed (the machine may lack it), and the torch found there is used. Without CUDA
the script says so and exits 2; ``--device cpu`` runs the same code on the CPU as a dry run
(a tiny GPT, gloo, one rank per test: ``tests/bench/test_device_check.py`` runs it).

The parts, most important first, each with a deadline (``SCHEDULE``, fractions of
``--budget-s``): a part that runs out keeps what it measured and says what was cut (``cut``);
a test that would not end before its deadline is not started (``passed: null``, ``cut``).

* ``gpt2`` (``bench.device.gpt_timing``): a GPT-2-small-sized model (~124M parameters, bf16
  autocast, AdamW, one rank under DDP, a batch scaled to a ~100 ms plain step): plain DDP, the
  guard with checks off, each check alone, the defaults and the defaults with the checksum in
  rotated blocks (medians, 90% intervals over rounds); the replay's extra time per audit step
  beside one extra forward and backward; then, per steady step of each, the profiler's kernel
  launches, stream syncs, copies and ``.item()`` reads, and the synchronisations
  ``torch.cuda.set_sync_debug_mode("warn")`` reports, with where they come from;
* ``throughput_<mib>mib``: fingerprint, word digest, ``torch.hash_tensor`` beside one
  ``torch.sum`` pass over one float32 tensor; ``throughput_gpt2_parameters``: the fingerprint of
  the GPT's ~150 parameter tensors beside a ``torch.sum`` of each and ``torch._foreach_norm``;
  each method's kernel launches per call;
* the tests of ``tests/cuda`` (plain functions, called one by one, each recorded as passed or
  failed with what it found and, when it failed, the assertion or the traceback): ``values``,
  ``rng_stream``, ``kernels``, ``telemetry``, ``nccl_guard`` (``gloo_guard`` in the dry run),
  ``checksum``, ``tolerant`` (their docstrings say what each proves; ``tolerant`` records the
  device's calibrated tolerance: how far its recomputations of a batch come apart).

``targets`` sets the issue's GPU targets beside the measured figures. Results go to
``DIR/device_check.json`` and ``DIR/DEVICE.md`` (``device_md``) and are printed;
``bench/DEVICE.md`` and ``bench/device_check.json`` hold the last run on a GPU.
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
"""A test or a measurement: fills the dict it is given; a test raises ``AssertionError`` when
it fails."""

BUDGET_S = 270.0
"""The whole run on the device, in seconds: under 5 minutes with the process's start (the
project's decision for its one shared device script; `--budget-s` gives more where a session
can spare it)."""
SCHEDULE = {"gpt2 timing": 0.34, "gpt2 counts": 0.45, "throughput": 0.57, "tests": 0.97}
"""Each part's deadline as a fraction of the budget from the start, in the order they run; a
part that ends early leaves its time to the next."""
TEST_SECONDS = {"values": 30.0, "rng_stream": 2.0, "kernels": 8.0, "telemetry": 2.0,
                "nccl_guard": 25.0, "checksum": 125.0, "tolerant": 30.0, "tolerant_bf16": 30.0}
"""About what each test takes on a GPU (the last run's times, with a margin): one that would
end past the tests' deadline is not started."""


def device_tests(device: torch.device) -> dict[str, tuple[Section, float]]:
    """The tests of ``tests/cuda`` this device runs, by their name in the JSON, with their
    arguments bound, and the seconds each needs (``TEST_SECONDS``; 0 in the dry run): on a
    GPU every test on every GPU; on the CPU one gloo rank each (the single GPU's case) and
    3 steps a clean checksum run."""
    from tests.cuda.test_checksum import test_checksum_is_clean_and_names_each_fault as checksum
    from tests.cuda.test_guard import test_guarded_ddp_names_a_nan_and_withholds_its_step as guard
    from tests.cuda.test_kernels import (
        test_rng_stream_replays_and_restores_the_generators as rng,
    )
    from tests.cuda.test_kernels import test_scaling_and_replay_words_equal_the_cpu as kernels
    from tests.cuda.test_telemetry import test_nvml_snapshot_reads_the_health_fields as nvml
    from tests.cuda.test_tolerant import (
        test_tolerant_replay_calibrates_on_the_device_and_names_a_flip as tolerant,
    )
    from tests.cuda.test_tolerant import (
        test_tolerant_replay_in_bfloat16_finds_half_precision_and_names_a_flip as tolerant_bf16,
    )
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
        tests["tolerant"] = lambda rec: tolerant(d, record=rec)
        tests["tolerant_bf16"] = lambda rec: tolerant_bf16(d, record=rec)
    else:
        tests["gloo_guard"] = lambda rec: guard("cpu", 1, record=rec)
        tests["checksum"] = lambda rec: checksum("cpu", 1, steps=3, record=rec)
        tests["tolerant"] = lambda rec: tolerant("cpu", 1, record=rec)
        tests["tolerant_bf16"] = lambda rec: tolerant_bf16("cpu", 1, record=rec)
    return {k: (t, TEST_SECONDS.get(k, 0.0) if device.type == "cuda" else 0.0)
            for k, t in tests.items()}


def device_measurements(device: torch.device, mib: list[int],
                        until: Callable[[str], float]) -> dict[str, tuple[Section, str]]:
    """The measurements of ``bench.device`` by their name in the JSON, each with the part of
    ``SCHEDULE`` whose deadline it keeps (``until``): on the CPU the dry run's tiny GPT."""
    from bench.device import DEVICE_PLAN, DRY_PLAN, gpt_timing, list_throughput, throughput

    plan = DEVICE_PLAN if device.type == "cuda" else DRY_PLAN

    def gpt(rec: dict[str, Any]) -> None:
        rec.update(gpt_timing(device.type, plan, until("gpt2 timing"), until("gpt2 counts")))
        if "error" in rec:  # failed, with what it measured before
            raise RuntimeError(rec.pop("error"))

    def size(rec: dict[str, Any], mib: int) -> None:
        rec.update(throughput(device, mib))

    def params(rec: dict[str, Any]) -> None:
        rec.update(list_throughput(device, plan.shape))

    return {"gpt2": (gpt, "gpt2 counts"),
            "throughput_gpt2_parameters": (params, "throughput"),
            **{f"throughput_{m}mib": (functools.partial(size, mib=m), "throughput") for m in mib}}


def run_section(section: Section, until: float | None = None,
                needs_s: float = 0.0) -> dict[str, Any]:
    """``section`` run with a fresh record: ``passed`` (a test: no assertion failed; a
    measurement: it ran), what it recorded, ``failure`` (the assertion) or ``error`` (the
    traceback), and ``seconds``. Not started when ``needs_s`` seconds from now pass ``until``
    (``time.time()``): ``passed`` None and ``cut`` saying why."""
    if until is not None and time.time() + needs_s > until:
        left = until - time.time()
        return {"passed": None, "cut": "not started: " + (
            f"{left:.0f} s left before its deadline, it needs about {needs_s:.0f} s"
            if left > 0 else "its deadline had passed")}
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


TARGET_OVERHEAD, TARGET_CHECKSUM, TARGET_REPLAY, TARGET_SYNCS = 0.02, 0.05, 1.15, 1
"""Issue 61's GPU targets: the defaults over plain DDP, the checksum over the defaults, the
replay's audit step over one extra forward and backward, synchronisations added a step."""
SYNC_JUDGED = ("defaults", "defaults + checksum", "replay")
"""The configurations whose added synchronisations the target bounds."""


def targets(gpt: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets beside what ``gpt`` (a ``gpt2`` record) measured: ``target``, ``measured``
    (the median, with its 90% interval where there is one), ``met`` (None: not measured)."""
    def stat(s: dict[str, Any] | None, pct: bool) -> tuple[str, float | None]:
        if not s or s.get("median") is None:
            return "not measured", None
        def f(x: float) -> str:
            return f"{x * 100:+.1f}%" if pct else f"{x:.2f}x"

        iv, median = s.get("interval_90"), float(s["median"])
        return f(median) + (f" [{f(iv[0])}, {f(iv[1])}]" if iv else ""), median

    rows = []
    for name, s, limit, pct in (
            ("defaults over plain DDP <= +2%",
             gpt.get("timing", {}).get("defaults", {}).get("vs_plain"), TARGET_OVERHEAD, True),
            ("defaults + checksum over the defaults <= +5%", gpt.get("checksum_over_defaults"),
             TARGET_CHECKSUM, True),
            ("replay per audit step <= 1.15x one extra forward+backward",
             gpt.get("replay", {}).get("per_audit_step_ratio"), TARGET_REPLAY, False)):
        text, value = stat(s, pct)
        rows.append({"target": name, "measured": text,
                     "met": None if value is None else value <= limit})
    counts = gpt.get("counts", {})
    base = max(counts.get("plain DDP", {}).get("syncs_per_step") or [0])
    for name in SYNC_JUDGED:
        per = counts.get(name, {}).get("syncs_per_step")
        added = None if not per else max(per) - base
        rows.append({"target": f"{name}: at most {TARGET_SYNCS} synchronisation added a step",
                     "measured": "not measured" if added is None else
                     f"{added:+d} (most in a step: {max(per)}, plain DDP: {base})",
                     "met": None if added is None else added <= TARGET_SYNCS})
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    iv = s.get("interval_90")
    return f"{s['median'] * 100:+.1f}%" + (
        f" [{iv[0] * 100:+.1f}, {iv[1] * 100:+.1f}]" if iv else "")


def _gpt_md(g: dict[str, Any]) -> list[str]:
    """The ``gpt2`` record's tables."""
    if "timing" not in g:
        return []
    s, cal = g["shape"], g.get("calibration", {})
    lines = ["", "## GPT-2-small-sized training step, one rank under DDP", "",
             f"Ours: {s['layers']} layers, width {s['width']}, {s['heads']} heads, vocabulary "
             f"{s['vocab']}, context {s['context']}: {g['parameters'] / 1e6:.1f}M parameters in "
             f"{g['parameter_tensors']} tensors; bf16 autocast, AdamW, {g['backend']}. Batch "
             f"{g['batch']} x {s['context']} tokens (from {cal.get('start_batch')} by a measured "
             f"plain step, aiming at {cal.get('target_step_s')} s)"
             + (f"; plain DDP at {g['tflops_plain']:.0f} TFLOPS of 6 x parameters x tokens"
                if g.get("tflops_plain") else "") + ". Rotated blocks, medians over rounds, "
             "90% bootstrap intervals over rounds."
             + (f" **Cut by the budget:** {'; '.join(g['cut'])}." if g.get("cut") else "")
             + (f" Detections or withheld steps (none expected): {g['reported']}."
                if g.get("reported") else ""), "",
             "| configuration | ms per step | vs plain DDP |", "|---|---|---|"]
    for name, t in g["timing"].items():
        lines.append(f"| {name} | {_ms(t['step_ms'])} | "
                     f"{'' if name == 'plain DDP' else _pct(t['vs_plain'])} |")
    r = g.get("replay", {})
    if "error" in r:
        lines += ["", f"The replay could not run on this model: `{r['error'].splitlines()[-1]}`"]
    elif r:
        def med(x: dict[str, Any]) -> str:
            return "-" if x.get("median") is None else f"{x['median']:.2f}"
        lines += ["", f"The replay every {r['interval']} steps (deterministic mode, each step "
                  f"timed): an audit step costs {med(r['audit_step_extra_ms'])} ms more than "
                  f"the others, one extra forward+backward {med(r['forward_backward_ms'])} ms: "
                  f"{med(r['per_audit_step_ratio'])}x (per round, median)."]
    counts = g.get("counts", {})
    if counts:
        base = max(counts.get("plain DDP", {}).get("syncs_per_step") or [0])
        lines += ["", "Per steady step: from torch's profiler, kernel launches, stream/event/"
                  "device synchronisations, device-to-host copies and `.item()` reads; from "
                  f"{g.get('sync_source', 'set_sync_debug_mode')}, the synchronisations warned "
                  "in each step, the most added over plain DDP, and where they come from.", "",
                  "| configuration | launches | syncs (profiler) | D2H copies | .item() | "
                  "syncs warned per step | added | where |", "|---|---|---|---|---|---|---|---|"]
        for name, c in counts.items():
            per = c["syncs_per_step"]
            where = "; ".join(f"{site} ({n})" for site, n in c["sync_sites"][:3])
            lines.append(f"| {name} | {c['kernel_launches']:.0f} | {c['stream_syncs']:.0f} | "
                         f"{c['d2h_copies']:.0f} | {c['item_reads']:.0f} | "
                         f"{' '.join(map(str, per))} | {max(per) - base:+d} | {where} |")
    lines += ["", "### Targets (issue 61)", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | "
              f"{'-' if t['met'] is None else 'yes' if t['met'] else '**no**'} |"
              for t in targets(g)]
    return lines


def device_md(report: dict[str, Any]) -> str:
    """The tables of a ``device_check.json``: what passed or was cut, the GPT-2-small step
    times, counts and targets, the fingerprint's throughput beside ``torch.sum``."""
    lines = [f"# Device check: {report.get('name', report['device'])}", "",
             f"torch {report['torch']}, CUDA {report.get('cuda') or '-'}, driver "
             f"{report.get('driver') or '-'}; host CPU {report.get('host_cpu', '-')}. "
             "Generated by `python -m bench.device_check` (docs/harness.md)"
             + (f" in {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget"
                if "seconds" in report else "")
             + (f"; at commit {report['commit']}" if report.get("commit") else "") + "."
             + (f" {report['note']}" if report.get("note") else ""), "",
             "| part | passed | seconds | problems |", "|---|---|---|---|"]
    for name, v in report.items():
        if isinstance(v, dict) and "passed" in v:
            problems = (v.get("problems") or v.get("mismatches") or v.get("failure")
                        or v.get("error") or v.get("cut") or [])
            text = "; ".join(problems[:3]) if isinstance(problems, list) else str(problems)
            ok = "cut" if v["passed"] is None else "yes" if v["passed"] else "**no**"
            lines.append(f"| {name} | {ok} | {v.get('seconds', '')} | "
                         f"{text[:300].replace('|', '/')} |")
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
    lines += _gpt_md(report.get("gpt2", {}))
    rows = [v for k, v in report.items() if k.startswith("throughput_") and "methods" in v]
    if rows:
        lines += ["", "## Throughput on the device (medians of 9; launches per call from the "
                  "profiler)", "", "| data | method | GiB/s | vs torch.sum | "
                  "vs torch._foreach_norm | launches |", "|---|---|---|---|---|---|"]
        for v in rows:
            data = (f"{v['tensor_mib']} MiB, one float32 tensor" if "tensor_mib" in v else
                    f"{v['list_mib']:.3g} MiB, {v['tensors']} parameter tensors")
            for method, m in v["methods"].items():
                lines.append(f"| {data} | {method} | {m['gib_per_s']:.0f} | "
                             f"{m['ratio_to_0']:.2f} | "
                             + (f"{m['ratio_to_1']:.2f}" if "ratio_to_1" in m else "-")
                             + f" | {m.get('launches', 0):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.device_check",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=int, nargs="*", default=None,
                    help="tensor sizes of the throughput rows (default: 64 256 1024 4096 on a "
                         "GPU, 1 in the dry run)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="seconds the whole run may take (the parts' deadlines scale with it)")
    args = ap.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a torch device; use cuda, cuda:N or cpu.")
    mib = args.mib if args.mib is not None else (
        [64, 256, 1024, 4096] if device.type == "cuda" else [1])
    if any(m <= 0 for m in mib):
        ap.error(f"--mib takes tensor sizes in MiB > 0, got {mib}.")
    if not args.budget_s > 0:
        ap.error(f"--budget-s takes the run's seconds, > 0, got {args.budget_s}.")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("device_check: CUDA is not available on this machine; nothing was checked.",
              file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is None:  # what tensors there report
        device = torch.device("cuda", torch.cuda.current_device())
    from bench.timing import cpu_name

    start = time.time()

    budget: float = args.budget_s

    def until(part: str) -> float:
        return start + SCHEDULE[part] * budget

    report: dict[str, Any] = {"torch": torch.__version__, "device": str(device),
                              "cuda": torch.version.cuda, "host_cpu": cpu_name(),
                              "commit": _commit(), "budget_s": args.budget_s}
    if device.type == "cuda":
        report["name"] = torch.cuda.get_device_name(device)
    parts = {name: (section, until(part), 0.0)
             for name, (section, part) in device_measurements(device, mib, until).items()}
    parts.update({name: (test, until("tests"), needs)
                  for name, (test, needs) in device_tests(device).items()})
    threads = torch.get_num_threads()
    if device.type == "cpu":  # as every rank runs: several threads on few shared cores crawl
        torch.set_num_threads(1)
    try:
        for name, (section, deadline, needs) in parts.items():
            report[name] = run_section(section, deadline, needs)
            print(name, json.dumps(report[name], default=str)[:2000], flush=True)
    finally:
        torch.set_num_threads(threads)
    report["seconds"] = round(time.time() - start, 1)
    report["targets"] = targets(report["gpt2"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(report.get("telemetry"), dict):
        report["driver"] = report["telemetry"].get("snapshot", {}).get("driver")
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "DEVICE.md").write_text(device_md(report))
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("passed") is False]
    cut = [k for k, v in report.items() if isinstance(v, dict) and v.get("passed") is None]
    print(f"seconds: {report['seconds']}; failed: {failed or 'none'}; not started: "
          f"{cut or 'none'}; cut inside gpt2: {report['gpt2'].get('cut') or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
