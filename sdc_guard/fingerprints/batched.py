"""Odd-weighted sums of many tensors in a number of torch ops that does not grow with their count.

The torch path (every device but a CPU running the C kernel) values a list of tensors here:
on a GPU each torch op is a kernel launch or more, so a pass of ops per tensor costs launches
in proportion to a model's parameters. Here the ops depend on the dtypes present and on the
total bytes alone (one chunk per ``chunk_bytes`` of them, and a pass per tensor of
``alone_bytes`` or more), never on how many tensors there are.

How
---
A *stream* is the tensors read one way: the fingerprint's 32-bit lanes (``MODE_LANES``, or
``MODE_LANES_V2`` under version 2's weights, which the replay digest takes too) or its 64-bit
words mapped by ``X ^ (X >>> 32)`` (``MODE_WORDS``). Its tensors are laid end to end in a
reused byte scratch, each from a block boundary (a block is ``BLOCK`` values, ``_BLOCK_ROWS``
rows of ``_ROW``) and zero-padded to the next one, chunk after chunk so the scratch stays
bounded. Per chunk:

1. one ``torch._foreach_copy_`` per dtype into views of the scratch (cached per layout: no op
   per tensor); a copy keeps the bits, lays a non-contiguous tensor out, and resolves a lazy
   conjugate or negative view (a bool tensor goes as its bytes, a view each, which launches
   nothing: a copy as bool would write any nonzero byte as 1);
2. one ``torch._foreach_zero_`` of the padding;
3. the values ``v`` widened to int64 (lanes zero-extended; words ``X ^ (X >>> 32)``). On CUDA
   (``LANE_SUM_DEVICES``) lanes are not widened: the reductions below read them as ``uint32``
   and sum into int64;
4. ``v`` as ``[blocks, _BLOCK_ROWS, _ROW]``: the row sums ``R`` and each block's column sums
   ``C``, two reductions;
5. per block ``X_b = sum_r (2 P r + 2 s_b) R_br + sum_c (2c + 1) C_bc``, which is
   ``sum_k (2 (s_b + k) + 1) v_k`` over the block's values: ``s_b`` is the block's first value
   counted from where the weights start (its tensor's start for the fingerprint, the
   concatenation's for the digest), cached per layout (``MODE_LANES_V2``: the row weights
   times ``2**8`` and the column weights ``2**8 (2c + 1) + 2**rho(c)``).

A tensor's sum is then the sum of its blocks' ``X``: the differences of one running sum at the
tensors' boundaries (exact: integers wrap modulo 2**64 alike in any order, on every device).

Memory traffic per value of ``u`` bytes: read ``u`` and write ``u`` (the copy); then, for
32-bit lanes on CUDA, read 4 twice (the sums); elsewhere read ``u`` and write 8 (the widening)
and read 8 twice (the sums; on the CPU the chunk is read from cache); and
a 32nd as much for the per-block sums. For float32 on CUDA that is 16 bytes a value where
``torch.sum`` reads 4 (the per-tensor ops of ``weighted``: 28). A tensor of ``alone_bytes``
or more is valued on its own (``weighted.weighted_sum``: no copy, and the compiled single-read
pass on CUDA from ``FUSED_MIN``): there are at most total bytes / ``alone_bytes`` of those.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from sdc_guard.fingerprints.weighted import (
    _ROW,
    _scratch_buffer,
    lane_weights,
    prep_lanes,
    prep_words,
    raw_bytes,
)
from sdc_guard.fingerprints.words import LANES_V2

MODE_LANES: Final = 0
"""Elements of up to 4 bytes and complex128: unsigned 32-bit lanes, zero-extended."""
MODE_WORDS: Final = 1
"""8-byte elements: 64-bit words mapped by ``X ^ (X >>> 32)``."""
MODE_LANES_V2: Final = LANES_V2
"""``MODE_LANES`` under the fingerprint's version 2: lane ``k`` weighs
``2**8 (2k + 1) + 2**rho(k)``. ``rho`` has period 64, which divides ``_ROW``: the block's
row weights are version 1's times ``2**8``, its column weights ``2**8 (2c + 1) + 2**rho(c)``,
and no op changes."""

_BLOCK_ROWS: Final = 32
"""Rows of ``_ROW`` values per block. A tensor is padded to a whole block; the block's column
sums (``C``, written per block) are a 32nd of the values, and a reduction over 32 rows runs at
the speed of one over the whole chunk where one over 8 rows does not (on the CPU)."""
BLOCK: Final = _BLOCK_ROWS * _ROW
"""Values per block."""

CPU_CHUNK_BYTES: Final = 1 << 22
"""Bytes of tensors per chunk on the CPU: the chunk's copy and its int64 values stay in cache
between the passes over them."""
DEVICE_CHUNK_BYTES: Final = 1 << 27
"""Bytes per chunk on an accelerator: few chunks (each a dozen launches) for a large state,
with a byte scratch and an int64 copy of at most 3 x 128 MiB."""


CPU_ALONE_BYTES: Final = 1 << 20
"""On the CPU a tensor of this many bytes or more is valued by a pass of its own: the ops'
dispatch is small beside its pass there, and the copy into the scratch is not."""


def chunk_bytes(device: torch.device) -> int:
    """The most bytes of tensors one chunk takes on ``device``."""
    return CPU_CHUNK_BYTES if device.type == "cpu" else DEVICE_CHUNK_BYTES


def alone_bytes(device: torch.device) -> int:
    """Tensors of this many bytes or more on ``device`` are valued alone, not batched: one
    chunk's worth on an accelerator (launches count there), ``CPU_ALONE_BYTES`` on the CPU."""
    return min(CPU_ALONE_BYTES, CPU_CHUNK_BYTES) if device.type == "cpu" else DEVICE_CHUNK_BYTES


@dataclass(frozen=True)
class Split:
    """Indices of a list of tensors by how a multi-tensor pass on ``device`` takes them
    (``split``)."""

    batched: list[int]
    """On ``device`` and under ``alone_bytes``: read together, by the pass."""
    alone: list[int]
    """On ``device``, ``alone_bytes`` or more: each read by a pass of its own."""
    elsewhere: dict[torch.device, list[int]]
    """On another device, by device: valued there, the value moved."""


def split(tensors: Sequence[torch.Tensor], device: torch.device) -> Split:
    """Which of ``tensors`` the pass on ``device`` reads together, which alone, which
    elsewhere."""
    limit = alone_bytes(device)
    out = Split([], [], {})
    for i, t in enumerate(tensors):
        if t.device != device:
            out.elsewhere.setdefault(t.device, []).append(i)
        elif t.numel() * t.element_size() >= limit:
            out.alone.append(i)
        else:
            out.batched.append(i)
    return out


def unit_of(mode: int) -> int:
    """Bytes per value read in ``mode``."""
    return 4 if mode in (MODE_LANES, MODE_LANES_V2) else 8


@dataclass
class _Chunk:
    """One pass over a part of a stream's tensors."""

    copies: list[tuple[list[int], list[torch.Tensor]]]
    """Per dtype and contiguity: the tensors' indices in the stream and their views in the
    scratch."""
    pads: list[torch.Tensor]
    """uint8 views of the scratch between a tensor's end and its block's end."""
    nbytes: int
    """Bytes of the scratch the chunk fills (a whole number of blocks)."""
    row_weights: torch.Tensor
    """int64 ``[blocks, _BLOCK_ROWS]``: ``2 P r + 2 s_b``."""


@dataclass
class _Plan:
    """The layout of a stream: where each tensor lies in the scratch, and the cached tensors."""

    chunks: list[_Chunk]
    bounds: torch.Tensor
    """int64: 0, then each tensor's end in blocks over the whole stream."""
    scratch: torch.Tensor
    """The byte scratch the views were made in (a grown scratch makes the plan anew)."""


_COL_WEIGHTS: dict[tuple[torch.device, int], torch.Tensor] = {}
"""The column weights for c < ``_ROW``, per device and mode: ``2c + 1``, or under version 2
``2**8 (2c + 1) + 2**rho(c)``."""

_plans: dict[tuple[int, torch.device, int, int, tuple[object, ...]], _Plan] = {}

_local = threading.local()
"""Per thread: the byte scratch per device (a comm hook's thread digests while another thread
may value, and a plan's views are of one scratch)."""


def _scratch(device: torch.device, nbytes: int) -> torch.Tensor:
    """This thread's byte scratch on ``device``, at least ``nbytes`` (grown, never shrunk: the
    views a plan caches are of it)."""
    bufs: dict[torch.device, torch.Tensor] = getattr(_local, "bufs", None) or {}
    _local.bufs = bufs
    b = bufs.get(device)
    if b is None or b.numel() < nbytes:
        if b is not None:  # the plans made on the old scratch would keep it alive
            _plans.clear()
        with torch.inference_mode(False):  # made in inference mode, it could not be written after
            b = bufs[device] = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
    return b


def _col_weights(device: torch.device, mode: int) -> torch.Tensor:
    w = _COL_WEIGHTS.get((device, mode))
    if w is None:
        w = _COL_WEIGHTS[(device, mode)] = lane_weights(
            _ROW, device, 2 if mode == MODE_LANES_V2 else 1).clone()
    return w


def _layout_key(t: torch.Tensor) -> tuple[object, ...]:
    """What a plan depends on: the dtype and shape, and whether the copy takes a multi-tensor
    kernel (on CUDA only lists of dense tensors of one dtype do: the others are copied apart,
    so that one strided tensor does not make the whole list take a launch per tensor)."""
    return (t.dtype, tuple(t.shape), t.is_contiguous())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _build(tensors: Sequence[torch.Tensor], mode: int, device: torch.device,
           shifts: Sequence[int] | None) -> _Plan:
    """The plan of ``tensors`` read in ``mode``; ``shifts``: each tensor's first value's
    offset in the weights (None: 0, each tensor weighted from its own start)."""
    unit = unit_of(mode)
    block_bytes = BLOCK * unit
    limit = max(chunk_bytes(device), block_bytes)
    spans: list[list[int]] = [[]]  # the tensors of each chunk
    used = 0
    sizes = [-(-_nbytes(t) // block_bytes) * block_bytes for t in tensors]
    for i, size in enumerate(sizes):
        if used + size > limit and spans[-1]:
            spans.append([])
            used = 0
        spans[-1].append(i)
        used += size
    scratch = _scratch(device, max(sum(sizes[i] for i in span) for span in spans))
    chunks = []
    ends = [0]
    for span in spans:
        groups: dict[tuple[object, ...], tuple[list[int], list[torch.Tensor]]] = {}
        pads = []
        weights: list[torch.Tensor] = []
        at = 0
        for i in span:
            t = tensors[i]
            n = _nbytes(t)
            view = scratch[at : at + n].view(t.dtype).view(t.shape)
            idx, views = groups.setdefault((t.dtype, t.is_contiguous()), ([], []))
            idx.append(i)
            views.append(view)
            if sizes[i] > n:
                pads.append(scratch[at + n : at + sizes[i]])
            blocks = sizes[i] // block_bytes
            first = 0 if shifts is None else shifts[i]
            starts = torch.arange(blocks, dtype=torch.int64) * BLOCK + first
            weights.append((256 if mode == MODE_LANES_V2 else 1) * (
                2 * starts[:, None]
                + 2 * _ROW * torch.arange(_BLOCK_ROWS, dtype=torch.int64)[None, :]))
            ends.append(ends[-1] + blocks)
            at += sizes[i]
        row_weights = (torch.cat(weights) if weights
                       else torch.zeros(0, _BLOCK_ROWS, dtype=torch.int64))
        chunks.append(_Chunk(list(groups.values()), pads, at, row_weights.to(device)))
    return _Plan(chunks, torch.tensor(ends, dtype=torch.int64, device=device), scratch)


def _as_copied(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors as the pass copies them: a bool tensor as its bytes (a copy as bool would
    write any nonzero byte as 1, and the fingerprint is of the bytes). Those views are the
    only ops per tensor here; they launch nothing."""
    return [raw_bytes(t) if t.dtype == torch.bool else t for t in tensors]


def _plan(tensors: Sequence[torch.Tensor], mode: int, device: torch.device,
          shifts: Sequence[int] | None) -> _Plan:
    # Per thread, as the scratch the views are of.
    key = (threading.get_ident(), device, mode, chunk_bytes(device),
           (tuple(_layout_key(t) for t in tensors), None if shifts is None else tuple(shifts)))
    plan = _plans.get(key)
    if plan is None or plan.scratch is not _scratch(device, 0):
        if len(_plans) > 64:
            _plans.clear()
        with torch.inference_mode(False):  # views made in inference mode are not writable after
            plan = _plans[key] = _build(tensors, mode, device, shifts)
    return plan


LANE_SUM_DEVICES: set[str] = {"cuda"}
"""Device types whose pass sums the 32-bit lanes into int64 as it reads them, without the
widened copy (two reads of 4 bytes a value where the copy costs a read of 4, a write of 8 and
two reads of 8). Not the CPU: there its reductions of unsigned lanes are slower than the copy
and two int64 reductions from cache."""

_lane_sums_checked: dict[str, bool] = {}


def lane_sums(device: torch.device) -> bool:
    """Does ``device`` sum unsigned 32-bit lanes into int64 (``LANE_SUM_DEVICES``), with the
    widened copy's values? Tried once per device type on lanes with the top bit set: a torch
    without those reductions for ``uint32``, or one that sign-extends, takes the copy (the
    check reads one bool from the device, once)."""
    if device.type not in LANE_SUM_DEVICES:
        return False
    ok = _lane_sums_checked.get(device.type)
    if ok is None:
        try:
            lanes = (torch.arange(BLOCK, dtype=torch.int64, device=device) * 0x9E3779B1
                     ).to(torch.int32).view(torch.uint32).view(-1, _BLOCK_ROWS, _ROW)
            wide = torch.empty(BLOCK, dtype=torch.int64, device=device)
            prep_lanes(lanes.reshape(-1), wide)
            grid = wide.view(-1, _BLOCK_ROWS, _ROW)
            ok = bool(torch.equal(lanes.sum(2, dtype=torch.int64), grid.sum(2))
                      and torch.equal(lanes.sum(1, dtype=torch.int64), grid.sum(1)))
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _lane_sums_checked[device.type] = ok
    return ok


def _block_sums(plan: _Plan, tensors: Sequence[torch.Tensor], mode: int,
                device: torch.device) -> torch.Tensor:
    """``X_b`` of every block of the stream (module docstring), int64 on ``device``."""
    unit = unit_of(mode)
    cols = _col_weights(device, mode)
    lanes = mode in (MODE_LANES, MODE_LANES_V2)
    out = []
    for ch in plan.chunks:
        for idx, views in ch.copies:
            torch._foreach_copy_(views, [tensors[i] for i in idx])
        if ch.pads:
            torch._foreach_zero_(ch.pads)
        raw = plan.scratch[: ch.nbytes]
        n = ch.nbytes // unit
        if lanes and lane_sums(device):
            grid = raw.view(torch.uint32).view(-1, _BLOCK_ROWS, _ROW)
            rows = grid.sum(2, dtype=torch.int64)
            blocks = grid.sum(1, dtype=torch.int64)
        else:
            values = _scratch_buffer(n, device)
            (prep_lanes if lanes else prep_words)(
                raw.view(torch.uint32 if lanes else torch.int64), values)
            grid = values.view(-1, _BLOCK_ROWS, _ROW)
            rows = grid.sum(2)
            blocks = grid.sum(1)
        out.append((rows * ch.row_weights).sum(1) + (blocks * cols).sum(1))
    return out[0] if len(out) == 1 else torch.cat(out)


def stream_values(tensors: Sequence[torch.Tensor], mode: int,
                  device: torch.device) -> torch.Tensor:
    """``sum_k w_k v_k`` of each tensor read in ``mode`` (``w_k = 2k+1``; under
    ``MODE_LANES_V2`` version 2's lane weights), an int64 vector on ``device``
    (every tensor on ``device``; one over ``chunk_bytes(device)`` takes a chunk alone): the
    same values as
    ``weighted.weighted_sum`` per tensor, with the last partial lane or word zero-padded."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    tensors = _as_copied(tensors)
    plan = _plan(tensors, mode, device, None)
    with torch.no_grad():
        sums = _block_sums(plan, tensors, mode, device)
        running = torch.nn.functional.pad(torch.cumsum(sums, 0), (1, 0))
        return torch.diff(running[plan.bounds])


def stream_total(tensors: Sequence[torch.Tensor], shifts: Sequence[int],
                 device: torch.device) -> torch.Tensor:
    """``sum_t sum_k (2**8 (2 (2 shifts_t + k) + 1) + 2**rho(k)) L_tk`` over the 32-bit lanes
    ``L_tk`` of each tensor, the last zero-padded: the replay digest of the tensors laid at
    word offsets ``shifts`` of a concatenation (``sdc_guard.fingerprints.digest``). A 0-d
    int64 on ``device``."""
    if not tensors:
        return torch.zeros((), dtype=torch.int64, device=device)
    tensors = _as_copied(tensors)
    lanes = [2 * s for s in shifts]
    plan = _plan(tensors, MODE_LANES_V2, device, lanes)
    with torch.no_grad():
        return _block_sums(plan, tensors, MODE_LANES_V2, device).sum()
