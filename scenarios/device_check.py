"""One prepared run for a machine with an accelerator: CUDA/nccl paths and fingerprint throughput.

    python -m scenarios.device_check [--out DIR] [--device cuda] [--mib 256]

Checks, each recorded as passed or failed with its numbers (nothing is skipped
silently; without CUDA the script says so and exits 2):

* ``fingerprint`` and the replay's word digest give the same value on the device
  as on the CPU, for every dtype, odd sizes, non-contiguous views, empty tensors
  and a tensor larger than one device chunk; the result stays on the device;
* ``rng_stream`` replays the same random numbers on the device;
* a guarded DDP step on the device with nccl (one rank per GPU; the ring of one
  when there is a single GPU) runs nonfinite, weights and replay every step with
  no detection, and a NaN written into a local gradient is named;
* throughput on the device: fingerprint, word digest, ``torch.hash_tensor``
  beside one ``torch.sum`` pass over the same float32 tensor.

Results go to ``DIR/device_check.json`` and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]


def _cases(g: torch.Generator) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for dtype in DTYPES:
        for n in (0, 1, 7, 1023, 65_537, 300_001):
            raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),),
                                generator=g, dtype=torch.uint8)
            t = raw.view(dtype) if dtype != torch.bool else raw.remainder(2).to(torch.bool)
            out.append(t)
    base = torch.randn(64, 48, generator=g)
    out += [base.t(), base[::3, 5:], torch.empty(0, 3)]
    return out


def check_values(device: torch.device) -> dict[str, Any]:
    from sdc_guard import fingerprint, fingerprint_tensor
    from sdc_guard import fingerprints as fp

    g = torch.Generator().manual_seed(0)
    mismatches = []
    for i, t in enumerate(_cases(g)):
        d = t.to(device)
        if fingerprint(t) != fingerprint(d):
            mismatches.append(f"fingerprint case {i} {t.dtype} {tuple(t.shape)}")
        if int(fp._digest_value(t)) != int(fp._digest_value(d)):
            mismatches.append(f"digest case {i} {t.dtype} {tuple(t.shape)}")
    big = torch.randn(fp._DEVICE_CHUNK + 12_345, generator=g)  # more than one device chunk
    if fingerprint(big) != fingerprint(big.to(device)):
        mismatches.append("fingerprint of a tensor larger than one device chunk")
    stays = fingerprint_tensor(big.to(device)).device == device
    return {"passed": not mismatches and stays, "mismatches": mismatches,
            "result_stays_on_device": stays}


def check_rng(device: torch.device) -> dict[str, Any]:
    from sdc_guard.determinism import rng_stream

    draws = []
    for _ in range(2):
        with rng_stream(7, 1, 3, 0, device):
            draws.append(torch.rand(1000, device=device).cpu())
    return {"passed": torch.equal(draws[0], draws[1])}


def _guarded_rank(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scenarios.models import classification_batch, cross_entropy_loss, reference_mlp
    from sdc_guard import GuardConfig, SDCGuard

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    model = DDP(reference_mlp().to(device), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_for(r: int, step: int) -> Any:
        x, y = classification_batch(r, step, batch=128, d_in=512, n_out=10)
        return x.to(device), y.to(device)

    guard = SDCGuard(model, opt, loss_fn=cross_entropy_loss, batch_for=batch_for,
                     config=GuardConfig(deterministic=True, replay_interval=1))

    def nan(bucket: Any) -> None:
        if guard.comm.step == 6 and rank == world - 1:
            bucket.buffer()[0] = float("nan")

    guard.comm.before.append(nan)
    reports = [guard.step(s) for s in range(8)]
    dist.barrier()
    return {"detections": [(d.check, d.step, list(d.suspect_ranks))
                           for r in reports for d in r.detections]}


def _nccl_entry(rank: int, world: int, port: int, q: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world)
        q.put((rank, _guarded_rank(rank, world)))
        dist.destroy_process_group()
    except Exception:  # reported to the parent, which fails the check
        q.put((rank, {"error": traceback.format_exc()[-3000:]}))


def check_nccl_guard() -> dict[str, Any]:
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_nccl_entry, args=(r, world, 29611, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    expected = [("nonfinite", 6, [world - 1])]
    ok = all(r.get("detections") == expected for r in results.values())
    return {"passed": ok, "world": world, "expected": expected, "ranks": results}


def _median_time(fn: Callable[[], object], device: torch.device, reps: int = 9) -> float:
    fn()
    torch.cuda.synchronize(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def throughput(device: torch.device, mib: int) -> dict[str, Any]:
    from sdc_guard import fingerprint_tensor
    from sdc_guard import fingerprints as fp

    x = torch.randn(mib * 2**20 // 4, device=device)
    methods: dict[str, Callable[[], object]] = {
        "torch.sum (one read pass)": lambda: x.sum(),
        "sdc_guard.fingerprint_tensor": lambda: fingerprint_tensor(x),
        "replay word digest": lambda: fp._digest_value(x),
        "torch.hash_tensor (XOR)": lambda: torch.hash_tensor(x),
    }
    times = {k: _median_time(f, device) for k, f in methods.items()}
    base = times["torch.sum (one read pass)"]
    return {"tensor_mib": mib, "methods": {
        k: {"median_s": t, "gib_per_s": mib / 1024 / t, "ratio_to_sum": base / t}
        for k, t in times.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mib", type=int, nargs="*", default=[256, 4096])
    args = ap.parse_args(argv)
    try:
        torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r} is not a torch device; use cuda, cuda:N or cpu.")
    if any(m <= 0 for m in args.mib):
        ap.error(f"--mib takes tensor sizes in MiB > 0, got {args.mib}.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("device_check: CUDA is not available on this machine; nothing was checked.",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    report: dict[str, Any] = {"torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        report["name"] = torch.cuda.get_device_name(device)
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "values": lambda: check_values(device),
        "rng_stream": lambda: check_rng(device),
    }
    if device.type == "cuda":
        steps["nccl_guard"] = check_nccl_guard
        for mib in args.mib:
            steps[f"throughput_{mib}mib"] = lambda mib=mib: throughput(device, mib)
    for name, fn in steps.items():
        t0 = time.perf_counter()
        try:
            report[name] = fn()
        except Exception:
            report[name] = {"passed": False, "error": traceback.format_exc()[-3000:]}
        report[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(report[name], default=str)[:2000], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("passed") is False]
    print("failed:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
