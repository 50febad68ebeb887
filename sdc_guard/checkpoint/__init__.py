"""Checkpoints that know the suspect window: save, verify, restore the last clean state.

::

    ckpt = sdc_guard.CheckpointManager(directory, keep=3)
    guard = sdc_guard.SDCGuard(..., checkpoints=ckpt)    # records suspect windows
    ckpt.save(step, model, optimizer)                     # collective: every rank calls
    start = ckpt.restore(model, optimizer)                # the step to train next
    ckpt.save(step, model, optimizer, extra={"lr": scheduler, "scaler": scaler})
    start = ckpt.restore(model, optimizer, extra={"lr": scheduler, "scaler": scaler})
    ckpt.save(step, model, optimizer, background=True)   # written on a thread; ckpt.wait()

**What a checkpoint holds.** The model's and the optimizer's ``state_dict``, every rank's
random-number-generator states (torch CPU and CUDA, Python's ``random``, NumPy's when it is
installed; they differ per rank), the step, the verification state (the newest step every
check verified clean, and each check's: asked of the bound guard when ``save`` is called,
or ``save(..., verified_through=step)`` without a guard), and the 64-bit fingerprint of the
parameters and optimizer state (``sdc_guard.fingerprint`` over ``state_tensors``), checked again after
loading. With ``extra``, each named object's ``state_dict()`` too (an LR scheduler, a
``GradScaler``, a stateful data loader: anything with ``state_dict`` and ``load_state_dict``),
every rank's, restored on that rank after the model and the optimizer. Rank 0 writes it (DDP
replicas are identical; the ranks' RNG states and extra states are gathered first):
``step-000000120-g0.pt`` and its manifest ``step-000000120-g0.json`` (format, size, SHA-256,
fingerprint, generation, the optimizers' types, the suspect windows known then). Both are
written to a temporary name, fsynced and renamed; the manifest is written last and is the
commit point, so a killed save leaves no checkpoint that looks whole. A write that fails (no
space, read-only storage) leaves nothing behind and raises ``CheckpointWriteError`` (the file,
the free space) on every rank of the ``save``; what a killed save left is removed by the next.

**What restore verifies** (``verify``), before anything goes into the model: the size and
SHA-256, ``torch.load(weights_only=True)`` (no arbitrary unpickling), the payload's step and
generation against its manifest's, that it fits the model and optimizers given (else
``CheckpointMismatchError``), and the fingerprint of the state it would load. ``restore``
needs no write: it works on read-only storage.

**The suspect window.** Every check knows the newest step it has verified clean (the
weights check: its last passing vote; the replay audit: its last passing audit; the
non-finite check: every step whose flags it has collected). On a detection at step d that
was not repaired in place, the window starts at ``min(d, SDCGuard.clean_through + 1)``: after
the newest step *every* enabled check verified (``SuspectWindows.start_of`` owns the rule).
The manager records the detection and the window in ``windows.json`` in its directory (a
restarted job sees it; lost or damaged, it fails safe: ``windows``) and from then on
refuses to restore any checkpoint of that timeline saved at a step inside the window, and
saves no new checkpoint until the run is restored (its state is suspect). A checkpoint taken
between replay audits is only as clean as the last audit before it. A repaired detection
opens no window, nor does a contained one (it never reached the weights).

**Timelines.** ``restore`` starts a new generation: checkpoints saved after it belong to
the new timeline, which the old windows do not cover.

**Keeping.** The newest ``keep`` checkpoints stay, and, whatever ``keep`` says, so do the
newest one that every enabled check has verified clean and, while a repair in place is inside
its repair window, the newest one before that repair. A corrupt or missing checkpoint is
logged at ERROR with the file and the reason, and the next older one is used; with none
usable, ``restore`` returns 0 (train from scratch) and says so.

The directory must be storage that every rank and every replacement pod can read (a
ReadWriteMany PersistentVolumeClaim in ``deploy/pytorchjob.yaml``), one job's own: an owner
marker with a lease (``owner``) refuses a second job.
"""


from __future__ import annotations

from sdc_guard.checkpoint.dcp import ShardedCheckpointManager
from sdc_guard.checkpoint.files import (
    CheckpointError,
    CheckpointWriteError,
    rng_state,
    set_rng_state,
)
from sdc_guard.checkpoint.manager import FORMAT, CheckpointInfo, CheckpointManager, Verifier
from sdc_guard.checkpoint.owner import LEASE_S, OWNER, CheckpointOwnerError
from sdc_guard.checkpoint.verify import CheckpointMismatchError
from sdc_guard.checkpoint.windows import WINDOWS, SuspectWindows

__all__ = [
    "FORMAT",
    "LEASE_S",
    "OWNER",
    "WINDOWS",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointMismatchError",
    "CheckpointOwnerError",
    "CheckpointWriteError",
    "ShardedCheckpointManager",
    "SuspectWindows",
    "Verifier",
    "rng_state",
    "set_rng_state",
]
