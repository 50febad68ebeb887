"""``python -m bench.replay_exchange``: where the replay audit posts its ring exchange, side by side.

The audit sends its two replayed words to their owner point to point. Posted right after the
replay, the message is alone on the wire; posted with the step's first gradient bucket (the
default, ``ReplayAudit.exchange_with_first_bucket``), it travels beside the bucket all-reduces.
On a machine with more ranks than cores a message on its own wakes the peer's communication
thread at a moment of its own, which preempts a rank that is computing. This times both
placements beside replay off and the ideal (replay off plus a plain forward+backward of the
neighbour's batch), every step audited, in alternated blocks on one model, and reports what
an audit step adds over its recomputation, per placement: the median over steps, wall and
main-thread CPU, with 90% bootstrap intervals over rounds. Writes ``OUT/replay_exchange.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from bench.reference import classification_batch, cross_entropy_loss, guarded_ddp, reference_mlp, switch
from bench.timing import bootstrap_interval, cpu_name, publish
from scenarios.run.launch import run_ranks
from scenarios.spec.overhead import replay_only
from sdc_guard import SDCGuard
from sdc_guard.internal import ReplayAudit

CONFIGS = ("off", "ideal", "first bucket", "after the replay")


def _rank(rank: int, world: int, rounds: int, block: int) -> dict[str, Any]:
    batch_for = functools.partial(classification_batch, batch=128)
    base = replay_only(1).config
    assert base is not None
    audit = replace(base, replay_interval=1, nonfinite=True)
    off = replace(audit, replay_interval=0)
    model = guarded_ddp(reference_mlp())
    guard = SDCGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     loss_fn=cross_entropy_loss, batch_for=batch_for, config=audit)
    module = model.module
    params = [p for p in module.parameters() if p.requires_grad]
    ideal = [False]

    def extra(step: int) -> None:  # the ideal's recomputation: what the audit must at least do
        if ideal[0]:
            loss = cross_entropy_loss(module, batch_for((rank + 1) % world, step))
            torch.autograd.grad(loss, params)

    guard.before_step.append(extra)
    wall: dict[str, list[list[float]]] = {n: [] for n in CONFIGS}
    cpu: dict[str, list[list[float]]] = {n: [] for n in CONFIGS}
    step = 0
    for r in range(rounds + 1):  # round 0 warms up
        for name in CONFIGS[r % 4:] + CONFIGS[:r % 4]:
            switch(guard, off if name in ("off", "ideal") else audit)
            ideal[0] = name == "ideal"
            for check in guard.checks:
                if isinstance(check, ReplayAudit):
                    check.exchange_with_first_bucket = name == "first bucket"
            guard.step(step)  # the first step after a switch is not timed
            step += 1
            w, c = [], []
            for _ in range(block):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                guard.step(step)
                c1 = time.thread_time()
                dist.barrier()
                w.append(time.perf_counter() - t0)
                c.append(c1 - c0)
                step += 1
            if r:
                wall[name].append(w)
                cpu[name].append(c)
    return {"wall": wall, "cpu": cpu}


def _ratio(m: dict[str, list[float]], name: str) -> float:
    """What an audit step adds over replay off, against what the ideal's recomputation adds."""
    off = statistics.median(m["off"])
    return (statistics.median(m[name]) - off) / (statistics.median(m["ideal"]) - off)


def replay_exchange(world: int, rounds: int, block: int) -> dict[str, Any]:
    res = run_ranks(_rank, world, rounds, block, timeout=3600)[0]
    out: dict[str, Any] = {"cpu": cpu_name(), "torch": torch.__version__, "world": world,
                           "rounds": rounds, "block": block, "placements": {}}
    for name in CONFIGS[2:]:
        entry: dict[str, Any] = {}
        for kind in ("wall", "cpu"):
            rounds_of = res[kind]
            flat = {k: [x for r in v for x in r] for k, v in rounds_of.items()}
            entry[kind] = _ratio(flat, name)
            entry[f"{kind}_interval_90"] = list(bootstrap_interval(
                rounds_of, functools.partial(_ratio, name=name)))
        out["placements"][name] = entry
    out["step_ms"] = {k: 1e3 * statistics.median(x for r in v for x in r)
                      for k, v in res["wall"].items()}
    return out


def table(res: dict[str, Any]) -> list[str]:
    lines = [f"Replay audit every step, {res['world']} ranks, reference MLP batch 128, "
             f"{res['rounds']} rounds of {res['block']}-step blocks ({res['cpu']}, torch "
             f"{res['torch']}). Per audit step: what it adds over replay off / what the "
             "ideal's forward+backward adds (median step; 90% bootstrap interval over rounds).",
             "", "| exchange posted | wall | 90% interval | main-thread CPU | 90% interval |",
             "|---|---|---|---|---|"]
    for name, e in res["placements"].items():
        lines.append(f"| {name} | **{e['wall']:.2f}** | {e['wall_interval_90'][0]:.2f} .. "
                     f"{e['wall_interval_90'][1]:.2f} | {e['cpu']:.2f} | "
                     f"{e['cpu_interval_90'][0]:.2f} .. {e['cpu_interval_90'][1]:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay_exchange",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=3, help="ranks (default 3)")
    ap.add_argument("--rounds", type=int, default=30, help="rounds (default 30)")
    ap.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    ap.add_argument("--out", default="bench", help="directory for replay_exchange.json")
    args = ap.parse_args(argv)
    if args.world < 2 or args.rounds < 2 or args.block < 1:
        ap.error(f"needs --world >= 2, --rounds >= 2, --block >= 1 (got {args.world}, "
                 f"{args.rounds}, {args.block})")
    res = replay_exchange(args.world, args.rounds, args.block)
    publish(args.out, "replay_exchange", res, table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
