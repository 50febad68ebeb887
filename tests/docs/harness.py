"""The names the documentation's runnable snippets assume, and the faults planted under them.

A runnable snippet (``tests/docs/test_snippets.py``) runs as a script, one process per rank,
launched as ``torchrun`` would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), in a working directory of its own. The script is the snippet as written,
between two lines of this module: ``from tests.docs.harness import *`` before it, and
``finish(globals())`` after it. A snippet marked ``loop`` starts from nothing but these
names:

- ``MyModel``: a small GPT-style language model (token and position embeddings, causal
  self-attention, an MLP, dropout), its weights the same on every rank;
- ``dataset``: ``dataset.batch(rank, step)`` -> ``(tokens, next_tokens)``, each
  ``(batch, sequence)``, the same for the same arguments;
- ``total``: the steps to train; ``checkpoint_every``: the steps between checkpoints.

A snippet marked ``built`` continues a loop's setup: the process group is initialised and
``model`` (the DDP model), ``optimizer``, ``scheduler``, ``loss_fn``, ``batch_for``, ``cfg``,
``device``, ``total`` and ``checkpoint_every`` exist (as the README's snippet makes them),
and, when the test starts a Kubernetes stand-in, ``quarantine`` (a ``KubeQuarantine`` that
acts on it); ``os``, ``sys``, ``torch``, ``dist`` and ``sdc_guard`` are imported.

The faults are planted through the data, as a faulty rank would meet them, and described by
``SNIPPET_FAULTS`` (JSON, see ``FaultPlan``): on ``rank``, at each step in ``flip``, the batch
fetch flips bit 22 of one weight of the live model (a corrupt weight: the weights check
sees it); at each step in ``nan``, the batch carries a token that makes that rank's forward
non-finite (a corrupt activation: the non-finite check withholds the step). A fault fires
the first time its step's batch is fetched on its rank, so a rollback past it trains that
step clean (the part was replaced), unless ``persist`` (it fires every time).

``finish`` prints ``SNIPPET-END rank R fingerprint F`` (the state of the model and the
optimizer) and tears the process group down in the order DDP needs.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sdc_guard

__all__ = ["MyModel", "build", "checkpoint_every", "dataset", "finish", "total"]

VOCAB = 48
"""Token ids 0..VOCAB-2 are text; VOCAB-1 is the poison token of a planted ``nan`` fault."""
POISON = VOCAB - 1
SEQ = 16
BATCH = 8

total = int(os.environ.get("SNIPPET_TOTAL", "24"))
checkpoint_every = int(os.environ.get("SNIPPET_CHECKPOINT_EVERY", "4"))


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """The faults of one run (``SNIPPET_FAULTS``)."""

    rank: int = 1
    """The faulty rank."""
    flip: tuple[int, ...] = ()
    """Steps at whose batch fetch bit 22 of the first weight of the attention's input
    projection is flipped on ``rank``."""
    nan: tuple[int, ...] = ()
    """Steps whose batch on ``rank`` makes that rank's forward non-finite."""
    persist: bool = False
    """Fire every time the step's batch is fetched (a fault a rollback does not remove)."""
    fired: set[tuple[str, int]] = field(default_factory=set, compare=False)

    @classmethod
    def from_env(cls) -> FaultPlan:
        raw = json.loads(os.environ.get("SNIPPET_FAULTS", "{}"))
        return cls(rank=int(raw.get("rank", 1)), flip=tuple(raw.get("flip", ())),
                   nan=tuple(raw.get("nan", ())), persist=bool(raw.get("persist", False)))

    def fires(self, kind: str, steps: tuple[int, ...], rank: int, step: int) -> bool:
        """Does the fault ``kind`` fire now, for this fetch of ``rank``'s batch of ``step``?"""
        if rank != self.rank or step not in steps or dist.get_rank() != self.rank:
            return False
        if self.persist:
            return True
        first = (kind, step) not in self.fired
        self.fired.add((kind, step))
        return first


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (w // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, w)
        h = h + self.drop(self.proj(y))
        out: torch.Tensor = h + self.drop(self.mlp(self.ln2(h)))
        return out


class MyModel(nn.Module):
    """A small GPT: logits ``(batch, sequence, VOCAB)`` for tokens ``(batch, sequence)``."""

    live: MyModel | None = None
    """The model of this process (the one ``dataset`` plants faults in)."""

    def __init__(self, width: int = 32, layers: int = 2, heads: int = 2,
                 dropout: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)  # every replica starts from the same weights
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        self.drop = nn.Dropout(dropout)
        MyModel.live = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks:
            h = block(h)
        logits: torch.Tensor = self.head(self.ln(h))
        if dist.get_rank() == dataset.plan.rank and bool((x == POISON).any()):
            logits = logits * float("nan")  # this rank's hardware, on the poisoned batch
        return logits


class Dataset:
    """Synthetic text: a token and the next, deterministic in (rank, step)."""

    def __init__(self) -> None:
        self.plan = FaultPlan.from_env()

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * step + rank)
        seq = torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1), generator=g)
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()
        if self.plan.fires("nan", self.plan.nan, rank, step):
            x[0, 0] = POISON
        if self.plan.fires("flip", self.plan.flip, rank, step) and MyModel.live is not None:
            block = MyModel.live.blocks[0]
            assert isinstance(block, Block)
            block.qkv.weight.detach().view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 22)
            print(f"harness: rank {rank} weight bit flipped at step {step}", flush=True)
        return x, y


dataset = Dataset()


def build() -> dict[str, Any]:
    """The names a ``built`` snippet assumes (the module doc)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    model = DDP(MyModel().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)

    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    def batch_for(rank: int, step: int) -> list[torch.Tensor]:
        return [t.to(device) for t in dataset.batch(rank, step)]

    names: dict[str, Any] = {
        "os": os, "sys": sys, "torch": torch, "dist": dist, "sdc_guard": sdc_guard,
        "device": device, "model": model, "optimizer": optimizer, "scheduler": scheduler,
        "loss_fn": loss_fn, "batch_for": batch_for,
        "cfg": sdc_guard.GuardConfig(replay_interval=10, deterministic=True,
                                     event_log="sdc-events.jsonl"),
    }
    kubeconfig = os.environ.get("SNIPPET_KUBECONFIG")
    if kubeconfig:
        from sdc_guard.remediation import KubeQuarantine
        names["quarantine"] = KubeQuarantine(dry_run=False, max_nodes=1, max_fraction=0.5,
                                             kubeconfig=kubeconfig)
    return names


def finish(names: dict[str, Any]) -> None:
    """Print this rank's final state, then leave as DDP needs (the reducer's destructor joins
    a gloo thread that waits for the GIL: a process that skips this can hang at exit)."""
    model, optimizer = names["model"], names.get("optimizer", names.get("opt"))
    state = sdc_guard.fingerprint(sdc_guard.state_tensors(model.module, optimizer))
    print(f"SNIPPET-END rank {dist.get_rank()} fingerprint {state:016x}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    names.clear()
    gc.collect()
    dist.destroy_process_group()
    os._exit(0)


logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
