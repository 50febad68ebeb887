"""The replicated state, in one canonical order: what the checks compare and checkpoints fingerprint.

Shared by the weights check, the replay audit, the checksum check and
``sdc_guard.checkpoint``; it knows models and optimizers, never a check.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.optimizers import Optimizers, each


def ddp_ignored(model: torch.nn.Module) -> set[int]:
    """``id`` of each parameter that DDP leaves to each rank (named in the module's
    ``_ddp_params_and_buffers_to_ignore``): never broadcast nor all-reduced, so its replicas
    may differ by design. ``model``: the DDP model or the module inside it."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    names = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
    if not names:
        return set()
    return {id(p) for n, p in module.named_parameters() if n in names}


def local(t: torch.Tensor) -> torch.Tensor:
    """``t`` as this rank holds it: a ``DTensor``'s local shard (FSDP2), else ``t``; detached
    (a tensor that needs no gradient is its own)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.detach() if t.requires_grad else t


def state_tensors(
    model: torch.nn.Module, optimizer: Optimizers | None, *, every: bool = False
) -> list[torch.Tensor]:
    """The replicated state in canonical order: parameters, then optimizer state tensors
    (of each optimizer in turn, when several are given).

    Parameters that DDP ignores (``ddp_ignored``), and their optimizer state, are not
    replicated and are left out, unless ``every`` (a checkpoint's own fingerprint). So is
    the state of an optimizer that shards it over the ranks (``ZeroRedundancyOptimizer``,
    known by its ``consolidate_state_dict``): each rank holds another part. A sharded
    tensor (FSDP2's ``DTensor``) is given as this rank's shard."""
    with torch.no_grad():  # (a DTensor's to_local() outside autograd is its local tensor)
        return _state_tensors(model, optimizer, every)


def _state_tensors(model: torch.nn.Module, optimizer: Optimizers | None,
                   every: bool) -> list[torch.Tensor]:
    skip = set() if every else ddp_ignored(model)
    tensors = [local(p) for _, p in model.named_parameters() if id(p) not in skip]
    for opt in () if optimizer is None else each(optimizer):
        if callable(getattr(opt, "consolidate_state_dict", None)):
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in skip:
                    continue
                st = opt.state.get(p) or {}
                for key in sorted(st, key=str):
                    v = st[key]
                    if isinstance(v, torch.Tensor):
                        tensors.append(local(v))
    return tensors
