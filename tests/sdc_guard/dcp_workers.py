"""Rank functions for the sharded-checkpoint tests: FSDP2 and HSDP on gloo, saved and restored.

Each builds a tiny MLP whose Linears and root are ``fully_shard``-ed over a CPU device mesh,
trains it with AdamW on batches drawn from the global RNG (so the RNG state moves with
training), and returns plain data: snapshots of every rank's local shards (parameters and
optimizer state), its RNG state, the checkpoint directory's listing, the log records.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from sdc_guard.checkpoint import CheckpointError
from sdc_guard.checkpoint.dcp import ShardedCheckpointManager
from sdc_guard.report import Detection


class Records(logging.Handler):
    """The checkpoint logger's records, as (level, message)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.getMessage()))


def listen() -> Records:
    h = Records()
    logger = logging.getLogger("sdc_guard.checkpoint")
    logger.addHandler(h)
    logger.setLevel(logging.DEBUG)
    return h


def build(mesh: DeviceMesh) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same tiny MLP on every rank (seeded), each Linear and the root sharded."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 6)
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _local(t: Any) -> Any:
    if isinstance(t, DTensor):
        return t.to_local().clone()
    if isinstance(t, torch.Tensor):
        return t.clone()
    return t


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's local shards of every parameter and optimizer state, and its RNG state."""
    params = {n: _local(p) for n, p in model.named_parameters()}
    state = {n: {k: _local(v) for k, v in opt.state.get(p, {}).items()}
             for n, p in model.named_parameters()}
    return {"params": params, "state": state, "rng": torch.get_rng_state().clone()}


def same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """What differs between two snapshots, bit for bit (empty: identical)."""
    out = [n for n in a["params"] if not torch.equal(a["params"][n].view(torch.uint8),
                                                     b["params"][n].view(torch.uint8))]
    for n, st in a["state"].items():
        for k, v in st.items():
            w = b["state"][n].get(k)
            if w is None or not torch.equal(v.reshape(-1).view(torch.uint8),
                                            w.reshape(-1).view(torch.uint8)):
                out.append(f"{n}.{k}")
    if not torch.equal(a["rng"], b["rng"]):
        out.append("rng")
    return out


def listing(directory: str) -> list[str]:
    return sorted(p.name for p in Path(directory).iterdir())


def fsdp_keep_and_restore(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Saves at steps 1, 2, 3 (keep=1, verified clean through 1) and leftovers of killed
    saves; then training on and a restore: the newest (step 3) comes back bit for bit."""
    seen = listen()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    ckpt = ShardedCheckpointManager(directory, keep=1)
    train(model, opt, 2)
    ckpt.save(1, model, opt, verified_through=1)
    train(model, opt, 1)
    ckpt.save(2, model, opt, verified_through=1)
    train(model, opt, 1)
    if rank == 0:  # what a save killed before its commit leaves: never restored, swept
        (Path(directory) / ".step-000000009-g0.tmp").mkdir()
        (Path(directory) / "step-000000008-g0").mkdir()
    ckpt.save(3, model, opt, verified_through=1)
    after_save = listing(directory)
    saved = snapshot(model, opt)
    train(model, opt, 3)
    changed = same(saved, snapshot(model, opt))
    start = ckpt.restore(model, opt)
    return {"start": start, "after_save": after_save, "changed": changed,
            "diff": same(saved, snapshot(model, opt)), "log": seen.seen}


def fsdp_corrupt(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Saves at steps 1 and 2; rank 0 flips a byte of a local shard's values inside step 2's
    ``.distcp`` files: restore logs it and brings step 1 back bit for bit."""
    seen = listen()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    ckpt = ShardedCheckpointManager(directory, keep=3)
    train(model, opt, 2)
    ckpt.save(1, model, opt)
    first = snapshot(model, opt)
    train(model, opt, 1)
    ckpt.save(2, model, opt)
    # Every rank's own shard of the first Linear's weight: its bytes are in one file.
    needle = _local(model.get_parameter("0.weight")).detach().numpy().tobytes()
    flipped = None
    for p in sorted((Path(directory) / "step-000000002-g0").glob("*.distcp")):
        data = bytearray(p.read_bytes())
        at = data.find(needle)
        if at >= 0 and rank == 0:
            data[at + len(needle) // 2] ^= 0x10
            p.write_bytes(bytes(data))
            flipped = p.name
            break
    torch.distributed.barrier()
    train(model, opt, 2)
    start = ckpt.restore(model, opt)
    return {"start": start, "flipped": flipped, "diff": same(first, snapshot(model, opt)),
            "log": seen.seen}


def fsdp_window(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Saves at steps 1 and 3; a detection at step 3 when every check had verified the run
    through step 1 opens a window from step 2: restore skips step 3 and brings step 1 back.
    Then a restore with the directory emptied: 0, the model left as it is."""
    seen = listen()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    ckpt = ShardedCheckpointManager(directory, keep=3)
    train(model, opt, 1)
    ckpt.save(1, model, opt)
    first = snapshot(model, opt)
    train(model, opt, 2)
    ckpt.save(3, model, opt)
    ckpt.record_detection(Detection("weights", 3, (1,), "", {}), verified_through=1)
    refused = ckpt.save(4, model, opt)  # the window is open: no save until a restore
    start = ckpt.restore(model, opt)
    diff = same(first, snapshot(model, opt))
    empty = ShardedCheckpointManager(Path(directory) / "empty")
    train(model, opt, 1)
    before = snapshot(model, opt)
    scratch = empty.restore(model, opt)
    untouched = same(before, snapshot(model, opt))
    # A job's first restore: an optimizer without state yet keeps none.
    model, opt = build(mesh)
    params = snapshot(model, opt)["params"]
    scratch += empty.restore(model, opt)
    after = snapshot(model, opt)["params"]
    fresh = [n for n in params if not torch.equal(params[n], after[n])] + (
        ["optimizer state"] if opt.state else [])
    return {"start": start, "refused": refused, "diff": diff, "scratch": scratch,
            "untouched": untouched, "fresh": fresh, "log": seen.seen}


def hsdp_roundtrip(rank: int, world: int, directory: str) -> dict[str, Any]:
    """HSDP on a 2x2 mesh (replicate x shard): save, train on, restore, bit for bit."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = build(mesh)
    ckpt = ShardedCheckpointManager(directory)
    train(model, opt, 1)
    ckpt.save(1, model, opt)
    saved = snapshot(model, opt)
    train(model, opt, 1)
    start = ckpt.restore(model, opt)
    diff = same(saved, snapshot(model, opt))
    # Rank 2 holds a replica of rank 0's shard: one value of it off, and no rank saves.
    if rank == 2:
        weight = model.get_parameter("0.weight")
        assert isinstance(weight, DTensor)
        with torch.no_grad():
            weight.to_local()[0, 0] += 1.0
    try:
        ckpt.save(2, model, opt)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    return {"start": start, "diff": diff, "refused": refused, "listing": listing(directory)}


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    """Every parameter and optimizer state whole (gathered across the mesh), as its bytes
    (tensors would travel back through shared memory that dies with the rank)."""
    out = {}
    for n, p in model.named_parameters():
        out[n] = _bytes(p.full_tensor() if isinstance(p, DTensor) else p)
        for k, v in opt.state[p].items():
            out[f"{n}.{k}"] = _bytes(v.full_tensor() if isinstance(v, DTensor) else v)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def reshard_save(rank: int, world: int, directory: str) -> dict[str, bytes]:
    """Save step 1 on ``world`` ranks; the state whole."""
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    train(model, opt, 1)
    ShardedCheckpointManager(directory).save(1, model, opt)
    return full_state(model, opt)


def reshard_restore(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Restore on ``world`` ranks what another number of ranks saved; the state whole."""
    seen = listen()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)  # a new job: the optimizer has no state yet
    start = ShardedCheckpointManager(directory).restore(model, opt)
    return {"start": start, "state": full_state(model, opt), "log": seen.seen}


def fsdp_background(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Background saves at steps 1 and 2 with training going on while they are written; a
    restore brings step 2's state back bit for bit. Then a background save whose commit
    fails on rank 0: ``wait()`` raises it there, the next ``save`` on every rank, and
    nothing of it is left or restored."""
    seen = listen()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    ckpt = ShardedCheckpointManager(directory, keep=3)
    train(model, opt, 2)
    first = ckpt.save(1, model, opt, verified_through=1, background=True)
    train(model, opt, 1)  # while step 1's files are written
    ckpt.save(2, model, opt, verified_through=1, background=True)
    saved = snapshot(model, opt)
    train(model, opt, 3)
    ckpt.wait()  # rank 0: until the commit; the others: until their own files are written
    torch.distributed.barrier()
    after_save = listing(directory)
    start = ckpt.restore(model, opt)
    restored = same(saved, snapshot(model, opt))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    if rank == 0:
        ckpt._commit = broken  # type: ignore[method-assign]
    ckpt.save(3, model, opt, verified_through=1, background=True)
    raised = ""
    try:  # step 3's failure, on every rank
        ckpt.save(4, model, opt, verified_through=1, background=True)
    except CheckpointError as e:
        raised = str(e)
    ckpt.save(5, model, opt, verified_through=1, background=True)
    waited = ""
    try:  # step 5's, on the rank that met it
        ckpt.wait()
    except CheckpointError as e:
        waited = str(e)
    torch.distributed.barrier()  # (rank 0's thread has cleaned up once its wait returned)
    return {"first": first, "after_save": after_save, "start": start, "restored": restored,
            "waited": waited, "raised": raised, "final": listing(directory),
            "errors": [m for level, m in seen.seen if level == "ERROR"]}


def fsdp_version1(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A step 1 save whose manifest is rewritten as a release before fingerprint version 2
    wrote it (format 1, no version, each rank's fingerprint in version 1): restored and
    verified in version 1. Then the same manifest with version 2 fingerprints: refused."""
    import json

    from torch.distributed.checkpoint.state_dict import get_state_dict

    from sdc_guard.checkpoint.dcp_shards import rank_fingerprint, tensor_leaves

    seen = listen()
    mesh = init_device_mesh("cpu", (world,))
    model, opt = build(mesh)
    ckpt = ShardedCheckpointManager(directory, keep=3)
    train(model, opt, 2)
    ckpt.save(1, model, opt)
    manifest = Path(directory) / "step-000000001-g0.json"
    saved = snapshot(model, opt)
    msd, osd = get_state_dict(model, opt)
    leaves = tensor_leaves({"model": msd, "optim": osd})
    mine = [rank_fingerprint(leaves, 1), rank_fingerprint(leaves, 2)]
    every: list[Any] = [None] * world
    torch.distributed.all_gather_object(every, mine)
    rec = json.loads(manifest.read_text())
    recorded = (rec["format"], rec["fingerprint_version"],
                [r["fingerprint"] for r in rec["ranks"]] == [e[1] for e in every])

    def rewrite(version: int) -> None:
        torch.distributed.barrier()
        if rank == 0:
            old = dict(rec, format=1)
            old.pop("fingerprint_version")
            for r, e in zip(old["ranks"], every, strict=True):
                r["fingerprint"] = e[version - 1]
            manifest.write_text(json.dumps(old))
        torch.distributed.barrier()

    rewrite(1)
    train(model, opt, 2)
    start = ckpt.restore(model, opt)
    diff = same(saved, snapshot(model, opt))
    rewrite(2)
    train(model, opt, 1)
    refused = ckpt.restore(model, opt)
    return {"recorded": recorded, "start": start, "diff": diff, "refused": refused,
            "log": seen.seen}
