"""64-bit, order-sensitive fingerprints of a tensor's exact bits, computed on its device.

How it works
------------
A tensor's bytes are read in one of two ways, by element size:

* elements of 4 bytes or less (float32, float16, bfloat16, int8/16/32, uint8,
  bool, complex64): as unsigned 32-bit lanes ``L_k`` (the last one
  zero-padded), and ``V = sum_k (2k + 1) * L_k  (mod 2**64)``;
* 8-byte elements (float64, int64, complex128): as 64-bit words ``X_i``, each
  passed through the bijection ``Y_i = X_i ^ (X_i >>> 32)``, and
  ``V = sum_i (2i + 1) * Y_i  (mod 2**64)``.

The weights are never materialised: with the values laid out as rows of ``P``,
``sum_k (2k+1) v_k = 2P * sum_r r R_r + sum_c (2c+1) C_c`` where ``R`` are row
sums and ``C`` column sums, done chunk by chunk on the CPU so the second pass
reads from cache. ``V`` is folded with the dtype and shape through a bijective
64-bit mixer (splitmix64's finaliser); the tensors of a list each contribute a
mixed, position-keyed term to a wrapping sum (see ``fingerprint_tensor``).

What is guaranteed (``v2`` = the power of 2 dividing a number; odd weights are
invertible modulo 2**64; tested with hypothesis in ``tests/test_fingerprint.py``):

* **any single-element change**, every dtype: an element of <= 4 bytes lies in
  one lane, which changes by 0 < |d| < 2**32, so ``V`` changes by
  ``(2k+1) d != 0``; an 8-byte element is one word, ``X -> Y`` is a bijection so
  ``Y`` changes, and ``V`` changes by ``(2i+1) dY != 0``. The mixer is a
  bijection, so the fingerprint changes too;
* **swapping two unequal elements**, dtypes of <= 4 bytes, tensors under 2**32
  lanes, any two positions: with the elements at byte offsets o1, o2 of lanes
  k, l, ``dV = (v-u) [(2k+1) 2**(8 o1) - (2l+1) 2**(8 o2)]``; for k = l it is the
  single-change case, for o1 = o2 ``v2(dV) <= 1 + 31 + 31 < 64``, and for
  o1 != o2 ``v2(dV) <= 16 + 15 < 64``: never 0 modulo 2**64;
* swaps in 8-byte dtypes: ``dV = 2(a-b)(Y_b - Y_a)``, guaranteed whenever the low
  halves of ``Y`` differ (``+x``/``-x``, ``0.0``/``-0.0``, small integers of either
  sign...); the only possible misses have ``X_a ^ X_b`` equal to the same 32-bit
  mask D in both halves with ``v2(a-b) + v2(D) >= 31`` (no bijective word map
  avoids every such exception);
* dtype, shape and number of elements are part of the value (``zeros(4)`` and
  ``zeros(5)`` differ, as do ``-0.0`` and ``+0.0``, and NaNs with other payloads);
* no Python ``hash()``: the value is the same in every process and on every
  machine, CPU or CUDA (little-endian).

Only the final 8 bytes leave the device, and only when ``fingerprint`` (not
``fingerprint_tensor``) is called.

On the CPU a small C kernel (``sdc_guard._native``, built with the system C
compiler on first use, in well under a second) computes the same sums in one
read pass, about 3x faster, at the speed of ``torch.sum``; the values are
identical either way. Without a compiler, or with ``SDC_GUARD_NATIVE=0``, the
torch path runs (``native_enabled()`` says which).

The replay audit compares two computations of the same gradients, where a swap
is not a fault model, and uses a cheaper word digest ``D = sum_k (2k+1) X_k``
over the raw 64-bit words (``_digest_value``: no widening pass, about 2x
faster). Single-element changes are still guaranteed to change it; swaps of
elements that differ only in their top bits are not. D is linear, so D of
tensors laid end to end is a sum of per-tensor parts (``digest_parts``,
``concat_digest``): one flat DDP bucket or its separate gradients give the same.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Final

import torch

if TYPE_CHECKING:
    from sdc_guard._native import NativeKernel

__all__ = [
    "concat_digest",
    "digest_parts",
    "disable_native",
    "enable_native",
    "fingerprint",
    "fingerprint_tensor",
    "host_concat_digest",
    "host_spans_digest",
    "host_spans_scale_digest",
    "loss_word",
    "mix64",
    "mix64_int",
    "native_enabled",
    "to_signed64",
    "to_unsigned64",
    "word_count",
]

_MASK64: Final = (1 << 64) - 1
# Values per row for the row/column-sum decomposition; values per chunk on CPU
# (2**20 lanes: the chunk's int64 copy, 8 MiB, is read twice from cache); row groups
# per chunk for the column sums. Short rows keep the column sums' accumulators in
# registers: 128 is about 1.6x faster than 1024 here, 1 or 2 threads (tuned with
# every combination of 2**17..2**22 lanes, rows of 32..4096 and 1..8 groups).
_ROW: Final = 128
_CHUNK: Final = 1 << 20
_GROUPS: Final = 2
# On an accelerator: chunks of 2**26 lanes, so the int64 scratch copy stays at 512 MiB
# however large the tensor (a 4 GiB embedding would otherwise need 8 GiB of scratch).
_DEVICE_CHUNK: Final = 1 << 26
_SEED: Final = 0x9E3779B97F4A7C15
# Below this many values a tensor is summed directly against cached weights
# (fewer kernel launches than the row/column decomposition).
_SMALL: Final = 1 << 16

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


def mix64_int(z: int) -> int:
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


_meta_cache: dict[tuple[torch.dtype, tuple[int, ...]], int] = {}


def _meta_word(t: torch.Tensor) -> int:
    key = (t.dtype, tuple(t.shape))
    h = _meta_cache.get(key)
    if h is not None:
        return h
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(
            f"fingerprint: dtype {t.dtype} is not supported; supported dtypes are "
            f"{sorted(str(d) for d in _DTYPE_CODES)}. Convert the tensor with .to(...) first."
        )
    h = mix64_int(_SEED ^ code)
    h = mix64_int(h + t.dim())
    for s in t.shape:
        h = mix64_int(h + s)
    if len(_meta_cache) > 4096:
        _meta_cache.clear()
    _meta_cache[key] = h
    return h


_weight_cache: dict[torch.device, torch.Tensor] = {}


def _odd_weights(n: int, device: torch.device) -> torch.Tensor:
    """(2i + 1) for i < n (a view of one cached vector per device when n is small)."""
    if n > _SMALL:
        return torch.arange(n, dtype=torch.int64, device=device).mul_(2).add_(1)
    w = _weight_cache.get(device)
    if w is None:
        w = torch.arange(_SMALL, dtype=torch.int64, device=device).mul_(2).add_(1)
        _weight_cache[device] = w
    return w[:n]


_arange_cache: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 as int64, a view of one cached vector per device."""
    a = _arange_cache.get(device)
    if a is None or a.numel() < n:
        a = torch.arange(max(n, 1 << 12), dtype=torch.int64, device=device)
        _arange_cache[device] = a
    return a[:n]


Prep = Callable[[torch.Tensor, torch.Tensor], None]

_scratch = threading.local()


def _scratch_buffer(n: int, device: torch.device) -> torch.Tensor:
    """An int64 work buffer of n values, reused per thread and device (no page faults per call)."""
    bufs: dict[torch.device, torch.Tensor] = getattr(_scratch, "bufs", None) or {}
    _scratch.bufs = bufs
    b = bufs.get(device)
    if b is None or b.numel() < n:
        b = torch.empty(n, dtype=torch.int64, device=device)
        if device.type == "cpu":  # on CUDA the caching allocator already reuses memory
            bufs[device] = b
    return b[:n]


def _prep_lanes(block: torch.Tensor, out: torch.Tensor) -> None:
    """uint32 lanes -> int64, zero-extended."""
    out.copy_(block)


def _prep_words(block: torch.Tensor, out: torch.Tensor) -> None:
    """int64 words X -> Y = X ^ (X >>> 32): the high half kept, the low half xored with it."""
    out.copy_(block.view(torch.uint32)[1::2])  # X >>> 32, logical (little-endian high halves)
    torch.bitwise_xor(out, block, out=out)


_native: NativeKernel | None = None
_native_resolved = False


def _native_kernel() -> NativeKernel | None:
    """The C kernel of ``sdc_guard._native`` if in use, built on the first call, else None.

    On by default wherever a C compiler can build it; ``SDC_GUARD_NATIVE=0`` turns it
    off and ``SDC_GUARD_NATIVE=1`` warns when it cannot be built (the default only logs).
    """
    global _native, _native_resolved
    if not _native_resolved:
        _native_resolved = True
        setting = os.environ.get("SDC_GUARD_NATIVE", "")
        if setting != "0":
            from sdc_guard import _native as native

            _native = native.load(warn=setting == "1")
    return _native


def enable_native() -> bool:
    """Use the C kernel (building it now if needed); True if in use, else a warning says why.

    Fingerprints are identical either way; only the speed differs.
    """
    global _native, _native_resolved
    from sdc_guard import _native as native

    _native = native.load(warn=True)
    _native_resolved = True
    return _native is not None


def disable_native() -> None:
    """Use the pure-torch implementation until ``enable_native`` is called."""
    global _native, _native_resolved
    _native = None
    _native_resolved = True


def native_enabled() -> bool:
    """Does a CPU fingerprint run on the C kernel (building it if this is the first ask)?"""
    return _native_kernel() is not None


def _native_mode(prep: Prep | None) -> int:
    return 0 if prep is _prep_lanes else 1 if prep is _prep_words else 2


def _weighted(src: torch.Tensor, prep: Prep | None, *, with_sum: bool = False) -> torch.Tensor:
    """sum_k (2k+1) * prep(src)_k modulo 2**64, a 0-d int64 tensor on src's device.

    ``prep=None``: ``src`` is already int64 and is summed as it is, without a copy.
    ``with_sum=True``: an int64 pair ``[that, sum_k prep(src)_k]`` instead (the plain
    sum falls out of the row sums at no extra pass).
    """
    dev = src.device
    n = src.numel()
    kernel = _native_kernel() if dev.type == "cpu" else None
    if kernel is not None:
        mode = _native_mode(prep)
        flat = src.view(torch.int32) if mode == 0 else src
        both = torch.tensor(kernel.weighted_sum(flat, mode), dtype=torch.int64)
        return both if with_sum else both[0]
    if n <= _SMALL:
        if prep is None:
            vals = src
        else:
            vals = torch.empty(n, dtype=torch.int64, device=dev)
            prep(src, vals)
        value = (vals * _odd_weights(n, dev)).sum()
        return torch.stack([value, vals.sum()]) if with_sum else value
    rows = n // _ROW
    chunk = _CHUNK if dev.type == "cpu" else _DEVICE_CHUNK
    chunk_rows = max(_GROUPS, chunk // _ROW // _GROUPS * _GROUPS)
    n_chunks = (rows + chunk_rows - 1) // chunk_rows
    row_sums = torch.empty(rows, dtype=torch.int64, device=dev)
    col_sums = torch.zeros(n_chunks, _GROUPS, _ROW, dtype=torch.int64, device=dev)
    scratch = None if prep is None else _scratch_buffer(min(rows, chunk_rows) * _ROW, dev)
    for k in range(n_chunks):
        r0 = k * chunk_rows
        r1 = min(rows, r0 + chunk_rows)
        h = src[r0 * _ROW : r1 * _ROW]
        if prep is not None and scratch is not None:
            prep(h, scratch[: h.numel()])
            h = scratch[: h.numel()]
        torch.sum(h.view(-1, _ROW), 1, out=row_sums[r0:r1])
        if (r1 - r0) % _GROUPS == 0:
            torch.sum(h.view(_GROUPS, -1, _ROW), 1, out=col_sums[k])
        else:
            torch.sum(h.view(-1, _ROW), 0, out=col_sums[k, 0])
    # index k = r*P + c:  2k+1 = 2P*r + (2c+1)
    s = 2 * _ROW * (row_sums * _arange(rows, dev)).sum() + (
        col_sums.view(-1, _ROW).sum(0) * _odd_weights(_ROW, dev)
    ).sum()
    total = row_sums.sum() if with_sum else None
    if rows * _ROW < n:
        rest = src[rows * _ROW :]
        if prep is None:
            tail = rest
        else:
            tail = torch.empty(rest.numel(), dtype=torch.int64, device=dev)
            prep(rest, tail)
        tail_sum = tail.sum()
        s = s + (tail * _odd_weights(rest.numel(), dev)).sum() + 2 * rows * _ROW * tail_sum
        if total is not None:
            total = total + tail_sum
    return s if total is None else torch.stack([s, total])


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view, contiguous and 8-byte aligned."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_contiguous():
        t = t.contiguous()
    if (t.storage_offset() * t.element_size()) % 8:
        t = t.clone()
    return t.reshape(-1).view(torch.uint8)


def _tail_word(raw: torch.Tensor, full: int, unit: int) -> torch.Tensor:
    """The bytes after ``full``, zero-padded to one ``unit``-byte word, as a 1-element int64."""
    word = torch.zeros(unit, dtype=torch.uint8, device=raw.device)
    word[: raw.numel() - full] = raw[full:]
    last = torch.empty(1, dtype=torch.int64, device=raw.device)
    last.copy_(word.view(torch.uint32 if unit == 4 else torch.int64))
    return last


def _tensor_value(t: torch.Tensor) -> torch.Tensor:
    """V of the module docstring, as a 0-d int64 tensor (modulo 2**64) on t's device."""
    raw = _raw_bytes(t)
    unit = 8 if t.element_size() == 8 else 4
    full = raw.numel() // unit * unit
    body = raw[:full]
    if unit == 8:
        value = _weighted(body.view(torch.int64), _prep_words)
    else:
        value = _weighted(body.view(torch.uint32), _prep_lanes)
    if full < raw.numel():  # the last, partial lane: zero-padded, weight 2k+1 with k = full/4
        value = value + (2 * (full // 4) + 1) * _tail_word(raw, full, 4)[0]
    return value


_BATCH_BYTES: Final = 1 << 16
"""Tensors of at most this many bytes are valued together (``_small_values``)."""

_segment_cache: dict[tuple[torch.device, int, tuple[int, ...]],
                     tuple[torch.Tensor, torch.Tensor]] = {}


def _small_values(tensors: Sequence[torch.Tensor], unit: int,
                  device: torch.device) -> torch.Tensor:
    """V of each of many small tensors, an int64 vector: the same values as ``_tensor_value``.

    All of them go through one concatenation, one widening and one multiply by
    per-segment weights ``2k+1`` (k counted from each tensor's start), then a sum per
    tensor: a few ops in all instead of about 20 per tensor, which is what a model's
    biases, norms and optimizer step counters otherwise cost. ``unit`` is 4 (tensors
    of elements up to 4 bytes, as 32-bit lanes, the last one zero-padded) or 8
    (8-byte elements, as words mapped by ``_prep_words``).
    """
    pieces: list[torch.Tensor] = []
    counts: list[int] = []
    for t in tensors:
        t = t.detach()
        if t.is_complex():
            t = torch.view_as_real(t)
        raw = t.contiguous().reshape(-1).view(torch.uint8).to(device)
        pad = -raw.numel() % unit
        pieces.append(raw)
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        counts.append((raw.numel() + pad) // unit)
    whole = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)
    key = (device, unit, tuple(counts))
    layout = _segment_cache.get(key)
    if layout is None:
        # Built once per layout on the CPU (no device-side scan), then kept on the device.
        sizes = torch.tensor(counts, dtype=torch.int64)
        segment = torch.repeat_interleave(torch.arange(len(counts)), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        weights = (torch.arange(segment.numel()) - starts[segment]) * 2 + 1
        layout = (weights.to(device), segment.to(device))
        if len(_segment_cache) > 64:
            _segment_cache.clear()
        _segment_cache[key] = layout
    weights, segment = layout
    vals = torch.empty(weights.numel(), dtype=torch.int64, device=device)
    if unit == 4:
        _prep_lanes(whole.view(torch.uint32), vals)
    else:
        _prep_words(whole.view(torch.int64), vals)
    vals.mul_(weights)
    if device.type == "cpu":  # index_add_ is deterministic on the CPU only
        return torch.zeros(len(counts), dtype=torch.int64).index_add_(0, segment, vals)
    return torch.stack([part.sum() for part in torch.split(vals, counts)])


def _digest_value(t: torch.Tensor) -> torch.Tensor:
    """D = sum_k (2k+1) X_k (mod 2**64) over the raw 64-bit words X_k of t's bytes.

    No widening or transform pass: about 3x cheaper than ``_tensor_value``. Any
    single-element change is still guaranteed to change D (an element of s <= 8
    bytes at byte offset o of word k changes X_k by d * 2**(8o), 0 < |d| < 2**(8s),
    whose 2-adic valuation is at most 63, so (2k+1) * that is never 0 modulo 2**64),
    but swaps of elements that differ only in their top bits are not: use it to
    compare two computations of the same numbers, not as an order-sensitive
    fingerprint.
    """
    return digest_parts(t)[0]


def word_count(t: torch.Tensor) -> int:
    """How many 64-bit words hold ``t``'s bytes (the last one zero-padded)."""
    return (t.numel() * t.element_size() + 7) // 8


def digest_parts(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[D, S]`` of ``t``'s raw words: the digest D and the plain sum S (mod 2**64)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"digest_parts: expected a torch.Tensor, got {type(t).__name__}.")
    raw = _raw_bytes(t)
    full = raw.numel() // 8 * 8
    parts = _weighted(raw[:full].view(torch.int64), None, with_sum=True)
    if full < raw.numel():
        last = _tail_word(raw, full, 8)[0]
        parts = parts + torch.stack([(2 * (full // 8) + 1) * last, last])
    return parts


def host_concat_digest(pieces: Iterable[tuple[torch.Tensor, int]]) -> int | None:
    """D of CPU tensors laid end to end, as an unsigned int, by the C kernel; else None.

    ``pieces`` are (tensor, word offset in the concatenation). Each tensor is read
    once by the kernel and the parts are combined in Python integers (no torch op
    per tensor), which is what the replay audit does per gradient. ``None`` when the
    kernel is not in use or a tensor is not a CPU tensor; the caller then uses
    ``digest_parts`` and ``concat_digest``, which give the same value.
    """
    kernel = _native_kernel()
    if kernel is None:
        return None
    total = 0
    for t, offset in pieces:
        if not isinstance(t, torch.Tensor) or isinstance(offset, bool) or not isinstance(offset,
                                                                                          int):
            raise TypeError(f"host_concat_digest: pieces must be (torch.Tensor, int word offset) "
                            f"pairs, got ({type(t).__name__}, {type(offset).__name__}).")
        if t.device.type != "cpu":
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes % 8 == 0 and t.is_contiguous() and t.data_ptr() % 8 == 0:
            d, s = kernel.words_at(t.data_ptr(), nbytes // 8, 2)
        else:
            d, s = (v & _MASK64 for v in digest_parts(t).tolist())
        total += d + 2 * offset * s
    return total & _MASK64


def host_spans_digest(buf: torch.Tensor, spans: Iterable[tuple[int, int, int]]) -> int | None:
    """D of word ranges of one flat CPU buffer, moved to new offsets, by the C kernel; else None.

    ``spans`` are (first word, end word, word offset in the concatenation): the replay
    audit's view of a DDP bucket, whose gradients lie at other offsets in the bucket
    than in parameter order. ``buf`` must be contiguous and 8-byte aligned.
    """
    done = _host_spans("host_spans_digest", buf, spans, None)
    return None if done is None else done[0]


def host_spans_scale_digest(buf: torch.Tensor, spans: Iterable[tuple[int, int, int]],
                            scale: float) -> tuple[int, bool] | None:
    """``host_spans_digest`` of the words as they were, then the spans' float32 halves
    multiplied by ``scale`` in place (the bits of ``mul_``), in one pass over memory;
    with "was any of them NaN or Inf". None without the C kernel or a float32 ``buf``."""
    if buf.dtype != torch.float32:
        return None
    return _host_spans("host_spans_scale_digest", buf, spans, scale)


def _host_spans(name: str, buf: torch.Tensor, spans: Iterable[tuple[int, int, int]],
                scale: float | None) -> tuple[int, bool] | None:
    kernel = _native_kernel()
    if (kernel is None or buf.device.type != "cpu" or not buf.is_contiguous()
            or buf.data_ptr() % 8):
        return None
    base = buf.data_ptr()
    end = buf.numel() * buf.element_size() // 8
    total, bad = 0, False
    for a, b, offset in spans:
        if not 0 <= a <= b <= end:
            raise ValueError(f"{name}: span [{a}, {b}) lies outside the buffer's {end} words.")
        if scale is None:
            d, s = kernel.words_at(base + 8 * a, b - a, 2)
        else:
            d, s, flag = kernel.scale_digest_at(base + 8 * a, b - a, scale)
            bad |= flag
        total += d + 2 * offset * s
    return total & _MASK64, bad


def concat_digest(parts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """D of tensors laid end to end, from their ``[D, S]`` rows and their word offsets.

    A tensor whose words start at word ``o`` of the concatenation contributes
    ``sum_k (2(o+k)+1) X_k = D + 2 o S``. So D of a concatenation is a sum of parts,
    computed per tensor, per flat buffer, in any grouping: the replay audit gets the
    same digest of a model's gradients from DDP's buckets as from separate tensors.
    ``parts`` is ``[n, 2]``, ``offsets`` ``[n]`` (int64, same device); returns a 0-d int64.
    """
    if (parts.dim() != 2 or parts.shape[1] != 2 or offsets.shape != (parts.shape[0],)
            or parts.dtype != torch.int64 or offsets.dtype != torch.int64):
        raise ValueError(
            f"concat_digest: parts must be int64 [n, 2] (rows of digest_parts) and offsets "
            f"int64 [n]; got parts {parts.dtype} {list(parts.shape)}, offsets {offsets.dtype} "
            f"{list(offsets.shape)}."
        )
    return (parts[:, 0] + 2 * offsets * parts[:, 1]).sum()


_key_cache: dict[tuple[torch.device, bool, tuple[int, ...]], torch.Tensor] = {}


def _keys(device: torch.device, is_list: bool, metas: tuple[int, ...]) -> torch.Tensor:
    """Per-position keys: the tensor's dtype/shape word mixed with its index in the list."""
    key = (device, is_list, metas)
    k = _key_cache.get(key)
    if k is None:
        words = [
            to_signed64(mix64_int(mix64_int(m + i * _SEED) ^ (0xA5A5 if is_list else 0x5A5A)))
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
    total = torch.tensor(to_signed64(mix64_int(len(tensors) + (_SEED if is_list else 0))),
                         dtype=torch.int64, device=device)
    if tensors:
        total = total + mix64(_values(tensors, device) + _keys(device, is_list, metas)).sum()
    return mix64(total)


def _values(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """V of each tensor, an int64 vector on ``device``: small ones batched, large ones alone."""
    if len(tensors) == 1:
        return _tensor_value(tensors[0]).to(device).reshape(1)
    groups: dict[int, list[int]] = {4: [], 8: []}
    large: list[int] = []
    for i, t in enumerate(tensors):
        if t.numel() * t.element_size() <= _BATCH_BYTES:
            groups[8 if t.element_size() == 8 else 4].append(i)
        else:
            large.append(i)
    if not large and not groups[8]:
        return _small_values(tensors, 4, device)
    values = torch.empty(len(tensors), dtype=torch.int64, device=device)
    for unit, idx in groups.items():
        if idx:
            values[idx] = _small_values([tensors[i] for i in idx], unit, device)
    if large:
        values[large] = torch.stack([_tensor_value(tensors[i]).to(device, non_blocking=True)
                                     for i in large])
    return values


_INT_OF_SIZE: Final = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def loss_word(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d int64 word that changes with any bit of any of ``losses`` (the replay audit's).

    ``sum_k (2k+1) v_k`` over the losses' bits as sign-extended integers ``v_k``: a
    few tiny ops, where a fingerprint would cost tens. A changed loss changes its
    ``v`` by ``0 < |d| < 2**64``, times an odd weight; swapping two unequal losses of
    at most 4 bytes changes it by ``2(i-j)(v_j-v_i) != 0``.
    """
    flat = [loss.detach().reshape(()) for loss in losses]
    if flat and all(t.device.type == "cpu" and t.dtype == flat[0].dtype for t in flat):
        # On the host: one view and .item() per loss, Python integers (no tensor ops).
        as_int = _INT_OF_SIZE[flat[0].element_size()]
        total = sum((2 * k + 1) * int(t.view(as_int).item()) for k, t in enumerate(flat))
        return torch.tensor(to_signed64(total & _MASK64), dtype=torch.int64)
    return _loss_word_tensor(flat)


def _loss_word_tensor(flat: Sequence[torch.Tensor]) -> torch.Tensor:
    """``loss_word`` in tensor ops on the losses' device (no host sync)."""
    stacked = torch.stack(list(flat))
    v = stacked.view(_INT_OF_SIZE[stacked.element_size()]).to(torch.int64)
    return (v * _odd_weights(v.numel(), v.device)).sum()


def fingerprint(x: torch.Tensor | Iterable[torch.Tensor]) -> int:
    """A 64-bit fingerprint of the exact bits of a tensor (or an ordered list of tensors).

    Returns an int with ``0 <= v < 2**64``. See the module docstring for what
    is guaranteed to change it.
    """
    return to_unsigned64(int(fingerprint_tensor(x).item()))


if os.environ.get("SDC_GUARD_NATIVE") == "1":
    enable_native()  # build now, and warn now if it cannot be built
