"""``python -m bench.soak`` (``nox -s soak``): false positives of every check on clean sharded runs.

The harness's Llama-style model trained clean under FSDP (2 ranks) and HSDP (2x2), bf16
mixed precision, with every check the guard runs on a sharded model, for ``--steps`` steps
each; every detection is a false positive. Counts rank-steps, audits and detections per
check, and which checks the guard refused for sharded models (so a refusal cannot pass for
a clean run). Writes ``bench/soak.json``::

    python -m bench.soak [--steps N] [--out bench]

``--tolerant``: the tolerant replay audit instead, auditing every step, on the testbed for
kernels that are not deterministic (ranks at 1 and 2 threads, ``injectors.noise.LinearNoise``
of up to 4 ulps on every linear output), beside the non-finite and weights checks (the
checksum would take the testbed's noise, which it adds after each product, for a fault), in
float32 as the campaign's testbed runs (4 bfloat16 ulps on every output, 1.6% each, is far
more than a GPU's reduction order changes a bfloat16 result, and beyond the tolerance's
ceiling); writes ``bench/soak_tolerant.json``. ``--tolerant --bf16``: the same in bfloat16
mixed precision, each linear product moved in its float32 accumulator before its rounding
(``LinearNoise(where="accumulator")``, as a GPU's reduction order moves it); writes
``bench/soak_tolerant_bf16.json``, with the audits' distances (median, 99th percentile,
largest) beside the false positives.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.timing import cpu_name
from scenarios.run.launch import run_ranks
from scenarios.spec.models import build_model, scenario_loss, synthetic_batch
from scenarios.spec.sharding import shard_model
from sdc_guard import GuardConfig, SDCGuard

EVERY_CHECK = {"nonfinite": True, "weights_interval": 1, "replay_interval": 4,
               "deterministic": True, "checksum": True}
"""Every check on, the replay auditing every 4th step."""


def _config(refused: list[str]) -> GuardConfig:
    kw: dict[str, Any] = dict(EVERY_CHECK, nonfinite_exchange_interval=8)
    if "replay" in refused:
        kw.update(replay_interval=0, deterministic=False)
    if "checksum" in refused:
        kw["checksum"] = False
    return GuardConfig(**kw)


TOLERANT = GuardConfig(nonfinite=True, weights_interval=1, replay_interval=1,
                       replay_mode="tolerant", deterministic=False)
"""``--tolerant``: the tolerant audit at every step, the non-finite and weights checks."""


def _autocast_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``scenario_loss`` under ``torch.autocast`` in bfloat16 (DDP's mixed precision)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss: torch.Tensor = scenario_loss(model, batch)
    return loss


def _soak_rank(rank: int, world: int, shape: tuple[int, ...], steps: int,
               tolerant: bool = False, bf16: bool = False,
               parallel: str | None = None) -> dict[str, Any]:
    torch.set_num_threads(1 + rank % 2 if tolerant else 1)
    parallel = parallel or ("fsdp" if len(shape) == 1 else "hsdp")
    model = shard_model(build_model("llama", width=64, depth=2, seed=0), parallel=parallel,
                        mesh_shape=shape,
                        mixed_precision=(not tolerant or bf16) and parallel != "ddp")
    if tolerant:
        from injectors.noise import LinearNoise

        LinearNoise(model, ulps=4, seed=0, rank=rank,
                    where="accumulator" if bf16 else "output")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        return synthetic_batch("llama", 0, r, step, 0, batch=4)

    refused: list[str] = []
    loss = _autocast_loss if parallel == "ddp" and bf16 else scenario_loss
    while True:
        try:
            guard = SDCGuard(model, opt, loss_fn=loss, batch_for=batch_for,
                             config=TOLERANT if tolerant else _config(refused))
            break
        except ValueError as e:  # a check that does not guard sharded models yet
            what = next((c for c in ("replay", "checksum")
                         if c not in refused and c in str(e)), None)
            if what is None:
                raise
            refused.append(what)
    detections: list[dict[str, Any]] = []
    skipped = 0
    audit = next((c for c in guard.checks if c.name == "replay"), None)
    distances: list[float] = []
    """The tolerant audit's own-edge distance at each audit step (its spread)."""
    t0 = time.perf_counter()
    for step in range(steps):
        report = guard.step(step)
        skipped += report.skipped
        detections += [d.to_json() for d in report.detections]
        gap = getattr(audit, "gap", lambda: None)()
        if gap is not None:
            distances.append(gap * audit.tolerance)  # type: ignore[union-attr]
    detections += [d.to_json() for d in guard.flush()]
    return {"checks": [c.name for c in guard.checks], "refused": refused,
            "detections": detections, "skipped": skipped,
            "tolerance": getattr(audit, "tolerance", None), "distances": distances,
            "seconds": time.perf_counter() - t0}


def spread(distances: list[float]) -> dict[str, float] | None:
    """Median, 99th percentile and largest of the audits' distances (None: none)."""
    if not distances:
        return None
    xs = sorted(distances)
    return {"median": statistics.median(xs), "p99": xs[min(len(xs) - 1, (99 * len(xs)) // 100)],
            "max": xs[-1]}


def soak(steps: int, tolerant: bool = False, bf16: bool = False) -> dict[str, Any]:
    runs = []
    meshes: list[tuple[str, tuple[int, ...]]] = [("fsdp", (2,)), ("hsdp", (2, 2))]
    if bf16:
        meshes.append(("ddp", (3,)))  # torch.autocast, as DDP trains in bfloat16
    for parallel, shape in meshes:
        world = math.prod(shape)
        out = run_ranks(_soak_rank, world, shape, steps, tolerant, bf16, parallel,
                        timeout=24 * 3600)
        first = out[0]
        runs.append({"parallel": parallel, "mesh": list(shape), "ranks": world, "steps": steps,
                     "rank_steps": world * steps, "checks": first["checks"],
                     "refused": first["refused"],
                     "false_positives": sum(len(o["detections"]) for o in out),
                     "withheld_steps": first["skipped"],
                     "detections": first["detections"][:20],
                     **({"audits": steps, "tolerance": first["tolerance"],
                         "distances": spread([x for o in out for x in o["distances"]])}
                        if tolerant else {}),
                     "seconds": max(o["seconds"] for o in out)})
    model = "llama (2 blocks, width 64), bf16 mixed precision, AdamW"
    if tolerant and bf16:
        model = ("llama (2 blocks, width 64), bf16 mixed precision (FSDP2's MixedPrecisionPolicy; "
                 "under DDP torch.autocast), AdamW; the testbed: ranks "
                 "at 1 and 2 threads, every linear product moved by up to 4 float32 ulps in "
                 "its float32 accumulator before its rounding to bfloat16 (LinearNoise "
                 "where='accumulator'); the tolerant replay audit at every step")
    elif tolerant:
        model = ("llama (2 blocks, width 64), float32, AdamW; the testbed: ranks at 1 and 2 "
                 "threads, up to 4 ulps of noise on every linear output; the tolerant replay "
                 "audit at every step")
    return {"machine": cpu_name(), "torch": torch.__version__, "model": model,
            "rank_steps": sum(r["rank_steps"] for r in runs),
            "false_positives": sum(r["false_positives"] for r in runs), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1700,
                    help="steps per mesh (2 + 4 ranks: 6 rank-steps each)")
    ap.add_argument("--tolerant", action="store_true",
                    help="the tolerant replay audit on the noise testbed (soak_tolerant.json)")
    ap.add_argument("--bf16", action="store_true",
                    help="with --tolerant: bf16 mixed precision, the noise in the float32 "
                         "accumulator (soak_tolerant_bf16.json)")
    ap.add_argument("--out", default="bench")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be at least 1; got {args.steps}")
    if args.bf16 and not args.tolerant:
        ap.error("--bf16 is the tolerant audit's bfloat16 testbed: give --tolerant with it")
    res = soak(args.steps, args.tolerant, args.bf16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = ("soak_tolerant_bf16.json" if args.bf16 else
            "soak_tolerant.json" if args.tolerant else "soak.json")
    (out / name).write_text(json.dumps(res, indent=1) + "\n")
    for r in res["runs"]:
        print(f"{r.get('parallel', '')} mesh {r['mesh']}: {r['rank_steps']} rank-steps, checks {r['checks']} "
              f"(refused under sharding: {r['refused'] or 'none'}), "
              f"false positives {r['false_positives']}, {r['seconds']:.0f} s")
    print(f"total: {res['rank_steps']} rank-steps, {res['false_positives']} false positives")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
