"""Rank functions for the multi-rank tests (module level so spawned ranks can import them).

The guard's tests (``guarded_run``, ``replay_run``, ...) and the injectors' (``guard_trials``,
``plain_trials``, ...) share one tiny MLP, its data and its loss."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import sdc_guard
from injectors import Fault, InjectionContext, InjectionHandle, arm
from sdc_guard import CheckpointManager, GuardConfig, SDCGuard
from sdc_guard.checks.checksum import ChecksumCheck
from sdc_guard.checks.replay import ReplayAudit
from sdc_guard.fingerprints.words import to_unsigned64
from sdc_guard.parallel import BucketListener, GuardCommHook


def make_mlp(seed: int = 0, width: int = 32, act: type[nn.Module] = nn.ReLU) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), act(), nn.Linear(width, width), act(),
                         nn.Linear(width, 4))


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(8, 16, generator=g)
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def make_optimizer(model: nn.Module, opt: str) -> torch.optim.Optimizer:
    """AdamW or SGD with momentum, the same for the guarded and the plain loop."""
    if opt == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _summary(reports: list[sdc_guard.StepReport]) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(d.check, d.step, d.suspect_ranks) for r in reports for d in r.detections]


def _flushed(found: list[sdc_guard.Detection]) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(d.check, d.step, d.suspect_ranks) for d in found]


def _until_refused(guard: SDCGuard, found: list[sdc_guard.Detection], steps: int, *,
                   step_of: Any = None, after: Any = None, flush: bool = False) -> dict[str, Any]:
    """Train ``steps`` steps (step ``step_of(s)``, then ``after(s)``; then ``flush``) until
    the guard refuses with a ValueError: the error and the loop index it came at (both None
    when it never did), and the detections ``found`` holds by then (the guard's
    ``on_detection``, which ``flush`` feeds too)."""
    try:
        for s in range(steps):
            guard.step(s if step_of is None else step_of(s))
            if after is not None:
                after(s)
        if flush:
            guard.flush()
    except ValueError as e:
        return {"error": str(e), "at": s, "detections": _flushed(found)}
    return {"error": None, "at": None, "detections": _flushed(found)}


def guarded_run(rank: int, world: int, steps: int, fault: dict[str, Any] | None = None,
                cfg: dict[str, Any] | None = None, opt: str = "adamw",
                stop_on_detection: bool = False,
                quarantine: dict[str, Any] | None = None,
                bucket_view: bool = False) -> dict[str, Any]:
    """Train ``steps`` guarded steps; optionally corrupt something on one rank at one step.

    ``stop_on_detection``: leave the loop at the first report with a detection, as a
    user's loop would, then meet the other ranks (a rank that stopped alone would hang).
    ``quarantine``: ``{"nodes": [node of each rank], "kwargs": KubeQuarantine's}``: each
    rank runs as a pod on its node (NODE_NAME, POD_NAME) with a ``KubeQuarantine``.
    ``bucket_view``: DDP's ``gradient_as_bucket_view`` (the construction the guard recommends).
    """
    model = DDP(make_mlp(), gradient_as_bucket_view=bucket_view)
    optimizer = make_optimizer(model, opt)
    remediation = None
    if quarantine is not None:
        from sdc_guard.remediation import KubeQuarantine

        os.environ["NODE_NAME"] = quarantine["nodes"][rank]
        os.environ["POD_NAME"] = f"job-worker-{rank}"
        os.environ["POD_NAMESPACE"] = "ml"
        remediation = KubeQuarantine(**quarantine["kwargs"])
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(**(cfg or {})), remediation=remediation)
    fault = fault or {}
    if fault.get("site") == "weight_bitflip" and fault["rank"] == rank:
        def flip(step: int) -> None:
            if step == fault["step"]:
                w = next(model.module.parameters()).detach()
                w.view(-1).view(torch.int32)[3] ^= 1 << fault.get("bit", 0)
        guard.before_step.append(flip)
    if fault.get("site") == "grad_nan" and rank in fault.get("ranks", [fault.get("rank")]):
        def nan(bucket: Any) -> None:
            if guard.backend.step == fault["step"]:
                bucket.buffer()[0] = float("nan")
        guard.backend.before.append(nan)
    if fault.get("site") == "reduced_nan" and rank in fault["ranks"]:
        # A fault in this rank's copy of the all-reduced gradients of the last bucket.
        def corrupt(bucket: Any, out: torch.Tensor) -> None:
            if guard.backend.step == fault["step"] and bucket.is_last():
                out[0] = float("nan")
        guard.backend.after.append(corrupt)
    reports = []
    step_s = []
    for s in range(steps):
        t0 = time.perf_counter()
        reports.append(guard.step(s))
        step_s.append(time.perf_counter() - t0)
        if stop_on_detection and reports[-1].detections:
            break
    flushed = guard.flush()
    dist.barrier()
    out = {
        "detections": _summary(reports) + _flushed(flushed),
        "reported_at": [(r.step, d.check, d.step) for r in reports for d in r.detections],
        "flushed": _flushed(flushed),
        "rank": rank,
        "steps_run": len(reports),
        "skipped": [r.step for r in reports if r.skipped],
        "losses": [r.loss for r in reports],
        "final": sdc_guard.fingerprint(list(model.module.parameters())),
        "step_s": step_s,
        "suspect_nodes": [d.suspect_nodes for r in reports for d in r.detections]
        + [d.suspect_nodes for d in flushed],
        "telemetry": [d.evidence.get("telemetry") for r in reports for d in r.detections],
        "hooked": guard.comm_hook_registered,
    }
    if remediation is not None:
        out["actions"] = [a.to_json() for a in remediation.actions]
    return out


def plain_run(rank: int, world: int, steps: int, opt: str = "adamw") -> dict[str, Any]:
    """The same training as ``guarded_run`` with a plain DDP loop and no guard."""
    model = DDP(make_mlp())
    optimizer = make_optimizer(model, opt)
    losses = []
    for s in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch_for(rank, s))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(float(loss.item()))
    out = {"losses": losses, "final": sdc_guard.fingerprint(list(model.module.parameters()))}
    return out


# -- replay audit ----------------------------------------------------------------------------
class RunningCenter(nn.Module):
    """Subtracts a running mean that the training forward updates from its batch first: a
    buffer the forward reads (an RL observation normaliser, an EMA codebook), unlike
    BatchNorm's, which training ignores. Under DDP each rank's drifts from the others'
    until DDP broadcasts rank 0's at the next forward."""

    mean: torch.Tensor

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


class HostRandomSkip(nn.Module):
    """Skips (zeroes) its input at random, deciding with Python's ``random`` and NumPy's
    global generator, as LayerDrop was written in some models (not with torch's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        if self.training and (random.random() < 0.5) != (np.random.uniform() < 0.5):
            return x * 0.5
        return x


class DropMLP(nn.Module):
    """An MLP with dropout (random ops must replay exactly) and optionally BatchNorm or a
    ``RunningCenter``."""

    def __init__(self, batchnorm: bool = False, running: bool = False,
                 host_random: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.norm: nn.Module = (nn.BatchNorm1d(32) if batchnorm else
                                RunningCenter(32) if running else
                                HostRandomSkip() if host_random else nn.Identity())
        self.act1 = nn.ReLU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(32, 32)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act1(self.norm(self.fc1(x))))
        y: torch.Tensor = self.fc3(self.act2(self.fc2(h)))
        return y


def _micro_batches(k: int):  # type: ignore[no-untyped-def]
    def batches(rank: int, step: int) -> Any:
        if k == 1:
            return batch_for(rank, step)
        return [batch_for(rank, 1000 * step + i) for i in range(k)]
    return batches


def replay_run(rank: int, world: int, steps: int, *, native: bool = True,
               **kwargs: Any) -> dict[str, Any]:
    """``_replay_run``; ``native=False`` runs the digests on the torch path (as without a C
    compiler)."""
    with contextlib.nullcontext() if native else sdc_guard.native_kernel(False):
        return _replay_run(rank, world, steps, **kwargs)


def _replay_run(rank: int, world: int, steps: int, *, interval: int = 1,
                fault: dict[str, Any] | None = None, batchnorm: bool = False,
                running: bool = False, host_random: bool = False,
                micro: int = 1, skip_steps: tuple[int, ...] = (),
                nonfinite: bool = True, user_hook: bool = False,
                contain: bool = True, bucket_mb: float = 25.0,
                first_bucket: bool = True) -> dict[str, Any]:
    """Guarded training with the replay audit; optionally a bit flip in an activation of one rank.

    fault = {"rank", "step", "phase": "train"|"replay"|"any", "bit", "permanent": bool}, or
    {"site": "grad_nan", "rank", "step"}: a NaN in that rank's local gradient bucket.
    ``skip_steps``: steps this run leaves out entirely (the "never saw the fault" oracle).
    ``nonfinite``: the non-finite check too. ``user_hook``: a comm hook of the user's (DDP's
    own all-reduce hook); ``contain``: ``skip_step_on_detection``; ``bucket_mb``: DDP's bucket
    cap (tiny: several buckets); ``first_bucket``: ``ReplayAudit.exchange_with_first_bucket``.
    The result counts the audit's own collectives
    (``"collectives"``: its one-word agreements and its gathers, and the backend's veto
    words where no sentinel can carry the veto) and names the steps whose
    ring exchange was posted from the comm hook, with the first bucket
    (``"sent_with_first_bucket"``).
    """
    from sdc_guard.checks import replay as replay_module
    from sdc_guard.parallel import ddp as ddp_module

    counts = {"agreements": 0, "gathers": 0, "veto_words": 0}
    names = vars(replay_module)  # the names the audit calls, counted where it looks them up
    real_sum, real_gather = names["PendingSum"], names["all_gather_rows"]
    backend_names = vars(ddp_module)  # the backend's own word (a veto with no sentinel)
    real_backend_sum = backend_names["PendingSum"]

    def counted_sum(*a: Any, **k: Any) -> Any:
        counts["agreements"] += 1
        return real_sum(*a, **k)

    def counted_backend_sum(*a: Any, **k: Any) -> Any:
        counts["veto_words"] += 1
        return real_backend_sum(*a, **k)

    def counted_gather(*a: Any, **k: Any) -> Any:
        counts["gathers"] += 1
        return real_gather(*a, **k)

    names["PendingSum"], names["all_gather_rows"] = counted_sum, counted_gather
    backend_names["PendingSum"] = counted_backend_sum
    torch.manual_seed(0)
    model = DDP(DropMLP(batchnorm, running, host_random), bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GuardConfig(replay_interval=interval, deterministic=True, micro_batches=micro,
                      weights_interval=1, nonfinite=nonfinite, skip_step_on_detection=contain)
    hook = None
    if user_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        hook = default_hooks.allreduce_hook
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=_micro_batches(micro),
                     config=cfg, comm_hook=hook)
    fault = fault or {}
    current = {"step": -1}
    if fault.get("site") == "grad_nan":
        if fault["rank"] == rank:
            def nan(bucket: Any) -> None:
                if guard.backend.step == fault["step"]:
                    bucket.buffer()[0] = float("nan")
            guard.backend.before.append(nan)
    elif fault and fault["rank"] == rank:
        def flip(mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor:
            s = current["step"]
            hit = (s >= fault["step"]) if fault.get("permanent") else (s == fault["step"])
            if hit and fault.get("phase", "train") in ("any", guard.phase):
                out = out.clone()
                # the largest activation: positive after the ReLU, so the flip propagates
                i = int(out.view(-1).argmax())
                out.view(-1).view(torch.int32)[i] ^= 1 << fault.get("bit", 2)
            return out
        getattr(model.module, fault.get("module", "act2")).register_forward_hook(flip)
    in_hook: list[int] = []
    for audit in (c for c in guard.checks if isinstance(c, ReplayAudit)):
        def send(audit: ReplayAudit = audit, real: Any = audit._send_replayed) -> None:
            if audit._buckets:  # the comm hook has shown a bucket: posted from the hook
                in_hook.append(current["step"])
            real()
        audit._send_replayed = send  # type: ignore[method-assign]
        audit.exchange_with_first_bucket = first_bucket
    reports = []
    for s in range(steps):
        if s in skip_steps:
            continue
        current["step"] = s
        reports.append(guard.step(s))
    flushed = guard.flush()
    out = {
        "detections": _summary(reports) + _flushed(flushed),
        "skipped": [r.step for r in reports if r.skipped],
        "final": sdc_guard.fingerprint(list(model.module.parameters())),
        "collectives": counts,
        "sent_with_first_bucket": in_hook,
    }
    return out


class SpareMLP(nn.Module):
    """An MLP of ``width`` units, with a layer the forward pass never uses if ``spare``."""

    def __init__(self, width: int, spare: bool) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.spare = nn.Linear(width, width) if spare else None
        self.fc2 = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return y


def subgroup_run(rank: int, world: int, steps: int, fault_rank: int,
                 fault_step: int) -> dict[str, Any]:
    """Two DDP replicas sets in one job, each guarded over its own process group (ranks
    0-2 and 3-5, each on a node of its own): a flipped activation on global rank
    ``fault_rank`` at ``fault_step``, the replay audit every step."""
    os.environ["NODE_NAME"] = f"node-{rank}"
    groups = [dist.new_group([0, 1, 2]), dist.new_group([3, 4, 5])]
    group = groups[rank // 3]
    model = DDP(make_mlp(), process_group=group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GuardConfig(replay_interval=1, deterministic=True)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=cfg,
                     process_group=group)
    current = {"step": -1}
    if rank == fault_rank:
        def flip(mod: nn.Module, inp: Any, out: torch.Tensor) -> torch.Tensor:
            if current["step"] == fault_step and guard.phase == "train":
                out = out.clone()
                out.view(-1).view(torch.int32)[int(out.view(-1).argmax())] ^= 1 << 26
            return out
        model.module[1].register_forward_hook(flip)
    reports = []
    for s in range(steps):
        current["step"] = s
        reports.append(guard.step(s))
    found = [d for r in reports for d in r.detections] + guard.flush()
    return {"detections": [(d.check, d.step, d.suspect_ranks, d.suspect_nodes) for d in found],
            "skipped": [r.step for r in reports if r.skipped],
            "final": sdc_guard.fingerprint(list(model.module.parameters()))}


def unused_without_find_run(rank: int, world: int) -> dict[str, Any]:
    """A parameter the forward never uses, and DDP not told (``find_unused_parameters``): what
    the first audit step says, and whether anything was reported as a detection."""
    torch.manual_seed(0)
    model = DDP(SpareMLP(32, True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found: list[sdc_guard.Detection] = []
    cfg = GuardConfig(replay_interval=1, deterministic=True)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=cfg,
                     on_detection=found.append)
    try:
        guard.step(0)
    except RuntimeError as e:
        return {"error": str(e), "detections": found}
    return {"error": None, "detections": found}


def mixed_threads_run(rank: int, world: int, threads: list[int]) -> dict[str, Any]:
    """Ranks with other torch thread counts (``threads[rank]``): the replay refused when the
    guard is built and when switched on later; the other checks train on."""
    torch.set_num_threads(threads[rank])
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    kw: dict[str, Any] = {"loss_fn": loss_fn, "batch_for": batch_for}
    out: dict[str, Any] = {}
    try:  # a model of its own: where it is built, it keeps its comm hook
        first = DDP(make_mlp())
        SDCGuard(first, torch.optim.AdamW(first.parameters(), lr=1e-2),
                 config=GuardConfig(replay_interval=2, deterministic=True), **kw)
        out["built"] = None
    except ValueError as e:
        out["built"] = str(e)
    guard = SDCGuard(model, optimizer, config=GuardConfig(checksum=True), **kw)
    out["mismatch"] = guard.topology.compute_mismatch()
    try:
        guard.reconfigure(GuardConfig(replay_interval=1, deterministic=True))
        out["reconfigured"] = None
    except ValueError as e:
        out["reconfigured"] = str(e)
    out["detections"] = _summary([guard.step(s) for s in range(3)]) + _flushed(guard.flush())
    out["checks"] = [c.name for c in guard.checks]
    return out


def fingerprint_version_run(rank: int, world: int, versions: list[int]) -> str | None:
    """Each rank says the fingerprint version ``versions[rank]`` (as a rank of another release
    would): the guard's construction refuses on every rank when they differ; its message."""
    import sdc_guard.topology as topology

    topology.FINGERPRINT_VERSION = versions[rank]  # type: ignore[attr-defined]
    model = DDP(make_mlp())
    try:
        SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                 batch_for=batch_for)
    except ValueError as e:
        return str(e)
    return None


def step_offset_run(rank: int, world: int, offsets: list[int], since: int) -> dict[str, Any]:
    """Rank r calls ``guard.step(s + offsets[r])`` from step ``since`` on (before: ``s``),
    replay every step: the error each rank gets, and the detections before it."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(replay_interval=1, deterministic=True),
                     on_detection=found.append)
    return _until_refused(guard, found, 4,
                          step_of=lambda s: s + (offsets[rank] if s >= since else 0))


def own_batch_run(rank: int, world: int) -> dict[str, Any]:
    """A ``batch_for`` that builds this process's batch whatever rank it is given (it asks
    ``dist.get_rank()``): the first audit step's error, and the detections before it."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn,
                     batch_for=lambda r, step: batch_for(dist.get_rank(), step),
                     config=GuardConfig(replay_interval=2, deterministic=True),
                     on_detection=found.append)
    return _until_refused(guard, found, 3)


def refused_then_audited_run(rank: int, world: int) -> dict[str, Any]:
    """A replay refusal raised on every rank at the first audit step (a ``batch_for`` that
    draws anew on every call), after the step posted its early receive; then a new guard on
    the same process group audits three steps. Its error, and the new guard's detections."""
    torch.manual_seed(0)
    cfg = GuardConfig(replay_interval=1, deterministic=True)
    model = DDP(make_mlp())
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                     batch_for=lambda r, s: (torch.randn(8, 8), torch.randint(0, 4, (8,))),
                     config=cfg)
    try:
        guard.step(0)
        error = ""
    except ValueError as e:
        error = str(e)
    guard.close()
    fine = DDP(make_mlp())
    again = SDCGuard(fine, torch.optim.AdamW(fine.parameters(), lr=1e-2), loss_fn=loss_fn,
                     batch_for=batch_for, config=cfg)
    return {"error": error, "detections": [again.step(s).detections for s in range(3)]}


class _ScalarReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the tensor reads to the host (``.item()``, ``bool()``, ``.tolist()`` of a
    0-d tensor): on a GPU each waits for the queued work."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def loss_read_run(rank: int, world: int) -> dict[str, Any]:
    """The guard with its checks off and plain SGD: host reads in ``guard.step`` (none: the
    loss is read when the report's ``loss`` is asked for), then in reading ``loss``."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    guard = SDCGuard(model, torch.optim.SGD(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                     batch_for=batch_for, config=GuardConfig(nonfinite=False, weights_interval=0))
    guard.step(0)
    with _ScalarReads() as in_step:
        report = guard.step(1)
    with _ScalarReads() as in_loss:
        loss = report.loss
    return {"in_step": in_step.reads, "in_loss": in_loss.reads, "loss": loss,
            "again": report.loss, "float": isinstance(loss, float), "repr": repr(report)}


def running_buffer_run(rank: int, world: int, micro: int,
                       ddp_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``DropMLP(running=True)`` (a buffer the training forward reads and updates) with the
    replay: the error of the first audit step, where no rank can recompute another's."""
    torch.manual_seed(0)
    model = DDP(DropMLP(running=True), **ddp_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=_micro_batches(micro),
                     config=GuardConfig(replay_interval=1, deterministic=True,
                                        micro_batches=micro), on_detection=found.append)
    return _until_refused(guard, found, 3)


class MaxNormBag(nn.Module):
    """Token embeddings with ``max_norm`` (the lookup renormalises the rows it reads, in
    place), averaged, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 16, max_norm=1.0)
        self.head = nn.Linear(16, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.emb(tokens).mean(1))
        return out


def max_norm_run(rank: int, world: int, replay: bool) -> dict[str, Any]:
    """``MaxNormBag`` (a forward that writes a parameter) under the default checks (the
    weights check every step), with the replay or without: the error and its step, and the
    detections before it."""
    model = DDP(MaxNormBag())

    def tokens_for(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randint(0, 40, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)

    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                     batch_for=tokens_for, on_detection=found.append,
                     config=GuardConfig(replay_interval=2 if replay else 0,
                                        deterministic=replay))
    return _until_refused(guard, found, 5)


def bypass_run(rank: int, world: int, replay: bool) -> dict[str, Any]:
    """A ``loss_fn`` that calls ``model.module`` (bypassing DDP's forward, so DDP does not
    all-reduce the gradients) under the default checks, with the replay or without; the DDP
    model is called once before the first step (an evaluation): the error and its step, and
    the detections before it."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    with torch.no_grad():
        model(batch_for(rank, 0)[0])

    def bypass(m: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return loss_fn(m.module, batch)

    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=bypass,
                     batch_for=batch_for, on_detection=found.append,
                     config=GuardConfig(replay_interval=2 if replay else 0,
                                        deterministic=replay))
    return _until_refused(guard, found, 4)


def rank0_scheduler_run(rank: int, world: int, repair: bool) -> dict[str, Any]:
    """A learning-rate scheduler stepped on rank 0 only, under the default checks (the
    weights check every step, with repair by majority or without): the error and its step,
    and the detections before it."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     on_detection=found.append, config=GuardConfig(repair_by_majority=repair))
    return _until_refused(guard, found, 4,
                          after=lambda s: scheduler.step() if rank == 0 else None)


def divergent_start_run(rank: int, world: int, what: str, late: bool = False) -> dict[str, Any]:
    """A checkpoint's ``what`` ("parameters" or "optimizer") loaded on rank 0 only, after DDP
    broadcast rank 0's parameters: the error and its step, and the detections before it.
    ``late``: the guard built with its checks off, the defaults turned on after its first
    step (``SDCGuard.reconfigure``)."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if rank == 0:  # the checkpoint: another model's weights, or a few steps of an optimizer
        other = make_mlp(seed=1)
        if what == "parameters":
            model.module.load_state_dict(other.state_dict())
        else:
            trained = torch.optim.AdamW(model.module.parameters(), lr=1e-2)
            loss_fn(model.module, batch_for(0, 0)).backward()  # type: ignore[no-untyped-call]
            saved = {k: v.clone() for k, v in model.module.state_dict().items()}
            trained.step()
            model.module.load_state_dict(saved)
            optimizer.load_state_dict(trained.state_dict())
            model.zero_grad(set_to_none=True)
    found: list[sdc_guard.Detection] = []
    off = GuardConfig(nonfinite=False, weights_interval=0)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     on_detection=found.append, config=off if late else None)
    return _until_refused(guard, found, 3, after=(
        lambda s: guard.reconfigure(GuardConfig()) if late and s == 0 else None))


class WarmUp(nn.Module):
    """``make_mlp`` whose hidden activations ramp up over its first ten training calls, the
    ramp kept as a call counter (a plain Python attribute the forward updates)."""

    def __init__(self) -> None:
        super().__init__()
        net = make_mlp()
        assert isinstance(net, nn.Sequential)
        self.net = net
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        h = torch.relu(self.net[0](x)) * min(1.0, self.calls / 10)
        return self.rest(h)

    def rest(self, h: torch.Tensor) -> torch.Tensor:
        """The layers after the first, on its activations ``h``."""
        out: torch.Tensor = self.net[4](torch.relu(self.net[2](h)))
        return out


class OwnGenerator(nn.Module):
    """``make_mlp`` that masks its hidden activations in training from a generator of its
    own, seeded once (not torch's global one, which deterministic mode streams)."""

    def __init__(self) -> None:
        super().__init__()
        net = make_mlp()
        assert isinstance(net, nn.Sequential)
        self.net = net
        self.gen = torch.Generator().manual_seed(7)
        self.calls = 0  # (the worker reads it: counted as WarmUp counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        h = torch.relu(self.net[0](x))
        if self.training:
            h = h * (torch.rand(h.shape, generator=self.gen) > 0.2)
        out: torch.Tensor = self.net[4](torch.relu(self.net[2](h)))
        return out


class TensorState(nn.Module):
    """``WarmUp`` with its call counter kept as a plain tensor attribute, not a buffer (as
    custom schedules and EMA teachers often keep theirs), updated in place (``in_place``) or
    rebound to a new tensor at each training call."""

    def __init__(self, in_place: bool, per_rank: bool = False) -> None:
        super().__init__()
        net = make_mlp()
        assert isinstance(net, nn.Sequential)
        self.net = net
        self.in_place = in_place
        self.per_rank = per_rank  # counted by the batch's first input: each rank's its own
        self.seen = torch.zeros(())
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            by = x[0, 0].detach().abs().clamp(max=1.0) if self.per_rank else 1
            if self.in_place:
                self.seen += by
            else:
                self.seen = self.seen + by
        h = torch.relu(self.net[0](x)) * (self.seen / 10).clamp(max=1.0)
        out: torch.Tensor = self.net[4](torch.relu(self.net[2](h)))
        return out


class ListState(WarmUp):
    """``WarmUp`` with its count kept as the length of a Python list that each training call
    appends its batch's first input to (a log the loop reads, which the warm-up reads too)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            self.log.append(float(x[0, 0]))
        return self.rest(torch.relu(self.net[0](x)) * min(len(self.log) / 10, 1.0))


class LazyTable(WarmUp):
    """``WarmUp`` whose forward registers a buffer the first time it runs (a table built
    lazily, as rotary position caches often are) and scales its hidden layer by it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        if "table" not in self._buffers:
            self.register_buffer("table", torch.linspace(0.5, 1.5, 32), persistent=False)
        table: torch.Tensor = self._buffers["table"]  # type: ignore[assignment]
        return self.rest(torch.relu(self.net[0](x)) * table)


def rank_state_run(rank: int, world: int) -> dict[str, Any]:
    """``TensorState`` counting by each rank's own batches (its state differs from rank to
    rank), with the replay every step: the detections' suspects and their details."""
    torch.manual_seed(0)
    model = DDP(TensorState(in_place=True, per_rank=True))
    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                     batch_for=batch_for, on_detection=found.append,
                     config=GuardConfig(replay_interval=1, deterministic=True))
    for s in range(4):
        guard.step(s)
    guard.flush()
    return {"suspects": [d.suspect_ranks for d in found], "details": [d.detail for d in found],
            "kept": [d.evidence.get("state_tensors") for d in found]}


def beside_plain(guard: SDCGuard, plain: DDP, rank: int, steps: int,
                 before_step: Any = None) -> tuple[list[sdc_guard.Detection], bool]:
    """Train ``steps`` steps with ``guard`` and, on the same batches, ``plain`` (the same
    model) in a plain DDP loop with AdamW at the guarded runs' learning rate (``before_step(s)``
    first, when given): the detections (flushed), and whether both models end with the
    same parameters and buffers, bit for bit."""
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    found: list[sdc_guard.Detection] = []
    for s in range(steps):
        if before_step is not None:
            before_step(s)
        found += guard.step(s).detections
        optimizer.zero_grad(set_to_none=True)
        loss_fn(plain, batch_for(rank, s)).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    found += guard.flush()
    a, b = guard.model.module.state_dict(), plain.module.state_dict()
    return found, all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


def warm_up_run(rank: int, world: int, interval: int, kind: str = "counter") -> dict[str, Any]:
    """``WarmUp`` (``kind="counter"``), ``OwnGenerator`` (``"generator"``),
    ``TensorState`` (``"tensor in place"``, ``"tensor rebound"``), ``ListState``
    (``"list"``) or ``LazyTable`` (``"lazy buffer"``) with the replay every
    ``interval`` steps, beside a plain DDP loop: the detections, the call counters, and
    whether both runs end with the same state (their tensor attributes too) bit for bit."""
    def make() -> nn.Module:
        if kind.startswith("tensor"):
            return TensorState(in_place=kind == "tensor in place")
        if kind == "list":
            return ListState()
        if kind == "lazy buffer":
            return LazyTable()
        return WarmUp() if kind == "counter" else OwnGenerator()

    torch.manual_seed(0)
    guarded = DDP(make())
    torch.manual_seed(0)
    plain = DDP(make())
    guard = SDCGuard(guarded, torch.optim.AdamW(guarded.parameters(), lr=1e-2),
                     loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(replay_interval=interval, deterministic=True))
    found, same = beside_plain(guard, plain, rank, 12)
    if isinstance(guarded.module, TensorState) and isinstance(plain.module, TensorState):
        same = same and torch.equal(guarded.module.seen, plain.module.seen)
    if isinstance(guarded.module, ListState) and isinstance(plain.module, ListState):
        same = same and guarded.module.log == plain.module.log
    return {"detections": _flushed(found), "calls": (guarded.module.calls, plain.module.calls),
            "same": same}


def contrastive_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A contrastive loss over every rank's embeddings (SimCLR's pattern): each rank's second
    views are all-gathered (their gradient stays local) and its first views are scored
    against all of them."""
    x, y = batch
    za, zb = F.normalize(model(x), dim=1), F.normalize(model(y), dim=1)
    every = [torch.empty_like(zb) for _ in range(dist.get_world_size())]
    dist.all_gather(every, zb.detach())
    every[dist.get_rank()] = zb
    labels = torch.arange(za.shape[0]) + dist.get_rank() * za.shape[0]
    return F.cross_entropy(za @ torch.cat(every).t() / 0.1, labels)


def contrastive_run(rank: int, world: int, replay: bool) -> dict[str, Any]:
    """``contrastive_loss`` under the default checks, with the replay or without: the error
    and its step, and the detections."""
    torch.manual_seed(0)
    model = DDP(make_mlp())

    def views(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = batch_for(r, step)[0]
        return x, x.flip(1)

    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     loss_fn=contrastive_loss, batch_for=views, on_detection=found.append,
                     config=GuardConfig(replay_interval=1 if replay else 0,
                                        deterministic=replay))
    return _until_refused(guard, found, 4, flush=True)


def rank_loss_run(rank: int, world: int) -> dict[str, Any]:
    """A loss that depends on the process's rank (its targets shifted by dist.get_rank()),
    with the replay every step: the detections."""
    torch.manual_seed(0)
    model = DDP(make_mlp())

    def shifted(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(m(x), (y + dist.get_rank()) % 4)

    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=shifted,
                     batch_for=batch_for, on_detection=found.append,
                     config=GuardConfig(replay_interval=1, deterministic=True))
    for s in range(3):
        guard.step(s)
    found += guard.flush()
    return {"detections": _flushed(found), "details": [d.detail for d in found]}


def nonfinite_origin_run(rank: int, world: int, origin: str, checksum: bool = False,
                         native: bool = True) -> dict[str, Any]:
    """A NaN on rank 1 at step 2, from its batch (``origin="data"``: an Inf in its input, the
    same wherever the batch is computed) or from its hardware (``"hardware"``: a NaN written
    into its local gradient bucket), under the guard's default checks (and the checksum
    check, on the C passes or the torch path): the detections (with their suspects) and the
    withheld steps."""
    with contextlib.nullcontext() if native else sdc_guard.native_kernel(False):
        return _nonfinite_origin_run(rank, origin, checksum)


def _nonfinite_origin_run(rank: int, origin: str, checksum: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(make_mlp())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def data(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch_for(r, step)
        if origin == "data" and (r, step) == (1, 2):
            x = x.clone()
            x[0, 0] = float("inf")
        return x, y

    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=data,
                     config=GuardConfig(checksum=checksum))
    if origin == "hardware" and rank == 1:
        def nan(bucket: Any) -> None:
            if guard.backend.step == 2:
                bucket.buffer()[0] = float("nan")
        guard.backend.before.append(nan)
    reports = [guard.step(s) for s in range(5)]
    found = [(d.check, d.step, d.suspect_ranks, d.detail)
             for d in [d for r in reports for d in r.detections] + guard.flush()]
    return {"detections": found, "skipped": [r.step for r in reports if r.skipped]}


def ignored_params_run(rank: int, world: int) -> dict[str, Any]:
    """Parameters DDP ignores (``_ddp_params_and_buffers_to_ignore``): trained, each rank its
    own (the replay refuses them; the weights check leaves them out), and frozen, equal on
    every rank (audited) or not (refused)."""
    out: dict[str, Any] = {}
    cfg = GuardConfig(replay_interval=1, deterministic=True)
    for case in ("trained", "frozen_equal", "frozen_differ"):
        net = make_mlp()
        setattr(net, "_ddp_params_and_buffers_to_ignore", ["2.weight", "2.bias"])  # noqa: B010
        layer = net.get_submodule("2")
        if case != "trained":
            layer.requires_grad_(False)
        if case == "frozen_differ":
            with torch.no_grad():
                layer.get_parameter("bias").add_(rank)
        model = DDP(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=cfg)
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
        if case == "frozen_differ":
            continue
        if case == "trained":  # the weights check and the checksum
            guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                             config=dataclasses.replace(cfg, replay_interval=0, checksum=True))
            check = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
            out["weight_grads_checked"] = [x.name for x in check.layers if x.gw_checked]
        found = [d for s in range(4) for d in guard.step(s).detections] + guard.flush()
        out[f"{case}_detections"] = _flushed(found)
        out[f"{case}_ignored"] = sdc_guard.fingerprint(list(layer.parameters()))
    return out


class SparseEmbedding(nn.Module):
    """Token ids from the batch's features into ``nn.Embedding(sparse=True)`` (a sparse COO
    gradient, in a DDP bucket of its own: the step's last, the embedding coming first), then
    a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(40, 16, sparse=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 8).long().clamp(max=39)[:, :3]
        return self.head(self.emb(ids).mean(dim=1))  # type: ignore[no-any-return]


def sparse_embedding_run(rank: int, world: int, steps: int,
                         fault: dict[str, Any] | None) -> dict[str, Any]:
    """Every check on a model with a sparse embedding gradient; ``fault``: on ``rank`` at
    ``step``, one element of the local embedding gradient multiplied by ``factor`` (finite:
    the replay's to find), by a hook on the parameter (which the replay's recomputation of
    the neighbour's batch on that rank passes through too)."""
    model = DDP(SparseEmbedding())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = GuardConfig(replay_interval=1, deterministic=True, weights_interval=1, checksum=True)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=cfg)
    now = {"step": -1}
    if fault is not None and fault["rank"] == rank:
        def corrupt(g: torch.Tensor) -> torch.Tensor:
            if now["step"] != fault["step"]:
                return g
            c = g.coalesce()
            values = c.values().clone()
            values.view(-1)[0] *= fault["factor"]
            return torch.sparse_coo_tensor(c.indices(), values, c.shape)
        model.module.emb.weight.register_hook(corrupt)
    found: list[tuple[str, int, tuple[int, ...], bool]] = []
    for step in range(steps):
        now["step"] = step
        rep = guard.step(step)
        found += [(d.check, d.step, d.suspect_ranks, rep.skipped) for d in rep.detections]
    found += [(d.check, d.step, d.suspect_ranks, False) for d in guard.flush()]
    dist.barrier()
    return {"detections": found,
            "state": sdc_guard.fingerprint(sdc_guard.state_tensors(model.module, optimizer))}


def zero_checkpoint_run(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    """``ZeroRedundancyOptimizer`` (each rank holds a shard of the optimizer state) under the
    guard, saved after step 2 and restored after step 4: this rank's shard and the weights
    as saved, and every detection (there should be none)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = DDP(make_mlp())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=1e-2)
    ckpt = CheckpointManager(ckpt_dir)
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for, checkpoints=ckpt,
                     config=GuardConfig(replay_interval=2, deterministic=True))

    def shard() -> int:
        return sdc_guard.fingerprint([t for st in opt.optim.state.values()
                                      for _, t in sorted(st.items()) if torch.is_tensor(t)])

    found = [d for s in range(3) for d in guard.step(s).detections]
    ckpt.save(2, model, opt)
    saved = (shard(), sdc_guard.fingerprint(list(model.parameters())))
    found += [d for s in range(3, 5) for d in guard.step(s).detections]
    moved = shard() != saved[0]
    start = ckpt.restore(model, opt)
    restored = (shard(), sdc_guard.fingerprint(list(model.parameters())))
    found += [d for s in range(start, 5) for d in guard.step(s).detections] + guard.flush()
    return {"start": start, "moved": moved, "restored_as_saved": restored == saved,
            "detections": _flushed(found)}


def replay_layout_run(rank: int, world: int, steps: int, *, width: int,
                      unused: bool = False, bucket_mb: float = 25.0,
                      as_view: bool = False) -> dict[str, Any]:
    """The replay audit's gradient word from flat DDP buckets against the per-gradient path.

    ``width`` odd gives parameters that are not whole 64-bit words (the per-gradient
    path); ``unused`` gives DDP a parameter without a gradient (find_unused_parameters);
    ``as_view``: DDP's ``gradient_as_bucket_view``.
    """
    torch.manual_seed(0)
    model = DDP(SpareMLP(width, unused), find_unused_parameters=unused, bucket_cap_mb=bucket_mb,
                gradient_as_bucket_view=as_view)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = GuardConfig(replay_interval=1, deterministic=True, weights_interval=1)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for, config=cfg)
    replay = next(c for c in guard.checks if isinstance(c, ReplayAudit))
    same: list[bool] = []
    step_words: list[int] = []
    summed: list[bool] = []

    class Compare(BucketListener):
        def local(self, bucket: Any) -> None:  # runs before the scaling pass
            compare(bucket)

        def before_last_allreduce(self) -> None:  # every share has been delivered
            total()

    def compare(bucket: Any) -> None:
        idx = [replay.index[id(p)] for p in bucket.parameters()]
        per_gradient = to_unsigned64(int(replay._digest(bucket.gradients(), idx)))
        step_words.append(per_gradient)
        plan = replay._plan(bucket, idx)
        if plan is not None:  # the buffer's own path (host or tensor)
            same.append(to_unsigned64(int(plan.digest(bucket.buffer()))) == per_gradient)

    def total() -> None:  # every bucket's share has been delivered (fused or not)
        assert replay._own_grad is not None
        want = sum(step_words) & ((1 << 64) - 1)
        summed.append(to_unsigned64(int(replay._own_grad)) == want)
        step_words.clear()

    guard.backend.subscribe(Compare())
    reports = [guard.step(s) for s in range(steps)]
    return {"detections": _summary(reports) + _flushed(guard.flush()), "same": same,
            "summed": summed,
            "fused": guard.backend.fused_digests, "native": sdc_guard.native_enabled(),
            "flat_buckets": [p is not None for p in replay._plans.values()]}


def hooks_run(rank: int, world: int, mode: str) -> dict[str, Any]:
    """A user comm hook composed with the guard, or a GradScaler with an inf gradient."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DDP(make_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs: dict[str, Any] = {}
    if mode == "user_hook":
        kwargs = {"comm_hook": default_hooks.allreduce_hook, "comm_hook_state": None}
    if mode == "scaler":
        kwargs = {"grad_scaler": torch.amp.GradScaler("cpu", init_scale=2.0**10)}
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(), **kwargs)
    if rank == 1:
        def poison(bucket: Any) -> None:
            if guard.backend.step == 2:
                bucket.buffer()[0] = float("inf") if mode == "scaler" else float("nan")
        guard.backend.before.append(poison)
    reports = [guard.step(s) for s in range(5)]
    out: dict[str, Any] = {"detections": _summary(reports) + _flushed(guard.flush()),
                           "final": sdc_guard.fingerprint(list(model.module.parameters())),
                           "skipped": [r.step for r in reports if r.skipped],
                           "finite": all(bool(torch.isfinite(p).all())
                                         for p in model.module.parameters())}
    if mode == "scaler":
        out["scale"] = float(kwargs["grad_scaler"].get_scale())
    return out


def vote_run(rank: int, world: int, words: list[int]) -> list[int] | None:
    """gather_if_different on this rank's word from ``words`` (one per rank)."""
    from sdc_guard.collectives import gather_if_different

    return gather_if_different(torch.tensor([words[rank]], dtype=torch.int64))


# -- the injectors' tests -----------------------------------------------------------------
PADDING_FEATURE = 15
"""Input feature that is always 0: column 15 of ``0.weight`` has an exactly-zero gradient."""


def padded_batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_for`` with input feature ``PADDING_FEATURE`` always 0."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(8, 16, generator=g)
    x[:, PADDING_FEATURE] = 0.0
    y = torch.randint(0, 4, (8,), generator=g)
    return x, y


def _no_module_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def _same_items(now: list[Any], before: list[Any]) -> bool:
    return len(now) == len(before) and all(a is b for a, b in zip(now, before, strict=True))


def _grad_observer(comm: GuardCommHook, step_of: Any, out: dict[int, list[int]]) -> None:
    """Record a fingerprint of each local bucket as the all-reduce would see it."""
    def observe(bucket: Any) -> None:
        out.setdefault(step_of(), []).append(sdc_guard.fingerprint(bucket.buffer()))
    comm.before.append(observe)


def guard_trials(rank: int, world: int, trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each trial: ``faults`` (list of Fault), ``steps``, ``opt``, ``cfg`` (GuardConfig kwargs),
    ``compile`` (the module inside DDP compiled: targets then start with ``_orig_mod.``),
    ``gelu`` (GELU activations instead of ReLU)."""
    results = []
    for trial in trials:
        net = make_mlp(act=nn.GELU if trial.get("gelu") else nn.ReLU)
        model = DDP(torch.compile(net) if trial.get("compile") else net)
        optimizer = make_optimizer(model, trial.get("opt", "adamw"))
        guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=padded_batch_for,
                         config=GuardConfig(**trial.get("cfg", {})))
        lists_before = (list(guard.before_step), list(guard.backend.before), list(guard.backend.after))
        handles = [arm(f, guard=guard) for f in trial.get("faults", [])]
        grads: dict[int, list[int]] = {}
        _grad_observer(guard.backend, lambda g=guard: g.backend.step, grads)
        reports = [guard.step(s) for s in range(trial["steps"])]
        flushed = guard.flush()
        guard.backend.before.pop()  # the observer
        for h in handles:
            h.remove()
        clean = (_same_items(guard.before_step, lists_before[0])
                 and _same_items(guard.backend.before, lists_before[1])
                 and _same_items(guard.backend.after, lists_before[2])
                 and _no_module_hooks(model.module))
        results.append({
            "detections": [(d.check, d.step, d.suspect_ranks)
                           for d in [*(d for r in reports for d in r.detections), *flushed]],
            "skipped": [r.step for r in reports if r.skipped],
            "losses": [r.loss for r in reports],
            "grads": [grads.get(s, []) for s in range(trial["steps"])],
            "final": sdc_guard.fingerprint(list(model.module.parameters())),
            "records": [rec for h in handles for rec in h.records],
            "armed": [h.armed for h in handles],
            "clean": clean,
        })
        del guard, model, optimizer, handles
    gc.collect()  # once: with torch._dynamo imported (by DDP) a full collection costs ~1 s
    dist.barrier()
    return results


def plain_trials(rank: int, world: int, trials: list[dict[str, Any]],
                 bad_faults: list[Fault]) -> tuple[list[dict[str, Any]], list[str]]:
    """A user's own DDP loop with ``GuardCommHook()`` and no SDCGuard.

    Each trial: ``faults``, ``steps``, optional ``events`` (a path for an EventLog sink).
    Also arms each of ``bad_faults`` (see ``arm_errors``), in the same process group.
    """
    errors = arm_errors(rank, world, bad_faults)
    results = []
    for trial in trials:
        model = DDP(make_mlp())
        optimizer = make_optimizer(model, trial.get("opt", "adamw"))
        comm = GuardCommHook()
        model.register_comm_hook(comm, GuardCommHook.hook)
        sink: list[dict[str, Any]] = []
        events = trial.get("events")
        ctx = InjectionContext.plain(model, optimizer=optimizer, comm=comm,
                                     events=events if events is not None else sink)
        handles: list[InjectionHandle] = [arm(f, context=ctx) for f in trial.get("faults", [])]
        losses = []
        for s in range(trial["steps"]):
            for h in handles:  # several handles on one context: the step starts once
                h.begin_step(s)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model, padded_batch_for(rank, s))
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(loss.item())
        for h in handles:
            h.remove()
        results.append({
            "losses": losses,
            "final": sdc_guard.fingerprint(list(model.module.parameters())),
            "records": [rec for h in handles for rec in h.records],
            "sink": sink,
            "armed": [h.armed for h in handles],
            "clean": (comm.before == [] and comm.after == [] and ctx.step_hooks == []
                      and _no_module_hooks(model.module)),
        })
        del model, optimizer, comm, ctx, handles
    gc.collect()
    dist.barrier()
    return results, errors


def arm_errors(rank: int, world: int, faults: list[Fault]) -> list[str]:
    """Arm each fault on every rank against a plain context; return each error (or "")."""
    model = DDP(make_mlp())
    comm = GuardCommHook()
    model.register_comm_hook(comm, GuardCommHook.hook)
    ctx = InjectionContext.plain(model, comm=comm)
    out = []
    for f in faults:
        try:
            h = arm(f, context=ctx)
            out.append(f"armed={h.armed}")
            h.remove()
        except ValueError as e:
            out.append(f"{type(e).__name__}: {e}")
    del model, comm, ctx
    gc.collect()
    return out


class Position:
    """A per-rank state beside the model (a data loader's position): its rank and step."""

    def __init__(self, rank: int) -> None:
        self.state = {"rank": rank, "step": -1}

    def state_dict(self) -> dict[str, int]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def recovery_run(rank: int, world: int, steps: int, ckpt_dir: str, *, every: int,
                 fault: dict[str, Any] | None, cfg: dict[str, Any],
                 schedule: bool = False, background: bool = False) -> dict[str, Any]:
    """Train with a checkpoint every ``every`` steps; on the first unrepaired detection the
    faulty rank's fault is removed (its node replaced) and the run is restored from the last
    clean checkpoint, then trained to the end. ``schedule``: an LR schedule and a per-rank
    ``Position`` go into the checkpoints as ``extra`` states (``positions``: each rank's
    restored one). ``background``: saved on a thread."""
    model = DDP(make_mlp())
    optimizer = make_optimizer(model, "adamw")
    extra: dict[str, Any] = {}
    if schedule:
        extra = {"lr": torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.8 ** s),
                 "position": Position(rank)}
    ckpt = CheckpointManager(ckpt_dir, keep=2)
    guard = SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(**cfg), checkpoints=ckpt)
    armed = {"on": fault is not None and fault["rank"] == rank}

    def fires(step: int) -> bool:
        return bool(fault and armed["on"] and step >= fault["step"]
                    and (fault.get("permanent") or step == fault["step"]))

    def flip() -> None:
        w = next(model.module.parameters()).detach()
        w.view(-1).view(torch.int32)[3] ^= 1 << (fault or {}).get("bit", 0)

    if fault is not None and fault.get("after_step"):
        # after the step's backward, before its optimizer step: this replica's state only
        guard.before_optimizer_step = lambda g: flip() if fires(g.backend.step) else None
    elif fault is not None:  # before the forward: it reaches every replica via the gradient
        guard.before_step.append(lambda step: flip() if fires(step) else None)
    detections: list[tuple[str, int, tuple[int, ...], bool]] = []
    restored: list[tuple[int, int]] = []
    positions: list[dict[str, int]] = []
    step = 0
    while step < steps:
        rep = guard.step(step)
        detections += [(d.check, d.step, d.suspect_ranks, d.repaired) for d in rep.detections]
        if any(not d.repaired for d in rep.detections) and not restored:
            armed["on"] = False  # the faulty node is replaced
            resume = ckpt.restore(model, optimizer, extra=extra)
            restored.append((step, resume))
            if schedule:
                positions.append(extra["position"].state_dict())
            step = resume
            continue
        if schedule:
            extra["lr"].step()
            extra["position"].state["step"] = step
        if step % every == 0:
            ckpt.save(step, model, optimizer, extra=extra, background=background)
        step += 1
    guard.flush()
    ckpt.wait()
    dist.barrier()
    return {"detections": detections, "restored": restored, "positions": positions,
            "final": sdc_guard.fingerprint(sdc_guard.state_tensors(model.module, optimizer))}


# -- several optimizers ----------------------------------------------------------------------
def _muon_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Muon for the 2-D weights, AdamW for the biases (Muon updates matrices only)."""
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.Muon(mats, lr=1e-2), torch.optim.AdamW(rest, lr=1e-2)]


def two_optimizers_run(rank: int, world: int, corrupt_at: int | None,
                       directory: str) -> dict[str, Any]:
    """The MLP trained by Muon and AdamW together under every check (the replay every 2
    steps, the checksum, the weights with both optimizers' states), beside a plain DDP loop
    with the same two optimizers. ``corrupt_at``: at that step, the injector flips a bit of
    rank 1's AdamW ``exp_avg`` of ``2.bias`` (the second optimizer's state). Then a
    checkpoint of both saved, and restored into fresh optimizers (and, refused, into the Muon
    alone)."""
    torch.manual_seed(0)
    guarded = DDP(make_mlp())
    torch.manual_seed(0)
    plain = DDP(make_mlp())
    opts, plain_opts = _muon_adamw(guarded), _muon_adamw(plain)
    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(guarded, opts, loss_fn=loss_fn, batch_for=batch_for,
                     on_detection=found.append,
                     config=GuardConfig(replay_interval=2, deterministic=True, checksum=True,
                                        include_optimizer_state=True))
    if corrupt_at is not None:
        arm(Fault(site="optimizer_state", rank=1, step=corrupt_at, target="2.bias",
                  state_key="exp_avg", index=3, bits=(20,)), guard=guard)
    for s in range(6):
        guard.step(s)
        for opt in plain_opts:
            opt.zero_grad(set_to_none=True)
        loss_fn(plain, batch_for(rank, s)).backward()  # type: ignore[no-untyped-call]
        for opt in plain_opts:
            opt.step()
    found += guard.flush()
    same = all(torch.equal(a, b) for a, b in zip(
        sdc_guard.state_tensors(guarded.module, opts),
        sdc_guard.state_tensors(plain.module, plain_opts), strict=True))
    ckpt = CheckpointManager(directory)
    ckpt.save(5, guarded, opts)
    fresh = _muon_adamw(guarded)
    start = ckpt.restore(guarded, fresh)
    restored = all(torch.equal(a, b) for a, b in zip(
        sdc_guard.state_tensors(guarded.module, opts),
        sdc_guard.state_tensors(guarded.module, fresh), strict=True))
    try:
        ckpt.restore(guarded, fresh[0])
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"detections": _flushed(found), "same": same, "start": start,
            "restored": restored, "refused": refused,
            "states": len(sdc_guard.state_tensors(guarded.module, opts))}


def save_then_restore_run(rank: int, world: int, directory: str) -> dict[str, Any]:
    """A checkpoint saved and at once restored, no collective between: the step each rank
    resumes from (rank 0 writes while the others go on to restore)."""
    torch.manual_seed(0)
    model = DDP(make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(directory)
    ckpt.save(3, model, opt)
    return {"start": ckpt.restore(model, opt)}


def two_optimizers_scaler_run(rank: int, world: int) -> dict[str, Any]:
    """Muon and AdamW under a ``GradScaler`` with gradient clipping in
    ``before_optimizer_step`` (each optimizer unscaled), the replay and the checksum on,
    beside the same plain loop: the detections, and whether both end alike bit for bit."""
    torch.manual_seed(0)
    guarded = DDP(make_mlp())
    torch.manual_seed(0)
    plain = DDP(make_mlp())
    opts, plain_opts = _muon_adamw(guarded), _muon_adamw(plain)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    def clip(g: SDCGuard) -> None:
        for opt in g.optimizers:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(g.model.parameters(), 1.0)

    found: list[sdc_guard.Detection] = []
    guard = SDCGuard(guarded, opts, loss_fn=loss_fn, batch_for=batch_for, grad_scaler=scaler,
                     before_optimizer_step=clip, on_detection=found.append,
                     config=GuardConfig(replay_interval=2, deterministic=True, checksum=True))
    for s in range(6):
        guard.step(s)
        for opt in plain_opts:
            opt.zero_grad(set_to_none=True)
        plain_scaler.scale(loss_fn(plain, batch_for(rank, s))).backward()  # type: ignore[no-untyped-call]
        for opt in plain_opts:
            plain_scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        for opt in plain_opts:
            plain_scaler.step(opt)
        plain_scaler.update()
    found += guard.flush()
    a, b = guarded.module.state_dict(), plain.module.state_dict()
    return {"detections": _flushed(found), "same": all(torch.equal(a[k], b[k]) for k in a)}


def freeze_run(rank: int, world: int) -> dict[str, Any]:
    """``make_mlp`` under DDP with ``find_unused_parameters=True``, its middle layer frozen
    (``requires_grad_(False)``) from step 2 on (its product's backward still runs: the
    first layer needs its input gradient) and its first layer from step 4, trained with
    the replay every step, the
    checksum and the weights check, beside a plain DDP loop frozen alike: the detections,
    and whether both runs end with the same parameters."""
    cfg = GuardConfig(replay_interval=1, deterministic=True, checksum=True)
    guarded = DDP(make_mlp(), find_unused_parameters=True)
    plain = DDP(make_mlp(), find_unused_parameters=True)
    guard = SDCGuard(guarded, torch.optim.AdamW(guarded.parameters(), lr=1e-2),
                     loss_fn=loss_fn, batch_for=batch_for, config=cfg)

    def freeze(s: int) -> None:
        if s in (2, 4):
            for model in (guarded, plain):
                for p in model.module[4 - s].parameters():
                    p.requires_grad_(False)

    found, same = beside_plain(guard, plain, rank, 7, freeze)
    return {"detections": _flushed(found), "same": same}


def qat_run(rank: int, world: int) -> dict[str, Any]:
    """``make_mlp`` prepared for quantisation-aware training (``torch.ao.quantization``:
    fake-quantised weights and activations whose observers' per-channel ranges start empty
    and take their shape in the first forward), trained with the replay every step and the
    weights check beside a plain DDP loop: the detections, and whether both runs end with
    the same parameters and buffers (the observers' ranges, the fake quantisers' scales)."""
    import torch.ao.quantization as quant

    def make() -> DDP:
        net: Any = nn.Sequential(quant.QuantStub(), *make_mlp().children(), quant.DeQuantStub())
        net.qconfig = quant.get_default_qat_qconfig("x86")  # type: ignore[no-untyped-call]
        quant.prepare_qat(net.train(), inplace=True)  # type: ignore[no-untyped-call]
        return DDP(net)

    guarded, plain = make(), make()
    guard = SDCGuard(guarded, torch.optim.AdamW(guarded.parameters(), lr=1e-2),
                     loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(replay_interval=1, deterministic=True))
    found, same = beside_plain(guard, plain, rank, 4)
    return {"detections": _flushed(found), "same": same,
            "ranges": tuple(guarded.module[1].weight_fake_quant.activation_post_process
                            .min_val.shape)}
