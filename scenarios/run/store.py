"""On-disk state of a campaign: the append-only trial table and the golden-run cache.

``trials.csv`` gets one complete line per finished trial, written with a single
``os.write`` on an ``O_APPEND`` descriptor and ``fsync``-ed before the next trial
starts; the header is written only when the file is created. A campaign killed
at any moment therefore leaves every finished trial on disk and at most one torn
last line, which ``TrialTable`` cuts off when it opens the file. Resuming
skips the ids already present: nothing is lost or counted twice.

Golden runs are cached as ``<cache>/<key>.json`` (per-step fingerprints, losses)
and ``<cache>/<key>.pt`` (final parameters), keyed by
``Scenario.training_key()``, a hash of everything that determines the fault-free
trajectory (plus the torch and sdc_guard versions).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

COLUMNS = (
    "id", "scenario", "kind", "site", "field", "fault_model", "fault_rank", "fault_step",
    "target", "state_key", "replay_interval", "outcome", "check", "checks", "detect_step",
    "suspects", "blame_correct", "contained", "same_step", "skipped", "injections",
    "first_injection", "injected_ranks", "nonfinite_injected", "first_divergence", "latency_from_injection",
    "latency_from_divergence", "rel_weight_dev", "loss_diff", "steps_run", "seconds", "error",
    "fault", "repaired", "cordoned_nodes", "cordon_correct", "breaker_tripped", "fault_to_cordon_s",
    "quarantine_errors", "rollback_step", "wasted_steps", "fault_to_resume_s",
    "final_matches_golden", "checksum", "product", "bits", "injected_value",
    "injected_dtype", "parallel", "saves_refused", "pattern", "deterministic", "transient",
)
"""The columns of ``trials.csv``, in order (see reports/README.md for each one's meaning)."""


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, separators=(",", ":"), sort_keys=True)
    if isinstance(v, float):
        return repr(v)
    return str(v)


class TrialTable:
    """``trials.csv``: read what is there (repairing a torn last line), append rows durably."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()

    def check_header(self) -> None:
        """Refuse to append to a table written with other columns (another version)."""
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open() as fh:
                header = next(csv.reader(fh), None)
            if header is not None and tuple(header) != COLUMNS:
                from scenarios.spec.errors import ScenarioError

                raise ScenarioError("--out", str(self.path.parent),
                                    "a new output directory", reason="its trials.csv has "
                                    "other columns (written by another version)")

    def _repair(self) -> None:
        """Cut a torn last line (a write interrupted by a kill) so appends start cleanly."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with self.path.open("r+b") as fh:
                fh.truncate(keep)
                fh.flush()
                os.fsync(fh.fileno())

    def rows(self) -> list[dict[str, str]]:
        """Every complete row (a row with the wrong number of cells is skipped)."""
        if not self.path.exists():
            return []
        text = self.path.read_text()
        if not text.strip():
            return []
        reader = csv.reader(io.StringIO(text))
        header = next(reader, None)
        if header is None:
            return []
        return [dict(zip(header, r, strict=True)) for r in reader if len(r) == len(header)]

    def done_ids(self) -> set[str]:
        return {r["id"] for r in self.rows()}

    def append(self, row: dict[str, Any]) -> None:
        """Write one complete line (plus the header if the file is new) and fsync it."""
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown trial column(s) {sorted(unknown)}")
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        new = not self.path.exists() or self.path.stat().st_size == 0
        if new:
            w.writerow(COLUMNS)
        w.writerow([_cell(row.get(c)) for c in COLUMNS])
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, buf.getvalue().encode())
            os.fsync(fd)
        finally:
            os.close(fd)


# -- golden runs --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GoldenRun:
    """The fault-free reference of one scenario."""

    key: str
    scenario: str
    initial_fp: int
    """State fingerprint (parameters + optimizer state) before step 0."""
    state_fps: list[int]
    """State fingerprint after each step (rank 0; every rank agreed)."""
    weight_fps: list[int]
    """Fingerprint of the parameters alone after each step (``sdc_guard.fingerprint``)."""
    losses: list[list[float]]
    """``losses[rank][step]``: each rank's own training loss."""
    detections: list[Any]
    """Detections in the golden run itself (should be none: each would be a false positive)."""
    ranks_agree: bool
    """Whether every rank's per-step state fingerprints were identical."""
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def golden_paths(cache: Path, key: str) -> tuple[Path, Path]:
    return cache / f"{key}.json", cache / f"{key}.pt"


def load_golden(cache: Path, key: str) -> GoldenRun | None:
    js, pt = golden_paths(cache, key)
    if not (js.exists() and pt.exists()):
        return None
    try:
        return GoldenRun(**json.loads(js.read_text()))
    except (json.JSONDecodeError, TypeError):
        return None


def save_golden(cache: Path, golden: GoldenRun) -> None:
    js, _ = golden_paths(cache, golden.key)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = js.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(golden.to_json()) + "\n")
    os.replace(tmp, js)


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temporary file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
