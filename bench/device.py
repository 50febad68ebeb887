"""The device script's workloads and measurements (``python -m bench.device_check``).

* ``workload``: a DDP model of the campaign's kinds (or the bench's reference MLP) on a
  device, with its optimizer, loss and batches; the device tests build theirs here;
* ``gpt_timing``: a GPT-2-small-sized model (``Gpt``, ours: 12 layers, width 768, 12 heads,
  vocabulary 50257, context 1024, ~124M parameters, nothing downloaded), bf16 autocast,
  AdamW, one rank under DDP: plain DDP beside the guard with its checks off, each check
  alone, the defaults and the defaults with the checksum, in rotated blocks; the replay's
  cost per audit step beside one extra forward and backward; per step, from torch's
  profiler, the kernel launches, the stream syncs, the device-to-host copies and the
  ``.item()`` reads, and the synchronisations ``torch.cuda.set_sync_debug_mode("warn")``
  reports (``sync_counts``);
* ``throughput``: the fingerprint, the replay's word digest and ``torch.hash_tensor`` beside
  one ``torch.sum`` pass over one float32 tensor; ``list_throughput``: the fingerprint of the
  GPT's parameter tensors beside a ``torch.sum`` per tensor and ``torch._foreach_norm``; each
  with its kernel launches per call.

Every measurement stops at the deadline it is given and says what it cut. Only the public
API of ``sdc_guard`` and the names ``sdc_guard.internal`` exports are used here.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

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


# -- the GPT-2-small-sized workload ------------------------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class GptShape:
    """A GPT-2-style decoder's size: pre-norm blocks of causal self-attention (torch's
    ``scaled_dot_product_attention``) and a tanh-GELU MLP of width 4x, learned positions, the
    output layer tied to the token embedding (as GPT-2's)."""

    layers: int
    """Transformer blocks."""
    width: int
    """The residual stream's width."""
    heads: int
    """Attention heads (``width`` divides by it)."""
    vocab: int
    """Vocabulary size."""
    context: int
    """Tokens per sequence."""

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "vocab", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GptShape.{name} must be an int >= 1, got {value!r}.")
        if self.width % self.heads:
            raise ValueError(f"GptShape.width ({self.width}) must be a multiple of heads "
                             f"({self.heads}): each head takes width/heads channels.")


GPT2_SMALL = GptShape(layers=12, width=768, heads=12, vocab=50257, context=1024)
"""GPT-2 small's size: 124.4M parameters in 148 tensors."""
GPT_TINY = GptShape(layers=2, width=64, heads=4, vocab=512, context=32)
"""The same code at a size the CPU dry run steps in milliseconds."""


class _Block(nn.Module):
    def __init__(self, s: GptShape) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1, self.ln2 = nn.LayerNorm(s.width), nn.LayerNorm(s.width)
        self.qkv, self.proj = nn.Linear(s.width, 3 * s.width), nn.Linear(s.width, s.width)
        self.fc, self.out = nn.Linear(s.width, 4 * s.width), nn.Linear(4 * s.width, s.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, w // self.heads).permute(
            2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return out


class Gpt(nn.Module):
    """A GPT-2-style language model of ``GptShape`` (``tokens -> logits``)."""

    def __init__(self, s: GptShape) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(s.vocab, s.width), nn.Embedding(s.context, s.width)
        self.blocks = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def build_gpt(shape: GptShape, device: torch.device, seed: int = 0) -> Gpt:
    """A ``Gpt`` initialised on ``device`` from ``seed`` (GPT-2's N(0, 0.02))."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with device:
            return Gpt(shape)


def gpt_loss(device_type: str) -> Callable[[nn.Module, Any], torch.Tensor]:
    """Next-token cross-entropy of a ``(batch, context + 1)`` token tensor, the model under
    bf16 autocast (the loss in float32, as autocast computes it)."""
    def loss(model: nn.Module, tokens: Any) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return loss


def gpt_workload(template: Gpt, pool: torch.Tensor, device: torch.device) -> Workload:
    """A copy of ``template`` under DDP with AdamW; batch (rank, step) is one of ``pool``'s
    token tensors (made on the device once: a step copies nothing from the host)."""
    model = DistributedDataParallel(copy.deepcopy(template),
                                    device_ids=[device.index] if device.type == "cuda" else None)

    def batch_for(rank: int, step: int) -> torch.Tensor:
        return pool[(rank * 5 + step) % pool.shape[0]]

    return Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                    loss=gpt_loss(device.type), batch_for=batch_for)


def token_pool(shape: GptShape, batch: int, device: torch.device, n: int = 8) -> torch.Tensor:
    """``n`` batches of ``batch`` random sequences of ``context + 1`` tokens, on ``device``."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, shape.vocab, (n, batch, shape.context + 1), generator=g).to(device)


@dataclass(frozen=True, kw_only=True, slots=True)
class GptPlan:
    """How ``gpt_timing`` measures: the model, its batch, the blocks and the counts."""

    shape: GptShape
    """The model's size."""
    batch: int
    """Sequences per step to start from: the batch when ``target_step_s`` is None."""
    target_step_s: float | None
    """A plain DDP step's time to aim at: the batch is ``batch`` scaled by the target over a
    measured plain step (``calibrate``), within ``max_batch`` and the device's memory."""
    max_batch: int
    """The most sequences a step may take."""
    block: int
    """Steps per timed block (one block of each configuration a round)."""
    rounds: int
    """Rounds at most, the first a warm-up; fewer when the deadline comes first (at least
    two measured rounds give an interval)."""
    replay_interval: int
    """The replay audit's interval (every k-th step an audit step)."""
    replay_block: int
    """Steps per block of the replay's rounds, each step timed alone (a multiple of
    ``replay_interval``)."""
    profile_steps: int
    """Steady steps profiled per configuration (after two unprofiled ones)."""
    sync_steps: int
    """Steady steps whose synchronisations are counted per configuration."""

    def __post_init__(self) -> None:
        for name in ("batch", "max_batch", "block", "profile_steps", "sync_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GptPlan.{name} must be an int >= 1, got {value!r}.")
        if not isinstance(self.rounds, int) or self.rounds < 2:
            raise ValueError(f"GptPlan.rounds must be an int >= 2 (a warm-up round, then the "
                             f"measured ones), got {self.rounds!r}.")
        k = self.replay_interval
        if not isinstance(k, int) or k < 2 or self.replay_block % k:
            raise ValueError(f"GptPlan.replay_interval must be an int >= 2 (an audit step and "
                             f"others to compare it with) that divides replay_block "
                             f"({self.replay_block}), got {k!r}.")
        if self.target_step_s is not None and not self.target_step_s > 0:
            raise ValueError(f"GptPlan.target_step_s must be seconds > 0, or None to keep the "
                             f"batch, got {self.target_step_s!r}.")


DEVICE_PLAN = GptPlan(shape=GPT2_SMALL, batch=32, target_step_s=0.1, max_batch=64, block=4,
                      rounds=9, replay_interval=4, replay_block=8, profile_steps=4, sync_steps=8)
"""On a GPU. The batch from arithmetic: a step is about ``6 x 124M x tokens`` flops plus the
attention's ``12 x layers x context x width`` a token (~0.86 GFLOP a token); 32 sequences of
1024 tokens are ~2.8e13 flops, ~100 ms at ~280 TFLOPS of bf16 (an H100 or H200 running eager
PyTorch), then scaled by the measured plain step. ``sync_steps`` spans a non-finite flags
window (8 steps)."""
DRY_PLAN = GptPlan(shape=GPT_TINY, batch=2, target_step_s=0.005, max_batch=4, block=2,
                   rounds=3, replay_interval=2, replay_block=2, profile_steps=2, sync_steps=3)
"""The CPU dry run: the same code on ``GPT_TINY``, two steps a block."""

GPT_CONFIGS = {
    "guard, checks off": GuardConfig(nonfinite=False, weights_interval=0),
    "nonfinite": GuardConfig(nonfinite=True, weights_interval=0),
    "weights every step (with optimizer state)": GuardConfig(nonfinite=False),
    "checksum": GuardConfig(nonfinite=False, weights_interval=0, checksum=True),
    "defaults": GuardConfig(),
    "defaults + checksum": GuardConfig(checksum=True),
}
"""The guard's configurations timed beside plain DDP (``PLAIN``); the replay's are
``replay_configs``."""
PLAIN = "plain DDP"
REPLAY, IDEAL = "replay", "one extra forward+backward"


def replay_configs(k: int) -> dict[str, GuardConfig]:
    """The replay alone, every ``k`` steps, and the guard with no check under the same
    deterministic mode (``IDEAL`` adds one forward and backward to its every k-th step)."""
    off = GuardConfig(nonfinite=False, weights_interval=0, deterministic=True)
    return {REPLAY: GuardConfig(nonfinite=False, weights_interval=0, deterministic=True,
                                replay_interval=k), IDEAL: off}


# -- counting what a step makes the host do ----------------------------------------------------

SYNC_MESSAGE = "called a synchronizing CUDA operation"
"""What ``torch.cuda.set_sync_debug_mode("warn")`` warns at each synchronisation."""

VALUE_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "equal",
                         "is_nonzero", "_unique2", "unique_consecutive", "repeat_interleave"})
"""aten ops that make a GPU's host wait for the device: a value read (``.item()``,
``bool(t)``) or an output shaped by the values."""


class CpuSyncWarnings(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """On the CPU, where ``set_sync_debug_mode`` does nothing: the same warning as CUDA's, at
    each op of ``VALUE_READS`` dispatched while entered (the reads that would wait on a GPU),
    so the dry run counts through the same code as the device."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in VALUE_READS:
            warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=2)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def sync_debug(device: torch.device) -> Iterator[None]:
    """Synchronisations warned while the block runs: ``torch.cuda.set_sync_debug_mode("warn")``
    on CUDA (restored after), ``CpuSyncWarnings`` elsewhere."""
    if device.type == "cuda":
        was = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(was)
    else:
        with CpuSyncWarnings():  # type: ignore[no-untyped-call]
            yield


_PLUMBING = ("/torch/_dynamo/", "/torch/_compile.py", "/torch/utils/_python_dispatch.py",
             "/warnings.py", "/contextlib.py", "/bench/device.py")
"""Frames that only pass a warning on (``_site`` skips them)."""


def _site(stack: traceback.StackSummary) -> str:
    """Where a synchronisation happened: the innermost frame that is not ``_PLUMBING``, and
    when that is not in ``sdc_guard``, the innermost frame of ``sdc_guard`` that led there
    (``torch/optim/optimizer.py:95 via sdc_guard/guard.py:428``)."""
    def name(f: traceback.FrameSummary) -> str:
        path = f.filename
        for root in ("/sdc_guard/", "/site-packages/"):
            if root in path:
                path = (root.strip("/") + "/" if root == "/sdc_guard/" else "") + path.split(
                    root, 1)[1]
        return f"{path}:{f.lineno}"

    frames = [f for f in stack if not any(p in f.filename for p in _PLUMBING)] or list(stack)
    ours = [f for f in frames if "/sdc_guard/" in f.filename]
    if not ours or ours[-1] is frames[-1]:
        return name(frames[-1])
    return f"{name(frames[-1])} via {name(ours[-1])}"


def sync_counts(run: Callable[[int], object], steps: range, device: torch.device,
                debug: Callable[[torch.device], contextlib.AbstractContextManager[None]]
                = sync_debug) -> dict[str, Any]:
    """``run`` of each of ``steps`` under ``debug``: the synchronisations warned in each step
    (``SYNC_MESSAGE``), and the five places that warned most (``_site``: where in
    ``sdc_guard``, or in torch, the host waited)."""
    per_step: list[int] = []
    sites: Counter[str] = Counter()
    seen = [0]

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        if SYNC_MESSAGE in str(message):
            seen[0] += 1
            sites[_site(traceback.extract_stack())] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        with debug(device):
            for s in steps:
                before = seen[0]
                run(s)
                per_step.append(seen[0] - before)
    return {"syncs_per_step": per_step, "sync_sites": sites.most_common(5)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_counts(run: Callable[[int], object], steps: range,
                   device: torch.device) -> dict[str, Any]:
    """Per step of ``steps`` (``run`` of each, profiled): the kernel launches (``cudaLaunch*``,
    ``cuLaunch*``, graph launches), the stream, event and device synchronisations, the
    ``cudaMemcpy*`` calls (any direction), the device-to-host and host-to-device copies the
    device ran, the ``.item()`` reads (``aten::_local_scalar_dense``) and the aten ops. The
    events are counted by name from the profiler's raw results (building its per-operator
    tables would take seconds a step on a GPT-2-sized step)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for s in steps:
            run(s)
        _sync(device)
    results = getattr(prof.profiler, "kineto_results", None)
    names: Counter[str] = (Counter(e.name() for e in results.events()) if results is not None
                           else Counter({e.key: e.count for e in prof.key_averages()}))
    n = max(len(steps), 1)

    def count(match: Callable[[str], bool]) -> float:
        return sum(c for k, c in names.items() if match(k)) / n

    return {
        "kernel_launches": count(lambda k: k.startswith(("cudaLaunch", "cuLaunch",
                                                         "cudaGraphLaunch"))),
        "stream_syncs": count(lambda k: "Synchronize" in k),
        "memcpy_calls": count(lambda k: k.startswith("cudaMemcpy")),
        "d2h_copies": count(lambda k: k.startswith("Memcpy DtoH")),
        "h2d_copies": count(lambda k: k.startswith("Memcpy HtoD")),
        "item_reads": count(lambda k: k == "aten::_local_scalar_dense"),
        "aten_ops": count(lambda k: k.startswith("aten::")),
    }


# -- timing ------------------------------------------------------------------------------------

@dataclass
class Runner:
    """A configuration's step, its next step number, and what its steps reported."""

    step: Callable[[int], Any]
    """Runs one step (a ``StepReport`` from a guard, None from the plain loop)."""
    guard: SDCGuard | None = None
    """The guard whose step it is (``flush`` asks it for its late detections)."""
    at: int = 0
    """The next step number."""
    reported: list[tuple[str, int]] = field(default_factory=list)
    """(check, step) of every detection and ("withheld", step) of every withheld step."""

    def __call__(self, step: int) -> None:
        report = self.step(step)
        if report is not None:
            self.reported += [(d.check, d.step) for d in report.detections]
            if report.skipped:
                self.reported.append(("withheld", step))

    def flush(self) -> None:
        """The guard's late detections (``SDCGuard.flush``) added to ``reported``."""
        if self.guard is not None:
            self.reported += [(d.check, d.step) for d in self.guard.flush()]

    def steps(self, n: int) -> range:
        """The next ``n`` step numbers, taken."""
        self.at += n
        return range(self.at - n, self.at)


def time_rounds(runners: dict[str, Runner], block: int, rounds: int, device: torch.device,
                deadline: float, *, each_step: bool = False) -> tuple[dict[str, list[Any]], bool]:
    """Rotated rounds of one block of ``block`` steps per runner (the first round a warm-up,
    not kept), until ``rounds`` or until the next round would pass ``deadline``
    (``time.time()``). Per runner, per kept round: the block's seconds per step, or with
    ``each_step`` each step's ``(step, seconds)`` (the device synchronised around each).
    Returns the rounds and whether the deadline cut them."""
    names = list(runners)
    kept: dict[str, list[Any]] = {n: [] for n in names}
    last = 0.0
    for r in range(rounds):
        if r and time.time() + last > deadline:
            return kept, True
        t_round = time.perf_counter()
        for name in names[r % len(names):] + names[:r % len(names)]:
            run = runners[name]
            _sync(device)
            samples: list[Any] = []
            t0 = time.perf_counter()
            for s in run.steps(block):
                if each_step:
                    t0 = time.perf_counter()
                run(s)
                if each_step:
                    _sync(device)
                    samples.append((s, time.perf_counter() - t0))
            if not each_step:
                _sync(device)
                samples.append((time.perf_counter() - t0) / block)
            if r:
                kept[name].append(samples if each_step else samples[0])
        last = time.perf_counter() - t_round
    return kept, False


def ratio_stats(per_round: list[float]) -> dict[str, Any]:
    """The median of per-round values and its 90% bootstrap interval over rounds."""
    from bench.timing import bootstrap_interval

    if not per_round:
        return {"median": None, "interval_90": None, "rounds": 0}
    interval = (bootstrap_interval({"r": [[x] for x in per_round]},
                                   lambda m: statistics.median(m["r"]))
                if len(per_round) > 1 else None)
    return {"median": statistics.median(per_round), "interval_90": interval,
            "rounds": len(per_round)}


def per_audit(samples: list[tuple[int, float]], k: int) -> float:
    """The extra seconds of an audit step (every ``k``-th) over the block's other steps:
    the medians' difference."""
    hit = statistics.median(t for s, t in samples if s % k == 0)
    rest = [t for s, t in samples if s % k]
    return hit - (statistics.median(rest) if rest else 0.0)


# -- the GPT-2-small-sized run -----------------------------------------------------------------

def calibrate(template: Gpt, plan: GptPlan, device: torch.device,
              models: int) -> dict[str, Any]:
    """The batch: ``plan.batch`` scaled by ``plan.target_step_s`` over the median of three
    plain steps at that batch (after one), within ``plan.max_batch`` and, on a GPU, what the
    memory left after ``models`` more copies (weights, gradients, AdamW's two moments, DDP's
    buckets: ~5 copies of the parameters each) holds at the measured peak per sequence."""
    out: dict[str, Any] = {"start_batch": plan.batch, "target_step_s": plan.target_step_s}
    if plan.target_step_s is None:
        return {**out, "batch": plan.batch}
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    w = gpt_workload(template, token_pool(plan.shape, plan.batch, device, n=2), device)
    times = []
    for s in range(4):
        _sync(device)
        t0 = time.perf_counter()
        w.plain_step(0, s)
        _sync(device)
        times.append(time.perf_counter() - t0)
    measured = statistics.median(times[1:])
    batch = max(1, round(plan.batch * plan.target_step_s / measured))
    cap = plan.max_batch
    del w
    if cuda:  # the peak counts the copy's own state too: a bound on the safe side
        per_seq = (torch.cuda.max_memory_allocated(device) - base) / plan.batch
        params = sum(p.numel() * p.element_size() for p in template.parameters())
        room = (0.85 * torch.cuda.get_device_properties(device).total_memory
                - torch.cuda.memory_allocated(device) - 5 * params * models)
        cap = min(cap, int(room / per_seq))
        out["peak_bytes_per_sequence"] = per_seq
    return {**out, "measured_step_s": measured, "scaled_batch": batch, "memory_cap": cap,
            "batch": max(1, min(batch, cap))}


@contextlib.contextmanager
def _determinism(on: bool) -> Iterator[None]:
    """Deterministic algorithms on (``on``) or off while the block runs, then as they were
    (the replay's guards turn them on for the whole process when built)."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
           torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = on, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = was[1], was[2]


def _gpt_rank(rank: int, world: int, plan: GptPlan, timing_until: float,
              counts_until: float) -> dict[str, Any]:
    """``gpt_measure`` on this rank (the CPU dry run on the torch path GPUs take)."""
    # Before the first matmul: the replay's deterministic mode needs cuBLAS's fixed
    # workspace, and every configuration runs with it alike.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch.distributed as dist

    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    with native_kernel(False) if device.type == "cpu" else contextlib.nullcontext():
        return gpt_measure(rank, plan, device, timing_until, counts_until)


def gpt_measure(rank: int, plan: GptPlan, device: torch.device, timing_until: float,
                counts_until: float) -> dict[str, Any]:
    """The GPT run on this rank: calibrate the batch; plain DDP and ``GPT_CONFIGS`` in
    rotated blocks, then the replay beside ``IDEAL`` (deterministic, each step timed), until
    ``timing_until``; then each one's profile and synchronisations until ``counts_until``.
    A part the deadline cut is named in ``cut``; an error in the replay's part is recorded
    there and the rest goes on; any other error ends the run, recorded in ``error`` beside
    what was measured before it."""
    torch.backends.cuda.matmul.allow_tf32 = True  # as training jobs run (bf16 autocast anyway)
    t0 = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(name: str) -> None:
        seconds[name] = round(time.perf_counter() - t0 - sum(seconds.values()), 2)

    template = build_gpt(plan.shape, device)
    out: dict[str, Any] = {
        "device": str(device), "shape": {k: getattr(plan.shape, k) for k in GptShape.__slots__},
        "parameters": sum(p.numel() for p in template.parameters()),
        "parameter_tensors": len(list(template.parameters())), "cut": [],
        "phase_seconds": seconds,
        "sync_source": ('torch.cuda.set_sync_debug_mode("warn")' if device.type == "cuda" else
                        "CpuSyncWarnings: each read a GPU would wait for (no CUDA here)")}
    try:
        _measure(rank, plan, device, template, timing_until, counts_until, out, lap)
    except Exception:  # (an out-of-memory error, say): what was measured stays
        out["error"] = traceback.format_exc()[-3000:]
    return out


def _measure(rank: int, plan: GptPlan, device: torch.device, template: Gpt,
             timing_until: float, counts_until: float, out: dict[str, Any],
             lap: Callable[[str], None]) -> None:
    """``gpt_measure``'s parts, filling ``out`` as they go."""
    out["calibration"] = calibrate(template, plan, device, len(GPT_CONFIGS) + 3)
    lap("calibrate")
    batch = out["calibration"]["batch"]
    out.update(batch=batch, tokens_per_step=batch * plan.shape.context)
    pool = token_pool(plan.shape, batch, device)
    plain = gpt_workload(template, pool, device)
    runners = {PLAIN: Runner(lambda s: plain.plain_step(rank, s))}
    for name, config in GPT_CONFIGS.items():
        g = gpt_workload(template, pool, device).guard(config)
        runners[name] = Runner(g.step, g)
    lap("build")
    split = time.time() + 0.65 * (timing_until - time.time())
    blocks, cut = time_rounds(runners, plan.block, plan.rounds, device, split)
    if cut:
        out["cut"].append(f"timing: {len(blocks[PLAIN])} of {plan.rounds - 1} rounds")
    out["block_s"] = blocks
    base = blocks[PLAIN]
    out["timing"] = {name: {
        "step_ms": statistics.median(v) * 1e3 if v else None,
        "vs_plain": ratio_stats([a / b - 1 for a, b in zip(v, base, strict=True)])}
        for name, v in blocks.items()}
    if blocks["defaults"]:
        out["checksum_over_defaults"] = ratio_stats([a / b - 1 for a, b in zip(
            blocks["defaults + checksum"], blocks["defaults"], strict=True)])
        out["tflops_plain"] = (6 * out["parameters"] * out["tokens_per_step"]
                               / statistics.median(base) / 1e12)
    lap("timing")
    replay: dict[str, Runner] = {}
    try:
        replay = _replay_runners(rank, plan, template, pool, device)
        out["replay"] = _replay_timing(replay, plan, device, timing_until, out["cut"])
    except Exception:
        out["replay"] = {"error": traceback.format_exc()[-2000:]}
    lap("replay")
    counts: dict[str, Any] = {}
    with _determinism(False):
        _counts(runners, plan, device, counts_until, counts, out["cut"])
    if replay and "error" not in out["replay"]:
        with _determinism(True):
            _counts(replay, plan, device, counts_until, counts, out["cut"])
    out["counts"] = counts
    lap("counts")
    for r in (*runners.values(), *replay.values()):
        r.flush()
    out["reported"] = {n: r.reported[:10] for n, r in {**runners, **replay}.items()
                       if r.reported}


def _replay_runners(rank: int, plan: GptPlan, template: Gpt, pool: torch.Tensor,
                    device: torch.device) -> dict[str, Runner]:
    """``replay_configs``' guards (deterministic mode from here on); ``IDEAL``'s with one
    more forward and backward of the batch at its every k-th step."""
    k = plan.replay_interval
    guards = {name: gpt_workload(template, pool, device).guard(config)
              for name, config in replay_configs(k).items()}
    module, loss = guards[IDEAL].model.module, gpt_loss(device.type)
    params = [p for p in module.parameters() if p.requires_grad]
    batch_for = guards[IDEAL].batch_for
    assert batch_for is not None  # (gpt_workload's)

    def extra(step: int) -> None:
        if step % k == 0:
            torch.autograd.grad(loss(module, batch_for(rank, step)), params)

    guards[IDEAL].before_step.append(extra)
    return {name: Runner(g.step, g) for name, g in guards.items()}


def _replay_timing(runners: dict[str, Runner], plan: GptPlan, device: torch.device,
                   until: float, cut: list[str]) -> dict[str, Any]:
    """Each step of the replay's and ``IDEAL``'s blocks timed: an audit step's extra time over
    the other steps of its block, per round; the ratio of the two per round."""
    k = plan.replay_interval
    steps, was_cut = time_rounds(runners, plan.replay_block, plan.rounds, device, until,
                                 each_step=True)
    if was_cut:
        cut.append(f"replay timing: {len(steps[REPLAY])} of {plan.rounds - 1} rounds")
    audit = [per_audit(x, k) for x in steps[REPLAY]]
    ideal = [per_audit(x, k) for x in steps[IDEAL]]
    return {"interval": k, "audit_step_extra_ms": ratio_stats([x * 1e3 for x in audit]),
            "forward_backward_ms": ratio_stats([x * 1e3 for x in ideal]),
            "per_audit_step_ratio": ratio_stats([a / b for a, b in zip(audit, ideal, strict=True)
                                                 if b > 0]),
            "step_s": steps}


def _counts(runners: dict[str, Runner], plan: GptPlan, device: torch.device, until: float,
            into: dict[str, Any], cut: list[str]) -> None:
    """Each runner's ``profile_counts`` and ``sync_counts`` over steady steps (two steps
    first), into ``into``, until ``until``."""
    for name, run in runners.items():
        if time.time() > until:
            cut.append(f"counts: {name}")
            continue
        for s in run.steps(2):
            run(s)
        into[name] = {**profile_counts(run, run.steps(plan.profile_steps), device),
                      **sync_counts(run, run.steps(plan.sync_steps), device)}


def gpt_timing(device_type: str, plan: GptPlan, timing_until: float,
               counts_until: float) -> dict[str, Any]:
    """``gpt_measure`` on one rank under DDP (nccl on a GPU, gloo on the CPU), in a process
    of its own (``run_ranks``)."""
    from scenarios.run.launch import run_ranks

    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = max(counts_until - time.time(), 0.0) + 300.0
    out: dict[str, Any] = run_ranks(_gpt_rank, 1, plan, timing_until, counts_until,
                                    timeout=timeout, backend=backend)[0]
    return {"backend": backend, "world": 1, **out}


# -- throughput --------------------------------------------------------------------------------

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


def launches(fn: Callable[[], object], device: torch.device) -> float:
    """The kernel launches of one call of ``fn``, from torch's profiler (0 on the CPU)."""
    n: float = profile_counts(lambda _: fn(), range(1), device)["kernel_launches"]
    return n


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


def _torch_ops(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with fingerprint_torch_ops():
            return fn()
    return run


def _rates(methods: dict[str, Callable[[], object]], device: torch.device, mib: float,
           bases: tuple[str, ...]) -> dict[str, Any]:
    times = {k: _median_time(f, device) for k, f in methods.items()}
    return {k: {"median_s": t, "gib_per_s": mib / 1024 / t,
                **{f"ratio_to_{i}": times[b] / t for i, b in enumerate(bases)},
                "launches": launches(methods[k], device)} for k, t in times.items()}


SUM = "torch.sum (one read pass)"


def throughput(device: torch.device, mib: int) -> dict[str, Any]:
    """Medians of 9 over a float32 tensor of ``mib`` MiB: each method's time, GiB/s, its rate
    against one ``torch.sum`` pass (``ratio_to_0``) and its kernel launches per call: the
    library's own choice of path beside the torch ops alone."""
    x = torch.randn(mib * 2**20 // 4, device=device)
    methods: dict[str, Callable[[], object]] = {
        SUM: lambda: x.sum(),
        "sdc_guard.fingerprint_tensor": lambda: fingerprint_tensor(x),
        "fingerprint_tensor, torch ops": _torch_ops(lambda: fingerprint_tensor(x)),
        "replay word digest": lambda: internal.digest_value(x),
        "replay word digest, torch ops": _torch_ops(lambda: internal.digest_value(x)),
        "torch.hash_tensor (XOR)": lambda: torch.hash_tensor(x),
    }
    return {"tensor_mib": mib, "methods": _rates(methods, device, mib, (SUM,))}


SUM_EACH, FOREACH_NORM = "torch.sum of each tensor", "torch._foreach_norm (fused passes)"


def list_throughput(device: torch.device, shape: GptShape) -> dict[str, Any]:
    """The fingerprint of a ``Gpt``'s parameter tensors (one list, as the weights check takes
    them) beside a ``torch.sum`` of each tensor (``ratio_to_0``) and ``torch._foreach_norm``
    over the list (``ratio_to_1``): medians of 9, GiB/s, launches per call."""
    params = [p.detach() for p in build_gpt(shape, device).parameters()]
    mib = sum(p.numel() * p.element_size() for p in params) / 2**20
    methods: dict[str, Callable[[], object]] = {
        SUM_EACH: lambda: [p.sum() for p in params],
        FOREACH_NORM: lambda: torch._foreach_norm(params),
        "sdc_guard.fingerprint_tensor (list)": lambda: fingerprint_tensor(params),
        "fingerprint_tensor (list), torch ops": _torch_ops(lambda: fingerprint_tensor(params)),
    }
    return {"tensors": len(params), "list_mib": mib,
            "methods": _rates(methods, device, mib, (SUM_EACH, FOREACH_NORM))}
