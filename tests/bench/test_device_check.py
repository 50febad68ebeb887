"""The prepared device run on the CPU: the GPT-2-small code at a tiny size, the throughput and
the device tests (tests/cuda) through ``python -m bench.device_check --device cpu``; the
parts it is made of (the rotated blocks and their deadline, the synchronisation counting, the
targets, the tables), each test's judgement, and a clear refusal without CUDA."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import device, device_check
from tests.cuda import test_checksum, test_guard, test_kernels


@pytest.mark.timeout(600)  # about 20 s alone; minutes beside other work on two cores
def test_dry_run_on_cpu_passes_and_writes_json(tmp_path: Path) -> None:
    assert device_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["values"]["passed"] and report["values"]["mismatches"] == []
    assert report["values"]["result_stays_on_device"]
    assert report["rng_stream"]["passed"] and report["rng_stream"]["state_restored"]
    assert report["kernels"]["passed"] and report["kernels"]["fused_unscale_kernel_used"]
    assert report["kernels"]["fused_unscale_kernel"] == {  # float32 takes the C kernel
        "float32": None, "float16": True, "bfloat16": True}
    guard = report["gloo_guard"]  # the guarded steps, with gloo in place of nccl, one rank
    assert guard["passed"] and guard["world"] == 1
    # The replay's in the step's own report (a ring of one: its own replay), the
    # non-finite one from flush().
    assert guard["ranks"][0]["detections"] == [["replay", 6, [0]], ["nonfinite", 6, [0]]]
    assert guard["ranks"][0]["skipped"] == [6]
    checksum = report["checksum"]  # the checksum check's torch path, as a GPU runs it
    assert checksum["passed"] and checksum["problems"] == [], checksum
    assert checksum["clean_runs"] == len(test_checksum.CHECKSUM_RUNS) + len(
        test_checksum.CHECKSUM_FUSED_RUNS)
    assert set(checksum["fused_checked"].values()) == {True}  # every fused form agreed
    assert {"cpu/forward/float32", "cpu/gx+gw/float32", "cpu/weight/float32"} <= set(
        checksum["fused_checked"])
    assert 0 < checksum["autocast_sides_error"] < test_checksum.AUTOCAST_SIDES  # float32 sides
    assert checksum["faults"] == 3 * len(test_checksum.CHECKSUM_FAULTS)  # plain, hooked, fused
    gpt = report["gpt2"]  # the GPT-2-small code at the tiny size, every part of it
    assert gpt["passed"] and gpt["cut"] == [] and gpt["reported"] == {}
    assert gpt["shape"] == {"layers": 2, "width": 64, "heads": 4, "vocab": 512, "context": 32}
    configs = [device.PLAIN, *device.GPT_CONFIGS]
    assert list(gpt["timing"]) == configs
    assert all(t["step_ms"] > 0 and t["vs_plain"]["rounds"] == device.DRY_PLAN.rounds - 1
               for t in gpt["timing"].values())
    replay = gpt["replay"]
    assert replay["interval"] == 2 and replay["per_audit_step_ratio"]["median"] is not None
    assert list(gpt["counts"]) == [*configs, device.REPLAY, device.IDEAL]
    for name, c in gpt["counts"].items():
        # The CPU proxy of a GPU's reads: AdamW reads its step counters (CPU tensors on a GPU)
        assert len(c["syncs_per_step"]) == device.DRY_PLAN.sync_steps, name
        assert min(c["syncs_per_step"]) >= max(gpt["counts"][device.PLAIN]["syncs_per_step"])
        assert c["item_reads"] > 0 and c["aten_ops"] > 0 and c["kernel_launches"] == 0
    assert {t["target"] for t in report["targets"]} >= {
        "defaults over plain DDP <= +2%", "replay: at most 1 synchronisation added a step"}
    params = report["throughput_gpt2_parameters"]
    assert params["passed"] and params["tensors"] == 28 and set(params["methods"]) == {
        device.SUM_EACH, device.FOREACH_NORM, "sdc_guard.fingerprint_tensor (list)",
        "fingerprint_tensor (list), torch ops"}
    assert report["throughput_1mib"]["passed"]
    md = (tmp_path / "DEVICE.md").read_text()
    assert "| checksum | yes |" in md and "| gloo_guard | yes |" in md
    assert "| defaults + checksum |" in md and "### Targets (issue 61)" in md


def _gpt_record() -> dict[str, Any]:
    """A ``gpt2`` record as a GPU run would write it (the figures invented)."""
    def stat(median: float | None, lo: float = 0.0, hi: float = 0.0) -> dict[str, Any]:
        return {"median": median, "interval_90": [lo, hi], "rounds": 8}

    counts = {name: {"kernel_launches": 900.0, "stream_syncs": 1.0, "memcpy_calls": 2.0,
                     "d2h_copies": 1.0, "h2d_copies": 0.0, "item_reads": 0.0, "aten_ops": 3000.0,
                     "syncs_per_step": per, "sync_sites": [["sdc_guard/guard.py:1", 8]]}
              for name, per in ((device.PLAIN, [0, 0]), ("defaults", [1, 1]),
                                ("defaults + checksum", [1, 3]), (device.REPLAY, [0, 1]))}
    return {"shape": {"layers": 12, "width": 768, "heads": 12, "vocab": 50257, "context": 1024},
            "parameters": 124_439_808, "parameter_tensors": 148, "backend": "nccl", "batch": 24,
            "calibration": {"start_batch": 32, "target_step_s": 0.1}, "tflops_plain": 300.0,
            "cut": ["counts: one extra forward+backward"], "reported": {},
            "timing": {device.PLAIN: {"step_ms": 100.0, "vs_plain": stat(0.0)},
                       "defaults": {"step_ms": 101.0, "vs_plain": stat(0.01, 0.005, 0.015)}},
            "checksum_over_defaults": stat(0.08, 0.07, 0.09),
            "replay": {"interval": 4, "audit_step_extra_ms": stat(40.0),
                       "forward_backward_ms": stat(38.0),
                       "per_audit_step_ratio": stat(1.05, 1.0, 1.1)},
            "counts": counts}


def test_targets_judge_each_figure() -> None:
    met = {t["target"]: (t["measured"], t["met"]) for t in device_check.targets(_gpt_record())}
    assert met["defaults over plain DDP <= +2%"] == ("+1.0% [+0.5%, +1.5%]", True)
    assert met["defaults + checksum over the defaults <= +5%"][1] is False
    assert met["replay per audit step <= 1.15x one extra forward+backward"] == (
        "1.05x [1.00x, 1.10x]", True)
    assert met["defaults: at most 1 synchronisation added a step"][1] is True
    assert met["defaults + checksum: at most 1 synchronisation added a step"] == (
        "+3 (most in a step: 3, plain DDP: 0)", False)
    # Nothing measured (a run cut before its counts): said so, neither met nor missed.
    empty = device_check.targets({"replay": {"error": "RuntimeError: ..."}})
    assert {t["met"] for t in empty} == {None}
    assert {t["measured"] for t in empty} == {"not measured"}


def test_device_md_renders_the_gpt_tables_and_a_cut_part() -> None:
    report = {"device": "cuda:0", "name": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0",
              "seconds": 400.0, "budget_s": 450.0, "gpt2": {"passed": True, **_gpt_record()},
              "checksum": {"passed": None, "cut": "not started: 20 s left before its deadline, "
                                                  "it needs about 125 s"},
              "throughput_gpt2_parameters": {"passed": True, "tensors": 148, "list_mib": 474.7,
                                             "methods": {device.SUM_EACH: {
                                                 "gib_per_s": 1000.0, "ratio_to_0": 1.0,
                                                 "ratio_to_1": 0.5, "launches": 148.0}}}}
    md = device_check.device_md(report)
    assert "| checksum | cut |" in md and "it needs about 125 s" in md
    assert "in 400 s of a 450 s budget" in md
    assert "124.4M parameters in 148 tensors" in md and "Batch 24 x 1024 tokens" in md
    assert "**Cut by the budget:** counts: one extra forward+backward." in md
    assert "| defaults | 101.00 | +1.0% [+0.5, +1.5] |" in md
    assert "1.05x (per round, median)" in md
    assert "| defaults + checksum | 900 | 1 | 1 | 0 | 1 3 | +3 | sdc_guard/guard.py:1 (8) |" in md
    assert "| defaults + checksum over the defaults <= +5% | +8.0% [+7.0%, +9.0%] | **no** |" in md
    assert ("| 475 MiB, 148 parameter tensors | torch.sum of each tensor | 1000 | 1.00 | 0.50 "
            "| 148 |") in md


def test_sync_counts_counts_each_steps_warnings_and_names_where() -> None:
    """The counting of ``set_sync_debug_mode("warn")``'s warnings, on the CPU's stand-in
    stream (``CpuSyncWarnings``: the same warning at each read a GPU would wait for) and on a
    fake one that warns as CUDA does, with other warnings beside it not counted."""
    x = torch.arange(4.0)

    def step(s: int) -> None:
        x.sum().item()  # one read
        for _ in range(s):
            bool(x[0] > 0)  # s more
        x.mul(2)  # no read

    out = device.sync_counts(step, range(3), torch.device("cpu"))
    assert out["syncs_per_step"] == [1, 2, 3]
    site = out["sync_sites"][0][0]
    assert site.startswith("tests/bench/test_device_check.py:") or "test_device_check.py:" in site

    @contextlib.contextmanager
    def fake(_: torch.device) -> Iterator[None]:
        yield

    def warns(s: int) -> None:
        warnings.warn(device.SYNC_MESSAGE, UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    assert device.sync_counts(warns, range(2), torch.device("cpu"), fake)[
        "syncs_per_step"] == [1, 1]


def test_time_rounds_rotates_and_stops_at_its_deadline() -> None:
    order: list[str] = []

    def runner(name: str) -> device.Runner:
        return device.Runner(lambda s: order.append(f"{name}{s}"))

    runners = {n: runner(n) for n in "ab"}
    kept, cut = device.time_rounds(runners, 2, 3, torch.device("cpu"), time.time() + 60)
    assert not cut and [len(v) for v in kept.values()] == [2, 2]  # the warm-up round dropped
    assert order == ["a0", "a1", "b0", "b1", "b2", "b3", "a2", "a3", "a4", "a5", "b4", "b5"]
    steps, _ = device.time_rounds(runners, 2, 2, torch.device("cpu"), time.time() + 60,
                                  each_step=True)
    assert [s for s, _ in steps["a"][0]] == [8, 9]  # each step timed, tagged
    kept, cut = device.time_rounds(runners, 2, 5, torch.device("cpu"), time.time() - 1)
    assert cut and kept == {"a": [], "b": []}  # the warm-up ran, nothing after the deadline


def test_per_audit_and_stats() -> None:
    assert device.per_audit([(0, 5.0), (1, 1.0), (2, 1.2), (3, 1.0)], 4) == 4.0
    one = device.ratio_stats([0.1])
    assert one == {"median": 0.1, "interval_90": None, "rounds": 1}
    many = device.ratio_stats([0.1, 0.2, 0.3, 0.4])
    assert many["median"] == pytest.approx(0.25) and many["interval_90"][0] <= 0.25


def test_a_failed_gpt_run_keeps_what_it_had_and_fails_its_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("this process has a process group: DDP would not fail here")
    # No process group: DDP refuses the calibration's model, after the model was built.
    out = device.gpt_measure(0, device.DRY_PLAN, torch.device("cpu"), time.time() + 60,
                             time.time() + 60)
    assert out["parameters"] == 134_912 and "calibration" not in out
    assert "process group" in out["error"]
    monkeypatch.setattr(device, "gpt_timing", lambda *a: {"parameters": 1, "error": "Boom: x"})
    section = device_check.run_section(device_check.device_measurements(
        torch.device("cpu"), [], lambda part: time.time() + 60)["gpt2"][0])
    assert section["passed"] is False and section["parameters"] == 1
    assert "RuntimeError: Boom: x" in section["error"]


def test_gpt2_small_has_its_size() -> None:
    model = device.build_gpt(device.GPT2_SMALL, torch.device("meta"))
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 124_439_808 and len(params) == 148
    assert model.head.weight is model.wte.weight  # tied, as GPT-2's


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"width": 100, "heads": 12}, "GptShape.width (100) must be a multiple of heads (12)"),
    ({"layers": 0}, "GptShape.layers must be an int >= 1"),
])
def test_bad_shape_is_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        dataclasses.replace(device.GPT_TINY, **kwargs)


def test_bad_plan_is_named() -> None:
    with pytest.raises(ValueError, match=re.escape("GptPlan.replay_interval must be an int >= 2")):
        dataclasses.replace(device.DRY_PLAN, replay_interval=3)  # does not divide the block
    with pytest.raises(ValueError, match=re.escape("GptPlan.rounds must be an int >= 2")):
        dataclasses.replace(device.DRY_PLAN, rounds=1)


def test_a_part_past_its_deadline_is_not_started() -> None:
    ran: list[int] = []
    section = device_check.run_section(lambda rec: ran.append(1), time.time() + 5, needs_s=60)
    assert ran == [] and section["passed"] is None
    assert section["cut"].startswith("not started:") and "needs about 60 s" in section["cut"]
    late = device_check.run_section(lambda rec: ran.append(1), time.time() - 1)
    assert late["cut"] == "not started: its deadline had passed"
    assert device_check.run_section(lambda rec: ran.append(1), time.time() + 60)["passed"]
    assert ran == [1]


def _checksum_rank_result(detections: list[list[object]], skipped: list[int],
                          fired: list[int]) -> dict[str, Any]:
    return {"clean": {"mlp/float32": {"detections": [], "skipped": []}},
            "faults": [{"fault": {"product": "forward"}, "fired": fired,
                        "detections": detections, "skipped": skipped}]}


def test_checksum_judge_names_what_went_wrong() -> None:
    problems = test_checksum.checksum_problems
    good = [_checksum_rank_result([["checksum", 5, [1]]], [5], []),
            _checksum_rank_result([["checksum", 5, [1]]], [5], [5, 5])]
    assert problems(good) == []
    missed = [_checksum_rank_result([], [], []), _checksum_rank_result([], [], [5])]
    assert len(problems(missed)) == 2
    wrong_rank = [_checksum_rank_result([["checksum", 5, [0]]], [5], []),
                  _checksum_rank_result([["checksum", 5, [0]]], [5], [5])]
    assert len(problems(wrong_rank)) == 2
    not_withheld = [_checksum_rank_result([["checksum", 5, [1]]], [], []),
                    _checksum_rank_result([["checksum", 5, [1]]], [5], [5])]
    assert problems(not_withheld) == [
        "rank 0: mlp {'product': 'forward'}: fired [5], detections [['checksum', 5, [1]]], "
        "skipped []"]
    false_positive = [good[0], dict(good[1], clean={"mlp/bfloat16": {
        "detections": [["checksum", 3, [1]]], "skipped": [3]}})]
    assert len(problems(false_positive)) == 1
    rounded = [good[0], dict(good[1], clean={"mlp/autocast": {  # sides cast down
        "detections": [], "skipped": [], "sides_error": 2.0 ** -9}})]
    assert len(problems(rounded)) == 1
    given_up = [dict(good[0], fused_checked={"cuda/forward/float32": False}), good[1]]
    assert problems(given_up) == [
        "rank 0: fused sides given up (failed or disagreed): ['cuda/forward/float32']"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])  # (the dry run: 1)
def test_guard_test_expects_what_each_world_size_reports(world: int) -> None:
    record: dict[str, Any] = {}
    test_guard.test_guarded_ddp_names_a_nan_and_withholds_its_step("cpu", world, record=record)
    assert record["world"] == world and len(record["ranks"]) == world


def test_kernel_test_fails_on_a_wrong_device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdc_guard import internal

    real = internal.replay_term_device
    monkeypatch.setattr(internal, "replay_term_device", lambda row: real(row) + 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the dry run: torch's threads crawl on shared cores
    try:
        section = device_check.run_section(
            lambda rec: test_kernels.test_scaling_and_replay_words_equal_the_cpu("cpu",
                                                                                 record=rec))
    finally:
        torch.set_num_threads(threads)
    assert not section["passed"]
    assert any("step-word term" in m for m in section["mismatches"])
    assert "step-word term" in section["failure"]  # the assertion's message, in the JSON


def test_a_section_that_raises_is_recorded_as_failed() -> None:
    def broken(rec: dict[str, Any]) -> None:
        rec["found"] = 1
        raise RuntimeError("no device")

    section = device_check.run_section(broken)
    assert section["passed"] is False and section["found"] == 1
    assert "RuntimeError: no device" in section["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert device_check.main(["--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "device_check.json").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--device", "gpu0"], "is not a torch device"),
    (["--device", "cpu", "--mib", "0"], "--mib takes tensor sizes"),
    (["--device", "cpu", "--budget-s", "0"], "--budget-s takes the run's seconds"),
])
def test_bad_arguments_are_named(args: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        device_check.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
