"""The fork server that rank processes start from, with torch already imported.

A rank started with ``spawn`` imports torch, and DDP's constructor then imports
``torch._dynamo``: about 2 s of CPU per rank, paid again at every pool (re)start.
Forked from a server that imported them once, a rank starts in a fraction of a
second. ``context()`` is the multiprocessing context to start ranks with;
``start()`` starts the server now, so that it imports while the caller does its
own start-up (``python -m scenarios`` calls it before importing anything else).

This module imports no torch: the server is a process of its own, started by
``multiprocessing`` (it lives until the process that started it exits). CUDA is
not initialised in it, so its children may use their GPUs.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from typing import Any

PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo"]
"""What the server imports once for every rank (``torch._dynamo``: DDP's lazy import)."""


def context() -> Any:
    """A forkserver context that preloads ``PRELOAD``; spawn where there is no forkserver."""
    try:
        ctx = multiprocessing.get_context("forkserver")
    except ValueError:  # pragma: no cover - platforms without forkserver
        return multiprocessing.get_context("spawn")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the server now (a no-op if it runs, or where ranks are spawned); returns at once,
    the server imports in the background."""
    if context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def start_for(argv: Sequence[str]) -> None:
    """``start()`` if the ``python -m scenarios`` command line ``argv`` runs ranks on this
    machine (``run`` or ``campaign``, not as a ``torchrun`` rank)."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if argv[:1] and argv[0] in ("run", "campaign") and not launched:
        start()
