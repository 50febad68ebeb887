"""The files of a sharded checkpoint: its manifest, the checks before DCP reads it, removal.

Everything here reads or removes files; the collectives and the verdict live in
``sdc_guard.checkpoint.dcp``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from sdc_guard.checkpoint.files import CheckpointError
from sdc_guard.checkpoint.verify import CheckpointMismatchError, optimizer_types

log = logging.getLogger("sdc_guard.checkpoint")

FORMAT = 2
"""The schema of a sharded checkpoint's manifest and states file: 2 adds the fingerprint's
version (``fingerprint_version``; format 1 was fingerprinted with version 1, and is verified
with it)."""

READS = (1, 2)
"""The formats a sharded checkpoint is read in."""

KIND = "dcp"
"""A sharded checkpoint's manifest's ``kind`` (``CheckpointManager``'s have none)."""

STATE = "sdc_guard_state.pt"
"""The file beside DCP's that holds every rank's RNG and ``extra`` states."""


def read_manifest(m: Path) -> dict[str, Any]:
    """The manifest at ``m``, checked to be a sharded checkpoint's naming its own directory
    (``ValueError``/``KeyError``/``OSError`` say why not)."""
    rec = json.loads(m.read_text())
    if not isinstance(rec, dict):
        raise ValueError("not a JSON object")
    if rec.get("kind") != KIND:
        raise ValueError("it is a CheckpointManager (replicated) checkpoint's; read it with "
                         "sdc_guard.CheckpointManager")
    if rec.get("format") not in READS:
        raise ValueError(f"format {rec.get('format')!r}, and this sdc-guard reads sharded "
                         f"checkpoints of formats {list(READS)}: upgrade sdc-guard")
    if rec["file"] != m.stem:
        raise ValueError(f"it names the directory {rec['file']!r}, not its own {m.stem}")
    return rec


def state_bytes(state: dict[str, Any]) -> bytes:
    """``state`` serialized as ``restore`` loads it (``weights_only``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def check_files(directory: Path, rec: dict[str, Any]) -> None:
    """Every file the manifest lists is there, of its size; ``.metadata`` of its SHA-256."""
    for name, size in sorted(rec["files"].items()):
        p = directory / name
        try:
            got = p.stat().st_size
        except OSError as e:
            raise CheckpointError(f"checkpoint file {p} cannot be read: {e}") from e
        if got != size:
            raise CheckpointError(f"checkpoint file {p} is {got} bytes, its manifest says "
                                  f"{size}: truncated or replaced")
    meta = directory / ".metadata"
    digest = hashlib.sha256(_read(meta)).hexdigest()
    if digest != rec["sha256"]:
        raise CheckpointError(f"checkpoint file {meta}: SHA-256 {digest[:16]}... is not the "
                              f"recorded {str(rec['sha256'])[:16]}...: the file is corrupt")


def load_state(directory: Path, rec: dict[str, Any]) -> dict[str, Any]:
    """The RNG and ``extra`` states file, checked against its SHA-256 and loaded with
    ``weights_only=True``."""
    p = directory / STATE
    data = _read(p)
    digest = hashlib.sha256(data).hexdigest()
    if digest != rec["state"]["sha256"]:
        raise CheckpointError(f"checkpoint file {p}: SHA-256 {digest[:16]}... is not the "
                              f"recorded {str(rec['state']['sha256'])[:16]}...: the file is "
                              "corrupt")
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint file {p} does not load with weights_only=True: "
                              f"{e}") from e
    if not isinstance(state, dict) or state.get("step") != rec["step"]:
        raise CheckpointError(f"checkpoint file {p} is not the states file of step "
                              f"{rec['step']}")
    return state


def refuse_other(directory: Path, rec: dict[str, Any],
                 leaves: Sequence[tuple[str, torch.Tensor]],
                 opts: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse, before anything is read, a checkpoint of another model or optimizer: other
    keys, shapes or dtypes than the live state's, or other optimizer types."""
    saved = rec["tensors"]
    mine = {k: (list(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in leaves}
    missing = sorted(set(mine) - set(saved))
    unexpected = sorted(set(saved) - set(mine))
    other = [f"{k} {saved[k]['dtype']}{saved[k]['shape']} saved, {mine[k][1]}{mine[k][0]} "
             "here" for k in sorted(set(mine) & set(saved))
             if [saved[k]["shape"], saved[k]["dtype"]] != list(mine[k])]
    problems = [f"{label}: {items[:4]}{' ...' if len(items) > 4 else ''}"
                for label, items in (("missing from the checkpoint", missing),
                                     ("in the checkpoint, not here", unexpected),
                                     ("other shapes or dtypes", other)) if items]
    given = optimizer_types(opts)
    if list(rec.get("optimizers") or given) != given:
        problems.append(f"saved with the optimizer(s) {rec['optimizers']}, given {given}")
    if problems:
        raise CheckpointMismatchError(
            f"ShardedCheckpointManager.restore: checkpoint {directory} holds the state of "
            f"another model or optimizer ({'; '.join(problems)}). Nothing was loaded. Pass "
            "the model and optimizers it was saved with, or point the manager at their "
            "directory.")


def files_of(directory: Path,
             where: Sequence[tuple[str, tuple[int, ...] | None]]) -> list[str]:
    """The DCP files that hold each (key, box offsets) of ``where`` (offsets None: every box
    of the key), keys by DCP's flattened names, from its ``.metadata``; the directory when
    the metadata cannot say."""
    try:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        md = FileSystemReader(str(directory)).read_metadata()
    except Exception:  # the metadata itself is unreadable: name the directory
        return [str(directory)]
    names = set()
    for index, info in md.storage_data.items():
        for key, offsets in where:
            if index.fqn == key and (offsets is None or index.offset is None
                                     or tuple(index.offset) == tuple(offsets)):
                names.add(str(directory / info.relative_path))
    return sorted(names) or [str(directory)]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """Remove the directory ``path`` if it is there; a failure is logged, not raised."""
    if not path.exists():
        return
    try:
        shutil.rmtree(path)
    except OSError as e:
        log.warning("sdc-guard: cannot remove %s: %s", path, e)


def remove_file(path: Path) -> None:
    """Remove ``path`` if it is there; a failure is logged, not raised."""
    with contextlib.suppress(FileNotFoundError):
        try:
            path.unlink()
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                log.warning("sdc-guard: cannot remove %s: %s", path, e)


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {p} cannot be read: {e}") from e
