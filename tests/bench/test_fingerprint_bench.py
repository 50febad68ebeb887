"""The fingerprint bench's in-cache table: each instruction set's word loop, and its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fingerprint import in_cache_throughput
from bench.results import markdown
from sdc_guard import native_enabled
from sdc_guard.fingerprints.native import ISAS, active_kernel


def test_in_cache_rates_name_every_loop_this_cpu_runs_and_reach_results_md() -> None:
    if not native_enabled():
        pytest.skip("the C kernel could not be built here")
    kernel = active_kernel()
    assert kernel is not None
    before = kernel.isa
    res = in_cache_throughput(rounds=1, reps=2)
    assert kernel.isa == before  # the forced loops are undone
    assert res is not None
    loops = [name for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1]
             for name in (f"C word loop, {isa}", f"C word loop, {isa}, version 1")]
    assert list(res["gib_per_s"]) == ["torch.sum", *loops]
    assert all(v > 0 for v in res["gib_per_s"].values())
    results = json.loads((Path(__file__).parents[2] / "bench" / "results.json").read_text())
    page = markdown({**results, "fingerprint": {**results["fingerprint"], "in_cache": res}})
    line = next(x for x in page.splitlines() if x.startswith("In cache ("))
    assert all(isa in line for isa in ISAS[: ISAS.index(kernel.cpu_isa) + 1])


def test_after_a_torch_op_times_both_builds_on_avx2_and_the_widest_in_both_conditions() -> None:
    from bench.fingerprint import HOT, PAUSED, after_torch_op, after_torch_op_md
    from bench.timing import cpu_name

    if not native_enabled():
        pytest.skip("the C kernel could not be built here")
    kernel = active_kernel()
    assert kernel is not None
    before = kernel.isa
    res = after_torch_op((2,), rounds=2)
    assert active_kernel() is kernel and kernel.isa == before  # the build and loops restored
    assert res is not None and res["machine"] == cpu_name()
    builds = dict.fromkeys([kernel.threading.split(" ")[0], "pthreads"])
    isas = dict.fromkeys(["avx2", kernel.cpu_isa] if kernel.cpu_isa != "baseline"
                         else ["baseline"])
    want = ["torch.sum", *(f"fingerprint, {b}, {i}" for b in builds for i in isas)]
    for cond in (HOT, PAUSED):
        rows = res["sizes"]["2"][cond]
        assert list(rows) == want
        for name in want[1:]:
            lo, hi = rows[name]["ratio_interval_90"]
            assert 0 < lo <= hi and rows[name]["median_s"] > 0
    assert len(res["load_average"]) == 2
    page = "\n".join(after_torch_op_md(res))
    assert "load average (1 minute) was " in page
    assert cpu_name() in page and f"| 2 MiB float32: word loop, threads | {HOT} | {PAUSED} |" \
        in page
    assert all(f"| {i}, {b} | " in page for b in builds for i in isas)
