"""The backend seam: what a kind of data parallelism offers the checks, and what they may ask.

A *backend* owns three things the checks need and must not reach for themselves:

- **how gradients are observed and reduced**: it shows each rank's local gradients before
  the reduction and the reduced result after it, one ``Bucket`` at a time, as events to the
  ``GradientListener`` objects that subscribed (DDP: its comm hook's buckets);
- **the containment channel**: once per step, before the step's last gradient reduction,
  it asks every listener that wants to whether this rank withholds the step (``veto``), and
  hands each of them one ``Containment`` answer that every rank reads alike (``vetoed``);
- **which ranks hold the same state** (``layout``): DDP's replicas are the whole process
  group; under FSDP each rank holds a shard of its own; under HSDP each shard has its
  replicas across the replicate dimension of the mesh.

The checks know only this module; ``sdc_guard.parallel.ddp`` is the implementation for
``DistributedDataParallel``, ``sdc_guard.parallel.fsdp`` the one for FSDP2's
``fully_shard`` (FSDP and HSDP). docs/architecture.md draws the seam.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from sdc_guard.hostread import StepRead
    from sdc_guard.scaling import Flag, RowSums, SketchRequest, Spans


@dataclass(frozen=True)
class Layout:
    """Which ranks hold the same state: what the weights check votes within.

    ``sets[j]`` are the ranks (numbered in the backend's ``group``) that hold part ``j`` of
    the state alike, in rank order; this rank holds part ``part``. DDP: one part, every rank.
    FSDP over N ranks: N parts of one rank each (nothing to vote with). HSDP over an R x S
    mesh: S parts (the shards) of R replicas each."""

    sets: tuple[tuple[int, ...], ...]
    part: int
    replica_group: dist.ProcessGroup | None
    """The group of the ranks in ``sets[part]`` (a repair broadcasts within it); None where
    the part has one rank, or where it is the backend's whole group (DDP)."""

    @classmethod
    def replicated(cls, world: int) -> Layout:
        """Every rank a replica of the same state (DDP)."""
        return cls((tuple(range(world)),), 0, None)

    @property
    def sharded(self) -> bool:
        """Do the ranks hold different parts (the reduced gradients then differ per rank,
        and a per-rank verdict on them must travel to every rank before it withholds)?"""
        return len(self.sets) > 1

    @property
    def replicas(self) -> int:
        """How many ranks hold each part (1: pure FSDP, no replica to compare with)."""
        return min(len(s) for s in self.sets)

    def part_of(self, rank: int) -> int:
        """The part ``rank`` holds."""
        return next(j for j, s in enumerate(self.sets) if rank in s)

    def computes_with(self, rank: int) -> tuple[int, ...]:
        """The ranks whose forward and backward use ``rank``'s part of the state: one of each
        part's holders, the ``i``-th where ``rank`` is its part's ``i``-th (HSDP: ``rank``'s
        shard group, which gathers its parameters from those parts). DDP: ``rank`` alone."""
        if len(self.sets) == 1:
            return (rank,)
        i = self.sets[self.part_of(rank)].index(rank)
        return tuple(sorted(s[i] for s in self.sets if i < len(s)))


class Bucket(Protocol):
    """One flat buffer of a rank's gradients, as ``torch.distributed.GradBucket`` shows it."""

    def buffer(self) -> torch.Tensor: ...

    def index(self) -> int: ...

    def is_last(self) -> bool: ...

    def parameters(self) -> list[torch.Tensor]: ...

    def gradients(self) -> list[torch.Tensor]: ...


class Containment(Protocol):
    """The step's containment answer, the same on every rank (``GradientListener.vetoed``)."""

    def ask(self, read: StepRead) -> None:
        """Have the answer come in the step's one read (``sdc_guard.hostread``); ``read``
        then costs no read of its own."""
        ...

    def read(self, *, expect_overflow: bool = False) -> bool:
        """Did some rank withhold this step? One host read the first time (a sync on a
        device), the same answer after. ``expect_overflow``: a ``GradScaler`` skips steps
        whose gradients overflow by itself, so a non-finite value that could hide a veto is
        not one."""
        ...

    def ranks(self) -> tuple[int, ...] | None:
        """The ranks that withheld, where the answer names them (a sentinel: one slot per
        rank); None where it only counts them (a word)."""
        ...


class DigestSpans(Protocol):
    """Which words of a bucket a listener wants digested, and how to digest them without
    the C kernel (the same value, by torch ops)."""

    @property
    def spans(self) -> Spans: ...

    def digest(self, buf: torch.Tensor) -> torch.Tensor: ...


class GradientListener:
    """The events a check can subscribe to (``Backend.subscribe``). Every method is optional.

    The backend calls these and nothing else; a listener never calls back into the backend.
    Per bucket, in this order: ``local``, ``row_sums``, ``sketches``, (the backend's scaling
    pass), ``after_scaling``; on the step's last bucket ``before_last_allreduce`` and
    ``veto``; then ``vetoed`` with the step's containment answer; after the reduction,
    ``reduced``.
    """

    wants_flag: bool = False
    """Set to have the scaling pass flag NaN/Inf in each local bucket (``after_scaling``)."""

    def local(self, bucket: Any) -> DigestSpans | None:
        """The local words, before the scaling pass (read only). Return spans to have the
        pass digest them (their digest comes to ``after_scaling``)."""
        return None

    def row_sums(self, bucket: Any) -> list[RowSums] | None:
        """Matrices in the local bucket (2-D views into its buffer) whose float32 row sums,
        before the scaling, the pass should write into the tensors given with them (ready
        in ``after_scaling``)."""
        return None

    def sketches(self, bucket: Any) -> SketchRequest | None:
        """Gradients in the local bucket whose sketch rows (the tolerant replay's), of the
        values before the scaling, the pass should take in its read where it can; the rows
        are in the request in ``after_scaling``."""
        return None

    def after_scaling(self, bucket: Any, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        """After the scaling pass: the local NaN/Inf flag (if ``wants_flag``), the digest of
        the spans ``local`` returned (an unsigned int from the C kernel, else a 0-d int64
        tensor), or None."""

    def before_last_allreduce(self) -> None:
        """Once per step, before the last bucket's reduction: every local bucket has been
        seen, and a small collective started here rides the meeting point the gradient
        reduction needs anyway."""

    def reduced(self, bucket: Any, out: torch.Tensor) -> None:
        """The bucket's reduced result, on the communication thread (read only)."""

    wants_veto: bool = False
    """Set to be asked, once per step, whether this rank withholds the step (``veto``) and
    told the answer of every rank (``vetoed``)."""

    veto_early: bool = False
    """Is the veto ready once the step's last gradient reduction is about to start (it needs
    nothing done after the backward)? A backend that learns which reduction is the step's
    last (FSDP2) then asks it there and carries the answer on that reduction, with no word
    of its own; ``reduced`` may still come after ``veto`` for that last reduction."""

    def veto(self) -> Flag | None:
        """Before the step's last gradient reduction, after ``before_last_allreduce``: True
        (or a 0-d device bool) to withhold the step on every rank; False to take part
        without withholding; None to sit this step out. None must be alike on every rank
        (a step rule), because a backend without a free channel then exchanges a word."""
        return None

    def vetoed(self, answer: Containment) -> None:
        """The step's containment answer, once per step in which ``veto`` was asked
        (``Containment.read`` gives it). Steps without a gradient reduction have none."""


BucketListener = GradientListener
"""The name the DDP comm hook's listeners had before the backend seam."""


class Backend(Protocol):
    """What ``SDCGuard`` and its checks need from a kind of data parallelism."""

    group: dist.ProcessGroup | None
    """The group every rank of the job is in: the checks' words travel within it."""
    layout: Layout
    """Which ranks of ``group`` hold the same state (the weights check votes within each set)."""
    rank: int
    world_size: int
    step: int
    """The step being computed (fault injectors read it)."""

    def subscribe(self, listener: GradientListener) -> None:
        """Send gradient events to ``listener`` from now on."""
        ...

    def unsubscribe(self, listener: GradientListener) -> None:
        """Stop sending events to ``listener`` (a check that is replaced)."""
        ...

    def begin_step(self, step: int) -> None:
        """Before the forward pass of ``step``."""
        ...

    def attach(self) -> None:
        """Observe the gradients from now on, if anything needs them (idempotent)."""
        ...

    def no_sync(self) -> AbstractContextManager[Any]:
        """Backward passes inside accumulate gradients without reducing them (the step's
        micro-batches before its last)."""
        ...

    def after_backward(self) -> None:
        """After the step's last backward, before the checks' verdicts: a backend whose
        reductions end before it knows they are the step's last asks for the veto here."""
        ...


def _dense(t: torch.Tensor) -> bool:
    """Does ``t`` fill its memory without gaps or overlaps, in some order of its dims?"""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def bucket_gradients(bucket: Bucket) -> list[torch.Tensor]:
    """The bucket's gradients as views of its buffer with their parameters' strides.

    ``GradBucket.gradients()`` views every gradient as contiguous, but DDP lays a gradient
    out in its bucket with its parameter's strides when those are dense (a transposed
    weight, a ``channels_last`` convolution): read through that view, the gradient's
    elements come in another order than its parameter's (the replay audit's gradient word
    would then differ from every recomputation's)."""
    grads, params = bucket.gradients(), bucket.parameters()
    if len(grads) != len(params):  # a sparse gradient's bucket lists no dense view
        return grads
    out = []
    for p, g in zip(params, grads, strict=True):
        if (g.layout == torch.strided and p.layout == torch.strided and p.dim() > 1
                and p.stride() != g.stride() and _dense(p)):
            g = g.as_strided(p.shape, p.stride())
        out.append(g)
    return out
