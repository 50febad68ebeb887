"""Check "replay" under FSDP2 and HSDP: the ring replay through the sharded model.

The audit is the DDP one (``sdc_guard.checks.replay``: the ring, the four words per rank,
the point-to-point exchange, the owner's veto, the gather, the localisation and the
arbitration); what changes is how a neighbour's batch is recomputed and what is compared.

**Recomputation, on every rank at once.** Under ``fully_shard`` no rank holds the whole
model: a forward all-gathers each module's parameters from every shard rank, a backward
all-gathers them again and hands each module's local, unsharded gradients to the
reduce-scatter. So the recomputation cannot run on one rank alone. On an audit step every
rank r recomputes its ring neighbour's ((r + 1) mod N) micro-batches together, through the
FSDP2 root, inside ``FSDPBackend.recomputing()``: the listeners see each module's local
gradients as in a step, but nothing is reduced (zero shards; HSDP's replicate all-reduce
off). Each micro-batch runs on the owner's random stream (``rng_stream(seed, owner, step,
micro)``), the micro-batches before the last without gradient sync, as the guard's step
runs them. The sharded gradients are put back as they were afterwards (the step's own
backward starts from none; an arbitration, which runs after that backward, leaves the
step's gradients in place), and so are the module's buffers and its RNG.

**What is compared.** The owner's own loss bits and a digest of its local unsharded
gradients, taken in the reduce-scatter of its own step (``local``: one ``ShardChunk`` per
``fully_shard`` module, before the reduction), against the replaying rank's loss and the
same digest of the chunks its recomputation produced. The gradient word is the linear word
digest (``sdc_guard.fingerprints.digest``) of every chunk's buffer, chunk i laid at word
offset ``i * 2**40`` (each module's buffer padded to 2**40 words): the sum does not depend
on the order in which the modules' reduce-scatters run.

**Micro-batches.** As under DDP the comparison is on the step's accumulated gradients:
FSDP2 accumulates the local unsharded gradients of the micro-batches before the last and
reduce-scatters their sum in the last backward, which is the buffer both sides digest. A
fault in any micro-batch changes that sum.

**Arbitration.** A single bad edge a -> b is arbitrated by t = b + 1 replaying b's batch,
as under DDP; because the recomputation is collective, every rank recomputes b's batch
with it (each rank's result but t's is left unused).

**Tolerant mode** (``GuardConfig(replay_mode="tolerant")``, ``FSDPTolerantReplayAudit``): the
tolerant audit of ``replay_tolerant`` (a float64 sketch within a calibrated tolerance, the
diagnosis by reruns, the trigger between audits) with the sketch taken per chunk: each
``fully_shard`` module's local gradient buffer is one gradient of the sketch (its norm and
projections), so both sides sketch the same buffers whichever order the reduce-scatters
run in. The diagnosis's reruns are collective too, which makes them cheaper than under
DDP: one recomputation of b's batch, on every rank at once, gives b's, a's and the third
rank's result of it together (each rank's on its own hardware), so ``DIAGNOSIS_RERUNS``
recomputations of it give every rerun the diagnosis asks for. The trigger's norm is
taken from the chunks before their reduce-scatters, and its vote rides the step's last
one, as the audit's veto does.

Blind spots are those of the DDP audit (transient faults on steps not audited), and the
reduce-scatter itself and HSDP's all-reduce are outside what this check compares (the
non-finite check and, under HSDP, the weights vote see the reduced shards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from sdc_guard.checks.replay import (
    ReplayAudit,
    Word,
    _loss_word,
    _probed,
    _refuse_sync_batchnorm,
    _same_buffer,
    add_words,
)
from sdc_guard.checks.replay_tolerant import TolerantReplayAudit, _loss_sum
from sdc_guard.collectives import all_gather_rows
from sdc_guard.determinism import buffers_set
from sdc_guard.fingerprints.digest import host_concat_digest, tensors_digest
from sdc_guard.hostread import on_host
from sdc_guard.parallel.base import Bucket
from sdc_guard.types import BatchFor, LossFn, fetch_micro_batches

if TYPE_CHECKING:
    from sdc_guard.parallel.fsdp import FSDPBackend

CHUNK_STRIDE_BITS = 40
"""Chunk i's buffer lies at word offset ``i << CHUNK_STRIDE_BITS`` in the gradient word."""


def chunk_word(buf: torch.Tensor, index: int, device: torch.device) -> Word:
    """Chunk ``index``'s share of the gradient word: the digest of its buffer at word
    offset ``index << CHUNK_STRIDE_BITS`` (an unsigned int from the C kernel on the CPU,
    else a 0-d int64 tensor on ``device``)."""
    flat = buf.reshape(-1)
    offset = index << CHUNK_STRIDE_BITS
    if on_host(device):
        host = host_concat_digest([(flat, offset)])
        if host is not None:
            return host
    return tensors_digest([flat], [offset], device)


class FSDPReplayAudit(ReplayAudit):
    """The ring replay audit of a ``fully_shard`` model (FSDP or HSDP); see the module doc."""

    veto_early = True
    """The own words are complete once the step's last reduce-scatter input is digested
    (``local`` runs before the backend carries the veto) and the replayed words arrived by
    then: the veto rides that reduction, with no word of its own."""

    def __init__(
        self,
        model: nn.Module,
        *,
        interval: int,
        loss_fn: LossFn,
        batch_for: BatchFor,
        backend: FSDPBackend,
        seed: int,
        micro_batch_count: int,
        group: dist.ProcessGroup | None = None,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        contain: bool = True,
    ) -> None:
        self._init_state(model, interval=interval, loss_fn=loss_fn, batch_for=batch_for,
                         backend=backend, seed=seed, micro_batch_count=micro_batch_count,
                         group=group, scale=scale, contain=contain,
                         device=next(model.parameters()).device)
        _refuse_sync_batchnorm(model)
        self._fsdp = backend
        self._replaying = False
        """Inside a recomputation: the chunks the backend shows are the replay's."""
        self._replay_grad: Word | None = None
        backend.subscribe(self)

    # -- the chunks, of the step or of a recomputation --------------------------------------
    def local(self, bucket: Bucket) -> None:
        """On audit steps, the chunk's share of the own gradient word (or, inside a
        recomputation, of the replayed one), digested here: FSDP2 has no scaling pass."""
        if self._replaying:
            self._replay_grad = add_words(self._replay_grad,
                                          chunk_word(bucket.buffer(), bucket.index(),
                                                     self.device))
        elif self._observing:
            self._buckets += 1
            self._post_due()  # the exchange waits for the step's first reduce-scatter
            self._add_own(chunk_word(bucket.buffer(), bucket.index(), self.device))
        return None

    def _replay_start(self) -> None:
        """Before a recomputation: nothing of its chunks seen yet."""
        self._replay_grad = None

    def _replay_result(self, losses: list[torch.Tensor]) -> Any:
        """What a recomputation reports, once its chunks are seen: the loss and gradient
        words (the tolerant audit: a sketch)."""
        grad = self._replay_grad
        return _loss_word(losses), grad if grad is not None else 0

    def _check_complete(self, step: int) -> None:
        """Nothing to refuse: FSDP2 reduce-scatters every module whose parameters got
        gradients, in the step and in the recomputation alike."""

    # -- recomputation ----------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Every rank replays its neighbour's micro-batches of ``step`` at once, through the
        sharded model, from the pre-step weights; then watches its own losses and local
        gradients. The replayed words go to their owner (point to point) with the step's
        first reduce-scatter, as under DDP with its first bucket (``_send_replayed``), or
        right away when the model is one ``fully_shard`` module (the first is the last)."""
        self._own_grad = None
        self._own_losses = []
        self._replayed = None
        self._own_cache = None
        self._row_cache = None
        self._pending = None
        self._veto_asked = False
        self._buckets = 0
        self.phase = "train"
        self._observing = False
        self._replay_at_start(step)

    def _replay_first(self, step: int) -> None:
        """``begin_step``'s recomputation of the neighbour's batch, and its exchange."""
        self._save_step_buffers()
        self._replayed = self._replay((self.rank + 1) % self.world, step, "replay")
        self._at_step_buffers = False  # the owner's forward comes next
        self._observing = True
        if not self._buffers_checked:
            self._check_buffers()
        if self._exchanges:
            if self._many_buckets and self.exchange_with_first_bucket:
                self._send_due = True
            else:
                self._send_replayed()

    def _replay(self, rank: int, step: int, phase: str) -> Any:
        """What ``rank``'s micro-batches of ``step`` give here (``_replay_result``: the loss and
        gradient words), recomputed by every rank together (collective: each rank passes the
        owner it replays)."""
        self.phase = phase
        buffers = self._buffers_for_replay()
        self._replay_start()
        try:
            batches = fetch_micro_batches(self.batch_for, rank, step, self.micro)
            if not _probed(self.batch_for):
                self._probe(batches, rank, step)
            self._replaying = True
            losses = self._fsdp.recompute(batches, self.loss_fn, owner=rank, step=step,
                                          seed=self.seed, scale=self.scale)
        finally:
            self._replaying = False
            if not self._buffers_checked:
                self._changed = [q for m, n, q, value in buffers if q in self._watched
                                 and not _same_buffer(m._buffers.get(n), value)]
            buffers_set(self.module, buffers)
            self.phase = "train"
        return self._replay_result(losses)

    def _arbiter_replay(self, owner: int, arbiter: int, step: int) -> tuple[Word, Word] | None:
        """Every rank recomputes ``owner``'s batch (the forward communicates); the arbiter's
        words are the ones that count."""
        words = self._replay(owner, step, "arbitrate")
        return words if arbiter == self.rank else None

    def _check_buffers(self) -> None:
        """On the first audit step of a model with buffers outside its norm layers: did the
        training forward change any (a running normaliser, an EMA codebook)? FSDP2 keeps each
        rank's buffers its own (no broadcast), so such a buffer drifts apart across ranks
        with their batches, and every audit would convict a healthy rank. Decided on every
        rank alike: one small all-reduce, once."""
        self._buffers_checked = True
        changed = torch.tensor([int(bool(self._changed))], dtype=torch.int64,
                               device=self.device)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        if not int(changed.item()):
            return
        names: Any = self._changed or "(on another rank)"
        raise ValueError(
            f"replay audit: the training forward updates buffers {names} outside the norm "
            "layers, and FSDP2 does not keep buffers equal across ranks: each rank's drift "
            "apart with its own batches, so no other rank can recompute the owner's step. "
            "Compute them from the parameters, keep them fixed during training, or set "
            "replay_interval=0.")


class FSDPTolerantReplayAudit(TolerantReplayAudit, FSDPReplayAudit):
    """The tolerant replay audit of a ``fully_shard`` model (FSDP or HSDP): the sketch per
    chunk, the reruns collective; see the module doc."""

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        qualified = {id(m): name for name, m in model.named_modules()}
        self.names = [qualified.get(id(m)) or "the root module" for m in self._fsdp.modules]
        """Each chunk's module, by ``ShardChunk.index``: what the sketch's rows are of."""
        self._replay_rows: list[torch.Tensor | None] = []

    def _sketched(self) -> list[int]:
        """One gradient per ``fully_shard`` module: its reduce-scatter buffer."""
        return self._fsdp.chunk_sizes()

    def local(self, bucket: Bucket) -> None:
        """A chunk's sketch row: the own step's on audit steps, the recomputation's inside
        one; on the other steps its share of the trigger's norm."""
        if self._replaying:
            self._replay_rows[bucket.index()] = self.sketch.row(
                bucket.index(), bucket.buffer().reshape(-1))
        elif self._observing:
            self._buckets += 1
            self._post_due()  # the exchange waits for the step's first reduce-scatter
            self._own_rows[bucket.index()] = self.sketch.row(
                bucket.index(), bucket.buffer().reshape(-1))
        elif self.trigger and not self.due(self._backend.step):
            self._add_norm(bucket)
        return None

    def _replay_start(self) -> None:
        self._replay_rows = [None] * self.sketch.count

    def _replay_result(self, losses: list[torch.Tensor]) -> torch.Tensor:
        rows, self._replay_rows = self._replay_rows, []
        return self.sketch.of(_loss_sum(losses, self.device), rows)

    def _rerun(self, step: int, tasks: list[tuple[int, int, int]]
               ) -> dict[tuple[int, int, int], torch.Tensor]:
        """Each (owner, by, k) task's sketch. A recomputation is collective, so each rank
        recomputes ``owner``'s batch in every one of them: the k-th recomputation of it gives
        every rank's k-th result at once (one gather for all)."""
        runs = list(dict.fromkeys((owner, k) for owner, _, k in tasks))
        size = self.sketch.size()
        mine = (torch.cat([self._replay(owner, step, "arbitrate") for owner, _ in runs])
                if runs else torch.zeros(0, dtype=torch.float64, device=self.device))
        rows = all_gather_rows(mine, self.group).cpu()
        at = {run: i * size for i, run in enumerate(runs)}
        return {(owner, by, k): rows[by, at[owner, k]:at[owner, k] + size]
                for owner, by, k in tasks}
