"""What ``restore`` checks of a checkpoint before anything of it is loaded into the model.

A checkpoint is loaded only after it has passed every check: its size and SHA-256 (against
its manifest), the payload's step and generation against the manifest's, that it fits the
model and optimizers given (the same names, shapes, dtypes and optimizer types), and the
fingerprint of the state it would load against the recorded one, computed from the
loaded ``state_dict``\\ s in the canonical order ``state_tensors`` gives the live state. A
refused checkpoint leaves the model and the optimizers as they were.

A checkpoint that does not fit (``CheckpointMismatchError``) is not damaged, and an older one
of the same directory would not fit either: ``restore`` raises it. A damaged one
(``CheckpointError``) is logged, and the next older one tried.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sdc_guard.checkpoint.files import CheckpointError
from sdc_guard.fingerprints import fingerprint
from sdc_guard.fingerprints.words import FINGERPRINT_VERSION
from sdc_guard.optimizers import Optimizers, each


class CheckpointMismatchError(ValueError):
    """A sound checkpoint of another model or optimizer than the ones given (other names,
    shapes, dtypes or optimizer types); the message says what differs."""


def module_of(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper, or the model itself."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _own_loader(module: torch.nn.Module, key: str) -> bool:
    """Whether the module holding state ``key`` loads it with a loader of its own (a
    quantisation observer resizes its ranges): its buffers' shapes are its business."""
    owner = module
    for part in key.split(".")[:-1]:
        owner = getattr(owner, part, None)  # type: ignore[assignment]
        if not isinstance(owner, torch.nn.Module):
            return False
    return type(owner)._load_from_state_dict is not torch.nn.Module._load_from_state_dict


def _listed(label: str, items: list[str]) -> str:
    return f"{label}: {items[:4]}{' ...' if len(items) > 4 else ''}"


def refuse_other_model(file: Path, module: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    """Refuse, before anything loads, a checkpoint of another model: names it holds that the
    model has not, or the other way round, parameters or buffers of other shapes, tensors of
    other dtypes. ``load_state_dict`` would raise after loading what does fit (leaving the
    run half restored), or cast another dtype silently (and the fingerprint would call the
    result corrupt). Buffers of modules that load them with their own loader (a quantisation
    observer's ranges start empty and its loader resizes them) are their modules' business."""
    mine = module.state_dict()
    params = {k for k, _ in module.named_parameters()}
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    shapes, dtypes = [], []
    for k, v in mine.items():
        s = saved.get(k)
        if not isinstance(s, torch.Tensor) or not isinstance(v, torch.Tensor):
            continue
        if k not in params and _own_loader(module, k):
            continue
        if s.shape != v.shape:
            shapes.append(f"{k} {tuple(s.shape)} saved, {tuple(v.shape)} in the model")
        elif s.dtype != v.dtype:
            dtypes.append(f"{k} {s.dtype} saved, {v.dtype} in the model")
    parts = [_listed(label, items)
             for label, items in (("not in the checkpoint", missing),
                                  ("not in the model", unexpected), ("other shapes", shapes),
                                  ("other dtypes", dtypes)) if items]
    if parts:
        raise CheckpointMismatchError(
            f"CheckpointManager.restore: checkpoint {file} holds another model than the one "
            f"given ({'; '.join(parts)}). Nothing was loaded. Restore into the model it was "
            "saved from (the same architecture, sizes and dtype), or give a new model a "
            "directory of its own.")


def optimizer_types(optimizer: Optimizers) -> list[str]:
    """The optimizers' classes, as a checkpoint records them."""
    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in each(optimizer)]


def refuse_other_optimizers(file: Path, optimizer: Optimizers, saved: list[str] | None) -> None:
    """Refuse a checkpoint saved with optimizers of other types (a checkpoint of format 1
    does not record them: not checked)."""
    given = optimizer_types(optimizer)
    if saved is None or list(saved) == given:
        return
    short = [s.rsplit(".", 1)[-1] for s in saved]
    raise CheckpointMismatchError(
        f"CheckpointManager.restore: checkpoint {file} was saved with the optimizer(s) "
        f"{short}, and {[g.rsplit('.', 1)[-1] for g in given]} were given: their states do "
        "not translate. Nothing was loaded. Pass optimizers of the types it was saved with, "
        "or give the new optimizer a directory of its own.")


def refuse_other_layout(file: Path, optimizer: Optimizers, saved: Any) -> None:
    """Refuse a checkpoint of another number of optimizers, or whose param groups hold
    other numbers of parameters than the optimizers given, as ``load_state_dict`` of
    ``sdc_guard.optimizers`` does, before its state is read for the fingerprint."""
    where = "CheckpointManager.restore(optimizer)"
    single = isinstance(optimizer, torch.optim.Optimizer)
    opts = each(optimizer)
    if single and isinstance(saved, list):
        raise CheckpointMismatchError(
            f"{where}: the checkpoint {file} holds the state of {len(saved)} optimizers; "
            f"pass the same {len(saved)}, as a list in the order they were saved.")
    states = [saved] if single else saved
    if not isinstance(states, list) or len(states) != len(opts):
        count = len(states) if isinstance(states, list) else 1
        raise CheckpointMismatchError(
            f"{where}: the checkpoint {file} holds the state of {count} optimizer(s), and "
            f"{len(opts)} were given; pass the ones it was saved with, in the same order.")
    for i, (opt, sd) in enumerate(zip(opts, states, strict=True)):
        given = [len(g["params"]) for g in opt.param_groups]
        held = [len(g["params"]) for g in sd.get("param_groups", [])]
        if given != held:
            which = f"optimizer {i} ({type(opt).__name__})" if len(opts) > 1 else (
                type(opt).__name__)
            raise CheckpointMismatchError(
                f"{where}: the checkpoint's {which} has param groups of {held} parameters, "
                f"the one given {given}: pass the optimizer it was saved with (the same "
                f"parameters in the same groups, in the same order); checkpoint {file}.")


def payload_fingerprint(module: torch.nn.Module, optimizer: Optimizers,
                        payload: Mapping[str, Any], version: int = FINGERPRINT_VERSION) -> str:
    """The fingerprint the live state will have once ``payload`` is loaded, computed from the
    payload's ``state_dict``\\ s in ``state_tensors(module, optimizer, every=True)``'s order:
    the parameters (by their names), then each optimizer's state tensors, parameter by
    parameter in its groups' order, keys sorted (an optimizer that shards its state, known
    by ``consolidate_state_dict``, is left out, as there); in ``version`` (the one the
    manifest records)."""
    model_sd = payload["model"]
    tensors = [model_sd[name] for name, _ in module.named_parameters()]
    opts = each(optimizer)
    saved = payload["optimizer"] if isinstance(optimizer, (list, tuple)) else [
        payload["optimizer"]]
    for opt, sd in zip(opts, saved, strict=True):
        if callable(getattr(opt, "consolidate_state_dict", None)):
            continue
        state = sd.get("state", {})
        for group in sd.get("param_groups", []):
            for idx in group["params"]:
                st = state.get(idx) or {}
                for key in sorted(st, key=str):
                    v = st[key]
                    if isinstance(v, torch.Tensor):
                        tensors.append(v.detach())
    return f"{fingerprint(tensors, version=version):016x}"


def check_payload(info: Any, payload: Any, module: torch.nn.Module,
                  optimizer: Optimizers) -> None:
    """Every check of a loaded payload before it goes into ``module`` and ``optimizer``:
    the manifest's step and generation (``CheckpointError``), the model's and optimizers'
    fit (``CheckpointMismatchError``) and the fingerprint (``CheckpointError``)."""
    for field in ("step", "generation"):
        held = payload.get(field)
        if held != getattr(info, field):
            raise CheckpointError(f"checkpoint {info.file} holds {field} {held!r}, its manifest "
                                  f"{info.manifest.name} says {getattr(info, field)!r}: the "
                                  "manifest does not describe this file")
    refuse_other_model(info.file, module, payload["model"])
    refuse_other_layout(info.file, optimizer, payload["optimizer"])
    refuse_other_optimizers(info.file, optimizer, payload.get("optimizers"))
    try:
        got = payload_fingerprint(module, optimizer, payload, info.fingerprint_version)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {info.file}: its state does not have the layout "
                              f"of the model and optimizers given ({type(e).__name__}: {e})"
                              ) from e
    if got != info.fingerprint:
        raise CheckpointError(f"checkpoint {info.file}: the state it holds has fingerprint "
                              f"{got}, not the recorded {info.fingerprint}; nothing was loaded")
