"""The odd-weighted sum ``sum_k (2k+1) v_k (mod 2**64)`` under the fingerprint and the digest.

One read pass through the C kernel on the CPU (``sdc_guard.fingerprints.native``).
On a CUDA device, for tensors of ``FUSED_MIN`` values or more, one read pass too: the
widening, the weights and both sums written as one expression that ``torch.compile``
fuses (``_fused``; compiled once per mode, checked against the torch ops on its first
use, and given up for the torch ops if it fails to compile or to agree). Elsewhere, or
without a compiler, torch ops: with the values laid out as rows of ``P``,
``sum_k (2k+1) v_k = 2P * sum_r r R_r + sum_c (2c+1) C_c`` where ``R`` are row sums and
``C`` column sums, done chunk by chunk so the second pass reads from cache (on a GPU
that is a widened copy and two reads of it, well short of one read pass:
``bench/DEVICE.md``). Every
path gives the same value, bit for bit: the arithmetic is on integers modulo ``2**64``.
That is a pass per tensor; the torch path values a list of tensors in one multi-tensor pass
instead (``sdc_guard.fingerprints.batched``), and only its largest tensors here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final

import torch

from sdc_guard.compiled import CheckedCompile
from sdc_guard.fingerprints.native import active_kernel
from sdc_guard.fingerprints.words import LANES_V2

# Values per row for the row/column-sum decomposition; values per chunk on CPU
# (2**20 lanes: the chunk's int64 copy, 8 MiB, is read twice from cache); row groups
# per chunk for the column sums. Short rows keep the column sums' accumulators in
# registers (chosen over every combination of 2**17..2**22 lanes, rows of 32..4096
# and 1..8 groups, on 1 and 2 threads).
_ROW: Final = 128
_CHUNK: Final = 1 << 20
_GROUPS: Final = 2
# On an accelerator: chunks of 2**26 lanes, so the int64 scratch copy stays at 512 MiB
# however large the tensor (a 4 GiB embedding would otherwise need 8 GiB of scratch).
DEVICE_CHUNK: Final = 1 << 26
# Below this many values a tensor is summed directly against cached weights
# (fewer kernel launches than the row/column decomposition).
SMALL: Final = 1 << 16


_weight_cache: dict[torch.device, torch.Tensor] = {}


def odd_weights(n: int, device: torch.device) -> torch.Tensor:
    """(2i + 1) for i < n (a view of one cached vector per device when n is small)."""
    if n > SMALL:
        return torch.arange(n, dtype=torch.int64, device=device).mul_(2).add_(1)
    w = _weight_cache.get(device)
    if w is None:
        w = torch.arange(SMALL, dtype=torch.int64, device=device).mul_(2).add_(1)
        _weight_cache[device] = w
    return w[:n]


_lane_cache: dict[torch.device, torch.Tensor] = {}


def ruler_powers(index: torch.Tensor) -> torch.Tensor:
    """``2**rho(i)`` of int64 lane indices, ``rho(i) = 6 - min(v2(i + 1), 6)``
    (``words.ruler_shift``): 64 over the lowest set bit of ``i + 1``, capped at 64."""
    j = index + 1
    return 64 // torch.clamp(j & -j, max=64)


def lane_weights(n: int, device: torch.device, version: int) -> torch.Tensor:
    """The weights of lanes ``0..n-1`` in ``version``: ``2i + 1`` (1) or
    ``2**8 (2i + 1) + 2**rho(i)`` (2); a view of one cached vector per device when n is
    small."""
    if version == 1:
        return odd_weights(n, device)
    if n > SMALL:
        i = torch.arange(n, dtype=torch.int64, device=device)
        return (2 * i + 1) * 256 + ruler_powers(i)
    w = _lane_cache.get(device)
    if w is None:
        i = torch.arange(SMALL, dtype=torch.int64, device=device)
        w = _lane_cache[device] = (2 * i + 1) * 256 + ruler_powers(i)
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
        with torch.inference_mode(False):  # kept: made in inference mode, it could not be
            b = torch.empty(n, dtype=torch.int64, device=device)  # written outside it after
        if device.type == "cpu":  # on CUDA the caching allocator already reuses memory
            bufs[device] = b
    return b[:n]


def prep_lanes(block: torch.Tensor, out: torch.Tensor) -> None:
    """uint32 lanes -> int64, zero-extended."""
    out.copy_(block)


def prep_words(block: torch.Tensor, out: torch.Tensor) -> None:
    """int64 words X -> Y = X ^ (X >>> 32): the high half kept, the low half xored with it."""
    out.copy_(block.view(torch.uint32)[1::2])  # X >>> 32, logical (little-endian high halves)
    torch.bitwise_xor(out, block, out=out)


def native_mode(prep: Prep | None, version: int = 1) -> int:
    """The C kernel's mode for values read by ``prep`` (``words.LANES_V2`` for lanes under
    version 2)."""
    if prep is prep_lanes:
        return LANES_V2 if version == 2 else 0
    return 1 if prep is prep_words else 2


_FUSED_ROW: Final = 4096
"""Values per row in ``_fused_math``: the rows' sums are its parallel first stage."""


def _prepared(x: torch.Tensor, mode: int) -> torch.Tensor:
    """The values ``v`` that ``native_mode`` ``mode`` reads from ``x`` (0: ``x`` is int32
    holding uint32 lanes, zero-extended; 1: int64 words ``X ^ (X >>> 32)``; 2: int64 as
    they are)."""
    if mode in (0, LANES_V2):
        return x.to(torch.int64) & 0xFFFFFFFF
    if mode == 1:
        return x ^ ((x >> 32) & 0xFFFFFFFF)
    return x


def _fused_math(src: torch.Tensor, mode: int) -> torch.Tensor:
    """int64 ``[sum_k (2k+1) v_k, sum_k v_k]`` (mod ``2**64``) of ``_prepared(src, mode)``,
    written for ``torch.compile`` to read ``src`` once with no intermediate tensor: per row
    of ``_FUSED_ROW`` values ``A_r = sum_c (2c+1) v_rc`` and ``B_r = sum_c v_rc`` (one kernel,
    parallel over rows: a single reduction over a dynamic size would run on one block),
    then ``sum_r A_r + 2 P r B_r``, and the last partial row directly."""
    n = src.numel()
    rows = n // _FUSED_ROW
    head = rows * _FUSED_ROW
    body = _prepared(src[:head].view(rows, _FUSED_ROW), mode)
    tail = _prepared(src[head:], mode)
    c = torch.arange(_FUSED_ROW, device=src.device, dtype=torch.int64)
    r = torch.arange(rows, device=src.device, dtype=torch.int64)
    k = torch.arange(tail.numel(), device=src.device, dtype=torch.int64) + head
    b = body.sum(1)
    if mode == LANES_V2:  # 2**8 (2k+1) + 2**rho(k); rho has period 64, which divides a row
        a = (body * ((2 * c + 1) * 256 + ruler_powers(c))).sum(1)
        weighted = ((a + (256 * 2 * _FUSED_ROW) * r * b).sum()
                    + (tail * ((2 * k + 1) * 256 + ruler_powers(k))).sum())
    else:
        a = (body * (2 * c + 1)).sum(1)
        weighted = (a + (2 * _FUSED_ROW) * r * b).sum() + (tail * (2 * k + 1)).sum()
    return torch.stack([weighted, b.sum() + tail.sum()])


FUSED_DEVICES: set[str] = {"cuda"}
"""The device types whose weighted sums take ``torch.compile``'s fused kernel (``_fused``)."""
FUSED_MIN = 1 << 27
"""Values from which the fused kernel runs. It reads a large tensor in one pass where the
torch ops take three, but each call has a fixed cost that a smaller tensor's pass does not
repay (``bench/DEVICE.md``: the 256 MiB and 4096 MiB rows)."""
_FUSED = CheckedCompile()
"""``_fused_math`` compiled per device type, checked per (device type, mode)."""


def _fused(src: torch.Tensor, mode: int, torch_ops: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """``_fused_math`` compiled for ``src``'s device type, or None where it is off, failed to
    compile, or once gave another value than ``torch_ops`` (compared on the first use of
    each mode, bit for bit: a compiler bug must not change a fingerprint; a warning says
    why: ``sdc_guard.compiled``)."""
    kind = src.device.type
    if kind not in FUSED_DEVICES:
        return None
    flat = src.view(torch.int32) if mode in (0, LANES_V2) else src
    got: torch.Tensor | None = _FUSED.run(
        kind, _fused_math, (kind, mode), f"the fingerprint kernel on {kind}", torch_ops,
        lambda got, want: bool(torch.equal(got, want)), flat, mode,
        fallback=", slower than the fused pass (bench/DEVICE.md)")
    return got


def weighted_sum(src: torch.Tensor, prep: Prep | None, *, with_sum: bool = False,
                 version: int = 1) -> torch.Tensor:
    """sum_k (2k+1) * prep(src)_k modulo 2**64, a 0-d int64 tensor on src's device.

    ``prep=None``: ``src`` is already int64 and is summed as it is, without a copy.
    ``with_sum=True``: an int64 pair ``[that, sum_k prep(src)_k]`` instead (the plain
    sum falls out of the row sums at no extra pass). ``version=2`` with ``prep_lanes``:
    the weights ``2**8 (2k+1) + 2**rho(k)`` (``lane_weights``) instead of ``2k+1``.
    """
    dev = src.device
    n = src.numel()
    kernel = active_kernel() if dev.type == "cpu" else None
    mode = native_mode(prep, version)
    if kernel is not None:
        flat = src.view(torch.int32) if mode in (0, LANES_V2) else src
        both = torch.tensor(kernel.weighted_sum(flat, mode), dtype=torch.int64)
        return both if with_sum else both[0]
    if n >= FUSED_MIN and dev.type in FUSED_DEVICES:
        fused = _fused(src, mode,
                       lambda: _torch_weighted_sum(src, prep, with_sum=True, version=version))
        if fused is not None:
            return fused if with_sum else fused[0]
    return _torch_weighted_sum(src, prep, with_sum=with_sum, version=version)


def _torch_weighted_sum(src: torch.Tensor, prep: Prep | None, *,
                        with_sum: bool, version: int = 1) -> torch.Tensor:
    """``weighted_sum`` in torch ops (the row and column sums of the module docstring).
    Under version 2 the same sums with other weights, no other op: the row of ``_ROW``
    values is a whole number of ``rho``'s periods, so lane ``k = r P + c`` weighs
    ``2**8 (2 P r) + [2**8 (2c + 1) + 2**rho(c)]``, a row part and a column part."""
    dev = src.device
    n = src.numel()
    v2 = version == 2 and prep is prep_lanes
    ver = 2 if v2 else 1
    if n <= SMALL:
        if prep is None:
            vals = src
        else:
            vals = torch.empty(n, dtype=torch.int64, device=dev)
            prep(src, vals)
        value = (vals * lane_weights(n, dev, ver)).sum()
        return torch.stack([value, vals.sum()]) if with_sum else value
    rows = n // _ROW
    chunk = _CHUNK if dev.type == "cpu" else DEVICE_CHUNK
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
    s = (256 if v2 else 1) * 2 * _ROW * (row_sums * _arange(rows, dev)).sum() + (
        col_sums.view(-1, _ROW).sum(0) * lane_weights(_ROW, dev, ver)
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
        s = (s + (tail * lane_weights(rest.numel(), dev, ver)).sum()
             + (256 if v2 else 1) * 2 * rows * _ROW * tail_sum)
        if total is not None:
            total = total + tail_sum
    return s if total is None else torch.stack([s, total])


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view, contiguous and 8-byte aligned."""
    t = t.detach()
    if t.is_conj() or t.is_neg():  # lazy views: their memory holds the values before the op
        t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.reshape(-1)
    # A view of 0 or 1 elements counts as contiguous with any stride, which the byte view
    # refuses: those are copied too, as are views off an 8-byte boundary.
    if flat.stride(0) != 1 or (flat.storage_offset() * flat.element_size()) % 8:
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def tail_word(raw: torch.Tensor, full: int, unit: int) -> torch.Tensor:
    """The bytes after ``full``, zero-padded to one ``unit``-byte word, as a 1-element int64."""
    word = torch.zeros(unit, dtype=torch.uint8, device=raw.device)
    word[: raw.numel() - full] = raw[full:]
    last = torch.empty(1, dtype=torch.int64, device=raw.device)
    last.copy_(word.view(torch.uint32 if unit == 4 else torch.int64))
    return last


INT_OF_SIZE: Final = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
