"""A guarded DDP training that stops when it must: it restarts elsewhere, rolls back, or ends.

One process per rank, started by a launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (the Kubeflow training-operator does, for
``deploy/pytorchjob.yaml``; so does ``torchrun``). ``NODE_NAME`` and ``POD_NAME`` come from
the downward API. nccl on GPUs, gloo on CPUs. The model and data are synthetic stand-ins for
yours: replace ``make_model`` and ``batch_for``.

    python examples/train_guarded.py --steps 200 [--act] [--kubeconfig PATH] [--plant-fault STEP]
        [--checkpoint-dir DIR [--checkpoint-every N] [--keep-checkpoints K]]
    torchrun --standalone --nproc-per-node 3 examples/train_guarded.py --no-quarantine \\
        --plant-fault 20 --checkpoint-dir /tmp/ckpt --checkpoint-every 10

What it does with a detection (every rank gets the same detections in the same call, so
every rank takes the same branch at the same step):

- repaired in place (the weights check restored a lone corrupt replica from the majority),
  or contained (the step was withheld on every rank, the fault never reached the weights):
  nothing to undo, training goes on.
- a convicted rank (suspects named, not repaired) whose node was quarantined for real
  (``--act``): every rank exits ``EXIT_QUARANTINED`` (200). ``restartPolicy: ExitCode``
  retries 128-255, so the job's pods are recreated away from the cordoned node, and the new
  processes restore the newest clean checkpoint at their start.
- anything else not repaired nor contained (no quarantine: ``--no-quarantine``, a dry run,
  the breaker tripped, the API refused; or no rank could be named): roll back in process to
  the newest checkpoint before the suspect window, and go on. When there is nothing to roll
  back to (no ``--checkpoint-dir``, no clean checkpoint yet), or the fault came back before
  a new clean checkpoint was saved (a second rollback to the same one would loop), every rank
  exits ``EXIT_CONVICTED`` (3) with a line saying what to do: a permanent failure for
  ``restartPolicy: ExitCode``, since a restart would land on the same hardware.

With ``--checkpoint-dir`` (``deploy/pytorchjob.yaml`` gives the shared volume), every rank
starts by restoring the newest checkpoint before any suspect window (none on a fresh run: step
0) and saves one every ``--checkpoint-every`` steps, the LR schedule with it: the restarted job
resumes from the last clean state on the schedule the fault-free run would have followed. An
in-process rollback is exact (the same run, bit for bit, as one that never met the fault); a
restarted job resumes bit for bit as a fault-free job restarted at the same step does (DDP
lays out its gradient buckets anew after a process's first iteration, so the first step after
any restart rounds its all-reduce differently from a job that never stopped;
docs/recovery.md).

Without Kubernetes credentials (in-cluster, or ``--kubeconfig``) it exits with code 2 at once
and says so; ``--no-quarantine`` detects, repairs and rolls back without a cluster.

``--plant-fault STEP`` flips a bit of one weight of rank 1 at every step from STEP on, to see
the whole path: the weights check repairs it from the majority once, and convicts rank 1 the
second time. The faulty bit stands for a part that a rollback's operator replaced: it is gone
after a rollback, unless ``--fault-persists`` (then it comes back, and the job ends with
``EXIT_CONVICTED``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from sdc_guard import EXIT_CONVICTED, EXIT_QUARANTINED
from sdc_guard.remediation import KubeError, KubeQuarantine

WHAT_TO_DO = (
    "a person must look: read the detection in the log (and the event log, "
    "`python -m sdc_guard events summarize FILE`), take the suspect node out of the job "
    "(kubectl cordon NODE, or release the quarantine breaker if it tripped), then resubmit the "
    "job; it resumes from the newest clean checkpoint")
"""The line a job that cannot recover by itself ends with (``EXIT_CONVICTED``)."""


def make_model() -> nn.Module:
    torch.manual_seed(0)  # every replica starts from the same weights
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def batch_for(device: torch.device):  # type: ignore[no-untyped-def]
    def fetch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Deterministic in (rank, step): the replay audit fetches a neighbour's batch again.
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        x = torch.randn(64, 32, generator=g)
        return x.to(device), (x[:, :10].argmax(dim=1)).to(device)
    return fetch


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


class FaultyBit:
    """A ``before_step`` hook: bit 22 of the first element of ``param`` flipped at every step
    from ``at`` on (a permanent fault: repaired once by the majority, convicted the second
    time). ``disarm()`` stands for the part being replaced."""

    def __init__(self, param: torch.Tensor, at: int) -> None:
        self.param, self.at, self.armed = param, at, True

    def __call__(self, step: int) -> None:
        if self.armed and step >= self.at:
            self.param.detach().view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 22)

    def disarm(self) -> None:
        self.armed = False


def quarantined(quarantine: KubeQuarantine | None, detections: list[sdc_guard.Detection],
                device: torch.device) -> bool:
    """Did the acting rank quarantine every suspect's node for real? Every rank asks at once
    (after ``guard.flush()``, which waits for the cordon) and gets the acting rank's answer,
    so that no rank leaves for a restart while the others roll back."""
    code = None if quarantine is None else quarantine.restart_code(detections)
    if quarantine is None or quarantine.dry_run:
        return False  # the same on every rank: no collective needed
    flag = torch.tensor([int(code == EXIT_QUARANTINED)], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=quarantine.acting_rank)
    return bool(flag.item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--act", action="store_true",
                    help="quarantine for real (default: a dry run, dryRun=All)")
    ap.add_argument("--kubeconfig", default=None,
                    help="kubeconfig path (default: the pod's service account)")
    ap.add_argument("--no-quarantine", action="store_true",
                    help="no cluster: detect, repair, roll back, or end with EXIT_CONVICTED")
    ap.add_argument("--plant-fault", type=int, default=None, metavar="STEP",
                    help="a stuck bit in a weight of rank 1 from STEP on (a demonstration)")
    ap.add_argument("--fault-persists", action="store_true",
                    help="the planted fault survives a rollback (default: gone after one)")
    ap.add_argument("--event-log", default=None, help="JSON-lines file for detections")
    ap.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                    help="shared storage every rank and replacement pod reads: restore from "
                         "it at the start, save to it, roll back to it (default: no "
                         "checkpoints)")
    ap.add_argument("--checkpoint-every", type=int, default=50, metavar="N",
                    help="save a checkpoint every N steps (default 50)")
    ap.add_argument("--keep-checkpoints", type=int, default=3, metavar="K",
                    help="checkpoints kept, besides the newest verified clean (default 3)")
    args = ap.parse_args(argv)
    if args.checkpoint_every < 1:
        ap.error(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    try:  # before the process group: a rank that cannot start leaves no peer waiting
        quarantine = None if args.no_quarantine else KubeQuarantine(
            dry_run=not args.act, max_nodes=1, max_fraction=0.1, kubeconfig=args.kubeconfig)
    except KubeError as e:
        print(f"train_guarded: {e}; or --no-quarantine to detect only", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = DDP(make_model().to(device), device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    ckpt = None if args.checkpoint_dir is None else \
        sdc_guard.CheckpointManager(args.checkpoint_dir, keep=args.keep_checkpoints)
    config = sdc_guard.GuardConfig(replay_interval=4, deterministic=True,
                                   event_log=args.event_log)
    guard = sdc_guard.SDCGuard(model, optimizer, loss_fn=loss_fn, batch_for=batch_for(device),
                               config=config, remediation=quarantine, checkpoints=ckpt)
    fault = None
    if args.plant_fault is not None and rank == 1:
        fault = FaultyBit(next(model.module.parameters()), args.plant_fault)
        guard.before_step.append(fault)
    extra = {"lr": schedule}  # state that belongs to the step, rolled back with the model
    start = step = 0 if ckpt is None else ckpt.restore(model, optimizer, extra=extra)

    code = 0
    resumed_at: int | None = None  # the step the last rollback resumed at
    while step < args.steps:
        report = guard.step(step)
        schedule.step()
        unsettled = [d for d in report.detections if not (d.repaired or d.contained)]
        convicted = [d for d in report.detections if d.suspect_ranks and not d.repaired]
        if convicted or unsettled:
            guard.flush()  # collective: every rank is here, at the same step; waits for the cordon
        if convicted and quarantined(quarantine, convicted, device):
            code = EXIT_QUARANTINED
            d = convicted[0]
            print(f"rank {rank}: {d.check} detection at step {d.step}, suspects "
                  f"{list(d.suspect_nodes)} quarantined; exiting {code} to restart elsewhere",
                  flush=True)
            break
        if unsettled:
            d = unsettled[0]
            resume = 0 if ckpt is None else ckpt.restore(model, optimizer, extra=extra)
            if resume == 0 or resume == resumed_at:
                why = ("no checkpoint to roll back to" if ckpt is None else
                       "no clean checkpoint to roll back to" if resume == 0 else
                       f"the fault came back after the rollback to step {resume}")
                code = EXIT_CONVICTED
                print(f"rank {rank}: {d.check} detection at step {d.step}, suspects "
                      f"{list(d.suspect_nodes) or 'not named'}, not quarantined, and {why}: "
                      f"exiting {code}; {WHAT_TO_DO}", flush=True)
                break
            print(f"rank {rank}: {d.check} detection at step {d.step}, suspects "
                  f"{list(d.suspect_nodes) or 'not named'}; rolled back, resuming at step "
                  f"{resume}", flush=True)
            if fault is not None and not args.fault_persists:
                fault.disarm()
            step = resumed_at = resume
            continue
        if ckpt is not None and (step + 1) % args.checkpoint_every == 0:
            # collective; refused while suspect; written and fsynced on a thread
            ckpt.save(step, model, optimizer, extra=extra, background=True)
        step += 1
    else:
        guard.flush()
        state = sdc_guard.fingerprint(sdc_guard.state_tensors(model.module, optimizer))
        print(f"rank {rank}: trained steps {start} to {args.steps - 1}; state fingerprint "
              f"{state:016x}", flush=True)
    if ckpt is not None:
        ckpt.wait()  # the last checkpoint committed before the process leaves
    if quarantine is not None:
        quarantine.close()  # evidence held back by the rate limit goes out now
    # Tear down in this order: the DDP reducer's destructor joins a gloo thread that waits for
    # the GIL, and a process that skips it can hang or abort at exit.
    dist.barrier()
    guard.close()
    del guard, model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
