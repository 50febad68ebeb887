"""Small agreements between ranks: majority votes, and the small collectives that carry them."""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sdc_guard.hostread import StepRead


def majority_outliers(values: Sequence[Hashable]) -> tuple[int, ...] | None:
    """Ranks whose value differs from a strict majority; ``None`` when there is none.

    ``()`` means everyone agrees. With two ranks that disagree there is no strict
    majority (1 of 2), so the answer is ``None``: a mismatch without a suspect.
    """
    if not values:
        return ()
    value, count = Counter(values).most_common(1)[0]
    if count * 2 <= len(values):
        return None
    return tuple(r for r, v in enumerate(values) if v != value)


def steps_disagree(steps: Sequence[int]) -> str | None:
    """``steps`` (one per rank) in words when they are not all one step, else None:
    ``"step 5 on ranks 0, 2; step 6 on rank 1"``."""
    by_step: dict[int, list[int]] = {}
    for rank, s in enumerate(steps):
        by_step.setdefault(int(s), []).append(rank)
    if len(by_step) < 2:
        return None
    return "; ".join(f"step {s} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                     for s, r in by_step.items())


STEPS_FIX = ("every rank must call SDCGuard.step with the same step number: the checks compare "
             "the ranks' work step by step, and the replay audit recomputes a neighbour's batch "
             "of that step, so a rank at another step would be convicted, healthy. Take the "
             "step to resume from from one source on every rank (CheckpointManager.restore, "
             "or a broadcast from rank 0).")
"""What ``steps_disagree``'s callers tell the user to do."""


class StepsDisagree(ValueError):
    """The ranks called ``SDCGuard.step`` with different steps, found in a word every rank
    reads at the same call (so every rank raises it, naming who was where)."""


def all_gather_rows(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Gather a small 1-D tensor from every rank into a ``(world, len)`` tensor (one collective)."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


def gather_objects(obj: object, group: dist.ProcessGroup | None = None, *,
                   device: torch.device | None = None) -> list[Any]:
    """Every rank's picklable ``obj`` (item r: rank r's), as ``all_gather_object`` gives them,
    without NumPy: torch's object collectives read the bytes back through NumPy, which is not
    a dependency of sdc_guard. The pickled bytes travel as a uint8 tensor on ``device`` (the
    model's: a CUDA device under NCCL; None: the CPU); two collectives, the sizes first."""
    data = pickle.dumps(obj)
    dev = torch.device("cpu") if device is None else device
    sizes = all_gather_rows(torch.tensor([len(data)], dtype=torch.int64, device=dev),
                            group)[:, 0].tolist()
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    rows = all_gather_rows(buf, group).cpu()
    return [pickle.loads(bytes(rows[r, :n].tolist())) for r, n in enumerate(sizes)]


class PendingSum:
    """An int64 SUM all-reduce of a few words in flight; ``wait()`` gives the total of the first,
    ``wait_all()`` of every word."""

    def __init__(self, word: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                 in_place: bool = False) -> None:
        """``in_place``: ``word`` is a 1-D int64 tensor the caller hands over, summed where it
        is (no copy); otherwise a copy is summed and ``word`` is left as it was."""
        self.word = word if in_place else word.detach().to(torch.int64).reshape(-1).clone()
        work = dist.all_reduce(self.word, group=group, async_op=True)
        if work is None:  # pragma: no cover - async_op=True always returns a Work handle
            raise RuntimeError("torch.distributed.all_reduce(async_op=True) returned no Work")
        self.work = work
        self._totals: list[int] | None = None
        self._asked: tuple[StepRead, int] | None = None

    def ask(self, read: StepRead) -> None:
        """Have the totals come in the step's one read (``sdc_guard.hostread``): the
        all-reduce is waited for here (on a GPU the stream waits, not the host)."""
        if self._totals is None and self._asked is None:
            self.work.wait()
            self._asked = (read, read.ask(self.word))

    def wait_all(self) -> list[int]:
        if self._totals is None:
            if self._asked is not None:
                read, handle = self._asked
                self._totals = [int(v) for v in read.get(handle)]
            else:
                self.work.wait()
                self._totals = [int(v) for v in self.word.tolist()]
        return self._totals

    def wait(self) -> int:
        return self.wait_all()[0]


def sum_word(word: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """The wrapping sum over every rank of one int64 ``word`` (one all-reduce, one host sync).

    On gloo an all-reduce of fewer elements than there are ranks takes a cheaper path
    than any larger one, and than an all_gather. The pre-step checks therefore agree
    on "all clean" through one word whose sum is 0 exactly when they are, and gather
    their full evidence only when it is not.
    """
    return PendingSum(word, group).wait()


def gather_if_different(word: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[int] | None:
    """``None`` when every rank holds the same int64 ``word``; else every rank's word.

    The common case costs one all-reduce (MAX over ``[w, ~w]``, i.e. the maximum and
    the bitwise complement of the minimum), which on gloo is cheaper than an
    all_gather; the all_gather runs only when the words differ. Every rank gets
    the same answer, so the second collective happens on every rank or on none.
    """
    w = word.reshape(1).to(torch.int64)
    both = torch.cat([w, torch.bitwise_not(w)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    largest, not_smallest = both.tolist()
    if largest == ~not_smallest:  # max == min: every rank holds the same word
        return None
    return [int(v) for v in all_gather_rows(w, group)[:, 0].tolist()]


_BITS = 63
"""Flag bits per int64 word: the sign bit is left alone, so every total stays positive."""


def words_on(words: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 ``words`` as a tensor on ``device`` without a host sync: on a GPU through pinned
    memory, copied asynchronously (``torch.tensor(..., device="cuda")`` waits for the stream:
    the host could not queue ahead of the GPU)."""
    host = torch.tensor(list(words), dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def flag_words(flags: Sequence[bool], rank: int, world: int) -> list[int]:
    """This rank's ``flags`` (``k`` of them) as bits of int64 words, for a SUM all-reduce.

    Flag ``i`` of rank ``r`` is bit ``i * world + r``; no two ranks share a bit, so the
    sum over the ranks is their bitwise OR and says exactly which rank raised which
    flag (``flag_rows``): one small all-reduce names everyone, with no second
    collective. ``ceil(k * world / 63)`` words: one for up to 31 ranks with two flags.
    """
    words = [0] * -(-len(flags) * world // _BITS)
    for i, on in enumerate(flags):
        if on:
            pos = i * world + rank
            words[pos // _BITS] |= 1 << (pos % _BITS)
    return words


def flag_rows(words: Sequence[int], k: int, world: int) -> list[list[int]]:
    """Every rank's ``k`` flags (row ``r``: rank ``r``) from the summed ``flag_words``."""
    if not any(words):  # (the usual case: no flag raised, no bit to pick out)
        return [[0] * k for _ in range(world)]

    def bit(pos: int) -> int:
        return (words[pos // _BITS] >> (pos % _BITS)) & 1
    return [[bit(i * world + r) for i in range(k)] for r in range(world)]


def collectives_issued(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    """How many collectives the default process group and ``group`` have issued so far (the
    sequence numbers torch's process groups keep for their desync debugging), or None where
    torch does not say. Two readings that differ bracket a collective."""
    groups = [dist.distributed_c10d._get_default_group()]
    if group is not None and group is not groups[0]:
        groups.append(group)
    try:
        return tuple(int(g._get_sequence_number_for_group())  # type: ignore[attr-defined]
                     for g in groups)
    except (AttributeError, RuntimeError):
        return None


COMMUNICATING_LOSS = (
    "loss_fn(model, batch) communicates with the other ranks (a collective on a process group, "
    "such as the all_gather of embeddings in a contrastive loss, as CLIP and SimCLR train), so "
    "a rank cannot recompute another rank's loss alone: the gathered values would come from "
    "the other ranks' recomputations of other batches.")
"""Why a recomputation refuses a loss that issues collectives."""
