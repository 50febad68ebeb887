"""``ShardedCheckpointManager``: sharded state (FSDP2, HSDP) saved through ``torch.distributed.checkpoint``.

::

    ckpt = ShardedCheckpointManager(directory, keep=3)   # shared storage, every rank
    ckpt.save(step, model, optimizer)                    # collective: every rank writes its shards
    start = ckpt.restore(model, optimizer)               # the step to train next

The same API and rules as ``CheckpointManager`` (it is one: an ``SDCGuard`` takes it as
``checkpoints=``): suspect windows, the keep rule, the verifier, the owner marker, every
rank's RNG states and ``extra`` states. What differs is the storage and what is verified.

**Storage.** One DCP checkpoint per step, ``step-000000120-g0/``, in DCP's own layout
(``.metadata`` and one ``__<rank>_<n>.distcp`` file per writer), written by
``torch.distributed.checkpoint.save`` from ``get_state_dict(model, optimizer)`` (an FSDP2
``fully_shard`` model, DDP or a plain module alike). The ranks' RNG and ``extra`` states are
gathered to rank 0 and written beside DCP's files as ``sdc_guard_state.pt``. Everything is
written into ``.step-000000120-g0.tmp``, renamed once every rank has finished and DCP's
``.metadata`` is complete; then rank 0 writes the manifest ``step-000000120-g0.json``, the
commit point. A killed save leaves a temporary directory or a directory without a manifest,
neither of which is restored; the next save removes them.

**What the manifest records.** Besides what ``CheckpointManager``'s does (step, generation,
verification state, optimizers' types, job, suspect windows): each file's size, the SHA-256
of ``.metadata`` and of ``sdc_guard_state.pt``, the world size and mesh, every rank's
fingerprint of the local shards it held (``dcp_shards.rank_fingerprint``) and its layout,
and every key's shape, dtype and whole-tensor digest (``dcp_shards.piece_digest``). A save
whose replicas (HSDP) hold different values in one shard is refused: DCP would write one of
them.

**What restore verifies, before anything is loaded into the model**: the files' sizes and
the two SHA-256s, that the keys, shapes and dtypes are the model's and optimizers', then it
loads the checkpoint with ``dcp.load`` into fresh tensors (zeros of the live state's
layout) and, on the layout it was saved with, compares each rank's fingerprint with the
recorded one; on another layout (DCP reshards), each key's whole-tensor digest. One
verdict for every rank: a checkpoint any rank finds damaged is logged at ERROR, naming the
files that hold the keys that differ, and every rank tries the next older one. Only then
does ``set_state_dict`` load the fresh copy into the model and the optimizers.

``save(..., background=True)``: the state is staged (copied) in the call, and DCP's
asynchronous save writes it on a thread while training goes on; its collectives (the plan,
the finish) run on a gloo group of the manager's ranks made for them, never on training's.
Once every rank's files are written, rank 0 commits (the states file, the rename, the
manifest) on that thread. One save is in flight at a time: the next ``save`` and
``restore`` wait for it; ``wait()`` does (on rank 0 until the commit, on the others until
their own files are written: a barrier after it on every rank sees it committed); a
failure on any rank raises ``CheckpointError`` on every rank from the next ``save`` (from
``wait()`` on the rank that met it), and nothing of that save is restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sdc_guard.checkpoint.dcp_files import (
    FORMAT,
    KIND,
    STATE,
    check_files,
    files_of,
    fsync_dir,
    load_state,
    read_manifest,
    refuse_other,
    remove_file,
    remove_tree,
    state_bytes,
)
from sdc_guard.checkpoint.dcp_shards import (
    Box,
    box,
    fresh_copy,
    layout_digest,
    mesh_of,
    piece_digests,
    rank_fingerprint,
    tensor_leaves,
    whole_digests,
)
from sdc_guard.checkpoint.extra import extra_held, extra_states, load_extra
from sdc_guard.checkpoint.files import (
    TMP,
    CheckpointError,
    CheckpointWriteError,
    rng_state,
    set_rng_state,
    write_atomic,
)
from sdc_guard.checkpoint.manager import (
    CheckpointInfo,
    CheckpointManager,
    _why,
    recorded_version,
    restore_verifier,
    verifier_state,
)
from sdc_guard.checkpoint.verify import optimizer_types
from sdc_guard.collectives import gather_objects
from sdc_guard.fingerprints.words import FINGERPRINT_VERSION
from sdc_guard.optimizers import Optimizers, as_optimizers

log = logging.getLogger("sdc_guard.checkpoint")

__all__ = ["FORMAT", "KIND", "STATE", "ShardedCheckpointManager"]


class ShardedCheckpointManager(CheckpointManager):
    """Save, verify and restore sharded state through ``torch.distributed.checkpoint``;
    refuse checkpoints inside a suspect window (``CheckpointManager``'s rules)."""

    _behind: dist.ProcessGroup | None = None
    """The group background saves' collectives run on (``_background_group``)."""

    def save(self, step: int, model: torch.nn.Module, optimizer: Optimizers, *,
             extra: Mapping[str, Any] | None = None,
             background: bool = False,
             verified_through: int | None = None) -> CheckpointInfo | None:
        """Checkpoint the state after ``step``: every rank writes its shards (collective).
        ``CheckpointManager.save``'s arguments and outcome. ``background``: the state is
        staged now and written and committed on a thread (the module doc); the manifest is
        then not known yet, and None is returned on every rank (``checkpoints()`` lists it
        once ``wait()`` returns). Returns the manifest on rank 0, None elsewhere and when
        refused (an open suspect window)."""
        self._refuse_save_arguments(step, verified_through)
        if not isinstance(background, bool):
            raise ValueError(f"ShardedCheckpointManager.save(background=...): a bool, got "
                             f"{background!r}.")
        opts = as_optimizers(optimizer, "ShardedCheckpointManager.save(optimizer)")
        from torch.distributed.checkpoint.state_dict import get_state_dict  # DCP: on first use
        from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        failed_before = self._take_write_error()  # one save at a time; the last one's outcome
        local_extra = extra_states(extra, "save")
        device = _device(model)
        msd, osd = get_state_dict(model, opts)
        tree = {"model": msd, "optim": osd}
        leaves = tensor_leaves(tree)
        pieces = piece_digests(leaves)
        mine = {"fingerprint": rank_fingerprint(leaves),
                "layout": layout_digest({k: b for k, (b, _) in pieces.items()})}
        gathered = self._gather((rng_state(device), local_extra, mine, pieces, failed_before),
                                device)
        earlier = next((g[4] for g in gathered if g[4] is not None), None)
        if earlier is not None:  # a background save failed on some rank: every rank raises
            raise earlier
        opened = self.windows.opened()
        generation = self.windows.generation
        if self.verifier is not None:  # read here, on the caller's thread
            through, per_check = self.verifier.verified()
        else:
            through, per_check = verified_through, {}
        if opened:
            log.warning("sdc-guard: not saving step %d: a suspect window is open since step %d "
                        "(restore a checkpoint first)", step, opened[0]["start"])
            return None
        name = f"step-{step:09d}-g{generation}"
        final = self.directory / name
        tmp = self.directory / f".{name}{TMP}"
        digests, differ = whole_digests([g[3] for g in gathered])
        writer = self._rank() == 0

        def prepare() -> None:
            if differ:
                raise CheckpointError(
                    f"not saving {final}: the replicas hold different values of {differ[:4]}; "
                    "the state is not consistent across replicas (a fault the checks have "
                    "not reported yet?), and DCP would keep one of them")
            self.owner.check()
            self.owner.renew()
            self.windows.flush(writer=True)
            remove_tree(tmp)

        self._agree(prepare if writer else None, device)
        info: CheckpointInfo | None = None
        windows, repairs = ((self.windows.snapshot(), self.windows.repairs_before(step))
                            if writer else (None, []))

        def commit() -> None:
            nonlocal info
            info = self._commit(step, generation, tmp, final, gathered, digests, through,
                                per_check, opts, mesh_of(leaves), windows, repairs)

        if background:
            self._save_behind(tree, step, tmp, final, commit if writer else None, device,
                              dcp_async_save)
            return None
        try:
            try:
                dcp_save(tree, checkpoint_id=str(tmp), process_group=self.group)
                failed: BaseException | None = None
            except Exception as e:  # every rank agrees below, whichever failed
                failed = e
            self._agree(None, device, mine_failed=failed, what=f"the DCP write of {tmp}")
            self._agree(commit if writer else None, device)
        except BaseException:  # nothing of it is left behind
            if writer:
                remove_tree(tmp)
            raise
        return info

    def _save_behind(self, tree: dict[str, Any], step: int, tmp: Path, final: Path,
                     commit: Any, device: torch.device, dcp_async_save: Any) -> None:
        """``save(background=True)``'s DCP part: staged in this call (a failure raised on
        every rank here), written on DCP's thread with its collectives on a group of their
        own, then committed by rank 0 on a thread of ours once every rank's files are
        written. A failure there is kept for ``wait()`` and the next ``save``."""
        group = self._background_group()
        future: Any = None
        failed: BaseException | None = None
        try:
            future = dcp_async_save(tree, checkpoint_id=str(tmp), process_group=group)
        except Exception as e:  # staging failed: every rank agrees below
            failed = e
        try:
            self._agree(None, device, mine_failed=failed, what=f"staging {tmp}")
        except BaseException:
            if commit is not None:
                remove_tree(tmp)
            raise

        def finish() -> None:
            try:
                future.result()  # every rank's files are written once DCP's finish returns
                if commit is not None:
                    commit()
            except BaseException as e:  # raised by wait() and the next save
                log.error("sdc-guard: the background save of checkpoint %s failed: %s",
                          final, e)
                self._write_error = (final, e)
                if commit is not None:
                    remove_tree(tmp)

        # Not a daemon: an interpreter that exits waits for the save to be committed.
        self._writer = threading.Thread(target=finish, name=f"sdc-guard-checkpoint-{step}")
        self._writer.start()

    def _background_group(self) -> dist.ProcessGroup | None:
        """The gloo group of the manager's ranks that background saves' collectives run on
        (made on the first, by every rank of it); None without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._behind is None:
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            self._behind = dist.new_group(ranks=ranks, backend="gloo",
                                          use_local_synchronization=True)
        return self._behind

    # -- the writer's part -----------------------------------------------------------------
    def _commit(self, step: int, generation: int, tmp: Path, final: Path,
                gathered: list[Any], digests: dict[str, str | None], through: int | None,
                per_check: dict[str, int], opts: tuple[torch.optim.Optimizer, ...],
                mesh: dict[str, Any] | None, windows: dict[str, Any] | None,
                repairs: Any) -> CheckpointInfo:
        """The states file into the DCP directory, its rename, the manifest (the commit
        point), the prune. ``windows`` and ``repairs``: the suspect windows as the save
        found them (read on the caller's thread)."""
        state = {"format": FORMAT, "step": step, "generation": generation,
                 "rng": [g[0] for g in gathered], "extra": [g[1] for g in gathered],
                 "world_size": len(gathered),
                 "guard": None if self.verifier is None and through is None else {
                     "clean_through": through, "checks": per_check,
                     "state": verifier_state(self.verifier)}}
        buf = state_bytes(state)
        write_atomic(tmp / STATE, buf)
        meta = (tmp / ".metadata").read_bytes()
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        fsync_dir(tmp)
        if final.exists():  # a directory of the same step left by a save killed uncommitted
            remove_tree(final)
        try:
            os.replace(tmp, final)
        except OSError as e:
            raise CheckpointWriteError.of(final, e) from e
        fsync_dir(self.directory)
        ranks = [{"rank": r, **g[2]} for r, g in enumerate(gathered)]
        boxes: dict[str, Box] = {k: b for k, (b, _) in gathered[0][3].items()}
        combined = hashlib.sha256(json.dumps([r["fingerprint"] for r in ranks]).encode())
        manifest = self.directory / f"{final.name}.json"
        info = CheckpointInfo(step=step, generation=generation, file=final, manifest=manifest,
                              size=sum(files.values()),
                              sha256=hashlib.sha256(meta).hexdigest(),
                              fingerprint=combined.hexdigest()[:16], clean_through=through,
                              saved_at=time.time(), windows=windows,
                              fingerprint_version=FINGERPRINT_VERSION)
        record = {
            "format": FORMAT, "kind": KIND, "step": step, "generation": generation,
            "file": final.name, "size": info.size, "sha256": info.sha256,
            "fingerprint": info.fingerprint, "clean_through": through,
            "fingerprint_version": info.fingerprint_version,
            "saved_at": info.saved_at, "optimizers": optimizer_types(opts),
            "job": self.owner.job, "windows": windows, "files": files,
            "state": {"file": STATE, "sha256": hashlib.sha256(buf).hexdigest()},
            "world_size": len(gathered), "mesh": mesh, "ranks": ranks,
            "tensors": {k: {"shape": list(b.shape), "dtype": b.dtype, "digest": digests[k]}
                        for k, b in sorted(boxes.items())},
        }
        try:
            write_atomic(manifest, json.dumps(record, indent=1).encode())
        except BaseException:  # no directory that looks whole without its manifest
            remove_tree(final)
            raise
        self._prune(through, generation, repairs)
        return info

    def _remove(self, c: CheckpointInfo) -> None:
        remove_file(c.manifest)  # the manifest first: never a manifest without data
        remove_tree(c.file)

    def _sweep(self) -> None:
        for p in self.directory.glob("step-*"):
            if p.is_dir() and not p.with_name(f"{p.name}.json").exists():
                log.warning("sdc-guard: removing %s: a checkpoint's data without its manifest "
                            "(a save that failed or was killed before its commit)", p)
                remove_tree(p)
        for p in self.directory.glob(f".step-*{TMP}*"):
            log.warning("sdc-guard: removing %s: what a killed save left", p)
            remove_tree(p) if p.is_dir() else remove_file(p)

    # -- restoring -------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every committed sharded checkpoint (those with a manifest), newest first. A
        manifest that is unreadable, of another kind, or naming a directory other than its
        own is logged and left out."""
        out = []
        for m in self.directory.glob("step-*.json"):
            try:
                rec = read_manifest(m)
                windows = rec.get("windows")
                out.append(CheckpointInfo(
                    step=int(rec["step"]), generation=int(rec["generation"]),
                    file=m.with_name(m.stem), manifest=m, size=int(rec["size"]),
                    sha256=str(rec["sha256"]), fingerprint=str(rec["fingerprint"]),
                    clean_through=rec.get("clean_through"), saved_at=float(rec["saved_at"]),
                    windows=windows if isinstance(windows, dict) else None,
                    fingerprint_version=recorded_version(rec)))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.error("sdc-guard: checkpoint manifest %s is unreadable (%s); skipped", m, e)
        return sorted(out, key=lambda c: (c.generation, c.step), reverse=True)

    def restore(self, model: torch.nn.Module, optimizer: Optimizers, *,
                extra: Mapping[str, Any] | None = None) -> int:
        """Load the newest usable checkpoint before every suspect window; the step to train
        next (0: none is usable, the model and optimizer are left as they are). Collective.
        ``CheckpointManager.restore``'s arguments and rules; nothing of a checkpoint reaches
        the model or the optimizers before every rank has verified its copy."""
        extra_states(extra, "restore")
        opts = as_optimizers(optimizer, "ShardedCheckpointManager.restore(optimizer)")
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        device = _device(model)
        try:
            self.wait()  # a background save: committed (or failed) before anything is read
        except CheckpointError as e:
            log.error("sdc-guard: %s; restoring from the checkpoints there are", e)
        if self._world() > 1:  # the last save is committed before any rank looks
            dist.barrier(group=self.group)
        stateless = [o for o in opts if not o.state]  # get_state_dict steps them (lr 0)
        msd, osd = get_state_dict(model, opts)
        live = {"model": msd, "optim": osd}
        chosen = None
        candidates = self.checkpoints()
        seen = self._gather([c.manifest.name for c in candidates], device)
        if any(s != seen[0] for s in seen):  # the loads below are collective
            raise CheckpointError(f"ranks see different checkpoints in {self.directory}: "
                                  f"{seen}; is the directory shared storage every rank reads?")
        for info in candidates:
            w = self.refused(info)
            if w is not None:
                log.warning("sdc-guard: not restoring %s: saved at step %d, inside the suspect "
                            "window from step %d (%s)", info.file, info.step, w["start"],
                            _why(w))
                continue
            fresh = fresh_copy(live)
            loaded, why = self._try(info, fresh, opts, extra, device)
            if loaded is None:
                log.error("sdc-guard: checkpoint %s: %s; trying the next older checkpoint",
                          info.file, why)
                continue
            chosen = (info, fresh, loaded)
            break
        try:
            self.windows.new_timeline(writer=self._rank() == 0)
        except CheckpointWriteError as e:
            log.error("sdc-guard: restoring without recording the new timeline (%s); it holds "
                      "in memory and the next save writes it first", e)
        if chosen is None:
            for o in stateless:  # left as they were: a run from scratch starts stateless
                o.state.clear()
            if self._rank() == 0:
                log.error("sdc-guard: no usable checkpoint in %s: training starts from scratch "
                          "(step 0)", self.directory, extra={"sdc_event": self.FROM_SCRATCH})
            return 0
        info, fresh, state = chosen
        set_state_dict(model, opts, model_state_dict=fresh["model"],
                       optim_state_dict=fresh["optim"])
        rank, world = self._rank(), self._world()
        if len(state["rng"]) == world:
            set_rng_state(state["rng"][rank], device)
        else:
            log.warning("sdc-guard: %s was saved by %d ranks, this job has %d; RNG states not "
                        "restored", info.file, len(state["rng"]), world)
        load_extra(info, state, extra, rank=rank, world=world)
        restore_verifier(self.verifier, state.get("guard"), info.step)
        if rank == 0:
            log.warning("sdc-guard: restored %s (step %d); training resumes at step %d",
                        info.file, info.step, info.step + 1)
        return info.step + 1

    def _try(self, info: CheckpointInfo, fresh: dict[str, Any],
             opts: tuple[torch.optim.Optimizer, ...], extra: Mapping[str, Any] | None,
             device: torch.device) -> tuple[dict[str, Any] | None, str]:
        """Load ``info`` into ``fresh`` and verify it, every rank alike: its states file
        and the reason ("") when every rank found it sound, else None and the reasons."""
        rec = read_manifest(info.manifest)
        leaves = tensor_leaves(fresh)
        refuse_other(info.file, rec, leaves, opts)
        state: dict[str, Any] | None = None
        why = ""
        try:
            check_files(info.file, rec)
            state = load_state(info.file, rec)
        except CheckpointError as e:
            why = str(e)
        if state is not None:  # a restore(extra=...) the checkpoint cannot serve: raised
            extra_held(info, state, extra)
        whys = [w for w in self._gather(why, device) if w]
        if whys:  # every rank skips the load alike
            return None, "; ".join(dict.fromkeys(whys))
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        try:
            dcp_load(fresh, checkpoint_id=str(info.file), process_group=self.group)
        except Exception as e:  # DCP raises on every rank when any rank's read failed
            why = f"it does not load ({type(e).__name__}: {str(e).strip()[:400]})"
        ranks = rec.get("ranks") or []
        same = (not why and len(ranks) == self._world()
                and ranks[self._rank()].get("layout") == layout_digest(
                    {k: box(t) for k, t in leaves}))
        good = same and ranks[self._rank()].get("fingerprint") == rank_fingerprint(
            leaves, info.fingerprint_version)
        verdicts = self._gather((why, same, good), device)
        failed = [v[0] for v in verdicts if v[0]]
        if failed:
            return None, "; ".join(dict.fromkeys(failed))
        if all(v[2] for v in verdicts):
            return state, ""
        # Another layout (DCP resharded), or a fingerprint that differs: each key's whole digest.
        pieces = self._gather(piece_digests(leaves), device)
        got, differ = whole_digests(pieces)
        tensors = rec["tensors"]
        unknown = [k for k in got if tensors.get(k, {}).get("digest") is None]
        bad = sorted({k for k in got if k not in unknown
                      and got[k] != tensors[k]["digest"]} | {d.split(" ")[0] for d in differ})
        same_layout = all(v[1] for v in verdicts)
        ranks_bad = [r for r, v in enumerate(verdicts) if not v[2]] if same_layout else []
        if bad:  # on the saved layout, the boxes of the ranks whose fingerprint differs
            where = ([(k, pieces[r][k][0].offsets) for r in ranks_bad for k in bad]
                     if ranks_bad else [(k, None) for k in bad])
            return None, (f"the state it holds differs from what was saved in {bad[:4]}"
                          f"{' ...' if len(bad) > 4 else ''}"
                          f"{f' on ranks {ranks_bad}' if ranks_bad else ''} (in "
                          f"{', '.join(files_of(info.file, where))}); nothing was loaded")
        if same_layout:  # a fingerprint differs where no digest does (a swap of values)
            return None, (f"the fingerprint of the shards of ranks {ranks_bad} is not the "
                          "recorded one; nothing was loaded")
        if unknown:
            raise CheckpointError(
                f"checkpoint {info.file} was saved on another layout (world size "
                f"{rec.get('world_size')}, mesh {rec.get('mesh')}), and the keys {unknown[:4]} "
                "have no whole-tensor digest to verify them with after resharding; restore "
                "it on the layout it was saved with")
        return state, ""

    # -- collectives -----------------------------------------------------------------------
    def _gather(self, obj: Any, device: torch.device) -> list[Any]:
        return gather_objects(obj, self.group, device=device) if self._world() > 1 else [obj]

    def _agree(self, work: Any, device: torch.device, *,
               mine_failed: BaseException | None = None, what: str = "") -> None:
        """Run ``work`` (on the ranks given one) and raise, on every rank, the first error
        any rank met (a ``CheckpointError``; another exception is wrapped in one)."""
        failed = mine_failed
        if work is not None:
            try:
                work()
            except Exception as e:
                failed = e
        if failed is not None and not isinstance(failed, CheckpointError):
            wrapped = CheckpointError(f"{what or 'the save'} failed on rank {self._rank()}: "
                                      f"{type(failed).__name__}: {failed}")
            wrapped.__cause__ = failed
            failed = wrapped
        told = self._gather(failed, device)
        first = next((t for t in told if t is not None), None)
        if first is not None:
            raise failed if failed is not None else first


def _device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.to_local().device if isinstance(p, DTensor) else p.device
