"""The checksum check on the device, its torch path (the C passes serve the CPU): every model
the campaign ships trains clean in float32 (TF32 off and on), bfloat16 and under autocast,
with the eager sides and with the fused ones; an exponent flip inside each product of a
linear layer on the last rank is named in its step, that rank, and the step withheld on
every rank. Its step times on a GPT-2-small-sized model are the bench's
(``bench.device.gpt_timing``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tests.cuda.support import fill, fused_checked, fused_sides, on, sides_error

CHECKSUM_RUNS = [(kind, dtype, tf32) for kind in ("mlp", "mlp_hooked", "cnn", "cnn_bn",
                                                  "transformer")
                 for dtype, tf32 in (("float32", False), ("float32", True), ("bfloat16", False))
                 ] + [("mlp", "autocast", False), ("transformer", "autocast", False)]
"""(model kind, dtype, TF32 allowed): the clean runs; ``mlp_hooked`` is the MLP with the
user's hooks of ``users_hooks``; dtype ``autocast``: a float32 model whose loss runs under
autocast to bfloat16 (the check's own sides must stay float32 there: ``AUTOCAST_SIDES``)."""
CHECKSUM_FUSED_RUNS = [("mlp", "float32"), ("transformer", "bfloat16"),
                       ("transformer", "autocast")]
"""Clean runs again with the sides' fused expressions (``support.fused_sides``)."""
AUTOCAST_SIDES = 1e-4
"""The largest error the autocast runs may show in a forward identity's right-hand side
against float64, as a fraction of its magnitude sum: float32 sums keep to about
``k 2^-24`` (``k`` <= 257 here: 1.5e-5 at worst, typically far less); sums cast to bfloat16
show ~2^-9."""
CHECKSUM_FAULTS: list[dict[str, Any]] = [
    {"site": "linear_product", "product": p, "target": "net.2", "bits": (b,)}
    for p in ("forward", "input_grad", "weight_grad") for b in (30, 29, 28)]
"""Exponent flips inside the MLP's middle layer, each product (fired on the last rank), in
the MLP, in ``mlp_hooked`` and in the MLP with the fused sides."""


def _clamped(g: torch.Tensor) -> torch.Tensor:
    return g.clamp(-0.02, 0.02)


def _doubled(m: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out * 2


def _halved_in_place(m: nn.Module, args: Any, out: torch.Tensor) -> None:
    out.mul_(0.5)


def _halved_input_grad(m: nn.Module, grad_in: Any, grad_out: Any) -> Any:
    return tuple(None if g is None else g * 0.5 for g in grad_in)


def users_hooks(module: nn.Module) -> nn.Module:
    """The hooks users put on their layers, on an MLP: every parameter's gradient clamped by
    a tensor hook, the middle linear layer's output replaced by a forward hook, the last
    one's output scaled in place and its input gradient halved by a full backward hook
    (the checksum reads each product past them)."""
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    for p in module.parameters():
        p.register_hook(_clamped)  # type: ignore[no-untyped-call]
    linears[1].register_forward_hook(_doubled)
    linears[-1].register_forward_hook(_halved_in_place)
    linears[-1].register_full_backward_hook(_halved_input_grad)
    return module


def checksum_rank(rank: int, world: int, device: str, steps: int) -> dict[str, Any]:
    """The clean runs (``steps`` steps each) and the faults on this rank; ``device`` is a
    device type."""
    from sdc_guard import native_kernel

    dev = on(device)  # "cuda": the GPU run_ranks set for this rank
    # The dry run takes the device's path: torch ops, no C passes.
    with native_kernel(False) if dev.type == "cpu" else contextlib.nullcontext():
        return _checksum_runs(rank, world, dev, steps)


def _checksum_runs(rank: int, world: int, dev: torch.device, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from bench.device import workload
    from injectors import Fault, arm
    from sdc_guard import GuardConfig, SDCGuard

    checked = GuardConfig(checksum=True)

    def guard_for(kind: str, dtype: str) -> SDCGuard:
        hooks = users_hooks if kind.endswith("_hooked") else None
        return workload(kind.removesuffix("_hooked"), dtype, dev, hooks=hooks).guard(checked)

    def dets(found: list[Any]) -> list[tuple[str, int, list[int]]]:
        return [(d.check, d.step, list(d.suspect_ranks)) for d in found]

    out: dict[str, Any] = {"device": str(dev), "backend": dist.get_backend(), "clean": {},
                           "faults": []}

    def clean(kind: str, dtype: str) -> dict[str, Any]:
        guard = guard_for(kind, dtype)
        worst = sides_error(guard) if dtype == "autocast" else None
        reports = [guard.step(s) for s in range(steps)]
        found = [d for r in reports for d in r.detections] + guard.flush()
        return {"detections": dets(found), "skipped": [r.step for r in reports if r.skipped],
                **({} if worst is None else {"sides_error": worst[0]})}

    tf32 = torch.backends.cuda.matmul.allow_tf32
    for kind, dtype, allow in CHECKSUM_RUNS:
        torch.backends.cuda.matmul.allow_tf32 = allow
        try:
            out["clean"][f"{kind}/{dtype}{'/tf32' if allow else ''}"] = clean(kind, dtype)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        dist.barrier()
    for kind, dtype in CHECKSUM_FUSED_RUNS:
        with fused_sides(dev):
            out["clean"][f"{kind}/{dtype}/fused"] = clean(kind, dtype)
        dist.barrier()
    for kind in ("mlp", "mlp_hooked", "mlp/fused"):
        fused = kind.endswith("/fused")
        guard = guard_for(kind.removesuffix("/fused"), "float32")
        step = 0
        for f in CHECKSUM_FAULTS:
            guard.reconfigure(guard.config)
            handle = arm(Fault(**f, rank=world - 1, step=step + 1), guard=guard)
            with fused_sides(dev) if fused else contextlib.nullcontext():
                reports = [guard.step(step + i) for i in range(4)]
            step += 4
            found = [d for r in reports for d in r.detections] + guard.flush()
            handle.remove()
            out["faults"].append({"fault": f, "model": kind,
                                  "fired": [rec["step"] for rec in handle.records],
                                  "detections": dets(found),
                                  "skipped": [r.step for r in reports if r.skipped]})
    dist.barrier()
    out["fused_checked"] = fused_checked()
    return out


def checksum_problems(results: list[dict[str, Any]]) -> list[str]:
    """What ``checksum_rank``'s results (by rank) show going wrong: a fused side given up; a
    detection or a withheld step in a clean run, or sides under autocast farther than
    ``AUTOCAST_SIDES`` from float64; a fault that did not fire in exactly one step, or that
    every rank did not report once, as the checksum's, naming the last rank, with that step
    withheld."""
    world = len(results)
    problems = []
    for r, res in enumerate(results):
        given_up = [k for k, ok in res.get("fused_checked", {}).items() if not ok]
        if given_up:
            problems.append(f"rank {r}: fused sides given up (failed or disagreed): {given_up}")
        for run, v in res["clean"].items():
            if v["detections"] or v["skipped"] or v.get("sides_error", 0.0) > AUTOCAST_SIDES:
                problems.append(f"rank {r}: {run} clean: {v}")
        for i, v in enumerate(res["faults"]):
            fired = sorted(set(results[-1]["faults"][i]["fired"]))
            want = [("checksum", fired[0], [world - 1])] if len(fired) == 1 else None
            if want is None or [tuple(d) for d in v["detections"]] != want or v["skipped"] != fired:
                problems.append(f"rank {r}: {v.get('model', 'mlp')} {v['fault']}: fired {fired}, "
                                f"detections {v['detections']}, skipped {v['skipped']}")
    return problems


def test_checksum_is_clean_and_names_each_fault(
        device: str = "cuda", world: int | None = None, steps: int = 300,
        record: dict[str, Any] | None = None) -> None:
    """On ``world`` ranks (every GPU by default; 3 on the CPU), ``steps`` steps a clean run:
    no detection in any clean run; each fault named in the step it fired, on the last rank,
    withheld; every fused side agreed with the eager one."""
    from scenarios.run.launch import run_ranks
    from tests.launch import scaled

    out = fill(record)
    cuda = torch.device(device).type == "cuda"
    world = world or (torch.cuda.device_count() if cuda else 3)
    backend = "nccl" if cuda else "gloo"
    results = run_ranks(checksum_rank, world, "cuda" if cuda else "cpu", steps, timeout=scaled(1800),
                        backend=backend)
    problems = checksum_problems(results)
    out.update(world=world, backend=backend, problems=problems[:20],
               clean_runs=len(results[0]["clean"]), faults=len(results[0]["faults"]),
               autocast_sides_error=max(v["sides_error"] for r in results
                                        for v in r["clean"].values() if "sides_error" in v),
               fused_checked=results[0].get("fused_checked", {}))
    assert not problems, problems[:20]
    assert len(results[0]["clean"]) == len(CHECKSUM_RUNS) + len(CHECKSUM_FUSED_RUNS)
    assert len(results[0]["faults"]) == 3 * len(CHECKSUM_FAULTS)  # plain, hooked, fused
