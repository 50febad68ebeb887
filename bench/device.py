"""The device script's workloads and timings (``python -m bench.device_check``).

* ``workload``: a DDP model of the campaign's kinds (or the bench's reference MLP) on a
  device, with its optimizer, loss and batches; the device tests build theirs here too;
* ``checksum_timing``: guarded steps on ranks of the device with the checksum off, on, and
  with its sides' fused expressions, each check alone and plain DDP beside them, rotated
  round by round, and per step, from torch's profiler, the kernel launches, the stream syncs,
  the copies and the ``.item()`` reads;
* ``throughput``: the fingerprint, the replay's word digest and ``torch.hash_tensor`` beside
  one ``torch.sum`` pass over the same float32 tensor.

Only the public API of ``sdc_guard`` and the names ``sdc_guard.internal`` exports are used
here: the paths are switched through ``internal.FINGERPRINT_FUSED_DEVICES`` and
``internal.SIDES_FUSED_DEVICES``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_guard import GuardConfig, SDCGuard, fingerprint_tensor, internal, native_kernel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "autocast": torch.float32}
"""A workload's dtype by name; ``autocast``: a float32 model whose loss runs under autocast
to bfloat16."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A DDP model on its device, ready for a guard or a plain loop."""

    model: DistributedDataParallel
    """The model, wrapped."""
    optimizer: torch.optim.Optimizer
    """AdamW over its parameters."""
    loss: Callable[[nn.Module, Any], torch.Tensor]
    """The ``loss_fn`` (``sdc_guard.LossFn``)."""
    batch_for: Callable[[int, int], Any]
    """The batch of (rank, step), on the device (``sdc_guard.BatchFor``)."""

    def guard(self, config: GuardConfig) -> SDCGuard:
        """An ``SDCGuard`` over this model with ``config``."""
        return SDCGuard(self.model, self.optimizer, loss_fn=self.loss, batch_for=self.batch_for,
                        config=config)

    def plain_step(self, rank: int, step: int) -> None:
        """One step of a plain DDP loop."""
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(self.model, self.batch_for(rank, step)).backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()


def workload(kind: str, dtype: str, device: torch.device, *, batch: int = 32, width: int = 64,
             hooks: Callable[[nn.Module], object] | None = None) -> Workload:
    """``kind``: ``"reference"`` (the bench's MLP, float32, ``width`` unused) or a campaign model
    (``scenarios.spec.models``: mlp, cnn, cnn_bn, transformer; depth 2). ``hooks`` runs on the
    module before DDP wraps it (the user's own hooks)."""
    from bench.reference import classification_batch, cross_entropy_loss, reference_mlp
    from scenarios.spec.models import build_model, scenario_loss, synthetic_batch

    if dtype not in DTYPES:
        raise ValueError(f"workload: dtype is one of {list(DTYPES)}, got {dtype!r}.")
    loss: Callable[[nn.Module, Any], torch.Tensor]
    if kind == "reference":
        module = reference_mlp().to(device)

        def batch_for(r: int, step: int) -> Any:
            x, y = classification_batch(r, step, batch=batch)
            return x.to(device), y.to(device)

        loss = cross_entropy_loss
    else:
        module = build_model(kind, width=width, depth=2, seed=0).to(device, DTYPES[dtype])

        def batch_for(r: int, step: int) -> Any:
            x, y = synthetic_batch(kind, 0, r, step, 0, batch=batch, dtype=DTYPES[dtype])
            return x.to(device), y.to(device)

        loss = scenario_loss
    if dtype == "autocast":
        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return scenario_loss(m, b)

    if hooks is not None:
        hooks(module)
    model = DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
    return Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                    loss=loss, batch_for=batch_for)


@contextlib.contextmanager
def fused_sides(device: torch.device) -> Iterator[list[str]]:
    """The checksum's sides by their fused expressions on ``device`` while the block runs
    (``internal.SIDES_FUSED_DEVICES``); yields the warnings raised meanwhile (a fused form
    that failed to compile or to agree is given up, with a warning, for the eager one).
    On the CPU (the dry run) the sides stay eager: compiling them there takes tens of seconds
    a process, and a CPU's timing is only the plumbing's."""
    was = set(internal.SIDES_FUSED_DEVICES)
    if device.type != "cpu":
        internal.SIDES_FUSED_DEVICES.add(device.type)
    got: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        try:
            yield got
        finally:
            internal.SIDES_FUSED_DEVICES.intersection_update(was)
    for w in caught:
        if str(w.message).startswith("sdc_guard:"):
            got.append(str(w.message))
        else:  # not ours: shown as it would have been
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


CHECKSUM_TIMED = {
    "reference MLP (512-1024-1024-10), batch 128": ("reference", 128, 0, "float32"),
    "MLP 16-4096-4096-4, batch 4096": ("mlp", 4096, 4096, "float32"),
    "transformer (width 128, 2 blocks), batch 64": ("transformer", 64, 128, "float32"),
    "MLP 16-4096-4096-4 in bfloat16, batch 8192": ("mlp", 8192, 4096, "bfloat16")}
"""name -> (model kind, batch, width, dtype) timed with the checksum on and off. The last is
where the sides' reads weigh (64 MiB activations, each read four to six times by the eager
sides, widened and copied, once by the fused ones) and a compiled call's fixed cost does not."""

CHECK_CONFIGS = {
    "guard, checks off": GuardConfig(nonfinite=False, weights_interval=0),
    "nonfinite": GuardConfig(nonfinite=True, weights_interval=0),
    "weights (with optimizer state), every step": GuardConfig(nonfinite=False),
    "weights every 8 steps": GuardConfig(nonfinite=False, weights_interval=8),
}
"""The guard's checks one by one, timed beside plain DDP and the defaults (``_timing_rank``)."""

ROUNDS = 7
"""Rotated rounds of blocks of steps; the first warms up."""


def _timing_rank(rank: int, world: int, device_type: str, timed_steps: int,
                 timed: list[str]) -> dict[str, Any]:
    """The step times of ``timed`` (``CHECKSUM_TIMED`` names) on this rank."""
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
              else torch.device("cpu"))
    out: dict[str, Any] = {"device": str(device), "backend": dist.get_backend(), "timing": {},
                           "fused_warnings": []}
    # The dry run takes the device's path: torch ops, no C passes.
    with native_kernel(False) if device.type == "cpu" else contextlib.nullcontext():
        for name in timed:
            out["timing"][name] = _time_workload(rank, device, *CHECKSUM_TIMED[name],
                                                 timed_steps, out["fused_warnings"])
            dist.barrier()
    return out


def _time_workload(rank: int, device: torch.device, kind: str, batch: int, width: int,
                   dtype: str, timed_steps: int, fused_warnings: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    def guarded(config: GuardConfig) -> SDCGuard:
        return workload(kind, dtype, device, batch=batch, width=width).guard(config)

    guards = {label: guarded(GuardConfig(checksum=c))
              for label, c in (("off", False), ("on", True), ("fused", True))}
    single = {label: guarded(config) for label, config in CHECK_CONFIGS.items()}
    # Plain DDP: a plain loop on a model of its own.
    bare = workload(kind, dtype, device, batch=batch, width=width)

    def fused_step(step: int, g: SDCGuard = guards["fused"]) -> None:
        with fused_sides(device) as caught:
            g.step(step)
        fused_warnings.extend(caught)

    steppers: dict[str, Callable[[int], object]] = {
        "plain": lambda step: bare.plain_step(rank, step),
        **{k: g.step for k, g in guards.items()}, "fused": fused_step,
        **{k: g.step for k, g in single.items()}}
    times: dict[str, list[float]] = {label: [] for label in steppers}
    for r in range(ROUNDS):  # rotated blocks, the first round warms up
        at = r % len(steppers)
        for label in list(steppers)[at:] + list(steppers)[:at]:
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            for s in range(timed_steps):
                steppers[label](r * timed_steps + s)
            _sync(device)
            if r:
                times[label].append((time.perf_counter() - t0) / timed_steps)
    per_step = {label: step_profile(g, ROUNDS * timed_steps, 5)
                for label, g in guards.items() if label != "fused"}
    with fused_sides(device) as caught:
        per_step["fused"] = step_profile(guards["fused"], ROUNDS * timed_steps, 5)
    fused_warnings.extend(caught)
    for g in (*guards.values(), *single.values()):
        g.flush()
    off, on_t = statistics.median(times["off"]), statistics.median(times["on"])
    fused_t = statistics.median(times["fused"])
    base = statistics.median(times["plain"])
    return {"step_ms_plain": base * 1e3, "step_ms_off": off * 1e3,
            "step_ms_checksum": on_t * 1e3, "overhead": on_t / off - 1.0,
            "step_ms_fused": fused_t * 1e3, "overhead_fused": fused_t / off - 1.0,
            "guard_vs_plain": off / base - 1.0,
            "by_check_ms": {label: statistics.median(times[label]) * 1e3 for label in single},
            "per_step": per_step}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_profile(guard: SDCGuard, first: int, steps: int) -> dict[str, Any]:
    """Where a guarded step's host time goes, per step over ``steps`` profiled steps: the
    kernel launches, the stream and device syncs, the copies (``cudaMemcpy*`` in any
    direction: one from or to pageable host memory waits, one between device buffers does
    not), the ``.item()`` reads, and the ten operators taking the most host time of their
    own."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and guard.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for s in range(2):
        guard.step(first + s)
    with profile(activities=activities) as prof:
        for s in range(steps):
            guard.step(first + 2 + s)
        _sync(guard.device)
    events = prof.key_averages()

    def count(match: Callable[[str], bool]) -> float:
        return float(sum(e.count for e in events if match(e.key))) / steps

    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return {
        "kernel_launches": count(lambda k: k.startswith(("cudaLaunch", "cuLaunch"))),
        "stream_syncs": count(lambda k: "Synchronize" in k),
        "memcpy_calls": count(lambda k: k.startswith("cudaMemcpy")),  # any direction
        "item_reads": count(lambda k: k == "aten::_local_scalar_dense"),
        "aten_ops": count(lambda k: k.startswith("aten::")),
        "top_self_host_us": [(e.key, round(e.self_cpu_time_total / steps, 1),
                              e.count / steps) for e in top],
    }


def checksum_timing(device_type: str, world: int, timed_steps: int = 20,
                    timed: list[str] | None = None) -> dict[str, Any]:
    """The step times of ``_timing_rank`` on ``world`` ranks (nccl on GPUs, gloo on the CPU):
    rank 0's, with the fused sides' warnings of every rank. ``timed``: the
    ``CHECKSUM_TIMED`` workloads to time (all by default)."""
    from scenarios.run.launch import run_ranks

    backend = "nccl" if device_type == "cuda" else "gloo"
    results = run_ranks(_timing_rank, world, device_type, timed_steps,
                        list(CHECKSUM_TIMED) if timed is None else timed, timeout=1800,
                        backend=backend)
    return {"world": world, "backend": backend, "timed_steps": timed_steps,
            "timing": results[0]["timing"],
            "fused_warnings": sorted({w for r in results for w in r["fused_warnings"]})}


def _median_time(fn: Callable[[], object], device: torch.device, reps: int = 9) -> float:
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@contextlib.contextmanager
def fingerprint_torch_ops() -> Iterator[None]:
    """The fingerprint's and the digest's weighted sums by torch ops on every device while
    the block runs (``internal.FINGERPRINT_FUSED_DEVICES`` emptied, then restored)."""
    kept = set(internal.FINGERPRINT_FUSED_DEVICES)
    internal.FINGERPRINT_FUSED_DEVICES.clear()
    try:
        yield
    finally:
        internal.FINGERPRINT_FUSED_DEVICES.update(kept)


def throughput(device: torch.device, mib: int) -> dict[str, Any]:
    """Medians of 9 over a float32 tensor of ``mib`` MiB: each method's time, GiB/s, and its
    rate against one ``torch.sum`` pass: the library's own choice of path (the compiled pass
    on large tensors of a device that has one) beside the torch ops alone."""
    def torch_ops(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            with fingerprint_torch_ops():
                return fn()
        return run

    x = torch.randn(mib * 2**20 // 4, device=device)
    methods: dict[str, Callable[[], object]] = {
        "torch.sum (one read pass)": lambda: x.sum(),
        "sdc_guard.fingerprint_tensor": lambda: fingerprint_tensor(x),
        "fingerprint_tensor, torch ops": torch_ops(lambda: fingerprint_tensor(x)),
        "replay word digest": lambda: internal.digest_value(x),
        "replay word digest, torch ops": torch_ops(lambda: internal.digest_value(x)),
        "torch.hash_tensor (XOR)": lambda: torch.hash_tensor(x),
    }
    times = {k: _median_time(f, device) for k, f in methods.items()}
    base = times["torch.sum (one read pass)"]
    return {"tensor_mib": mib, "methods": {
        k: {"median_s": t, "gib_per_s": mib / 1024 / t, "ratio_to_sum": base / t}
        for k, t in times.items()}}
