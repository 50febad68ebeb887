"""The prepared device run on the CPU: the device tests (tests/cuda) and the timings through
``python -m bench.device_check --device cpu``, each test's judgement, and a clear refusal
without CUDA."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import device_check
from tests.cuda import test_checksum, test_guard, test_kernels


@pytest.mark.timeout(600)  # about 90 s alone; 300 s beside other work on two cores
def test_dry_run_on_cpu_passes_and_writes_json(tmp_path: Path) -> None:
    assert device_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["values"]["passed"] and report["values"]["mismatches"] == []
    assert report["values"]["result_stays_on_device"]
    assert report["rng_stream"]["passed"] and report["rng_stream"]["state_restored"]
    assert report["kernels"]["passed"] and report["kernels"]["fused_unscale_kernel_used"]
    assert report["kernels"]["fused_unscale_kernel"] == {  # float32 takes the C kernel
        "float32": None, "float16": True, "bfloat16": True}
    guard = report["gloo_guard"]  # the guarded steps, with gloo in place of nccl
    assert guard["passed"] and guard["world"] == 3
    for rank in guard["ranks"]:
        # The replay's in the step's own report, the non-finite one from flush().
        assert rank["detections"] == [["replay", 6, [2]], ["nonfinite", 6, [2]]]
        assert rank["skipped"] == [6]
    checksum = report["checksum"]  # the checksum check's torch path, as a GPU runs it
    assert checksum["passed"] and checksum["problems"] == [], checksum
    assert checksum["clean_runs"] == len(test_checksum.CHECKSUM_RUNS) + len(
        test_checksum.CHECKSUM_FUSED_RUNS)
    assert set(checksum["fused_checked"].values()) == {True}  # every fused form agreed
    assert {"cpu/forward/float32", "cpu/gx+gw/float32", "cpu/weight/float32"} <= set(
        checksum["fused_checked"])
    assert 0 < checksum["autocast_sides_error"] < test_checksum.AUTOCAST_SIDES  # float32 sides
    assert checksum["faults"] == 3 * len(test_checksum.CHECKSUM_FAULTS)  # plain, hooked, fused
    timing = report["checksum_timing"]  # the bench's part: step times, into the checksum record
    assert timing["passed"] and timing["world"] == 3 and timing["fused_warnings"] == []
    assert all(t["step_ms_off"] > 0 and t["step_ms_fused"] > 0 and t["step_ms_plain"] > 0
               for t in checksum["timing"].values())
    md = (tmp_path / "DEVICE.md").read_text()
    assert "| checksum | yes |" in md and "| gloo_guard | yes |" in md
    assert "| reference MLP (512-1024-1024-10), batch 128 |" in md


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
@pytest.mark.parametrize("world", [1, 2])
def test_guard_test_expects_what_each_world_size_reports(world: int) -> None:
    record: dict[str, Any] = {}
    test_guard.test_guarded_ddp_names_a_nan_and_withholds_its_step("cpu", world, record=record)
    assert record["world"] == world and len(record["ranks"]) == world


def test_kernel_test_fails_on_a_wrong_device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from sdc_guard import internal

    real = internal.replay_term_device
    monkeypatch.setattr(internal, "replay_term_device", lambda row: real(row) + 1)
    section = device_check.run_section(
        lambda rec: test_kernels.test_scaling_and_replay_words_equal_the_cpu("cpu", record=rec))
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
])
def test_bad_arguments_are_named(args: list[str], message: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        device_check.main(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
