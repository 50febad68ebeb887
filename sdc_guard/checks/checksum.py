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
of the two tensor hooks and the view (``_product_node``). The two sides of
each identity cost a few vector passes over ``X``, ``Y``, ``GY``, ``GX``, ``GW``
and ``W``: O(N in + N out + in out) against the product's O(N in out).

The weight's sums (``W^T e``, ``|W|^T e``, ``W e``, ``|W| e``) are taken once per
step, at the layer's first call (``_w_key``): the forward identity is checked in
the forward hook, while ``X`` and ``Y`` are in cache, and the input gradient's is
by rows so that the backward reads no weight (by columns, ``e^T GX = (e^T GY) W``,
it needs a product with ``W`` there; docs/checks/checksum.md weighs the two). On the
CPU, for float32 layers with the exact bound, C passes of the native kernel read
each matrix once (``W`` and ``|W|`` in one read) and compare in C, one call per hook
(``NativeKernel.cs_fwd``, ``cs_bwd``; ``cs_gx`` for a ``GX`` seen on its own) into a
workspace the layer keeps (``_Layer.pool``), and ``GW e`` comes from the local
gradient bucket, summed by the comm hook's scaling pass in the read that scales it
(``bucket_weight_grad``, ``row_sums``); elsewhere torch operations do it (``|W|``
formed for the weight's sums, small products per call, ``GW`` read in a hook on ``W``).

**Tolerance, from the rounding-error bound.** Both sides are computed in
float32 (upcast). With ``u(t)`` the unit roundoff of dtype ``t`` (float32 2^-24,
bfloat16 2^-8, float16 2^-11) and ``g(n, u) = n u / (1 - n u)``, a checksum
entry whose product has inner length ``K`` passes when::

    |lhs - rhs| <= s * ( g(K, u_acc) + u_out + 2 u_in + g(L + R + 2, u32) ) * M * (1 + 1e-3)

``u_acc``: the accumulation (float32 for float32, bfloat16 and float16 products;
on CUDA, with reduced-precision reductions allowed, the product's own dtype over
``ceil(log2 K)`` levels of split sums); ``u_out``: the rounding of the product to
its dtype; ``u_in``: the rounding of each operand to the product's dtype when it
arrives in another one (autocast; TF32 counts as 2^-11); ``L`` and ``R``: the
lengths of the two checksum sides' float32 sums; ``M``: the sum of the absolute
values of every term of the entry (``sum_jk |X_ik| |W_jk| + sum_j |b_j|`` for a
forward row, ``sum_jk |GY_ij| |W_jk|`` for an input-gradient row,
``sum_ik |GY_ij| |X_ik|`` for a weight-gradient row), computed exactly, with the
same matrix products as the checksums applied to absolute values;
``s``: ``ChecksumConfig.tolerance_scale`` (1 by default: the bound itself, no
per-model constant). This is the worst-case bound (Higham, *Accuracy and
Stability of Numerical Algorithms*, ch. 3), so a clean product never fails it;
the price is that a corruption smaller than it is invisible. For a float32
entry of the reference MLP the bound is about ``1e-4 M``: a flip of an exponent
bit or of the top mantissa bits of a term of typical size is seen, a flip of the
lower mantissa bits is not. In bfloat16 (7 mantissa bits) the bound is a few
ulps of ``M``: only exponent and sign flips of large terms stand out
(the campaign report's ``checksum_bits.svg`` shows, bit by bit, where the line falls;
docs/checks/checksum.md).

**Contained in the step, with no new collective.** A rank whose products fail
writes the largest finite value of the dtype into its own slot (element
``rank``) of the step's last gradient bucket, after the non-finite scan and
before the all-reduce (the DDP backend's *veto sentinel*,
``sdc_guard.parallel.ddp``). The all-reduce
then carries it to every rank, where that element is at least half the largest
finite value (no real gradient is): every rank withholds its optimizer step,
the same step, without a word exchanged. The sentinel is finite, also when
several ranks veto at once (each writes its own slot), so the non-finite check
does not report it, and a ``GradScaler`` does not see an overflow (the guard
skips its ``step`` and ``update``: the scale is kept). With a comm hook of the
user's own (which may compress or keep state), the sentinel is not written:
the backend carries the veto in a one-word all-reduce started just before the
last gradient all-reduce and waited for before the optimizer step instead.
The check only answers ``veto`` and reads the answer it is handed (``vetoed``).
``GuardConfig.skip_step_on_detection=False`` turns containment off (nothing is
written into the gradients).

**Naming the rank needs one word**, exchanged like the non-finite check's
(``flagword.DeferredFlags``): every rank puts the products that failed (three
bits) and the index of the first failing layer as bits of int64 words; the words
of ``exchange_interval`` steps travel in one small all-reduce that nobody waits
for and are judged a step later, so the detection, with its own step, names the
rank, the layer and the products on every rank, one to ``exchange_interval``
steps after the step. On the suspect rank the detection's evidence also holds
every failing entry (layer, product, micro-batch, residual, bound).

What it cannot see: corruptions below the bound (above); layers that are not
``nn.Linear`` (convolutions, attention's batched products, embeddings, norms:
the next step for this check); the weight gradient of a weight tied to another
module (an embedding shared with the output layer: its gradient sums both uses; the
other two products are still checked); weight gradients once a gradient is taken
inside the loss (an input gradient with ``create_graph=True``: ``_inner_backward``); a
layer whose forward is not the stock
``nn.Linear.forward`` (a LoRA or quantised subclass computes something else
than ``X W^T + b``) unless named in ``ChecksumConfig.layers``, which asserts
the identity holds at its boundary; a layer whose weight is parametrized
(``spectral_norm``, ``weight_norm``: reading it runs the parametrization again);
a module used by a functional call that bypasses its ``forward``
(``nn.MultiheadAttention``'s ``out_proj``); and faults outside the products
(optimizer, all-reduce, storage): the other checks' work.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parametrize

from sdc_guard.checks import sides
from sdc_guard.checks.base import Check, Verdict
from sdc_guard.checks.flagword import DeferredFlags
from sdc_guard.checks.weightpass import WeightPass
from sdc_guard.config import PRODUCTS, ChecksumConfig
from sdc_guard.fingerprints.native import NativeKernel, active_kernel
from sdc_guard.fingerprints.public import WeightSums
from sdc_guard.parallel.base import (
    Backend,
    Bucket,
    Containment,
    GradientListener,
    bucket_gradients,
)
from sdc_guard.report import Detection
from sdc_guard.scaling import Flag, RowSums
from sdc_guard.state import ddp_ignored

log = logging.getLogger(__name__)

_U32 = 2.0 ** -24
_UNIT = {torch.float32: _U32, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8,
         torch.float16: 2.0 ** -11}
_TF32 = 2.0 ** -11


def unit_roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff of a floating dtype (half its machine epsilon)."""
    u = _UNIT.get(dtype)
    if u is None:
        raise ValueError(f"the checksum check handles float32, float64, bfloat16 and float16 "
                         f"products, not {dtype}.")
    return u


def _gamma(n: int, u: float) -> float:
    nu = n * u
    return nu / (1.0 - nu) if nu < 0.5 else math.inf


def accumulation(dtype: torch.dtype, device: torch.device, k: int) -> float:
    """``g(K, u_acc)``: the accumulation error of a product of inner length ``k`` in ``dtype``."""
    if dtype == torch.float64:
        return _gamma(k, _UNIT[torch.float64])
    acc = _gamma(k, _U32)
    if device.type == "cuda":
        matmul = torch.backends.cuda.matmul
        reduced = (dtype == torch.float16 and matmul.allow_fp16_reduced_precision_reduction) or (
            dtype == torch.bfloat16 and matmul.allow_bf16_reduced_precision_reduction)
        if reduced:  # split-K partial sums rounded to the product's dtype, level by level
            acc += math.ceil(math.log2(max(k, 2))) * unit_roundoff(dtype)
    return acc


def input_rounding(compute: torch.dtype, operands: tuple[torch.dtype, ...],
                   device: torch.device) -> float:
    """``2 u_in``: the rounding of the operands that arrive in another dtype than ``compute``
    (autocast), or to TF32 when CUDA float32 products may use it."""
    if compute == torch.float32 and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return 2 * _TF32
    return sum(unit_roundoff(compute) for d in operands if d != compute)


def tolerance(scale: float, *, k: int, checked: int, compute: torch.dtype,
              operands: tuple[torch.dtype, ...], device: torch.device) -> float:
    """The factor that multiplies ``M`` (module doc): ``k`` the product's inner length,
    ``checked`` the lengths of the two checksum sides' float32 sums together (``L + R``)."""
    if device.type != "cuda":
        return _tolerance(scale, k, checked, compute, tuple(operands), "cpu", None)
    matmul = torch.backends.cuda.matmul
    flags = (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    return _tolerance(scale, k, checked, compute, tuple(operands), "cuda", flags)


@functools.lru_cache(maxsize=4096)
def _tolerance(scale: float, k: int, checked: int, compute: torch.dtype,
               operands: tuple[torch.dtype, ...], device: str,
               flags: tuple[bool, bool, bool] | None) -> float:
    """``tolerance``, cached: a hook asks for it every step with the same sizes; ``flags``
    (CUDA's TF32 and reduced-precision settings, read at each call) are part of the key."""
    at = torch.device(device)
    factor = (accumulation(compute, at, k) + unit_roundoff(compute)
              + input_rounding(compute, operands, at) + _gamma(checked + 2, _U32))
    return scale * factor * (1.0 + 1e-3)


@functools.lru_cache(maxsize=4096)
def _cpu_tolerance(scale: float, k: int, checked: int) -> float:
    """``tolerance`` of a float32 product of float32 operands on the CPU (cached: the native
    path asks for it every step with the same sizes)."""
    cpu = torch.device("cpu")
    return tolerance(scale, k=k, checked=checked, compute=torch.float32,
                     operands=(torch.float32, torch.float32), device=cpu)


_F32 = 4
_F32_DTYPE = torch.float32
_PER_THREAD = 1 << 20
"""Elements per thread of a native pass (below that, starting a thread costs more)."""


def _threads(elements: int) -> int:
    if elements < 2 * _PER_THREAD:  # one thread, without asking torch for its count
        return 1
    return max(1, min(torch.get_num_threads(), elements // _PER_THREAD))


def _flat_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` (float32 on the CPU, at least 1-D) as rows the C passes can read in place, and
    their stride: a contiguous tensor as its rows (no view made; the usual case, asked
    first), a 2-D matrix with unit column stride as it is, anything else copied first."""
    if t.is_contiguous():
        return t, t.shape[-1]
    ld = _row_stride(t)
    if ld >= 0:
        return t, ld
    t = t.reshape(-1, t.shape[-1]).contiguous()
    return t, t.shape[-1]


def _rows_ok(t: torch.Tensor) -> bool:
    """A 2-D float32 CPU matrix the C passes can read in place (unit column stride)."""
    return t.dtype is _F32_DTYPE and t.device.type == "cpu" and _row_stride(t) >= 0


def _row_stride(t: torch.Tensor) -> int:
    """The row stride of ``t`` if it is a 2-D matrix with unit column stride whose rows do
    not overlap, else -1 (its dtype and device not looked at: the caller knows them)."""
    st = t.stride()
    return st[0] if len(st) == 2 and st[1] == 1 and st[0] >= t.shape[1] else -1


_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_PRODUCT_NODES = {"AddmmBackward0": 1, "MmBackward0": 0}
"""The autograd nodes of ``F.linear``'s product, and where their input's gradient is among
the gradients they pass on (``addmm(b, X, W^T)``: b, X, W^T; ``mm(X, W^T)``: X, W^T)."""


def _product_node(out: torch.Tensor, weight: torch.Tensor) -> tuple[Any, int] | None:
    """The autograd node that multiplies by ``weight`` to give ``out`` (under at most two
    reshapes, as ``F.linear`` flattens a 3-D input), and the index of the input's gradient
    among its gradients; None unless the graph is exactly that (a subclass's own forward,
    a fault injector's product, an unknown torch version: the tap and tensor hooks then)."""
    node = out.grad_fn
    for _ in range(2):
        if node is None or node.name() not in _VIEW_NODES:
            break
        node = node.next_functions[0][0]
    if node is None:
        return None
    at = _PRODUCT_NODES.get(node.name())
    if at is None:
        return None
    nxt = node.next_functions
    transpose = nxt[at + 1][0] if len(nxt) == at + 2 else None
    if transpose is None or transpose.name() != "TBackward0":
        return None
    leaf = transpose.next_functions[0][0]  # W^T's source: W, maybe through a cast
    if leaf is not None and leaf.name() == "ToCopyBackward0":
        leaf = leaf.next_functions[0][0]
    if leaf is None or getattr(leaf, "variable", None) is not weight:
        return None
    return node, at


_EDGE_DEPTH = 4
"""How many autograd nodes deep under a call's output ``_weight_edge`` looks."""


def _weight_edge(out: torch.Tensor, weight: torch.Tensor,
                 x: torch.Tensor) -> tuple[Any, int] | None:
    """The autograd node of one call that passes ``weight`` its gradient (its edge into the
    weight's gradient accumulator) and that edge's index among its gradients, searched from
    the call's output down to its input ``x`` (not below: an earlier call of the same layer
    lies there), at most ``_EDGE_DEPTH`` nodes deep; None if there is none."""
    stop, seen = x.grad_fn, set()
    frontier = [out.grad_fn]
    for _ in range(_EDGE_DEPTH):
        below = []
        for node in frontier:
            if node is None or node is stop or id(node) in seen:
                continue
            seen.add(id(node))
            for i, (child, _) in enumerate(node.next_functions):
                if child is not None and getattr(child, "variable", None) is weight:
                    return node, i
                below.append(child)
        frontier = below
    return None


def linear_layers(model: nn.Module, patterns: tuple[str, ...] | None) -> list[tuple[str, nn.Linear]]:
    """The layers a ``ChecksumConfig.layers`` selects, in ``named_modules`` order.

    A layer whose weight or bias is parametrized (``torch.nn.utils.parametrizations``:
    ``spectral_norm``, ``weight_norm``, ``orthogonal``) is never chosen: ``m.weight``
    computes the tensor anew at each access, so the hooks would have to run the
    parametrization again to read the weight the product used, and spectral_norm's
    power iteration updates its buffers each time it runs (training would then differ from
    the unguarded run, and from the replay's recomputation)."""
    chosen = []
    for name, m in model.named_modules():
        if (not isinstance(m, nn.Linear) or parametrize.is_parametrized(m)
                or not m.weight.is_floating_point()):
            continue
        if patterns is None:
            if type(m).forward is nn.Linear.forward:
                chosen.append((name, m))
        elif any(fnmatch.fnmatchcase(name, p) for p in patterns):
            chosen.append((name, m))
    if patterns is not None:
        for p in patterns:
            if not any(fnmatch.fnmatchcase(name, p) for name, _ in chosen):
                linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
                parametrized = [n for n, m in model.named_modules()
                                if isinstance(m, nn.Linear) and parametrize.is_parametrized(m)]
                raise ValueError(f"ChecksumConfig.layers: {p!r} matches no floating-point "
                                 f"nn.Linear of the model that can be checked; its linear "
                                 f"layers: {linears}" + (
                                     f" ({parametrized} parametrized: not checkable, their "
                                     "weight is computed anew at each access)"
                                     if parametrized else "") + ".")
    return chosen


def _node_shape(out: torch.Tensor, found: tuple[Any, int]) -> tuple[type, int, type, int]:
    """``_Layer.node_shape`` of a graph ``_product_node`` accepted."""
    node, depth = out.grad_fn, 0
    while node is not None and node is not found[0]:
        node, depth = node.next_functions[0][0], depth + 1
    return type(out.grad_fn), depth, type(found[0]), found[1]


def _known_node(out: torch.Tensor,
                shape: tuple[type, int, type, int] | None) -> tuple[Any, int] | None:
    """The product node of a stock ``nn.Linear`` call whose graph starts as the layer's last
    one did (``_product_node`` checked that one through to the weight), else None."""
    node = out.grad_fn
    if shape is None or type(node) is not shape[0]:
        return None
    for _ in range(shape[1]):
        if node is None:
            return None
        node = node.next_functions[0][0]
    return (node, shape[3]) if type(node) is shape[2] else None


@dataclass(slots=True)
class _Call:
    """One forward call of a layer in this micro-batch: what its checks still need."""

    x: torch.Tensor
    """The input, ``N x in`` (a reference: autograd keeps it for ``GW`` anyway; on the C
    path as the layer got it, maybe 3-D, and not detached, which would be a tensor
    operation: read it under ``no_grad``)."""
    sums: torch.Tensor
    """float32, from the forward hook: ``X e``, ``|X| e`` and ``Y e`` (``N`` each), the
    output's taken there because a later in-place operation (an in-place ReLU) may change
    the output itself. On the C path the call's whole workspace (``_NATIVE_WS``)."""
    rows: int
    """``N``: the input's rows (all its dimensions but the last)."""
    micro_batch: int = 0
    tapped: bool = False
    """The input needs a gradient: the input-gradient product is checked."""
    gx_rhs: torch.Tensor | None = None
    gx_bound: torch.Tensor | None = None
    """The input gradient's bound with the tolerance applied (``ChecksumCheck._gy_sides``)."""
    gy_dtype: torch.dtype | None = None
    native: bool = False
    """Checked by the C passes (``_gy_native``): float32 on the CPU with the exact bound."""
    gx_ready: bool = False
    """The C passes left the input gradient's right-hand side and bound in ``sums``."""
    via_node: bool = False
    """Its backward is seen through the product's node (``ChecksumCheck._on_node``): a tap
    the pre-hook installed on its input (not knowing yet) is ignored."""
    gy: torch.Tensor | None = None
    """Seen without the product's node, with the weight's gradient hooked: ``GY``, kept from
    the output's hook until the node that passes the weight its gradient has run
    (``ChecksumCheck._on_weight_edge``)."""
    plan: _Plan | None = None
    """The C path's: its forward call's plan (``_Plan``), which keeps its backward's too."""

    @property
    def x_rows(self) -> torch.Tensor:
        """float32 ``2 x N``: per row of ``X``, its sum and the sum of its absolute values."""
        n = self.rows
        return self.sums[:2 * n].view(2, n)

    @property
    def y_sum(self) -> torch.Tensor:
        """float32 ``N``: the output's row sums."""
        n = self.rows
        return self.sums[2 * n:3 * n]


@dataclass(slots=True)
class _Plan:
    """What the C forward call of a layer's call needs that ``X``'s and ``Y``'s sizes fix
    (``ChecksumCheck._plan``): kept from step to step, so that a hook does not work them out
    again (a checked step's Python is much of what the check costs)."""

    x_shape: torch.Size
    y_shape: torch.Size
    n: int
    ws: torch.Tensor
    """The call's workspace (``_Layer.pool``)."""
    sizes: tuple[int, int, int]
    """``N``, ``in`` and ``X``'s row stride."""
    y_sizes: tuple[int, int]
    """``out`` and ``Y``'s row stride."""
    sums: tuple[int, int]
    """The addresses of the weight's sums and of the bias's (``_Layer.wsum``)."""
    work: tuple[int]
    """The workspace's address."""
    tol: float
    threads: tuple[int, int]
    """The passes' threads over ``X`` and over ``Y``."""
    bwd: _Backward | None = None
    """The backward call's, found at its first (``ChecksumCheck._gy_native``)."""
    x2: torch.Tensor | None = None
    y2: torch.Tensor | None = None
    """A plan made for one call only: ``X`` and ``Y`` as the C passes read them (copies of
    tensors whose rows are not evenly spaced)."""


@dataclass(slots=True)
class _Backward:
    """What the C backward call of a layer's call needs that its sizes fix (``_Plan.bwd``)."""

    out: int
    sums: tuple[int, int, int]
    """The addresses of ``W e``, ``|W| e`` (``_Layer.wsum``) and of the workspace."""
    gxs: int
    """The address of the input gradient's part of the workspace."""
    inner: int
    tol: float
    threads: tuple[int, int]
    """The passes' threads over ``GY`` and over ``GX``."""


_NATIVE_WS = 8
"""A C-path call's workspace, in units of ``N`` floats: ``sdc_cs_fwd``'s (``X e``,
``|X| e``, ``Y e``, the forward's right-hand side and bound), then ``sdc_cs_bwd``'s (the
input gradient's right-hand side and bound, ``GX e``)."""
_GXS = 5
"""Where ``sdc_cs_bwd``'s part of the workspace starts (in units of ``N``)."""


@dataclass(slots=True)
class _Layer:
    name: str
    index: int
    module: nn.Linear
    node_ok: bool = False
    """The layer's last call had a product node (``_product_node``): its next call is seen
    through the node, with no tap on its input."""
    via_node: bool = False
    """Set by the forward pre-hook for the call under way: it installed no tap."""
    posted: bool = False
    """The call under way was seen by this check's global forward hook (``_FrontHook``):
    the layer's own forward hook leaves it."""
    checked: bool = False
    """The forward pre-hook found the call under way one to check (the check active, a
    non-empty input tensor, not a recomputation) and started its micro-batch (``_fresh``):
    the forward hook reads it (once) instead of asking again."""
    node_shape: tuple[type, int, type, int] | None = None
    """What ``_product_node`` last found: the output's node type, the views above the
    product, the product node's type, its input gradient's index. A call of the stock
    forward whose graph starts alike is the same graph (``_known_node``)."""
    native: bool = False
    """Float32 weight (and bias) the C passes can read: set at each checked step's start."""
    gw_checked: bool = True
    """The weight-gradient identity is checked: asked for, the weight is no other module's
    too (a tied embedding's gradient adds into the same ``W.grad``), and DDP all-reduces it
    (not named in ``_ddp_params_and_buffers_to_ignore``)."""
    calls: list[_Call] = field(default_factory=list)
    w_key: tuple[int, ...] | None = None
    """The step and the weight's (and bias's) version the sums in ``wsum`` were taken at:
    once per step, and again if the weight changes within it."""
    sides_key: tuple[int, ...] | None = None
    """The same for ``sides``."""
    norm_key: tuple[int, ...] | None = None
    """The same for ``w_norm``."""
    wsum: torch.Tensor | None = None
    """The C path's sums of the weight: ``e^T W``, ``e^T |W|`` (``in`` each), ``W e``,
    ``|W| e`` (``out`` each), then the bias's sum and absolute sum (``sdc_cs_fwd``)."""
    sides: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None,
                 torch.Tensor, torch.Tensor] | None = None
    """The torch path's: ``e^T W``, ``e^T |W|``, ``W e``, ``|W| e`` in float32 (the
    absolute ones None with the "norm" bound), the bias's sum and absolute sum."""
    w_norm: torch.Tensor | None = None
    """float32 0-d: ``||W||_F`` at the weight version ``norm_key`` (the "norm" bound)."""
    gw_rhs: torch.Tensor | None = None
    gw_bound: torch.Tensor | None = None
    gw_rows: int = 0
    gw_dtype: torch.dtype | None = None
    """The dtype the weight gradient was computed in (its output's gradient's)."""
    plans: list[_Plan] = field(default_factory=list)
    """The C forward calls' plans, by the call's index in the micro-batch (``_Plan``)."""
    pool: list[torch.Tensor] = field(default_factory=list)
    """The C path's workspaces, one per call of the layer in a micro-batch, kept from step to
    step (an allocation per call is a dispatch and, often, fresh pages)."""
    gw_buf: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """The C path's weight-gradient sides (right-hand side, bound) and ``GW e``, kept."""
    gw_at: tuple[int, int] = (0, 0)
    """The addresses of ``gw_buf``'s sides."""
    handles: list[Any] = field(default_factory=list)
    gw_step: bool = False
    """The weight-gradient identity is checked in this step: ``gw_checked``, and the weight
    requires a gradient now (a layer frozen during training has none: DDP's bucket holds
    zeros for it while its backward may still run, for the layers before it)."""
    weight_hook: int | None = None
    """The id of this check's own hook on the weight (``_on_gw``), if it has one."""
    gw_at_node: bool = False
    """The weight has gradient hooks of the user's (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``: a clamp, a per-layer scale), which change its
    gradient after the product made it: the weight-gradient identity is then checked at
    the product's node, call by call, on the gradient the product passes on
    (``ChecksumCheck._gw_node``), never on ``W.grad``; a call seen without that node (a
    subclass's or a fault injector's own product), on the gradient the node of the call that
    passes the weight its gradient gives (``_weight_edge``). Found at each checked step's
    start (``_gradient_hooked``)."""
    called: bool = False
    """The layer's forward ran in a checked step (``ChecksumCheck.uncalled``)."""
    ask: WeightSums | None = None
    """What the weights check's pass after the last optimizer step was asked to take into
    ``wsum`` (``ChecksumCheck.weight_sums``), at the weight's version ``ask_key``."""
    ask_key: tuple[int, ...] | None = None
    pre_sums: bool = False
    """``wsum`` holds the sums that pass took (``ask``), not yet found good or stale by a
    failing entry (``ChecksumCheck._stale``)."""
    fuse: bool = True
    """The weight's sums may come from the weights check's pass: cleared for good once they
    were found stale (the weight written between the pass and the product where its version
    counter does not see it, through ``.data``)."""
    w: torch.Tensor | None = None
    """The layer's weight (``module.weight``) as the step found it (``begin_step``)."""
    b: torch.Tensor | None = None
    """Its bias, likewise (None without one)."""


_OWN_GLOBAL_HOOKS: set[int] = set()
"""The ids of the checks' global forward hooks (``_FrontHook``) among torch's."""


class _FrontHook:
    """A global forward hook of the check's, kept first among the global forward hooks while
    the user has any (``nn.modules.module.register_module_forward_hook``): torch runs the
    global hooks before a module's own, so one that replaces a linear layer's output, or
    changes it in place, would otherwise run before the check reads the product (a false
    mismatch in every product of every step). It hands the check's layers' calls to their
    forward hooks, and is removed when the user's global hooks are gone (a global hook
    takes every module call of the process off torch's fast path)."""

    def __init__(self) -> None:
        self.posts: dict[nn.Module, Any] = {}
        self.handle: Any = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        post = self.posts.get(module)
        if post is not None:
            post(module, args, out)

    def keep_first(self) -> None:
        """Before a checked layer's call: first among the global forward hooks if the user
        has one, absent otherwise."""
        hooks = nn.modules.module._global_forward_hooks
        users = any(k not in _OWN_GLOBAL_HOOKS for k in hooks)
        if not users:
            if self.handle is not None:
                self.remove()
            return
        if self.handle is None:
            self.handle = nn.modules.module.register_module_forward_hook(self)
            _OWN_GLOBAL_HOOKS.add(self.handle.id)
        for k in hooks:  # ahead of every hook of the user's (another guard's may lead)
            if k == self.handle.id:
                break
            if k not in _OWN_GLOBAL_HOOKS:
                hooks.move_to_end(self.handle.id, last=False)  # type: ignore[attr-defined]
                break

    def remove(self) -> None:
        if self.handle is not None:
            _OWN_GLOBAL_HOOKS.discard(self.handle.id)
            self.handle.remove()
            self.handle = None


_is_compiling = torch.compiler.is_compiling


def _eager(hook: Any) -> Any:
    """``hook``, run eagerly where torch.compile traces it: torch.compile meets a call of
    ``torch.compiler.disable(hook)`` there (a graph break), while a module called eagerly
    calls ``hook`` itself, without the disabling wrapper's own work (it saves and restores
    the frame evaluator on every call: a few microseconds a hook in a training step)."""
    hidden = torch.compiler.disable(hook)  # type: ignore[no-untyped-call]

    def run(*args: Any) -> Any:
        if _is_compiling():
            return hidden(*args)
        return hook(*args)
    return run


_GRAPH_TASK = getattr(torch._C, "_current_graph_task_id", None)
"""The running backward's graph task id (-1 outside one), where this torch has it."""
_TOP_SAVED_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _in_backward() -> bool:
    """Is a backward running (this forward call a recomputation inside it)?"""
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


def _versions(w: torch.Tensor, b: torch.Tensor | None) -> tuple[int, int, int]:
    """A weight's (and bias's) storage and versions: its sums are taken again when they move."""
    return (w.data_ptr(), w._version, -1 if b is None else b._version)


def _gradient_hooked(layer: _Layer, w: torch.Tensor) -> bool:
    """Does anything but this check change the weight ``w``'s gradient between the product
    and ``W.grad`` (``_Layer.gw_at_node``)? DDP's own hooks are not the tensor's."""
    hooks = w._backward_hooks
    return bool(getattr(w, "_post_accumulate_grad_hooks", None)) or bool(
        hooks and any(k != layer.weight_hook for k in hooks))


def _full_backward_hooked(module: nn.Module) -> bool:
    """Does a full backward hook (``register_full_backward_hook``, the module's or a global
    one) see this module's input gradient? It may return another one, which then flows to
    the input in place of the product's: a tap on the input would see that."""
    return bool((module._backward_hooks and module._is_full_backward_hook)
                or (nn.modules.module._global_backward_hooks
                    and nn.modules.module._global_is_full_backward_hook))


def _recomputing() -> bool:
    """Is this forward call activation checkpointing's recomputation without reentry
    (``torch.utils.checkpoint(..., use_reentrant=False)``)? It runs inside the backward,
    under saved-tensor hooks, only to regenerate the tensors the backward saved (it stops
    as soon as it has them, often before the layer's forward hook): no backward runs
    through its output, so its calls are not the layer's (the forward's own call was
    checked). The reentrant form's recomputation, with no such hooks, is the graph its
    backward runs through: checked as a call."""
    task, top = _GRAPH_TASK, _TOP_SAVED_HOOKS
    if task is None or top is None:  # not in this torch: every call counts
        return False
    if task() == -1:  # not inside a backward
        return False
    try:
        hooks = top(False)
    except TypeError:  # older signature, without ignore_is_tracing
        hooks = top()
    return hooks is not None


@dataclass
class _Failure:
    """One set of checksum entries (read on the host only when one of them failed)."""

    layer: _Layer
    product: str
    micro_batch: int
    bad: torch.Tensor
    """0-d bool."""
    diff: torch.Tensor
    bound: torch.Tensor
    entries: list[_Entries] | None = None
    """Compared together (``ChecksumCheck._compared``): ``diff``, ``bound`` and ``each`` are
    theirs laid end to end, and ``split`` tells which of them failed."""
    each: torch.Tensor | None = None

    def split(self) -> list[_Failure]:
        """The products that failed, each with its own entries (host reads: after a failure)."""
        if self.entries is None or self.each is None:
            return [self] if bool(self.bad) else []
        out, at = [], 0
        for e in self.entries:
            n = e.lhs.numel()
            bad = self.each[at:at + n].any()
            if bool(bad):
                out.append(_Failure(e.layer, e.product, e.micro_batch, bad,
                                    self.diff[at:at + n], self.bound[at:at + n]))
            at += n
        return out

    def excess(self) -> float:
        """The largest ``|lhs - rhs| / tolerance`` (inf for a non-finite entry)."""
        ratio = self.diff / self.bound.clamp_min(torch.finfo(torch.float32).tiny)
        return float(ratio.nan_to_num(nan=math.inf).max())


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def _full_precision(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The checksum sides' products in float32 where CUDA autocast is on (a forward hook runs
    inside the user's autocast region, and CUDA autocast runs ``mv``/``addmv`` in half
    precision: sides rounded to 8 bits, which the tolerance does not allow for); elsewhere
    nothing to do (CPU autocast leaves ``mv``/``addmv`` alone)."""
    if t.is_cuda and torch.is_autocast_enabled():
        return torch.autocast("cuda", enabled=False)
    return contextlib.nullcontext()


@dataclass(slots=True)
class _Entries:
    """One product's checksum entries on the torch path, compared with the step's others at
    once (``ChecksumCheck._compared``): a comparison per product would be six kernels each."""

    layer: _Layer
    product: str
    micro_batch: int
    lhs: torch.Tensor
    rhs: torch.Tensor
    bound: torch.Tensor
    """The tolerance: ``|lhs - rhs|`` may not exceed it."""


class ChecksumCheck(Check, GradientListener):
    """Checksums of every checked linear layer's three products; see the module doc."""

    name = "checksum"
    wants_veto = True

    def __init__(
        self,
        model: nn.Module,
        config: ChecksumConfig,
        *,
        backend: Backend,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        expect_overflow: bool = False,
        contain: bool = True,
        weight_pass: WeightPass | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.group = group
        self.expect_overflow = expect_overflow
        self.contain = contain
        self._backend = backend
        self._weight_pass = weight_pass
        self.exact = config.bound == "exact"
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        self.layers = [_Layer(n, i, m) for i, (n, m) in
                       enumerate(linear_layers(inner, config.layers))]
        """The checked layers, in ``named_modules`` order (a detection names their index)."""
        self.skipped = [n for n, m in inner.named_modules() if isinstance(m, nn.Linear)
                        and n not in {layer.name for layer in self.layers}]
        """``nn.Linear`` modules left out: a forward of their own, a non-float weight, a
        parametrized weight or bias (``linear_layers``), or not named in
        ``ChecksumConfig.layers``."""
        self._want = {p: p in config.products for p in PRODUCTS}
        holders: dict[int, int] = {}
        for mod in inner.modules():
            for p in mod.parameters(recurse=False):
                holders[id(p)] = holders.get(id(p), 0) + 1
        # A tied weight's gradient also holds the others' share. A weight DDP ignores is in
        # no bucket: its gradient may come after the last one, when the step's verdict is
        # already cast, so a failure there could not be contained.
        ignored = ddp_ignored(model)
        for layer in self.layers:
            layer.gw_checked = (self._want["weight_grad"]
                                and holders.get(id(layer.module.weight), 0) == 1
                                and id(layer.module.weight) not in ignored)
        self._kernel: NativeKernel | None = (
            active_kernel() if self.exact and device.type == "cpu" else None)
        """The C passes, for float32 layers on the CPU with the exact bound (the same
        identities and tolerances as the torch ops; one read of each matrix)."""
        self._generation = 0
        """Counts checked steps: the weight's sums are taken at least once per step."""
        self._layer_bits = max(1, (len(self.layers) + 1).bit_length())
        self._clean_flags = (False,) * (len(PRODUCTS) + self._layer_bits)
        """A step's bits where no product failed (``_local_flags``)."""
        self._active = False
        self._micro = 0
        self._failures: list[_Failure] = []
        """The C path's failures (only failed products are recorded there)."""
        self._entries: list[_Entries] = []
        self._batch: list[_Failure] | None = None
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._front = _FrontHook()
        self._local: dict[int, list[dict[str, Any]]] = {}
        """This rank's failing entries per step, kept until the step is judged."""
        self._deferred = DeferredFlags(len(PRODUCTS) + self._layer_bits, config.exchange_interval,
                                       device=device, group=group)
        """Every rank's bits per step (``_local_flags``), judged a step after they travel."""
        self._answer: Containment | None = None
        """This step's containment answer (``vetoed``)."""
        self.bucket_weight_grad = self._kernel is not None and all(
            layer.module.weight.dtype == torch.float32 for layer in self.layers)
        """The weight-gradient identity is checked on the local gradient bucket, its row
        sums taken by the comm hook's scaling pass in the same read (``row_sums``), instead of
        by a hook on each weight (a read of ``GW`` of its own): float32 weights on the CPU
        with the C kernel. ``GW e`` is then the step's weight gradient summed over its
        micro-batches, against the right-hand sides summed likewise."""
        self._by_weight = {id(layer.module.weight): layer for layer in self.layers}
        self._rows_pending: list[tuple[_Layer, torch.Tensor]] = []
        self._bucket_weights: dict[int, tuple[tuple[int, int], list[tuple[_Layer, torch.Tensor]]]] = {}
        """Per bucket index: (its buffer's address and size, the weight gradients in it)."""
        self.native_calls = 0
        """Layer calls whose products the C passes checked (the rest: torch operations)."""
        self.pre_sums_used = 0
        """Steps' first calls of a layer that took the weight's sums from the weights check's
        pass (``weight_sums``) instead of reading the weight again."""
        self.stale_sums = 0
        """Times those sums were found stale (``_stale``): the weight written through
        ``.data`` between the pass and the product."""
        self._forward_phase = False
        """Between a checked layer's forward and ``on_loss``: a backward now is ``loss_fn``'s."""
        self.inner_backward = False
        """A backward ran inside ``loss_fn`` (``_inner_backward``): weight gradients unchecked."""
        self.unseen_input_grads = 0
        """Calls whose input gradient went unchecked: the pre-hook expected the product's
        node (as on the layer's last call, with the stock forward and a 2-D or contiguous
        input) and the graph had none. Not seen in any shipped model or test."""
        self.uncalled: list[str] | None = None
        """After the first checked step: the chosen layers whose forward did not run in it
        (a module used through a functional call that bypasses its ``forward``, such as
        ``nn.MultiheadAttention``'s ``out_proj``, never checked; or one that step did not
        use, such as an expert no token was routed to, checked in the steps that run it).
        Logged once as a warning."""
        for layer in self.layers:
            self._hook(layer)
        backend.subscribe(self)
        if weight_pass is not None:  # the weights' sums taken in the weights check's read
            weight_pass.subscribe(self.weight_sums)

    # -- hooks --------------------------------------------------------------------------------
    def _hook(self, layer: _Layer) -> None:
        """Hooks on the layer: a forward hook that sums ``X`` and ``Y`` and hooks the call's
        backward. The backward is seen through the product's own autograd node (its
        gradients in and out: ``GY`` and this call's ``GX``, ``_product_node``) when the
        layer's graph has one; otherwise (and on a layer's first call, to find out) through a
        hook on ``Y`` and one on a view of ``X`` that only this call consumes (the *tap*,
        installed by a forward pre-hook)."""
        m = layer.module

        def pre(mod: nn.Module, args: tuple[Any, ...]) -> Any:
            layer.via_node = False
            layer.posted = False
            layer.checked = False
            if nn.modules.module._global_forward_hooks or self._front.handle is not None:
                self._front.keep_first()
            if (not self._active or not args or not isinstance(args[0], torch.Tensor)
                    or args[0].numel() == 0):
                return None  # an empty input (an expert no token was routed to): no product
            if _in_backward():  # (the reentrant checkpoint's recomputation runs in one)
                if _recomputing():
                    return None
            else:
                self._forward_phase = True
            self._fresh(layer)
            layer.checked = True
            x = args[0]
            # The product's node will be there (as on the last call): no tap needed. Only
            # the stock forward on a 2-D or contiguous input multiplies in one addmm/mm.
            if (layer.node_ok and "forward" not in mod.__dict__
                    and type(mod).forward is nn.Linear.forward
                    and (x.dim() <= 2 or x.is_contiguous())):
                layer.via_node = True
                return None
            if not (self._want["input_grad"] and x.requires_grad and torch.is_grad_enabled()):
                return None
            if _full_backward_hooked(mod):  # its GX may not be the product's: no tap
                return None
            tap = x.view_as(x)  # consumed by this layer only: its hook sees this layer's GX
            call_index = len(layer.calls)
            tap.register_hook(  # type: ignore[no-untyped-call]
                lambda gx: self._on_tap(layer, call_index, gx))
            return (tap, *args[1:])

        def post(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            checked, layer.checked = layer.checked, False
            if not (checked and isinstance(out, torch.Tensor)):
                return  # (the pre-hook found no product to check, or a recomputation)
            layer.called = True
            x = args[0]
            backward = out.requires_grad and torch.is_grad_enabled()
            via_node, layer.via_node = layer.via_node, False
            found = None
            if backward:
                found = _known_node(out, layer.node_shape) if via_node else None
                if found is None:
                    found = _product_node(out, m.weight)
                    layer.node_shape = None if found is None else _node_shape(out, found)
            layer.node_ok = found is not None
            if via_node and found is None and backward:  # not as predicted: no GX this call
                self.unseen_input_grads += int(bool(x.requires_grad) and self._want["input_grad"])
            if found is not None:  # GY and GX (and, hooked, GW) from the product's node
                node, gx_at = found
                tapped = bool(x.requires_grad) and self._want["input_grad"]
                self._on_forward(layer, x, out, tapped)
                call = layer.calls[-1]
                call.via_node = True  # (a tap installed for this call is ignored)
                call_index = len(layer.calls) - 1
                node.register_hook(lambda grads_in, grads_out: self._on_node(
                    layer, call, call_index, grads_out[0], grads_in[gx_at] if tapped else None,
                    grads_in[gx_at + 1] if layer.gw_at_node else None))
                return
            tapped = (bool(x.requires_grad) and self._want["input_grad"] and not via_node
                      and not _full_backward_hooked(m))
            self._on_forward(layer, x, out, tapped)
            call = layer.calls[-1]
            if not backward:
                return
            edge = (_weight_edge(out, m.weight, x) if layer.gw_step and layer.gw_at_node
                    else None)
            if edge is not None:  # GW at the node that passes it on, GY kept for it
                out.register_hook(  # type: ignore[no-untyped-call]
                    lambda gy: self._on_gy(layer, call, gy, keep=True))
                edge[0].register_hook(lambda grads_in, grads_out: self._on_weight_edge(
                    layer, call, grads_in[edge[1]]))
            else:
                out.register_hook(  # type: ignore[no-untyped-call]
                    lambda gy: self._on_gy(layer, call, gy))

        # Hidden from torch.compile (``_eager``): traced, the hooks' reads of ``self._active``
        # would give the train step and the replay (checks idle) different graphs, whose
        # kernels need not agree bit for bit; run eagerly, they split both the same way.
        # The forward hook runs first (prepend): it sees the product's own output, before a
        # forward hook of the user's replaces it or changes it in place.
        # The user's global forward hooks run before any of the module's: then the check's
        # global one (``_FrontHook``), kept before them, reads the call and this one leaves it.
        def own(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if layer.posted:
                layer.posted = False
                return
            post(mod, args, out)

        def front(mod: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            layer.posted = True
            post(mod, args, out)

        layer.handles.append(m.register_forward_pre_hook(_eager(pre)))
        layer.handles.append(m.register_forward_hook(_eager(own), prepend=True))
        self._front.posts[m] = _eager(front)
        if layer.gw_checked and m.weight.requires_grad and not self.bucket_weight_grad:
            handle = m.weight.register_hook(  # type: ignore[no-untyped-call]
                lambda gw: self._on_gw(layer, gw))
            layer.weight_hook = handle.id
            layer.handles.append(handle)

    def _on_node(self, layer: _Layer, call: _Call, call_index: int, gy: torch.Tensor | None,
                 gx: torch.Tensor | None, gwt: torch.Tensor | None = None) -> None:
        """The product node's post-hook: its output's gradient ``GY`` and, when checked, this
        call's input gradient ``GX`` (both 2-D: the node multiplies the flattened input);
        ``gwt``, the gradient of ``W^T`` it passes on (``in x out``: its column sums are
        ``GW e``), when the weight's gradient is hooked (``_Layer.gw_at_node``)."""
        if gy is None:
            return
        if self._forward_phase and self._active:
            self._inner_backward(layer)
        kernel = self._kernel
        if (self._active and call.native and kernel is not None
                and gy.dtype is _F32_DTYPE and (gx is None or gx.dtype is _F32_DTYPE)):
            # (on the CPU: the call's input and weight were, and the node's gradients are)
            self._gy_native(kernel, layer, call, *_flat_rows(gy),
                            *((None, 0) if gx is None else _flat_rows(gx)))
        else:
            self._on_gy(layer, call, gy)
            if gx is not None:
                self._on_gx(layer, call_index, gx)
        if gwt is not None and self._active and layer.gw_step and layer.gw_at_node:
            self._gw_node(layer, call, gy, gwt.detach().sum(0, dtype=torch.float32))

    def _on_weight_edge(self, layer: _Layer, call: _Call, gw: torch.Tensor | None) -> None:
        """The post-hook of the node that passes a hooked weight its gradient, for a call
        seen without the product's node (``_weight_edge``): ``gw`` is this call's ``GW``."""
        gy, call.gy = call.gy, None
        if gw is not None and gy is not None and self._active and layer.gw_step:
            self._gw_node(layer, call, gy, gw.detach().sum(1, dtype=torch.float32))

    def _gw_node(self, layer: _Layer, call: _Call, gy: torch.Tensor,
                 lhs: torch.Tensor) -> None:
        """The weight-gradient identity of one call, on the gradient a node passes on before
        the user's hooks see it (``lhs``: its row sums, this call's share of ``GW e``)
        against ``GY^T (X e)``, within ``|GY|^T (|X| e)`` times the tolerance. Torch
        operations: only for a weight whose gradient is hooked (``_Layer.gw_at_node``)."""
        g = gy.detach().reshape(-1, gy.shape[-1])
        n = g.shape[0]
        tol = tolerance(self.config.tolerance_scale, k=n,
                        checked=2 * layer.module.in_features + n, compute=g.dtype,
                        operands=(call.x.dtype,), device=gy.device)
        with _full_precision(g):
            gf = g if g.dtype == torch.float32 else g.float()
            x_rows = call.x_rows
            rhs = torch.mv(gf.t(), x_rows[0])
            bound = torch.addmv(self._zero(g.device), gf.abs().t(), x_rows[1], beta=0,
                                alpha=tol)
        self._record(layer, "weight_grad", call.micro_batch, lhs, rhs, bound)

    def _on_tap(self, layer: _Layer, call_index: int, gx: torch.Tensor) -> None:
        """The tap's hook: the input gradient of a call not seen through its node."""
        if call_index < len(layer.calls) and not layer.calls[call_index].via_node:
            self._on_gx(layer, call_index, gx)

    def _fresh(self, layer: _Layer) -> None:
        """A forward of a new micro-batch: the previous one's calls are done with."""
        if layer.calls and layer.calls[-1].micro_batch != self._micro:
            layer.calls.clear()

    def close(self) -> None:
        """Remove every hook this check added (``SDCGuard.reconfigure`` calls it)."""
        self._backend.unsubscribe(self)
        if self._weight_pass is not None:
            self._weight_pass.unsubscribe(self.weight_sums)
        for layer in self.layers:
            for h in layer.handles:
                h.remove()
            layer.handles.clear()
        self._front.remove()
        self._front.posts.clear()
        self._active = False

    # -- the identities -----------------------------------------------------------------------
    def _record(self, layer: _Layer, product: str, micro_batch: int, lhs: torch.Tensor,
                rhs: torch.Tensor, bound: torch.Tensor) -> None:
        self._entries.append(_Entries(layer, product, micro_batch, _flat(lhs), _flat(rhs),
                                      _flat(bound)))
        self._batch = None

    def _compared(self) -> list[_Failure]:
        """The step's torch-path entries compared, all of them at once per device: one
        ``_Failure`` per device whose entries' ``bad`` says whether any failed, or, when one
        did, one per product that failed (with its entries, for the evidence)."""
        if self._batch is not None:
            return self._batch
        by_device: dict[torch.device, list[_Entries]] = {}
        for e in self._entries:
            by_device.setdefault(e.lhs.device, []).append(e)
        out = []
        for entries in by_device.values():
            dtypes = {t.dtype for e in entries for t in (e.lhs, e.rhs, e.bound)}
            wide = functools.reduce(torch.promote_types, dtypes)  # an exact widening

            def joined(ts: list[torch.Tensor], wide: torch.dtype = wide) -> torch.Tensor:
                return torch.cat([t if t.dtype == wide else t.to(wide) for t in ts])

            lhs = joined([e.lhs for e in entries])
            rhs = joined([e.rhs for e in entries])
            bound = joined([e.bound for e in entries])
            diff = (lhs - rhs).abs()
            # Only an entry with a finite bound can fail: a non-finite bound means non-finite
            # operands (a NaN in the data), whose product is non-finite without any fault in
            # it. Then NaN and Inf fail, except with a GradScaler: an overflow is the
            # scaler's business.
            bad = (((diff > bound) & torch.isfinite(diff)) if self.expect_overflow
                   else ~(diff <= bound) & torch.isfinite(bound))
            first = entries[0]
            out.append(_Failure(first.layer, first.product, first.micro_batch, bad.any(), diff,
                                bound, entries, bad))
        self._batch = out
        return out

    def _forward_tol(self, layer: _Layer, x: torch.Tensor, y_dtype: torch.dtype) -> float:
        m = layer.module
        inner = x.shape[-1]
        return tolerance(self.config.tolerance_scale, k=inner + 1,
                         checked=2 * m.out_features + inner, compute=y_dtype,
                         operands=(x.dtype, m.weight.dtype), device=x.device)

    def _forward_norm(self, layer: _Layer, call: _Call, xf: torch.Tensor) -> None:
        """The forward identity of ``call`` by torch operations with the "norm" bound, in the
        forward hook (``xf``: its input in float32)."""
        w_col, _, _, _, b_sum, b_abs = self._sides(layer)  # (0-d zeros: no bias)
        tol = self._forward_tol(layer, call.x, call.gy_dtype or self._y_dtype(layer, call.x))
        rhs = torch.addmv(b_sum, xf, w_col)
        # <= ||X_i||_2 sum_j ||W_j||_2 <= ||X_i||_2 sqrt(out) ||W||_F
        bound = (torch.linalg.vector_norm(xf, dim=1) * (
            math.sqrt(layer.module.out_features) * self._weight_norm(layer)) + b_abs) * tol
        self._record(layer, "forward", call.micro_batch, call.y_sum, rhs, bound)

    @staticmethod
    def _y_dtype(layer: _Layer, x: torch.Tensor) -> torch.dtype:
        return torch.promote_types(x.dtype, layer.module.weight.dtype)

    def _w_key(self, layer: _Layer) -> tuple[int, ...]:
        """When the weight's sums are to be taken (again): once per step, and when the
        weight or bias changed since (its version)."""
        return (self._generation, *self._version_key(layer))

    @staticmethod
    def _version_key(layer: _Layer) -> tuple[int, ...]:
        """The weight's (and bias's) storage and versions."""
        m = layer.module
        return _versions(m.weight, m.bias)

    def weight_sums(self, step: int) -> list[WeightSums]:
        """The weight sums the shared pass over the weights after ``step``'s optimizer step
        (``WeightPass``, which this check subscribes to) is asked to take in the same read:
        those the next step's first forward would otherwise read each weight again for. The
        C path's layers (the exact bound, float32, a contiguous weight no other checked
        layer shares), when the check is due at the next step.

        The sums serve the next step's first call if the weight's version is still the
        one they were taken at; a write through ``.data`` in between changes no version, so
        an entry that fails against them is checked again (``_stale``)."""
        kernel = self._kernel
        if kernel is None or not self.exact or not self.due(step + 1):
            for layer in self.layers:
                layer.ask = None
            return []
        seen: set[int] = set()
        shared: set[int] = set()
        for layer in self.layers:
            w_id = id(layer.w)
            (shared if w_id in seen else seen).add(w_id)
        asks = []
        for layer in self.layers:
            # (the tensors the step found: if the module got others since, the weights
            # check's pass, which matches them by address, reads none of these)
            w, b = layer.w, layer.b
            if not (w is not None and layer.fuse and layer.native and layer.wsum is not None
                    and id(w) not in shared and w.is_contiguous()):
                layer.ask = None
                continue
            # The same ask as last step's while it names the same tensors (only its version
            # moves on): no objects made per step.
            ask = layer.ask
            if not (ask is not None and ask.weight.data_ptr() == w.data_ptr()
                    and ask.weight.shape == w.shape and ask.out is layer.wsum
                    and (ask.bias is None if b is None else
                         ask.bias is not None and ask.bias.data_ptr() == b.data_ptr()
                         and ask.bias.shape == b.shape)):
                ask = layer.ask = WeightSums(w.detach(), None if b is None else b.detach(),
                                             layer.wsum, kernel.threads_for(w.numel()))
            ask.taken = False
            layer.ask_key = _versions(w, b)
            asks.append(ask)
        return asks

    def _stale(self, layer: _Layer) -> bool:
        """An entry failed against the sums from the weights check's pass: take them again
        by the same pass (the same threads: the same bits if the weight is what it was).
        True if they changed: the weight was written since where its version counter does
        not see it (through ``.data``), and the layer takes its own sums from then on."""
        layer.pre_sums = False
        ask, kernel = layer.ask, self._kernel
        if ask is None or kernel is None or layer.wsum is None:
            return False
        before = layer.wsum.view(torch.int32).clone()
        ask.take(kernel)
        if torch.equal(before, layer.wsum.view(torch.int32)):
            return False
        layer.fuse = False
        self.stale_sums += 1
        return True

    def _on_forward(self, layer: _Layer, x: torch.Tensor, y: torch.Tensor,
                    tapped: bool) -> None:
        """The forward hook's sums of ``X`` and ``Y`` (and of ``W``, once per step), and the
        forward identity checked right away, while ``X`` and ``Y`` are in cache."""
        kernel = self._kernel
        want = self._want["forward"]
        if (layer.native and kernel is not None and x.dtype is _F32_DTYPE
                and y.dtype is _F32_DTYPE):
            i = len(layer.calls)
            plan = layer.plans[i] if i < len(layer.plans) else None
            if not (plan is not None and plan.x_shape == x.shape and plan.y_shape == y.shape
                    and x.is_contiguous() and y.is_contiguous()):
                plan = self._plan(layer, x, y)
            x2, n, ws = plan.x2 if plan.x2 is not None else x, plan.n, plan.ws
            y_at = plan.y2.data_ptr() if plan.y2 is not None else y.data_ptr()
            w, bias = layer.w, layer.b  # (as the step found them: native says so)
            assert w is not None
            version = (w.data_ptr(), w._version, -1 if bias is None else bias._version)
            key = (self._generation, *version)  # (_versions, inline: a hook runs it every call)
            fresh = layer.w_key != key
            layer.w_key = key
            if fresh:  # the weights check's pass may have taken the sums already
                ask = layer.ask
                layer.pre_sums = ask is not None and ask.taken and layer.ask_key == version
                fresh = not layer.pre_sums
                self.pre_sums_used += layer.pre_sums
            # (the weight's address, row stride and bias are read by the C call only when
            # it takes the weight's sums, fresh)
            w_args = ((version[0], w.stride(0), None if bias is None else bias.data_ptr(), 1)
                      if fresh else (0, plan.sizes[1], None, 0))
            bad = kernel.cs_fwd(x2.data_ptr(), *plan.sizes, y_at, *plan.y_sizes, *w_args[:3],
                                *plan.sums, w_args[3], *plan.work, int(want), plan.tol,
                                int(self.expect_overflow), *plan.threads,
                                _threads(w.numel()) if fresh else 1)
            if bad and layer.pre_sums and self._stale(layer):  # against the sums of the
                bad = kernel.cs_fwd(x2.data_ptr(), *plan.sizes, y_at,   # weight as it is
                                    *plan.y_sizes, 0, plan.sizes[1], None, *plan.sums, 0,
                                    *plan.work, int(want), plan.tol,
                                    int(self.expect_overflow), *plan.threads, 1)
            call = _Call(x2, ws, n, self._micro, tapped, gy_dtype=y.dtype, native=True,
                         plan=plan)
            self.native_calls += 1
            if bad:
                assert layer.wsum is not None
                b0, b1 = layer.wsum[-2:].tolist()
                self._failed(layer, "forward", call.micro_batch, ws[2 * n:3 * n],
                             ws[3 * n:4 * n], ws[4 * n:5 * n], plan.tol, b0, b1)
        else:
            xd = x.detach().reshape(-1, x.shape[-1])
            y2 = y.detach().reshape(-1, y.shape[-1])
            n = xd.shape[0]
            with _full_precision(xd):
                if want and self.exact:  # sum_jk |X_ik||W_jk| + sum |b| bounds the identity
                    w_col, w_abs_col, _, _, b_sum, b_abs = self._sides(layer)
                    assert w_abs_col is not None
                    sums, rhs, bound = sides.forward_sides(
                        xd, y2, w_col, w_abs_col, b_sum, b_abs,
                        self._forward_tol(layer, xd, y.dtype))
                else:  # the sums the backward's identities need (and the "norm" bound's)
                    xf = xd if xd.dtype == torch.float32 else xd.float()
                    sums = torch.cat([xf.sum(1), torch.linalg.vector_norm(
                        xf, ord=1, dim=1), y2.sum(1, dtype=torch.float32)])
                call = _Call(xd, sums, n, micro_batch=self._micro, tapped=tapped,
                             gy_dtype=y.dtype)
                if want and self.exact:
                    self._record(layer, "forward", call.micro_batch, call.y_sum, rhs, bound)
                elif want:
                    self._forward_norm(layer, call, xf)
        layer.calls.append(call)

    def _plan(self, layer: _Layer, x: torch.Tensor, y: torch.Tensor) -> _Plan:
        """The C forward call's arguments that the sizes of ``X`` and ``Y`` fix, for the
        layer's next call in this micro-batch: kept (``_Layer.plans``) where both are
        contiguous, the usual case, else made for this call (with copies if need be)."""
        x2, ldx = _flat_rows(x)  # the C passes read rows at a stride: no view for 3-D
        y2, ldy = _flat_rows(y)
        inner, out = x2.shape[-1], y2.shape[-1]
        n = x2.numel() // inner if inner else 0
        ws = self._workspace(layer, _NATIVE_WS * n)
        wsum_t = layer.wsum
        if wsum_t is None:
            wsum_t = layer.wsum = torch.empty(2 * inner + 2 * out + 2)
        wsum = wsum_t.data_ptr()
        kept = x2 is x and y2 is y and x.is_contiguous() and y.is_contiguous()
        plan = _Plan(x.shape, y.shape, n, ws, (n, inner, ldx), (out, ldy),
                     (wsum, wsum + (2 * inner + 2 * out) * _F32), (ws.data_ptr(),),
                     _cpu_tolerance(self.config.tolerance_scale, inner + 1, 2 * out + inner),
                     (_threads(n * inner), _threads(n * out)),
                     x2=None if kept else x2, y2=None if kept else y2)
        if kept:
            i = len(layer.calls)
            if i < len(layer.plans):
                layer.plans[i] = plan
            else:
                layer.plans.append(plan)
        return plan

    @staticmethod
    def _workspace(layer: _Layer, size: int) -> torch.Tensor:
        """The workspace of the layer's next call in this micro-batch (``_Layer.pool``)."""
        i = len(layer.calls)
        pool = layer.pool
        if i < len(pool) and pool[i].numel() >= size:
            return pool[i]
        ws = torch.empty(size)
        if i < len(pool):
            pool[i] = ws
        else:
            pool.append(ws)
        return ws

    def _sides(self, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                             torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The torch path's sums of the weight (``_Layer.sides``), once per step."""
        key = self._w_key(layer)
        if layer.sides_key != key or layer.sides is None:
            layer.sides_key = key
            m = layer.module
            w = m.weight.detach()
            b = m.bias.detach() if m.bias is not None else None
            w_col, w_abs_col, w_row, w_abs_row, b_sum, b_abs = sides.weight_sides(
                w, b, self._zero(w.device), self.exact)
            assert w_col is not None and w_row is not None
            assert b_sum is not None and b_abs is not None
            layer.sides = (w_col, w_abs_col, w_row, w_abs_row, b_sum, b_abs)
        return layer.sides

    def _zero(self, device: torch.device) -> torch.Tensor:
        """A float32 0-d zero on ``device``, made once (a bias's sums without a bias; the input
        of ``addmv`` with ``beta=0``, which reads none of it)."""
        zero = self._zeros.get(device)
        if zero is None:
            zero = self._zeros[device] = torch.zeros((), device=device)
        return zero

    def _weight_norm(self, layer: _Layer) -> torch.Tensor:
        """``||W||_F`` in float32, once per step (the "norm" bound)."""
        key = self._w_key(layer)
        if layer.norm_key != key or layer.w_norm is None:
            w = layer.module.weight
            layer.w_norm = torch.linalg.vector_norm(w.detach(), dtype=torch.float32)
            layer.norm_key = key
        return layer.w_norm

    def _on_gy(self, layer: _Layer, call: _Call, gy: torch.Tensor, keep: bool = False) -> None:
        """The output's gradient ``GY`` of a call seen without its product's node; ``keep``:
        kept for the weight-gradient identity at the weight's node (``_on_weight_edge``)."""
        if not self._active:
            return
        if keep:
            call.gy = gy
        if self._forward_phase:
            self._inner_backward(layer)
        if call.native and self._kernel is not None and gy.dtype == torch.float32:
            self._gy_native(self._kernel, layer, call, *_flat_rows(gy))  # (no detach: pointers)
            return
        g = gy.detach().reshape(-1, gy.shape[-1])
        with _full_precision(g):
            self._gy_sides(layer, call, g)

    def _gy_sides(self, layer: _Layer, call: _Call, g: torch.Tensor) -> None:
        """``_on_gy`` by torch operations (``g``: ``GY``, 2-D): the input gradient's right-hand
        side and bound (the tolerance applied), and this call's share of the weight
        gradient's, one ``mv``/``addmv`` each."""
        call.gy_dtype = g.dtype
        gx = call.tapped
        gw = layer.gw_step and not layer.gw_at_node
        if not (gx or gw):
            return
        m = layer.module
        w_row = w_abs_row = None
        tol = 0.0
        if gx:  # the weight's sums (once a step) and the tolerance: the input gradient's only
            _, _, w_row, w_abs_row, _, _ = self._sides(layer)
            tol = tolerance(self.config.tolerance_scale, k=m.out_features,
                            checked=2 * m.in_features + m.out_features, compute=g.dtype,
                            operands=(m.weight.dtype,), device=g.device)
        x_rows = call.x_rows
        exact = w_abs_row is not None
        gx_rhs, gx_bound, gw_rhs, gw_bound = sides.gy_sides(
            g, w_row if gx and exact else None, w_abs_row if gx else None, tol,
            x_rows[0] if gw else None, x_rows[1] if gw else None, self._zero(g.device))
        if gx and not exact and w_row is not None:  # GY (W e), within ||GY_i||_2 sqrt(in) ||W||_F
            gf = g if g.dtype == torch.float32 else g.float()
            gx_rhs = torch.mv(gf, w_row)
            gx_bound = torch.linalg.vector_norm(gf, dim=1) * (
                tol * math.sqrt(m.in_features) * self._weight_norm(layer))
        if gx:
            call.gx_rhs, call.gx_bound = gx_rhs, gx_bound
        if gw and gw_rhs is not None and gw_bound is not None:
            if layer.gw_rhs is None or layer.gw_bound is None:
                layer.gw_rhs, layer.gw_bound = gw_rhs, gw_bound
            else:  # another call of the layer in this micro-batch: its share adds on
                layer.gw_rhs = layer.gw_rhs + gw_rhs
                layer.gw_bound = layer.gw_bound + gw_bound
            layer.gw_rows += g.shape[0]
            layer.gw_dtype = g.dtype

    def _gy_native(self, kernel: NativeKernel, layer: _Layer, call: _Call, g: torch.Tensor,
                   ldg: int, gx: torch.Tensor | None = None, ldx: int = 0) -> None:
        """``_on_gy`` (and ``_on_gx``, given ``gx``) by the C passes, in one call
        (``sdc_cs_bwd``): one read of ``GY`` for the input gradient's right-hand side and
        bound, ``GY (W e)`` and ``|GY| (|W| e)`` (``W``'s sums from the forward), and the
        weight gradient's, ``GY^T (X e)`` and ``|GY|^T (|X| e)``; then ``GX``'s row sums
        compared. Without ``gx`` the input gradient's sides stay in the workspace
        (``_on_gx``). ``g`` and ``gx`` as ``_flat_rows`` gives them, with their row strides."""
        n = call.rows
        call.gy_dtype = g.dtype
        gw = add = 0
        gw_at = gwb_at = 0
        if layer.gw_step and not layer.gw_at_node:
            if layer.gw_rhs is None or layer.gw_bound is None:
                if layer.gw_buf is None:
                    buf = torch.empty(3, g.shape[-1])
                    layer.gw_buf = (buf[0], buf[1], buf[2])
                    layer.gw_at = (buf[0].data_ptr(), buf[1].data_ptr())
                layer.gw_rhs, layer.gw_bound = layer.gw_buf[0], layer.gw_buf[1]
                gw_at, gwb_at = layer.gw_at
            else:  # another call of the layer in this micro-batch: its share adds on
                add = 1
                gw_at, gwb_at = layer.gw_rhs.data_ptr(), layer.gw_bound.data_ptr()
            gw = 1
            layer.gw_rows += n
            layer.gw_dtype = g.dtype
        side = call.tapped
        if not (gw or side) or layer.wsum is None:
            return
        plan = call.plan
        fixed = plan.bwd if plan is not None else None
        if fixed is None:  # what the call's sizes fix (kept with its forward's plan)
            out, inner = g.shape[-1], layer.module.in_features
            at = call.sums.data_ptr()
            wr = layer.wsum.data_ptr() + 2 * inner * _F32
            fixed = _Backward(out, (wr, wr + out * _F32, at), at + _GXS * n * _F32, inner,
                              _cpu_tolerance(self.config.tolerance_scale, out, 2 * inner + out),
                              (_threads(n * out), _threads(n * inner)))
            if plan is not None:
                plan.bwd = fixed
        out, inner, tol = fixed.out, fixed.inner, fixed.tol
        gx_at = gx.data_ptr() if gx is not None and side else None  # (an input gradient not
        ldx = ldx if gx_at is not None else inner                    # asked for: not compared)
        g_at = g.data_ptr()
        bad = kernel.cs_bwd(g_at, n, out, ldg, *fixed.sums, gw_at, gwb_at, gw, add, int(side),
                            fixed.gxs, gx_at, inner, ldx, tol, int(self.expect_overflow),
                            *fixed.threads)
        call.gx_ready = side and gx_at is None
        if bad and layer.pre_sums and self._stale(layer):  # again, against the sums as they are
            bad = kernel.cs_bwd(g_at, n, out, ldg, *fixed.sums, 0, 0, 0, 0, 1, fixed.gxs, gx_at,
                                inner, ldx, tol, int(self.expect_overflow), *fixed.threads)
        if bad:
            self._gx_failed(layer, call, n, tol)

    def _gx_failed(self, layer: _Layer, call: _Call, n: int, tol: float) -> None:
        """The C passes found input-gradient entries that fail: record them."""
        ws = call.sums
        at = _GXS * n
        self._failed(layer, "input_grad", call.micro_batch, ws[at + 2 * n:at + 3 * n],
                     ws[at:at + n], ws[at + n:at + 2 * n], tol)

    def _compare(self, layer: _Layer, product: str, micro_batch: int, lhs: torch.Tensor,
                 rhs: torch.Tensor | None, bound: torch.Tensor | None, tol: float,
                 rhs0: float = 0.0, bound0: float = 0.0) -> None:
        """The native path's ``_record``: entries compared in C; a failure recorded only when
        one fails (no tensor op otherwise)."""
        if self._kernel is None or rhs is None or bound is None:
            return
        bad = self._kernel.cs_compare(lhs.data_ptr(), rhs.data_ptr(), bound.data_ptr(),
                                      lhs.numel(), rhs0, bound0, tol, int(self.expect_overflow))
        if bad:
            self._failed(layer, product, micro_batch, lhs, rhs, bound, tol, rhs0, bound0)

    def _failed(self, layer: _Layer, product: str, micro_batch: int, lhs: torch.Tensor,
                rhs: torch.Tensor, bound: torch.Tensor, tol: float, rhs0: float = 0.0,
                bound0: float = 0.0) -> None:
        """A failure the C comparison found, with its entries (read for the evidence)."""
        diff = (lhs.double() - (rhs.double() + rhs0)).abs().float()
        limit = ((bound.double() + bound0) * tol).float()
        self._failures.append(_Failure(layer, product, micro_batch, torch.tensor(True), diff,
                                       limit))

    def _on_gx(self, layer: _Layer, call_index: int, gx: torch.Tensor) -> None:
        if not self._active or call_index >= len(layer.calls):
            return
        call = layer.calls[call_index]
        out = layer.module.out_features
        g = gx if gx.dim() == 2 else gx.reshape(-1, gx.shape[-1])
        n, inner = g.shape
        if call.gx_ready:  # the C passes left GY (W e) and its bound in the call's workspace
            at = _GXS * n
            if self._kernel is not None and g.dtype == torch.float32:
                g = g if _rows_ok(g) else g.contiguous()
                tol = _cpu_tolerance(self.config.tolerance_scale, out, 2 * inner + out)
                # A failure against sums found stale is not counted: the right-hand side
                # was taken from GY, gone now, so the entries cannot be checked again.
                if self._kernel.cs_gx(g.data_ptr(), n, inner, g.stride(0),
                                      call.sums.data_ptr() + at * _F32, tol,
                                      int(self.expect_overflow), _threads(g.numel())) and not (
                                          layer.pre_sums and self._stale(layer)):
                    self._gx_failed(layer, call, n, tol)
                return
            tol = tolerance(self.config.tolerance_scale, k=out, checked=2 * inner + out,
                            compute=call.gy_dtype or gx.dtype,
                            operands=(layer.module.weight.dtype,), device=gx.device)
            call.gx_rhs, call.gx_bound = call.sums[at:at + n], call.sums[at + n:at + 2 * n] * tol
        if call.gx_rhs is None or call.gx_bound is None:
            return
        lhs = g.detach().sum(1, dtype=torch.float32)  # against sides with the tolerance applied
        self._record(layer, "input_grad", call.micro_batch, lhs, call.gx_rhs, call.gx_bound)

    def _on_gw(self, layer: _Layer, gw: torch.Tensor) -> None:
        if not self._active:
            return
        if layer.gw_rhs is not None and layer.gw_bound is not None:
            n = layer.gw_rows
            g = gw.detach()
            if (self._kernel is not None and layer.calls and layer.calls[0].native
                    and _rows_ok(g) and layer.gw_dtype == torch.float32):
                lhs = torch.empty(g.shape[0])
                self._kernel.cs_rows(g.data_ptr(), g.shape[0], g.shape[1], g.stride(0), None,
                                     None, 1, None, None, 0, lhs.data_ptr(), None, None, None,
                                     _threads(g.numel()))
                self._compare(layer, "weight_grad", layer.calls[0].micro_batch, lhs,
                              layer.gw_rhs, layer.gw_bound, _cpu_tolerance(
                                  self.config.tolerance_scale, n, 2 * g.shape[1] + n))
                layer.gw_rhs = layer.gw_bound = None
                layer.gw_rows = 0
                return
            lhs = g.sum(1, dtype=torch.float32)
            x_dtype = layer.calls[0].x.dtype if layer.calls else gw.dtype
            tol = tolerance(self.config.tolerance_scale, k=n, checked=2 * gw.shape[1] + n,
                            compute=layer.gw_dtype or gw.dtype, operands=(x_dtype,),
                            device=gw.device)
            micro = layer.calls[0].micro_batch if layer.calls else self._micro
            self._record(layer, "weight_grad", micro, lhs, layer.gw_rhs, layer.gw_bound * tol)
        layer.gw_rhs = layer.gw_bound = None
        layer.gw_rows = 0

    def row_sums(self, bucket: Bucket) -> list[RowSums] | None:
        """The checked layers' weight gradients in this local bucket, whose row sums the
        comm hook's scaling pass takes (``bucket_weight_grad``)."""
        if not (self.bucket_weight_grad and self._active):
            return None
        requests: list[RowSums] = []
        self._rows_pending = []
        for layer, g in self._weights_in(bucket):
            if layer.gw_rhs is None:
                continue
            out = layer.gw_buf[2] if layer.gw_buf is not None else torch.empty(g.shape[0])
            requests.append((g, out))
            self._rows_pending.append((layer, out))
        return requests or None

    def _weights_in(self, bucket: Bucket) -> list[tuple[_Layer, torch.Tensor]]:
        """The checked layers' weight gradients in the bucket: views of its buffer, found once
        per buffer (DDP keeps a bucket's buffer from step to step; it may rebuild them once)."""
        buf = bucket.buffer()
        if buf.layout != torch.strided:  # a sparse gradient's own bucket: no linear weight
            return []
        index = bucket.index()
        key = (buf.data_ptr(), buf.numel())
        known = self._bucket_weights.get(index)
        if known is None or known[0] != key:
            found = [(layer, g) for p, g in zip(bucket.parameters(), bucket_gradients(bucket),
                                                  strict=True)
                     if (layer := self._by_weight.get(id(p))) is not None and g.dim() == 2]
            known = self._bucket_weights[index] = (key, found)
        return known[1]

    def after_scaling(self, bucket: Bucket, flag: Flag | None,
                      digest: int | torch.Tensor | None) -> None:
        """The weight-gradient identity of the layers ``row_sums`` asked for."""
        pending, self._rows_pending = self._rows_pending, []
        micro = 0 if self._micro <= 1 else -1  # -1: summed over the step's micro-batches
        for layer, lhs in pending:
            n = layer.gw_rows
            inner = layer.module.in_features
            x_dtype = layer.calls[0].x.dtype if layer.calls else torch.float32
            compute = layer.gw_dtype or torch.float32
            tol = (_cpu_tolerance(self.config.tolerance_scale, n, 2 * inner + n)
                   if compute == x_dtype == torch.float32 else
                   tolerance(self.config.tolerance_scale, k=n, checked=2 * inner + n,
                             compute=compute, operands=(x_dtype,), device=self.device))
            self._compare(layer, "weight_grad", micro, lhs, layer.gw_rhs, layer.gw_bound, tol)
            layer.gw_rhs = layer.gw_bound = None
            layer.gw_rows = 0

    def _done(self) -> None:
        """The step's products are all checked: let go of the step's inputs (as autograd
        does after the backward, not a step later)."""
        self._active = False
        for layer in self.layers:
            layer.calls.clear()

    # -- per step -----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.config.interval == 0

    def on_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's forward is done: forwards from now on belong to the next one."""
        self._micro += 1
        self._forward_phase = False

    def _inner_backward(self, layer: _Layer) -> None:
        """A layer's backward ran before ``loss_fn`` returned: a gradient taken inside the loss
        (an input gradient, as a gradient penalty or a physics-informed loss takes, with
        ``create_graph=True``). The layers' weight gradients then hold terms of that
        gradient's own graph, which no identity of the layer's product covers, and the
        products' backward runs more than once: the weight-gradient identity is not checked
        from now on (the forward and input-gradient ones still are), and said so once."""
        if self.inner_backward:
            return
        self.inner_backward = True
        for each in self.layers:
            each.gw_checked = each.gw_step = False
            each.gw_rhs = each.gw_bound = None
            each.gw_rows = 0
        log.warning("checksum: layer %r ran a backward inside loss_fn (a gradient taken in the "
                    "loss, as a gradient penalty or a physics-informed loss takes): the weight "
                    "gradients then hold terms no product identity covers, so the weight-"
                    "gradient identity is no longer checked; the forward and input-gradient "
                    "products still are", layer.name)

    def begin_step(self, step: int) -> None:
        self._active = True
        self._forward_phase = False
        self._micro = 0
        self._generation += 1
        self._failures = []
        self._entries = []
        self._batch = None
        self._answer = None
        kernel = self._kernel is not None
        for layer in self.layers:
            layer.calls.clear()
            layer.gw_rhs = layer.gw_bound = None
            m = layer.module
            w = layer.w = m.weight
            b = layer.b = m.bias
            layer.native = kernel and _rows_ok(w) and (
                b is None or (b.dtype is _F32_DTYPE and b.is_contiguous()))
            layer.gw_step = layer.gw_checked and w.requires_grad
            layer.gw_at_node = layer.gw_step and _gradient_hooked(layer, w)

    def _flags(self) -> tuple[Flag, list[_Failure]]:
        """Whether any entry failed (a host bool on the CPU, else a 0-d device bool)."""
        failures = self._failures + (self._compared() if self._entries else [])
        if not failures:
            return False, []
        if len(failures) == 1:
            flag = failures[0].bad
        else:
            flag = torch.stack([f.bad.to(failures[-1].bad.device) for f in failures]).any()
        return (bool(flag) if flag.device.type == "cpu" else flag), failures

    def veto(self) -> Flag | None:
        """Called by the comm hook before the step's last gradient all-reduce: does this rank
        withhold the step? The products of the step are all computed by then; later ones (the
        replay audit's arbitration) are not checked."""
        self._done()
        if not self.contain:
            return None
        flag, _ = self._flags()
        return flag

    def vetoed(self, answer: Containment) -> None:
        self._answer = answer

    def pre_step(self, step: int) -> Verdict:
        if self._active:  # no veto was asked for (no gradient all-reduce ran)
            self._done()
        if self.uncalled is None:
            self.uncalled = [layer.name for layer in self.layers if not layer.called]
            if self.uncalled:
                log.warning("checksum: layer(s) %s did not run their forward in step %d: a "
                            "layer is checked only in the steps that run its forward, so one "
                            "used through a functional call that bypasses it (as "
                            "nn.MultiheadAttention does with out_proj) is never checked",
                            self.uncalled, step)
        found = self._deferred.collect(self)
        answer, self._answer = self._answer, None
        withhold = (answer is not None and self.contain
                    and answer.read(expect_overflow=self.expect_overflow))
        self._deferred.add(step, self._local_flags(step))
        return Verdict(found, withhold=withhold)

    def _local_flags(self, step: int) -> Sequence[bool]:
        """This rank's bits for ``step``: one per product, then the first failing layer's index
        (plus one; 0 when none failed). Reads the failures on the host only when one did."""
        if not (self._failures or self._entries):  # nothing recorded: nothing failed
            self._batch = None
            return self._clean_flags
        products = [False] * len(PRODUCTS)
        first = 0
        flag, failures = self._flags()
        if bool(flag):  # a device flag: one host sync per checked step
            entries = []
            for f in (one for group in failures for one in group.split()):
                products[PRODUCTS.index(f.product)] = True
                first = first or f.layer.index + 1
                entries.append({"layer": f.layer.name, "product": f.product,
                                "micro_batch": f.micro_batch, "excess": f.excess()})
            self._local[step] = entries
        self._failures = []
        self._entries = []
        self._batch = None
        bits = [(first >> i) & 1 == 1 for i in range(self._layer_bits)]
        return products + bits

    def flush(self) -> list[Detection]:
        return self._deferred.flush(self)

    def rewind(self, step: int) -> None:
        self._deferred.rewind()
        self._local.clear()
        super().rewind(step)

    def judge(self, step: int, rows: list[list[int]]) -> list[Detection]:
        """The detection, if any, from every rank's bits for ``step`` (row r: rank r)."""
        n = len(PRODUCTS)
        failed: dict[int, dict[str, Any]] = {}
        for r, row in enumerate(rows):
            products = [p for p, bit in zip(PRODUCTS, row[:n], strict=True) if bit]
            if not products:
                continue
            index = sum(bit << i for i, bit in enumerate(row[n:])) - 1
            layer = self.layers[index].name if 0 <= index < len(self.layers) else None
            failed[r] = {"products": products, "layer": layer}
        local = self._local.pop(step, None)
        if not failed:
            return []
        suspects = tuple(sorted(failed))
        what = "; ".join(f"rank {r}: layer {v['layer']!r}, {'/'.join(v['products'])}"
                         for r, v in failed.items())
        evidence: dict[str, Any] = {"ranks": {str(r): v for r, v in failed.items()}}
        if local:
            evidence["entries"] = local
        return [Detection(
            "checksum", step, suspects,
            detail=f"linear-layer checksum mismatch ({what}): the product differs from its "
            "checksum by more than the rounding-error bound",
            evidence=evidence)]
