"""Files that a killed process leaves whole or absent, and the random-number states a checkpoint keeps."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the reason."""


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``: written to a temporary name beside it, fsynced, renamed over it,
    and the directory fsynced: a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This rank's random-number-generator states, in types ``weights_only`` loading accepts."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return out
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    out["numpy"] = [str(name), torch.from_numpy(np.asarray(keys).astype(np.int64)), int(pos),
                    int(has_gauss), float(gauss)]
    return out


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
