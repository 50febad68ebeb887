"""A GPU telemetry snapshot for the evidence of a detection, through NVML.

The suspect rank takes it itself, at detection time, of its own device: ECC error counts,
retired pages and remapped rows, the pending-retirement and XID-relevant states, temperature,
clocks, power and throttle reasons. An operator deciding whether a cordoned node goes back into
service reads these first (an uncorrectable ECC count or a pending row remap settles it; a
clean device with a replay mismatch points to a marginal core that NVML cannot see).

NVML comes from ``nvidia-ml-py`` (extra ``nvml``). Without a GPU, without the package or
when NVML fails, the snapshot says so (``available: False`` and the reason); it never raises.
Each field NVML refuses on this device (older GPUs lack row remapping, for example) is
recorded as ``None`` with the reason under ``errors``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch


def gpu_snapshot(device: torch.device | None = None) -> dict[str, Any]:
    """NVML readings of ``device`` (a CUDA device), or why there are none. Never raises."""
    out: dict[str, Any] = {"time": time.time()}
    if device is None or device.type != "cuda":
        return {**out, "available": False,
                "reason": f"no GPU: the rank computes on {device.type if device else 'cpu'}"}
    try:
        import pynvml
    except ImportError:
        return {**out, "available": False,
                "reason": "nvidia-ml-py is not installed (pip install 'sdc-guard[nvml]')"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError and driver-missing errors alike
        return {**out, "available": False, "reason": f"nvmlInit failed: {e}"}
    try:
        return {**out, **_read(pynvml, _nvml_index(device))}
    except Exception as e:
        return {**out, "available": False, "reason": f"NVML: {e}"}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _nvml_index(device: torch.device) -> int:
    """NVML numbers devices by PCI order; CUDA may not (CUDA_VISIBLE_DEVICES): the device is
    looked up by its PCI bus id, else by its UUID; a torch that gives neither: CUDA's index."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    import pynvml

    bus = pci_bus_id(props)
    if bus is not None:
        with contextlib.suppress(pynvml.NVMLError):
            return int(pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(bus)))
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return int(pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")))
    return int(index)


def pci_bus_id(props: Any) -> str | None:
    """NVML's bus id string ("00000000:1B:00.0", domain:bus:device.function) of a device from
    torch's properties, which give the three numbers apart (``pci_domain_id``,
    ``pci_bus_id``, ``pci_device_id``); None where this torch lacks them."""
    parts = [getattr(props, f"pci_{name}_id", None) for name in ("domain", "bus", "device")]
    if not all(isinstance(v, int) for v in parts):
        return None
    domain, bus, dev = parts
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def _read(nv: Any, index: int) -> dict[str, Any]:
    h = nv.nvmlDeviceGetHandleByIndex(index)
    errors: dict[str, str] = {}

    def field(name: str, fn: Callable[[], Any]) -> Any:
        try:
            v = fn()
        except Exception as e:
            errors[name] = str(e)
            return None
        return v.decode() if isinstance(v, bytes) else v

    def ecc_count(etype: int, counter: int) -> Callable[[], Any]:
        return lambda: nv.nvmlDeviceGetTotalEccErrors(h, etype, counter)

    ecc = {}
    for label, counter in (("volatile", nv.NVML_VOLATILE_ECC), ("aggregate", nv.NVML_AGGREGATE_ECC)):
        for kind, etype in (("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                            ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            ecc[f"{label}_{kind}"] = field(f"ecc_{label}_{kind}", ecc_count(etype, counter))

    def remapped() -> dict[str, Any]:
        corr, unc, pending, failure = nv.nvmlDeviceGetRemappedRows(h)
        return {"correctable": corr, "uncorrectable": unc, "pending": bool(pending),
                "failure": bool(failure)}

    def retired() -> dict[str, Any]:
        return {
            "single_bit": len(nv.nvmlDeviceGetRetiredPages(
                h, nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)),
            "double_bit": len(nv.nvmlDeviceGetRetiredPages(
                h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERRORS)),
            "pending": bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(h)),
        }

    snap = {
        "available": True,
        "index": index,
        "name": field("name", lambda: nv.nvmlDeviceGetName(h)),
        "uuid": field("uuid", lambda: nv.nvmlDeviceGetUUID(h)),
        "serial": field("serial", lambda: nv.nvmlDeviceGetSerial(h)),
        "pci_bus_id": field("pci_bus_id", lambda: nv.nvmlDeviceGetPciInfo(h).busId),
        "driver": field("driver", lambda: nv.nvmlSystemGetDriverVersion()),
        "ecc_mode": field("ecc_mode", lambda: list(nv.nvmlDeviceGetEccMode(h))),
        "ecc_errors": ecc,
        "remapped_rows": field("remapped_rows", remapped),
        "retired_pages": field("retired_pages", retired),
        "temperature_c": field("temperature_c",
                               lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        "sm_clock_mhz": field("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
        "mem_clock_mhz": field("mem_clock_mhz",
                               lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
        "power_w": field("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
        "throttle_reasons": field("throttle_reasons",
                                  lambda: int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))),
        "performance_state": field("performance_state", lambda: nv.nvmlDeviceGetPerformanceState(h)),
    }
    snap["errors"] = errors
    return snap
