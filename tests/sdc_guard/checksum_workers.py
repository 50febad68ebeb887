"""Rank functions of the checksum check's multi-rank tests (module level: spawned ranks import
them). The models and data are the campaign's (``scenarios.spec.models``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import sdc_guard
from injectors import Fault, arm
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from sdc_guard import ChecksumConfig, GuardConfig, SDCGuard
from sdc_guard.checks import sides
from sdc_guard.checks.checksum import ChecksumCheck
from sdc_guard.fingerprints.native import disable_native

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fused_forms() -> None:
    """This rank's checksum sides by the fused expressions (``sides.FUSED_DEVICES``) on the
    CPU, without the C passes, run as written: uncompiled (``test_checksum_sides`` compares
    the compiled kernels with them); each still checked against the eager form first."""
    disable_native()
    sides.FUSED_DEVICES.add("cpu")
    sides._FUSED.fns.update(forward=sides._forward_math, weight=sides._weight_math,
                           **sides.GY_FORMS)


def _fused_agreed() -> dict[str, bool]:
    """The fused expressions run in this rank: whether each agreed (in every dtype it ran)."""
    out: dict[str, bool] = {}
    for (_, name, _), ok in sides._FUSED.checked.items():
        out[name] = out.get(name, True) and ok
    return out


def _checksum(guard: SDCGuard) -> ChecksumCheck:
    """The guard's checksum check."""
    return next(c for c in guard.checks if isinstance(c, ChecksumCheck))


def _guard(kind: str, dtype: str, cfg: GuardConfig, *, batch: int = 8, width: int = 16,
           scaler: Any = None, comm_hook: Any = None, micro: int = 1) -> SDCGuard:
    model = DDP(build_model(kind, width=width, depth=2, seed=0).to(_DTYPES[dtype]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(rank: int, step: int) -> Any:
        mbs = [synthetic_batch(kind, 0, rank, step, i, batch=batch, dtype=_DTYPES[dtype])
               for i in range(micro)]
        return mbs[0] if micro == 1 else mbs

    return SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=batch_for, config=cfg,
                    grad_scaler=scaler, comm_hook=comm_hook)


def _dets(found: list[sdc_guard.Detection]) -> list[tuple[str, int, tuple[int, ...]]]:
    return [(d.check, d.step, d.suspect_ranks) for d in found]


def clean_run(rank: int, world: int, runs: list[tuple[str, str]], steps: int,
              fused: bool = False) -> dict[str, Any]:
    """Every (model kind, dtype) of ``runs`` trained ``steps`` clean steps with the checksum on.
    ``fused``: the sides by the fused expressions (``fused_forms``).

    Returns the detections and the largest residual seen as a fraction of its tolerance."""
    if fused:
        fused_forms()
    out: dict[str, Any] = {}
    for kind, dtype in runs:
        guard = _guard(kind, dtype, GuardConfig(checksum=True, weights_interval=0))
        check = _checksum(guard)
        worst = [0.0]
        record = check._record  # the tolerance's margin, measured on the way

        def spy(layer: Any, product: str, micro: int, lhs: torch.Tensor, rhs: torch.Tensor,
                bound: torch.Tensor, record: Any = record, worst: list[float] = worst) -> None:
            ratio = ((lhs - rhs).abs() / bound.clamp_min(1e-30)).max()
            worst[0] = max(worst[0], float(ratio))
            record(layer, product, micro, lhs, rhs, bound)

        compare = check._compare  # the C path's comparison (float32 on the CPU)

        def spy_native(layer: Any, product: str, micro: int, lhs: torch.Tensor,
                       rhs: torch.Tensor, bound: torch.Tensor, tol: float, rhs0: float = 0.0,
                       bound0: float = 0.0, compare: Any = compare,
                       worst: list[float] = worst) -> None:
            diff = (lhs.double() - (rhs.double() + rhs0)).abs()
            ratio = (diff / ((bound.double() + bound0) * tol).clamp_min(1e-30)).max()
            worst[0] = max(worst[0], float(ratio))
            compare(layer, product, micro, lhs, rhs, bound, tol, rhs0, bound0)

        check._record = spy  # type: ignore[method-assign,assignment]
        check._compare = spy_native  # type: ignore[method-assign,assignment]
        found = []
        skipped = []
        for s in range(steps):
            r = guard.step(s)
            found += r.detections
            skipped += [s] if r.skipped else []
        found += guard.flush()
        out[f"{kind}/{dtype}"] = {"detections": _dets(found), "skipped": skipped,
                                  "worst_fraction_of_tolerance": worst[0],
                                  "layers": [x.name for x in check.layers],
                                  "fused": _fused_agreed()}
        dist.barrier()
    return out


def fault_runs(rank: int, world: int, faults: list[dict[str, Any] | list[dict[str, Any]]],
               cfg: dict[str, Any],
               kind: str = "mlp", scaler: bool = False, user_hook: bool = False,
               micro: int = 1, native: bool = True, fused: bool = False) -> list[dict[str, Any]]:
    """One guard; per fault: fresh checks, the fault armed, 4 steps, flush, disarm. An entry
    may be a list of faults, armed together. ``native=False``: the torch ops only (no C
    kernel in this rank); ``fused``: the sides by the fused expressions (``fused_forms``)."""
    if not native:
        disable_native()
    if fused:
        fused_forms()
    hook = None
    if user_hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        hook = allreduce_hook
    gs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None
    guard = _guard(kind, "float32", GuardConfig(**cfg, micro_batches=micro), scaler=gs,
                   comm_hook=hook, micro=micro,
                   batch=8)
    model = guard.model.module
    results = []
    step = 0
    for f in faults:
        guard.reconfigure(guard.config)
        handles = [arm(Fault(**{**one, "step": step + 1}), guard=guard)
                   for one in (f if isinstance(f, list) else [f])]
        before = [p.detach().clone() for p in model.parameters()]
        reports = []
        states = []
        for _ in range(4):
            reports.append(guard.step(step))
            states.append(sdc_guard.fingerprint(list(model.parameters())))
            step += 1
        found = [d for r in reports for d in r.detections] + guard.flush()
        for h in handles:
            h.remove()
        results.append({
            "fired": [(rec["step"], rec["bits"]) for h in handles for rec in h.records],
            "detections": _dets(found),
            "layers": [d.evidence.get("ranks", {}) for d in found],
            "entries": [d.evidence.get("entries") for d in found],
            "skipped": [r.step for r in reports if r.skipped],
            "states": states,
            "scale": gs.get_scale() if gs is not None else None,
            "moved": any(not torch.equal(a, b) for a, b in zip(before, model.parameters(),
                                                               strict=True)),
            "native": any(check.native_calls for check in guard.checks
                          if isinstance(check, ChecksumCheck)),
            "fused_row_sums": guard.backend.fused_row_sums,
            "fused": _fused_agreed(),
        })
    return results


def switching_layout(rank: int, world: int, steps: int,
                     faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The mlp with ``net.2``'s input contiguous on even steps and, the same values, with a
    column stride on odd ones (a forward hook on ``net.1`` copies it so): the C forward's
    plan kept, then made for one call, then kept again (``checksum.state.Plan``). ``faults``
    armed at once (each with its own step)."""
    guard = _guard("mlp", "float32", GuardConfig(checksum=True, weights_interval=0))
    model = guard.model.module
    odd = [False]

    def relayout(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out.t().contiguous().t() if odd[0] else None

    model.net[1].register_forward_hook(relayout)
    handles = [arm(Fault(**f), guard=guard) for f in faults]
    reports = []
    for step in range(steps):
        odd[0] = step % 2 == 1
        reports.append(guard.step(step))
    found = [d for r in reports for d in r.detections] + guard.flush()
    for h in handles:
        h.remove()
    check = _checksum(guard)
    return {"detections": _dets(found), "layers": [d.evidence.get("ranks", {}) for d in found],
            "skipped": [r.step for r in reports if r.skipped],
            "fired": [rec["step"] for h in handles for rec in h.records],
            "native": check.native_calls, "plans": len(check.layers[1].plans)}


class LoraLinear(nn.Linear):
    """A LoRA-style subclass: its output is not ``F.linear(x, weight, bias)``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.a = nn.Parameter(torch.randn(4, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (x @ self.a.t()) @ self.b.t()


def hooks_and_subclasses(rank: int, world: int) -> dict[str, Any]:
    """Which layers are chosen, and that a reconfigure leaves no hook behind."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), LoraLinear(8, 8),
                        nn.ReLU(inplace=True), nn.Linear(8, 2))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch_for(r: int, s: int) -> Any:
        g = torch.Generator().manual_seed(100 * s + r)
        return torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True))
    default = ([x.name for x in _checksum(guard).layers], _checksum(guard).skipped)
    dets = [d for s in range(5) for d in guard.step(s).detections]
    guard.flush()
    named_cfg = GuardConfig(checksum=ChecksumConfig(layers=("0", "4")))
    guard.reconfigure(named_cfg)
    named = [x.name for x in _checksum(guard).layers]
    for s in range(5, 8):
        dets += guard.step(s).detections
    guard.flush()
    guard.reconfigure(GuardConfig(checksum=False))
    left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
    weight_hooks = sum(len(p._backward_hooks or {}) for p in net.parameters())
    error = ""
    try:
        guard.reconfigure(GuardConfig(checksum=ChecksumConfig(layers=("nope",))))
    except ValueError as e:
        error = str(e)
    return {"default": default, "named": named, "detections": _dets(dets), "hooks_left": left,
            "weight_hooks_left": weight_hooks, "error": error}


def node_gx_fault(rank: int, world: int, at_step: int) -> dict[str, Any]:
    """The checksum check seeing net.2's backward through its product node (no tap): a flip
    in that node's input gradient on rank 1 at ``at_step``, planted by a post-hook on the
    node registered before the check's, is an input-gradient mismatch of net.2."""
    guard = _guard("mlp", "float32", GuardConfig(checksum=True, weights_interval=0))
    check = _checksum(guard)
    layer = next(x for x in check.layers if x.name == "net.2")
    armed = [False]

    def corrupt(grads_in: tuple[Any, ...], grads_out: tuple[Any, ...]) -> Any:
        gx = grads_in[1].clone()
        gx.view(-1)[3] = gx.view(-1)[3] * 2.0 ** 64
        return (grads_in[0], gx, *grads_in[2:])

    def plant(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        if armed[0] and out.grad_fn is not None and out.grad_fn.name() == "AddmmBackward0":
            out.grad_fn.register_hook(corrupt)

    layer.module.register_forward_hook(plant, prepend=True)
    via_node = []
    found = []
    skipped = []
    for step in range(at_step + 3):
        armed[0] = rank == 1 and step == at_step
        r = guard.step(step)
        found += r.detections
        skipped += [step] if r.skipped else []
        via_node.append(layer.node_ok)
    found += guard.flush()
    return {"detections": _dets(found), "layers": [d.evidence.get("ranks", {}) for d in found],
            "skipped": skipped, "node_ok": via_node, "unseen": check.unseen_input_grads}


class TiedModel(nn.Module):
    """An embedding whose weight is also the output layer's (a language model's tying)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(torch.relu(self.mid(self.emb(tokens))))
        return y


def tied_run(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Clean steps of ``TiedModel`` with the checksum on: no detection, and which layers'
    weight gradients are checked."""
    model = DDP(TiedModel())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randint(0, 11, (6, 4), generator=g), torch.randint(0, 11, (6, 4),
                                                                        generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        tokens, target = batch
        return F.cross_entropy(m(tokens).reshape(-1, 11), target.reshape(-1))

    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True, weights_interval=0))
    check = _checksum(guard)
    found = []
    for s in range(steps):
        found += guard.step(s).detections
    found += guard.flush()
    return {"detections": _dets(found),
            "gw_checked": {x.name: x.gw_checked for x in check.layers}}


class AuxModel(nn.Module):
    """A model with a probe layer whose output the loss does not use (a logged metric)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.probe = nn.Linear(16, 4)
        self.probed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        self.probed = self.probe(h)  # requires grad; no backward ever reaches it
        y: torch.Tensor = self.head(h)
        return y


def unused_output_run(rank: int, world: int, steps: int, flip_at: int,
                      native: bool = True) -> dict[str, Any]:
    """``AuxModel`` with the checksum on: the probe's forward, which no backward reaches, is
    checked in its forward hook all the same; with ``flip_at`` >= 0 an exponent bit of one of
    its outputs flips on rank 1 at that step (a forward hook ahead of the check's).
    ``native=False``: the torch ops only."""
    if not native:
        disable_native()
    model = DDP(AuxModel(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(m(x), y)

    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True, weights_interval=0))
    check = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
    step_now = [0]

    def plant(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        if rank == 1 and step_now[0] == flip_at:
            with torch.no_grad():
                out.view(-1)[5] = out.view(-1)[5] * 2.0 ** 64

    model.module.probe.register_forward_hook(plant, prepend=True)
    found, skipped = [], []
    for s in range(steps):
        step_now[0] = s
        r = guard.step(s)
        found += r.detections
        skipped += [s] if r.skipped else []
    found += guard.flush()
    return {"detections": _dets(found), "skipped": skipped,
            "layers": [d.evidence.get("ranks", {}) for d in found],
            "native": check.native_calls > 0}


def compiled_run(rank: int, world: int, steps: int) -> dict[str, Any]:
    """``DDP(torch.compile(mlp))`` with the checksum and a replay every step: ``steps`` clean
    steps, then a top-exponent flip in rank 1's product of the last layer (one step)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    model = DDP(torch.compile(net))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, s: int) -> Any:
        g = torch.Generator().manual_seed(1000 * s + r)
        return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True, replay_interval=1, deterministic=True))
    clean = [d for s in range(steps) for d in guard.step(s).detections]
    handle = arm(Fault(site="linear_product", rank=1, step=steps, target="_orig_mod.2",
                       product="forward", bits=(30,)), guard=guard)
    report = guard.step(steps)
    late = guard.flush()  # the checksum's verdict on a step comes with the next one's
    handle.remove()
    return {"clean": _dets(clean), "fault": _dets(report.detections + late),
            "skipped": report.skipped}


class Checkpointed(nn.Module):
    """Two residual blocks under ``torch.utils.checkpoint`` (activation checkpointing)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU(),
                                                   nn.Linear(32, 32)) for _ in range(2)])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h: torch.Tensor = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.reentrant)
        out: torch.Tensor = self.head(h)
        return out


def checkpointed_run(rank: int, world: int, reentrant: bool, faults: list[dict[str, Any]],
                     replay: bool = False) -> list[list[tuple[str, int, tuple[int, ...]]]]:
    """The checksum on a model with activation checkpointing: 2 clean steps (their
    detections first), then each fault armed for one step on rank 1 (its detections).
    ``replay``: instead, one step with the replay audit (its detections, or its error)."""
    torch.manual_seed(0)
    model = DDP(Checkpointed(reentrant))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, s: int) -> Any:
        g = torch.Generator().manual_seed(100 * s + r)
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    if replay:  # what the replay says of it
        guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                         config=GuardConfig(replay_interval=1, deterministic=True))
        try:
            return [_dets(guard.step(0).detections)]
        except RuntimeError as e:
            return [str(e)]  # type: ignore[list-item]
    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True))
    out = [_dets([d for s in range(2) for d in guard.step(s).detections])]
    step = 2
    for f in faults:
        handle = arm(Fault(**f, step=step), guard=guard)
        found = guard.step(step).detections + guard.flush()
        handle.remove()
        out.append(_dets(found))
        step += 1
    return out


class Odd(nn.Module):
    """Linear layers called the ways a real model may: an expert no token reached (an empty
    input), an unbatched 1-D input, a non-contiguous 3-D input."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.expert = nn.Linear(32, 32)
        self.vec = nn.Linear(32, 32)
        self.heads = nn.Linear(8, 8)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        routed = h[h[:, 0] > 1e9]  # no row: the expert gets a [0, 32] input
        h = h + self.expert(routed).sum(0)
        h = h + self.vec(h[0])
        t = h.view(-1, 4, 8).transpose(0, 1)
        h = self.heads(t).transpose(0, 1).reshape(-1, 32)
        out: torch.Tensor = self.head(h)
        return out


def odd_calls_run(rank: int, world: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
    """``Odd`` with the checksum and the replay: 3 clean steps, then each fault armed on rank
    1 for one step (detections and injection records per fault)."""
    torch.manual_seed(0)
    model = DDP(Odd())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, s: int) -> Any:
        g = torch.Generator().manual_seed(100 * s + r)
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss_fn(m: nn.Module, b: Any) -> torch.Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True, replay_interval=1, deterministic=True))
    clean = _dets([d for s in range(3) for d in guard.step(s).detections])
    per_fault = []
    for i, f in enumerate(faults):
        handle = arm(Fault(**f, step=3 + i), guard=guard)
        found = guard.step(3 + i).detections + guard.flush()
        handle.remove()
        per_fault.append({"detections": _dets(found), "fired": len(handle.records)})
    return {"clean": clean, "faults": per_fault}


def _parametrized_mlp() -> nn.Module:
    """An MLP whose middle layer's weight is spectrally normalised and whose first is weight
    normalised (``torch.nn.utils.parametrizations``): ``m.weight`` is computed anew at
    each access, and spectral_norm's power iteration updates its buffers each time."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 4))
    torch.nn.utils.parametrizations.weight_norm(net[0])
    torch.nn.utils.parametrizations.spectral_norm(net[2])
    return net


def parametrized_run(rank: int, world: int, steps: int) -> dict[str, Any]:
    """A parametrized model trained with the checksum and every audit on, beside the same
    model trained by a plain DDP loop: the detections, the layers checked, and whether the
    two runs end with the same parameters and buffers, bit for bit."""
    cfg = GuardConfig(checksum=True, replay_interval=1, deterministic=True, weights_interval=1)

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    guarded, plain = DDP(_parametrized_mlp()), DDP(_parametrized_mlp())
    guard = SDCGuard(guarded, torch.optim.AdamW(guarded.parameters(), lr=1e-2),
                     loss_fn=loss_fn, batch_for=batch_for, config=cfg)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    found = []
    for s in range(steps):
        found += guard.step(s).detections
        opt.zero_grad(set_to_none=True)
        loss_fn(plain, batch_for(rank, s)).backward()  # type: ignore[no-untyped-call]
        opt.step()
    found += guard.flush()
    a, b = guarded.module.state_dict(), plain.module.state_dict()
    return {"detections": _dets(found), "layers": [x.name for x in _checksum(guard).layers],
            "same": {k: torch.equal(a[k], b[k]) for k in a}}


def physics_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A physics-informed loss: the residual of du/dx0 + du/dx1 = sin(x0), with the input
    gradient taken inside the loss (``create_graph=True``, so the weights get its terms)."""
    x = x.clone().requires_grad_(True)
    u: torch.Tensor = m(x)
    du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
    residual: torch.Tensor = du[:, 0] + du[:, 1] - torch.sin(x[:, 0])
    return residual.square().mean() + u.square().mean()


def physics_run(rank: int, world: int, native: bool,
                fault: dict[str, Any] | None) -> dict[str, Any]:
    """``physics_loss`` on a tanh MLP with the checksum on (the C passes or the torch path),
    clean or with a fault in a product from step 2: the detections, the withheld steps, and
    whether the check saw the backward inside the loss."""
    if not native:
        disable_native()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 1)))

    def batch_for(r: int, step: int) -> torch.Tensor:
        return torch.rand(16, 2, generator=torch.Generator().manual_seed(1000 * r + step))

    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     loss_fn=physics_loss, batch_for=batch_for,
                     config=GuardConfig(checksum=True))
    handle = None if fault is None else arm(Fault(**fault), guard=guard)
    reports = [guard.step(s) for s in range(4)]
    found = [d for r in reports for d in r.detections] + guard.flush()
    if handle is not None:
        handle.remove()
    return {"detections": _dets(found), "skipped": [r.step for r in reports if r.skipped],
            "inner_backward": _checksum(guard).inner_backward}


class Strided(nn.Module):
    """Parameters whose memory is not row-major: a linear layer with a column-major weight, a
    channels_last convolution and a transposed matrix (DDP lays their gradients out in its
    buckets with the parameters' strides)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.lin.weight = nn.Parameter(self.lin.weight.detach().t().contiguous().t())
        self.w = nn.Parameter(torch.randn(4, 16).t())
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)  # type: ignore[call-overload]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        img = x[:, :48].reshape(-1, 3, 4, 4).contiguous(memory_format=torch.channels_last)
        out: torch.Tensor = torch.relu(self.lin(x[:, :16])) @ self.w + self.conv(img).mean((2, 3))
        return out


def strided_run(rank: int, world: int, fault: dict[str, Any] | None) -> dict[str, Any]:
    """``Strided`` with the checksum and the replay every step, clean or with ``fault``: the
    detections and the withheld steps."""
    model = DDP(Strided())

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(8, 48, generator=g), torch.randint(0, 4, (8,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                     batch_for=batch_for,
                     config=GuardConfig(checksum=True, replay_interval=1, deterministic=True))
    handle = None if fault is None else arm(Fault(**fault), guard=guard)
    reports = [guard.step(s) for s in range(4)]
    found = [d for r in reports for d in r.detections] + guard.flush()
    if handle is not None:
        handle.remove()
    return {"detections": _dets(found), "skipped": [r.step for r in reports if r.skipped]}


def _hooked_mlp(post_accumulate: bool) -> nn.Module:
    """An MLP (8 -> 24 -> 12 -> 2) with the hooks users put on their layers, all registered
    before the guard is built: every parameter's gradient clamped by a tensor hook, the
    middle layer's output replaced by a forward hook, the last layer's output scaled in
    place by one and its input gradient halved by a full backward hook; with
    ``post_accumulate``, the first weight's gradient halved after accumulation too."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 12), nn.ReLU(),
                        nn.Linear(12, 2))
    for p in net.parameters():
        p.register_hook(_clamp)  # type: ignore[no-untyped-call]
    net[2].register_forward_hook(_doubled)
    net[4].register_forward_hook(_halved_in_place)
    net[4].register_full_backward_hook(_halved_input_grad)
    if post_accumulate:
        first: nn.Linear = net[0]  # type: ignore[assignment]
        first.weight.register_post_accumulate_grad_hook(_halve_grad)  # type: ignore[no-untyped-call]
    return net


def _clamp(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.02, 0.02)


def _doubled(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _halved_in_place(m: nn.Module, args: Any, out: torch.Tensor) -> None:
    out.mul_(0.5)


def _halved_input_grad(m: nn.Module, grad_in: Any, grad_out: Any) -> tuple[torch.Tensor]:
    return (grad_in[0] * 0.5,)


def _halve_grad(p: torch.Tensor) -> None:
    if p.grad is not None:
        p.grad.mul_(0.5)


class _FlipProduct(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A fault inside a stock kernel: the first ``mm`` that returns a ``shape`` matrix gets
    its element 0 with bit ``bit`` flipped (a linear layer's weight gradient: ``addmm``'s
    backward computes it as ``(GY^T X)^T`` for the transposed weight, an ``out x in``
    product that no other of ``_hooked_mlp``'s has)."""

    def __init__(self, shape: tuple[int, int], bit: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.shape, self.bit, self.done = shape, bit, False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (not self.done and func is torch.ops.aten.mm.default
                and tuple(out.shape) == self.shape):
            self.done = True
            word = out.view(-1)[:1].view(torch.int32)
            word ^= 1 << self.bit
        return out


def user_hooks_run(rank: int, world: int, post_accumulate: bool,
                   flip_step: int | None, injected: bool = False) -> dict[str, Any]:
    """``_hooked_mlp`` trained with the checksum (and, without post-accumulate hooks, the
    replay every step), beside the same model in a plain DDP loop: the detections, the
    withheld steps and whether both runs end with the same parameters. With ``flip_step``,
    rank 1's backward in that step computes the middle layer's weight gradient product
    (``12 x 24``) with a flipped bit (``_FlipProduct``); with ``injected`` too, the fault
    injector's ``linear_product`` site flips it (its own autograd node makes the product,
    not torch's ``addmm``)."""
    cfg = (GuardConfig(checksum=True) if post_accumulate or flip_step is not None
           else GuardConfig(checksum=True, replay_interval=1, deterministic=True))

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    guarded, plain = DDP(_hooked_mlp(post_accumulate)), DDP(_hooked_mlp(post_accumulate))
    guard = SDCGuard(guarded, torch.optim.AdamW(guarded.parameters(), lr=1e-2),
                     loss_fn=loss_fn, batch_for=batch_for, config=cfg)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    reports = []
    if injected and flip_step is not None:
        arm(Fault(site="linear_product", product="weight_grad", target="2", bits=(30,),
                  rank=1, step=flip_step), guard=guard)
    for s in range(4):
        if s == flip_step and rank == 1 and not injected:
            with _FlipProduct((12, 24), 30) as flip:
                reports.append(guard.step(s))
            assert flip.done
        else:
            reports.append(guard.step(s))
        opt.zero_grad(set_to_none=True)
        loss_fn(plain, batch_for(rank, s)).backward()  # type: ignore[no-untyped-call]
        opt.step()
    found = [d for r in reports for d in r.detections] + guard.flush()
    a, b = guarded.module.state_dict(), plain.module.state_dict()
    return {"detections": _dets(found), "skipped": [r.step for r in reports if r.skipped],
            "same": all(torch.equal(a[k], b[k]) for k in a),
            "at_node": [layer.gw_at_node for layer in _checksum(guard).layers]}


def _global_doubled(m: nn.Module, args: Any, out: Any) -> Any:
    return out * 2 if isinstance(m, nn.Linear) else None


def _global_halved_in_place(m: nn.Module, args: Any, out: Any) -> None:
    if isinstance(m, nn.Linear):
        out.mul_(0.5)


def global_hook_run(rank: int, world: int, in_place: bool,
                    fault_step: int | None) -> dict[str, Any]:
    """An MLP trained with the checksum while a global forward hook of the user's
    (``register_module_forward_hook``, which torch runs before any module's own) doubles
    every linear layer's output, or halves it in place, beside the same model in a plain
    DDP loop (the hook acts on both). With ``fault_step``, the injector flips an exponent
    bit of the middle layer's forward product on rank 1 in that step. Then the user's hook
    is removed and one more step taken: is the check's own global hook gone too?"""
    handle = nn.modules.module.register_module_forward_hook(
        _global_halved_in_place if in_place else _global_doubled)

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 12), nn.ReLU(),
                             nn.Linear(12, 2))

    try:
        guarded, plain = DDP(mlp()), DDP(mlp())
        guard = SDCGuard(guarded, torch.optim.AdamW(guarded.parameters(), lr=1e-2),
                         loss_fn=loss_fn, batch_for=batch_for,
                         config=GuardConfig(checksum=True))
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        if fault_step is not None:
            arm(Fault(site="linear_product", product="forward", target="2", bits=(30,),
                      rank=1, step=fault_step), guard=guard)
        reports = []
        for s in range(4):
            reports.append(guard.step(s))
            opt.zero_grad(set_to_none=True)
            loss_fn(plain, batch_for(rank, s)).backward()  # type: ignore[no-untyped-call]
            opt.step()
        front = _checksum(guard)._front.handle is not None
        a, b = guarded.module.state_dict(), plain.module.state_dict()
        same = all(torch.equal(a[k], b[k]) for k in a)
    finally:
        handle.remove()
    reports.append(guard.step(4))
    found = [d for r in reports for d in r.detections] + guard.flush()
    return {"detections": _dets(found), "skipped": [r.step for r in reports if r.skipped],
            "same": same, "front_while_hooked": front,
            "front_after": _checksum(guard)._front.handle is not None,
            "global_hooks_left": len(nn.modules.module._global_forward_hooks)}


def two_guards_global_hook_run(rank: int, world: int) -> dict[str, Any]:
    """Two guarded models stepped in turn while a global forward hook of the user's doubles
    every linear layer's output: each check's global hook must come before the user's (the
    second one once stayed behind it, seeing the first one's lead)."""
    handle = nn.modules.module.register_module_forward_hook(_global_doubled)

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    def guarded() -> SDCGuard:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 24), nn.ReLU(), nn.Linear(24, 2)))
        return SDCGuard(model, torch.optim.SGD(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                        batch_for=batch_for, config=GuardConfig(checksum=True))

    try:
        a, b = guarded(), guarded()
        found = []
        for s in range(3):
            found += a.step(s).detections + b.step(s).detections
        found += a.flush() + b.flush()
    finally:
        handle.remove()
    return {"detections": _dets(found)}


def post_accumulate_replay_refused(rank: int, world: int) -> dict[str, str]:
    """The replay with a post-accumulate-grad hook: refused when the guard is built, and at
    the first audit step when the hook comes after."""
    errors = {}

    def batch_for(r: int, step: int) -> Any:
        g = torch.Generator().manual_seed(1000 * r + step)
        return torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return F.cross_entropy(m(batch[0]), batch[1])

    cfg = GuardConfig(replay_interval=1, deterministic=True)
    model = DDP(_hooked_mlp(True))
    try:
        SDCGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                 batch_for=batch_for, config=cfg)
    except ValueError as e:
        errors["built"] = str(e)
    model = DDP(_hooked_mlp(False))
    guard = SDCGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn,
                     batch_for=batch_for, config=cfg)
    guard.step(0)
    model.module[2].bias.register_post_accumulate_grad_hook(lambda p: None)
    try:
        guard.step(1)
    except ValueError as e:
        errors["later"] = str(e)
    return errors


def autocast_run(rank: int, world: int, steps: int) -> dict[str, Any]:
    """The MLP in float32 run under ``torch.autocast`` (bfloat16 products) with the checksum
    on: its detections, and the largest error of a forward identity's right-hand side
    ``X (W^T e) + sum b``, which the check computes itself, against float64, as a fraction
    of ``|X| (|W|^T e) + sum |b|`` (float32 sums: about ``(in + 2) 2^-24``; sums the autocast
    region rounded to bfloat16: about ``2^-9``)."""
    model = DDP(build_model("mlp", width=16, depth=2, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        return synthetic_batch("mlp", 0, r, step, 0, batch=8)

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return scenario_loss(m, batch)

    guard = SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                     config=GuardConfig(checksum=True, weights_interval=0))
    check = _checksum(guard)
    record = check._record
    worst = [0.0]
    seen = [0]
    inputs: dict[nn.Module, torch.Tensor] = {}
    for layer in check.layers:
        layer.module.register_forward_pre_hook(
            lambda mod, args: inputs.__setitem__(mod, args[0].detach()))

    def spy(layer: Any, product: str, micro: int, lhs: torch.Tensor, rhs: torch.Tensor,
            bound: torch.Tensor) -> None:
        if product == "forward":
            m, x = layer.module, inputs[layer.module].double()
            w, b = m.weight.detach().double(), m.bias.detach().double()
            want = x @ w.sum(0) + b.sum()
            mag = x.abs() @ w.abs().sum(0) + b.abs().sum()
            worst[0] = max(worst[0], float(((rhs.double() - want).abs() / mag).max()))
            seen[0] += 1
        record(layer, product, micro, lhs, rhs, bound)

    check._record = spy  # type: ignore[method-assign,assignment]
    found = []
    for s in range(steps):
        found += guard.step(s).detections
    found += guard.flush()
    return {"detections": _dets(found), "worst": worst[0], "forward_entries": seen[0],
            "native": check.native_calls > 0}


def weight_sums_run(rank: int, world: int, steps: int, write_at: int | None) -> dict[str, Any]:
    """Clean steps with the guard's defaults and the checksum on: the weights check's pass
    takes the weights' sums for the next step's products. ``write_at``: after that step,
    every rank scales its weights through ``.data`` (no version counter sees it), so the
    sums that pass took are stale at the next step's products."""
    guard = _guard("mlp", "float32", GuardConfig(checksum=True), width=32)
    check = _checksum(guard)
    found = []
    for s in range(steps):
        found += guard.step(s).detections
        if s == write_at:
            with torch.no_grad():
                for p in guard.model.module.parameters():
                    p.data.mul_(1.0 + 2.0 ** -6)
    found += guard.flush()
    return {"detections": _dets(found), "native": check.native_calls,
            "pre_sums_used": check.pre_sums_used, "stale": check.stale_sums,
            "layers": len(check.layers), "fuse": [x.fuse for x in check.layers]}
