r"""The ``extra`` states a checkpoint keeps beside the model: LR schedulers, ``GradScaler``\ s, loaders.

Anything with ``state_dict`` and ``load_state_dict``, every rank's, checked by name on
``save`` (its state must load with ``torch.load(weights_only=True)``, as ``restore`` loads
it) and on ``restore`` (the checkpoint must hold a state for every name given).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger("sdc_guard.checkpoint")


def extra_states(extra: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """``extra``'s objects checked (a name, ``state_dict`` and ``load_state_dict``); on
    ``save`` (``where``), their states, each checked to load with ``weights_only=True``."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"CheckpointManager.{where}(extra=...) must map names to objects "
                         f"with state_dict() and load_state_dict(), got {type(extra).__name__}")
    out: dict[str, Any] = {}
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"CheckpointManager.{where}(extra=...): the key {name!r} must be "
                             "a non-empty str (the name the state is saved under)")
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(
                f"CheckpointManager.{where}(extra={{{name!r}: ...}}): a "
                f"{type(obj).__name__} has no state_dict() and load_state_dict(); pass the "
                "object that owns the state (the LR scheduler, the GradScaler, the loader)")
        if where != "save":
            continue
        state = obj.state_dict()
        buf = io.BytesIO()
        try:
            torch.save(state, buf)
            buf.seek(0)
            torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as e:  # a state that restore could not load safely
            raise ValueError(
                f"CheckpointManager.save(extra={{{name!r}: ...}}): the state_dict() of this "
                f"{type(obj).__name__} does not load with torch.load(weights_only=True), as "
                f"restore loads it ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "make it hold tensors and plain Python values only") from e
        out[name] = state
    return out




def extra_held(info: Any, payload: dict[str, Any], extra: Mapping[str, Any] | None) -> None:
    """Refuse (before anything is loaded) a restore whose ``extra`` names a state the
    checkpoint does not hold: resuming with it left as it is would be silently wrong."""
    held = (payload.get("extra") or [{}])[0]
    missing = sorted(set(extra or {}) - set(held))
    if missing:
        raise ValueError(
            f"CheckpointManager.restore(extra=...): checkpoint {info.file} holds no state "
            f"for {missing} (it holds {sorted(held)}); it was saved without them. Pass "
            "save(..., extra=...) the same names, or restore this one without them and "
            "set their state yourself")


def load_extra(info: Any, payload: dict[str, Any], extra: Mapping[str, Any] | None, *,
               rank: int, world: int) -> None:
    """Give each object of ``extra`` this rank's saved state (the writer's, when the
    checkpoint was saved by another number of ranks)."""
    states = payload.get("extra") or [{}]
    if len(states) == world:
        mine = states[rank]
    else:
        mine = states[0]
        if extra:
            log.warning("sdc-guard: %s was saved by %d ranks, this job has %d; every rank "
                        "restores the writer's extra states %s", info.file, len(states),
                        world, sorted(extra))
    for name, obj in (extra or {}).items():
        try:
            obj.load_state_dict(mine[name])
        except Exception as e:
            raise ValueError(
                f"CheckpointManager.restore(extra={{{name!r}: ...}}): this "
                f"{type(obj).__name__}'s load_state_dict refused the state saved in "
                f"{info.file} ({type(e).__name__}: {e}); pass the same kind of object "
                "save was given") from e
    unused = sorted(set(mine) - set(extra or {}))
    if unused and rank == 0:
        log.warning("sdc-guard: %s also holds the states %s, which restore(extra=...) was "
                    "not given: they are left as they are", info.file, unused)
