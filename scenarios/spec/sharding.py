"""How a scenario model is spread over the ranks: DDP, FSDP2 or HSDP, as torchtitan applies them.

``shard_model`` wraps a freshly built model (``scenarios.spec.models.build_model``) on every
rank of an initialised process group: ``"ddp"`` in ``DistributedDataParallel``; ``"fsdp"``
with ``fully_shard`` on a 1-D mesh of every rank; ``"hsdp"`` with ``fully_shard`` on a 2-D
mesh ``("replicate", "shard")``, each parameter sharded within a row and replicated across
the rows. FSDP2 wraps each transformer block (each parameterised layer of the smaller
models) and then the root (embeddings, final norm, output), so one block's parameters are
gathered at a time. ``parallel_of`` reads back which of the three a wrapped model is, from
its parameters' ``DTensor`` meshes.

Activation checkpointing recomputes each block's forward in the backward
(``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations. It changes
the block's class in place, as ``fully_shard`` does, rather than nesting the block in a
wrapper module: parameter and module names stay those of the plain model, so the campaign's
fault targets and the checks' layer names mean the same modules under every wrapping.
"""

from __future__ import annotations

import math
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

PARALLELS: Final = ("ddp", "fsdp", "hsdp")
"""How ``shard_model`` may spread a model over the ranks."""
HSDP_DIMS: Final = ("replicate", "shard")
"""The names of an HSDP mesh's dimensions: replicas across the first, shards along the second."""


def shard_model(model: nn.Module, *, parallel: str, mesh_shape: tuple[int, ...],
                mixed_precision: bool = False, activation_checkpointing: bool = False) -> nn.Module:
    """``model`` spread over the default process group's ranks as ``parallel`` says.

    ``mesh_shape`` is ``(world,)`` for ``"ddp"`` and ``"fsdp"`` and ``(replicas, shards)``
    with ``replicas * shards == world`` for ``"hsdp"``. ``mixed_precision`` (FSDP2 only)
    gathers parameters in bfloat16 and reduces gradients in float32, the policy torchtitan
    trains with; the sharded parameters, and so the optimizer, keep the model's own dtype.
    ``activation_checkpointing`` recomputes each block in the backward (see the module's
    docstring). Call it on every rank with the same arguments (the meshes are collective).
    FSDP2 shards ``model`` in place and returns it; DDP returns its wrapper.
    """
    _check_arguments(parallel, mesh_shape, mixed_precision)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if parallel == "ddp":
        return DistributedDataParallel(model)
    if parallel == "fsdp":
        mesh = init_device_mesh("cpu", mesh_shape)
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=HSDP_DIMS)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    units = shard_units(model)
    for i, unit in enumerate(units):
        # the last block's parameters are needed again at once by the backward: keep them
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def parallel_of(model: nn.Module) -> tuple[str, tuple[int, ...]]:
    """Which of ``PARALLELS`` wraps ``model`` and on what mesh shape: ``("ddp", (world,))``,
    ``("fsdp", (world,))`` or ``("hsdp", (replicas, shards))``, read from the wrapper (DDP)
    or from the ``device_mesh`` of its parameters' ``DTensor``s (FSDP2)."""
    if isinstance(model, DistributedDataParallel):
        return "ddp", (dist.get_world_size(model.process_group),)
    meshes = {(p.device_mesh, tuple(p.placements))
              for p in model.parameters() if isinstance(p, DTensor)}
    if not meshes:
        raise ValueError(f"model: a {type(model).__name__} with no DTensor parameters is not "
                         f"wrapped by DDP or FSDP2; wrap it with shard_model(model, parallel=..., "
                         f"mesh_shape=...) first.")
    if len(meshes) > 1:
        raise ValueError(f"model: its parameters lie on {len(meshes)} different meshes or "
                         f"placements; parallel_of reads models wrapped by shard_model, whose "
                         f"parameters share one mesh.")
    mesh, placements = meshes.pop()
    shape = tuple(mesh.shape)
    if placements == (Shard(0),):
        return "fsdp", shape
    if placements == (Replicate(), Shard(0)):
        return "hsdp", shape
    raise ValueError(f"model: its parameters are placed {placements} on a mesh of shape {shape} "
                     f"(dims {mesh.mesh_dim_names}); only FSDP2's (Shard(0),) and HSDP's "
                     f"(Replicate(), Shard(0)) are data parallel layouts parallel_of knows.")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 wraps one by one before the root: a transformer's blocks
    (``model.blocks``); otherwise each top-level layer that holds parameters (the layers of
    a top-level ``nn.Sequential`` counted one by one)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        return list(blocks)
    units: list[nn.Module] = []
    for child in model.children():
        layers = list(child) if isinstance(child, nn.Sequential) else [child]
        units += [m for m in layers if any(True for _ in m.parameters())]
    return units


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Make each of ``shard_units(model)`` recompute its forward in the backward instead of
    keeping its activations, in place (names, parameters and ``isinstance`` unchanged).
    Applying it twice changes nothing more. ``shard_model`` calls it before wrapping."""
    for unit in shard_units(model):
        _checkpoint_in_place(unit)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` made ``module`` recompute its forward in
    the backward."""
    return isinstance(module, _Checkpointed)


class _Checkpointed(nn.Module):
    """Mixed into a block's class: its forward runs under ``torch.utils.checkpoint``."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inner = super().forward  # the block's own forward (the next class in the MRO)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)


_CHECKPOINTED_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def _checkpoint_in_place(module: nn.Module) -> None:
    """Give ``module`` the class ``Checkpointed<its class>``: still an instance of its own
    class, with the same names and parameters; its forward recomputed in the backward."""
    cls = type(module)
    if issubclass(cls, _Checkpointed):
        return
    if cls not in _CHECKPOINTED_CLASSES:
        _CHECKPOINTED_CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {})
    module.__class__ = _CHECKPOINTED_CLASSES[cls]


def _check_arguments(parallel: str, mesh_shape: tuple[int, ...], mixed_precision: bool) -> None:
    if parallel not in PARALLELS:
        raise ValueError(f"parallel={parallel!r} is not a way to spread a model; use one of "
                         f"{list(PARALLELS)} (tensor and pipeline parallel are not supported).")
    if (not isinstance(mesh_shape, tuple) or not mesh_shape
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                       for n in mesh_shape)):
        raise ValueError(f"mesh_shape={mesh_shape!r} must be a tuple of positive ints, e.g. "
                         f"(world,) for {parallel!r}" +
                         (" or (replicas, shards)." if parallel == "hsdp" else "."))
    if not dist.is_initialized():
        raise ValueError(f"parallel={parallel!r} needs an initialised default process group; "
                         f"call torch.distributed.init_process_group first.")
    world = dist.get_world_size()
    dims = 2 if parallel == "hsdp" else 1
    if len(mesh_shape) != dims:
        example = "(replicas, shards)" if dims == 2 else f"({world},)"
        raise ValueError(f"mesh_shape={mesh_shape} has {len(mesh_shape)} dimension(s); "
                         f"parallel={parallel!r} takes {dims}: use {example}.")
    if math.prod(mesh_shape) != world:
        replicas = 2 if world % 2 == 0 else 1
        example = f", e.g. ({replicas}, {world // replicas})" if parallel == "hsdp" else f": ({world},)"
        raise ValueError(f"mesh_shape={mesh_shape} covers {math.prod(mesh_shape)} ranks but the "
                         f"process group has {world}; give a mesh_shape whose product is "
                         f"{world}{example}.")
    if mixed_precision and parallel == "ddp":
        raise ValueError("mixed_precision=True is FSDP2's policy (bfloat16 parameters, float32 "
                         "reduction); for parallel='ddp' build the model in bfloat16 "
                         "(model.to(torch.bfloat16)) or use torch.autocast, and leave "
                         "mixed_precision False.")
