"""injectors: corrupt real tensors on purpose during real distributed training.

A ``Fault`` (one frozen, validated record) says where, what and when; ``arm``
checks it against the model and installs it on its rank, returning an
``InjectionHandle`` (a context manager) that keeps the ground-truth records
and removes everything on exit. ``InjectionContext`` bundles what arming
needs, for an ``SDCGuard`` (``arm(fault, guard=guard)``) or a plain loop
(``arm(fault, context=InjectionContext.plain(...))`` and
``handle.begin_step(step)`` each step). ``injectors.bits`` is the bit-level
core: flips and value faults on any supported dtype, in place, by
reinterpreting the storage (bit 0 = least significant).

Sites: activation, activation_grad, gradient_before_allreduce,
gradient_after_allreduce, optimizer_state, weight_storage, linear_product.
Fault models: transient, intermittent (probability p per step), permanent.
``injectors.patterns`` names the shapes faults take in the field (bursts, columns,
multi-bit words, whole values, stuck bits), each with the study or hardware it imitates.
"""

from injectors.arm import InjectionHandle, arm, resolve_target
from injectors.bits import BitChange, BitLayout, flip_bits, layout_of, read_bits
from injectors.context import InjectionContext
from injectors.fault import KINDS, MODELS, PHASES, SITES, Fault, FaultError

__all__ = [
    "KINDS",
    "MODELS",
    "PHASES",
    "SITES",
    "BitChange",
    "BitLayout",
    "Fault",
    "FaultError",
    "InjectionContext",
    "InjectionHandle",
    "arm",
    "flip_bits",
    "layout_of",
    "read_bits",
    "resolve_target",
]
