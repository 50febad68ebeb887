"""64-bit, order-sensitive fingerprints of a tensor's exact bits, computed on its device.

How it works
------------
The tensor's bytes are read as little 64-bit words ``X_0 .. X_{m-1}`` (the last
partial word zero-padded), and two position-weighted sums are taken, wrapping
modulo 2**64::

    S1 = sum_i (2i + 1) * X_i
    S2 = sum_i (2i + 1) * (X_i >> 32)          (arithmetic shift: the high half)

Both sums are computed without materialising the weights: with the words laid
out as rows of ``P`` words, ``sum_i (2i+1) X_i = 2P * sum_r r R_r + sum_c (2c+1) C_c``
where ``R`` are the row sums and ``C`` the column sums. Row and column sums are
plain reductions, done chunk by chunk so the second read hits the cache.
The tensor value is ``V = S1 + K * S2`` (``K`` an odd constant below 2**31); it
is folded with the dtype and shape through a bijective 64-bit mixer
(splitmix64's finaliser); the tensors of a list each contribute a mixed,
position-keyed term to a wrapping sum (see ``fingerprint_tensor``).

What is guaranteed (proved in the comments of ``_tensor_value``, tested with
hypothesis in ``tests/test_fingerprint.py``):

* any change to a single element of any dtype changes the fingerprint (the
  weight of every word is odd, and the mixer is a bijection
  applied to each tensor's value before the sum, and to the sum);
* swapping two unequal elements changes it for every dtype of up to 32 bits
  whose two elements sit at the same offset within their 8-byte words (the
  usual case), and for 64-bit dtypes, in tensors of fewer than 2**31 words;
  other swaps change it unless one specific position pair and value pattern
  coincide (about 2**-32 of pairs, and only with sign-bit-only differences);
* the dtype, shape and number of elements are part of the value
  (``zeros(4)`` and ``zeros(5)`` differ, as do ``-0.0`` and ``+0.0``, and NaNs
  with different payloads);
* no Python ``hash()``: the value is the same in every process and on every
  machine, CPU or CUDA.

Only the final 8 bytes leave the device, and only when ``fingerprint`` (not
``fingerprint_tensor``) is called.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import torch

__all__ = [
    "fingerprint",
    "fingerprint_tensor",
    "index_key",
    "indexed_terms",
    "mix64",
    "to_signed64",
    "to_unsigned64",
]

_MASK64: Final = (1 << 64) - 1
# Odd, below 2**31 (see the proof in _tensor_value).
_K: Final = 0x5BD1E995
# Words per row for the row/column-sum decomposition, and words per chunk on CPU
# (2**19 words = 4 MiB: the second pass over a chunk comes from L2/L3).
_ROW: Final = 256
_CPU_CHUNK_WORDS: Final = 1 << 19
_SEED: Final = 0x9E3779B97F4A7C15
# Below this many words a tensor is summed directly against cached weights
# (fewer kernel launches than the row/column decomposition).
_SMALL_WORDS: Final = 1 << 16

# Stable codes for dtypes: never depend on torch's enum order.
_DTYPE_CODES: Final[dict[torch.dtype, int]] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.float16: 3,
    torch.bfloat16: 4,
    torch.int8: 5,
    torch.uint8: 6,
    torch.int16: 7,
    torch.int32: 8,
    torch.int64: 9,
    torch.bool: 10,
    torch.complex64: 11,
    torch.complex128: 12,
}
for _name, _code in (("uint16", 13), ("uint32", 14), ("uint64", 15),
                     ("float8_e4m3fn", 16), ("float8_e5m2", 17)):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code


def to_signed64(v: int) -> int:
    """Map an unsigned 64-bit integer to the int64 with the same bits."""
    v &= _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def to_unsigned64(v: int) -> int:
    """Map an int64 to the unsigned 64-bit integer with the same bits."""
    return v & _MASK64


def _mix64_int(z: int) -> int:
    """splitmix64's finaliser on a Python int (a bijection on 64-bit words)."""
    z &= _MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z


def _lshr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int64 tensor."""
    return (z >> k) & ((1 << (64 - k)) - 1)


_M1: Final = to_signed64(0xBF58476D1CE4E5B9)
_M2: Final = to_signed64(0x94D049BB133111EB)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on an int64 tensor, elementwise (wrapping arithmetic)."""
    z = z ^ _lshr(z, 30)
    z = z * _M1
    z = z ^ _lshr(z, 27)
    z = z * _M2
    return z ^ _lshr(z, 31)


def _meta_word(t: torch.Tensor) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(
            f"fingerprint: dtype {t.dtype} is not supported; supported dtypes are "
            f"{sorted(str(d) for d in _DTYPE_CODES)}. Convert the tensor with .to(...) first."
        )
    h = _mix64_int(_SEED ^ code)
    h = _mix64_int(h + t.dim())
    for s in t.shape:
        h = _mix64_int(h + s)
    return h


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The tensor's bytes as int64 words, plus the zero-padded last partial word (or None)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_contiguous() or (t.storage_offset() * t.element_size()) % 8 != 0:
        t = t.contiguous() if not t.is_contiguous() else t.clone()
        if (t.storage_offset() * t.element_size()) % 8 != 0:  # pragma: no cover
            t = t.clone()
    raw = t.reshape(-1).view(torch.uint8)
    n_full = raw.numel() // 8
    main = raw[: n_full * 8].view(torch.int64)
    rest = raw.numel() - n_full * 8
    if rest == 0:
        return main, None
    tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
    tail[:rest] = raw[n_full * 8 :]
    return main, tail.view(torch.int64)


_weight_cache: dict[tuple[torch.device, int], torch.Tensor] = {}


def _odd_weights(n: int, device: torch.device) -> torch.Tensor:
    """(2i + 1) for i < n (a view of one cached vector per device when n is small)."""
    if n > _SMALL_WORDS:
        return torch.arange(n, dtype=torch.int64, device=device).mul_(2).add_(1)
    w = _weight_cache.get((device, _SMALL_WORDS))
    if w is None:
        w = torch.arange(_SMALL_WORDS, dtype=torch.int64, device=device).mul_(2).add_(1)
        _weight_cache[(device, _SMALL_WORDS)] = w
    return w[:n]


_arange_cache: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 as int64, a view of one cached vector per device."""
    a = _arange_cache.get(device)
    if a is None or a.numel() < n:
        a = torch.arange(max(n, 1 << 12), dtype=torch.int64, device=device)
        _arange_cache[device] = a
    return a[:n]


def _weighted_sum_small(x: torch.Tensor, first_index: int) -> torch.Tensor:
    """sum_i (2(first_index + i) + 1) * x_i, wrapping, for a short vector."""
    w = _odd_weights(x.numel(), x.device)
    s = (x * w).sum()
    if first_index:
        s = s + 2 * first_index * x.sum()  # (2(f+i)+1) = (2i+1) + 2f
    return s


def _weighted_sums(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S1, S2) of the module docstring for a 1-D int64 tensor of words."""
    dev = words.device
    m = words.numel()
    if m <= _SMALL_WORDS:
        w = _odd_weights(m, dev)
        return (words * w).sum(), ((words >> 32) * w).sum()
    rows = m // _ROW
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    s1, s2 = zero, zero
    if rows:
        body = words[: rows * _ROW]
        chunk_rows = rows if dev.type != "cpu" else max(1, _CPU_CHUNK_WORDS // _ROW)
        row_sums1 = torch.empty(rows, dtype=torch.int64, device=dev)
        row_sums2 = torch.empty(rows, dtype=torch.int64, device=dev)
        n_chunks = (rows + chunk_rows - 1) // chunk_rows
        col_sums1 = torch.empty(n_chunks, _ROW, dtype=torch.int64, device=dev)
        col_sums2 = torch.empty(n_chunks, _ROW, dtype=torch.int64, device=dev)
        high = torch.empty(min(rows, chunk_rows) * _ROW, dtype=torch.int64, device=dev)
        for k in range(n_chunks):
            r0 = k * chunk_rows
            r1 = min(rows, r0 + chunk_rows)
            block = body[r0 * _ROW : r1 * _ROW]
            hi = high[: block.numel()]
            torch.bitwise_right_shift(block, 32, out=hi)
            b2 = block.view(-1, _ROW)
            h2 = hi.view(-1, _ROW)
            torch.sum(b2, 1, out=row_sums1[r0:r1])
            torch.sum(b2, 0, out=col_sums1[k])
            torch.sum(h2, 1, out=row_sums2[r0:r1])
            torch.sum(h2, 0, out=col_sums2[k])
        # sum over word index i = r*P + c of (2i+1) X = 2P * sum_r r R_r + sum_c (2c+1) C_c
        r_idx = _arange(rows, dev)
        cw = _odd_weights(_ROW, dev)
        s1 = 2 * _ROW * (row_sums1 * r_idx).sum() + (col_sums1.sum(0) * cw).sum()
        s2 = 2 * _ROW * (row_sums2 * r_idx).sum() + (col_sums2.sum(0) * cw).sum()
    if rows * _ROW < m:
        rest = words[rows * _ROW :]
        s1 = s1 + _weighted_sum_small(rest, rows * _ROW)
        s2 = s2 + _weighted_sum_small(rest >> 32, rows * _ROW)
    return s1, s2


def _tensor_value(t: torch.Tensor) -> torch.Tensor:
    """V = S1 + K*S2 over the tensor's words, as a 0-d int64 tensor on t's device.

    Why a single-element change always changes V: a change confined to one
    word i changes that word by d = d_lo + 2**32 d_hi (|d_lo|, |d_hi| < 2**32,
    not both 0) and its high half by d_hi, so V changes by
    (2i+1) * (d_lo + (2**32 + K) d_hi). The bracket is a non-zero integer of
    magnitude below 2**64 (if d_hi != 0 it is at least 2**32 + K - 2**32 > 0 in
    size), hence non-zero modulo 2**64, and (2i+1) is odd, so the product is
    non-zero modulo 2**64. An element of up to 8 bytes never spans two words
    (elements are aligned to their size).
    """
    words, tail = _words(t)
    s1, s2 = _weighted_sums(words)
    if tail is not None:
        idx = words.numel()
        s1 = s1 + (2 * idx + 1) * tail[0]
        s2 = s2 + (2 * idx + 1) * (tail[0] >> 32)
    return s1 + _K * s2


_key_cache: dict[tuple[torch.device, bool, tuple[int, ...]], torch.Tensor] = {}


def _keys(device: torch.device, is_list: bool, metas: tuple[int, ...]) -> torch.Tensor:
    """Per-position keys: the tensor's dtype/shape word mixed with its index in the list."""
    key = (device, is_list, metas)
    k = _key_cache.get(key)
    if k is None:
        words = [
            to_signed64(_mix64_int(_mix64_int(m + i * _SEED) ^ (0xA5A5 if is_list else 0x5A5A)))
            for i, m in enumerate(metas)
        ]
        k = torch.tensor(words, dtype=torch.int64, device=device)
        if len(_key_cache) > 256:
            _key_cache.clear()
        _key_cache[key] = k
    return k


def fingerprint_tensor(x: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor:
    """The fingerprint as a 0-d int64 tensor on the (first) tensor's device. No host sync.

    The int64 holds the same bits as the unsigned value ``fingerprint`` returns.
    Tensor k of a list contributes ``mix(V_k + key_k)`` to a wrapping sum, where
    ``key_k`` encodes its dtype, shape and position; a change to one element of one
    tensor changes exactly one term (``mix`` is a bijection), so it always changes
    the sum, and the final ``mix`` keeps it changed.
    """
    is_list = not isinstance(x, torch.Tensor)
    tensors: list[torch.Tensor] = [x] if isinstance(x, torch.Tensor) else list(x)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fingerprint: item {i} is a {type(t).__name__}, not a torch.Tensor; "
                "pass a tensor or an iterable of tensors."
            )
    device = tensors[0].device if tensors else torch.device("cpu")
    metas = tuple(_meta_word(t) for t in tensors)
    total = torch.tensor(to_signed64(_mix64_int(len(tensors) + (_SEED if is_list else 0))),
                         dtype=torch.int64, device=device)
    if tensors:
        values = torch.stack([_tensor_value(t).to(device, non_blocking=True) for t in tensors])
        total = total + mix64(values + _keys(device, is_list, metas)).sum()
    return mix64(total)


def index_key(index: int) -> int:
    """The signed 64-bit key of position ``index`` in an unordered, indexed collection."""
    return to_signed64(_mix64_int(_mix64_int(index + 0x51ED27) ^ _SEED))


def indexed_terms(pairs: Iterable[tuple[int, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Sum of ``mix(V(t) + key(index))`` over (index, tensor) pairs, a 0-d int64 tensor.

    The sum is commutative, so partial sums computed in any grouping (e.g. per DDP
    bucket) add up to the same total; ``mix64`` of the total is then a fingerprint of
    the indexed collection that does not depend on how it was split. A change to one
    element of one tensor changes exactly one term, hence the total.
    """
    items = list(pairs)
    if not items:
        return torch.zeros((), dtype=torch.int64, device=device)
    values = torch.stack([_tensor_value(t).to(device) for _, t in items])
    keys = torch.tensor([index_key(i) for i, _ in items], dtype=torch.int64, device=device)
    return mix64(values + keys).sum()


def fingerprint(x: torch.Tensor | Iterable[torch.Tensor]) -> int:
    """A 64-bit fingerprint of the exact bits of a tensor (or an ordered list of tensors).

    Returns an int with ``0 <= v < 2**64``. See the module docstring for what
    is guaranteed to change it.
    """
    return to_unsigned64(int(fingerprint_tensor(x).item()))
