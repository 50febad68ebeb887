"""64-bit word helpers shared by the fingerprint, the replay digest and the collectives."""

from __future__ import annotations

from typing import Final

import torch

MASK64: Final = (1 << 64) - 1
SEED: Final = 0x9E3779B97F4A7C15


def to_signed64(v: int) -> int:
    """Map an unsigned 64-bit integer to the int64 with the same bits."""
    v &= MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def to_unsigned64(v: int) -> int:
    """Map an int64 to the unsigned 64-bit integer with the same bits."""
    return v & MASK64


def mix64_int(z: int) -> int:
    """splitmix64's finaliser on a Python int (a bijection on 64-bit words)."""
    z &= MASK64
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK64
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK64
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

