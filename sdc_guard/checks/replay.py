"""Check "replay": the ring replay audit.

On an audit step every rank r first recomputes, from the pre-step weights and
without gradient sync, the micro-batches of its ring neighbour n = (r + 1) mod N,
and digests that loss and those gradients. Then it computes its own step as
usual, keeping the bits of its own loss and a digest of its *local* gradients
(seen in the comm hook, before the all-reduce). The gradient word is the digest
of every gradient laid end to end in parameter order (``sdc_guard.fingerprints.
digest``: the fingerprint's version 2 lane sum, unmixed, which no burst at one bit
over up to 64 lanes of a gradient cancels): linear, so each DDP bucket adds its share
from its flat buffer, the
replay adds its separate gradients' shares, and the value does not depend on
the bucketing; a parameter without a gradient is zeros on both sides. On the
CPU a float32 bucket's share is computed by the comm hook's 1/world scaling
pass (the audit subscribes to the hook and hands it the bucket's spans,
``BucketListener.local``: one C pass digests the local words, scales them and
flags non-finite values), so the audit reads its own gradients no more often
than DDP does.

Each rank has four 64-bit words: its own loss and gradient words and those of
its replay. Edge r -> n is *bad* when r's replay of n's batch disagrees with
what n reported for itself.

The common case (every edge agrees) costs no collective of its own. With its
own step's first gradient bucket (right after the replay when the gradients fill
one bucket), r sends its two replayed words to n point to point, and receives
the replay of its own batch from r - 1; both travel beside the bucket
all-reduces. In the comm hook, just before the step's last
gradient all-reduce, each rank compares its own words with the replay it
received; a difference *vetoes* the step through the backend's containment
channel (``GradientListener.veto``; under DDP a sentinel in the last bucket, which
the all-reduce that runs anyway carries to every rank, or a word of its own under
a user's comm hook), and every rank withholds the step. Only then (or when a
non-finite gradient reached the sentinel, which could hide a veto) do the ranks
gather every rank's four words (``all_gather_rows``) and compare each edge bit
for bit. With ``skip_step_on_detection=False`` or with one rank, the ranks agree
instead through a one-word all-reduce started before the last gradient
all-reduce and waited for before the optimizer step: its sum is 0 exactly
when every edge agrees (``replay_term_host``).

Localisation (every rank derives the same answer from the same gathered words):

    bad edges              reading                                suspect
    ---------------------  -------------------------------------  -----------------------
    none                   all computations agree                 -
    (f-1 -> f), (f -> f+1) f computed wrong both times            f
      (two adjacent edges)   (its own batch and its neighbour's)
    (a -> b) alone         either a's replay or b's own compute   arbitration: a third
                           was hit by a transient fault           rank t = b+1 replays b's
                                                                  batch; t agrees with b
                                                                  -> a; t agrees with a's
                                                                  replay -> b; neither ->
                                                                  no suspect
    any, world size 2      no third opinion                       none (mismatch reported)

    ring of 4, fault on rank 2:     0 --ok--> 1 --BAD--> 2 --BAD--> 3 --ok--> 0
                                    two bad edges meet at 2: suspect 2

The arbitration replay happens in the same step (a second small all_gather), so
the verdict is reached before ``optimizer.step()``: the guard withholds the step
on every rank and the corrupted gradient never reaches the weights.

Blind spot, by design: a transient fault on a step that is not audited is not
seen by this check (the non-finite and weight checks still run every step).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import struct
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.checks.base import Check, Verdict
from sdc_guard.collectives import (
    COMMUNICATING_LOSS,
    STEPS_FIX,
    PendingSum,
    all_gather_rows,
    collectives_issued,
    gather_if_different,
    steps_disagree,
    words_on,
)
from sdc_guard.determinism import (
    SavedBuffers,
    buffers_saved,
    buffers_set,
    module_state_kept,
    rng_stream,
    state_tensors_written,
)
from sdc_guard.fingerprints.digest import (
    device_loss_word,
    host_concat_digest,
    host_loss_word,
    host_spans_digest,
    tensors_digest,
    word_count,
)
from sdc_guard.fingerprints.public import fingerprint, fingerprint_tensor
from sdc_guard.fingerprints.words import MASK64, mix64, mix64_int, to_signed64, to_unsigned64
from sdc_guard.hostread import StepRead, on_host
from sdc_guard.parallel.base import (
    Backend,
    Bucket,
    Containment,
    GradientListener,
    bucket_gradients,
)
from sdc_guard.report import Detection
from sdc_guard.scaling import Flag
from sdc_guard.state import ddp_ignored
from sdc_guard.types import BatchFor, LossFn, fetch_micro_batches, recomputed_loss

Word = int | torch.Tensor
"""One of the audit's 64-bit words: an unsigned Python int when computed on the host (the
C kernel's digests, a CPU loss's bits), else a 0-d int64 tensor on the device. On the CPU
the audit's words stay Python integers from digest to comparison: a tensor op costs
more between the step's large products, on the caches they filled, than in a loop."""


def add_words(a: Word | None, b: Word) -> Word:
    """``a + b`` modulo 2**64 (``a`` None: ``b``)."""
    if a is None:
        return b
    if isinstance(a, int) and isinstance(b, int):
        return (a + b) & MASK64
    device = b.device if isinstance(b, torch.Tensor) else a.device  # type: ignore[union-attr]
    return as_tensor(a, device) + as_tensor(b, device)


def _loss_word(losses: Sequence[torch.Tensor]) -> Word:
    """``loss_word`` as a host int for CPU losses, else as a tensor on their device (never a
    read to the host there)."""
    if losses and on_host(losses[0]):
        host = host_loss_word(losses)
        if host is not None:
            return host
    return device_loss_word(losses)


_TWO_WORDS = struct.Struct("=qq")
"""Two int64 words as they lie in a CPU tensor's memory (native byte order): the replayed
words written into the send buffer without a tensor op (``ReplayAudit._send_replayed``)."""


def as_tensor(w: Word, device: torch.device | None = None) -> torch.Tensor:
    """The word as a 0-d int64 tensor (an int on ``device``, default the CPU; copied to a
    device without a host sync)."""
    if isinstance(w, int):
        return words_on([to_signed64(w)], device or torch.device("cpu")).reshape(())
    return w if device is None else w.to(device)


def words_tensor(words: Sequence[Word], device: torch.device) -> torch.Tensor:
    """int64 ``[len(words)]`` on ``device``: one op when every word is a host int."""
    if all(isinstance(w, int) for w in words):
        return words_on([to_signed64(int(w)) for w in words], device)
    return torch.stack([as_tensor(w, device) for w in words])


@dataclass(frozen=True)
class BucketPlan:
    """Where each parameter's gradient lies in a DDP bucket buffer, in 64-bit words."""

    ranges: list[tuple[int, int]]
    """[start, end) word range of each gradient in the buffer."""
    spans: list[tuple[int, int, int]]
    """(start, end, word offset in parameter order) per gradient: what the comm hook's
    scaling pass digests (``sdc_guard.parallel.base.DigestSpans``)."""

    @staticmethod
    def of(buf: torch.Tensor, grads: Sequence[torch.Tensor], idx: Sequence[int],
           offsets: Sequence[int]) -> BucketPlan | None:
        """The plan, or None unless the gradients tile the buffer in whole, aligned words."""
        size = buf.element_size()
        if (buf.dim() != 1 or not buf.is_contiguous() or buf.data_ptr() % 8
                or buf.numel() * size % 8 or any(i < 0 for i in idx)):
            return None
        storage = buf.untyped_storage().data_ptr()
        spans = []
        for i, g in zip(idx, grads, strict=True):
            if g.numel() == 0:
                continue
            start = g.data_ptr() - buf.data_ptr()
            nbytes = g.numel() * size
            if (g.dtype != buf.dtype or not g.is_contiguous() or start % 8 or nbytes % 8
                    or g.untyped_storage().data_ptr() != storage):
                return None
            spans.append((start // 8, (start + nbytes) // 8, i))
        spans.sort()
        covered = 0
        for a, b, _ in spans:  # no gap, no overlap, nothing outside
            if a != covered:
                return None
            covered = b
        if covered != buf.numel() * size // 8 or not spans:
            return None
        return BucketPlan([(a, b) for a, b, _ in spans],
                          [(a, b, offsets[i]) for a, b, i in spans])

    def digest(self, buf: torch.Tensor) -> torch.Tensor:
        """The buffer's share of the gradient word (0-d int64), on the host or the device.

        Each parameter's gradient is a span of the buffer, digested as a tensor of its own at
        its word offset in parameter order (``sdc_guard.fingerprints.digest``): on the CPU
        one C-kernel call per span, combined in Python integers; on a device the spans as
        views of the buffer's bytes, in one multi-tensor pass (``tensors_digest``: a number of
        ops that does not grow with the number of gradients).
        """
        host = host_spans_digest(buf, self.spans)  # CPU: one kernel call per gradient
        if host is not None:
            return torch.tensor(to_signed64(host), dtype=torch.int64)
        raw = buf.view(torch.uint8)
        return tensors_digest([raw[8 * a:8 * b] for a, b in self.ranges],
                              [o for _, _, o in self.spans], buf.device)


def grads_digest(grads: Sequence[torch.Tensor], offsets: Sequence[int],
                 device: torch.device) -> torch.Tensor:
    """The gradient word (0-d int64) of separate gradients at word ``offsets`` in parameter order.

    On the CPU one C-kernel call per gradient, combined in Python integers; elsewhere
    ``tensors_digest`` on ``device``, in a number of ops that does not grow with the number of
    gradients. The same value.
    """
    if not grads:
        return torch.zeros((), dtype=torch.int64, device=device)
    if on_host(device):  # one kernel call per gradient, no torch op
        host = host_concat_digest(zip(grads, offsets, strict=True))
        if host is not None:
            return torch.tensor(to_signed64(host), dtype=torch.int64)
    return tensors_digest(grads, offsets, device)


def _strided_pieces(grads: Sequence[torch.Tensor], offsets: Sequence[int],
                    names: Sequence[str]) -> tuple[list[torch.Tensor], list[int]]:
    """Sparse COO gradients (``nn.Embedding(sparse=True)``) as two dense pieces at their
    parameter's offset: the coalesced indices, then the coalesced values. Both sides of
    the audit coalesce the same uncoalesced gradient, so the pieces agree bit for bit when
    the computations did; only the rows a batch touched are read."""
    out: list[torch.Tensor] = []
    at: list[int] = []
    for g, o, name in zip(grads, offsets, names, strict=True):
        if g.layout == torch.strided:
            out.append(g)
            at.append(o)
        elif g.layout == torch.sparse_coo:
            c = g.coalesce()
            rows = c.indices().contiguous()
            out += [rows, c.values().contiguous()]
            at += [o, o + word_count(rows)]
        else:
            raise ValueError(f"the replay audit digests dense and sparse COO gradients; "
                             f"{name}'s gradient is {g.layout}: make it dense or COO, or "
                             "turn the audit off (replay_interval=0)")
    return out, at


_PROBED: weakref.WeakSet[Any] = weakref.WeakSet()
"""The ``batch_for`` callables ``ReplayAudit._probe`` has found deterministic: a guard that
switches its checks (``SDCGuard.reconfigure``) builds a new audit and does not ask again."""


def _probed(batch_for: BatchFor) -> bool:
    try:
        return batch_for in _PROBED
    except TypeError:  # not weakly referable
        return False


def _same_batch(a: Any, b: Any) -> bool:
    """Are two batches the same, tensors bit for bit (nested lists, tuples, mappings (a
    ``UserDict`` too, as Hugging Face's ``BatchEncoding``) and dataclasses)?"""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device):
            return False
        try:
            return fingerprint(a) == fingerprint(b)
        except TypeError:  # a layout without one order of bits (sparse): not ours to judge
            return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same_batch(x, y) for x, y in zip(a, b, strict=True)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):  # (a UserDict: a BatchEncoding)
        return (type(a) is type(b) and a.keys() == b.keys()
                and all(_same_batch(a[k], b[k]) for k in a))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            return False
        return all(_same_batch(getattr(a, f.name), getattr(b, f.name))
                   for f in dataclasses.fields(a))
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a plain answer: not ours to judge
        return True


def replay_term(row: torch.Tensor) -> torch.Tensor:
    """This rank's term of the step word: ``h(replayed) - h(own)``, a 0-d int64.

    ``row`` is ``ReplayAudit.row()``. ``h(loss, grad) = mix(mix(loss) + grad)`` is a
    bijection in each word when the other is fixed. Summed over the ring, every
    ``h(own_n)`` cancels against the ``h(replayed)`` of the rank before n when that edge
    agrees, so the sum is 0 exactly when every edge agrees. One bad edge always leaves a
    non-zero sum; several could cancel only by a 64-bit coincidence. A non-zero sum sends
    the ranks on to the full gather of the rows and ``judge``, which compares every edge
    word by word.
    """
    if on_host(row):  # a few integer ops on the host, not ~40 tiny kernels
        return replay_term_host(row)
    return replay_term_device(row)


def replay_term_host(row: torch.Tensor) -> torch.Tensor:
    """``replay_term`` in Python integers."""
    own_loss, own_grad, rep_loss, rep_grad = row.tolist()
    term = (mix64_int(mix64_int(rep_loss) + rep_grad)
            - mix64_int(mix64_int(own_loss) + own_grad))
    return torch.tensor(to_signed64(term), dtype=torch.int64)


def replay_term_device(row: torch.Tensor) -> torch.Tensor:
    """``replay_term`` in tensor ops on the row's device (no host sync)."""
    def h(loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return mix64(mix64(loss) + grad)

    return h(row[2], row[3]) - h(row[0], row[1])


def own_batch_error(step: int) -> ValueError:
    """Every rank's replay of its neighbour's batch came out as its own step did, and the
    ranks' own steps differ: each rank recomputed its own batch. A fault cannot do that; a
    ``batch_for`` that ignores its rank argument does (every edge would disagree at every
    audit step)."""
    return ValueError(
        f"replay audit, step {step}: every rank's recomputation of its neighbour's "
        "batch came out as its own step did: batch_for(rank, step) returns this "
        "process's batch whatever rank it is given (it must build the batch of its "
        "rank argument, not of dist.get_rank()), or the loss depends on the process's "
        "rank. Fix batch_for (or the loss), or set replay_interval=0.")


def every_edge_detection(step: int, evidence: dict[str, Any], module: nn.Module) -> Detection:
    """The detection when every edge of a ring of more than two ranks disagrees: no rank is
    named (a fault breaks only its own rank's two edges; every edge at once is a loss or a
    model that depends on the process computing it)."""
    kept = state_tensors_written(module)
    if kept:
        evidence["state_tensors"] = kept
    return Detection(
        "replay", step, (), evidence=evidence,
        detail="every ring edge disagrees: each rank's recomputation of its neighbour's "
        "batch differs from the neighbour's own step, as when the loss or the model "
        "depends on the process computing it (dist.get_rank() in loss_fn, state kept "
        "outside the modules' parameters and buffers) rather than on the batch; a fault "
        "breaks only its own rank's two edges. No rank is named; the step is withheld"
        + (f". The forward writes tensors kept as plain attributes, which DDP does not "
           f"keep equal across ranks: {kept} (register them as buffers, which DDP "
           f"broadcasts from rank 0, or compute them from the parameters)"
           if kept else ""))


def _buffers_synced_before_forward(model: DistributedDataParallel) -> bool:
    """Does DDP's training forward (outside ``no_sync``) start by broadcasting the
    authoritative rank's buffers (``broadcast_buffers=True``, the default, and buffers to
    sync)? Then that forward computes with those buffers, not with the rank's own."""
    if not getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", False)):
        return False
    if not len(getattr(model, "modules_buffers", ())):
        return False
    hook = getattr(model, "buffer_hook", None)
    where = getattr(getattr(hook, "buffer_comm_hook_location", None), "name", "PRE_FORWARD")
    return where == "PRE_FORWARD" and callable(getattr(model, "_sync_buffers", None))


def _refuse_compiled_ddp(model: DistributedDataParallel) -> None:
    """Refuse a DDP that is itself compiled (``model.compile()``).

    The own step then runs DDP's compiled graph, while the replay recomputes through the
    module inside it, uncompiled: other kernels, whose results need not agree bit for bit,
    so every edge of the ring would disagree at every audit step and every rank be a
    suspect. Compiling the module inside DDP runs the same compiled code in both."""
    if getattr(model, "_compiled_call_impl", None) is not None:
        raise ValueError(
            "replay audit: the DistributedDataParallel itself is compiled (ddp.compile()), so "
            "the replay, which recomputes through the module inside it, would run other "
            "kernels than the step and disagree with it on every rank. Compile the module "
            "inside DDP instead: DistributedDataParallel(torch.compile(module)), or "
            "module.compile() before wrapping it.")


def _grads(loss: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` of the replayed loss, which leaves ``.grad`` (and DDP's
    reducer) alone; reentrant activation checkpointing cannot run under it. A parameter
    frozen since the audit was built (``requires_grad_(False)``) gets none, as in the
    owner's backward."""
    live = [p for p in params if p.requires_grad]  # (one frozen since: no gradient, as DDP's)
    try:
        got = iter(torch.autograd.grad(loss, live, allow_unused=True))
        return tuple(next(got) if p.requires_grad else None for p in params)
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise RuntimeError(
            "replay audit: the model uses torch.utils.checkpoint(..., use_reentrant=True), "
            "which cannot run under torch.autograd.grad, how the replay computes a "
            "neighbour's gradients without touching .grad. Pass use_reentrant=False (what "
            "PyTorch recommends), or turn the replay off (GuardConfig(replay_interval=0)).") from e


def _same_buffer(now: torch.Tensor | None, before: torch.Tensor) -> bool:
    return now is not None and torch.equal(now, before)


def _refuse_post_accumulate_hooks(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse parameters with post-accumulate-grad hooks (``register_post_accumulate_grad_hook``).

    Such a hook runs when the backward has accumulated ``.grad`` and may change it there (a
    clamp, added noise), before DDP reads it into its bucket: the own gradient is the hooked
    one. The replay takes its gradients with ``torch.autograd.grad``, which accumulates
    nothing and runs no such hook, so every edge of the ring would disagree at every audit
    step (every step withheld). Checked when the audit is built and at each audit step
    (a hook can be added later), on every rank alike (the model is the same)."""
    hooked = [n for n, p in named if getattr(p, "_post_accumulate_grad_hooks", None)]
    if hooked:
        raise ValueError(
            f"replay audit: the parameters {hooked[:4]}{' ...' if len(hooked) > 4 else ''} "
            "have post-accumulate-grad hooks (register_post_accumulate_grad_hook), which "
            "change .grad after the backward computed it; the replay recomputes a "
            "neighbour's gradients with torch.autograd.grad, which runs no such hook, so "
            "every audit step would convict every rank. Make that change in "
            "before_optimizer_step (SDCGuard(..., before_optimizer_step=...): after the "
            "all-reduce, alike on every rank), or as a Tensor.register_hook hook (the replay "
            "runs those), or turn the replay off (GuardConfig(replay_interval=0)).")


def _refuse_sync_batchnorm(module: nn.Module) -> None:
    """Refuse ``nn.SyncBatchNorm``: it normalises with statistics gathered from every rank's
    batch, so a batch cannot be recomputed alone. In the replay each rank contributes its
    neighbour's statistics, the same set in another order, which the merge (a running
    combination, row by row) rounds differently: every edge would disagree in the last
    bits, at every audit step. Derived from how the merge works (DDP refuses
    SyncBatchNorm on the CPU, so no CPU test runs it)."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if names:
        raise ValueError(
            f"replay audit: the model has SyncBatchNorm layers {names[:4]}"
            f"{' ...' if len(names) > 4 else ''}, which normalise with statistics gathered "
            "from every rank's batch, so a neighbour's batch cannot be recomputed alone. Use "
            "nn.BatchNorm (each rank's own statistics) or turn the replay off "
            "(GuardConfig(replay_interval=0)).")


def _refuse_unshared(module: nn.Module, ignored: set[int],
                     group: dist.ProcessGroup | None) -> None:
    """Refuse parameters that DDP ignores unless they are frozen and equal on every rank.

    The replay recomputes a neighbour's batch with this rank's weights. DDP neither
    broadcasts nor all-reduces the parameters named in ``_ddp_params_and_buffers_to_ignore``:
    one that trains drifts apart between ranks, and one that differs makes every edge of
    the ring disagree at every audit step (every step withheld). Collective when some
    parameter is ignored (alike on every rank: the module is the same)."""
    if not ignored:
        return
    names = [n for n, p in module.named_parameters() if id(p) in ignored]
    trained = [n for n, p in module.named_parameters() if id(p) in ignored and p.requires_grad]
    if trained:
        raise ValueError(
            f"replay audit: DDP ignores the parameters {trained} "
            "(_ddp_params_and_buffers_to_ignore) and they require gradients: each rank "
            "trains its own, so a neighbour's batch cannot be recomputed with the same "
            "weights. Turn the replay off (GuardConfig(replay_interval=0); the weights check "
            "leaves these parameters out), or let DDP all-reduce them.")
    tensors = [p.detach() for n, p in module.named_parameters() if id(p) in ignored]
    if gather_if_different(fingerprint_tensor(tensors), group) is not None:
        raise ValueError(
            f"replay audit: DDP ignores the frozen parameters {names} "
            "(_ddp_params_and_buffers_to_ignore), so it did not broadcast them, and they "
            "differ between ranks: a neighbour's batch cannot be recomputed with the same "
            "weights. Load the same values on every rank, or turn the replay off "
            "(GuardConfig(replay_interval=0)).")


class ReplayAudit(Check, GradientListener):
    """The ring replay audit, every ``interval`` steps; see the module doc."""

    name = "replay"
    withholds = True

    def __init__(
        self,
        model: DistributedDataParallel,
        *,
        interval: int,
        loss_fn: LossFn,
        batch_for: BatchFor,
        backend: Backend,
        seed: int,
        micro_batch_count: int,
        group: dist.ProcessGroup | None = None,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
        contain: bool = True,
    ) -> None:
        self.model = model
        _refuse_compiled_ddp(model)
        self._init_state(model.module, interval=interval, loss_fn=loss_fn,
                         batch_for=batch_for, backend=backend, seed=seed,
                         micro_batch_count=micro_batch_count, group=group, scale=scale,
                         contain=contain, device=next(model.parameters()).device)
        # The parameters DDP all-reduces: those it ignores never reach the comm hook, so
        # they are not in the own gradient word and must not be in the replayed one.
        ignored = ddp_ignored(model)
        _refuse_unshared(self.module, ignored, group)
        _refuse_sync_batchnorm(self.module)
        named = [(n, p) for n, p in self.module.named_parameters()
                 if p.requires_grad and id(p) not in ignored]
        _refuse_post_accumulate_hooks(named)
        self._named = named
        self.params: list[torch.Tensor] = [p for _, p in named]
        self.names = [n for n, _ in named]
        self.index = {id(p): i for i, (_, p) in enumerate(named)}
        # The gradient word is the digest D of every gradient laid end to end in
        # parameter order (each padded to whole 64-bit words), wherever it is computed.
        ends = list(itertools.accumulate(word_count(p) for p in self.params))
        self.offsets = [0, *ends[:-1]] if ends else []
        self._plans: dict[tuple[int, ...], BucketPlan | None] = {}
        backend.subscribe(self)

    def _init_state(self, module: nn.Module, *, interval: int, loss_fn: LossFn,
                    batch_for: BatchFor, backend: Backend, seed: int, micro_batch_count: int,
                    group: dist.ProcessGroup | None,
                    scale: Callable[[torch.Tensor], torch.Tensor] | None, contain: bool,
                    device: torch.device) -> None:
        """What every audit holds, whatever the parallelism: the loop's callables, the ring,
        the words of the step and their exchange (``replay_fsdp`` builds on it too)."""
        self.interval = interval
        self.scale = scale
        self.module: nn.Module = module
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.seed = seed
        self.micro = micro_batch_count
        self.group = group
        self.device = device
        self._own_grad: Word | None = None
        self._observing = False
        self._own_losses: list[torch.Tensor] = []
        self._replayed: Any = None
        """The replay's words (``_words_of``), once ``begin_step`` has replayed."""
        self._own_cache: tuple[Word, Word] | None = None
        self._row_cache: torch.Tensor | None = None
        self._pending: PendingSum | None = None
        # Buffers a training forward may read: all but the norm layers' running statistics,
        # which a training forward updates and never reads. One that the forward changes is
        # checked once (``_check_buffers``).
        norms = {id(b) for m in self.module.modules()
                 if isinstance(m, nn.modules.batchnorm._NormBase) for b in m.buffers(False)}
        self._watched = {name for name, b in self.module.named_buffers() if id(b) not in norms}
        self._buffers_checked = not self._watched
        self._changed: list[str] = []
        self._step_buffers: SavedBuffers = []
        """The module's buffers as this audit step began (after DDP's buffer broadcast, when
        the owner's forward makes one): what every replay of the step starts from."""
        self._at_step_buffers = False
        """The module's buffers hold ``_step_buffers``' values (saved, and no forward since
        but recomputations, which put them back): a recomputation then starts from them as
        they are and restores from the saved copies, without saving them again."""
        self._backend = backend
        # The fast path (module doc): the replayed words go to their owner point to point,
        # the owner compares and vetoes through the backend's containment channel.
        self.wants_veto = contain and self.world > 1
        self._exchanges = self.wants_veto
        """Do the replayed words travel to their owner point to point (``_send_replayed``)?"""
        self._answer: Containment | None = None
        """This step's containment answer (``vetoed``), when the veto was asked."""
        self._exchange: list[Any] = []
        self._receiving: Any = None
        """The receive ``_receive_early`` posted, until ``_post`` joins it to the exchange."""
        self._peer = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._sent: torch.Tensor | None = None
        self._send_buf = torch.zeros(2, dtype=torch.int64)
        """The replayed words on their way to the owner (CPU): written in place, no tensor op."""
        self._veto_asked = False
        self._send_due = False
        """The exchange waits for this step's first gradient bucket (``local``)."""
        self._buckets = 0
        """Gradient buckets the comm hook has shown this audit step."""
        self._own_params = 0
        """Parameters whose gradients those buckets held (``_check_complete``)."""
        self._many_buckets = False
        """The last step had more than one bucket: the exchange waits for the first. Learned
        on every step the comm hook runs (``local``), not only on audit steps: the first audit
        after the check is built (``SDCGuard.reconfigure``) would otherwise post its exchange
        right after the replay."""
        self.exchange_with_first_bucket = True
        """Post the ring exchange with the first gradient bucket (``_send_replayed``); False:
        right after the replay (``python -m bench.replay_exchange`` times both)."""

    compares_replicas = True

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def close(self) -> None:
        self._backend.unsubscribe(self)

    def vetoed(self, answer: Containment) -> None:
        self._answer = answer

    # -- own computation, seen in the comm hook --------------------------------------------
    def local(self, bucket: Bucket) -> BucketPlan | None:
        """On audit steps, the bucket's share of the own gradient word: its spans, for the
        comm hook's scaling pass to digest (``after_scaling`` receives the value), or, for
        a bucket whose gradients do not tile it, digested here per gradient."""
        idx = self._seen(bucket)
        if idx is None:
            return None
        plan = self._plan(bucket, idx)
        if plan is None:
            grads = bucket_gradients(bucket)
            if bucket.buffer().layout != torch.strided and len(idx) == 1:
                grads = [bucket.buffer()]  # DDP gives a sparse gradient a bucket of its own
            kept = [(i, g) for i, g in zip(idx, grads, strict=True) if i >= 0]
            self._add_own(self._digest([g for _, g in kept], [i for i, _ in kept]))
        return plan

    def _seen(self, bucket: Bucket) -> list[int] | None:
        """A local bucket seen: on audit steps the index of each of its parameters (-1: not
        audited), after posting the exchange if it waited for the first bucket; else None."""
        if not self._observing:
            if bucket.is_last():  # learned on every step, so a new audit's first one posts early
                self._many_buckets = bucket.index() > 0
            return None
        self._buckets += 1
        self._post_due()
        idx = [self.index.get(id(p), -1) for p in bucket.parameters()]
        self._own_params += sum(i >= 0 for i in idx)
        return idx

    def after_scaling(self, bucket: Bucket, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        if digest is not None:
            self._add_own(digest)

    def _add_own(self, part: Word) -> None:
        self._own_grad = add_words(self._own_grad, part)

    def _plan(self, bucket: Bucket, idx: list[int]) -> BucketPlan | None:
        """Where the bucket's gradients lie in its flat buffer (cached), or None.

        With a plan the bucket's share of the gradient word comes from the buffer
        itself (``BucketPlan.digest``, or the comm hook's scaling pass); buckets whose
        gradients are not whole, aligned words of the buffer take the per-parameter
        path (``grads_digest``); the value is the same.
        """
        buf = bucket.buffer()
        if buf.layout != torch.strided:  # a sparse gradient's bucket: digested per gradient
            return None
        key = (bucket.index(), buf.data_ptr(), buf.numel(), *idx)
        if key not in self._plans:
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = BucketPlan.of(buf, bucket_gradients(bucket), idx, self.offsets)
        return self._plans[key]

    def _digest(self, grads: Sequence[torch.Tensor], indices: Sequence[int]) -> Word:
        """Gradient word of separate gradients (of the parameters at ``indices``)."""
        offsets = [self.offsets[i] for i in indices]
        if any(g.layout != torch.strided for g in grads):
            grads, offsets = _strided_pieces(grads, offsets, [self.names[i] for i in indices])
        if on_host(self.device) and grads:
            host = host_concat_digest(zip(grads, offsets, strict=True))
            if host is not None:
                return host
        return grads_digest(grads, offsets, self.device)

    def begin_step(self, step: int) -> None:
        """Replay the neighbour's micro-batches of ``step`` first, from the same pre-step
        weights; then watch this rank's own losses and local gradients. The replayed words
        go to their owner when this rank's first gradient bucket is ready (``local``), or
        right away when the model's gradients fill one bucket (the first is then the last,
        where the owner compares); see ``_send_replayed``.
        """
        _refuse_compiled_ddp(self.model)
        self._own_grad = None
        self._own_losses = []
        self._replayed = None
        self._own_cache = None
        self._row_cache = None
        self._pending = None
        self._veto_asked = False
        self._buckets = 0
        self._own_params = 0
        self.phase = "train"
        self._observing = True
        self._replay_at_start(step)

    def _replay_at_start(self, step: int) -> None:
        """``_replay_first`` with the exchange's receive posted before it (``_receive_early``),
        and matched should it raise (``_match_early_receive``)."""
        self._receive_early()
        try:
            self._replay_first(step)
        except BaseException:
            self._match_early_receive()
            raise

    def _replay_first(self, step: int) -> None:
        """``begin_step``'s recomputation of the neighbour's batch, and its exchange."""
        if self.micro == 1 and _buffers_synced_before_forward(self.model):
            # The owner's forward will compute with the authoritative rank's buffers (DDP
            # broadcasts them first); a buffer the training forward reads and updates (a
            # running normaliser, an EMA codebook) differs on every other rank, so the
            # replay starts from the same broadcast. The owner's own broadcast then sends
            # the same values again.
            self.model._sync_buffers()  # type: ignore[no-untyped-call]
        self._save_step_buffers()
        self._replayed = self._replay((self.rank + 1) % self.world, step, "replay")
        self._at_step_buffers = False  # the owner's forward comes next
        if not self._buffers_checked:
            self._check_buffers()
        if self._exchanges:
            if self._many_buckets and self.exchange_with_first_bucket:
                self._send_due = True
            else:
                self._send_replayed()

    def _check_buffers(self) -> None:
        """On the first audit step of a model with buffers outside its norm layers: did the
        training forward change any (a running normaliser, an EMA codebook)? Such a buffer is
        each rank's own until DDP broadcasts rank 0's, at the start of a forward outside
        ``no_sync``. With one micro-batch and that broadcast the replay starts from the same
        buffers as the owner (``begin_step``); otherwise the owner computes with buffers no
        other rank holds, and every audit would convict a healthy rank. Decided on every rank
        alike: one small all-reduce, once."""
        self._buffers_checked = True
        changed = torch.tensor([int(bool(self._changed))], dtype=torch.int64,
                               device=self.device)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX, group=self.group)
        if not int(changed.item()) or (self.micro == 1
                                       and _buffers_synced_before_forward(self.model)):
            return
        why = ("with micro_batches > 1 the owner's first micro-batches run under no_sync() "
               "with its own buffers and its last with rank 0's after rank 0's first "
               "micro-batches" if self.micro > 1 else
               "DDP does not broadcast them before the forward (broadcast_buffers=False or "
               "forward_sync_buffers=False)")
        names = self._changed or "(on another rank)"
        raise ValueError(
            f"replay audit: the training forward updates buffers {names} outside the norm "
            f"layers, and {why}: no other rank can recompute "
            "the owner's step. Use micro_batches=1 with DDP's buffer broadcast before each "
            "forward (the default: forward_sync_buffers=True, broadcast_buffers=True before "
            "torch 2.13; the replay then starts from the broadcast buffers), or set "
            "replay_interval=0.")

    def _send_replayed(self) -> None:
        """Send the replayed words to their owner (the next rank) and receive this rank's
        from the previous one, point to point, compared by the owner in the comm hook
        (``veto``). Posted with the first bucket's all-reduce rather than right after the
        replay: the messages then travel while the communication threads run anyway. With
        more ranks than cores, a message posted on its own wakes the peer's communication
        thread at a moment of its own, which preempts a rank that is computing
        (``python -m bench.replay_exchange`` times both placements side by side)."""
        assert self._replayed is not None
        if self.device.type == "cpu" and all(isinstance(w, int) for w in self._replayed):
            self._finish_exchange()  # (always done by now) the buffer must outlive its send
            words = self._send_buf
            ctypes.memmove(words.data_ptr(),
                           _TWO_WORDS.pack(*(to_signed64(int(w)) for w in self._replayed)), 16)
        else:
            words = words_tensor(self._replayed, self.device)
        self._post(words)

    def _receive_early(self) -> None:
        """On the CPU, at an audit step's start: post the receive of the previous rank's
        replay of this rank's batch, before anything of the step runs. gloo hands a message
        over once its receiver has said it is ready; with the receive posted this early, the
        peer's send (``_post``) finds it so and goes at once, rather than waiting in the
        step for a readiness its communication thread has to be scheduled to send."""
        if self._exchanges and self.device.type == "cpu" and self._receiving is None:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None
            self._receiving = group.recv([self._peer], (self.rank - 1) % self.world, 0)

    def _match_early_receive(self) -> None:
        """An audit step that raised after ``_receive_early``: send the next rank the zeros
        its early receive waits for, and wait for both, so that no receive is left posted
        for a later exchange to be matched against. The replay's refusals are raised on
        every rank alike; a rank that raises alone gets its receive from the previous
        rank's step, which goes on to its exchange."""
        receiving, self._receiving = self._receiving, None
        if receiving is not None:
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None
            blank = torch.zeros_like(self._peer)
            group.send([blank], (self.rank + 1) % self.world, 0).wait()
            receiving.wait()

    def _post(self, words: torch.Tensor) -> None:
        """Send ``words`` to the next rank and receive the previous rank's into ``_peer``."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        if self.device.type == "cpu":
            # gloo sends each op on its own (batch_isend_irecv would loop over them): post
            # both on the process group itself, without the Python wrappers' checks.
            group = self.group if self.group is not None else dist.group.WORLD
            assert group is not None
            receiving, self._receiving = self._receiving, None
            self._exchange = [group.send([words], nxt, 0),
                              receiving or group.recv([self._peer], prv, 0)]
        else:  # NCCL pairs a ring of sends and receives only when they are coalesced
            if self.group is not None:
                nxt = dist.get_global_rank(self.group, nxt)
                prv = dist.get_global_rank(self.group, prv)
            self._exchange = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, words, nxt, self.group),
                dist.P2POp(dist.irecv, self._peer, prv, self.group)])
        self._sent = words  # alive until the send completes

    def _post_due(self) -> None:
        """Post the exchange if it waits for the step's first gradient bucket: at that bucket,
        or at the verdict when none came (alike on every rank), so that every receive
        posted early is matched."""
        if self._send_due:
            self._send_due = False
            self._send_replayed()

    def _finish_exchange(self) -> None:
        for work in self._exchange:
            work.wait()
        self._exchange = []

    def veto(self) -> Flag | None:
        """In the comm hook, before the step's last gradient all-reduce: does this rank's own
        loss and gradient word differ from the previous rank's replay of its batch? A
        difference vetoes the step on every rank (``GuardCommHook._veto``); every rank
        then gathers the words and judges in ``pre_step``."""
        if not self._observing or not self._exchange:
            return None
        self._finish_exchange()
        self._veto_asked = True
        own = self._own()
        if all(isinstance(w, int) for w in own):  # the host's words: compare as integers
            return [to_signed64(int(w)) for w in own] != self._peer.tolist()
        differs = (self.row()[:2] != self._peer).any()
        return bool(differs) if on_host(differs) else differs

    def on_loss(self, loss: torch.Tensor) -> None:
        self._own_losses.append(loss)

    def before_last_allreduce(self) -> None:
        if not self.wants_veto:
            self._send_words()

    def _send_words(self) -> None:
        """Start the all-reduce of this rank's term of the step word (see ``term``).

        Runs in the comm hook just before the step's last gradient all-reduce, when the
        own gradients have all been digested: the ranks meet there anyway.
        """
        if not self._observing or self._replayed is None or self._pending is not None:
            return
        self._pending = PendingSum(replay_term(self.row()), self.group)

    def _own(self) -> tuple[Word, Word]:
        """This rank's own loss and gradient words, once its gradients are all digested
        (computed once per audit step; the audit stops watching then)."""
        if self._own_cache is None:
            self._own_cache = (_loss_word(self._own_losses),
                               self._own_grad if self._own_grad is not None else 0)
            self._observing = False
        return self._own_cache

    def row(self) -> torch.Tensor:
        """This rank's four int64 words: own loss, own gradients, replayed loss, replayed
        gradients (of the neighbour's batch). Computed once per audit step."""
        if self._replayed is None:
            raise RuntimeError("ReplayAudit: begin_step did not run this step")
        if self._row_cache is None:
            self._row_cache = words_tensor([*self._own(), *self._replayed], self.device)
        return self._row_cache

    # -- recomputation ----------------------------------------------------------------------
    def _save_step_buffers(self) -> None:
        """Keep the module's buffers as the step begins, for every recomputation of it."""
        self._step_buffers = buffers_saved(self.module)
        self._at_step_buffers = True

    def _buffers_for_replay(self) -> SavedBuffers:
        """Before a recomputation: give the module the step's first buffers (an arbitration
        runs after the owner's forward, which may have updated them); what to restore after
        it (the buffers as they are now)."""
        if self._at_step_buffers:
            return self._step_buffers
        buffers = buffers_saved(self.module)
        buffers_set(self.module, self._step_buffers)
        return buffers

    def _replay(self, rank: int, step: int, phase: str) -> Any:
        """What ``rank``'s micro-batches of ``step`` give here (``_words_of``: the loss and
        gradient fingerprints)."""
        self.phase = phase
        _refuse_post_accumulate_hooks(self._named)
        buffers = self._buffers_for_replay()
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        losses = []
        try:
            batches = fetch_micro_batches(self.batch_for, rank, step, self.micro)
            if not _probed(self.batch_for):
                self._probe(batches, rank, step)
            issued = collectives_issued(self.group)
            with module_state_kept(self.module):  # a forward's call counter, and the like
                for i, mb in enumerate(batches):
                    with rng_stream(self.seed, rank, step, i, self.device):
                        loss = recomputed_loss(self.loss_fn, self.module, mb)
                    losses.append(loss.detach())
                    scaled = self.scale(loss) if self.scale is not None else loss
                    new = _grads(scaled, self.params)
                    grads = [
                        g if acc is None else (acc if g is None else acc + g)
                        for acc, g in zip(grads, new, strict=True)
                    ]
            if issued is not None and collectives_issued(self.group) != issued:
                # every rank's recomputation communicated alike: every rank raises here
                raise ValueError(f"replay audit: {COMMUNICATING_LOSS} Every audit step would "
                                 "convict every rank. Set replay_interval=0: the other checks "
                                 "work with such a loss.")
        finally:
            if not self._buffers_checked:
                self._changed = [q for m, n, q, value in buffers if q in self._watched
                                 and not _same_buffer(m._buffers.get(n), value)]
            buffers_set(self.module, buffers)
            self.phase = "train"
        return self._words_of(losses, grads)

    def _words_of(self, losses: Sequence[torch.Tensor],
                  grads: Sequence[torch.Tensor | None]) -> Any:
        """What a recomputation reports: its loss and gradient words (the tolerant audit: a
        sketch)."""
        kept = [(i, g) for i, g in enumerate(grads) if g is not None]
        return _loss_word(losses), self._digest([g for _, g in kept], [i for i, _ in kept])

    def _probe(self, batches: Sequence[Any], rank: int, step: int) -> None:
        """On the first audit step: does ``batch_for(rank, step)`` give the same batch again?

        The audit rests on it (``sdc_guard.determinism``). A batch drawn from an iterator or
        from an unseeded generator differs on every call, and every edge of the ring would
        disagree at every audit step; the error names the cause instead. One extra call
        of ``batch_for``, once per process for each ``batch_for`` (``_PROBED``)."""
        again = fetch_micro_batches(self.batch_for, rank, step, self.micro)
        if not _same_batch(list(batches), list(again)):
            raise ValueError(
                f"replay audit: batch_for({rank}, {step}) returned a different batch when called "
                "again with the same arguments. The audit recomputes a neighbour's batch, so "
                "batch_for(rank, step) must be a function of (rank, step) alone: no iterator "
                "state, randomness only from a generator seeded by (rank, step) "
                "(docs/usage.md), or set replay_interval=0.")
        with contextlib.suppress(TypeError):  # not weakly referable: probed again next time
            _PROBED.add(self.batch_for)

    # -- verdict ----------------------------------------------------------------------------
    def ask(self, step: int, read: StepRead) -> None:
        """The step's containment answer (the owners compared in the comm hook), or else this
        rank's term of the step word, sent now if the hook never saw a last bucket, for the
        step's one read."""
        if self._replayed is None:
            raise RuntimeError("ReplayAudit.ask: begin_step did not run this step")
        if self._veto_asked:
            if self._answer is not None:
                self._answer.ask(read)
            return
        self._post_due()
        self._finish_exchange()  # sent, but the hook never saw a last bucket
        if self._pending is None:  # (alike on every rank)
            self._send_words()
        if self._pending is not None:
            self._pending.ask(read)

    def pre_step(self, step: int) -> Verdict:
        """Agree on the step word; on a mismatch compare the gathered ring edges, arbitrate
        single bad edges, localise. A detection withholds the step on every rank."""
        if self._replayed is None:
            raise RuntimeError("ReplayAudit.pre_step: begin_step did not run this step")
        self._check_complete(step)
        try:
            if self._veto_asked:  # the owners compared: a veto (or a non-finite value in
                # the sentinel's slots, which may hide one) sends every rank to the gather
                answer, self._answer = self._answer, None
                clean = answer is None or not answer.read()
            else:
                self._post_due()
                self._finish_exchange()  # (ask did it, unless it was not called)
                if self._pending is None:  # (alike on every rank)
                    self._send_words()
                pending, self._pending = self._pending, None
                clean = pending is None or pending.wait() == 0  # every edge agrees
            if clean and not self._gathers_anyway():
                self.verified(step)
                return Verdict()
            found = self.judge(step, self._gather_rows(step))
        finally:
            self._observing = False
            self._veto_asked = False
            self._send_due = False
            self._many_buckets = self._buckets > 1
        if found:
            self.tainted()
        else:
            self.verified(step)
        return Verdict(found, withhold=bool(found) or self._withhold_anyway())

    def _withhold_anyway(self) -> bool:
        """Withhold this audit step although ``judge`` found nothing (asked once, after it)?"""
        return False

    def _gathers_anyway(self) -> bool:
        """Does this audit step gather every rank's words even when every edge agrees?"""
        return False

    def _gather_rows(self, step: int) -> list[list[Any]]:
        """Every rank's ``row()`` (row r: rank r), gathered with its step: ranks at other
        steps (a drift the first step's agreement did not see) disagree on every edge of
        theirs, and that is an error of the loop, not a fault to convict."""
        mine = torch.cat([self.row(), torch.tensor([step], dtype=torch.int64,
                                                   device=self.device)])
        rows = all_gather_rows(mine, self.group).tolist()
        differ = steps_disagree([row[4] for row in rows])
        if differ is not None:
            raise ValueError(f"replay audit: the ranks are not at one step ({differ}); "
                             f"{STEPS_FIX}")
        words = [row[:4] for row in rows]
        if all(w[2:] == w[:2] for w in words) and len({tuple(w[:2]) for w in words}) > 1:
            raise own_batch_error(step)
        return words

    def _check_complete(self, step: int) -> None:
        """Refuse to compare an own gradient word that misses parameters.

        DDP reduces a bucket only once every gradient in it (and in the buckets before it)
        is ready. A parameter the forward did not use, without
        ``find_unused_parameters=True``, never gets one: its bucket and every later one never
        reach the comm hook, the own word lacks their share, and every edge of the ring
        would disagree on every rank, at every audit step.
        The error instead names the fix; DDP raises on the next step for the same reason.
        Every rank has the same parameters, so every rank raises here, before any collective
        of the verdict."""
        if self._own_params < len(self.params):
            raise RuntimeError(
                f"replay audit, step {step}: the gradient buckets DDP reduced held "
                f"{self._own_params} of the {len(self.params)} parameters that require "
                "gradients: the others got none (the forward did not use them), so their "
                "buckets never reached the all-reduce and nothing can be compared. Construct "
                "DistributedDataParallel(..., find_unused_parameters=True), or set "
                "requires_grad=False on the parameters the forward does not use.")

    def judge(self, step: int, words: list[list[Any]]) -> list[Detection]:
        """The detection, if any, from every rank's four words (row r: rank r, as ``row()``)."""
        rows = [[to_unsigned64(v) for v in row] for row in words]
        n = self.world
        own = [(rows[r][0], rows[r][1]) for r in range(n)]
        rep = [(rows[r][2], rows[r][3]) for r in range(n)]
        bad = [rep[r] != own[(r + 1) % n] for r in range(n)]  # edge r -> r+1
        if not any(bad):
            return []
        evidence: dict[str, Any] = {
            "own": [f"{a:016x}/{b:016x}" for a, b in own],
            "replay_of_next": [f"{a:016x}/{b:016x}" for a, b in rep],
            "bad_edges": [[r, (r + 1) % n] for r in range(n) if bad[r]],
        }
        if n > 2 and all(bad):
            # A faulty rank breaks its own two edges; every edge at once takes faults on
            # several ranks together, or (far likelier) a computation that depends on the
            # process: naming every rank would quarantine the whole job.
            return [every_edge_detection(step, evidence, self.module)]
        if n == 2:
            return [Detection("replay", step, (), evidence=evidence,
                              detail="replay mismatch between the two ranks; with world size 2 "
                              "there is no third rank to arbitrate")]
        suspects: set[int] = set()
        # Ranks with both the incoming and the outgoing edge bad computed wrong twice.
        for f in range(n):
            if bad[(f - 1) % n] and bad[f]:
                suspects.add(f)
        single = [a for a in range(n) if bad[a] and not bad[(a - 1) % n] and not bad[(a + 1) % n]]
        unresolved: list[list[int]] = []
        if single:
            verdicts = self._arbitrate(step, single, own, rep)
            evidence["arbitration"] = verdicts
            for a in single:
                who = verdicts[str(a)]["blames"]
                if who is None:
                    unresolved.append([a, (a + 1) % n])
                else:
                    suspects.add(who)
        detail = (f"replayed loss/gradient fingerprints disagree on ring edges "
                  f"{evidence['bad_edges']}")
        if suspects:
            detail += f"; localised to rank(s) {sorted(suspects)}"
        if unresolved:
            detail += f"; arbitration could not decide edges {unresolved}"
        return [Detection("replay", step, tuple(sorted(suspects)), detail=detail,
                          evidence=evidence)]

    def _arbiter_replay(self, owner: int, arbiter: int, step: int) -> tuple[Word, Word] | None:
        """The arbiter's words: its replay of ``owner``'s batch, on the arbiter only (the
        recomputation runs on the module alone, without communicating)."""
        return self._replay(owner, step, "arbitrate") if arbiter == self.rank else None

    def _arbitrate(
        self,
        step: int,
        edges: list[int],
        own: list[tuple[int, int]],
        rep: list[tuple[int, int]],
    ) -> dict[str, dict[str, Any]]:
        """Third-rank replays for single bad edges a -> b (one all_gather for all of them)."""
        n = self.world
        words = torch.zeros(2 * len(edges), dtype=torch.int64, device=self.device)
        for k, a in enumerate(edges):
            b = (a + 1) % n
            t = (b + 1) % n
            got = self._arbiter_replay(b, t, step)
            if got is not None:
                words[2 * k: 2 * k + 2] = words_tensor(got, self.device)
        rows = all_gather_rows(words, self.group).tolist()
        out: dict[str, dict[str, Any]] = {}
        for k, a in enumerate(edges):
            b = (a + 1) % n
            t = (b + 1) % n
            third = (to_unsigned64(rows[t][2 * k]), to_unsigned64(rows[t][2 * k + 1]))
            blames: int | None
            if third == own[b] and third != rep[a]:
                blames = a  # b's own result is confirmed: a's replay was wrong
            elif third == rep[a] and third != own[b]:
                blames = b  # a's replay is confirmed: b's own computation was wrong
            else:
                blames = None
            out[str(a)] = {"edge": [a, b], "arbiter": t, "blames": blames,
                           "arbiter_result": f"{third[0]:016x}/{third[1]:016x}"}
        return out
