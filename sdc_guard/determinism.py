"""Deterministic mode: the precondition for a bit-exact replay audit.

``enable_determinism(seed)`` turns on PyTorch's deterministic algorithms, pins
cuDNN, sets the cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``; set before the
first CUDA call for it to take effect) and seeds every generator.
``rng_stream(seed, rank, step, micro)`` then gives each micro-batch of each
(rank, step) its own random stream, restoring the previous RNG state on exit, so
dropout and other random ops replay exactly on another rank.

What the user must guarantee: ``batch_for(rank, step)`` returns the same batch
every time it is called with the same arguments (no iterator state, no
data-dependent host randomness), and the loss function draws randomness only
from torch's generators. The guard refuses to build a replay audit without
``GuardConfig(deterministic=True)``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from sdc_guard.fingerprints.words import MASK64, SEED, mix64_int


def enable_determinism(seed: int = 0) -> None:
    """Deterministic kernels, pinned cuDNN, the cuBLAS workspace setting, seeded generators."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(seed)


def derive_seed(*parts: int) -> int:
    """A 64-bit seed determined by the integers ``parts`` alone: the same in every process
    and on every machine (no Python ``hash()``). Fault models draw from it."""
    h = SEED
    for p in parts:
        h = mix64_int(h + (p & MASK64))
    return h


def stream_seed(seed: int, rank: int, step: int, micro: int = 0) -> int:
    """A 63-bit seed for one (rank, step, micro-batch); the same in every process."""
    z = seed & MASK64
    for part in (rank, step, micro):
        z = mix64_int(z + SEED + part)
    return z >> 1


@contextlib.contextmanager
def rng_stream(
    seed: int, rank: int, step: int, micro: int, device: torch.device
) -> Iterator[None]:
    """Run a block on the random stream of (rank, step, micro); restore the RNG state after.

    What ``torch.random.fork_rng(devices=[device])`` does for the CPU generator (and
    ``device``'s, on CUDA), without its accelerator lookup: this runs every training step
    in deterministic mode and again in every replay, where that lookup cost more than the
    generator's state (about 0.1 ms a call, with the caches cold after a step).
    """
    cpu = torch.default_generator
    s = stream_seed(seed, rank, step, micro)
    cpu_state = cpu.get_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    # Not torch.manual_seed: on CPU-only builds its lazy CUDA seeding costs ~0.4 ms a call.
    cpu.manual_seed(s)
    try:
        if cuda_state is not None:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(s)
        yield
    finally:
        cpu.set_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
