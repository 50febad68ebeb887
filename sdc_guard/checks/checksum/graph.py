"""The checksum check's autograd plumbing: where in a layer call's graph its products are.

A forward hook sees ``X`` and ``Y``; the backward of the call is seen either through the
product's own autograd node (``F.linear``'s ``addmm`` or ``mm``, under at most two reshapes:
``product_node``, one post-hook gets ``GY`` and this call's ``GX``) or, where the graph is not
that (a subclass's own forward, a fault injector's product), through a hook on ``Y`` and
one on a view of ``X`` that only this call consumes (the *tap*). A weight whose gradient the
user hooks has its gradient read at the node that passes it on (``weight_edge``).

Also here: the global forward hook kept first among the user's (``FrontHook``), the hooks'
wrapper that hides them from ``torch.compile`` only while it traces (``eager``), and how a
hook tells a recomputation inside the backward from a call (``in_backward``,
``recomputing``). Nothing here keeps state of the check's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_VIEW_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_PRODUCT_NODES = {"AddmmBackward0": 1, "MmBackward0": 0}
"""The autograd nodes of ``F.linear``'s product, and where their input's gradient is among
the gradients they pass on (``addmm(b, X, W^T)``: b, X, W^T; ``mm(X, W^T)``: X, W^T)."""

NodeShape = tuple[type, int, type, int]
"""What ``product_node`` found (``node_shape``): the output's node type, the views above the
product, the product node's type, its input gradient's index."""


def product_node(out: torch.Tensor, weight: torch.Tensor) -> tuple[Any, int] | None:
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
"""How many autograd nodes deep under a call's output ``weight_edge`` looks."""


def weight_edge(out: torch.Tensor, weight: torch.Tensor,
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


def node_shape(out: torch.Tensor, found: tuple[Any, int]) -> NodeShape:
    """``Layer.node_shape`` of a graph ``product_node`` accepted."""
    node, depth = out.grad_fn, 0
    while node is not None and node is not found[0]:
        node, depth = node.next_functions[0][0], depth + 1
    return type(out.grad_fn), depth, type(found[0]), found[1]


def known_node(out: torch.Tensor, shape: NodeShape | None) -> tuple[Any, int] | None:
    """The product node of a stock ``nn.Linear`` call whose graph starts as the layer's last
    one did (``product_node`` checked that one through to the weight), else None."""
    node = out.grad_fn
    if shape is None or type(node) is not shape[0]:
        return None
    for _ in range(shape[1]):
        if node is None:
            return None
        node = node.next_functions[0][0]
    return (node, shape[3]) if type(node) is shape[2] else None


_OWN_GLOBAL_HOOKS: set[int] = set()
"""The ids of the checks' global forward hooks (``FrontHook``) among torch's."""


class FrontHook:
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


def eager(hook: Any) -> Any:
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


def in_backward() -> bool:
    """Is a backward running (this forward call a recomputation inside it)?"""
    return _GRAPH_TASK is not None and _GRAPH_TASK() != -1


def gradient_hooked(w: torch.Tensor, own: int | None) -> bool:
    """Does anything but this check (whose own hook on ``w`` has the id ``own``) change the
    weight ``w``'s gradient between the product and ``W.grad`` (``Layer.gw_at_node``)?
    DDP's own hooks are not the tensor's."""
    hooks = w._backward_hooks
    return bool(getattr(w, "_post_accumulate_grad_hooks", None)) or bool(
        hooks and any(k != own for k in hooks))


def full_backward_hooked(module: nn.Module) -> bool:
    """Does a full backward hook (``register_full_backward_hook``, the module's or a global
    one) see this module's input gradient? It may return another one, which then flows to
    the input in place of the product's: a tap on the input would see that."""
    return bool((module._backward_hooks and module._is_full_backward_hook)
                or (nn.modules.module._global_backward_hooks
                    and nn.modules.module._global_is_full_backward_hook))


def recomputing() -> bool:
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
