"""``python -m bench.fsdp`` (``nox -s fsdp_bench``): the guard's cost over plain FSDP2, beside DDP.

The harness's Llama-style model (``scenarios.spec.models``, kind "llama") on 2 gloo ranks,
trained by plain FSDP2 (``fully_shard`` per block and the root), by the guard on FSDP2 with
its checks off, with each check alone and with the defaults; and by plain DDP and the guard
with the defaults on DDP, the same model and batches. Each configuration has a model of its
own, built alike; the configurations alternate step block by step block, their order
rotating round by round, and a barrier brackets every step. The replay audit's
configuration switches torch's deterministic algorithms on for the whole process, so every
configuration runs with them (side by side alike; on the CPU they change little). Medians
per configuration, the ratio of each to its plain baseline and a 90% bootstrap interval
over the rounds (``bench.timing``). Results go to ``bench/fsdp.json`` and ``bench/FSDP.md``::

    python -m bench.fsdp [--rounds N] [--block N] [--batch N] [--out bench]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.timing import bootstrap_interval, cpu_name, publish, split_rounds
from scenarios.run.launch import run_ranks
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.sharding import shard_model
from sdc_guard import GuardConfig, SDCGuard

OFF = GuardConfig(nonfinite=False, weights_interval=0)
CONFIGS: dict[str, tuple[str, GuardConfig | None]] = {
    "plain FSDP2": ("fsdp", None),
    "guard, checks off": ("fsdp", OFF),
    "guard, nonfinite alone": ("fsdp", GuardConfig(weights_interval=0)),
    "guard, weights alone (at rest)": ("fsdp", GuardConfig(nonfinite=False)),
    "guard, checksum alone": ("fsdp", GuardConfig(nonfinite=False, weights_interval=0,
                                                   checksum=True)),
    "guard, replay every 4 alone": ("fsdp", GuardConfig(nonfinite=False, weights_interval=0,
                                                         replay_interval=4, deterministic=True)),
    "guard, defaults": ("fsdp", GuardConfig()),
    "plain DDP": ("ddp", None),
    "guard on DDP, defaults": ("ddp", GuardConfig()),
}
"""Each configuration: its parallelism, and the guard's config (None: no guard)."""
BASELINE = {"fsdp": "plain FSDP2", "ddp": "plain DDP"}
SEED = 0


def _runner(rank: int, world: int, parallel: str, config: GuardConfig | None,
            batch: int) -> Callable[[int], None]:
    """One step of one configuration, on a model of its own."""
    model = shard_model(build_model("llama", width=64, depth=2, seed=SEED), parallel=parallel,
                        mesh_shape=(world,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        return synthetic_batch("llama", SEED, r, step, 0, batch=batch)

    if config is None:
        def plain(step: int) -> None:
            opt.zero_grad(set_to_none=True)
            scenario_loss(model, batch_for(rank, step)).backward()  # type: ignore[no-untyped-call]
            opt.step()
        return plain
    guard = SDCGuard(model, opt, loss_fn=scenario_loss, batch_for=batch_for, config=config)

    def guarded(step: int) -> None:
        guard.step(step)
    return guarded


def _bench_rank(rank: int, world: int, rounds: int, block: int,
                batch: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)  # two ranks on two cores: one thread each
    runs = {name: _runner(rank, world, parallel, cfg, batch)
            for name, (parallel, cfg) in CONFIGS.items()}
    names = list(runs)
    times: dict[str, list[float]] = {n: [] for n in names}
    step = 0
    for name in names:  # warm-up: optimizer state exists, caches are hot
        for _ in range(3):
            runs[name](step)
            step += 1
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(block):
                dist.barrier()
                t0 = time.perf_counter()
                runs[name](step)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
                step += 1
    return times


def fsdp_overhead(rounds: int = 20, block: int = 5, batch: int = 16) -> dict[str, Any]:
    """Medians per configuration (rank 0's clock) and each one's ratio to its baseline."""
    times = run_ranks(_bench_rank, 2, rounds, block, batch, timeout=3600)[0]
    per_round = {n: split_rounds(v, rounds) for n, v in times.items()}
    rows = []
    for name, (parallel, _) in CONFIGS.items():
        base = BASELINE[parallel]
        median = statistics.median(times[name])

        def ratio(pooled: dict[str, list[float]], n: str = name, b: str = base) -> float:
            return statistics.median(pooled[n]) / statistics.median(pooled[b])

        low, high = bootstrap_interval({k: per_round[k] for k in (name, base)}, ratio)
        rows.append({"configuration": name, "parallel": parallel, "median_ms": median * 1e3,
                     "ratio": ratio(times), "interval": [low, high], "baseline": base})
    return {"machine": f"{cpu_name()}, 2 ranks of 1 thread, torch {torch.__version__}",
            "model": "llama (2 blocks, width 64), AdamW", "batch": batch, "rounds": rounds,
            "block": block, "rows": rows}


def markdown(res: dict[str, Any]) -> list[str]:
    lines = ["# The guard over plain FSDP2 (and DDP), per step", "",
             f"{res['machine']}; {res['model']}, batch {res['batch']} sequences per rank; "
             f"{res['rounds']} rounds of {res['block']} steps per configuration, alternated, "
             "a barrier around each step. Generated by `python -m bench.fsdp`.", "",
             "| configuration | median step (ms) | over its baseline | 90% interval |",
             "|---|---:|---:|---|"]
    for row in res["rows"]:
        low, high = row["interval"]
        over = "baseline" if row["configuration"] == row["baseline"] else (
            f"{100 * (row['ratio'] - 1):+.1f}%")
        lines.append(f"| {row['configuration']} | {row['median_ms']:.2f} | {over} | "
                     f"{100 * (low - 1):+.1f}% .. {100 * (high - 1):+.1f}% |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    res = fsdp_overhead(args.rounds, args.block, args.batch)
    lines = markdown(res)
    publish(Path(args.out), "fsdp", res, lines)
    (Path(args.out) / "FSDP.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
