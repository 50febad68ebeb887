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
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from sdc_guard.checkpoint.files import CheckpointError, rng_state, set_rng_state, write_atomic
from sdc_guard.checkpoint.windows import SuspectWindows
from sdc_guard.collectives import gather_objects
from sdc_guard.fingerprints import fingerprint
from sdc_guard.optimizers import Optimizers, as_optimizers, load_state_dict, state_dict
from sdc_guard.state import state_tensors

if TYPE_CHECKING:
    from sdc_guard.report import Detection

log = logging.getLogger("sdc_guard.checkpoint")
"""The package's logger, one name for every module in it (a harness filters its records)."""

FORMAT = 1


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


def _extra_states(extra: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """``extra``'s objects checked (a name, ``state_dict`` and ``load_state_dict``); on
    ``save`` (``where``), their states, each checked to load with ``weights_only=True``."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"CheckpointManager.{where}(extra=...) must map names to objects "
                         f"with state_dict() and load_state_dict(), got {type(extra).__name__}")
    out: dict[str, Any] = {}
    for name, obj in extra.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"CheckpointManager.{where}(extra=...): the key {name!r} must be "
                             "a non-empty str (the name the state is saved under)")
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise ValueError(
                f"CheckpointManager.{where}(extra={{{name!r}: ...}}): a "
                f"{type(obj).__name__} has no state_dict() and load_state_dict(); pass the "
                "object that owns the state (the LR scheduler, the GradScaler, the loader)")
        if where != "save":
            continue
        state = obj.state_dict()
        buf = io.BytesIO()
        try:
            torch.save(state, buf)
            buf.seek(0)
            torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as e:  # a state that restore could not load safely
            raise ValueError(
                f"CheckpointManager.save(extra={{{name!r}: ...}}): the state_dict() of this "
                f"{type(obj).__name__} does not load with torch.load(weights_only=True), as "
                f"restore loads it ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                "make it hold tensors and plain Python values only") from e
        out[name] = state
    return out


def _module(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _refuse_other_model(file: Path, module: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    """Refuse, before anything loads, a checkpoint of another model: names it holds that the
    model has not, or the other way round, or parameters of other shapes. ``load_state_dict``
    would raise after loading what does fit (and the optimizer before it), leaving the run
    half restored; an older checkpoint of the same directory would not fit either. Buffers
    of other shapes are their modules' business: a quantisation observer's ranges start
    empty and its own loader resizes them."""
    mine = module.state_dict()
    params = dict(module.named_parameters())
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k in saved if k not in mine]
    shapes = [f"{k} {tuple(saved[k].shape)} saved, {tuple(v.shape)} in the model"
              for k, v in params.items() if isinstance(saved.get(k), torch.Tensor)
              and saved[k].shape != v.shape]
    if not (missing or unexpected or shapes):
        return
    parts = [f"{label}: {items[:4]}{' ...' if len(items) > 4 else ''}"
             for label, items in (("not in the checkpoint", missing),
                                  ("not in the model", unexpected), ("other shapes", shapes))
             if items]
    raise ValueError(
        f"CheckpointManager.restore: checkpoint {file} holds another model than the one given "
        f"({'; '.join(parts)}). Nothing was loaded. Restore into the model it was saved from "
        "(the same architecture and sizes), or give a new model a directory of its own.")


class CheckpointManager:
    """Save, verify and restore checkpoints; refuse those inside a suspect window."""

    FROM_SCRATCH = "restore_from_scratch"
    """``record.sdc_event`` of the ERROR record ``restore`` logs when no checkpoint is usable
    (a harness that records the rollback itself may filter that record out)."""

    def __init__(self, directory: str | Path, keep: int = 3, *,
                 group: dist.ProcessGroup | None = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"CheckpointManager(keep=...) must be an int >= 1, got {keep!r}.")
        self.directory = Path(directory)
        self.keep = keep
        self.group = group
        self.verifier: Verifier | None = None
        """Says which steps are verified clean, and is told of a restore (``bind``)."""
        self.windows = SuspectWindows(self.directory)
        """The suspect windows recorded beside the checkpoints (``windows.json``)."""
        self._writer: threading.Thread | None = None
        self._write_error: tuple[Path, BaseException] | None = None
        self.directory.mkdir(parents=True, exist_ok=True)

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

    def record_detection(self, d: Detection, *, verified_through: int | None) -> None:
        """A detection at ``d.step`` that was not repaired, when every enabled check had
        verified the run clean through ``verified_through`` (None: no check keeps such a
        step): its suspect window opens (``SuspectWindows.start_of``). Rank 0 writes it to
        ``windows.json``; every rank calls it."""
        if verified_through is not None and (isinstance(verified_through, bool)
                                             or not isinstance(verified_through, int)):
            raise ValueError(f"CheckpointManager.record_detection(verified_through=...): an int "
                             f"step or None, got {verified_through!r}.")
        start = SuspectWindows.start_of(d, verified_through)
        log.warning("sdc-guard: suspect window from step %d (%s detection at step %d): "
                    "checkpoints from step %d of generation %d on will not be restored",
                    start, d.check, d.step, start, self.windows.generation)
        self.windows.record(d, start, writer=self._rank() == 0)

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, model: torch.nn.Module, optimizer: Optimizers, *,
             extra: Mapping[str, Any] | None = None,
             background: bool = False,
             verified_through: int | None = None) -> CheckpointInfo | None:
        """Checkpoint the state after ``step``. Collective (the ranks' RNG states and
        ``extra`` states are gathered); rank 0 writes. ``extra``: named objects with
        ``state_dict`` and ``load_state_dict`` (an LR scheduler, a ``GradScaler``) saved
        with it, every rank's. ``background``: the state is serialized now, and the files
        are written, fsynced and committed on a thread while training goes on (``wait``;
        the next ``save`` and ``restore`` wait for it). Returns the manifest on rank 0 (with
        ``background``, the one about to be committed), None elsewhere and when refused (an
        open suspect window: the state is suspect until a restore). ``optimizer``: one, or a
        list of several (each one's ``state_dict``, in that order). ``verified_through``: for a
        manager used without a guard, the newest step your own verification found clean
        (the newest checkpoint at or before it is kept whatever ``keep`` says); with a guard
        bound, the guard says it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save(step): an int >= 0, got {step!r}.")
        if verified_through is not None and (isinstance(verified_through, bool) or not
                                             isinstance(verified_through, int)):
            raise ValueError(f"CheckpointManager.save(verified_through=...): an int step or "
                             f"None, got {verified_through!r}.")
        if verified_through is not None and self.verifier is not None:
            raise ValueError(
                "CheckpointManager.save(verified_through=...): this manager is bound to a "
                "guard (SDCGuard(checkpoints=...)), whose checks say which steps are verified; "
                "leave verified_through out, or use a manager of its own without the guard.")
        if not isinstance(background, bool):
            raise ValueError(f"CheckpointManager.save(background=...): a bool, got "
                             f"{background!r}.")
        self.wait()  # one write at a time; a failed background write raises here
        local_extra = _extra_states(extra, "save")
        device = next(model.parameters()).device
        gathered = gather_objects((rng_state(device), local_extra), self.group, device=device)
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
        if self._rank() != 0:
            return None
        payload = {
            "format": FORMAT, "step": step, "generation": generation,
            "model": _module(model).state_dict(), "optimizer": state_dict(optimizer),
            "rng": rngs, "world_size": self._world(), "extra": [g[1] for g in gathered],
            "guard": None if self.verifier is None and through is None else {
                "clean_through": through, "checks": per_check},
        }
        fp = f"{fingerprint(state_tensors(_module(model), optimizer, every=True)):016x}"
        buf = io.BytesIO()
        torch.save(payload, buf)
        data = buf.getvalue()
        name = f"step-{step:09d}-g{generation}"
        file = self.directory / f"{name}.pt"
        manifest = self.directory / f"{name}.json"
        info = CheckpointInfo(step=step, generation=generation, file=file,
                              manifest=manifest, size=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), fingerprint=fp,
                              clean_through=through, saved_at=time.time())
        record = json.dumps({
            "format": FORMAT, "step": step, "generation": info.generation, "file": file.name,
            "size": info.size, "sha256": info.sha256, "fingerprint": fp,
            "clean_through": info.clean_through, "saved_at": info.saved_at}, indent=1).encode()

        def commit() -> None:  # the data, then the manifest: the commit point
            write_atomic(file, data)
            write_atomic(manifest, record)
            self._prune(through, generation)

        if not background:
            commit()
            return info

        def write() -> None:
            try:
                commit()
            except BaseException as e:  # raised by wait(), on this thread's behalf
                log.error("sdc-guard: the background write of checkpoint %s failed: %s",
                          file, e)
                self._write_error = (file, e)

        # Not a daemon: an interpreter that exits waits for the write to be committed.
        self._writer = threading.Thread(target=write, name=f"sdc-guard-checkpoint-{step}")
        self._writer.start()
        return info

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
        """Every committed checkpoint (those with a manifest), newest first."""
        out = []
        for m in self.directory.glob("step-*.json"):
            try:
                rec = json.loads(m.read_text())
                out.append(CheckpointInfo(
                    step=int(rec["step"]), generation=int(rec["generation"]),
                    file=m.with_name(str(rec["file"])), manifest=m, size=int(rec["size"]),
                    sha256=str(rec["sha256"]), fingerprint=str(rec["fingerprint"]),
                    clean_through=rec.get("clean_through"), saved_at=float(rec["saved_at"])))
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
        same order)."""
        _extra_states(extra, "restore")
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
                            "window from step %d (%s detection at step %d)", info.file,
                            info.step, w["start"], w["check"], w["step"])
                continue
            try:
                payload = self._load(info)
                self._extra_held(info, payload, extra)
                _refuse_other_model(info.file, _module(model), payload["model"])
                # (the optimizers first: a checkpoint of another number of them is refused
                # before anything is loaded)
                load_state_dict(optimizer, payload["optimizer"],
                                "CheckpointManager.restore(optimizer)")
                _module(model).load_state_dict(payload["model"])
                got = f"{fingerprint(state_tensors(_module(model), optimizer, every=True)):016x}"
                if got != info.fingerprint:
                    raise CheckpointError(f"checkpoint {info.file}: the loaded state's "
                                          f"fingerprint {got} is not the recorded "
                                          f"{info.fingerprint}")
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
        self.windows.new_timeline(writer=self._rank() == 0)
        if chosen is None:
            if self._rank() == 0:  # every rank made the same choice (checked above)
                log.error("sdc-guard: no usable checkpoint in %s: training starts from scratch "
                          "(step 0)", self.directory, extra={"sdc_event": self.FROM_SCRATCH})
            return 0
        info, payload = chosen
        rngs = payload["rng"]
        rank = self._rank()
        if len(rngs) == self._world():
            set_rng_state(rngs[rank], device)
        else:
            log.warning("sdc-guard: %s was saved by %d ranks, this job has %d; RNG states not "
                        "restored", info.file, len(rngs), self._world())
        self._load_extra(info, payload, extra)
        if self.verifier is not None:
            self.verifier.rewind(info.step)
        if self._rank() == 0:
            log.warning("sdc-guard: restored %s (step %d); training resumes at step %d",
                        info.file, info.step, info.step + 1)
        return info.step + 1

    @staticmethod
    def _extra_held(info: CheckpointInfo, payload: dict[str, Any],
                    extra: Mapping[str, Any] | None) -> None:
        """Refuse (before anything is loaded) a restore whose ``extra`` names a state the
        checkpoint does not hold: resuming with it left as it is would be silently wrong."""
        held = (payload.get("extra") or [{}])[0]
        missing = sorted(set(extra or {}) - set(held))
        if missing:
            raise ValueError(
                f"CheckpointManager.restore(extra=...): checkpoint {info.file} holds no state "
                f"for {missing} (it holds {sorted(held)}); it was saved without them. Pass "
                "save(..., extra=...) the same names, or restore this one without them and "
                "set their state yourself")

    def _load_extra(self, info: CheckpointInfo, payload: dict[str, Any],
                    extra: Mapping[str, Any] | None) -> None:
        states = payload.get("extra") or [{}]
        rank = self._rank()
        if len(states) == self._world():
            mine = states[rank]
        else:
            mine = states[0]
            if extra:
                log.warning("sdc-guard: %s was saved by %d ranks, this job has %d; every rank "
                            "restores the writer's extra states %s", info.file, len(states),
                            self._world(), sorted(extra))
        for name, obj in (extra or {}).items():
            try:
                obj.load_state_dict(mine[name])
            except Exception as e:
                raise ValueError(
                    f"CheckpointManager.restore(extra={{{name!r}: ...}}): this "
                    f"{type(obj).__name__}'s load_state_dict refused the state saved in "
                    f"{info.file} ({type(e).__name__}: {e}); pass the same kind of object "
                    "save was given") from e
        unused = sorted(set(mine) - set(extra or {}))
        if unused and rank == 0:
            log.warning("sdc-guard: %s also holds the states %s, which restore(extra=...) was "
                        "not given: they are left as they are", info.file, unused)

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
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {info.file} is not an sdc-guard checkpoint of "
                                  f"format {FORMAT}")
        return payload

    # -- bookkeeping -----------------------------------------------------------------------
    def _prune(self, clean_through: int | None, generation: int) -> None:
        """Keep the newest ``keep``, and the newest checkpoint of ``generation`` verified clean
        by every check (through ``clean_through``, as ``save`` read it)."""
        infos = self.checkpoints()
        protected = next((c for c in infos if c.generation == generation
                          and clean_through is not None and c.step <= clean_through
                          and self.refused(c) is None), None)
        for c in infos[self.keep:]:
            if c is protected:
                continue
            for p in (c.manifest, c.file):  # the manifest first: never a manifest without data
                p.unlink(missing_ok=True)

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
