"""What the device tests share: the device a test runs on, its record, and switches of the
library's device paths. The switches reach into private modules (a test may; ``bench/`` may
not: it times through ``sdc_guard.internal``) and restore what they change."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def on(device: str) -> torch.device:
    """``device`` as a torch device; plain ``"cuda"`` is the current GPU (what tensors there
    report as their device)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def fill(record: dict[str, Any] | None) -> dict[str, Any]:
    """The dict a test writes what it found into: the caller's ``record``, or a new one."""
    return {} if record is None else record


@contextlib.contextmanager
def fingerprint_path(path: str) -> Iterator[None]:
    """The weighted sums under the fingerprint and the digest on one path while the block runs:
    ``"compiled"`` (the fused kernel, on the device types that have one, from ``SMALL`` values
    up where it would take ``FUSED_MIN``) or ``"torch"`` (torch ops only)."""
    from sdc_guard.fingerprints import weighted

    kept = (set(weighted.FUSED_DEVICES), weighted.FUSED_MIN)
    if path == "torch":
        weighted.FUSED_DEVICES.clear()
    elif path == "compiled":
        weighted.FUSED_MIN = weighted.SMALL + 1
    else:
        raise ValueError(f"fingerprint_path: path is 'compiled' or 'torch', got {path!r}.")
    try:
        yield
    finally:
        weighted.FUSED_DEVICES.update(kept[0])
        weighted.FUSED_MIN = kept[1]


@contextlib.contextmanager
def fused_sides(device: torch.device) -> Iterator[None]:
    """The checksum's sides by their fused expressions (``sdc_guard.checks.sides``) on
    ``device`` while the block runs: compiled on a GPU; run as written on the CPU (compiling
    them there takes tens of seconds a process; ``test_checksum_sides`` compiles them once)."""
    from sdc_guard.checks import sides

    if device.type == "cpu":
        sides._FUSED.fns.setdefault("forward", sides._forward_math)
        sides._FUSED.fns.setdefault("weight", sides._weight_math)
        for name, form in sides.GY_FORMS.items():
            sides._FUSED.fns.setdefault(name, form)
    was = set(sides.FUSED_DEVICES)
    sides.FUSED_DEVICES.add(device.type)
    try:
        yield
    finally:
        sides.FUSED_DEVICES.intersection_update(was)


def fused_checked() -> dict[str, bool]:
    """Each fused side tried in this process, by device type/name/dtype: did its first
    compiled result agree with the eager form?"""
    from sdc_guard.checks import sides

    return {"/".join(key): ok for key, ok in sides._FUSED.checked.items()}


def sides_error(guard: Any) -> list[float]:
    """Watch the guard's checksum check: the largest error of a forward identity's right-hand
    side (``X (W^T e) + sum b``, which the check computes) against float64, as a fraction of
    ``|X| (|W|^T e) + sum |b|``, kept in the list returned, as steps run."""
    from sdc_guard.checks.checksum import ChecksumCheck

    check = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
    inputs: dict[torch.nn.Module, torch.Tensor] = {}
    for layer in check.layers:
        layer.module.register_forward_pre_hook(
            lambda mod, args: inputs.__setitem__(mod, args[0].detach()))
    record = check._record
    worst = [0.0]

    def spy(layer: Any, product: str, micro: int, lhs: torch.Tensor, rhs: torch.Tensor,
            bound: torch.Tensor) -> None:
        if product == "forward":
            m, x = layer.module, inputs[layer.module]
            x = x.reshape(-1, x.shape[-1]).double()
            w = m.weight.detach().double()
            b = (m.bias.detach().double() if m.bias is not None
                 else torch.zeros((), dtype=torch.float64, device=w.device))
            want = x @ w.sum(0) + b.sum()
            mag = (x.abs() @ w.abs().sum(0) + b.abs().sum()).clamp_min(1e-300)
            worst[0] = max(worst[0], float(((rhs.double() - want).abs() / mag).max()))
        record(layer, product, micro, lhs, rhs, bound)

    check._record = spy  # type: ignore[method-assign,assignment]
    return worst
