"""The suspect rank's NVML snapshot (``sdc_guard.telemetry``) on a real GPU."""

from __future__ import annotations

from typing import Any

from sdc_guard.telemetry import gpu_snapshot
from tests.cuda.support import fill, on

HEALTH_FIELDS = ("ecc_errors", "remapped_rows", "retired_pages", "temperature_c",
                 "sm_clock_mhz", "power_w")


def test_nvml_snapshot_reads_the_health_fields(device: str = "cuda",
                                               record: dict[str, Any] | None = None) -> None:
    """Available, with some of the ECC, row-remapping, clock and power fields read (or the
    reason NVML refused: ``pip install '.[nvml]'``)."""
    out = fill(record)
    snap = gpu_snapshot(on(device))
    read = [k for k in HEALTH_FIELDS if snap.get(k) is not None]
    out.update(fields_read=read, snapshot=snap)
    assert snap.get("available"), f"no NVML snapshot: {snap.get('reason')}"
    assert read, f"NVML read none of {HEALTH_FIELDS}: {snap.get('errors')}"
