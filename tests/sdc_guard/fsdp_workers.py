"""Rank functions of the FSDP2 tests (``test_fsdp.py``): a small MLP under ``fully_shard``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sdc_guard import GuardConfig, SDCGuard


def mesh_for(shape: tuple[int, ...]) -> Any:
    """A 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` mesh (HSDP) on the CPU."""
    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def build(shape: tuple[int, ...], *, seed: int = 0) -> Any:
    """An MLP 8-16-16-4, each Linear ``fully_shard``-ed and then the root, as torchtitan does;
    the last layer left to the root (a root that owns parameters)."""
    mesh = mesh_for(shape)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    for i in (0, 2):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def local_state(model: Any, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of the parameters and the optimizer state, copied."""
    out = [p.detach().to_local().clone() for p in model.parameters()]
    for p in model.parameters():
        for k in sorted(opt.state.get(p, {})):
            v = opt.state[p][k]
            out.append((v.to_local() if hasattr(v, "to_local") else v).detach().clone())
    return out


def plain_steps(model: Any, opt: torch.optim.Optimizer, steps: int, rank: int,
                micro_batches: int) -> None:
    """FSDP2 training without the guard: what the guarded run must equal bit for bit."""
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for i in range(micro_batches):
            model.set_requires_gradient_sync(i == micro_batches - 1)
            batch = batch_for(rank, step * micro_batches + i)
            loss_fn(model, batch).backward()  # type: ignore[no-untyped-call]
        opt.step()


def same_as_plain(rank: int, world: int, shape: tuple[int, ...], micro_batches: int) -> bool:
    """Train 4 steps guarded (non-finite and weights checks on) and 4 unguarded from the same
    start: is every shard of the parameters and optimizer state bit for bit the same?"""
    guarded = build(shape)
    opt_g = torch.optim.AdamW(guarded.parameters(), lr=0.01)

    def per_micro(r: int, step: int) -> Any:  # the guard asks per step, micro-batches by index
        if micro_batches == 1:
            return batch_for(r, step)
        return [batch_for(r, step * micro_batches + i) for i in range(micro_batches)]

    cfg = GuardConfig(micro_batches=micro_batches)
    guard = SDCGuard(guarded, opt_g, loss_fn=loss_fn, batch_for=per_micro, config=cfg)
    for step in range(4):
        report = guard.step(step)
        assert not report.skipped and not report.detections, report
    assert guard.flush() == []
    assert guard.comm_hook_registered  # the hooks ran, not FSDP2's defaults alone
    plain = build(shape)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=0.01)
    plain_steps(plain, opt_p, 4, rank, micro_batches)
    a, b = local_state(guarded, opt_g), local_state(plain, opt_p)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def faults(rank: int, world: int, shape: tuple[int, ...], site: str, target: int,
           at: int, replay_interval: int = 0) -> dict[str, Any]:
    """Train 8 steps with the defaults and one fault on rank ``target`` at step ``at``:

    - "local_nan": a NaN in rank ``target``'s local gradients of the second Linear, in the
      row of the rank after it (so it lands in another rank's shard);
    - "reduced_inf": an Inf in rank ``target``'s reduced shard;
    - "reduced_inf_last": the same in the shard of the step's last reduction (as step 0
      reduced the modules), which carries the step's veto: nothing travels after it;
    - "state": after step ``at``'s optimizer step, a change in rank ``target``'s shard of
      the first weight's Adam ``exp_avg`` (one replica's state only);
    - "at_rest": before step ``at``, a change in rank ``target``'s shard of the first weight;
    - "at_rest_nan": the same, a NaN.

    Returns the steps withheld (and by which checks), the detections (check, step, suspects,
    repaired) as every rank saw them, and whether the ranks that hold each shard hold it
    alike at the end."""
    model = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(replay_interval=replay_interval,
                                        deterministic=replay_interval > 0))
    backend = guard.backend
    shards = shape[-1]

    def local_nan(chunk: Any) -> None:
        if backend.step == at and rank == target and chunk.index() == 2:
            rows = chunk.buffer().view(shards, -1)
            rows[(target + 1) % shards, 3] = float("nan")

    order: list[int] = []

    def reduced_inf(chunk: Any, out: torch.Tensor) -> None:
        if backend.step == 0:
            order.append(chunk.index())
        module = order[-1] if site == "reduced_inf_last" else 2
        if backend.step == at and rank == target and chunk.index() == module:
            out.view(-1)[-1] = float("inf")

    if site == "local_nan":
        backend.before.append(local_nan)
    if site.startswith("reduced_inf"):
        backend.after.append(reduced_inf)
    first: Any = next(model.parameters())
    withheld, withheld_by, seen = [], [], []
    for step in range(8):
        if site.startswith("at_rest") and step == at and rank == target:
            with torch.no_grad():
                if site == "at_rest_nan":
                    first.to_local().view(-1)[1] = float("nan")
                else:
                    first.to_local().view(-1)[1] += 0.25
        report = guard.step(step)
        if report.skipped:
            withheld.append((step, report.withheld_by) if site == "local_nan" else step)
            withheld_by.append((step, report.withheld_by))
        seen += report.detections
        if site == "state" and step == at and rank == target:
            with torch.no_grad():
                opt.state[first]["exp_avg"].to_local().view(-1)[1] += 0.5
    seen += guard.flush()
    # Do the holders of each shard hold it alike? Every rank's state words, compared per shard.
    mine = torch.cat([t.reshape(-1).double() for t in local_state(model, opt)])
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    alike = all(torch.equal(rows[r], rows[s[0]]) for s in backend.layout.sets for r in s)
    return {"withheld": withheld, "withheld_by": withheld_by, "alike": alike,
            "detections": [(d.check, d.step, tuple(d.suspect_ranks), d.repaired)
                           for d in seen]}


def collectives_per_step(rank: int, world: int, shape: tuple[int, ...], steps: int = 5,
                         weights: int = 0, checksum: bool = False) -> dict[str, list[int]]:
    """The collectives each step issues (the sequence numbers of every process group of
    this process, the mesh's included), for plain FSDP2 and for the guard with the
    non-finite check (its naming word out of the way), the weights check every
    ``weights`` steps (0: off) and the checksum check if ``checksum``, and whether the
    guard's run is bit-identical."""
    out: dict[str, list[int]] = {}
    states = []
    for name in ("plain", "guard"):
        model = build(shape)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        guard = None if name == "plain" else SDCGuard(
            model, opt, loss_fn=loss_fn, batch_for=batch_for,
            config=GuardConfig(weights_interval=weights, nonfinite_exchange_interval=1000,
                               checksum=checksum))
        counts = []
        for step in range(steps):
            before = collectives_issued()
            if guard is None:
                plain_steps_from(model, opt, step, rank)
            else:
                assert not guard.step(step).skipped
            counts.append(collectives_issued() - before)
        out[name] = counts
        states.append(local_state(model, opt))
    out["identical"] = [int(all(torch.equal(a, b) for a, b in zip(*states, strict=True)))]
    return out


def collectives_issued() -> int:
    """The collectives this process has issued so far: the sum of every process group's
    sequence number (the mesh's groups included)."""
    groups: Any = dist.distributed_c10d._world.pg_map
    return sum(int(g._get_sequence_number_for_group()) for g in groups)


def plain_steps_from(model: Any, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """Plain FSDP2's step ``step``."""
    opt.zero_grad(set_to_none=True)
    loss_fn(model, batch_for(rank, step)).backward()  # type: ignore[no-untyped-call]
    opt.step()


def reconfigured(rank: int, world: int, shape: tuple[int, ...]) -> list[Any]:
    """HSDP with the replay audit every step: a first run in which rank 4's weight shard
    changes before step 2 (the vote at once names rank 4), then, reconfigured and started
    over at step 0 as a harness does between trials, a second run in which rank 5's own
    local gradients change in step 2 (a finite change: the replay names rank 5). The
    detections of each run, as (check, step, suspects)."""
    model = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    config = GuardConfig(replay_interval=1, deterministic=True)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for, config=config)
    first: Any = next(model.parameters())
    shards = shape[-1]

    def flip(chunk: Any) -> None:
        if guard.backend.step == 2 and rank == 5 and chunk.index() == 2:
            chunk.buffer().view(shards, -1)[rank % shards, 3] += 1.0

    runs = []
    for run in range(2):
        if run:
            guard.reconfigure(config)
            guard.backend.before.append(flip)
        seen = []
        for step in range(4):
            if run == 0 and step == 2 and rank == 4:
                with torch.no_grad():
                    first.to_local().view(-1)[1] += 0.25
            seen += guard.step(step).detections
        seen += guard.flush()
        runs.append([(d.check, d.step, tuple(d.suspect_ranks)) for d in seen])
    return runs


def _refused(model: Any, **kw: Any) -> str:
    """The guard's error for ``model`` (its first step run: a block is found out there), or
    "accepted"."""
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        SDCGuard(model, opt, **{"loss_fn": loss_fn, "batch_for": batch_for, **kw}).step(0)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "accepted"


def refusals(rank: int, world: int) -> list[str]:
    """The guard's errors for what it cannot guard under FSDP2, each message."""
    model = build((world,))
    out = [_refused(model, comm_hook=lambda state, bucket: None),
           # a block, not the root (the loss function calls the whole model)
           _refused(model[0], loss_fn=lambda m, batch: loss_fn(model, batch)),
           _refused(nn.Sequential(nn.Linear(2, 2)))]  # not wrapped at all
    compiled = build((world,))
    compiled[2].compile()  # a block compiled in place (module.compile())
    out.append(_refused(compiled))
    other = init_device_mesh("cpu", (world,))  # a second mesh (an expert group's, say)
    torch.manual_seed(0)
    two = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(two[0], mesh=mesh_for((world,)))
    fully_shard(two[1], mesh=other)
    fully_shard(two, mesh=other)
    out.append(_refused(two))
    flat = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    unsharded = nn.Sequential(nn.Linear(4, 4))
    fully_shard(unsharded, mesh=flat)
    out.append(_refused(unsharded))
    return out


def injected(rank: int, world: int, shape: tuple[int, ...],
             fault: dict[str, Any]) -> dict[str, Any]:
    """Train 6 steps with the defaults and one fault armed through ``injectors`` (the
    campaigns' way); the records it left on this rank, the steps withheld, the detections."""
    from injectors import Fault, arm

    model = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for, config=GuardConfig())
    withheld, seen = [], []
    with arm(Fault(**fault), guard=guard) as handle:
        for step in range(6):
            report = guard.step(step)
            if report.skipped:
                withheld.append(step)
            seen += report.detections
        seen += guard.flush()
        records = list(handle.records)
    return {"records": len(records), "withheld": withheld,
            "detections": [(d.check, d.step, tuple(d.suspect_ranks), d.repaired)
                           for d in seen]}


def rollback(rank: int, world: int, shape: tuple[int, ...], directory: str,
             faulty: bool) -> dict[str, Any]:
    """Train 10 steps with the defaults and a ``ShardedCheckpointManager`` (DCP) bound to the
    guard, saving after every odd step. ``faulty``: before step 6, rank 1's weight shard
    changes at rest (pure FSDP: no replica to repair it); the guard names it in step 6, the
    run restores the newest checkpoint before the suspect window and trains on. Returns this
    rank's final shards, the detections and where the run resumed."""
    from sdc_guard import ShardedCheckpointManager

    model = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = ShardedCheckpointManager(directory, keep=3)
    # (the non-finite check's words every step: its verified steps keep up with the saves)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(nonfinite_exchange_interval=1), checkpoints=ckpt)
    seen, resumed = [], []
    step, struck = 0, False
    while step < 10:
        if faulty and step == 6 and rank == 1 and not struck:
            with torch.no_grad():
                first: Any = next(model.parameters())
                first.to_local().view(-1)[2] += 0.125
            struck = True
        report = guard.step(step)
        seen += report.detections
        if any(not d.repaired for d in report.detections):
            step = ckpt.restore(model, opt)
            resumed.append(step)
            continue
        if step % 2 == 1:
            ckpt.save(step, model, opt)
        step += 1
    seen += guard.flush()
    return {"state": [t.reshape(-1).tolist() for t in local_state(model, opt)],
            "resumed": resumed,
            "detections": [(d.check, d.step, tuple(d.suspect_ranks)) for d in seen]}


def llama_as_users_run_it(rank: int, world: int, shape: tuple[int, ...],
                          nan_at: int | None) -> dict[str, Any]:
    """The harness's Llama-style model under FSDP2 with bf16 parameters, float32 reductions
    and activation checkpointing (torchtitan's way), 5 steps with the defaults beside 5
    plain ones; ``nan_at``: a NaN in rank 1's local gradients at that step."""
    from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
    from scenarios.spec.sharding import shard_model

    parallel = "fsdp" if len(shape) == 1 else "hsdp"

    def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
        m = shard_model(build_model("llama", width=64, depth=2, seed=0), parallel=parallel,
                        mesh_shape=shape, mixed_precision=True, activation_checkpointing=True)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    def batch_of(r: int, step: int) -> Any:
        return synthetic_batch("llama", 0, r, step, 0, batch=4)

    model, opt = model_and_opt()
    guard = SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=batch_of, config=GuardConfig())

    def poison(chunk: Any) -> None:
        if guard.backend.step == nan_at and rank == 1 and chunk.index() == 1:
            chunk.buffer().view(-1)[5] = float("nan")

    guard.backend.before.append(poison)
    withheld, seen = [], []
    for step in range(5):
        report = guard.step(step)
        if report.skipped:
            withheld.append(step)
        seen += report.detections
    seen += guard.flush()
    same = None
    if nan_at is None:
        plain, opt_p = model_and_opt()
        for step in range(5):
            opt_p.zero_grad(set_to_none=True)
            scenario_loss(plain, batch_of(rank, step)).backward()  # type: ignore[no-untyped-call]
            opt_p.step()
        a, b = local_state(model, opt), local_state(plain, opt_p)
        same = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return {"withheld": withheld, "same_as_plain": same,
            "dtype": str(next(model.parameters()).dtype),
            "detections": [(d.check, d.step, tuple(d.suspect_ranks)) for d in seen]}
