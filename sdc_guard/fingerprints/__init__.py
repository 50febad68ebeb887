"""Fingerprints of tensors' exact bits: the public fingerprint, the replay digest, the C kernel.

``public``: ``fingerprint`` / ``fingerprint_tensor`` (order-sensitive, 64-bit);
``digest``: the replay audit's linear digest (version 2's lane sum, unmixed); ``words``: 64-bit helpers;
``weighted``: the odd-weighted sum under both; ``native``: the C kernel
(the sources in ``kernel/``), built on first use, and the switch that turns it off.
"""

from sdc_guard.fingerprints.native import native_enabled, native_kernel
from sdc_guard.fingerprints.public import fingerprint, fingerprint_tensor

__all__ = ["fingerprint", "fingerprint_tensor", "native_enabled", "native_kernel"]
