"""Files that a killed process leaves whole or absent, and the random-number states a checkpoint keeps.

A write that fails (no space left, read-only storage, a quota) removes its temporary file
and raises ``CheckpointWriteError``, which names the file and the free space: nothing is
left behind that a later save would have to find.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the reason."""


class CheckpointWriteError(CheckpointError):
    """A file of the checkpoint directory could not be written: no space left, read-only
    storage, a quota. Every rank of a ``save`` raises the same one."""

    def __init__(self, path: Path | str, errno: int | None, reason: str,
                 free_bytes: int | None) -> None:
        self.path = Path(path)
        """The file that could not be written."""
        self.errno = errno
        """The operating system's error number (``errno.ENOSPC``, ``errno.EROFS``, ...)."""
        self.reason = reason
        self.free_bytes = free_bytes
        """The space free on the directory's file system when it failed (None: unknown)."""
        free = "unknown space" if free_bytes is None else f"{free_bytes} bytes"
        fix = {errnos.ENOSPC: "free space there or point the CheckpointManager at larger "
                              "storage (fewer checkpoints: a smaller keep)",
               errnos.EDQUOT: "raise the quota or free space there",
               errnos.EROFS: "mount the storage read-write to save (restore reads only)",
               errnos.EACCES: "give the job write access to the directory (restore reads "
                              "only)"}.get(errno or 0, "check the storage")
        super().__init__(f"{self.path} could not be written: {reason} ({free} free on "
                         f"{self.path.parent}); nothing of it was left behind; {fix}")

    def __reduce__(self) -> tuple[Any, ...]:  # travels to the other ranks whole
        return (CheckpointWriteError, (str(self.path), self.errno, self.reason,
                                       self.free_bytes))

    @classmethod
    def of(cls, path: Path, e: OSError) -> CheckpointWriteError:
        """The error for ``e`` raised while writing ``path``, with the free space now."""
        try:
            free: int | None = shutil.disk_usage(path.parent).free
        except OSError:
            free = None
        reason = e.strerror or str(e) or type(e).__name__
        return cls(path, e.errno, reason, free)


TMP = ".tmp"
"""What a temporary file's name holds: ``.<name>.tmp<pid>``, hidden, beside its file."""


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path``: written to a temporary name beside it, fsynced, renamed over it,
    and the directory fsynced: a reader sees the old file or the new one, never a part.
    On failure the temporary file is removed and ``CheckpointWriteError`` raised (an
    ``OSError`` of the storage: no space, read-only)."""
    tmp = path.with_name(f".{path.name}{TMP}{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # read-only storage: it was never created
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointWriteError.of(path, e) from e
        raise
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
