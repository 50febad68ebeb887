"""The backend seam: how a kind of data parallelism shows the checks its gradients.

``base`` is the interface the checks know (``Backend``, ``GradientListener``, ``Bucket``,
``Containment``); ``ddp`` is its implementation for ``DistributedDataParallel``
(``GuardCommHook``). docs/architecture.md describes both sides.
"""

from __future__ import annotations

from sdc_guard.parallel.base import (
    Backend,
    Bucket,
    BucketListener,
    Containment,
    DigestSpans,
    GradientListener,
    bucket_gradients,
)
from sdc_guard.parallel.ddp import GuardCommHook

__all__ = [
    "Backend",
    "Bucket",
    "BucketListener",
    "Containment",
    "DigestSpans",
    "GradientListener",
    "GuardCommHook",
    "bucket_gradients",
]
