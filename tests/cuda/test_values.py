"""Fingerprints and the replay's word digest on the device equal the CPU's, on each of the
device's paths, and the fingerprint stays on the device."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from sdc_guard import fingerprint, fingerprint_tensor, internal
from tests.cuda.support import fill, fingerprint_path, on

CASE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
               torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


def cases(g: torch.Generator) -> list[torch.Tensor]:
    """Every dtype at odd sizes (empty, below and above ``SMALL``), two non-contiguous views
    and an empty matrix."""
    out: list[torch.Tensor] = []
    for dtype in CASE_DTYPES:
        for n in (0, 1, 7, 1023, 65_537, 300_001):
            raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),),
                                generator=g, dtype=torch.uint8)
            t = raw.view(dtype) if dtype != torch.bool else raw.remainder(2).to(torch.bool)
            out.append(t)
    base = torch.randn(64, 48, generator=g)
    out += [base.t(), base[::3, 5:], torch.empty(0, 3)]
    return out


def test_fingerprint_and_digest_equal_the_cpu(device: str = "cuda",
                                              record: dict[str, Any] | None = None) -> None:
    """Every case on the compiled pass (where the device has one) and on the torch ops, and a
    tensor larger than one device chunk."""
    dev, out = on(device), fill(record)
    g = torch.Generator().manual_seed(0)
    mismatches = []
    for path, (i, t) in itertools.product(("compiled", "torch"), enumerate(cases(g))):
        d = t.to(dev)
        with fingerprint_path(path):
            if fingerprint(t) != fingerprint(d):
                mismatches.append(f"fingerprint case {i} {t.dtype} {tuple(t.shape)}, {path}")
            if int(internal.digest_value(t)) != int(internal.digest_value(d)):
                mismatches.append(f"digest case {i} {t.dtype} {tuple(t.shape)}, {path}")
    big = torch.randn(internal.DEVICE_CHUNK + 12_345, generator=g)
    for path in ("compiled", "torch"):
        with fingerprint_path(path):
            if fingerprint(big) != fingerprint(big.to(dev)):
                mismatches.append(f"fingerprint of a tensor larger than one device chunk, {path}")
    stays = fingerprint_tensor(big.to(dev)).device == dev
    out.update(mismatches=mismatches, result_stays_on_device=stays)
    assert not mismatches, mismatches[:20]
    assert stays, f"fingerprint_tensor of a tensor on {dev} came back elsewhere"
