"""What the checksum check keeps: per layer (``Layer``), per call of a layer in a micro-batch
(``Call``), per size of a call on the C path (``Plan``, ``BackwardPlan``), the C path's buffers
of a layer (``NativeBuffers``, their raw addresses in ``Addresses``), a step's entries
(``Entries``, ``Failure``), and the check-wide state its hooks and paths share
(``CheckState``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sdc_guard.checks.checksum.graph import FrontHook, NodeShape
from sdc_guard.config import ChecksumConfig
from sdc_guard.fingerprints.native import CsBwdArgs, CsFwdArgs, NativeKernel
from sdc_guard.fingerprints.public import WeightSums

F32 = 4
"""Bytes of a float32 (the C path's addresses step by it)."""

NATIVE_WS = 8
"""A C-path call's workspace, in units of ``N`` floats: ``sdc_cs_fwd``'s (``X e``,
``|X| e``, ``Y e``, the forward's right-hand side and bound), then ``sdc_cs_bwd``'s (the
input gradient's right-hand side and bound, ``GX e``)."""
GXS = 5
"""Where ``sdc_cs_bwd``'s part of the workspace starts (in units of ``N``)."""


def versions(w: torch.Tensor, b: torch.Tensor | None) -> tuple[int, int, int]:
    """A weight's (and bias's) storage and versions: its sums are taken again when they move."""
    return (w.data_ptr(), w._version, -1 if b is None else b._version)


@dataclass(frozen=True, slots=True)
class Addresses:
    """The raw addresses of a layer's C-path buffers (``NativeBuffers``), taken once when the
    buffers are made: a foreign call takes addresses, not tensors."""

    wsum: int
    """The weight's sums: ``e^T W``, ``e^T |W|`` (``in`` floats each), ``W e``, ``|W| e``."""
    bsum: int
    """The bias's sum and absolute sum (two floats, after the weight's sums)."""
    w_row: int
    """``W e``, then ``|W| e`` at ``w_abs_row``: the input gradient's sides read them."""
    w_abs_row: int
    gw_rhs: int
    """The weight gradient's right-hand side, then its bound at ``gw_bound``."""
    gw_bound: int


@dataclass(frozen=True, slots=True)
class NativeBuffers:
    """The float32 buffers the C path keeps for a layer from step to step (made at its first
    C call: an allocation per step is a dispatch and, often, fresh pages)."""

    wsum: torch.Tensor
    """``e^T W``, ``e^T |W|`` (``in`` each), ``W e``, ``|W| e`` (``out`` each), then the bias's
    sum and absolute sum (``sdc_cs_fwd``, or the weights check's pass: ``WeightSums.out``)."""
    gw: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    """The weight gradient's right-hand side, its bound and ``GW e`` (``out`` each)."""
    at: Addresses

    @classmethod
    def make(cls, inner: int, out: int) -> NativeBuffers:
        wsum = torch.empty(2 * inner + 2 * out + 2)
        gw = torch.empty(3, out)
        w = wsum.data_ptr()
        return cls(wsum, (gw[0], gw[1], gw[2]), Addresses(
            wsum=w, bsum=w + (2 * inner + 2 * out) * F32, w_row=w + 2 * inner * F32,
            w_abs_row=w + (2 * inner + out) * F32, gw_rhs=gw[0].data_ptr(),
            gw_bound=gw[1].data_ptr()))


@dataclass(slots=True)
class BackwardPlan:
    """What the C backward call of a layer's call needs that its sizes fix (``Plan.bwd``)."""

    args: CsBwdArgs
    """``sdc_cs_bwd``'s arguments, built once: the sizes, the weight's sums and the
    workspace's addresses, the tolerance and the threads; a call sets ``GY``, ``GX``, their
    row strides and which products it takes (``CpuPath._gy_native``)."""
    inner: int
    tol: float


@dataclass(slots=True)
class Plan:
    """What the C forward call of a layer's call needs that ``X``'s and ``Y``'s sizes fix
    (``CpuPath._plan``): kept from step to step, so that a hook does not work them out again
    (a checked step's Python is much of what the check costs)."""

    x_shape: torch.Size
    y_shape: torch.Size
    n: int
    ws: torch.Tensor
    """The call's workspace (``Layer.pool``)."""
    fwd: CsFwdArgs
    """``sdc_cs_fwd``'s arguments, built once: the sizes and row strides, the addresses of
    the workspace and of the layer's sums, the tolerance and the threads; a call sets
    ``X``, ``Y`` and, when it takes the weight's sums, the weight's fields
    (``CpuPath._forward_native``)."""
    bwd: BackwardPlan | None = None
    """The backward call's, found at its first (``CpuPath._gy_native``)."""
    x2: torch.Tensor | None = None
    y2: torch.Tensor | None = None
    """A plan made for one call only: ``X`` and ``Y`` as the C passes read them (copies of
    tensors whose rows are not evenly spaced)."""


@dataclass(slots=True)
class Call:
    """One forward call of a layer in this micro-batch: what its checks still need."""

    x: torch.Tensor
    """The input, ``N x in`` (a reference: autograd keeps it for ``GW`` anyway; on the C
    path as the layer got it, maybe 3-D, and not detached, which would be a tensor
    operation: read it under ``no_grad``)."""
    sums: torch.Tensor
    """float32, from the forward hook: ``X e``, ``|X| e`` and ``Y e`` (``N`` each), the
    output's taken there because a later in-place operation (an in-place ReLU) may change
    the output itself. On the C path the call's whole workspace (``NATIVE_WS``)."""
    rows: int
    """``N``: the input's rows (all its dimensions but the last)."""
    micro_batch: int = 0
    tapped: bool = False
    """The input needs a gradient: the input-gradient product is checked."""
    gx_rhs: torch.Tensor | None = None
    gx_bound: torch.Tensor | None = None
    """The input gradient's bound with the tolerance applied (``TorchPath._gy_sides``)."""
    gy_dtype: torch.dtype | None = None
    native: bool = False
    """Checked by the C passes (``CpuPath._gy_native``): float32 on the CPU, exact bound."""
    gx_ready: bool = False
    """The C passes left the input gradient's right-hand side and bound in ``sums``."""
    via_node: bool = False
    """Its backward is seen through the product's node (``Hooks._on_node``): a tap the
    pre-hook installed on its input (not knowing yet) is ignored."""
    gy: torch.Tensor | None = None
    """Seen without the product's node, with the weight's gradient hooked: ``GY``, kept from
    the output's hook until the node that passes the weight its gradient has run
    (``Hooks._on_weight_edge``)."""
    plan: Plan | None = None
    """The C path's: its forward call's plan, which keeps its backward's too."""

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


WeightSides = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None,
                    torch.Tensor, torch.Tensor]
"""The torch path's sums of a weight: ``e^T W``, ``e^T |W|``, ``W e``, ``|W| e`` in float32
(the absolute ones None with the "norm" bound), the bias's sum and absolute sum."""


@dataclass(slots=True)
class Layer:
    """A checked ``nn.Linear``: what the check knows of it, of its call under way, of its
    calls in this micro-batch, of its weight's sums and of its weight gradient."""

    # -- the layer --------------------------------------------------------------------------
    name: str
    index: int
    """Its place among the checked layers (a detection names it)."""
    module: nn.Linear
    handles: list[Any] = field(default_factory=list)
    """The check's hooks on it (removed by ``ChecksumCheck.close``)."""
    weight_hook: int | None = None
    """The id of the check's own hook on the weight (``Hooks._on_gw``), if it has one."""
    gw_checked: bool = True
    """The weight-gradient identity is checked: asked for, the weight is no other module's
    too (a tied embedding's gradient adds into the same ``W.grad``), and DDP all-reduces it
    (not named in ``_ddp_params_and_buffers_to_ignore``)."""
    called: bool = False
    """The layer's forward ran in a checked step (``ChecksumCheck.uncalled``)."""

    # -- this step (``ChecksumCheck.begin_step``) --------------------------------------------
    w: torch.Tensor | None = None
    """The layer's weight (``module.weight``) as the step found it."""
    b: torch.Tensor | None = None
    """Its bias, likewise (None without one)."""
    native: bool = False
    """Float32 weight (and bias) the C passes can read."""
    gw_step: bool = False
    """The weight-gradient identity is checked in this step: ``gw_checked``, and the weight
    requires a gradient now (a layer frozen during training has none: DDP's bucket holds
    zeros for it while its backward may still run, for the layers before it)."""
    gw_at_node: bool = False
    """The weight has gradient hooks of the user's (``Tensor.register_hook``,
    ``register_post_accumulate_grad_hook``: a clamp, a per-layer scale), which change its
    gradient after the product made it: the weight-gradient identity is then checked at
    the product's node, call by call, on the gradient the product passes on
    (``TorchPath._gw_node``), never on ``W.grad``; a call seen without that node (a
    subclass's or a fault injector's own product), on the gradient the node of the call that
    passes the weight its gradient gives (``graph.weight_edge``)."""

    # -- the call under way (set by the forward pre-hook, read by the forward hook) ----------
    checked: bool = False
    """The pre-hook found the call one to check (the check active, a non-empty input
    tensor, not a recomputation) and started its micro-batch (``Hooks._fresh``): the forward
    hook reads it (once) instead of asking again."""
    via_node: bool = False
    """The pre-hook installed no tap: the call is to be seen through its product's node."""
    posted: bool = False
    """The call was seen by the check's global forward hook (``graph.FrontHook``): the
    layer's own forward hook leaves it."""
    node_ok: bool = False
    """The layer's last call had a product node (``graph.product_node``): its next call is
    seen through the node, with no tap on its input."""
    node_shape: NodeShape | None = None
    """What ``graph.product_node`` last found; a call of the stock forward whose graph starts
    alike is the same graph (``graph.known_node``)."""

    # -- this micro-batch's calls ------------------------------------------------------------
    calls: list[Call] = field(default_factory=list)

    # -- the weight's sums -------------------------------------------------------------------
    w_key: tuple[int, ...] | None = None
    """The step and the weight's (and bias's) version the C path's sums were taken at: once
    per step, and again if the weight changes within it."""
    sides_key: tuple[int, ...] | None = None
    """The same for ``sides``."""
    norm_key: tuple[int, ...] | None = None
    """The same for ``w_norm``."""
    w_at: tuple[int, ...] | None = None
    """FSDP2: the step and the gathered weight's (and bias's) storage and versions at the
    layer's last call (``Hooks._gathered``): the key of the torch path's sums, which a
    backward hook then finds taken without reading the weight (FSDP2 may have freed it)."""
    sides: WeightSides | None = None
    """The torch path's sums of the weight (``TorchPath._sides``)."""
    w_norm: torch.Tensor | None = None
    """float32 0-d: ``||W||_F`` at the weight version ``norm_key`` (the "norm" bound)."""
    ask: WeightSums | None = None
    """What the weights check's pass after the last optimizer step was asked to take into
    ``buffers.wsum`` (``CpuPath.weight_sums``), at the weight's version ``ask_key``."""
    ask_key: tuple[int, ...] | None = None
    pre_sums: bool = False
    """``buffers.wsum`` holds the sums that pass took (``ask``), not yet found good or stale
    by a failing entry (``CpuPath._stale``)."""
    fuse: bool = True
    """The weight's sums may come from the weights check's pass: cleared for good once they
    were found stale (the weight written between the pass and the product where its version
    counter does not see it, through ``.data``)."""

    # -- the weight gradient, summed over the micro-batch's calls ----------------------------
    gw_rhs: torch.Tensor | None = None
    gw_bound: torch.Tensor | None = None
    gw_rows: int = 0
    gw_dtype: torch.dtype | None = None
    """The dtype the weight gradient was computed in (its output's gradient's)."""

    # -- the C path's, kept from step to step ------------------------------------------------
    buffers: NativeBuffers | None = None
    plans: list[Plan] = field(default_factory=list)
    """The forward calls' plans, by the call's index in the micro-batch (``Plan``)."""
    pool: list[torch.Tensor] = field(default_factory=list)
    """The workspaces, one per call of the layer in a micro-batch."""


@dataclass(slots=True)
class Entries:
    """One product's checksum entries on the torch path, compared with the step's others at
    once (``TorchPath._compared``): a comparison per product would be six kernels each."""

    layer: Layer
    product: str
    micro_batch: int
    lhs: torch.Tensor
    rhs: torch.Tensor
    bound: torch.Tensor
    """The tolerance: ``|lhs - rhs|`` may not exceed it."""


@dataclass
class Failure:
    """One set of checksum entries (read on the host only when one of them failed)."""

    layer: Layer
    product: str
    micro_batch: int
    bad: torch.Tensor
    """0-d bool."""
    diff: torch.Tensor
    bound: torch.Tensor
    entries: list[Entries] | None = None
    """Compared together (``TorchPath._compared``): ``diff``, ``bound`` and ``each`` are
    theirs laid end to end, and ``split`` tells which of them failed."""
    each: torch.Tensor | None = None

    def split(self) -> list[Failure]:
        """The products that failed, each with its own entries (host reads: after a failure)."""
        if self.entries is None or self.each is None:
            return [self] if bool(self.bad) else []
        out, at = [], 0
        for e in self.entries:
            n = e.lhs.numel()
            bad = self.each[at:at + n].any()
            if bool(bad):
                out.append(Failure(e.layer, e.product, e.micro_batch, bad,
                                   self.diff[at:at + n], self.bound[at:at + n]))
            at += n
        return out

    def excess(self) -> float:
        """The largest ``|lhs - rhs| / tolerance`` (inf for a non-finite entry)."""
        ratio = self.diff / self.bound.clamp_min(torch.finfo(torch.float32).tiny)
        return float(ratio.nan_to_num(nan=math.inf).max())


class CheckState:
    """The check-wide state its hooks (``hooks.Hooks``) and its two paths (``cpu.CpuPath``,
    ``torchpath.TorchPath``) share: ``ChecksumCheck`` sets it up and resets it each step;
    the mixins only declare what they read."""

    config: ChecksumConfig
    device: torch.device
    exact: bool
    """The exact bound (``config.bound == "exact"``), not the norm bound."""
    gathered: bool
    """FSDP2: the layers' weights are gathered for each call (``ChecksumCheck.gathered``)."""
    expect_overflow: bool
    """A ``GradScaler`` runs: a non-finite entry is the scaler's business, not a failure."""
    layers: list[Layer]
    _want: dict[str, bool]
    """Per product name: checked."""
    _kernel: NativeKernel | None
    """The C passes, for float32 layers on the CPU with the exact bound."""
    _generation: int
    """Counts checked steps: the weight's sums are taken at least once per step."""
    _active: bool
    """Between ``begin_step`` and the step's last product: the hooks check."""
    _micro: int
    """The micro-batch under way."""
    _forward_phase: bool
    """Between a checked layer's forward and ``on_loss``: a backward now is ``loss_fn``'s."""
    _failures: list[Failure]
    """The C path's failures (only failed products are recorded there)."""
    _entries: list[Entries]
    """The torch path's entries of the step, compared at once."""
    _batch: list[Failure] | None
    _zeros: dict[torch.device, torch.Tensor]
    _front: FrontHook
    native_calls: int
    pre_sums_used: int
    stale_sums: int
    inner_backward: bool
    unseen_input_grads: int
    bucket_weight_grad: bool

    def due(self, step: int) -> bool:
        """Is the check due at ``step`` (every ``ChecksumConfig.interval``-th step)?"""
        return step % self.config.interval == 0
