"""The harness's seeds: every random choice and every synthetic batch derives from these two.

``seed_of(*parts)`` seeds choices (which faults a campaign samples, their targets
and elements, the ranks' torch generators); ``data_generator(seed, rank, step,
micro)`` is the stream one micro-batch of synthetic data is drawn from. Both are
functions of their arguments alone: the same in every process, on every machine
and in every run (no Python ``hash()``), so trial ids, faults and golden runs are
reproducible. Neither formula may change without changing every campaign's trials
(``seed_of``) or every golden trajectory (``data_generator``).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch


def seed_of(*parts: Any) -> int:
    """A 56-bit seed determined by ``parts`` (anything JSON can print; order matters)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:7], "little")


def data_generator(seed: int, rank: int, step: int, micro: int) -> torch.Generator:
    """The CPU generator of one micro-batch of (``seed``, ``rank``, ``step``, ``micro``)."""
    key = ((seed * 1_000_003 + rank) * 1_000_033 + step) * 1_009 + micro
    return torch.Generator().manual_seed(key & ((1 << 63) - 1))
