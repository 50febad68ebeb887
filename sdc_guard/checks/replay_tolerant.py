"""Check "replay", tolerant mode (``GuardConfig(replay_mode="tolerant")``): the ring replay
audit for runs without deterministic kernels.

The ring, the exchange beside the gradient buckets, the veto and the localisation are the
exact audit's (``sdc_guard.checks.replay``). What differs is what the ranks compare and
what they do before blaming anyone:

- **A sketch, within a tolerance.** Each side reports a float64 sketch of its loss and
  local gradients (``sdc_guard.checks.sketch``: the loss, each parameter's gradient norm and
  four fixed random projections of it), and an edge is bad when the two sketches differ
  by more than the tolerance (``distance``: every component in its own scale).
- **A tolerance calibrated from the run.** At the audit's first step (so after every
  ``SDCGuard.reconfigure`` too) each rank recomputes its neighbour's batch ``RERUNS``
  times; every rank gathers every rank's recomputations and owners' steps, and sets the
  tolerance to ``MARGIN`` times the larger median of the same-rank and the cross-rank
  differences (``calibrated_tolerance``). Every rank computes the same number from the same
  gathered sketches. It is logged (event ``replay_calibration``); a calibration above
  ``CEILING`` is refused (logged, and done again at the next audit), and meanwhile the
  audit compares at ``CEILING``. **Then it rolls**: the recomputations at the start see
  one batch per rank, and the noise of a recomputation changes as training goes on (a
  gradient that becomes a sum of cancelling terms carries more noise relative to its
  norm), so every ``ROLLING_AUDITS`` clean audits the ranks gather the median of their
  own edge's distances over those audits (the owner's step against its neighbour's
  replay: the quantity each audit compares) and the tolerance becomes ``MARGIN`` times
  the lower median of those medians (one float per rank, no recomputation; logged with
  ``"kind": "rolling"``). The lower median: a rank whose own distances a lasting fault
  inflates cannot raise it.
- **In half precision** (the calibration's first recomputation produced bfloat16 or float16
  tensors: ``HalfOutputs``; under ``torch.autocast``, half-precision parameters, FSDP2's
  bfloat16 ``MixedPrecisionPolicy``) a recomputation rounds every product anew, a rounding
  moves its element by up to ``2**-8``, and the moves cascade through the layers: the
  distances run far above the float32 ceiling, with a long tail (on the testbed the
  largest of a run is tens of times the median). The ceiling is then ``CEILING_HALF``;
  the audit compares at it until the rolling update that closes ``HALF_WINDOWS`` windows
  (the calibration at one step does not show the tail, nor does one window at the start
  of a run), and from then on each rolling update takes at least ``TAIL`` times the
  largest tail seen so far (per window: the upper median of the ranks' largest clean
  distances, the lower one with two ranks). Under DDP the audit then compares per bucket
  (``_grouped``: a small parameter's gradient carries the roundings at a far larger share
  of its own norm; under FSDP2 the sketch is per module already). The tolerance then sits
  a few percent of each component's scale: exponent flips that blow a value up are seen,
  finer changes are not.
- **A diagnosis by reruns before blame.** For a bad edge a -> b the audit reruns b's
  batch in the same step, in one gather: ``DIAGNOSIS_RERUNS`` times on b, on a and (with
  more than two ranks) on the third rank b + 1 (``diagnose``). A result that recurs on a
  rank other than the one that first computed it is one the batch can give. When both b's
  own result and a's replay recur elsewhere, the batch sits at a knife edge of its
  numerics (a value within a rounding of a ReLU's gate): no one is named (an event
  record, ``replay_unstable``; the step is withheld only where the veto already stopped
  it). When only one of them recurs elsewhere, the rank whose result recurs nowhere else
  is named: lasting (quarantine) when it gives that result at every rerun and every other
  rerun gives the other one, else transient (``transient=True``, no quarantine, unless
  the rank was named transient or repaired by the weights check within
  ``repair_window_steps``: a lasting fault then). Neither: no one is named. A rank whose
  two edges are both bad computed two batches wrong: it is named, transient when its own
  batch, rerun, comes out right.

- **A cheap trigger between audits** (``GuardConfig.replay_trigger``, with an interval above
  1, two ranks or more and containment on): on the other steps each rank takes its local gradient norm from
  its gradient buckets before the reduction (one read of each bucket) and votes to audit
  the step when the norm leaves its band (a factor ``exp(trigger_threshold)`` around the
  median of its recent norms, the factor learned from how far they drift: ``drift_score``)
  or is not finite. The vote rides the backend's veto channel (under DDP the sentinel in
  the last bucket: no word of its own). When some rank voted, every rank audits the step
  at once, before the optimizer step: every rank recomputes its own batch and its
  neighbour's, the ring is judged on those, and each rank's recomputed norm is compared
  with the one it took (a norm that did not come back while the batch reproduces on two
  ranks was a transient fault of the rank's step). The step is withheld (the vote's
  sentinel is in its reduced gradients). A spike the batch itself makes comes back
  everywhere: an event record (``replay_trigger``), no suspect. The trigger names no one by
  itself. It misses what does not move the norm: flips of low mantissa bits, and exponent
  flips that shrink a value which mattered little.

What the sketch cannot see: a difference smaller than the tolerance in every component,
i.e. a corruption of the low mantissa bits of a value (``docs/checks/replay.md``, "Tolerant
mode", measures the escapes by bit).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from sdc_guard.checks.base import Verdict
from sdc_guard.checks.replay import ReplayAudit, every_edge_detection, own_batch_error
from sdc_guard.checks.sketch import (
    CEILING,
    CEILING_HALF,
    FLOOR,
    MARGIN,
    BucketNorms,
    GradientSketch,
    calibrated_tolerance,
    component,
    differences,
    distance,
)
from sdc_guard.collectives import STEPS_FIX, PendingSum, all_gather_rows, steps_disagree
from sdc_guard.determinism import derive_seed
from sdc_guard.hostread import StepRead, on_host
from sdc_guard.parallel.base import Bucket, bucket_gradients
from sdc_guard.report import Detection
from sdc_guard.scaling import Flag, SketchRequest

_log = logging.getLogger(__name__)

TRIGGER_HISTORY = 64
"""Recent clean steps whose norms (and drift scores) set a rank's band."""

TRIGGER_MARGIN = 4.0
"""A rank votes above this multiple of the median drift score of its recent clean steps
(``trigger_threshold``)."""

TRIGGER_FLOOR = math.log(4.0)
"""The least threshold: a norm a factor of 4 from the median of the rank's recent ones."""

TRIGGER_WARMUP = 8
"""Clean steps of history before the threshold follows it (``TRIGGER_FLOOR`` until then)."""


def drift_score(norm: float, recent: Sequence[float]) -> float:
    """How far a rank's local gradient norm is from the median of its recent ones, in log
    scale (``|ln(norm / median)|``); Inf when the norm is not finite, or is zero, or the
    median is, and the other is not."""
    med = statistics.median(recent)
    if not math.isfinite(norm):
        return math.inf
    if norm == med:
        return 0.0
    if norm <= 0.0 or med <= 0.0:
        return math.inf
    return abs(math.log(norm / med))


def trigger_threshold(history: Sequence[float]) -> float:
    """``TRIGGER_MARGIN`` times the median drift score of the recent clean steps, at least
    ``TRIGGER_FLOOR`` (only the floor before ``TRIGGER_WARMUP`` of them)."""
    if len(history) < TRIGGER_WARMUP:
        return TRIGGER_FLOOR
    s = sorted(history)
    return max(TRIGGER_FLOOR, TRIGGER_MARGIN * s[len(s) // 2])


DIAGNOSIS_RERUNS = 2
"""Recomputations of a disputed batch on each of its owner, its replayer and the third rank."""

RERUNS = 4
"""Recomputations of the neighbour's batch on each rank at a calibration (the replay
included): ``RERUNS * (RERUNS - 1) / 2`` same-rank and ``RERUNS`` cross-rank differences per
rank."""

ROLLING_AUDITS = 32
"""Clean audits between the tolerance's rolling updates (``TolerantReplayAudit._roll``)."""

TAIL = 4.0
"""In half precision the rolled tolerance is at least this multiple of the largest tail seen
(per window of clean audits, the upper median of the ranks' largest edge distances; the
lower one with two ranks): half-precision roundings cascade, and their distances have a
long tail (the largest of a run tens of times their median), which a multiple of the
median alone does not cover."""

HALF_WINDOWS = 4
"""In half precision the tolerance leaves the ceiling at the rolling update that closes this
many windows of clean audits (``ROLLING_AUDITS`` each), not before: the tail of the
roundings' distances grows as training goes on, and one window at the start of a run does
not show it."""

_SKETCH_SALT = 0x5EC7
"""Separates the sketch's projections from the other streams drawn from the seed."""


_HALF = (torch.bfloat16, torch.float16)


class HalfOutputs(TorchFunctionMode):
    """Watches a computation for torch functions that return a bfloat16 or float16 tensor
    (``seen``): a model under ``torch.autocast``, with half-precision parameters, or under
    FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` computes its products so.
    Changes nothing it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (not self.seen and isinstance(out, torch.Tensor) and out.dtype in _HALF):
            self.seen = True
        return out


def _loss_sum(losses: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not losses:
        return torch.zeros((), dtype=torch.float64, device=device)
    if len(losses) == 1:
        return losses[0].detach().to(torch.float64).reshape(())
    return torch.stack([loss.detach().to(torch.float64).reshape(()) for loss in losses]).sum()


def diagnose(a: int, b: int, own: torch.Tensor, replay: torch.Tensor,
             reruns: Sequence[tuple[int, torch.Tensor]], close: Any
             ) -> tuple[int | None, bool, str]:
    """The verdict on one bad edge a -> b from the reruns of b's batch (``(rank, sketch)``:
    on b, on a, and on the third rank when there is one): (the rank named or None, lasting?,
    the verdict in words).

    Which ranks' reruns give b's own result again, and which a's replay: a result that
    recurs on a rank other than the one that first computed it is one the batch can give.
    Both recurring elsewhere: the batch's own numerics (a knife edge), "unstable", nobody
    named. Only a's replay recurring elsewhere: b's own result is its hardware's, named;
    lasting when b gives it at every rerun and every other rerun gives the replay's (it comes
    back on b alone), else transient. The mirror for a. Neither: nobody named.
    """
    again_own = {by for by, x in reruns if close(x, own)}
    again_replay = {by for by, x in reruns if close(x, replay)}
    if a == b:  # a ring of one: its own step against its own replay, rerun
        if bool(again_own) != bool(again_replay):
            return b, False, "the rank's " + ("step" if again_replay else "replay") + (
                " did not come back")
        return None, False, "unstable" if again_own else "undecided"
    own_elsewhere, replay_elsewhere = again_own - {b}, again_replay - {a}
    third = {by for by, _ in reruns} - {a, b}
    if own_elsewhere and replay_elsewhere:
        return None, False, "unstable"
    if replay_elsewhere:
        lasting = bool(third) and _only(reruns, b, own, close) and _only_not(
            reruns, b, replay, close)
        return b, lasting, f"rank {b}'s result " + (
            "comes back on it alone" if lasting else "did not come back elsewhere")
    if own_elsewhere:
        lasting = bool(third) and _only(reruns, a, replay, close) and _only_not(
            reruns, a, own, close)
        return a, lasting, f"rank {a}'s replay " + (
            "comes back on it alone" if lasting else "did not come back elsewhere")
    return None, False, "undecided"


def _only(reruns: Sequence[tuple[int, torch.Tensor]], rank: int, result: torch.Tensor,
          close: Any) -> bool:
    """Does ``rank``'s every rerun come back as ``result``?"""
    mine = [x for by, x in reruns if by == rank]
    return bool(mine) and all(close(x, result) for x in mine)


def _only_not(reruns: Sequence[tuple[int, torch.Tensor]], rank: int, result: torch.Tensor,
              close: Any) -> bool:
    """Does every other rank's every rerun come back as ``result``?"""
    theirs = [x for by, x in reruns if by != rank]
    return bool(theirs) and all(close(x, result) for x in theirs)


def _norm_of(sketch: torch.Tensor, width: int) -> float:
    """The whole gradient's norm, from a sketch's per-parameter norms."""
    return float(torch.linalg.vector_norm(sketch[1::width]))


def _close_norm(a: float, b: float, tol: float) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    scale = max(abs(a), abs(b))
    return math.isfinite(scale) and abs(a - b) <= tol * scale


class TolerantReplayAudit(ReplayAudit):
    """The ring replay audit compared within a calibrated tolerance; see the module doc."""

    def __init__(self, *args: Any, strikes: dict[int, list[int]],
                 repair_window_steps: int, trigger: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._contain = self.wants_veto
        """Does the audit's own verdict travel on the veto channel (containment, 2+ ranks)?"""
        self.trigger = trigger and self.interval > 1 and self._contain
        """Watch the local gradient norms between audits (module doc); its vote rides the
        backend's veto channel, so it needs containment on (a vote withholds its step) and
        two ranks or more."""
        self.wants_veto = self.wants_veto or self.trigger
        self._norm_step = -1
        self._norm_sq: torch.Tensor | None = None
        self._norm: torch.Tensor | None = None
        """This step's local gradient norm (0-d, on the device), once every bucket is seen."""
        self._norm_read: tuple[StepRead, int] | None = None
        self._vote: Flag | None = None
        self.norms: collections.deque[float] = collections.deque(maxlen=TRIGGER_HISTORY)
        """This rank's local gradient norms of the recent untriggered steps."""
        self.scores: collections.deque[float] = collections.deque(maxlen=TRIGGER_HISTORY)
        """Their scores (``drift_score``)."""
        self.triggered: list[int] = []
        """Steps at which the trigger ran an audit."""
        self.sketch = GradientSketch(self._sketched(), seed=derive_seed(self.seed, _SKETCH_SALT),
                                     device=self.device)
        self.tolerance: float | None = None
        """The calibrated tolerance (None until a calibration is accepted)."""
        self.strikes = strikes
        """Steps at which each rank was named transient here or repaired by the weights
        check (shared with it: one repair window for both)."""
        self.repair_window_steps = repair_window_steps
        self._exchanges = self.world > 1  # the agreement without a veto compares the edge too
        self._peer = torch.zeros(self.sketch.size(), dtype=torch.float64, device=self.device)
        self._own_rows: list[torch.Tensor | None] = []
        self._request: SketchRequest | None = None
        """The local bucket's gradients to sketch (or, for the trigger, its norm), from
        ``local`` to ``after_scaling``."""
        self._norms = BucketNorms()
        self._own_sketch: torch.Tensor | None = None
        self._calibration: list[torch.Tensor] = []
        self._records: list[dict[str, Any]] = []
        self._distance: torch.Tensor | None = None
        """This audit step's own edge distance (``_far``), while the step is judged."""
        self._recent: list[torch.Tensor] = []
        """The own edge's distances of the clean audits since the last rolling update."""
        self._clean_audits = 0
        """Clean audits since then (alike on every rank: the verdicts are collective)."""
        self._unstable = False
        self._warned = False
        self._windows = 0
        """Rolling windows closed since the last calibration (alike on every rank)."""
        self._tail = 0.0
        """In half precision: the largest tail seen in a rolling window (the upper median of
        the ranks' largest clean edge distances; the lower one with two ranks), alike on
        every rank."""
        self.half = False
        """Do the model's products run in half precision (bfloat16, float16)? Found at the
        calibration's first recomputation (``HalfOutputs``). Their roundings
        reach the sketch at a far larger scale, in a long tail: the ceiling is then
        ``CEILING_HALF``, the audit compares at it until the tail is measured
        (``HALF_WINDOWS``), every rolling update covers the tail (``TAIL``), and under DDP
        the audit compares per bucket (``_per_group``)."""
        self._extra: list[float] = []
        """Numbers gathered beside the sketches (a triggered audit's norm and vote)."""
        self._step_groups: dict[int, list[int]] = {}
        """This audit step's local buckets seen: bucket index -> its audited parameters."""
        self._groups: tuple[tuple[int, ...], ...] | None = None
        """The parameters of each bucket of the last audit step whose buckets were seen (alike
        on every rank: DDP's buckets are); in half precision the audit compares per bucket
        (``_apart``)."""
        self._group_of: dict[torch.device, torch.Tensor] = {}
        """Each parameter's group, for ``_grouped``, on each device it was asked on."""

    def _sketched(self) -> list[int]:
        """The element counts of the gradients the sketch holds: each parameter's."""
        return [p.numel() for p in self.params]

    # -- the tolerance -------------------------------------------------------------------
    def _tol(self) -> float:
        return self._ceiling() if self.tolerance is None else self.tolerance

    def restore_tolerance(self, tolerance: float, *, half: bool = False) -> None:
        """Take a tolerance calibrated earlier in the run (a checkpoint's) instead of
        calibrating at the next audit; ``half``: calibrated for products in half precision
        (its ceiling ``CEILING_HALF``)."""
        ceiling = CEILING_HALF if half else CEILING
        if not FLOOR <= tolerance <= ceiling:
            raise ValueError(f"replay tolerance {tolerance!r} is outside [{FLOOR}, {ceiling}]")
        self.tolerance = float(tolerance)
        self.half = bool(half)
        # below the half ceiling: rolled after the tail was measured (HALF_WINDOWS)
        self._windows = HALF_WINDOWS if self.half and tolerance < ceiling else 0

    def gap(self) -> float | None:
        """How far this rank's own sketch of the last audit step was from the previous rank's
        replay of its batch, in tolerances (None before a compared audit step): the spread
        of clean steps, which a benchmark records."""
        if self._own_sketch is None or self.world < 2 or not self.tolerance:
            return None
        return float(self._apart(self._own_sketch, self._peer)) / self.tolerance

    def saved(self) -> dict[str, Any]:
        if self.tolerance is None:
            return {}
        return {"tolerance": self.tolerance, **({"half": True, "tail": self._tail}
                                                 if self.half else {})}

    def load_saved(self, state: dict[str, Any]) -> None:
        """A restored checkpoint's tolerance, used from now on (the same job: the same
        model and kernels); ``reconfigure`` calibrates anew."""
        if isinstance(state.get("tolerance"), float):
            self.restore_tolerance(state["tolerance"], half=state.get("half") is True)
            if self.half and isinstance(state.get("tail"), float):
                self._tail = state["tail"]

    def records(self) -> list[dict[str, Any]]:
        out, self._records = self._records, []
        return out

    def _gathers_anyway(self) -> bool:
        return self.tolerance is None  # a calibration gathers every rank's recomputations

    def _calibrate(self, step: int, own: torch.Tensor, rep: torch.Tensor,
                   calib: torch.Tensor) -> None:
        """Set the tolerance from every rank's recomputations of its neighbour's batch."""
        n = self.world
        same: list[float] = []
        cross: list[float] = []
        for r in range(n):
            runs = [rep[r], *calib[r]]
            owner = own[(r + 1) % n]
            same += [float(self._apart(x, y)) for x, y in itertools.combinations(runs, 2)]
            cross += [float(self._apart(x, owner)) for x in runs]
        tol = calibrated_tolerance(same, cross)
        ceiling = self._ceiling()
        accepted = tol <= ceiling
        if accepted:  # in half precision: the ceiling until the tail is measured
            self.tolerance = ceiling if self.half else tol
            self._windows = 0
        self._records.append({
            "event": "replay_calibration", "step": step, "tolerance": tol,
            "accepted": accepted, "margin": MARGIN, "floor": FLOOR, "ceiling": ceiling,
            "same_rank": {"count": len(same), "max": max(same, default=0.0)},
            "cross_rank": {"count": len(cross), "max": max(cross, default=0.0)},
            "detail": ("tolerance calibrated" if accepted else
                       "calibration refused: recomputations differ by more than the ceiling "
                       "(calibrated again at the next audit)")})
        if not accepted:
            self._warn_noisy(tol, ceiling)
        if self.half:
            self._records[-1].update(half_precision=True, detail=(
                "half precision: the calibrated tolerance does not show the tail of the "
                "roundings' cascade; the audit compares at the ceiling until the rolling "
                f"update that closes {HALF_WINDOWS} windows of clean audits" if accepted
                else self._records[-1]["detail"]))

    # -- the step's sketches -------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._own_rows = [None] * self.sketch.count
        self._step_groups = {}
        self._own_sketch = None
        self._calibration = []
        super().begin_step(step)
        if self.tolerance is None:
            nxt = (self.rank + 1) % self.world
            with HalfOutputs() as watch:
                first = self._replay(nxt, step, "calibrate")
            self._calibration = [first, *(self._replay(nxt, step, "calibrate")
                                          for _ in range(RERUNS - 2))]
            self._set_half(watch.seen)

    def _words_of(self, losses: Sequence[torch.Tensor],
                  grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        rows = [None if g is None else self.sketch.row(i, g) for i, g in enumerate(grads)]
        return self.sketch.of(_loss_sum(losses, self.device), rows)

    def local(self, bucket: Bucket) -> None:
        """On audit steps, the bucket's local gradients to sketch (before the scaling): asked
        of the scaling pass (``sketches``), which takes them in its read where it can."""
        self._request = None
        idx = self._seen(bucket)
        if idx is None:
            if self.trigger and not self.due(self._backend.step):  # the norm rides the pass
                self._request = SketchRequest(self._norms, [(bucket.index(), bucket.buffer())])
            return None
        self._step_groups[bucket.index()] = [i for i in idx if i >= 0]
        grads = bucket_gradients(bucket)
        if bucket.buffer().layout != torch.strided and len(idx) == 1:
            grads = [bucket.buffer()]  # DDP gives a sparse gradient a bucket of its own
        self._request = SketchRequest(
            self.sketch, [(i, g) for i, g in zip(idx, grads, strict=True) if i >= 0])
        return None

    def sketches(self, bucket: Bucket) -> SketchRequest | None:
        return self._request

    def after_scaling(self, bucket: Bucket, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        request, self._request = self._request, None
        if request is None:
            return
        if request.sketch is self._norms:
            for row in request.rows.values():
                self._add_norm_sq(row[0].square())
            return
        for i, row in request.rows.items():
            self._own_rows[i] = row

    # -- the trigger ---------------------------------------------------------------------
    def _add_norm(self, bucket: Bucket) -> None:
        """Add the bucket's local sum of squares (one read of its buffer, in its own precision:
        the trigger's threshold is a factor of several, not a rounding)."""
        self._add_norm_sq(self._norms.row(bucket.index(), bucket.buffer())[0].square())

    def _add_norm_sq(self, sq: torch.Tensor) -> None:
        """Add a bucket's local sum of squares to this step's (0-d float64)."""
        step = self._backend.step
        if step != self._norm_step:
            self._norm_step, self._norm_sq, self._norm = step, None, None
        self._norm_sq = sq if self._norm_sq is None else self._norm_sq + sq

    def _band(self) -> tuple[float, float] | None:
        """The norms this rank's next step may have without a vote: within a factor
        ``exp(trigger_threshold)`` of the median of its recent norms (None: too few yet)."""
        if len(self.norms) < TRIGGER_WARMUP:
            return None
        med = statistics.median(self.norms)
        factor = math.exp(trigger_threshold(list(self.scores)))
        return med / factor, med * factor

    def _trigger_vote(self) -> Flag | None:
        """This rank's vote to audit the step now (non-audit steps, before the last gradient
        reduction): its local norm outside its band, or not finite. A device bool on a
        device (no read); the norm itself is read with the step's other values."""
        if self._norm_step != self._backend.step or self._norm_sq is None:
            return False  # (no bucket: alike on every rank under DDP)
        self._norm = self._norm_sq.sqrt()
        band = self._band()
        if band is None:
            self._vote = False
            return False
        lo, hi = band
        inside = (self._norm >= lo) & (self._norm <= hi)  # NaN: outside
        self._vote = bool(~inside) if on_host(inside) else ~inside
        return self._vote

    def awaiting(self, step: int) -> bool:
        return self.trigger and not self.due(step)

    def _trigger_pre_step(self, step: int) -> Verdict:
        """A non-audit step: an audit now when some rank voted; else the norm joins the
        history."""
        answer, self._answer = self._answer, None
        norm_read, self._norm_read = self._norm_read, None
        norm = (float(norm_read[0].get(norm_read[1])[0]) if norm_read is not None
                else float(self._norm) if self._norm is not None else None)
        self._norm = None
        if answer is not None and answer.read():
            return self._triggered_audit(step, norm, sentinel=answer.ranks() is not None)
        if norm is not None:
            if len(self.norms) >= TRIGGER_WARMUP:
                self.scores.append(drift_score(norm, self.norms))
            self.norms.append(norm)
        self.verified(step)
        return Verdict()

    def _triggered_audit(self, step: int, norm: float | None, *, sentinel: bool) -> Verdict:
        """Audit ``step`` now: every rank recomputes its own batch and its neighbour's; the
        ring is judged on those, and each rank's recomputed norm is compared with the one it
        took. ``sentinel``: the vote left its sentinel in the reduced gradients, so the step
        is withheld whatever the audit finds."""
        self.triggered.append(step)
        nxt = (self.rank + 1) % self.world
        self._save_step_buffers()
        again = self._replay(self.rank, step, "arbitrate")
        self._replayed = self._replay(nxt, step, "replay")
        self._at_step_buffers = False
        self._own_sketch, self._calibration = again, []
        vote = self._vote
        self._extra = [math.nan if norm is None else norm,
                       float(bool(vote)) if isinstance(vote, bool) or vote is None
                       else float(vote.item())]
        try:
            words = self._gather_rows(step)
        finally:
            self._replayed, self._extra = None, []
        w, tol = self.sketch.width, self._tol()
        own = [row[0] for row in words]
        rep = [row[1] for row in words]
        sent = [row[2][0] for row in words]
        votes = [r for r in range(self.world) if words[r][2][1] > 0]
        back = [_norm_of(own[r], w) for r in range(self.world)]
        # the trigger's norm is taken in the gradients' precision: compared at the ceiling
        moved = [r for r in range(self.world)
                 if not _close_norm(back[r], sent[r], max(tol, CEILING))]
        found = self.judge(step, words)
        record: dict[str, Any] = {
            "event": "replay_trigger", "step": step, "votes": votes, "norms": sent,
            "recomputed": back}
        n = self.world
        # a norm that did not come back on a rank whose batch reproduces on two ranks
        passing = [r for r in moved
                   if float(self._apart(rep[(r - 1) % n], own[r])) <= tol and not any(
                       r in d.suspect_ranks for d in found)]
        if passing:
            found += self._detections(
                step, {r: True for r in passing}, [],
                {"mode": "tolerant", "trigger": record, "tolerance": tol, "not_back": passing},
                head=f"the local gradient norm of rank(s) {passing} was out of its band and "
                "did not come back when recomputed, while the batch reproduces on the rank "
                "and its neighbour")
        record["outcome"] = ("fault found" if found else
                             "reproduced on every rank: the batch's own, no suspect")
        self._records.append(record)
        if found:
            self.tainted()
        else:
            self.verified(step)
        return Verdict(found, withhold=bool(found) or sentinel)

    def _own_vector(self) -> torch.Tensor:
        """This rank's own sketch, once its gradients are all seen (the audit stops watching)."""
        if self._own_sketch is None:
            self._own_sketch = self.sketch.of(_loss_sum(self._own_losses, self.device),
                                              self._own_rows)
            self._observing = False
        return self._own_sketch

    def _send_replayed(self) -> None:
        self._finish_exchange()
        self._post(self._replayed)

    def ask(self, step: int, read: StepRead) -> None:
        if self.due(step):
            super().ask(step, read)
            return
        if self._answer is not None:
            self._answer.ask(read)
        if self._norm is not None and not on_host(self._norm):
            self._norm_read = (read, read.ask(self._norm))

    def pre_step(self, step: int) -> Verdict:
        if not self.due(step):
            return self._trigger_pre_step(step)
        calibrated = self.tolerance is not None
        self._settle_groups()
        try:
            verdict = super().pre_step(step)
        finally:
            dist_now, self._distance = self._distance, None
        clean = not verdict.detections and not verdict.withhold  # alike on every rank
        if calibrated and self.world > 1 and clean:
            if dist_now is not None:
                self._recent.append(dist_now)
            self._clean_audits += 1
            if self._clean_audits >= ROLLING_AUDITS:
                self._roll(step)
        return verdict

    def _roll(self, step: int) -> None:
        """The tolerance's rolling update (module doc): every rank's median and largest edge
        distance over its recent clean audits, gathered; ``MARGIN`` times the lower median of
        the medians (in half precision at least ``TAIL`` times the tail seen), between
        ``FLOOR`` and the ceiling (above it: refused, logged). Collective."""
        recent, self._recent, self._clean_audits = self._recent, [], 0
        nan = torch.tensor(math.nan, dtype=torch.float64, device=self.device)
        kept = torch.stack(recent).to(torch.float64).reshape(-1) if recent else None
        med = kept.median() if kept is not None else nan
        top = (torch.where(torch.isfinite(kept), kept, torch.full_like(kept, -math.inf)).max()
               if kept is not None else nan)  # no finite distance: -inf, left out below
        mine = torch.stack([med.reshape(()), top.reshape(()),
                            torch.tensor(float(step), dtype=torch.float64, device=med.device)])
        rows = all_gather_rows(mine, self.group).cpu()
        differ = steps_disagree([int(v) for v in rows[:, 2].tolist()])
        if differ is not None:
            raise ValueError(f"replay audit: the ranks are not at one step ({differ}); "
                             f"{STEPS_FIX}")
        medians = [float(v) for v in rows[:, 0].tolist()]
        maxima = [float(v) for v in rows[:, 1].tolist()]
        seen = sorted(v for v in medians if math.isfinite(v))
        if not seen:
            return
        tol = max(FLOOR, MARGIN * seen[(len(seen) - 1) // 2])
        tops = sorted(v for v in maxima if math.isfinite(v))
        if self.half and tops:
            self._tail = max(self._tail, tops[len(tops) // 2 if len(tops) > 2 else 0])
            tol = max(tol, TAIL * self._tail)
        self._windows += 1
        ceiling = self._ceiling()
        accepted = tol <= ceiling
        early = self.half and self._windows < HALF_WINDOWS
        before = self.tolerance
        if accepted and not early:
            self.tolerance = tol
        record = {
            "event": "replay_calibration", "kind": "rolling", "step": step, "tolerance": tol,
            "accepted": accepted, "before": before, "margin": MARGIN, "floor": FLOOR,
            "ceiling": ceiling, "audits": ROLLING_AUDITS, "rank_medians": medians,
            "detail": ("tolerance rolled: MARGIN times the lower median of the ranks' median "
                       "edge distances over their recent clean audits" if accepted else
                       "rolling update refused: the recent distances are above the ceiling "
                       "(the tolerance stays)")}
        if self.half:
            record.update(half_precision=True, tail=TAIL, tail_seen=self._tail,
                          rank_maxima=maxima, windows=self._windows, detail=(
                f"half precision: the tail is measured over {HALF_WINDOWS} windows of clean "
                f"audits before the tolerance leaves the ceiling (window {self._windows}); "
                "the audit compares at the ceiling" if early and accepted else
                "tolerance rolled (half precision): the larger of MARGIN times the lower "
                "median of the ranks' median edge distances over their recent clean audits and "
                "TAIL times the largest median of their largest seen in any such window"
                if accepted else
                record["detail"]))
            if early:
                record["accepted"] = False
        self._records.append(record)
        if not accepted:
            self._warn_noisy(tol, ceiling)

    def _warn_noisy(self, tol: float, ceiling: float) -> None:
        """One WARNING per audit (on rank 0) when the recomputations differ by more than the
        ceiling: the audit then compares below their noise and its detections may be the
        kernels' roundings."""
        if self._warned or self.rank != 0:
            return
        self._warned = True
        _log.warning(
            "replay audit (tolerant): recomputations of a batch differ by %.3g of a "
            "component's scale, above the ceiling %.3g%s; the audit compares below their "
            "noise and may name healthy ranks. Use deterministic kernels with "
            "replay_mode='exact', or replay_interval=0 (docs/checks/replay.md, Tolerant "
            "mode).", tol, ceiling, " (products in half precision)" if self.half else "")

    def _set_half(self, seen: bool) -> None:
        """``half`` from what the calibration's recomputation produced, alike on every rank (a
        small all-reduce, once per calibration)."""
        flag = torch.tensor([int(seen)], dtype=torch.int64, device=self.device)
        if self.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.half = bool(int(flag.item()))

    def _ceiling(self) -> float:
        """The largest tolerance accepted: ``CEILING``, or ``CEILING_HALF`` where the model's
        products run in half precision (``half``)."""
        return CEILING_HALF if self.half else CEILING

    def _settle_groups(self) -> None:
        """This audit step's buckets as the comparison's groups, once every one is seen (the
        last bucket's veto, or ``pre_step``); a parameter in none of them (not in a bucket
        this step) makes a group of its own. Kept for the steps that see no bucket (a
        triggered audit's). Only in half precision, where the audit compares per bucket."""
        if not self.half or not self._step_groups:
            return
        groups = [tuple(v) for _, v in sorted(self._step_groups.items()) if v]
        seen = {i for g in groups for i in g}
        groups += [(i,) for i in range(self.sketch.count) if i not in seen]
        found = tuple(groups)
        if found != self._groups:
            self._groups = found
            owner = torch.empty(self.sketch.count, dtype=torch.int64)
            for g, members in enumerate(found):
                owner[list(members)] = g
            self._group_of = {owner.device: owner}

    def _grouped(self, v: torch.Tensor) -> torch.Tensor:
        """A sketch vector per group of parameters (``_groups``): the loss, then per group the
        norm of its gradients together and the sums of their projections (each parameter's
        projections are drawn independently: their sum is a projection of the group's
        gradients end to end). A NaN stays in its group. The verdicts' vectors are on the
        host, where ``index_add_`` adds in a fixed order: the same numbers on every rank."""
        assert self._groups is not None
        w = self.sketch.width
        rows = v[1:].reshape(-1, w)
        parts = torch.cat([rows[:, :1].square(), rows[:, 1:]], 1)
        acc = torch.zeros(len(self._groups), w, dtype=v.dtype, device=v.device)
        owner = self._group_of.get(v.device)
        if owner is None:
            owner = self._group_of[v.device] = next(iter(self._group_of.values())).to(v.device)
        acc.index_add_(0, owner, parts)
        acc[:, 0] = acc[:, 0].sqrt()
        return torch.cat([v[:1], acc.reshape(-1)])

    def _per_group(self) -> bool:
        """Compare per bucket rather than per parameter? In half precision under DDP, where
        the buckets are known: a small parameter's gradient (a norm's weight, a bias) carries
        the roundings of the products it passes through at a far larger share of its own
        norm than a bucket's gradients do of theirs, and per parameter the audit misfires
        (``docs/checks/replay.md``, "In half precision")."""
        return self.half and self._groups is not None

    def _apart(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``distance`` of two sketch vectors as the audit compares them: per parameter, or
        per bucket (``_per_group``)."""
        if self._per_group():
            return distance(self._grouped(a), self._grouped(b), self.sketch.width)
        return distance(a, b, self.sketch.width)

    def _component(self, a: torch.Tensor, b: torch.Tensor) -> str:
        """Where two sketch vectors differ most, in words (a parameter's, or a bucket's
        component)."""
        w = self.sketch.width
        if not self._per_group():
            return component(int(differences(a, b, w).argmax()), w, self.names)
        assert self._groups is not None
        i = int(differences(self._grouped(a), self._grouped(b), w).argmax())
        if i == 0:
            return "the loss"
        g, k = divmod(i - 1, w)
        members = [self.names[j] for j in self._groups[g]]
        return f"bucket {g}'s gradients ({', '.join(members[:3])}" + (
            f" and {len(members) - 3} more" if len(members) > 3 else "") + "): " + (
            "norm" if k == 0 else f"projection {k}")

    def _far(self) -> torch.Tensor:
        """Does the replay of this rank's batch (the previous rank's, or this rank's own with
        one rank) differ from its own step by more than the tolerance? (0-d bool; the
        distance is kept for the rolling update)"""
        other = self._peer if self.world > 1 else self._replayed
        self._distance = self._apart(self._own_vector(), other)
        return self._distance > self._tol()

    def veto(self) -> Flag | None:
        if not self._observing:  # not an audit step: the trigger's vote, if it is on
            return self._trigger_vote() if self.trigger else None
        if not self._contain or not self._exchange:
            return None
        self._finish_exchange()
        self._veto_asked = True
        self._settle_groups()
        far = self._far()
        return bool(far) if on_host(far) else far

    def before_last_allreduce(self) -> None:
        if self._observing and not self._contain:  # the agreement word (no veto)
            self._send_words()

    def _send_words(self) -> None:
        if not self._observing or self._replayed is None or self._pending is not None:
            return
        self._post_due()
        self._finish_exchange()
        self._pending = PendingSum(self._far().to(torch.int64).reshape(1), self.group)

    # -- verdict ---------------------------------------------------------------------------
    def _gather_rows(self, step: int) -> list[list[Any]]:
        """Every rank's own and replayed sketches (row r: rank r's, on the host), gathered with
        its step and, at a calibration, its recomputations (which set the tolerance here)."""
        size = self.sketch.size()
        extra = torch.tensor([*self._extra, float(step)], dtype=torch.float64,
                             device=self.device)
        mine = torch.cat([self._own_vector(), self._replayed, *self._calibration, extra])
        rows = all_gather_rows(mine, self.group).cpu()
        differ = steps_disagree([int(v) for v in rows[:, -1].tolist()])
        if differ is not None:
            raise ValueError(f"replay audit: the ranks are not at one step ({differ}); "
                             f"{STEPS_FIX}")
        own, rep = rows[:, :size], rows[:, size:2 * size]
        tail = rows[:, rows.shape[1] - 1 - len(self._extra):-1]
        if self._calibration:
            calib = rows[:, 2 * size:rows.shape[1] - 1 - len(self._extra)].reshape(
                self.world, -1, size)
            self._calibrate(step, own, rep, calib)
        tol = self._tol()
        if (self.world > 1 and all(float(self._apart(rep[r], own[r])) <= tol
                                   for r in range(self.world))
                and any(float(self._apart(own[r], own[(r + 1) % self.world])) > tol
                        for r in range(self.world))):
            raise own_batch_error(step)
        return [[own[r], rep[r], tail[r].tolist()] for r in range(self.world)]

    def judge(self, step: int, words: list[list[Any]]) -> list[Detection]:
        """The detections, if any, from every rank's own and replayed sketches (row r: rank
        r's): the exact audit's localisation, with the diagnosis by reruns (module doc)."""
        n, tol = self.world, self._tol()
        own = [row[0] for row in words]
        rep = [row[1] for row in words]
        gaps = [float(self._apart(rep[r], own[(r + 1) % n])) for r in range(n)]
        bad = [g > tol for g in gaps]
        self._unstable = False
        if not any(bad):
            return []
        evidence: dict[str, Any] = {
            "mode": "tolerant", "tolerance": tol, "edge_distances": gaps,
            "bad_edges": [[r, (r + 1) % n] for r in range(n) if bad[r]],
            "farthest": {str(r): self._component(rep[r], own[(r + 1) % n])
                         for r in range(n) if bad[r]},
        }
        if n > 2 and all(bad):
            return [every_edge_detection(step, evidence, self.module)]
        if n > 2:
            doubles = [f for f in range(n) if bad[(f - 1) % n] and bad[f]]
            singles = [a for a in range(n)
                       if bad[a] and not bad[(a - 1) % n] and not bad[(a + 1) % n]]
        else:  # two ranks: each bad edge on its own, without a third opinion
            doubles, singles = [], [a for a in range(n) if bad[a]]
        tasks: list[tuple[int, int, int]] = [(f, f, 0) for f in doubles]  # (owner, by, k)
        for a in singles:
            b = (a + 1) % n
            for by in dict.fromkeys((b, a, (b + 1) % n)):
                tasks += [(b, by, k) for k in range(DIAGNOSIS_RERUNS)]
        got = self._rerun(step, list(dict.fromkeys(tasks)))

        def close(x: torch.Tensor, y: torch.Tensor) -> bool:
            return float(self._apart(x, y)) <= tol

        named: dict[int, bool] = {}  # rank -> transient
        verdicts: dict[str, Any] = {}
        for f in doubles:  # two batches wrong on one rank: its fault
            transient = not close(got[(f, f, 0)], own[f])
            named[f] = transient and named.get(f, True)
            verdicts[f"rank {f}"] = {"edges": [[(f - 1) % n, f], [f, (f + 1) % n]],
                                     "own_rerun_came_back": not transient}
        unresolved: list[list[int]] = []
        unstable: list[list[int]] = []
        for a in singles:
            b = (a + 1) % n
            reruns = [(by, x) for (owner, by, _), x in got.items() if owner == b]
            who, lasting, verdict = diagnose(a, b, own[b], rep[a], reruns, close)
            if verdict == "unstable":
                unstable.append([a, b])
            elif who is None:
                unresolved.append([a, b])
            verdicts[f"edge {a}"] = {"edge": [a, b], "blames": who, "verdict": verdict,
                                     "reruns_per_rank": DIAGNOSIS_RERUNS}
            if who is not None:
                named[who] = (not lasting) and named.get(who, True)
        evidence["diagnosis"] = verdicts
        if unstable:
            evidence["unstable_edges"] = unstable
            self._records.append({
                "event": "replay_unstable", "step": step, "edges": unstable,
                "detail": "a recomputation's result and the other's both recur on other ranks: "
                "the batch's own numerics (a value at the edge of a ReLU's gate, of an "
                "overflow) under non-deterministic kernels, no fault; the step is withheld when "
                "the owner's veto already stopped it", "evidence": evidence})
        if not named and not unresolved:
            self._unstable = bool(unstable)
            return []
        return self._detections(step, named, unresolved, evidence)

    def _withhold_anyway(self) -> bool:
        """An unstable edge alone: no detection, but a veto already put its sentinel in the
        step's reduced gradients, so the step is withheld (on every rank: every rank judged
        alike)."""
        unstable, self._unstable = self._unstable, False
        return unstable and self._veto_asked

    def _detections(self, step: int, named: dict[int, bool], unresolved: list[list[int]],
                    evidence: dict[str, Any], head: str | None = None) -> list[Detection]:
        """One detection for the ranks named with a fault that came back (or a transient
        within the repair window), one for those named transient; one naming no one when
        nobody was named."""
        repeat = []
        for r in sorted(named):
            if named[r]:
                recent = [s for s in self.strikes.get(r, []) if step - s < self.repair_window_steps]
                self.strikes.setdefault(r, []).append(step)
                if recent:
                    named[r] = False
                    repeat.append(r)
        lasting = tuple(r for r in sorted(named) if not named[r])
        passing = tuple(r for r in sorted(named) if named[r])
        if head is None:
            head = ("replayed sketches differ beyond the tolerance on ring edges "
                    f"{evidence['bad_edges']}")
        tail = f"; the diagnosis could not decide edges {unresolved}" if unresolved else ""
        out = []
        if lasting:
            detail = f"{head}; localised to rank(s) {list(lasting)}, whose result came back"
            if repeat:
                detail += (f" (rank(s) {repeat} named transient or repaired within "
                           f"{self.repair_window_steps} steps before: a lasting fault)")
            out.append(Detection("replay", step, lasting, detail=detail + tail,
                                 evidence=evidence))
        if passing:
            out.append(Detection(
                "replay", step, passing, transient=True, evidence=evidence,
                detail=f"{head}; rank(s) {list(passing)} computed wrong once: recomputed on "
                "the same rank the result came out right (a transient fault: no quarantine)"
                + tail))
        if not out:
            out.append(Detection("replay", step, (), evidence=evidence,
                                 detail=head + "; no rank's hardware is to blame: the reruns "
                                 "did not single one out" + tail))
        return out

    def _rerun(self, step: int, tasks: list[tuple[int, int, int]]
               ) -> dict[tuple[int, int, int], torch.Tensor]:
        """Each (owner, by, k) task's sketch: ``by`` recomputes ``owner``'s batch of ``step``
        (its k-th time; one gather for all of them)."""
        size = self.sketch.size()
        mine = torch.zeros(len(tasks) * size, dtype=torch.float64, device=self.device)
        for i, (owner, by, _) in enumerate(tasks):
            if by == self.rank:
                mine[i * size:(i + 1) * size] = self._replay(owner, step, "arbitrate")
        rows = all_gather_rows(mine, self.group).cpu()
        return {task: rows[task[1], i * size:(i + 1) * size] for i, task in enumerate(tasks)}
