"""Check "checksum": every ``nn.Linear`` product verified by a checksum identity, every step.

For a layer ``Y = X W^T + b`` (``X``: ``N x in``, ``W``: ``out x in``) the three
products of a training step satisfy checksum identities (Huang and Abraham's
algorithm-based fault tolerance), each verified here from what crosses the
layer's boundary, never by replacing its ``forward``::

    product       computed                 identity checked (e: a vector of ones)
    -----------   ----------------------   --------------------------------------------
    forward       Y  = X W^T + b           Y e        = X (W^T e) + (b . e)     per row i
    input_grad    GX = GY W                GX e       = GY (W e)                per row i
    weight_grad   GW = GY^T X              GW e       = GY^T (X e)              per row j

A forward hook sees ``X`` and ``Y`` (after the layer's own computation, so a
fault inside it is visible); a tensor hook on ``Y`` sees ``GY``; a tensor hook
on a view of ``X`` that only this layer consumes sees this layer's ``GX`` (not
the sum over ``X``'s other consumers); a tensor hook on ``W`` sees this
backward's ``GW`` before it is accumulated into ``W.grad``. Where the layer's
graph is ``F.linear``'s own (an ``addmm`` or ``mm`` node, under at most two
reshapes), one post-hook on that node sees ``GY`` and this call's ``GX`` instead
of the two tensor hooks and the view (``graph.product_node``). The two sides of
each identity cost a few vector passes over ``X``, ``Y``, ``GY``, ``GX``, ``GW``
and ``W``: O(N in + N out + in out) against the product's O(N in out).

The weight's sums (``W^T e``, ``|W|^T e``, ``W e``, ``|W| e``) are taken once per
step, at the layer's first call: the forward identity is checked in the forward hook,
while ``X`` and ``Y`` are in cache, and the input gradient's is by rows so that the
backward reads no weight (by columns, ``e^T GX = (e^T GY) W``, it needs a product with
``W`` there; docs/checks/checksum.md weighs the two). On the CPU, for float32 layers with
the exact bound, C passes of the native kernel read each matrix once (``W`` and ``|W|`` in
one read) and compare in C, one call per hook, and ``GW e`` comes from the local gradient
bucket, summed by the comm hook's scaling pass in the read that scales it; elsewhere torch
operations do it (``|W|`` formed for the weight's sums, small products per call, ``GW``
read in a hook on ``W``). Under FSDP2 (``fully_shard``) the weight is taken where FSDP2
gathers it, at each call, and ``GW e`` comes from the local gradients FSDP2 is about to
reduce-scatter. The tolerance is the rounding-error bound of each entry
(``bounds``), so there is no threshold to tune.

What it cannot see: corruptions below the bound; layers that are not ``nn.Linear``
(convolutions, attention's batched products, embeddings, norms: the next step for this
check); the weight gradient of a weight tied to another module (an embedding shared with
the output layer: its gradient sums both uses; the other two products are still checked);
weight gradients once a gradient is taken inside the loss (an input gradient with
``create_graph=True``: ``Hooks._inner_backward``); a layer whose forward is not the stock
``nn.Linear.forward`` (a LoRA or quantised subclass computes something else than
``X W^T + b``) unless named in ``ChecksumConfig.layers``, which asserts the identity holds
at its boundary; a layer whose weight is parametrized (``spectral_norm``, ``weight_norm``:
reading it runs the parametrization again); a module used by a functional call that
bypasses its ``forward`` (``nn.MultiheadAttention``'s ``out_proj``); and faults outside the
products (optimizer, all-reduce, storage): the other checks' work.

The package, one job a module:

- ``bounds``: the tolerance, pure functions of sizes and dtypes;
- ``graph``: the autograd plumbing (product nodes, taps, the global forward hook kept
  first, recomputations told from calls);
- ``state``: what the check keeps per layer, per call and per plan (``Layer``, ``Call``,
  ``Plan``, the C path's buffers and their addresses);
- ``cpu``: the C path (float32 on the CPU, exact bound), one foreign call per hook;
- ``torchpath``: the torch operations' path (with ``sdc_guard.checks.sides``, the sums
  themselves, eager or fused);
- ``hooks``: the hooks on each layer, and which path each call takes;
- ``check``: ``ChecksumCheck`` itself, the check protocol and the gradient listener,
  containment and the word that names the rank.
"""

from sdc_guard.checks.checksum.bounds import (
    accumulation,
    input_rounding,
    tolerance,
    unit_roundoff,
)
from sdc_guard.checks.checksum.check import ChecksumCheck, linear_layers

__all__ = [
    "ChecksumCheck",
    "accumulation",
    "input_rounding",
    "linear_layers",
    "tolerance",
    "unit_roundoff",
]
