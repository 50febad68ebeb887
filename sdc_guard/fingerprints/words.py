"""64-bit word helpers shared by the fingerprint, the replay digest and the collectives."""

from __future__ import annotations

from typing import Final

import torch

MASK64: Final = (1 << 64) - 1
SEED: Final = 0x9E3779B97F4A7C15

FINGERPRINT_VERSION: Final = 2
"""The fingerprint's version that is computed unless another is asked for
(``sdc_guard.fingerprints.public``: 1 weights 32-bit lanes ``2k + 1``, 2 weights them
``2**8 (2k + 1) + 2**rho(k)``, which no burst of one flip per lane over up to 64 adjacent
lanes cancels)."""
VERSIONS: Final = (1, 2)
"""Every version this library computes (a checkpoint records the one it was saved with)."""
LANES_V2: Final = 6
"""The C kernel's and the torch path's mode for 32-bit lanes under version 2, which the
replay digest reads too (mode 0 is version 1's lanes, 1 the 64-bit words of both versions, 2
raw 64-bit words)."""


def check_version(version: object, where: str) -> int:
    """``version`` if it is one of ``VERSIONS``; else a ValueError naming ``where``."""
    if isinstance(version, bool) or version not in VERSIONS:
        raise ValueError(f"{where}: fingerprint version {version!r} is not one of "
                         f"{list(VERSIONS)}; give {FINGERPRINT_VERSION} (the current one) or 1 "
                         "(to verify what an older release recorded).")
    return int(version)


def ruler_shift(i: int) -> int:
    """``rho(i) = 6 - min(v2(i + 1), 6)``: the exponent of the extra weight ``2**rho(i)`` of
    lane ``i`` in version 2 (it depends on ``i mod 64`` alone)."""
    return 6 - min(((i + 1) & -(i + 1)).bit_length() - 1, 6)


def lane_weight(i: int, version: int) -> int:
    """The weight of 32-bit lane ``i`` in ``version`` (modulo ``2**64``)."""
    if version == 1:
        return 2 * i + 1
    return ((2 * i + 1) << 8) + (1 << ruler_shift(i)) & MASK64


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

