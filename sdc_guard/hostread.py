"""The step's one read from the device: what the checks need on the host before the optimizer step.

On a GPU every value the host reads (``.item()``, ``.tolist()``, ``bool(t)``) waits for all the
work queued before it, and while it waits the host queues nothing: the next step's kernels
start late. A guarded step needs some values on the host before the optimizer step (does any
rank withhold it? do the replicas' weights agree? which rank raised which flag?), so it reads
them, but once: every check puts the tensors it needs on the step's ``StepRead`` (``ask``)
first, and the first check that wants a value (``get``) reads them all, widened to int64
bits and joined in one tensor, with one ``.tolist()``. A check that did not ask reads on its
own (a second read: ``tests/sdc_guard/test_host_reads.py`` fails when one appears).

``on_host(x)``: can values on ``x``'s device be used on the host without waiting for a device
(the CPU's can)? The checks take host shortcuts there (Python bools and ints, no tensor op).
``cpu_as_device()`` makes the CPU answer no, so the code that runs on GPUs runs on the CPU
and its reads can be counted there (the tests' proxy for a GPU's synchronisations).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Final

import torch

_cpu_is_device = False


def on_host(x: torch.Tensor | torch.device) -> bool:
    """Can a value on ``x``'s device be read without waiting for a device? (The CPU's, unless
    ``cpu_as_device`` is on.)"""
    device = x.device if isinstance(x, torch.Tensor) else x
    return device.type == "cpu" and not _cpu_is_device


@contextlib.contextmanager
def cpu_as_device() -> Iterator[None]:
    """While entered, the checks treat the CPU as a device: they take the path they take on a
    GPU (values kept in tensors, read in the step's one read) instead of the host shortcuts.
    Process-wide (the comm hook's callbacks run on other threads); for tests and benchmarks
    that count reads on the CPU, with the C kernel off (``native_kernel(False)``)."""
    global _cpu_is_device
    saved, _cpu_is_device = _cpu_is_device, True
    try:
        yield
    finally:
        _cpu_is_device = saved


_CARRIERS: Final = {torch.float64: torch.int64, torch.float32: torch.int32,
                    torch.float16: torch.int16, torch.bfloat16: torch.int16}
"""Floating dtypes -> the integer dtype of their size: a float travels as its exact bits."""

_F32, _I32, _U32 = struct.Struct("<f"), struct.Struct("<i"), struct.Struct("<I")
_F64, _I64 = struct.Struct("<d"), struct.Struct("<q")
_F16, _I16 = struct.Struct("<e"), struct.Struct("<h")

Value = bool | int | float


def _decode(dtype: torch.dtype, bits: list[int]) -> list[Value]:
    """The values whose int64-widened bits are ``bits`` (``_widened``), as ``.tolist()`` gives
    them: a float from its exact bits (a NaN's payload aside, as Python floats keep it)."""
    if dtype == torch.float32:
        return [_F32.unpack(_I32.pack(b))[0] for b in bits]
    if dtype == torch.float64:
        return [_F64.unpack(_I64.pack(b))[0] for b in bits]
    if dtype == torch.float16:
        return [_F16.unpack(_I16.pack(b))[0] for b in bits]
    if dtype == torch.bfloat16:  # the top half of a float32
        return [_F32.unpack(_U32.pack((b & 0xFFFF) << 16))[0] for b in bits]
    if dtype == torch.bool:
        return [b != 0 for b in bits]
    return list(bits)


def _widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, as int64: integers and bools by value, floats by their bits."""
    flat = t.detach().reshape(-1)
    carrier = _CARRIERS.get(flat.dtype)
    if carrier is not None:
        flat = flat.contiguous().view(carrier)
    elif flat.dtype.is_floating_point or flat.dtype.is_complex:
        raise TypeError(f"StepRead.ask: a {flat.dtype} tensor cannot travel in the step's "
                        "read; ask for float64/32/16, bfloat16, integer or bool tensors.")
    return flat.to(torch.int64)


class StepRead:
    """The tensors the checks need on the host before this step's optimizer step, read in one
    go (per device) the first time any of them is wanted."""

    def __init__(self) -> None:
        self._asked: list[torch.Tensor] = []
        self._by_id: dict[int, int] = {}
        self._values: list[list[Value]] | None = None
        self.reads = 0
        """How many reads ``get`` made (one per device asked from; 0 until something is got)."""

    def ask(self, t: torch.Tensor) -> int:
        """Put ``t`` (a small tensor of flags, words or floats) on the read; its handle for
        ``get``. Asking for the same tensor object again gives the same handle."""
        if self._values is not None:
            raise RuntimeError("StepRead.ask: the step's values were read already; ask before "
                               "the first get (every check asks, then every check gets).")
        known = self._by_id.get(id(t))
        if known is not None and self._asked[known] is t:
            return known
        self._by_id[id(t)] = len(self._asked)
        self._asked.append(t)
        return len(self._asked) - 1

    def get(self, handle: int) -> list[Value]:
        """The values of the tensor asked as ``handle``, flattened, as ``.tolist()`` gives them."""
        if self._values is None:
            self._values = self._read()
        return self._values[handle]

    def _read(self) -> list[list[Value]]:
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(self._asked):
            by_device.setdefault(t.device, []).append(i)
        values: list[list[Value]] = [[] for _ in self._asked]
        for idx in by_device.values():
            parts = [_widened(self._asked[i]) for i in idx]
            joined = parts[0] if len(parts) == 1 else torch.cat(parts)
            bits = joined.tolist()  # the one read
            self.reads += 1
            at = 0
            for i, part in zip(idx, parts, strict=True):
                n = part.numel()
                values[i] = _decode(self._asked[i].dtype, bits[at:at + n])
                at += n
        self._asked = []
        return values
