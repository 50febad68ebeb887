"""The public fingerprint: 64 bits, order-sensitive, of a tensor's exact bits, on its device.

How it works
------------
A tensor's bytes are read in one of two ways, by element size:

* elements of 4 bytes or less (float32, float16, bfloat16, int8/16/32, uint8,
  bool) and complex128 (four lanes an element): as unsigned 32-bit lanes ``L_k``
  (the last one zero-padded), and ``V = sum_k w_k L_k  (mod 2**64)``;
* 8-byte elements (float64, int64, complex64): as 64-bit words ``X_i``, each
  passed through the bijection ``Y_i = X_i ^ (X_i >>> 32)``, and
  ``V = sum_i (2i + 1) * Y_i  (mod 2**64)``.

The lane weights depend on the version (``version=`` of ``fingerprint``; checkpoints
record theirs, and one recorded in version 1 is verified in version 1):

* version 2 (the default): ``w_k = 2**8 (2k + 1) + 2**rho(k)``, ``rho(k) = 6 - min(v2(k + 1),
  6)`` (``v2`` = the power of 2 dividing a number), so ``v2(w_k) = rho(k)``;
* version 1: ``w_k = 2k + 1``.

The weights are never materialised: with the values laid out as rows of ``P`` (a multiple
of 64, the period of ``rho``), ``sum_k w_k v_k`` is a row part ``2**8 * 2P * sum_r r R_r`` and a
column part ``sum_c w_c C_c`` where ``R`` are row sums and ``C`` column sums, done chunk by
chunk on the CPU so the second pass reads from cache. ``V`` is folded with the dtype, shape
and version through a bijective 64-bit mixer (splitmix64's finaliser); the tensors of a list
each contribute a mixed, position-keyed term to a wrapping sum (see
``fingerprint_tensor``).

What is guaranteed (odd numbers are invertible modulo 2**64; tested with hypothesis, and
exhaustively for small tensors, in ``tests/sdc_guard/test_fingerprint.py``), version 2:

* **any single-element change**, every dtype but complex128: an element of <= 4 bytes
  lies in one lane, which changes by 0 < |d| < 2**32, so ``V`` changes by ``w_k d`` with
  ``v2(w_k d) <= 6 + 31 < 64``; an 8-byte element is one word, ``X -> Y`` is a bijection so
  ``Y`` changes, and ``V`` changes by ``(2i+1) dY != 0``. The mixer is a bijection, so the
  fingerprint changes too. A complex128 element spans four lanes: a change inside one of
  them (any single bit flip) is seen by the same argument; a change across several lanes of
  one element is not proven;
* **a burst at one bit**: bit b flipped (each up or down) in every element of a run that
  spans at most 64 adjacent lanes (64 float32, 126 bfloat16 or float16, 252 int8 elements),
  dtypes of <= 4 bytes. A lane whose lowest element of the run flips changes by ``2**b c``,
  ``c`` odd (its other elements add multiples of ``2**(b+8)``); the first lane may hold only
  upper elements of the run (a change of ``v2 >= b + 8``). Among at most 64 consecutive
  integers ``k + 1`` one has more factors of 2 than every other (capped at 6: a run of at
  most 64 holds one multiple of 64 at most), so one lane has the smallest ``rho``: the terms
  ``2**b c w_k`` have one smallest power of 2, ``b + rho_min <= 31 + 6``, and so has their
  sum, which is not 0 modulo 2**64;
* **swapping two unequal elements**, dtypes of <= 4 bytes, tensors under 2**24 lanes: with
  the elements at byte offsets o1, o2 of lanes k, l, ``dV = (v-u) [w_k 2**(8 o1) - w_l 2**(8
  o2)]``; for k = l it is the single-change case. For o1 = o2: with ``rho_k != rho_l`` the
  bracket has ``v2 = 8 o1 + min(rho)``; with equal ``rho`` it is ``2**(8 o1 + 9) (k - l)``,
  and ``v2(v-u) + 8 o1 <= 31``, so ``v2(dV) <= 40 + v2(k - l) < 64``. For o1 != o2 the two
  terms' powers of 2 differ (``|rho_k - rho_l| <= 6 < 8``): ``v2(dV) <= 15 + 30``;
* swaps in 8-byte dtypes: ``dV = 2(a-b)(Y_b - Y_a)``, guaranteed whenever the low
  halves of ``Y`` differ (``+x``/``-x``, ``0.0``/``-0.0``, small integers of either
  sign...); the only possible misses have ``X_a ^ X_b`` equal to the same 32-bit
  mask D in both halves with ``v2(a-b) + v2(D) >= 31`` (no bijective word map
  avoids every such exception);
* **any two bit flips** in one tensor, dtypes of <= 4 bytes in tensors under 2**24 lanes
  (64 MiB), 8-byte dtypes under 2**30 words: a flip of bit b changes its lane by
  ``+-2**b``. In one lane it is a single change. In lanes i != j with ``b_i + rho_i !=
  b_j + rho_j``, ``v2(dV)`` is the smaller, ``<= 37``. With both equal to e, write
  ``w = 2**rho u``, ``u = 1 + 2**(8 - rho) (2k + 1)`` odd: ``dV = 2**e (+-u_i +- u_j)``. With
  ``rho_i != rho_j`` the bracket has ``v2 = 1`` (a sum: ``2`` plus multiples of 4) or
  ``min(8 - rho) <= 8`` (a difference); with ``rho_i = rho_j`` (so ``b_i = b_j``) it is
  ``2 + 2**(9 - rho) (i + j + 1)`` (``v2 = 1``) or ``2**(9 - rho) (i - j)``, and ``v2(dV) = b +
  9 + v2(i - j) <= 40 + 23``. In 64-bit words a flip of bit c changes ``Y`` by ``2**e u``,
  ``e = c mod 32``, ``u`` odd and ``u = +-1 mod 2**32`` (a flip in the high half flips bit c
  of ``Y`` and bit c - 32 of its low half). In one word it is a single change. In words
  i != j with unequal e, ``v2(dV)`` is the smaller e. With equal e, ``dV = 2**e [u_i (2i+1)
  + u_j (2j+1)]``, and the bracket is ``+-2 (i+j+1)`` or ``+-2 (i-j)`` modulo 2**32,
  neither 0, so ``v2(dV) <= 31 + 31``;
* dtype, shape, number of elements and version are part of the value (``zeros(4)`` and
  ``zeros(5)`` differ, as do ``-0.0`` and ``+0.0``, and NaNs with other payloads);
* no Python ``hash()``: the value is the same in every process and on every
  machine, CPU or CUDA (little-endian).

Version 1 proves the single change, swaps (tensors under 2**32 lanes) and two flips
(tensors under 2**31 lanes), but no burst: its weights ``2k+1`` cancel in 4 adjacent lanes
(``(2k+1) - (2k+3) - (2k+5) + (2k+7) = 0``), so the same bit of 4 float32 elements that held
0, 1, 1, 0 there goes unseen (about 1 random burst of 4 in 8). Version 2 trades the larger
tensors of its two-flip and swap proofs (two flips at the same bit in lanes of equal
``rho`` a multiple of ``2**(55 - b)`` apart, in opposite directions, can cancel in a
tensor of more than ``2**24`` lanes) for the bursts.

What is not guaranteed, version 2: changes whose weighted sum is 0 modulo 2**64. ``V`` is
linear in the lanes, so such patterns exist: a lane up by 800 and its left neighbour down by
2000 (``800 * 800 = 2000 * 320``, the weights of lanes 1 and 0), flips of many bits; bursts
with each lane's own bit (``bench/BURSTS.md`` measures them: none seen in 100,000 random
draws of up to 64 lanes); bursts in 8-byte dtypes, whose words keep the odd weights.

Only the final 8 bytes leave the device, and only when ``fingerprint`` (not
``fingerprint_tensor``) is called.

On the CPU a small C kernel (``sdc_guard.fingerprints.native``, sources in ``kernel/``,
built with the system C compiler on first use) computes the same sums in one read pass
where the torch path takes three (so about as fast as ``torch.sum``), and the few words
per tensor are mixed as Python ints (no tensor operation); the values are identical
either way. Without a compiler, or with ``SDC_GUARD_NATIVE=0``, the torch path runs
(``native_enabled()`` says which). The torch path values a list of tensors in one multi-tensor pass
(``tensor_values``, ``sdc_guard.fingerprints.batched``), in a number of ops that does not grow
with the number of tensors (on a GPU each op is a launch). The replay audit uses a
linear digest instead, version 2's lane sum without the mixing
(``sdc_guard.fingerprints.digest``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from sdc_guard.fingerprints.batched import (
    MODE_LANES,
    MODE_LANES_V2,
    MODE_WORDS,
    split,
    stream_values,
)
from sdc_guard.fingerprints.native import NativeKernel, active_kernel
from sdc_guard.fingerprints.weighted import (
    prep_lanes,
    prep_words,
    raw_bytes,
    tail_word,
    weighted_sum,
)
from sdc_guard.fingerprints.words import (
    FINGERPRINT_VERSION,
    LANES_V2,
    MASK64,
    SEED,
    check_version,
    lane_weight,
    mix64,
    mix64_int,
    to_signed64,
    to_unsigned64,
)

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


_meta_cache: dict[tuple[torch.dtype, tuple[int, ...], int], int] = {}


def _meta_word(t: torch.Tensor, version: int = 1) -> int:
    key = (t.dtype, tuple(t.shape), version)
    h = _meta_cache.get(key)
    if h is not None:
        return h
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(
            f"fingerprint: dtype {t.dtype} is not supported; supported dtypes are "
            f"{sorted(str(d) for d in _DTYPE_CODES)}. Convert the tensor with .to(...) first."
        )
    h = mix64_int(SEED ^ code ^ ((version - 1) << 48))  # the version too: v1 as it was
    h = mix64_int(h + t.dim())
    for s in t.shape:
        h = mix64_int(h + s)
    if len(_meta_cache) > 4096:
        _meta_cache.clear()
    _meta_cache[key] = h
    return h



def tensor_value(t: torch.Tensor, version: int = FINGERPRINT_VERSION) -> torch.Tensor:
    """V of the module docstring, as a 0-d int64 tensor (modulo 2**64) on t's device."""
    raw = raw_bytes(t)
    unit = 8 if t.element_size() == 8 else 4
    full = raw.numel() // unit * unit
    body = raw[:full]
    if unit == 8:
        value = weighted_sum(body.view(torch.int64), prep_words)
    else:
        value = weighted_sum(body.view(torch.uint32), prep_lanes, version=version)
    if full < raw.numel():  # the last, partial lane: zero-padded, lane k = full/4's weight
        value = value + to_signed64(lane_weight(full // 4, version)) * tail_word(raw, full, 4)[0]
    return value


_key_cache: dict[tuple[torch.device, bool, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}


_key_int_cache: dict[tuple[bool, tuple[int, ...]], tuple[int, ...]] = {}


def _key_ints(is_list: bool, metas: tuple[int, ...]) -> tuple[int, ...]:
    """Per-position keys, unsigned: the tensor's dtype/shape word mixed with its index in the
    list."""
    key = (is_list, metas)
    k = _key_int_cache.get(key)
    if k is None:
        k = tuple(mix64_int(mix64_int(m + i * SEED) ^ (0xA5A5 if is_list else 0x5A5A))
                  for i, m in enumerate(metas))
        if len(_key_int_cache) > 256:
            _key_int_cache.clear()
        _key_int_cache[key] = k
    return k


def _keys(device: torch.device, is_list: bool, metas: tuple[int, ...],
          idx: tuple[int, ...]) -> torch.Tensor:
    """``_key_ints`` at positions ``idx``, as an int64 vector on ``device``."""
    key = (device, is_list, metas, idx)
    k = _key_cache.get(key)
    if k is None:
        words = _key_ints(is_list, metas)
        k = torch.tensor([to_signed64(words[i]) for i in idx], dtype=torch.int64,
                         device=device)
        if len(_key_cache) > 256:
            _key_cache.clear()
        _key_cache[key] = k
    return k


def _native_value(t: torch.Tensor, kernel: NativeKernel, version: int) -> int:
    """``tensor_value`` of a CPU tensor by one call of the C kernel, unsigned, on the host.

    A contiguous tensor on an 8-byte boundary is read where it lies (no view: a tensor
    operation costs more than the pass on a small tensor); any other, and a lazy conjugate or
    negative view (its memory holds the values before the op), is copied first."""
    copy = None
    if t.is_contiguous() and t.data_ptr() % 8 == 0 and not (t.is_conj() or t.is_neg()):
        at, n = t.data_ptr(), t.numel() * t.element_size()
    else:
        copy = raw_bytes(t)
        at, n = copy.data_ptr(), copy.numel()
    if t.element_size() == 8:
        return kernel.words_at(at, n // 8, 1)[0]
    full = n // 4 * 4
    value = kernel.words_at(at, full // 4, LANES_V2 if version == 2 else 0)[0]
    if full < n:  # the last, partial lane: zero-padded, lane k = full/4's weight
        tail = int.from_bytes(ctypes.string_at(at + full, n - full), "little")
        value = (value + lane_weight(full // 4, version) * tail) & MASK64
    del copy  # the copy lives until the kernel has read it
    return value


@dataclass(eq=False)
class WeightSums:
    """A layer's weight whose checksum sums the fingerprint pass takes in the same read
    (``fingerprint_with_sums``): the checksum check asks, the weights check's pass answers
    (``sdc_guard.checks.checksum``)."""

    weight: torch.Tensor
    """float32, 2-D (``rows x cols``), contiguous, on the CPU."""
    bias: torch.Tensor | None
    """float32, ``rows`` contiguous, on the CPU, or None."""
    out: torch.Tensor
    """float32, ``2 cols + 2 rows + 2``: ``[e^T W, e^T |W|, W e, |W| e]``, then the bias's
    sum and absolute sum."""
    threads: int
    """The pass's threads: the sums' bits are the same from one pass to the next with the
    same threads (``NativeKernel.fp_wsum_at``)."""
    taken: bool = False
    """Set when a pass wrote ``out``."""
    _args: dict[str, Any] | None = field(default=None, init=False, repr=False)
    """``fp_wsum_at``'s arguments, found at the first pass (the tensors do not change: a
    weight that does is asked for anew)."""

    def take(self, kernel: NativeKernel, version: int = FINGERPRINT_VERSION) -> int:
        """One pass: ``out`` written; the weight's ``V`` (``tensor_value``) in ``version``,
        unsigned (the sums' bits do not depend on the version)."""
        args = self._args
        if args is None:
            rows, cols = self.weight.shape
            at = self.out.data_ptr()
            args = self._args = {
                "W": self.weight.data_ptr(), "rows": rows, "cols": cols,
                "bias": None if self.bias is None else self.bias.data_ptr(), "wsum": at,
                "bsum": at + 4 * (2 * cols + 2 * rows), "threads": self.threads}
        self.taken = True
        return kernel.fp_wsum_at(**args, version=version)


def _native_fingerprint(tensors: list[torch.Tensor], is_list: bool,
                        sums: dict[int, WeightSums] | None = None,
                        version: int = FINGERPRINT_VERSION) -> int | None:
    """The fingerprint, unsigned, of CPU tensors: every tensor's term (its ``V`` mixed with
    its key) by one call of the C kernel for the whole list (no tensor operation: on small
    tensors their dispatch, and a call per tensor, cost many times the pass itself); None
    when the kernel is off or a tensor is not on the CPU. ``sums``: address -> a weight
    whose pass also takes its checksum sums (``WeightSums``), if the tensor there has its
    shape."""
    kernel = active_kernel()
    if kernel is None or not all(t.is_cpu for t in tensors):
        return None
    total = mix64_int(len(tensors) + (SEED if is_list else 0))
    keys = _key_ints(is_list, tuple(_meta_word(t, version) for t in tensors))
    lanes = LANES_V2 if version == 2 else 0
    at, nbytes, modes, rest, copies = [], [], [], [], []
    for t, k in zip(tensors, keys, strict=True):
        ptr = t.data_ptr()
        ask = sums.pop(ptr, None) if sums else None
        if (ask is not None and ask.weight.shape == t.shape and t.dtype == torch.float32
                and t.is_contiguous()):
            total += mix64_int(ask.take(kernel, version) + k)
            continue
        if ptr % 8 == 0 and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            n = t.nbytes  # read where it lies (a view costs more than the pass on a small one)
        else:  # a lazy conjugate or negative view's memory holds the values before the op
            copy = raw_bytes(t)
            copies.append(copy)  # lives until the kernel has read it
            ptr, n = copy.data_ptr(), copy.numel()
        at.append(ptr)
        nbytes.append(n)
        modes.append(1 if t.element_size() == 8 else lanes)
        rest.append(k)
    total += kernel.fingerprint_terms(at, nbytes, modes, rest)
    del copies
    return mix64_int(total)


def fingerprint_with_sums(tensors: list[torch.Tensor], sums: Sequence[WeightSums],
                          version: int = FINGERPRINT_VERSION) -> torch.Tensor:
    """``fingerprint_tensor(tensors)``, with the checksum sums of the weights in ``sums``
    taken in the same read where the C kernel runs (each one's ``taken`` says; one that is
    not among ``tensors``, or is not a contiguous 2-D float32 CPU matrix, is not taken)."""
    ask = {s.weight.data_ptr(): s for s in sums
           if s.weight.dim() == 2 and s.weight.dtype == torch.float32}
    value = _native_fingerprint(tensors, True, ask, version) if ask else None
    if value is None:
        return fingerprint_tensor(tensors, version=version)
    return torch.tensor(to_signed64(value), dtype=torch.int64)


def _tensors(x: torch.Tensor | Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """The tensors of ``x`` and whether it was a list; a clear error for anything else."""
    tensors: list[torch.Tensor] = [x] if isinstance(x, torch.Tensor) else list(x)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"fingerprint: item {i} is a {type(t).__name__}, not a torch.Tensor; "
                "pass a tensor or an iterable of tensors."
            )
        if t.layout != torch.strided:
            raise TypeError(f"fingerprint: item {i} is a {t.layout} tensor; only dense tensors "
                            "have one layout of bits to fingerprint: pass t.to_dense().")
        if t.is_meta:
            raise ValueError(f"fingerprint: item {i} is on the meta device and holds no data; "
                             "fingerprint a tensor that has its values.")
    return tensors, not isinstance(x, torch.Tensor)


def fingerprint_tensor(x: torch.Tensor | Iterable[torch.Tensor], *,
                       version: int = FINGERPRINT_VERSION) -> torch.Tensor:
    """The fingerprint as a 0-d int64 tensor on the (first) tensor's device. No host sync.

    The int64 holds the same bits as the unsigned value ``fingerprint`` returns.
    Tensor k of a list contributes ``mix(V_k + key_k)`` to a wrapping sum, where
    ``key_k`` encodes its dtype, shape and position; a change to one element of one
    tensor changes exactly one term (``mix`` is a bijection), so it always changes
    the sum, and the final ``mix`` keeps it changed. ``version``: 2 (the default) or 1
    (``words.VERSIONS``; 1 to verify what an older release recorded).
    """
    version = check_version(version, "fingerprint_tensor")
    tensors, is_list = _tensors(x)
    device = tensors[0].device if tensors else torch.device("cpu")
    value = _native_fingerprint(tensors, is_list, None, version)
    if value is not None:
        return torch.tensor(to_signed64(value), dtype=torch.int64)
    metas = tuple(_meta_word(t, version) for t in tensors)
    if not tensors:
        start = mix64_int(SEED if is_list else 0)
        return mix64(torch.tensor(to_signed64(start), dtype=torch.int64))
    host = ([i for i, t in enumerate(tensors) if t.device.type == "cpu"]
            if device.type != "cpu" else [])
    return _device_fingerprint(tensors, is_list, metas, device, host, version)


def _device_fingerprint(tensors: Sequence[torch.Tensor], is_list: bool,
                        metas: tuple[int, ...], device: torch.device,
                        host: Sequence[int], version: int) -> torch.Tensor:
    """``fingerprint_tensor`` by torch ops on ``device``, with the terms of the tensors at
    positions ``host`` (CPU tensors in a device's list: an optimizer's step counters) summed
    on the host as Python ints: copying each to the device would cost a copy and a wait for
    the device's queue. The start and those terms reach the device as one Python int, an
    argument of the op that adds it (no copy)."""
    start = mix64_int(len(tensors) + (SEED if is_list else 0))
    keys = _key_ints(is_list, metas)
    for i in host:
        start += mix64_int(_host_value(tensors[i], version) + keys[i])
    skip = set(host)
    here = [i for i in range(len(tensors)) if i not in skip]
    # The terms are summed: the values may come in any order, with their keys in the same.
    values, order = _grouped_values([tensors[i] for i in here], device, version)
    terms = mix64(values + _keys(device, is_list, metas, tuple(here[j] for j in order)))
    return mix64(terms.sum() + to_signed64(start))


def _host_value(t: torch.Tensor, version: int) -> int:
    """``tensor_value`` of a CPU tensor, unsigned, as a Python int (the C kernel, else torch
    ops on the CPU and a read of their result: CPU memory, no device to wait for)."""
    kernel = active_kernel()
    if kernel is not None:
        return _native_value(t, kernel, version)
    return to_unsigned64(int(tensor_value(t, version)))


def tensor_values(tensors: Sequence[torch.Tensor], device: torch.device,
                  version: int = FINGERPRINT_VERSION) -> torch.Tensor:
    """V of each tensor, an int64 vector on ``device``, in a number of torch ops that does not
    grow with the number of tensors (``_grouped_values``)."""
    values, order = _grouped_values(tensors, device, version)
    if order == sorted(order):
        return values
    inverse = [0] * len(order)
    for j, i in enumerate(order):
        inverse[i] = j
    return values[_positions(device, inverse)]


def _grouped_values(tensors: Sequence[torch.Tensor], device: torch.device,
                    version: int) -> tuple[torch.Tensor, list[int]]:
    """V of each tensor, an int64 vector on ``device``, in the order of the indices returned
    with it. The tensors on ``device`` under ``alone_bytes`` go through one multi-tensor pass
    per way of reading (lanes, words; ``sdc_guard.fingerprints.batched``), chunk by chunk;
    each larger one is valued alone (``tensor_value``: there are at most total bytes /
    ``alone_bytes`` of them, and they skip the pass's copy); the tensors on another device are
    valued there and their values moved, one copy per device."""
    if len(tensors) <= 1:
        return ((tensor_value(tensors[0], version).to(device).reshape(1) if tensors
                 else torch.zeros(0, dtype=torch.int64, device=device)), list(range(len(tensors))))
    parts_of = split(tensors, device)
    alone, elsewhere = parts_of.alone, parts_of.elsewhere
    lanes = MODE_LANES_V2 if version == 2 else MODE_LANES
    streams: dict[int, list[int]] = {lanes: [], MODE_WORDS: []}
    for i in parts_of.batched:
        streams[MODE_WORDS if tensors[i].element_size() == 8 else lanes].append(i)
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for mode, idx in streams.items():
        if idx:
            parts.append(stream_values([tensors[i] for i in idx], mode, device))
            order += idx
    if alone:
        parts.append(torch.stack([tensor_value(tensors[i], version) for i in alone]))
        order += alone
    for other, idx in elsewhere.items():
        parts.append(tensor_values([tensors[i] for i in idx], other, version).to(
            device, non_blocking=True))
        order += idx
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), order


_position_cache: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _positions(device: torch.device, idx: list[int]) -> torch.Tensor:
    """``idx`` as an index tensor on ``device``, kept (indexing a GPU tensor with a Python
    list copies the list there: a stream sync at every call)."""
    key = (device, tuple(idx))
    t = _position_cache.get(key)
    if t is None:
        if len(_position_cache) > 256:
            _position_cache.clear()
        t = _position_cache[key] = torch.tensor(idx, dtype=torch.int64, device=device)
    return t


def fingerprint(x: torch.Tensor | Iterable[torch.Tensor], *,
                version: int = FINGERPRINT_VERSION) -> int:
    """A 64-bit fingerprint of the exact bits of a tensor (or an ordered list of tensors).

    Returns an int with ``0 <= v < 2**64``. See the module docstring for what
    is guaranteed to change it. ``version``: 2 (the default) or 1, to verify a value an
    older release recorded (``words.VERSIONS``).
    """
    version = check_version(version, "fingerprint")
    tensors, is_list = _tensors(x)
    value = _native_fingerprint(tensors, is_list, None, version)
    if value is not None:
        return value
    return to_unsigned64(int(fingerprint_tensor(tensors[0] if not is_list else tensors,
                                                version=version).item()))
