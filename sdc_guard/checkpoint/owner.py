"""One checkpoint directory per job: ``owner.json``, the job's identity and a lease.

Two jobs writing one directory would prune each other's checkpoints and mix their
timelines. The first job to use a directory writes ``owner.json``: its identity and the
time its lease was last renewed (at construction and by every save). Another job is refused
while the lease runs (``LEASE_S`` after the last renewal, unless ``lease_s`` says otherwise),
so a job that was killed leaves no permanent lock: once its lease has expired the directory
is free. The job's identity is, in this order: ``CheckpointManager(job_id=...)``, the
environment variable ``SDC_GUARD_JOB`` (``deploy/pytorchjob.yaml`` sets it to the
PyTorchJob's name on every pod, so restarted pods are the same job), torchrun's
``TORCHELASTIC_RUN_ID`` (unless it is torchrun's placeholder ``none``); without any of them
the job is unnamed, and unnamed jobs cannot tell each other apart.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from sdc_guard.checkpoint.files import CheckpointError, write_atomic

OWNER = "owner.json"
LEASE_S = 3600.0
"""How long a lease lasts after its last renewal (a save), in seconds, by default."""


class CheckpointOwnerError(CheckpointError):
    """The directory belongs to another job whose lease has not expired."""


def job_identity(job_id: str | None) -> str | None:
    """The job's identity: ``job_id``, else ``$SDC_GUARD_JOB``, else torchrun's
    ``$TORCHELASTIC_RUN_ID`` (not its placeholder ``none``); None: unnamed."""
    if job_id is not None:
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"CheckpointManager(job_id=...): a non-empty str naming the job "
                             f"(the same on every rank and every restart), got {job_id!r}.")
        return job_id
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return os.environ.get("SDC_GUARD_JOB") or (run_id if run_id not in (None, "", "none")
                                               else None)


class OwnerMarker:
    """``directory / owner.json``: which job holds the directory, and until when."""

    def __init__(self, directory: Path, job: str | None, lease_s: float) -> None:
        self.path = directory / OWNER
        self.job = job
        self.lease_s = lease_s

    def read(self) -> dict[str, Any] | None:
        """The marker, or None when there is none (or it is unreadable: it then protects
        nothing, and the next renewal replaces it)."""
        try:
            rec = json.loads(self.path.read_text())
            float(rec["renewed_at"]), float(rec["lease_s"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return rec if isinstance(rec, dict) else None

    def check(self, now: float | None = None) -> None:
        """Raise ``CheckpointOwnerError`` if another job holds an unexpired lease."""
        rec = self.read()
        if rec is None or rec.get("job") == self.job:
            return
        now = time.time() if now is None else now
        expires = float(rec["renewed_at"]) + float(rec["lease_s"])
        if now >= expires:
            return
        theirs = "an unnamed job" if rec.get("job") is None else f"job {rec['job']!r}"
        mine = "an unnamed job" if self.job is None else f"job {self.job!r}"
        raise CheckpointOwnerError(
            f"checkpoint directory {self.path.parent} belongs to {theirs} (from "
            f"{rec.get('host', '?')}, lease renewed by its last save, expiring in "
            f"{expires - now:.0f} s); this is {mine}. Give each job a directory of its own; "
            f"if it is the same job, give it the same identity (job_id=, or $SDC_GUARD_JOB); "
            f"if that job is gone, wait for its lease to expire or remove {self.path}.")

    def renew(self) -> None:
        """Write the marker: this job holds the directory from now for ``lease_s``
        (``CheckpointWriteError`` if it cannot be written)."""
        write_atomic(self.path, json.dumps({
            "job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
            "renewed_at": time.time(), "lease_s": self.lease_s}, indent=1).encode())
