"""Properties and known answers for sdc_guard.fingerprint."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdc_guard import fingerprint, native_kernel
from sdc_guard.fingerprints import digest as D
from sdc_guard.fingerprints import public as P
from sdc_guard.fingerprints import weighted as W
from sdc_guard.fingerprints.words import to_signed64

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
M64 = (1 << 64) - 1
V2_ARANGE = 16803111230339968512
"""``fingerprint(torch.arange(10, dtype=torch.float32))`` in version 2, pinned."""
V2_LIST = 10822693613244055738
"""``fingerprint([arange(6, int64).view(2, 3), tensor([True, False])])`` in version 2."""


def _ref_weight(k: int, version: int) -> int:
    """Lane k's weight, written out as docs/fingerprint.md states it: ``2k + 1`` in version 1;
    ``2**8 (2k + 1) + 2**rho(k)`` in version 2, ``rho(k)`` 6 less the times 2 divides k + 1
    (at most 6)."""
    if version == 1:
        return 2 * k + 1
    twos, j = 0, k + 1
    while j % 2 == 0 and twos < 6:
        j //= 2
        twos += 1
    return 256 * (2 * k + 1) + (1 << (6 - twos))


def _ref_value(t: torch.Tensor, version: int = 2) -> int:
    """Pure-Python V over the tensor's bytes (module docstring), to cross-check the fast path."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    if t.element_size() == 8:
        words = [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]
        return sum((2 * i + 1) * (x ^ (x >> 32)) for i, x in enumerate(words)) & M64
    raw += b"\0" * (-len(raw) % 4)
    lanes = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]
    return sum(_ref_weight(k, version) * v for k, v in enumerate(lanes)) & M64


def _random_tensor(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(-(2**15), 2**15, (n * size // 2 + 1,), generator=g, dtype=torch.int16)
    return bits.view(torch.uint8)[: n * size].clone().view(INT_VIEW[size]).view(dtype)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 5, 1023, 1024, 1025, 5000, (1 << 16) + 3, 300_001])
def test_fast_path_matches_python_reference(n: int, dtype: torch.dtype, version: int) -> None:
    t = _random_tensor(dtype, n, seed=n)
    for native in (True, False):
        with native_kernel(native):
            got = int(P.tensor_value(t, version).item()) & M64
            assert got == _ref_value(t, version), native


def test_fast_path_matches_reference_with_tail_bytes() -> None:
    for n in (1, 3, 7, 9, 13, 257):
        t = _random_tensor(torch.uint8, n, seed=n)
        for version in (1, 2):
            for native in (True, False):
                with native_kernel(native):
                    assert int(P.tensor_value(t, version).item()) & M64 == _ref_value(t, version)
                    assert (P._native_fingerprint([t], False, None, version) is None
                            or fingerprint(t, version=version)
                            == fingerprint(t.clone(), version=version))


def test_large_chunked_path_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # Force several chunks (and a partial last chunk and a remainder row) on a small tensor.
    monkeypatch.setattr(W, "_CHUNK", 4 * 64)
    monkeypatch.setattr(W, "_ROW", 64)
    monkeypatch.setattr(W, "SMALL", 32)
    for dtype, n in ((torch.float32, 5 * 256 + 3 * 64 + 17), (torch.float64, 7 * 256 + 64 + 5),
                     (torch.float32, 4 * 256 + 64), (torch.float16, 2 * 256 + 1)):
        t = _random_tensor(dtype, n, seed=n)
        for version in (1, 2):
            with native_kernel(False):
                got = int(P.tensor_value(t, version).item()) & M64
            assert got == _ref_value(t, version), (dtype, n, version)


@pytest.mark.timeout(280)
@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="torch.compile on the CPU needs a C++ compiler")
def test_the_compiled_kernel_gives_the_reference_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused pass a CUDA device takes (``torch.compile`` of ``_fused_math``), compiled
    here by the CPU's inductor: each mode against the pure-Python reference, with a partial
    last lane, for the fingerprint and the digest."""
    monkeypatch.setattr(W, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(W, "FUSED_MIN", W.SMALL)
    monkeypatch.setattr(W._FUSED, "fns", {})
    monkeypatch.setattr(W._FUSED, "checked", {})
    with native_kernel(False):
        for dtype, n in ((torch.float32, 70_001), (torch.bfloat16, 140_003),
                         (torch.float64, 70_001), (torch.int64, 66_000),
                         (torch.float32, 20 * W._FUSED_ROW)):  # whole rows only
            t = _random_tensor(dtype, n, seed=n)
            for version in (1, 2):
                got = int(P.tensor_value(t, version).item()) & M64
                assert got == _ref_value(t, version), (dtype, n, version)
            assert int(D.digest_value(t).item()) & M64 == _ref_digest(t), (dtype, n)
    assert W._FUSED.checked == {("cpu", 0): True, ("cpu", 1): True, ("cpu", 6): True}


def test_a_kernel_that_fails_or_disagrees_is_given_up_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "FUSED_DEVICES", {"cpu"})
    monkeypatch.setattr(W, "FUSED_MIN", W.SMALL)
    monkeypatch.setattr(W._FUSED, "checked", {})
    t = _random_tensor(torch.float32, 70_001, seed=3)
    want = _ref_value(t, 1)

    def broken(flat: torch.Tensor, mode: int) -> torch.Tensor:
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(W._FUSED, "fns", {"cpu": broken})
    with native_kernel(False):
        with pytest.warns(RuntimeWarning, match="did not compile"):
            assert int(P.tensor_value(t, 1).item()) & M64 == want
        assert W._FUSED.checked[("cpu", 0)] is False
        assert int(P.tensor_value(t, 1).item()) & M64 == want  # not tried again: no warning
        monkeypatch.setattr(W._FUSED, "checked", {})
        monkeypatch.setattr(W._FUSED, "fns", {
            "cpu": lambda flat, mode: torch.zeros(2, dtype=torch.int64)})
        with pytest.warns(RuntimeWarning, match="another value"):
            assert int(P.tensor_value(t, 1).item()) & M64 == want
        assert W._FUSED.checked[("cpu", 0)] is False


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES), n=st.integers(1, 200), data=st.data())
def test_any_single_element_change_changes_fingerprint(dtype: torch.dtype, n: int,
                                                         data: st.DataObject) -> None:
    t = _random_tensor(dtype, n, seed=data.draw(st.integers(0, 2**31)))
    if dtype == torch.bool:
        t = t.view(torch.uint8).remainder(2).to(torch.bool)
    i = data.draw(st.integers(0, n - 1))
    size = t.element_size()
    u = t.clone()
    iv = u.view(INT_VIEW[size]) if dtype != torch.bool else u.view(torch.uint8)
    width = 1 if dtype == torch.bool else 8 * size
    bit = data.draw(st.integers(0, width - 1))
    mask = 1 << bit
    if width == 8 * size and bit == width - 1:
        mask = -(1 << bit)  # the sign bit as a signed integer of this width
    iv[i] ^= mask
    assert not torch.equal(t.view(torch.uint8), u.view(torch.uint8))
    version = data.draw(st.sampled_from([1, 2]))
    assert fingerprint(t, version=version) != fingerprint(u, version=version)


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from([torch.complex64, torch.complex128]), n=st.integers(1, 100),
       data=st.data())
def test_complex_tensors_are_read_as_documented(dtype: torch.dtype, n: int,
                                                 data: st.DataObject) -> None:
    # complex64 as 64-bit words (one an element), complex128 as 32-bit lanes (four an
    # element) (docs/fingerprint.md), alone or in a list; any single bit flip is seen.
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    t = torch.randn(n, dtype=dtype, generator=g)
    parts = torch.view_as_real(t)
    read_as = t.view(torch.int64) if dtype == torch.complex64 else parts.view(torch.int32)
    assert int(P.tensor_value(t).item()) & M64 == _ref_value(read_as)
    assert int(P.tensor_values([t, t[:1]], torch.device("cpu"))[0]) & M64 == _ref_value(read_as)
    u = t.clone()
    word = torch.view_as_real(u).view(INT_VIEW[parts.element_size()]).view(-1)
    word[data.draw(st.integers(0, 2 * n - 1))] ^= 1 << data.draw(st.integers(0, 8 * parts.element_size() - 2))
    assert fingerprint(t) != fingerprint(u)
    assert fingerprint([t]) != fingerprint([u])


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(st.tuples(st.sampled_from([*DTYPES, torch.complex64]),
                                st.sampled_from([0, 1, 2, 3, 7, 100, 4097, 16_385, 40_000])),
                      min_size=2, max_size=12),
       seed=st.integers(0, 2**31), view=st.booleans())
def test_small_tensors_batched_have_the_values_of_the_single_path(
        specs: list[tuple[torch.dtype, int]], seed: int, view: bool) -> None:
    # A list's tensors are valued together (sdc_guard.fingerprints.batched, with the C
    # kernel on or off): every value must equal the one-tensor path's and the pure-Python
    # reference, for complex, bool, empty and strided tensors.
    tensors = []
    for k, (dtype, n) in enumerate(specs):
        if dtype == torch.complex64:
            t = torch.view_as_complex(_random_tensor(torch.float32, 2 * n, seed=seed + k)
                                      .reshape(n, 2))
        else:
            t = _random_tensor(dtype, n, seed=seed + k)
        tensors.append(t[::2] if view and n > 2 else t)
    for version in (1, 2):
        got = [int(v) & M64 for v in P.tensor_values(tensors, torch.device("cpu"), version)]
        assert got == [int(P.tensor_value(t, version)) & M64 for t in tensors]
        # complex64 elements are 8 bytes: valued as 64-bit words, like int64
        assert got == [_ref_value(t.view(torch.int64) if t.is_complex() else t, version)
                       for t in tensors]


def _ref_digest(t: torch.Tensor, offset: int = 0) -> int:
    """Pure-Python digest of ``t`` at word ``offset`` (``sdc_guard.fingerprints.digest``):
    lane k weighs ``2**8 (2 (2 offset + k) + 1) + 2**rho(k)``, ``rho`` from the tensor's start."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 4)
    lanes = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]
    return sum((_ref_weight(k, 2) + 1024 * offset) * v for k, v in enumerate(lanes)) & M64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("n", [0, 1, 3, 5, 1023, 1025, (1 << 16) + 3, 300_001])
def test_digest_matches_python_reference(n: int, dtype: torch.dtype) -> None:
    t = _random_tensor(dtype, n, seed=n + 7)
    assert int(D.digest_value(t).item()) & M64 == _ref_digest(t)


def test_digest_chunked_path_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W, "_CHUNK", 4 * 64)
    monkeypatch.setattr(W, "_ROW", 64)
    monkeypatch.setattr(W, "SMALL", 32)
    for dtype, n in ((torch.float32, 5 * 256 + 3 * 64 + 17), (torch.float64, 7 * 256 + 5),
                     (torch.float16, 2 * 256 + 1)):
        t = _random_tensor(dtype, n, seed=n)
        assert int(D.digest_value(t).item()) & M64 == _ref_digest(t), (dtype, n)


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES[:-1]), n=st.integers(1, 3000), data=st.data())
def test_any_single_element_change_changes_the_digest(dtype: torch.dtype, n: int,
                                                       data: st.DataObject) -> None:
    # Any new value inside one lane, not only one flipped bit: every element of up to 4 bytes,
    # and one half of an 8-byte element (the guarantee the replay audit relies on).
    t = _random_tensor(dtype, n, seed=data.draw(st.integers(0, 2**31)))
    size = min(t.element_size(), 4)
    lanes = t.numel() * t.element_size() // size
    i = data.draw(st.integers(0, lanes - 1))
    new = data.draw(st.integers(-(2 ** (8 * size - 1)), 2 ** (8 * size - 1) - 1))
    iv = t.clone().view(INT_VIEW[size] if size > 1 else torch.int8)
    old = int(iv[i])
    if new == old:
        return
    iv[i] = new
    u = iv.view(dtype)
    assert int(D.digest_value(t)) != int(D.digest_value(u))
    offsets = torch.tensor([0, 2], dtype=torch.int64)
    assert int(D.concat_digest(torch.stack([D.digest_parts(torch.zeros(3)),
                                                D.digest_parts(t)]), offsets)) != int(
        D.concat_digest(torch.stack([D.digest_parts(torch.zeros(3)),
                                         D.digest_parts(u)]), offsets))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from(DTYPES[:-1]), st.integers(0, 2000)),
                      min_size=1, max_size=5), seed=st.integers(0, 2**31))
def test_concat_digest_is_the_digest_of_the_padded_concatenation(
        sizes: list[tuple[torch.dtype, int]], seed: int) -> None:
    # The replay audit relies on it: per-tensor parts, shifted to their word offsets, give
    # the digest of the tensors laid end to end (each zero-padded to whole words), on every
    # path: the parts, the multi-tensor pass and the C kernel.
    tensors = [_random_tensor(dtype, n, seed=seed + k) for k, (dtype, n) in enumerate(sizes)]
    offsets = [sum(D.word_count(u) for u in tensors[:k]) for k in range(len(tensors))]
    want = sum(_ref_digest(t, o) for t, o in zip(tensors, offsets, strict=True)) & M64
    parts = torch.stack([D.digest_parts(t) for t in tensors])
    assert int(D.concat_digest(parts, torch.tensor(offsets, dtype=torch.int64))) & M64 == want
    assert D.host_concat_digest(zip(tensors, offsets, strict=True)) in (want, None)
    with native_kernel(False):
        assert int(D.tensors_digest(tensors, offsets, torch.device("cpu"))) & M64 == want
    assert [int(p[1]) & M64 for p in parts] == [
        sum(int.from_bytes(bytes(t.reshape(-1).view(torch.uint8).tolist())[i:i + 4].ljust(4, b"\0"),
                           "little") for i in range(0, t.numel() * t.element_size(), 4)) & M64
        for t in tensors]


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES[:-1]), n=st.integers(2, 300), data=st.data())
def test_swapping_two_unequal_elements_changes_fingerprint(dtype: torch.dtype, n: int,
                                                            data: st.DataObject) -> None:
    t = _random_tensor(dtype, n, seed=data.draw(st.integers(0, 2**31)))
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda k: k != i))
    raw = t.view(INT_VIEW[t.element_size()])
    if raw[i] == raw[j]:
        return
    u = t.clone()
    u[i], u[j] = t[j], t[i]
    version = data.draw(st.sampled_from([1, 2]))
    assert fingerprint(t, version=version) != fingerprint(u, version=version)


@settings(max_examples=400, deadline=None)
@given(dtype=st.sampled_from([*DTYPES[:-1], torch.complex64, torch.complex128]),
       n=st.integers(1, 300), data=st.data())
def test_any_two_bit_flips_change_fingerprint(dtype: torch.dtype, n: int,
                                              data: st.DataObject) -> None:
    # Two flipped bits anywhere in one tensor, on both paths (the proof in
    # sdc_guard/fingerprints/public.py): near each other (one element, a neighbour, the
    # same bit of two elements) as often as far apart.
    seed = data.draw(st.integers(0, 2**31))
    t = (_random_tensor(dtype.to_real(), 2 * n, seed).view(dtype) if dtype.is_complex
         else _random_tensor(dtype, n, seed))
    nbits = 8 * t.numel() * t.element_size()
    first = data.draw(st.integers(0, nbits - 1))
    near = st.integers(max(0, first - 128), min(nbits - 1, first + 128))
    same_bit = st.sampled_from(range(first % (8 * t.element_size()), nbits,
                                     8 * t.element_size()))
    second = data.draw(st.one_of(st.integers(0, nbits - 1), near, same_bit)
                       .filter(lambda b: b != first))
    raw = t.reshape(-1).view(torch.uint8).clone()
    for b in (first, second):
        raw[b // 8] ^= 1 << (b % 8)
    u = raw.view(dtype)
    version = data.draw(st.sampled_from([1, 2]))
    for native in (True, False):
        with native_kernel(native):
            assert fingerprint(t, version=version) != fingerprint(u, version=version), (
                first, second)
            assert fingerprint([t, t], version=version) != fingerprint([t, u], version=version)


def test_the_documented_cancelling_burst_of_version_1() -> None:
    # What version 1 does not see (docs/fingerprint.md): flips whose weighted changes cancel.
    # The same bit of 4 adjacent float32 lanes that held 0, 1, 1, 0 there changes V by
    # 2**31 ((2k+1) - (2k+3) - (2k+5) + (2k+7)) = 0, wherever the burst starts; held
    # 0, 0, 1, 1 (any other pattern) it is seen. Version 2 sees both.
    for k in range(0, 5):
        x = torch.ones(12)
        x[k + 1:k + 3] = -1.0  # signs +, -, -, + at k .. k+3
        y = x.clone()
        y.view(torch.int32)[k:k + 4] ^= -(1 << 31)
        assert torch.equal(y[k:k + 4], -x[k:k + 4]) and y.sum() == x.sum()
        for native in (True, False):
            with native_kernel(native):
                assert fingerprint(y, version=1) == fingerprint(x, version=1)
                assert fingerprint(y) != fingerprint(x)
        x[k + 1], x[k + 3] = x[k + 3].item(), x[k + 1].item()  # signs +, +, -, -
        y = x.clone()
        y[k:k + 4] = -x[k:k + 4]
        assert fingerprint(y, version=1) != fingerprint(x, version=1)
    # three bits: bit 4 of lane 0 down and its bit 6 up (+3 * 2**4), bit 4 of lane 1 down
    lanes = torch.tensor([0x10, 0x10, 7], dtype=torch.int32)
    changed = torch.tensor([0x40, 0x00, 7], dtype=torch.int32)
    assert fingerprint(lanes, version=1) == fingerprint(changed, version=1)


def _weights_of(n: int, version: int) -> list[int]:
    """Each lane's weight as the implementation has it: V of a tensor with 1 in that lane
    (V is linear), read on the C kernel's path and on the torch path, which must agree."""
    out = []
    for native in (True, False):
        with native_kernel(native):
            eye = torch.eye(n, dtype=torch.int32)
            out.append([int(P.tensor_value(eye[k], version)) & M64
                        - (int(P.tensor_value(torch.zeros(n, dtype=torch.int32), version)) & M64)
                        for k in range(n)])
    assert out[0] == out[1]
    return out[0]


def test_version_2_weighs_each_lane_as_documented() -> None:
    assert _weights_of(200, 2) == [_ref_weight(k, 2) for k in range(200)]
    assert _weights_of(70, 1) == [2 * k + 1 for k in range(70)]


def test_no_burst_of_up_to_64_lanes_at_one_bit_cancels_in_version_2() -> None:
    # The proof (sdc_guard/fingerprints/public.py): a burst flips bit b of each of up to 64
    # adjacent lanes, each up or down: dV = 2**b sum_k s_k w_k. The weights' powers of 2
    # (rho) have a single smallest in every window of 64 lanes or fewer, so the sum has that
    # power of 2 exactly and is not 0 modulo 2**(64 - b). Checked here: (1) the single
    # smallest, for every window up to 64 lanes from every phase; (2) every sign pattern of
    # every window up to 12 lanes, from 128 starts and near 2**20, against 2**33 (bit 31, the
    # hardest); (3) on tensors, below.
    def rho(k: int) -> int:
        return (_ref_weight(k, 2) & -_ref_weight(k, 2)).bit_length() - 1

    for start in range(128):
        for length in range(1, 65):
            window = [rho(k) for k in range(start, start + length)]
            assert window.count(min(window)) == 1, (start, length)
    for base in (0, 64, (1 << 20) - 40):
        w = torch.tensor([_ref_weight(k, 2) for k in range(base, base + 140)], dtype=torch.int64)
        for length in range(1, 13):
            signs = torch.tensor([[1 if p >> i & 1 else -1 for i in range(length)]
                                  for p in range(1 << length)], dtype=torch.int64)
            windows = w.unfold(0, length, 1)  # [starts, length]
            sums = (signs[:, None, :] * windows[None]).sum(-1)
            assert not bool(((sums & ((1 << 33) - 1)) == 0).any()), (base, length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_burst_at_one_bit_changes_version_2_on_small_tensors(dtype: torch.dtype) -> None:
    # Exhaustively on a tensor, for the fingerprint and the replay digest: every offset, every
    # bit of the element, bursts of 2 to 5 elements and every pattern of up/down flips (the
    # bit's value in each element before the flip), on the C kernel's path; the torch path
    # gives the same values on a sample of them. Version 1 misses some of the same float32
    # bursts.
    n, width = 10, 8 * torch.empty((), dtype=dtype).element_size()
    ints = INT_VIEW[width // 8]
    base = _random_tensor(dtype, n, seed=7).view(ints).tolist()
    top = 1 << width
    missed_v1 = 0
    sample: list[torch.Tensor] = []
    rng = random.Random(1)
    for length in range(2, 6):
        for at in range(n - length + 1):
            for bit in range(width):
                one = 1 << bit
                for pattern in range(1 << length):
                    vals = [v % top for v in base]  # unsigned words
                    for i in range(length):  # the bit's value before the flip
                        vals[at + i] = (vals[at + i] | one if pattern >> i & 1
                                        else vals[at + i] & ~one)
                    flipped = [v ^ one if at <= k < at + length else v
                               for k, v in enumerate(vals)]
                    x, y = (torch.tensor([v - top if v >= top // 2 and ints.is_signed else v
                                          for v in w], dtype=ints).view(dtype)
                            for w in (vals, flipped))
                    assert int((x.view(ints) != y.view(ints)).sum()) == length
                    assert fingerprint(x) != fingerprint(y), (length, at, bit, pattern)
                    assert D.host_concat_digest([(x, 0)]) != D.host_concat_digest([(y, 0)]), (
                        length, at, bit, pattern)
                    if length == 4 and bit < 4:
                        missed_v1 += fingerprint(x, version=1) == fingerprint(y, version=1)
                    if rng.random() < 0.01:
                        sample += [x, y]
    assert missed_v1 > 0 or dtype != torch.float32  # the cancelling patterns v2 removes
    native = [fingerprint(t) for t in sample]
    digests = [D.host_concat_digest([(t, 0)]) for t in sample]
    with native_kernel(False):
        assert [fingerprint(t) for t in sample] == native
        assert [int(D.digest_value(t)) & M64 for t in sample] == digests


def test_a_three_bit_pattern_that_cancels_in_version_2() -> None:
    # Version 2 is linear in the lanes too: changes whose weighted sum is 0 modulo 2**64
    # still escape it (docs/fingerprint.md), e.g. lane 1 (weight 3 * 2**8 + 2**5 = 800) up
    # by 800 and lane 0 (weight 2**8 + 2**6 = 320) down by 2000: 800 * 800 = 2000 * 320, a
    # change of 0, made of many flipped bits.
    x = torch.tensor([5000, 17, 9], dtype=torch.int32)
    y = torch.tensor([3000, 17 + 800, 9], dtype=torch.int32)
    assert fingerprint(x) == fingerprint(y)
    assert fingerprint(x, version=1) != fingerprint(y, version=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sign_only_swaps_that_defeat_a_plain_weighted_sum(dtype: torch.dtype) -> None:
    # Words that differ only in their top bits: a single odd-weighted sum over raw
    # 64-bit words misses these swaps (2(a-b) * 2**63 == 0 modulo 2**64).
    for pair in ((1.0, -1.0), (0.0, -0.0)):
        for n in (4, 8, 64, 1024):
            for i, j in {(1, 3), (3, n - 1), (n // 2 - 1, n - 1)} - {(3, 3)}:
                t = torch.ones(n, dtype=dtype)
                t[i], t[j] = pair
                u = t.clone()
                u[i], u[j] = t[j], t[i]
                assert fingerprint(t) != fingerprint(u), (pair, n, i, j)


def test_64bit_single_change_that_a_linear_lane_mix_would_miss() -> None:
    # S1 + K*S2 over words and high halves is not injective on 64-bit words: this
    # change made the bracket exactly 2**64 (found while reviewing the first design).
    a = torch.tensor([0x80000000_53FD0A0B - 2**64], dtype=torch.int64)
    b = torch.tensor([0x3C6B1E1F_00000000], dtype=torch.int64)
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a.view(torch.float64)) != fingerprint(b.view(torch.float64))


def test_exact_bits_count() -> None:
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))
    a = torch.tensor([float("nan")])
    b = a.clone()
    b.view(torch.int32)[0] ^= 1  # another NaN payload
    assert torch.isnan(b).all()
    assert fingerprint(a) != fingerprint(b)


def test_shape_length_dtype_and_list_order_count() -> None:
    assert fingerprint(torch.zeros(4)) != fingerprint(torch.zeros(5))
    assert fingerprint(torch.zeros(2, 3)) != fingerprint(torch.zeros(3, 2))
    assert fingerprint(torch.zeros(4, dtype=torch.int32)) != fingerprint(torch.zeros(4))
    a, b = torch.arange(3.0), torch.arange(4.0)
    assert fingerprint([a, b]) != fingerprint([b, a])
    assert fingerprint([a]) != fingerprint(a)
    assert fingerprint([a, b]) == fingerprint((a, b))


def test_views_equal_their_contiguous_copies() -> None:
    x = torch.randn(100, 33)
    assert fingerprint(x.t()) == fingerprint(x.t().contiguous())
    assert fingerprint(x[:, 3]) == fingerprint(x[:, 3].clone())
    assert fingerprint(x[1:, 1:]) == fingerprint(x[1:, 1:].clone())
    assert fingerprint(x.view(-1)[3:]) == fingerprint(x.view(-1)[3:].clone())
    # lazy conjugate and negative views: the values they show, not the memory under them, on
    # the C kernel's path and on the torch path
    # (seeded: for about 3% of random 6-element z the fingerprints of z and its conjugate
    # agree, which this test of lazy views does not ask about)
    z = torch.randn(6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    neg = torch._neg_view(x)
    for native in (True, False):
        with native_kernel(native):
            assert fingerprint(z.conj()) == fingerprint(z.conj().resolve_conj()) != fingerprint(z)
            assert fingerprint([x, z.conj()]) == fingerprint([x, z.conj().resolve_conj()])
            assert fingerprint(neg) == fingerprint(-x) != fingerprint(x)
    # 0 or 1 elements at a stride: "contiguous" to torch, yet no byte view of them exists
    for view in (x.view(-1)[1::2][:1], x.view(-1)[1::2][:0], x[:, 3][:1]):
        assert fingerprint(view) == fingerprint(view.clone(memory_format=torch.contiguous_format))
        assert fingerprint([view, x]) == fingerprint([view.clone(), x])


def test_empty_bool_and_every_dtype_in_range() -> None:
    for dtype in DTYPES:
        for shape in ((0,), (3,), (2, 5), (0, 4)):
            v = fingerprint(torch.zeros(shape, dtype=dtype))
            assert 0 <= v < 2**64
    assert fingerprint(torch.empty(0)) != fingerprint(torch.empty(0, 1))


def test_known_answers_are_stable() -> None:
    # Pinned values: a change here breaks fingerprints stored by earlier releases (version 1:
    # the values every release before version 2 stored; version 2: the current one).
    t = [torch.arange(6, dtype=torch.int64).view(2, 3), torch.tensor([True, False])]
    for native in (True, False):
        with native_kernel(native):
            assert fingerprint(torch.arange(10, dtype=torch.float32),
                               version=1) == 14293593760334939079
            assert fingerprint(t, version=1) == 2525836643581307108
            assert fingerprint(torch.arange(10, dtype=torch.float32)) == V2_ARANGE
            assert fingerprint(t) == V2_LIST


def test_same_value_in_a_fresh_process() -> None:
    code = ("import torch, sdc_guard; "
            "print(sdc_guard.fingerprint(torch.linspace(-3, 3, 1001, dtype=torch.float64)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = fingerprint(torch.linspace(-3, 3, 1001, dtype=torch.float64))
    assert int(out.stdout.strip()) == here


@pytest.mark.skipif(not hasattr(torch, "hash_tensor"),
                    reason="this torch has no torch.hash_tensor to compare with")
def test_order_and_cancellation_that_blind_torch_hash_tensor() -> None:
    def h(t: torch.Tensor) -> int:
        return int(torch.hash_tensor(t).view(torch.int64).item())

    x = torch.arange(10, dtype=torch.float32)
    assert h(x) == h(x.flip(0))  # XOR: order-blind
    assert fingerprint(x) != fingerprint(x.flip(0))
    y = x.clone()
    y.view(torch.int32)[2] ^= 1 << 4
    y.view(torch.int32)[6] ^= 1 << 4  # the same flip twice cancels in an XOR reduction
    assert h(x) == h(y)
    assert fingerprint(x) != fingerprint(y)


def test_bad_input_is_named() -> None:
    with pytest.raises(TypeError, match="item 1 is a int"):
        fingerprint([torch.zeros(2), 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not supported"):
        fingerprint(torch.zeros(2, dtype=torch.float8_e4m3fnuz))
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(TypeError, match=r"item 1 is a torch.sparse_coo tensor.*to_dense"):
        fingerprint([torch.zeros(2), sparse])
    assert fingerprint(sparse.to_dense()) == fingerprint(torch.eye(3))
    with pytest.raises(ValueError, match="item 0 is on the meta device"):
        P.fingerprint_tensor(torch.empty(3, device="meta"))


def test_loss_word_sees_every_bit_of_every_micro_batch_loss() -> None:
    losses = [torch.tensor(2.5), torch.tensor(0.125), torch.tensor(-1.0)]
    base = int(D.loss_word(losses))
    for i in range(3):
        for bit in (0, 22, 31):
            changed = [loss.clone() for loss in losses]
            changed[i].view(torch.int32).bitwise_xor_(-(1 << 31) if bit == 31 else 1 << bit)
            assert int(D.loss_word(changed)) != base, (i, bit)
    assert int(D.loss_word(losses[::-1])) != base


@settings(max_examples=80, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16,
                              torch.int32, torch.int8]),
       n=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_loss_word_on_the_host_equals_the_tensor_path(dtype: torch.dtype, n: int,
                                                      seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    losses = list(raw.view(dtype))  # any bits: NaN payloads, negative zeros, ...
    host = int(D.loss_word(losses))
    assert host == int(D.device_loss_word(losses))
    signed = [int(v) for v in raw.view(W.INT_OF_SIZE[size])]
    assert host == to_signed64(sum((2 * k + 1) * v for k, v in enumerate(signed)))


def test_digest_helpers_name_bad_input() -> None:
    with pytest.raises(TypeError, match=r"digest_parts: expected a torch\.Tensor"):
        D.digest_parts([1, 2])  # type: ignore[arg-type]
    parts = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="offsets int64 \\[n\\]"):
        D.concat_digest(parts, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="parts must be int64"):
        D.concat_digest(parts.float(), torch.zeros(3, dtype=torch.int64))
