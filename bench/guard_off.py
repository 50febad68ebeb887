"""``python -m bench.guard_off``: the guard's own work per step with every check off, measured
directly.

With its checks off the guard registers no comm hook (DDP keeps its built-in all-reduce), so
what it adds to a plain training loop is its step loop: the batch and micro-batch split,
the checks asked whether they are due, the loss kept for the report. Three ranks sharing two
cores time that beside plain DDP with intervals as wide as the target (``bench/RESULTS.md``):
the noise of the machine. Here one process (one rank of gloo, one thread) times the guard's
``step`` and the same plain loop on the same model in alternated blocks, in the main thread's
CPU time, and reports the difference per step beside the plain step, on the reference MLP
and on a tiny model, where the loop's own cost is all there is to see: a fixed cost per
step, which the reference step carries too. Writes ``OUT/guard_off.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from bench.reference import D_IN, classification_batch, cross_entropy_loss, reference_mlp
from bench.timing import bootstrap_interval, cpu_name, publish
from scenarios.spec.overhead import CHECKS_OFF
from sdc_guard import SDCGuard

MODELS: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "reference MLP (512-1024-1024-10), batch 128": (reference_mlp, 128, D_IN),
    "tiny MLP (16-16-10), batch 8": (
        lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10)), 8, 16),
}
"""name -> (model, batch, input width)."""


def _measure(make: Callable[[], nn.Module], batch: int, d_in: int, rounds: int,
             block: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(make(), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(rank: int, step: int) -> Any:
        return classification_batch(rank, step, batch=batch, d_in=d_in)

    guard = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=CHECKS_OFF.config)
    assert not guard.comm_hook_registered  # else the plain loop would not be plain DDP

    def plain(step: int) -> None:
        opt.zero_grad(set_to_none=True)
        cross_entropy_loss(model, batch_for(0, step)).backward()  # type: ignore[no-untyped-call]
        opt.step()

    runs = {"plain DDP": plain, "guard, checks off": guard.step}
    per_round: dict[str, list[list[float]]] = {k: [] for k in runs}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        order = list(runs) if r % 2 else list(runs)[::-1]
        for name in order:
            run = runs[name]
            t0 = time.thread_time()
            for _ in range(block):
                run(step)
                step += 1
            if r:
                per_round[name].append([(time.thread_time() - t0) / block])

    def extra(m: dict[str, list[float]]) -> float:
        return statistics.median(m["guard, checks off"]) - statistics.median(m["plain DDP"])

    flat = {k: [v[0] for v in vs] for k, vs in per_round.items()}
    base = statistics.median(flat["plain DDP"])
    lo, hi = bootstrap_interval(per_round, extra)
    return {"plain_step_cpu_s": base, "extra_cpu_s": extra(flat),
            "extra_cpu_interval_90_s": [lo, hi], "fraction": extra(flat) / base,
            "fraction_interval_90": [lo / base, hi / base]}


def guard_off(rounds: int, block: int) -> dict[str, Any]:
    """Both models, in this process (a one-rank gloo group on loopback, one thread)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        models = {name: _measure(make, batch, d_in, rounds, block)
                  for name, (make, batch, d_in) in MODELS.items()}
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    ref, tiny = (models[name] for name in MODELS)
    fixed = tiny["extra_cpu_s"] / ref["plain_step_cpu_s"]
    return {"cpu": cpu_name(), "torch": torch.__version__, "rounds": rounds, "block": block,
            "models": models, "fixed_fraction_of_reference_step": fixed,
            "fixed_fraction_interval_90": [v / ref["plain_step_cpu_s"]
                                           for v in tiny["extra_cpu_interval_90_s"]]}


def table(res: dict[str, Any]) -> list[str]:
    lines = [f"The guard with its checks off beside the same plain loop, main-thread CPU time per "
             f"step, one rank, one thread ({res['cpu']}, torch {res['torch']}; "
             f"{res['rounds']} alternated rounds of {res['block']} steps, medians, 90% "
             "bootstrap intervals over rounds):", "",
             "| model | plain step (ms CPU) | guard's extra (us) | 90% interval (us) | fraction |",
             "|---|---|---|---|---|"]
    for name, m in res["models"].items():
        lo, hi = m["extra_cpu_interval_90_s"]
        lines.append(f"| {name} | {m['plain_step_cpu_s'] * 1e3:.2f} | "
                     f"{m['extra_cpu_s'] * 1e6:+.0f} | {lo * 1e6:+.0f} .. {hi * 1e6:+.0f} | "
                     f"{m['fraction'] * 100:+.2f}% |")
    lo, hi = res["fixed_fraction_interval_90"]
    fixed = res["fixed_fraction_of_reference_step"] * 100
    lines += ["", f"The loop's cost does not grow with the model: the tiny model's extra, "
              f"beside the reference MLP's plain step, is **{fixed:+.2f}%** "
              f"(90%: {lo * 100:+.2f}% .. {hi * 100:+.2f}%); on the reference MLP itself the "
              "difference is within the noise of its step."]
    return lines


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.guard_off``: the table, written to OUT/guard_off.json too."""
    ap = argparse.ArgumentParser(prog="python -m bench.guard_off", description=main.__doc__)
    ap.add_argument("--rounds", type=int, default=60, help="alternated rounds (default 60)")
    ap.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    ap.add_argument("--out", default="bench", help="directory for guard_off.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.block < 1:
        ap.error(f"--rounds and --block must be at least 1 (got --rounds {args.rounds} "
                 f"--block {args.block})")
    res = guard_off(args.rounds, args.block)
    publish(args.out, "guard_off", res, table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
