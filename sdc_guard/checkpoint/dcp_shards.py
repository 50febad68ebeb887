"""What a sharded checkpoint records of the state each rank holds, and checks before loading it.

A ``torch.distributed.checkpoint`` state dict (``get_state_dict(model, optimizer)``) holds,
per key, a ``DTensor`` (FSDP2, HSDP: each rank holds one box of the whole tensor, its
``to_local()``) or a plain tensor (an optimizer's step counter: every rank holds all of
it). Two values are recorded of it at save:

* **each rank's fingerprint**: ``sdc_guard.fingerprint`` of the rank's local tensors in the
  canonical key order (``tensor_leaves``), and the layout they came in (``layout_digest``):
  restored on the same layout, every rank's fresh copy must have its own fingerprint;
* **each key's whole-tensor digest** (``piece_digest``): ``D = sum_g (2g + 1) X_g`` modulo
  2**64 over the elements' bits ``X_g`` (widened to 64 bits; complex128 as two words), ``g``
  the element's index in the whole tensor laid out contiguously. It is a sum over elements,
  so the boxes of any sharding add up to the same value: a resharded restore (another world
  size or mesh, which DCP reshards) is verified with it. Any single-element change changes
  it (``(2g + 1)`` is odd and the change is below 2**64 in 2-adic valuation); unlike the
  fingerprint it does not promise to see swaps.

Neither touches the model: they are computed on the tensors given, the live state at save
and the fresh copy DCP loaded into at restore.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from sdc_guard.fingerprints import fingerprint
from sdc_guard.fingerprints.words import FINGERPRINT_VERSION, MASK64

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_BLOCK = 1 << 20
"""Elements digested at once: the index and widened words of a block are held at once."""


@dataclass(frozen=True, slots=True)
class Box:
    """Where this rank's piece of one key lies in the whole tensor."""

    shape: tuple[int, ...]
    """The whole tensor's shape."""
    offsets: tuple[int, ...]
    """The piece's first index along each dimension."""
    sizes: tuple[int, ...]
    """The piece's shape (its ``to_local()``'s)."""
    dtype: str


def tensor_leaves(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a nested state dict, by their dotted path (DCP's flattened key), in
    the canonical order: sorted by path."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            out.append((path, node))
        elif isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(tree, prefix)
    return sorted(out, key=lambda kv: kv[0])


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


def box(t: torch.Tensor) -> Box:
    """Where ``t``'s local part lies in the whole tensor (DCP's own chunk of it: the piece
    this rank writes or, under replication, a copy of it)."""
    dtype = str(t.dtype).removeprefix("torch.")
    if not isinstance(t, DTensor):
        return Box(tuple(t.shape), (0,) * t.dim(), tuple(t.shape), dtype)
    chunks = t.__create_chunk_list__()  # type: ignore[no-untyped-call]  # DCP's own
    if len(chunks) != 1:
        raise ValueError(f"a DTensor of shape {tuple(t.shape)} with placements "
                         f"{t.placements} holds {len(chunks)} pieces on one rank; sharded "
                         "checkpoints handle one box per rank (FSDP2 and HSDP meshes)")
    return Box(tuple(t.shape), tuple(int(o) for o in chunks[0].offsets),
               tuple(int(s) for s in chunks[0].sizes), dtype)


def rank_fingerprint(leaves: Sequence[tuple[str, torch.Tensor]],
                     version: int = FINGERPRINT_VERSION) -> str:
    """``sdc_guard.fingerprint`` of this rank's local tensors, in ``leaves``' order, as hex, in
    ``version`` (the one a manifest records, when verifying it)."""
    return f"{fingerprint([local(t).detach() for _, t in leaves], version=version):016x}"


def layout_digest(boxes: Mapping[str, Box]) -> str:
    """A digest of which box of which key this rank holds: equal digests, equal layouts."""
    body = [[k, list(b.shape), list(b.offsets), list(b.sizes), b.dtype]
            for k, b in sorted(boxes.items())]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:32]


def piece_digest(piece: torch.Tensor, b: Box) -> int:
    """This box's part of the whole tensor's digest (the module's ``D``, as an unsigned int):
    the digests of the boxes that tile a tensor add up (modulo 2**64) to its digest."""
    t = piece.detach().contiguous()
    if t.numel() == 0:
        return 0
    size = t.element_size()
    unit = min(size, 8)
    per = size // unit  # words per element: 2 for complex128, else 1
    words = t.reshape(-1).view(_INT_OF_SIZE[unit]).to(torch.int64).reshape(-1, per)
    strides = [1] * len(b.shape)
    for d in range(len(b.shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * b.shape[d + 1]
    device = t.device
    # The whole tensor's flat index of each local element, one block of rows at a time.
    inner = torch.zeros((), dtype=torch.int64, device=device)
    for d in range(1, len(b.sizes)):
        ar = torch.arange(b.offsets[d], b.offsets[d] + b.sizes[d], dtype=torch.int64,
                          device=device) * strides[d]
        inner = (inner.unsqueeze(-1) + ar).reshape(-1) if inner.dim() else ar
    inner = inner.reshape(-1)
    rows = b.sizes[0] if b.sizes else 1
    row_len = inner.numel()
    step = max(1, _BLOCK // max(1, row_len))
    lane = torch.arange(per, dtype=torch.int64, device=device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if b.sizes:
            first = (torch.arange(r0, r1, dtype=torch.int64, device=device)
                     + b.offsets[0]) * strides[0]
            flat = (first.unsqueeze(-1) + inner).reshape(-1)
        else:
            flat = torch.zeros(1, dtype=torch.int64, device=device)
        g = flat.unsqueeze(-1) * per + lane
        total = total + ((2 * g + 1) * words[r0 * row_len:r1 * row_len]).sum()
    return int(total.item()) & MASK64


def piece_digests(leaves: Iterable[tuple[str, torch.Tensor]]
                  ) -> dict[str, tuple[Box, int]]:
    """Each key's box and its part of the whole-tensor digest, for this rank's tensors."""
    out = {}
    for k, t in leaves:
        b = box(t)
        out[k] = (b, piece_digest(local(t), b))
    return out


def whole_digests(per_rank: Sequence[Mapping[str, tuple[Box, int]]]
                  ) -> tuple[dict[str, str | None], list[str]]:
    """Every key's whole-tensor digest, as hex, from every rank's ``piece_digests``: the
    distinct boxes summed (a replica's copy counted once). None for a key whose boxes do
    not tile the tensor exactly (it cannot be checked after resharding). Also the keys whose
    replicas hold different values in one box: named as ``key (ranks [...])``."""
    boxes: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], dict[int, list[int]]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, pieces in enumerate(per_rank):
        for k, (b, d) in pieces.items():
            shapes[k] = b.shape
            boxes.setdefault(k, {}).setdefault((b.offsets, b.sizes), {}).setdefault(
                d, []).append(rank)
    digests: dict[str, str | None] = {}
    differ: list[str] = []
    for k, by_box in sorted(boxes.items()):
        total = 0
        count = 0
        for (_, sizes), values in by_box.items():
            if len(values) > 1:
                differ.append(f"{k} (ranks {sorted(r for rs in values.values() for r in rs)})")
            total += next(iter(values))
            n = 1
            for s in sizes:
                n *= s
            count += n
        whole = 1
        for s in shapes[k]:
            whole *= s
        digests[k] = f"{total & MASK64:016x}" if count == whole else None
    return digests, differ


def fresh_copy(tree: Any) -> Any:
    """``tree`` with every tensor replaced by zeros of its layout in new storage (a DTensor
    by a DTensor of the same mesh and placements), the rest copied: what DCP loads into, so
    nothing reaches the live state before it is verified."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree.detach())
    if isinstance(tree, Mapping):
        return {k: fresh_copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [fresh_copy(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(fresh_copy(v) for v in tree)
    return copy.deepcopy(tree)


def mesh_of(leaves: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any] | None:
    """The device mesh the state is sharded over (its shape and dimension names), or None."""
    for _, t in leaves:
        if isinstance(t, DTensor):
            m = t.device_mesh
            return {"shape": list(m.shape), "dim_names": list(m.mesh_dim_names or [])}
    return None
