"""``CheckpointManager``: save, verify and restore checkpoints; refuse those inside a suspect window.

It knows models, optimizers and ``state_dict`` objects, never the guard: what it needs of
one comes through the small ``Verifier`` protocol, asked on the caller's thread. The
package's doc (``sdc_guard.checkpoint``) describes the files and the rules.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from sdc_guard.checkpoint.extra import extra_held, extra_states, load_extra
from sdc_guard.checkpoint.files import (
    TMP,
    CheckpointError,
    CheckpointWriteError,
    rng_state,
    set_rng_state,
    write_atomic,
)
from sdc_guard.checkpoint.owner import LEASE_S, OwnerMarker, job_identity
from sdc_guard.checkpoint.verify import check_payload, module_of, optimizer_types
from sdc_guard.checkpoint.windows import SuspectWindows
from sdc_guard.collectives import gather_objects
from sdc_guard.config import GuardConfig
from sdc_guard.fingerprints import fingerprint
from sdc_guard.fingerprints.words import FINGERPRINT_VERSION, check_version
from sdc_guard.optimizers import Optimizers, as_optimizers, load_state_dict, state_dict
from sdc_guard.state import state_tensors

if TYPE_CHECKING:
    from sdc_guard.report import Detection

log = logging.getLogger("sdc_guard.checkpoint")
"""The package's logger, one name for every module in it (a harness filters its records)."""

FORMAT = 3
"""The schema of a checkpoint's payload and manifest. 2 adds the optimizers' types (payload
and manifest) and the suspect windows known at the save (manifest); 3 the fingerprint's
version (manifest: ``fingerprint_version``; 1 and 2 were fingerprinted with version 1, and are
verified with it). 1 and 2 are still read."""

READS = (1, 2, 3)
"""The formats ``restore`` reads."""

_REPAIR_DEFAULT: Any = GuardConfig.__dataclass_fields__["repair_window_steps"].default
REPAIR_WINDOW_STEPS = int(_REPAIR_DEFAULT)
"""The repair window ``record_detection`` assumes when it is not given one (the guard's
default ``GuardConfig.repair_window_steps``)."""


def recorded_version(rec: Mapping[str, Any]) -> int:
    """The fingerprint version a manifest records (1 where it records none: format 1 and 2);
    a ValueError for one this release does not compute."""
    return check_version(rec.get("fingerprint_version", 1), "the manifest")


class Verifier(Protocol):
    """What a manager needs of whatever verifies the run (``SDCGuard(checkpoints=...)``
    hands itself through ``bind``). Asked only on the thread that calls ``save`` or
    ``restore``, never from a background write."""

    group: dist.ProcessGroup | None
    """The replica set the verifier's collectives span: the manager's must be the same."""

    def verified(self) -> tuple[int | None, dict[str, int]]:
        """The newest step every enabled check has verified clean (-1: none yet; None: no
        check is enabled), and each check's own."""
        ...

    def rewind(self, step: int) -> None:
        """The run was restored to the state after ``step``, a checkpoint verified clean."""
        ...


def verifier_state(verifier: Verifier | None) -> dict[str, Any] | None:
    """What ``verifier`` keeps in a checkpoint beside the steps (its optional
    ``saved_state()``: an ``SDCGuard``'s checks' calibrations), or None."""
    saved = getattr(verifier, "saved_state", None)
    return saved() if callable(saved) else None


def restore_verifier(verifier: Verifier | None, guard: Mapping[str, Any] | None,
                     step: int) -> None:
    """Hand ``verifier`` what it kept in the checkpoint (``load_saved_state``, when it has
    one and the checkpoint holds any), then rewind it to ``step``."""
    if verifier is None:
        return
    state = (guard or {}).get("state")
    load = getattr(verifier, "load_saved_state", None)
    if state and callable(load):
        load(state)
    verifier.rewind(step)


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """One checkpoint's manifest."""

    step: int
    generation: int
    file: Path
    manifest: Path
    size: int
    sha256: str
    fingerprint: str
    clean_through: int | None
    saved_at: float
    windows: dict[str, Any] | None = None
    """The suspect windows and repairs known when it was saved (format 2 on; None before)."""
    fingerprint_version: int = 1
    """The version ``fingerprint`` was computed in (format 3 on; 1 before), and is verified in."""


class CheckpointManager:
    """Save, verify and restore checkpoints; refuse those inside a suspect window."""

    FROM_SCRATCH = "restore_from_scratch"
    """``record.sdc_event`` of the ERROR record ``restore`` logs when no checkpoint is usable
    (a harness that records the rollback itself may filter that record out)."""

    def __init__(self, directory: str | Path, keep: int = 3, *,
                 group: dist.ProcessGroup | None = None, job_id: str | None = None,
                 lease_s: float = LEASE_S) -> None:
        """``job_id``: this job's identity in the directory's owner marker (default
        ``$SDC_GUARD_JOB``, else torchrun's ``$TORCHELASTIC_RUN_ID``); ``lease_s``: how long
        the marker holds the directory after the last save (``sdc_guard.checkpoint.owner``).
        Raises ``CheckpointOwnerError`` when another job's lease on it runs."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"CheckpointManager(keep=...) must be an int >= 1, got {keep!r}.")
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not (
                lease_s > 0):
            raise ValueError(f"CheckpointManager(lease_s=...) must be seconds > 0 (how long "
                             f"the directory stays this job's after its last save), got "
                             f"{lease_s!r}.")
        self.directory = Path(directory)
        self.keep = keep
        self.group = group
        self.verifier: Verifier | None = None
        """Says which steps are verified clean, and is told of a restore (``bind``)."""
        self.windows = SuspectWindows(self.directory)
        """The suspect windows recorded beside the checkpoints (``windows.json``)."""
        self.owner = OwnerMarker(self.directory, job_identity(job_id), float(lease_s))
        """The directory's owner marker (``owner.json``): one job per directory."""
        self._writer: threading.Thread | None = None
        self._write_error: tuple[Path, BaseException] | None = None
        self.directory.mkdir(parents=True, exist_ok=True)
        self.owner.check()
        if self._rank() == 0:
            try:
                self.owner.renew()
            except CheckpointWriteError as e:  # read-only storage: restore still works
                log.warning("sdc-guard: the owner marker cannot be written (%s); saving "
                            "will fail until it can", e)
        why = self.windows.reconcile([(c.generation, c.step, c.clean_through, c.windows)
                                      for c in self.checkpoints() if c.windows is not None])
        if why is not None:
            log.error("sdc-guard: the suspect windows are not known: %s. Failing safe: the "
                      "windows the newest checkpoint carries hold, and in each timeline no "
                      "checkpoint newer than the newest one the manifests vouch for (verified "
                      "clean by every check, before any repair) is restored", why)

    # -- the verifier's side ---------------------------------------------------------------
    def bind(self, verifier: Verifier | None) -> None:
        """Ask ``verifier`` which steps are verified clean at each ``save``, and tell it of
        each ``restore`` (``SDCGuard(..., checkpoints=self)`` binds the guard; None unbinds).
        Its group must be the manager's: the collectives and the writer (the group's rank 0)
        are that replica set's."""
        if verifier is not None and not (hasattr(verifier, "group")
                                         and callable(getattr(verifier, "verified", None))
                                         and callable(getattr(verifier, "rewind", None))):
            raise TypeError(
                f"CheckpointManager.bind(verifier): a {type(verifier).__name__} is not a "
                "Verifier: it needs a group attribute and the methods verified() -> "
                "(step or None, {check: step}) and rewind(step) (an SDCGuard is one; "
                "SDCGuard(..., checkpoints=manager) binds it), or None to unbind.")
        if verifier is not None and self.group is not verifier.group:
            raise ValueError(
                "SDCGuard(checkpoints=...): the CheckpointManager's group is not the guard's "
                "process_group, so its collectives and its writer would span other ranks. "
                "Build it with the same group, CheckpointManager(directory, "
                "group=process_group), and a directory of that replica set's own.")
        self.verifier = verifier

    def record_detection(self, d: Detection, *, verified_through: int | None,
                         repair_window_steps: int | None = None) -> None:
        """Every detection at ``d.step``, when every enabled check had verified the run clean
        through ``verified_through`` (None: no check keeps such a step). One not repaired nor
        contained opens its suspect window (``SuspectWindows.start_of``). One repaired in place
        is recorded as a repair of its suspect ranks: while the newest save is within
        ``repair_window_steps`` (default ``GuardConfig.repair_window_steps``'s) of it, the
        newest checkpoint before it is kept whatever ``keep`` says. A contained one (the
        corrupt value never reached the weights) changes nothing. Every rank calls it, and
        rank 0 writes ``windows.json``; a write that fails is logged at ERROR and never
        raised (the change holds in memory and the next write of the file carries it): no
        rank waits for another here."""
        if verified_through is not None and (isinstance(verified_through, bool)
                                             or not isinstance(verified_through, int)):
            raise ValueError(f"CheckpointManager.record_detection(verified_through=...): an int "
                             f"step or None, got {verified_through!r}.")
        if repair_window_steps is not None and (
                isinstance(repair_window_steps, bool) or not isinstance(repair_window_steps, int)
                or repair_window_steps < 1):
            raise ValueError(f"CheckpointManager.record_detection(repair_window_steps=...): an "
                             f"int >= 1 (GuardConfig.repair_window_steps) or None, got "
                             f"{repair_window_steps!r}.")
        writer = self._rank() == 0
        try:
            if d.repaired:
                window = REPAIR_WINDOW_STEPS if repair_window_steps is None else (
                    repair_window_steps)
                log.info("sdc-guard: %s repair at step %d of ranks %s: the newest checkpoint "
                         "before it is kept while saves are within %d steps of it", d.check,
                         d.step, list(d.suspect_ranks), window)
                self.windows.record_repair(d, d.step + window, writer=writer)
            elif getattr(d, "contained", False):
                log.info("sdc-guard: %s detection at step %d was contained (it never reached "
                         "the weights): no suspect window", d.check, d.step)
            else:
                start = SuspectWindows.start_of(d, verified_through)
                log.warning("sdc-guard: suspect window from step %d (%s detection at step %d): "
                            "checkpoints from step %d of generation %d on will not be "
                            "restored", start, d.check, d.step, start, self.windows.generation)
                self.windows.record(d, start, writer=writer)
        except CheckpointWriteError as e:
            log.error("sdc-guard: the %s detection at step %d is recorded in memory only: %s. "
                      "The next restore or save writes it; a restart before then loses it "
                      "(the manifests carry the windows of every save)", d.check, d.step, e)

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: Optimizers, *,
             extra: Mapping[str, Any] | None = None,
             background: bool = False,
             verified_through: int | None = None) -> CheckpointInfo | None:
        """Checkpoint the state after ``step``. Collective (the ranks' RNG states and
        ``extra`` states are gathered, and the writer's outcome shared); rank 0 writes.
        ``extra``: named objects with ``state_dict`` and ``load_state_dict`` (an LR
        scheduler, a ``GradScaler``) saved with it, every rank's. ``background``: the state
        is serialized now, and the files are written, fsynced and committed on a thread while
        training goes on (``wait``; the next ``save`` and ``restore`` wait for it). Returns
        the manifest on rank 0 (with ``background``, the one about to be committed), None
        elsewhere and when refused (an open suspect window: the state is suspect until a
        restore). ``optimizer``: one, or a list of several (each one's ``state_dict``, in that
        order). ``verified_through``: for a manager used without a guard, the newest step
        your own verification found clean (the newest checkpoint at or before it is kept
        whatever ``keep`` says); with a guard bound, the guard says it.

        A write that fails (no space, read-only storage: ``CheckpointWriteError``, naming the
        file and the free space) or a directory another job holds (``CheckpointOwnerError``)
        raises the same error on every rank, here for a synchronous save, at the next
        ``save`` for a background one, and leaves no file of it behind."""
        self._refuse_save_arguments(step, verified_through)
        if not isinstance(background, bool):
            raise ValueError(f"CheckpointManager.save(background=...): a bool, got "
                             f"{background!r}.")
        failed = self._take_write_error()  # one write at a time; the last one's outcome
        local_extra = extra_states(extra, "save")
        device = next(model.parameters()).device
        gathered = gather_objects((rng_state(device), local_extra, failed), self.group,
                                  device=device)
        if gathered[0][2] is not None:  # the writer's background write failed: every rank
            raise gathered[0][2]
        rngs = [g[0] for g in gathered]
        opened = self.windows.opened()
        generation = self.windows.generation
        if self.verifier is not None:  # read here, on the caller's thread, never by the writer
            through, per_check = self.verifier.verified()
        else:
            through, per_check = verified_through, {}
        if opened:
            log.warning("sdc-guard: not saving step %d: a suspect window is open since step %d "
                        "(restore a checkpoint first)", step, opened[0]["start"])
            return None
        for opt in as_optimizers(optimizer, "CheckpointManager.save(optimizer)"):
            consolidate = getattr(opt, "consolidate_state_dict", None)
            if callable(consolidate):  # ZeroRedundancyOptimizer: each rank holds a shard
                consolidate(to=self._writer_in(getattr(opt, "process_group", None)))
        info: CheckpointInfo | None = None
        outcome: BaseException | None = None
        if self._rank() == 0:
            try:
                info = self._write(step, generation, model, optimizer, rngs,
                                   [g[1] for g in gathered], through, per_check, background)
            except Exception as e:  # every rank raises it (below), this one the original
                outcome = e
        if self._world() > 1:
            shared = outcome if isinstance(outcome, CheckpointError) or outcome is None else (
                CheckpointError(f"the writer (rank 0) failed to save the checkpoint of step "
                                f"{step}: {type(outcome).__name__}: {outcome}"))
            told = gather_objects(shared if self._rank() == 0 else None, self.group,
                                  device=device)[0]
            if outcome is None and told is not None:
                raise told
        if outcome is not None:
            raise outcome
        return info

    def _write(self, step: int, generation: int, model: torch.nn.Module,
               optimizer: Optimizers, rngs: list[Any], extras: list[Any], through: int | None,
               per_check: dict[str, int], background: bool) -> CheckpointInfo:
        """The writer's part of ``save``: the owner marker checked and renewed and the
        windows written (on this thread), then the data and the manifest (on a thread of
        its own with ``background``), then the prune."""
        self.owner.check()
        self.owner.renew()
        self.windows.flush(writer=True)  # before any manifest that carries its revision
        payload = {
            "format": FORMAT, "step": step, "generation": generation,
            "model": module_of(model).state_dict(), "optimizer": state_dict(optimizer),
            "optimizers": optimizer_types(optimizer),
            "rng": rngs, "world_size": self._world(), "extra": extras,
            "guard": None if self.verifier is None and through is None else {
                "clean_through": through, "checks": per_check,
                "state": verifier_state(self.verifier)},
        }
        fp = f"{fingerprint(state_tensors(module_of(model), optimizer, every=True)):016x}"
        version = FINGERPRINT_VERSION
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        name = f"step-{step:09d}-g{generation}"
        file = self.directory / f"{name}.pt"
        manifest = self.directory / f"{name}.json"
        windows = self.windows.snapshot()
        info = CheckpointInfo(step=step, generation=generation, file=file,
                              manifest=manifest, size=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), fingerprint=fp,
                              clean_through=through, saved_at=time.time(), windows=windows,
                              fingerprint_version=version)
        record = json.dumps({
            "format": FORMAT, "step": step, "generation": info.generation, "file": file.name,
            "size": info.size, "sha256": info.sha256, "fingerprint": fp,
            "fingerprint_version": version,
            "clean_through": info.clean_through, "saved_at": info.saved_at,
            "optimizers": payload["optimizers"], "job": self.owner.job,
            "windows": windows}, indent=1).encode()
        repairs = self.windows.repairs_before(step)

        def commit() -> None:  # the data, then the manifest: the commit point
            write_atomic(file, data)
            try:
                write_atomic(manifest, record)
            except BaseException:  # no data file without its manifest
                _unlink(file)
                raise
            self._prune(through, generation, repairs)

        if not background:
            commit()
            return info

        def write() -> None:
            try:
                commit()
            except BaseException as e:  # raised by wait() and the next save, for this thread
                log.error("sdc-guard: the background write of checkpoint %s failed: %s",
                          file, e)
                self._write_error = (file, e)

        # Not a daemon: an interpreter that exits waits for the write to be committed.
        self._writer = threading.Thread(target=write, name=f"sdc-guard-checkpoint-{step}")
        self._writer.start()
        return info

    def _refuse_save_arguments(self, step: int, verified_through: int | None) -> None:
        """``save``'s ``step`` and ``verified_through``, checked (the errors name this class)."""
        who = type(self).__name__
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{who}.save(step): an int >= 0, got {step!r}.")
        if verified_through is not None and (isinstance(verified_through, bool) or not
                                             isinstance(verified_through, int)):
            raise ValueError(f"{who}.save(verified_through=...): an int step or None, got "
                             f"{verified_through!r}.")
        if verified_through is not None and self.verifier is not None:
            raise ValueError(
                f"{who}.save(verified_through=...): this manager is bound to a guard "
                "(SDCGuard(checkpoints=...)), whose checks say which steps are verified; "
                "leave verified_through out, or use a manager of its own without the guard.")

    def _take_write_error(self) -> CheckpointError | None:
        """Wait for a background write; the error it failed with (None: none, or not the
        writer), as every rank of the next ``save`` raises it."""
        try:
            self.wait()
        except CheckpointError as e:
            cause = e.__cause__
            return cause if isinstance(cause, CheckpointError) else e
        return None

    def wait(self) -> None:
        """Wait for a background write (``save(background=True)``) to be committed; raise
        ``CheckpointError`` if it failed. A no-op on the ranks that do not write."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        failed, self._write_error = self._write_error, None
        if failed is not None:
            raise CheckpointError(f"the background write of checkpoint {failed[0]} failed: "
                                  f"{failed[1]}") from failed[1]

    # -- restoring -------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every committed checkpoint (those with a manifest), newest first. A manifest that
        is unreadable, or names a data file other than its own, is logged and left out."""
        out = []
        for m in self.directory.glob("step-*.json"):
            try:
                rec = json.loads(m.read_text())
                if rec.get("kind") == "dcp":
                    raise ValueError("it is a sharded (DCP) checkpoint's; read it with "
                                     "sdc_guard.checkpoint.ShardedCheckpointManager")
                if rec["file"] != f"{m.stem}.pt":
                    raise ValueError(f"it names the data file {rec['file']!r}, not its own "
                                     f"{m.stem}.pt")
                windows = rec.get("windows")
                out.append(CheckpointInfo(
                    step=int(rec["step"]), generation=int(rec["generation"]),
                    file=m.with_name(f"{m.stem}.pt"), manifest=m, size=int(rec["size"]),
                    sha256=str(rec["sha256"]), fingerprint=str(rec["fingerprint"]),
                    clean_through=rec.get("clean_through"), saved_at=float(rec["saved_at"]),
                    windows=windows if isinstance(windows, dict) else None,
                    fingerprint_version=recorded_version(rec)))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("sdc-guard: checkpoint manifest %s is unreadable (%s); skipped", m, e)
        return sorted(out, key=lambda c: (c.generation, c.step), reverse=True)

    def refused(self, info: CheckpointInfo) -> dict[str, Any] | None:
        """The suspect window that forbids ``info``, or None."""
        return self.windows.refusing(info.generation, info.step)

    def restore(self, model: torch.nn.Module, optimizer: Optimizers, *,
                extra: Mapping[str, Any] | None = None) -> int:
        """Load the newest usable checkpoint before every suspect window; the step to train
        next. 0: none is usable, and the model and optimizer (and ``extra``) are left as they
        are: start from scratch (re-initialise them, or save a checkpoint of the initial
        state first). ``extra``: the objects ``save`` was given, by the same names; each
        loads this rank's saved state after the model and the optimizer. Collective; every
        rank reads the files. ``optimizer``: what ``save`` was given (several: a list, in the
        same order).

        Nothing of a checkpoint is loaded before it has passed every check
        (``sdc_guard.checkpoint.verify``): a damaged one is logged and the next older one
        tried; one of another model, optimizer type or dtype raises
        ``CheckpointMismatchError`` (a ``ValueError``). It writes nothing it needs: on
        read-only or full storage it restores what is there and logs that the new timeline
        is not yet written."""
        extra_states(extra, "restore")
        as_optimizers(optimizer, "CheckpointManager.restore(optimizer)")
        try:  # a checkpoint still being written is committed first
            self.wait()
        except CheckpointError as e:  # restore what is there: the next older one
            log.error("sdc-guard: %s", e)
        if self._world() > 1:  # and rank 0's last save is committed before any rank looks
            dist.barrier(group=self.group)
        device = next(model.parameters()).device
        chosen = None
        for info in self.checkpoints():
            w = self.refused(info)
            if w is not None:
                log.warning("sdc-guard: not restoring %s: saved at step %d, inside the suspect "
                            "window from step %d (%s)", info.file, info.step, w["start"],
                            _why(w))
                continue
            try:
                payload = self._load(info)
                extra_held(info, payload, extra)
                check_payload(info, payload, module_of(model), optimizer)
            except CheckpointError as e:
                log.error("sdc-guard: %s; trying the next older checkpoint", e)
                continue
            chosen = (info, payload)
            break
        if self._world() > 1:  # every rank must resume from the same checkpoint
            picks = gather_objects(None if chosen is None else chosen[0].manifest.name,
                                   self.group, device=device)
            if len(set(picks)) != 1:
                raise CheckpointError(f"ranks chose different checkpoints to restore: {picks}; "
                                      "is the directory shared storage every rank reads?")
        try:
            self.windows.new_timeline(writer=self._rank() == 0)
        except CheckpointWriteError as e:  # restore needs no write: the next save writes it
            log.error("sdc-guard: restoring without recording the new timeline (%s); it holds "
                      "in memory and the next save writes it first", e)
        if chosen is None:
            if self._rank() == 0:  # every rank made the same choice (checked above)
                log.error("sdc-guard: no usable checkpoint in %s: training starts from scratch "
                          "(step 0)", self.directory, extra={"sdc_event": self.FROM_SCRATCH})
            return 0
        info, payload = chosen
        # Every check passed: the optimizers first (several are all checked before any
        # loads), then the model.
        load_state_dict(optimizer, payload["optimizer"], "CheckpointManager.restore(optimizer)")
        module_of(model).load_state_dict(payload["model"])
        rngs = payload["rng"]
        rank = self._rank()
        if len(rngs) == self._world():
            set_rng_state(rngs[rank], device)
        else:
            log.warning("sdc-guard: %s was saved by %d ranks, this job has %d; RNG states not "
                        "restored", info.file, len(rngs), self._world())
        load_extra(info, payload, extra, rank=rank, world=self._world())
        restore_verifier(self.verifier, payload.get("guard"), info.step)
        if self._rank() == 0:
            log.warning("sdc-guard: restored %s (step %d); training resumes at step %d",
                        info.file, info.step, info.step + 1)
        return info.step + 1

    def _load(self, info: CheckpointInfo) -> dict[str, Any]:
        try:
            data = info.file.read_bytes()
        except OSError as e:
            raise CheckpointError(f"checkpoint {info.file} cannot be read: {e}") from e
        if len(data) != info.size:
            raise CheckpointError(f"checkpoint {info.file} is {len(data)} bytes, its manifest "
                                  f"says {info.size}: truncated or replaced")
        digest = hashlib.sha256(data).hexdigest()
        if digest != info.sha256:
            raise CheckpointError(f"checkpoint {info.file}: SHA-256 {digest[:16]}... is not "
                                  f"the recorded {info.sha256[:16]}...: the file is corrupt")
        try:
            payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # an unpickling refusal or a damaged archive
            raise CheckpointError(f"checkpoint {info.file} does not load with "
                                  f"weights_only=True: {e}") from e
        if not isinstance(payload, dict) or payload.get("format") not in READS:
            raise CheckpointError(f"checkpoint {info.file} is not an sdc-guard checkpoint of "
                                  f"a format this version reads {READS}")
        return payload

    # -- bookkeeping -----------------------------------------------------------------------
    def _prune(self, clean_through: int | None, generation: int,
               repairs: list[int]) -> None:
        """Keep the newest ``keep`` of the checkpoints a restore could use, and the newest
        ``keep`` of those a suspect window refuses (kept for a person to look at, never
        counted against the usable ones: a run whose windows refuse its newest saves still
        has ``keep`` to go back to); the newest checkpoint of ``generation`` verified clean
        by every check (through ``clean_through``, as ``save`` read it); and the newest
        checkpoint before each repair in ``repairs`` (still inside its repair window). Then
        remove what a failed or killed save left: data files without a manifest and
        temporary files of checkpoints (each logged)."""
        infos = self.checkpoints()
        usable = [c for c in infos if self.refused(c) is None]
        refused = [c for c in infos if self.refused(c) is not None]
        clean = next((c for c in usable if c.generation == generation
                      and clean_through is not None and c.step <= clean_through), None)
        protected = {id(c) for c in [clean] + [next((c for c in usable if c.step < r), None)
                                               for r in repairs] if c is not None}
        for c in usable[self.keep:] + refused[self.keep:]:
            if id(c) not in protected:
                self._remove(c)
        self._sweep()

    def _remove(self, c: CheckpointInfo) -> None:
        """Delete checkpoint ``c``: the manifest first, never a manifest without data."""
        for p in (c.manifest, c.file):
            _unlink(p)

    def _sweep(self) -> None:
        """Remove what a failed or killed save left (each logged)."""
        for p in self.directory.glob("step-*.pt"):
            if p.is_file() and not p.with_suffix(".json").exists():
                log.warning("sdc-guard: removing %s: a checkpoint's data without its manifest "
                            "(a save that failed or was killed before its commit)", p)
                _unlink(p)
        for p in self.directory.glob(f".step-*{TMP}*"):
            log.warning("sdc-guard: removing %s: the temporary file of a save that was killed",
                        p)
            _unlink(p)
        for p in self.directory.glob(f".owner.json{TMP}*"):  # a marker write killed midway
            if p.name != f".owner.json{TMP}{os.getpid()}":
                log.warning("sdc-guard: removing %s: the temporary file of an owner marker "
                            "write that was killed", p)
                _unlink(p)

    def _writer_in(self, group: dist.ProcessGroup | None) -> int:
        """The writer's (this manager's rank 0's) rank in ``group`` (None: the default
        group), where a sharded optimizer gathers its state before the writer saves it."""
        if not dist.is_initialized():
            return 0
        writer = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        if group is None or group is dist.group.WORLD:
            return writer
        return dist.get_group_rank(group, writer)

    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1


def _unlink(path: Path) -> None:
    """Remove ``path`` if it is there; a failure (read-only storage) is logged, not raised."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("sdc-guard: cannot remove %s: %s", path, e)


def _why(w: Mapping[str, Any]) -> str:
    """What opened window ``w``, in words."""
    if w.get("reason"):
        return f"the windows are not known: {w['reason']}"
    return f"{w['check']} detection at step {w['step']}"
