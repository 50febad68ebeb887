"""The optional fused CPU kernel computes exactly what the torch path computes."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

import sdc_guard._native as native_mod
import sdc_guard.fingerprints as fpmod
from sdc_guard import fingerprint

from .test_fingerprint import DTYPES, _random_tensor


@pytest.fixture
def native() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = fpmod.enable_native()
    if not available:
        pytest.skip("sdc_guard._native could not be built here (the torch path is used): "
                    + "; ".join(str(w.message) for w in caught))
    try:
        yield
    finally:
        fpmod.disable_native()


@pytest.mark.parametrize("n", [fpmod._SMALL + 1, 65_537 * 3, 300_001, (1 << 20) + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
def test_native_values_equal_the_torch_path(native: None, n: int, dtype: torch.dtype) -> None:
    t = _random_tensor(dtype, n, seed=n)
    with_native = (int(fpmod._tensor_value(t)), fpmod.digest_parts(t).tolist(), fingerprint(t))
    fpmod.disable_native()
    assert with_native == (int(fpmod._tensor_value(t)), fpmod.digest_parts(t).tolist(),
                           fingerprint(t))


def test_native_fingerprints_of_every_dtype_and_views(native: None) -> None:
    cases = [_random_tensor(d, 70_001, seed=3) for d in DTYPES[:-1]]
    base = torch.randn(600, 700)
    cases += [base.t(), base[::3, 5:], torch.zeros(1 << 17)]
    got = [fingerprint(t) for t in cases]
    fpmod.disable_native()
    assert got == [fingerprint(t) for t in cases]


def test_native_uses_torch_threads(native: None) -> None:
    t = torch.randn((1 << 20) + 5)
    threads = torch.get_num_threads()
    try:
        values = set()
        for k in (1, 2):
            torch.set_num_threads(k)
            values.add(fingerprint(t))
    finally:
        torch.set_num_threads(threads)
    assert len(values) == 1


def test_a_failed_build_falls_back_to_torch_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_mod, "_SOURCE", native_mod._SOURCE + "\n#error broken on purpose\n")
    monkeypatch.setattr(native_mod, "_tried", False)
    monkeypatch.setattr(native_mod, "_module", None)
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert fpmod.enable_native() is False
    assert native_mod.load() is None  # tried once: no second build, no second warning
    t = torch.randn(100_000)
    assert fingerprint(t) == fingerprint(t.clone())
    fpmod.disable_native()
