"""Check "weights": replicas must hold bit-identical weights (and optimizer state).

After ``optimizer.step()`` each rank fingerprints its parameters (in
``named_parameters`` order) and, optionally, its optimizer state tensors
(param groups in order, parameters in order, state keys sorted), and starts one small
all-reduce (the maximum and minimum of the 64-bit words) that nobody waits for. The next
step reads its result in the step's one read from the device (``sdc_guard.hostread``),
before that step's optimizer step: every rank equal settles the common case; otherwise
one ``all_gather`` of the word per rank and a majority vote: ranks outside a strict
majority are suspects; no strict majority (or world size 2) is a detection without a
suspect. A vote that finds the replicas apart withholds the step it is read in on every
rank: that step's gradients came in part from the replica that differed, so nothing of
it reaches the weights, and the detection names the step whose state was voted on. After
the last step, ``flush`` reads the vote still in flight.

Under FSDP2 (``sdc_guard.parallel.base.Layout``) each shard is voted among the ranks that
hold it: HSDP's replicas across the replicate dimension. The vote is still one all-reduce
over every rank (a slot per shard), so every rank reads every shard's verdict and withholds
alike. Pure FSDP holds no replica to vote with: the check is then *at rest*, each rank's
shard fingerprinted after the optimizer step and again before the next optimizer step
uses it, and a rank whose shard changed in between is named. The second fingerprint is
taken just before the next step's last gradient reduction, and its verdict rides that
reduction (the FSDP2 backend's sentinel, ``GradientListener.veto_early``): no collective
of its own, every rank withholds that step alike, and the slots name the ranks. Where the
reduction cannot carry it, the backend's word does, and the names are gathered on a
mismatch. Its remedy is a rollback (there is no majority to repair from).

Repair by majority (``GuardConfig.repair_by_majority``, on by default): when the suspects
are a strict minority, the lowest-numbered rank of the majority broadcasts its parameters and
optimizer state to every rank, and a second vote verifies that every rank now agrees. The
detection is reported with ``repaired=True``; the guard does not quarantine for it and no
suspect window opens (the state is the majority's again). A rank repaired a second time
within ``repair_window_steps`` is treated as a permanent fault: its detection is reported
unrepaired (quarantine, rollback), though the state is still made whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sdc_guard.checks.base import Check, Verdict
from sdc_guard.checks.weightpass import WeightPass
from sdc_guard.collectives import (
    STEPS_FIX,
    StepsDisagree,
    all_gather_rows,
    gather_if_different,
    gather_objects,
    majority_outliers,
    steps_disagree,
)
from sdc_guard.fingerprints.public import fingerprint_tensor
from sdc_guard.fingerprints.words import mix64_int, to_signed64, to_unsigned64
from sdc_guard.hostread import StepRead
from sdc_guard.optimizers import Optimizers, param_groups
from sdc_guard.parallel.base import Backend, Containment, GradientListener, Layout
from sdc_guard.report import Detection
from sdc_guard.scaling import Flag
from sdc_guard.state import state_tensors

_STEP_SALT = 0x5344435F53544550
"""Mixed with the step before its stamp is taken (``WeightsCheck.post_step``)."""

_LOWEST = -(1 << 63)
"""The slots of the other shards in a rank's vote vector (MAX leaves theirs)."""


def hyperparameters(optimizer: Optimizers) -> list[dict[str, Any]]:
    """Each param group's settings (learning rate, betas, weight decay, ...) as plain values:
    numbers, strings, tuples of them, one-element tensors as numbers; the rest left out.
    Several optimizers: their groups in turn."""

    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else None
        if isinstance(v, (bool, int, float, str)) or v is None:
            return v
        if isinstance(v, (tuple, list)):
            items = [plain(x) for x in v]
            return tuple(items) if all(x is not None for x in items) else None
        return None

    return [{k: pv for k, v in group.items() if k != "params" and (pv := plain(v)) is not None}
            for group in param_groups(optimizer)]


def settings_differ(everyone: list[list[dict[str, Any]]]) -> list[str]:
    """Where the ranks' ``hyperparameters`` differ: "group g key: rank r value, ..." each."""
    out = []
    groups = max(len(e) for e in everyone)
    for g in range(groups):
        keys = sorted({k for e in everyone if g < len(e) for k in e[g]})
        for k in keys:
            values = [e[g].get(k, "(none)") if g < len(e) else "(no group)" for e in everyone]
            if any(v != values[0] for v in values):
                out.append(f"param group {g} {k!r}: " + ", ".join(
                    f"rank {r} {v!r}" for r, v in enumerate(values)))
    return out


@dataclass(eq=False)
class _Vote:
    """A weights vote in flight: the state after ``step``, its stamped word, and the
    all-reduce of ``[word, ~word]`` (MAX) that says whether every rank's word is the same."""

    step: int
    stamp: int
    word: torch.Tensor
    both: torch.Tensor | None
    """``[word, ~word]`` in this rank's shard's slots; None at rest until ``ask`` compares."""
    work: Any
    asked: tuple[StepRead, int] | None = None
    """Its handle in the step's one read (``WeightsCheck.ask``)."""
    tensors: list[torch.Tensor] | None = None
    """At rest: the state's tensors as fingerprinted after the step, read again before the
    next optimizer step (in-place updates keep them the state's own)."""
    changed: Flag | None = None
    """At rest: has this rank's state changed since (``_AtRest.veto``)?"""
    answer: Containment | None = None
    """At rest: every rank's answer, carried by the next step's gradient reduction."""


class _AtRest(GradientListener):
    """The at-rest comparison as the backend's listener: asked just before the next step's
    last gradient reduction, which carries every rank's answer (``WeightsCheck.veto``)."""

    wants_veto = True
    veto_early = True

    def __init__(self, check: WeightsCheck) -> None:
        self.check = check

    def veto(self) -> Flag | None:
        return self.check.veto()

    def vetoed(self, answer: Containment) -> None:
        vote = self.check._vote
        if vote is not None:
            vote.answer = answer


class WeightsCheck(Check):
    """Replicas' weights (and optimizer state) compared after the step, every ``interval``;
    the vote is read before the next step's optimizer step."""

    name = "weights"
    compares_replicas = True
    checks_start = True

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optimizers,
        *,
        interval: int,
        include_optimizer_state: bool,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        repair: bool = False,
        repair_window_steps: int = 1000,
        repairs: dict[int, list[int]] | None = None,
        weight_pass: WeightPass | None = None,
        layout: Layout | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.model = model
        self.layout = (Layout.replicated(dist.get_world_size(group)) if layout is None
                       else layout)
        """Which ranks hold the same state: the vote runs within each set."""
        self.at_rest = self.layout.sharded and self.layout.replicas == 1
        """Pure FSDP: no replica; each rank's state is compared with itself between steps."""
        self.optimizer = optimizer
        self.interval = interval
        self.include_optimizer_state = include_optimizer_state
        self.device = device
        self.group = group
        self.repair = repair
        self.repair_window_steps = repair_window_steps
        self.repairs: dict[int, list[int]] = {} if repairs is None else repairs
        """Steps at which each rank was repaired (or, shared with the tolerant replay audit,
        named with a transient fault): one repair window for both."""
        self._vote: _Vote | None = None
        """The vote of the state after the last step it was due at, until it is read."""
        self.weight_pass = WeightPass() if weight_pass is None else weight_pass
        """The read of the weights this check runs after each step it is due at; other
        checks may have sums taken in it (``WeightPass.subscribe``)."""
        self._undecided: _Vote | None = None
        """At rest: the last vote whose carried answer could not be read (a non-finite
        gradient summed into the sentinel slots), for ``vote_now``."""
        self._backend = backend if self.at_rest else None
        self._listener: _AtRest | None = None
        if self._backend is not None:
            self._listener = _AtRest(self)
            self._backend.subscribe(self._listener)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def local_fingerprint(self, step: int | None = None,
                          tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """This rank's fingerprint (of ``tensors``, the state's as ``_state`` lists them);
        after ``step``'s optimizer step, by the shared pass (``weight_pass``), which takes its
        subscribers' sums in the same read."""
        return self.weight_pass.fingerprint(self._state() if tensors is None else tensors, step)

    def _state(self) -> list[torch.Tensor]:
        return state_tensors(self.model, self.optimizer if self.include_optimizer_state else None)

    def check_start(self, step: int) -> None:
        """Do the replicas start from the same state? Asked once, at the first step with this
        check on, before anything of the step runs (one all-gather of two words).

        DDP broadcasts rank 0's parameters when it is built and never again: a checkpoint
        loaded after that on some ranks only (``if rank == 0: model.module.load_state_dict(...)``,
        or the optimizer's state) leaves the replicas apart. This check would then convict
        the ranks outside the majority at the first step, and repair by majority would
        overwrite the loaded weights with the others'."""
        if self.at_rest:
            return  # no replicas to start alike
        words = [fingerprint_tensor(state_tensors(self.model, None)), self.local_fingerprint()]
        rows = all_gather_rows(torch.stack([w.to(self.device).reshape(()) for w in words]),
                               self.group).tolist()
        sets = self.layout.sets
        apart = [s for s in sets if any(rows[r] != rows[s[0]] for r in s)]
        if not apart:
            return
        what = ("parameters" if any(rows[r][0] != rows[s[0]][0] for s in apart for r in s)
                else "optimizer states")
        column = 0 if what == "parameters" else 1
        odd: tuple[int, ...] | None = ()
        for s in apart:
            out = majority_outliers([rows[r][column] for r in s])
            odd = None if out is None or odd is None else odd + tuple(s[i] for i in out)
        where = (f"ranks {list(odd)} differ from the others" if odd
                 else "no majority of the ranks agrees")
        raise ValueError(
            f"SDCGuard.step({step}): the replicas do not start from the same state: their "
            f"{what} differ before the first step ({where}). DDP broadcasts rank 0's "
            "parameters when it is built and never again, so state loaded afterwards on some "
            "ranks only (if rank == 0: model.module.load_state_dict(...) or "
            "optimizer.load_state_dict(...)) leaves the replicas apart, and the weights check "
            "would convict a healthy rank (repair by majority would overwrite the loaded "
            "state). Load it on every rank (sdc_guard.CheckpointManager.restore does), or load "
            "the weights before wrapping the model in DDP.")

    def awaiting(self, step: int) -> bool:
        return self._vote is not None

    def post_step(self, step: int) -> list[Detection]:
        """Fingerprint this rank's state and start the vote's all-reduce; read in the next
        step's ``pre_step`` (or ``flush``).

        The word carries the step agreement too: each rank XORs a 64-bit stamp of its step
        into it, so ranks at different steps differ like replicas that differ, and the
        mismatch path first gathers the steps (``StepsDisagree`` on every rank) before anyone
        is blamed."""
        self._drop_vote()
        if self.at_rest:  # compared with itself before the next optimizer step (``veto``)
            tensors = self._state()
            word = self.local_fingerprint(step, tensors).to(self.device).reshape(1)
            self._vote = _Vote(step, 0, word, None, None, tensors=tensors)
            return []
        self._vote = self._stamped(step, self.local_fingerprint(step))
        return []

    def _stamped(self, step: int, fingerprint: torch.Tensor) -> _Vote:
        """The vote of ``fingerprint`` (this rank's state) as the state after ``step``: the
        step's stamp XORed in, the all-reduce started."""
        stamp = to_signed64(mix64_int(step ^ _STEP_SALT))
        word = fingerprint.to(self.device).reshape(1) ^ stamp
        both, work = self._start(word, torch.bitwise_not(word))
        return _Vote(step, stamp, word, both, work)

    def _start(self, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The MAX all-reduce over every rank of ``[first, second]`` in this rank's shard's
        slots (the lowest int64 in the others'): per shard, the max of ``first`` and of
        ``second`` over the ranks that hold it."""
        pair = torch.cat([first, second])
        if len(self.layout.sets) == 1:
            both = pair
        else:
            both = torch.full((2 * len(self.layout.sets),), _LOWEST, dtype=torch.int64,
                              device=self.device)
            part = self.layout.part
            both[2 * part:2 * part + 2] = pair
        work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        if work is None:  # pragma: no cover - async_op=True always returns a Work handle
            raise RuntimeError("torch.distributed.all_reduce(async_op=True) returned no Work")
        return both, work

    def veto(self) -> Flag | None:
        """At rest, before the step's last gradient reduction: has this rank's state changed
        since the vote's fingerprint? A 0-d bool tensor, never read here (the backend writes
        the sentinel with it; the step's one read brings the answer). None when no vote
        waits (alike on every rank: the interval says)."""
        vote = self._vote
        if vote is None or vote.both is not None:
            return None
        vote.changed = self._now(vote).reshape(()) != vote.word.reshape(())
        return vote.changed

    def _now(self, vote: _Vote) -> torch.Tensor:
        """At rest: the fingerprint of the state as it is now (the tensors the vote read)."""
        return fingerprint_tensor(vote.tensors if vote.tensors is not None
                                  else self._state()).to(self.device).reshape(1)

    def ask(self, step: int, read: StepRead) -> None:
        vote = self._vote
        if vote is not None and vote.answer is not None:  # at rest, carried: no word
            vote.answer.ask(read)
            return
        if vote is not None and vote.both is None:  # at rest: the state as it is now
            vote.both, vote.work = self._start(vote.word, torch.bitwise_not(self._now(vote)))
        if vote is not None and vote.asked is None:
            assert vote.both is not None
            vote.work.wait()  # on a GPU the stream waits, not the host
            vote.asked = (read, read.ask(vote.both))

    def pre_step(self, step: int) -> Verdict:
        """Judge the vote of the state an earlier step left (read in the step's one read); a
        mismatch withholds this step on every rank (every rank holds the same words)."""
        vote, self._vote = self._vote, None
        if vote is None:
            return Verdict()
        found = self._judge(vote)
        return Verdict(found, withhold=bool(found))

    def flush(self) -> list[Detection]:
        """After the last step: the vote still in flight, if any (collective on a mismatch)."""
        vote, self._vote = self._vote, None
        return [] if vote is None else self._judge(vote)

    def rewind(self, step: int) -> None:
        """A restore: the vote in flight was of the abandoned state; waited for, dropped."""
        self._drop_vote()
        super().rewind(step)

    def close(self) -> None:
        """Replaced (``SDCGuard.reconfigure``): a vote in flight is waited for and dropped
        (call ``SDCGuard.flush`` first to have it judged)."""
        self._drop_vote()
        if self._backend is not None and self._listener is not None:
            self._backend.unsubscribe(self._listener)

    def _drop_vote(self) -> None:
        self._undecided = None
        vote, self._vote = self._vote, None
        if vote is not None and vote.work is not None:
            vote.work.wait()

    def _judge(self, vote: _Vote) -> list[Detection]:
        """The vote's verdict on the state after ``vote.step``: none when every rank's word is
        the same; else the gather, the steps' agreement, the majority and the repair."""
        if vote.answer is not None:
            return self._judge_carried(vote, vote.answer)
        if vote.both is None:  # at rest, flushed before the next step compared it
            vote.both, vote.work = self._start(vote.word, torch.bitwise_not(self._now(vote)))
        if vote.asked is not None:
            read, handle = vote.asked
            words = [int(v) for v in read.get(handle)]
        else:
            vote.work.wait()
            words = [int(v) for v in vote.both.tolist()]
        step, stamp = vote.step, vote.stamp
        # per shard: max == min (at rest: then == now), every rank holding it alike
        apart = [j for j in range(len(words) // 2) if words[2 * j] != ~words[2 * j + 1]]
        if not apart:
            self.verified(step)
            return []
        if self.at_rest:
            return self._changed_at_rest(step, apart)
        gathered = [int(v) for v in all_gather_rows(vote.word, self.group)[:, 0].tolist()]
        steps = all_gather_rows(torch.tensor([step], dtype=torch.int64, device=self.device),
                                self.group)[:, 0].tolist()
        differ = steps_disagree(steps)
        if differ is not None:
            raise StepsDisagree(f"SDCGuard.step: the ranks are not at one step ({differ}, found "
                                f"in the weights check's vote); {STEPS_FIX}")
        values = [to_unsigned64(v ^ stamp) for v in gathered]
        bad: dict[int, tuple[int, ...]] = {}
        """Per shard whose ranks differ: the ranks outside its strict majority."""
        unattributed = []
        for j in apart:
            members = self.layout.sets[j]
            out = majority_outliers([values[r] for r in members])
            if out is None:
                unattributed.append(j)
            elif out:
                bad[j] = tuple(members[i] for i in out)
        if not bad and not unattributed:
            self.verified(step)
            return []
        self._refuse_settings_drift(step)
        evidence: dict[str, Any] = {"fingerprints": [f"{v:016x}" for v in values]}
        if len(self.layout.sets) > 1:
            evidence["shards"] = {str(j): list(self.layout.sets[j]) for j in apart}
        outliers: tuple[int, ...] | None = (
            None if unattributed and not bad else tuple(sorted(r for o in bad.values() for r in o)))
        if outliers is None:
            self.tainted()
            return [
                Detection(
                    "weights",
                    step,
                    (),
                    detail="weight fingerprints differ across ranks and no strict majority "
                    "agrees: cannot attribute",
                    evidence=evidence,
                )
            ]
        detail = f"rank(s) {list(outliers)} hold weights that differ from the majority"
        if unattributed:
            detail += (f"; the replicas of shard(s) {unattributed} differ too, with no strict "
                       "majority among them: cannot attribute")
        repaired = False
        if self.repair:
            repeat = [r for r in outliers if any(step - s < self.repair_window_steps
                                                 for s in self.repairs.get(r, []))]
            sources = self._repair(bad)
            ok = self._agree_now() and not unattributed
            for r in outliers:
                self.repairs.setdefault(r, []).append(step)
            evidence["repair"] = {"source": (next(iter(sources.values())) if len(sources) == 1
                                             else {str(j): r for j, r in sources.items()}),
                                  "verified": ok, "repeat_ranks": repeat}
            if repeat:  # the earlier repair was this permanent fault too: the window opens there
                evidence["repair"]["since"] = min(
                    s for r in repeat for s in self.repairs[r] if step - s < self.repair_window_steps)
            repaired = ok and not repeat
            detail += ("; repaired in place from rank" + (
                f" {sources[next(iter(sources))]}" if len(sources) == 1
                else f"s {sorted(sources.values())}")
                       + (" and verified" if ok else ", but the ranks still differ"))
            if repeat:
                detail += (f"; rank(s) {repeat} repaired before within "
                           f"{self.repair_window_steps} steps: a permanent fault")
        if repaired:
            self.verified(step)
        else:
            self.tainted()
        return [Detection("weights", step, outliers, detail=detail, evidence=evidence,
                          repaired=repaired)]

    def vote_now(self, step: int) -> list[Detection]:
        """Vote on the state as it stands, before ``step``'s optimizer step (withheld), and
        judge at once: repair included, the detection of ``step``. Collective; for a step
        that another check withheld on every rank, where a weight difference would explain
        what it saw (``SDCGuard``: under HSDP a shard's holder computes with its whole shard
        group, so a changed weight shard shows in the computation of every rank of that
        group). At rest (pure FSDP), where a non-finite gradient summed into the sentinel
        slots hid the answer the step's reduction carried (every rank computes with every
        shard, so a NaN or Inf written into one spreads to every gradient): every rank's own
        comparison, gathered."""
        if self.at_rest:  # a carried answer a non-finite gradient hid: every rank's, gathered
            vote, self._undecided = self._undecided, None
            ranks = self._gather_changed(vote)
            if ranks:
                return self._changed_at_rest(step if vote is None else vote.step,
                                             self._parts(ranks))
            if vote is not None:
                self.verified(vote.step)
            return []
        return self._judge(self._stamped(step, self.local_fingerprint()))

    def _refuse_settings_drift(self, step: int) -> None:
        """Before a rank is blamed for weights that differ: do the ranks' optimizers run with
        the same settings? A learning-rate scheduler stepped on some ranks only (or a learning
        rate set under ``if rank == 0``) makes a replica's update differ at every step without
        any fault: the odd rank would be convicted (repaired, then a permanent fault). One
        gather of every rank's settings, on a mismatch only; the error is raised on every
        rank alike (they all hold the same gathered settings)."""
        everyone = gather_objects(hyperparameters(self.optimizer), self.group, device=self.device)
        differ = settings_differ(everyone)
        if differ:
            raise ValueError(
                f"weights check, step {step}: the replicas' weights differ, and so do their "
                f"optimizers' settings: {'; '.join(differ[:6])}. Every rank must run the "
                "optimizer with the same settings: step the learning-rate scheduler (and set any "
                "learning rate) on every rank alike, not under `if rank == 0`. Not a fault of "
                "the hardware: no rank is blamed.")

    def _repair(self, bad: dict[int, tuple[int, ...]]) -> dict[int, int]:
        """Per shard in ``bad``, its majority's lowest rank broadcasts the parameters and
        optimizer state to the shard's other holders; the sources, by shard. Collective within
        each repaired shard's holders."""
        sources = {j: min(set(self.layout.sets[j]) - set(out)) for j, out in bad.items()}
        mine = sources.get(self.layout.part)
        if mine is not None:
            src = dist.get_global_rank(self.group, mine) if self.group is not None else mine
            within = self.group if len(self.layout.sets) == 1 else self.layout.replica_group
            with torch.no_grad():
                for t in state_tensors(self.model, self.optimizer):
                    dist.broadcast(t, src=src, group=within)
        self.weight_pass.invalidate()  # its sums were taken from the weights as they were
        return sources

    def _agree_now(self) -> bool:
        """Does every shard's holders' state agree now? One vote, waited for. Collective."""
        word = self.local_fingerprint().to(self.device).reshape(1)
        if len(self.layout.sets) == 1:
            return gather_if_different(word, self.group) is None
        both, work = self._start(word, torch.bitwise_not(word))
        work.wait()
        words = [int(v) for v in both.tolist()]
        return all(words[2 * j] == ~words[2 * j + 1] for j in range(len(words) // 2))

    def _judge_carried(self, vote: _Vote, answer: Containment) -> list[Detection]:
        """At rest, the answer the gradient reduction carried: the ranks it names (a word
        only counts them: then every rank's ``changed`` is gathered, on a mismatch only)."""
        ranks = answer.ranks()
        if ranks is None and answer.read():
            ranks = self._gather_changed(vote)
        if not ranks:
            if ranks is not None and answer.read():  # a non-finite slot hides what it held
                self._undecided = vote
            else:
                self.verified(vote.step)
            return []
        return self._changed_at_rest(vote.step, self._parts(ranks))

    def _gather_changed(self, vote: _Vote | None) -> tuple[int, ...]:
        """At rest: the ranks whose state changed since ``vote`` (None: not this rank's),
        by one gather of every rank's answer. Collective."""
        mine = False if vote is None or vote.changed is None else vote.changed
        flag = (torch.as_tensor(mine) if isinstance(mine, bool) else mine).to(
            self.device, torch.int64).reshape(1)
        return tuple(r for r, v in enumerate(all_gather_rows(flag, self.group)[:, 0].tolist())
                     if v)

    def _parts(self, ranks: tuple[int, ...]) -> list[int]:
        return [j for j, held in enumerate(self.layout.sets) if any(r in ranks for r in held)]

    def _changed_at_rest(self, step: int, apart: list[int]) -> list[Detection]:
        """Pure FSDP: the ranks whose shard changed between ``step``'s optimizer step and the
        next one's use of it. Nothing to repair from: a rollback's."""
        ranks = tuple(sorted(r for j in apart for r in self.layout.sets[j]))
        self.tainted()
        return [Detection(
            "weights", step, ranks,
            detail=f"rank(s) {list(ranks)}: the shard of the weights (or optimizer state) each "
            f"holds changed at rest, after step {step}'s optimizer step and before the next "
            "one (FSDP holds no replica to repair it from: roll back)",
            evidence={"at_rest": True, "shards": [int(j) for j in apart]})]
