"""A CPU proxy for what a GPU step makes the host wait for, and for the ops a step dispatches.

On a CUDA device the host waits for the queued work whenever it reads a value from the device:
``.item()``, ``bool(t)`` and ``float(t)`` (all ``aten._local_scalar_dense``), ``.tolist()``,
``.numpy()``, ``.cpu()``/``.to("cpu")`` of a device tensor, ops whose output shape depends on
the values (``nonzero``, ``masked_select``, ``unique``...), and ``torch.tensor(host_data,
device=...)`` from pageable memory. On the CPU none of these waits, but the same code makes the
same calls: ``HostReads`` counts them while it is entered, by kind, so a test can hold a step
to a number of reads that plain training with the same optimizer also makes.

``DispatchedOps`` counts the aten ops dispatched (each a kernel launch or more on a GPU), by
name, so a test can see whether a check's ops grow with the number of parameters.

The C kernel (``sdc_guard.fingerprints.native``) reads CPU memory without dispatching: the
code GPUs take is the torch path, so the counts are taken with the kernel off.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_SHAPED = {"nonzero", "nonzero_static", "masked_select", "_unique", "_unique2",
                 "unique_dim", "unique_consecutive", "repeat_interleave", "bincount",
                 "histc", "_local_scalar_dense", "equal", "is_nonzero", "allclose"}
"""aten ops whose result the host must wait for: a value read to the host or an output whose
shape depends on the values. ``repeat_interleave`` with a tensor of repeats and ``bincount``
size their output from the values."""


class HostReads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the reads to the host made while entered, by kind (``.counts``; ``.total``).

    The aten ops of ``_VALUE_SHAPED`` are counted where they are dispatched; ``.tolist()``,
    ``.numpy()``, ``.cpu()`` and ``torch.tensor(..., device=...)`` copy without dispatching an
    op of their own on a CPU tensor, so they are counted where they are called (the methods
    are wrapped while entered)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: collections.Counter[str] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _VALUE_SHAPED:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def _wrap(self, owner: Any, attr: str, kind: str, counts: Any = None) -> None:
        original = getattr(owner, attr)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if counts is None or counts(*args, **kwargs):
                self.counts[kind] += 1
            return original(*args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, counted)

    def __enter__(self) -> HostReads:
        self._wrap(torch.Tensor, "tolist", "tolist")
        self._wrap(torch.Tensor, "numpy", "numpy")
        self._wrap(torch.Tensor, "cpu", "cpu")
        self._wrap(torch, "tensor", "tensor(device=)",
                   lambda *a, **k: k.get("device") is not None)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()


class DispatchedOps(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten ops dispatched while entered, by name (``.counts``; ``.total``)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
