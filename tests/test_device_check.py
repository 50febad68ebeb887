"""The prepared device run: its value checks on the CPU, and a clear refusal without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scenarios import device_check


def test_value_checks_pass_on_cpu_and_write_json(tmp_path: Path) -> None:
    assert device_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["values"]["passed"] and report["values"]["mismatches"] == []
    assert report["rng_stream"]["passed"]


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
