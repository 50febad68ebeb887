"""The FSDP2 backend: ``fully_shard`` models on a 1-D mesh (FSDP) or a 2-D mesh (HSDP).

``FSDPBackend`` implements ``sdc_guard.parallel.base.Backend`` for a model that
``torch.distributed.fsdp.fully_shard`` wrapped. FSDP2 reduces each of its modules'
gradients on its own: per module (a "param group"), the rank's local, unsharded
gradients are copied into one flat buffer laid out ``[shard ranks, -1]`` and
reduce-scattered over the shard dimension, then, under HSDP, all-reduced over the
replicate dimension. Two public seams show them, and this backend takes both:

- ``FSDPModule.set_custom_reduce_scatter(comm)``: ``comm(output, input, group, op)`` runs
  the reduce-scatter, and ``input`` is this rank's local gradients (event ``local``,
  ``after_scaling``; fault injectors' site "gradient_before_allreduce"). The backend runs
  the same ``reduce_scatter_single`` FSDP2 runs by default, with the op FSDP2 chose, so
  training stays bit-identical to FSDP2 without the guard;
- ``FSDPModule.set_all_reduce_hook(hook)``: ``hook(output)`` sees the reduced shard (under
  HSDP after the replicate all-reduce): event ``reduced``; site
  "gradient_after_allreduce".

The interface class of the custom reduce-scatter lives in a private module of torch; the
backend's object matches it structurally (``allocate`` and ``__call__``) and imports
nothing private. The seams need torch 2.8 or newer (checked at construction).

**Containment.** Under sharding a NaN in rank 1's local gradients lands in the shard of
whichever rank owns those elements; each rank sees only its own shard reduced. A verdict
must reach every rank in its step, or one shard would be updated and another not (and
the replicas of a shard would drift apart). No reduction of FSDP2 knows it is the step's
last, but FSDP2 reduces a model's modules in the same order every step: the backend
learns it from the step before, and the reduce-scatter it names last carries the veto of
the listeners whose verdict is ready by then (``veto_early``) as a sentinel in its buffer
(``_carry``), read from the reduced shard in the step's one read from the device
(``sdc_guard.hostread``). The other listeners, and every listener where the reduction
cannot carry it (``_carry`` says when), have it in a word of their own: after the step's
last backward (``after_backward``) one int64 SUM all-reduce over every rank. A step in
which no listener takes part sends nothing.

What it refuses, at construction: a model that is not the ``fully_shard`` root (the
outermost module must be an ``FSDPModule``), compiled blocks, parameters on more than one
mesh (MoE expert groups on meshes of their own among them), a mesh of more than two
dimensions or placements other than FSDP2's own (tensor or pipeline parallelism), a mesh
that does not span the process group, and modules with more than one param group (FSDP2's
custom reduce-scatter refuses those itself).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from sdc_guard.collectives import PendingSum, words_on
from sdc_guard.determinism import module_state_kept, rng_stream
from sdc_guard.parallel.base import GradientListener, Layout
from sdc_guard.parallel.ddp import SentinelAnswer, WordAnswer, sentinel_values
from sdc_guard.scaling import Flag, check_nonfinite, check_row_sums, row_sums
from sdc_guard.types import LossFn, recomputed_loss

_REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""FSDP2's own default collective (``reduce_scatter_single`` where torch has it)."""
SEAMS = ("set_custom_reduce_scatter", "set_all_reduce_hook", "set_requires_all_reduce")
"""What the backend needs of ``FSDPModule`` (torch 2.8 and newer have them)."""

FSDP_FIX = ("Wrap the model as FSDP2 does it (torchtitan's way): fully_shard(block, "
            "mesh=mesh) for each block, then fully_shard(model, mesh=mesh) for the root, on a "
            "1-D mesh (FSDP) or a 2-D mesh with dims (replicate, shard) (HSDP), and pass the "
            "root to SDCGuard.")


class ShardChunk:
    """One FSDP2 module's gradients on their way to the reduce-scatter, as a ``Bucket``.

    ``buffer()`` is this rank's local, unsharded gradients of that module, laid out
    ``[shard ranks, -1]`` (each row the part one rank will own); writing it changes what
    is reduced (fault injectors do)."""

    __slots__ = ("_buffer", "_index", "_module", "_shards")

    def __init__(self, buffer: torch.Tensor, index: int, module: torch.nn.Module,
                 shards: int) -> None:
        self._buffer, self._index, self._module, self._shards = buffer, index, module, shards

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        """The module's place among the model's ``fully_shard`` modules (outermost first)."""
        return self._index

    def is_last(self) -> bool:
        """Never known: FSDP2 reduces each module on its own (``after_backward`` ends the step)."""
        return False

    def parameters(self) -> list[torch.Tensor]:
        """The module's own sharded parameters (``DTensor``), in order."""
        return list(_own_parameters(self._module))

    def gradients(self) -> list[torch.Tensor]:
        """Not views of the buffer: each gradient is split across its rows (``gradient_of``)."""
        return []

    def _columns(self, param: torch.Tensor) -> tuple[int, int] | None:
        """Where ``param``'s part lies in each row: (offset, length), or None when it is not
        one of this module's (``row_lengths``)."""
        offset, found = 0, None
        for p, length in row_lengths(self._module, self._shards):
            if p is param:
                found = (offset, length)
            offset += length
        if offset * self._shards != self._buffer.numel():
            raise RuntimeError(
                f"sdc-guard: FSDP2's reduce-scatter buffer holds {self._buffer.numel()} "
                f"elements, not the {offset * self._shards} its module's parameters fill: "
                "this version of FSDP2 lays it out otherwise")
        return found

    def gradient_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s local gradient in the buffer, padded: a ``[shard ranks, -1]`` view whose
        elements come in the order of the gradient's own (writes reach the reduction)."""
        where = self._columns(param)
        if where is None:
            return None
        offset, length = where
        return self._buffer.view(self._shards, -1)[:, offset:offset + length]

    def reduced_of(self, param: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        """``param``'s slice of this rank's reduced shard ``out`` (padded)."""
        where = self._columns(param)
        if where is None:
            return None
        offset, length = where
        return out.view(-1)[offset:offset + length]


def _own_parameters(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The parameters ``fully_shard(module)`` manages: its own, not those of a nested
    ``FSDPModule``."""
    nested = [m for m in module.modules() if m is not module and isinstance(m, FSDPModule)]
    inner = {id(p) for m in nested for p in m.parameters()}
    for p in module.parameters():
        if id(p) not in inner:
            yield p


def row_lengths(module: torch.nn.Module, shards: int) -> list[tuple[torch.Tensor, int]]:
    """Each parameter ``fully_shard(module)`` manages, with the length of its part in each row
    of the module's reduce-scatter buffer (``[shards, -1]``): FSDP2 pads dim 0 to a multiple
    of the shard ranks and gives each rank one slice of it, the parameters side by side in
    each row."""
    out = []
    for p in _own_parameters(module):
        shape = tuple(p.shape)  # (the global shape: indexing a DTensor communicates)
        rows = -(-shape[0] // shards) if shape else 1
        out.append((p, rows * math.prod(shape[1:])))
    return out


class _ReduceScatter:
    """The custom reduce-scatter of one FSDP2 module (structurally FSDP2's ``ReduceScatter``):
    FSDP2's default collective, with the backend's events around it."""

    def __init__(self, backend: FSDPBackend, index: int, module: torch.nn.Module) -> None:
        self.backend, self.index, self.module = backend, index, module

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        chunk = ShardChunk(input_tensor, self.index, self.module, group.size())
        self.backend._local(chunk)
        if self.backend.quiet:  # a recomputation's gradients: seen, never reduced
            output_tensor.zero_()
            return None
        self.backend._carry(chunk, op)
        return _REDUCE_SCATTER(output_tensor, input_tensor, group=group, op=op,
                               async_op=async_op)


class _Carried:
    """The veto riding this step's last reduce-scatter: who was asked, where, the answer."""

    __slots__ = ("answer", "divided_by", "listeners", "position")

    def __init__(self, listeners: list[GradientListener], position: int,
                 divided_by: int) -> None:
        self.listeners, self.position, self.divided_by = listeners, position, divided_by
        self.answer: SentinelAnswer | None = None
        """The reduced sentinel slots, once the reduction's all-reduce hook has run."""


def _vetoes(listeners: list[GradientListener]) -> list[tuple[GradientListener, Flag]]:
    """Ask ``listeners`` for this step's veto (``before_last_allreduce``, then ``veto``): the
    ones that take part, with their flags."""
    for lst in listeners:
        lst.before_last_allreduce()
    return [(lst, f) for lst in listeners if (f := lst.veto()) is not None]


def _divided_by(op: Any, world: int) -> int | None:
    """What FSDP2's reductions divide a sum by, at most: 1 for SUM, the world for AVG
    (the reduce-scatter over the shard ranks, HSDP's all-reduce over the replicas); None for
    a pre-multiplied sum (a user's divide factor), whose factor the op does not show."""
    if op == dist.ReduceOp.SUM:
        return 1
    if op == dist.ReduceOp.AVG:
        return world
    return None


class FSDPBackend:
    """The FSDP2 backend (``sdc_guard.parallel.base.Backend``); see the module doc."""

    def __init__(self, model: torch.nn.Module,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.model: Any = model
        self.group = process_group
        """Every rank of the job: the checks' words and the veto travel within it."""
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.mesh = mesh_of(model, self.world_size)
        self.layout = _layout(self.mesh, process_group)
        """Under FSDP each rank its own part; under HSDP the replicas of each shard."""
        self.parallel = "hsdp" if self.mesh.ndim == 2 else "fsdp"
        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        """Every ``fully_shard`` module, outermost first."""
        for m in self.modules:
            groups = len(m._get_fsdp_state()._fsdp_param_groups)
            if groups > 1:
                raise ValueError(
                    f"SDCGuard(model=...): the fully_shard module {type(m).__name__} manages "
                    f"{groups} param groups (a per-parameter mesh from shard_placement_fn), "
                    "and FSDP2 hands the guard one group's gradients at a time only. "
                    f"Shard it with one mesh and placement. {FSDP_FIX}")
        self.before: list[Callable[[ShardChunk], None]] = []
        """Fault injectors' callbacks on the local gradients (may modify them)."""
        self.after: list[Callable[[ShardChunk, torch.Tensor], None]] = []
        """Fault injectors' callbacks on the reduced shard (may modify it)."""
        self.listeners: list[GradientListener] = []
        self.step = -1
        self.attached = False
        """Are the reduce-scatter and all-reduce hooks set on the model's modules?"""
        self._chunks: list[ShardChunk] = []
        """This step's chunks, by reduce-scatter, to pair with the all-reduce hook's outputs."""
        self.quiet = False
        """Inside ``recomputing``: the reduce-scatters show the local gradients and reduce
        nothing."""
        self._root_seen = False
        """Has the first backward shown that the model is FSDP2's root (``_refuse_inner``)?"""
        self._order: tuple[int, ...] = ()
        """The modules the previous step reduced, in order (``ShardChunk.index``): FSDP2
        reduces a model's modules in the same order every step, so when this step's
        reductions have followed it up to its last, that one is taken for the step's last."""
        self._seen: list[int] = []
        """The modules this step has reduced so far, in order."""
        self._carried: _Carried | None = None
        """The veto riding this step's last reduce-scatter (``_carry``), if it does."""

    @property
    def shards(self) -> int:
        """The ranks each module's parameters are sharded over (the mesh's last dimension)."""
        return int(self.mesh.size(self.mesh.ndim - 1))

    def chunk_sizes(self) -> list[int]:
        """The element count of each module's reduce-scatter buffer (``ShardChunk.buffer``),
        by ``ShardChunk.index`` (0 for a module that owns no parameters)."""
        n = self.shards
        return [n * sum(length for _, length in row_lengths(m, n)) for m in self.modules]

    # -- the Backend protocol --------------------------------------------------------------
    def subscribe(self, listener: GradientListener) -> None:
        self.listeners.append(listener)

    def unsubscribe(self, listener: GradientListener) -> None:
        self.listeners[:] = [x for x in self.listeners if x is not listener]

    def attach(self) -> None:
        """Set the hooks on every module that owns parameters, the first time something needs
        the gradients. Once set they stay (FSDP2 has no way to unset them); training is
        bit-identical either way."""
        if self.attached or not (self.listeners or self.before or self.after):
            return
        for i, m in enumerate(self.modules):
            if not m._get_fsdp_state()._fsdp_param_groups:
                continue  # a root that owns no parameters reduces nothing
            m.set_custom_reduce_scatter(_ReduceScatter(self, i, m))  # type: ignore[arg-type]
            m.set_all_reduce_hook(self._reduced)
        self.attached = True

    def begin_step(self, step: int) -> None:
        self.step = step
        self._chunks = []
        self._seen = []
        self._carried = None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP2's ``set_requires_gradient_sync(False)`` for the micro-batches before the last
        (inside ``recomputing`` too: HSDP's all-reduce, which turning the sync back on turns
        on as well, stays off there)."""
        root: Any = self.model
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)
            if self.quiet:
                root.set_requires_all_reduce(False)

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """A forward and backward whose gradients are only looked at (a check's recomputation
        of a batch, on every rank at once): the listeners see each module's local gradients
        as in a step (``local``, ``row_sums``, ``after_scaling``; not the fault injectors'
        callbacks, nor the non-finite flag, which are the step's own), but nothing is reduced:
        the reduce-scatters do not communicate and leave a zero shard, HSDP's replicate
        all-reduce is off, no ``reduced`` event. Zero the gradients after it. Collective:
        the forward all-gathers the parameters."""
        root: Any = self.model
        self.attach()
        self.quiet = True
        root.set_requires_all_reduce(False)
        try:
            yield
        finally:
            self.quiet = False
            root.set_requires_all_reduce(True)

    def recompute(self, batches: Sequence[Any], loss_fn: LossFn, *, owner: int, step: int,
                  seed: int | None,
                  scale: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> list[torch.Tensor]:
        """``owner``'s micro-batches of ``step`` through the model, forward and backward, inside
        ``recomputing``: the listeners see each module's local gradients, nothing is reduced,
        and the sharded gradients are put back as they were afterwards (a check may recompute
        after the step's backward), as are the module's Python attributes
        (``module_state_kept``; buffers are the caller's). Each micro-batch draws the owner's
        random stream (``seed`` None: the current one), those before the last without
        gradient sync, as the guard's step runs them; ``scale`` is the loss scaling (a
        ``GradScaler``'s). Collective: every rank calls it at once, each with the owner it
        recomputes. Returns the losses, detached."""
        params = list(self.model.parameters())
        device = params[0].device if params else torch.device("cpu")
        kept = [p.grad for p in params]
        losses: list[torch.Tensor] = []
        try:
            for p in params:
                p.grad = None
            last = len(batches) - 1
            with self.recomputing(), module_state_kept(self.model):
                for i, mb in enumerate(batches):
                    sync = contextlib.nullcontext() if i == last else self.no_sync()
                    draws = (rng_stream(seed, owner, step, i, device) if seed is not None
                             else contextlib.nullcontext())
                    with sync:
                        with draws:
                            loss = recomputed_loss(loss_fn, self.model, mb)
                        losses.append(loss.detach())
                        torch.autograd.backward(scale(loss) if scale is not None else loss)
                    del loss
        finally:
            for p, g in zip(params, kept, strict=True):
                p.grad = g
        return losses

    # -- events ------------------------------------------------------------------------------
    def _local(self, chunk: ShardChunk) -> None:
        """The local gradients: the injectors' callbacks, then the row sums the listeners
        ask for and the non-finite flag, in one read where the C kernel can take both (as
        DDP's scaling pass does), then each listener's ``local`` and ``after_scaling``."""
        flag: Flag | None = None
        wants_flag = False
        if not self.quiet:  # a recomputation's gradients are not the step's: no injector
            # (as under DDP, where a recomputation passes no comm hook), no non-finite flag
            for cb in self.before:
                cb(chunk)
            wants_flag = any(lst.wants_flag for lst in self.listeners)
        rows = [r for lst in self.listeners for r in (lst.row_sums(chunk) or ())]
        if wants_flag and rows:
            flag = check_row_sums(chunk.buffer(), rows)
        else:
            if wants_flag:
                flag = check_nonfinite(chunk.buffer())
            if rows:
                row_sums(rows)
        wants = [lst.local(chunk) for lst in self.listeners]
        digests = [None if w is None else w.digest(chunk.buffer()) for w in wants]
        for lst, digest in zip(self.listeners, digests, strict=True):
            lst.after_scaling(chunk, flag, digest)
        self._chunks.append(chunk)

    def _carry(self, chunk: ShardChunk, op: Any) -> None:
        """Before a reduce-scatter (not a recomputation's): when it is the step's last, as
        the previous step's order says, ask the listeners whose veto is ready
        (``veto_early``) and write this rank's sentinel into the buffer, so the reduction
        carries the step's containment answer to every rank and no word of its own travels.

        A rank that withholds writes the dtype's largest finite value at element ``rank``
        (of the job's ranks) of every row of its local buffer (where several listeners take
        part, the sum of the values of those that withhold, ``sentinel_values``: each reads
        its own, and the ranks that wrote it), after the listeners read it
        (the non-finite scan never sees it) and before the reduction: row ``j`` is summed
        into rank ``j``'s shard, so every rank's shard holds every rank's slot, and HSDP's
        all-reduce sums each slot over the replicas. One slot per rank of the job: two
        ranks that withhold never add into one value that overflows (which a reader would
        take for a gradient's overflow). The withheld step's gradients are dropped, so the
        slots cost nothing; on a step no rank withholds nothing is written. Not carried
        (the word after the backward instead): a row shorter than the job's ranks, a
        reduction whose division the op does not show, or a step whose order differs."""
        self._seen.append(chunk.index())
        order = self._order
        if len(self._seen) != len(order) or tuple(self._seen) != order:
            return
        early = [lst for lst in self.listeners if lst.wants_veto and lst.veto_early]
        buf = chunk.buffer()
        divided_by = _divided_by(op, self.world_size)
        if (not early or divided_by is None or not buf.dtype.is_floating_point
                or buf.numel() // chunk._shards < self.world_size):
            return
        taking = _vetoes(early)
        if not taking:  # every listener sits this step out (alike on every rank)
            return
        values = sentinel_values(buf.dtype, len(taking))
        raised = [(f, v) for (_, f), v in zip(taking, values, strict=True) if f is not False]
        if raised:
            col = buf.view(chunk._shards, -1)[:, self.rank]
            if all(isinstance(f, bool) for f, _ in raised):
                col.fill_(sum(v for _, v in raised))
            else:  # device flags: written on the device, no host read
                flags = [torch.as_tensor(f, device=buf.device).reshape(()) for f, _ in raised]
                value = sum((f.to(buf.dtype) * v for f, (_, v) in zip(flags, raised,
                                                                      strict=True)),
                            torch.zeros((), dtype=buf.dtype, device=buf.device))
                col.copy_(torch.where(torch.stack(flags).any(), value, col))
        self._carried = _Carried([lst for lst, _ in taking], len(self._seen), divided_by)

    def _reduced(self, out: torch.Tensor) -> None:
        """FSDP2's all-reduce hook: the module's reduced shard. The hooks run in the order of
        the reduce-scatters, each after its own."""
        if self.quiet:
            return
        chunk = self._chunks[-1] if self._chunks else ShardChunk(out, -1, self.model, 1)
        for cb in self.after:
            cb(chunk, out)
        carried = self._carried
        if carried is not None and carried.answer is None and len(self._seen) == carried.position:
            # (a copy: FSDP2 divides the shard in place after this hook)
            carried.answer = SentinelAnswer(out.view(-1)[:self.world_size].clone(),
                                             carried.divided_by)
            levels = len(carried.listeners)
            for i, lst in enumerate(carried.listeners):
                lst.vetoed(carried.answer.level(i, levels))
        for lst in self.listeners:
            lst.reduced(chunk, out)

    def after_backward(self) -> None:
        """The step's veto: every listener that takes part says whether this rank withholds,
        and one int64 SUM all-reduce over every rank carries the answers, a word per
        listener (``vetoed``: each reads its own, so a step is withheld by the checks that
        vetoed, on every rank alike)."""
        if not self._root_seen:
            self._refuse_inner()
        seen, self._seen = self._seen, []
        self._order = tuple(seen)
        carried, self._carried = self._carried, None
        asked = [lst for lst in self.listeners if lst.wants_veto]
        if (carried is not None and carried.answer is not None
                and len(seen) == carried.position):  # the carrier was the step's last
            asked = [lst for lst in asked if not any(lst is c for c in carried.listeners)]
        # (else a reduction came after the one taken for the last: every listener is asked
        # again below, and the word's answer replaces the carried one)
        if not asked:
            return
        taking = _vetoes(asked)
        if not taking:  # every listener sits this step out (alike on every rank)
            return
        word = words_on([int(f) if isinstance(f, bool) else 0 for _, f in taking],
                        torch.device(self.mesh.device_type))
        for i, (_, f) in enumerate(taking):
            if not isinstance(f, bool):  # a device flag: copied on the device, no host read
                word[i] = torch.as_tensor(f).reshape(()).to(word.device, torch.int64)
        pending = PendingSum(word, self.group, in_place=True)
        for i, (lst, _) in enumerate(taking):
            lst.vetoed(WordAnswer(pending, i))

    def _refuse_inner(self) -> None:
        """A block that ``fully_shard`` wrapped looks like the root until the first forward
        tells FSDP2 which one is: the guard given a block would hook part of the model and
        call the rest clean. Asked after the first backward, alike on every rank."""
        root = getattr(self.model._get_fsdp_state(), "_is_root", True)
        if root is False:
            raise ValueError(
                f"SDCGuard(model=...) got a fully_shard module ({type(self.model).__name__}) "
                f"that is inside another one, not the root the loss function calls. {FSDP_FIX}")
        self._root_seen = True


def mesh_of(model: torch.nn.Module, world: int) -> Any:
    """The one ``DeviceMesh`` every parameter of ``model`` is sharded on, checked."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"SDCGuard(model=...) got {type(model).__name__}, not the fully_shard "
                        f"root. {FSDP_FIX}")
    compiled = [name or "(the root)" for name, m in model.named_modules()
                if hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise ValueError(
            f"SDCGuard(model=...): {compiled[:4]} are compiled (torch.compile, or "
            "module.compile()); the guard does not guard compiled blocks under FSDP2 yet. "
            "Leave the blocks eager for a guarded run.")
    missing = [name for name in SEAMS if not hasattr(model, name)]
    if missing:
        raise RuntimeError(
            f"SDCGuard(model=...): this torch ({torch.__version__}) has no FSDPModule."
            f"{missing[0]}, which the guard needs to see FSDP2's gradients: install torch 2.8 "
            "or newer for FSDP2, or guard a DistributedDataParallel model.")
    meshes: dict[int, Any] = {}
    plain = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            plain.append(name)
            continue
        meshes.setdefault(id(p.device_mesh), p.device_mesh)
        want = (Shard(0),) if p.device_mesh.ndim == 1 else (Replicate(), Shard(0))
        if tuple(p.placements) != want:
            raise ValueError(
                f"SDCGuard(model=...): parameter {name!r} is placed {tuple(p.placements)} on "
                f"its mesh, not as FSDP2 places it ({want}): tensor or pipeline parallelism "
                "is not supported yet. Use FSDP2 alone (fully_shard on a 1-D or 2-D data-"
                "parallel mesh).")
    if plain:
        raise ValueError(f"SDCGuard(model=...): parameters {plain[:4]} are not sharded by "
                         f"fully_shard (plain tensors beside DTensors). {FSDP_FIX}")
    if not meshes:
        raise ValueError("SDCGuard(model=...): the fully_shard model has no parameters.")
    if len(meshes) > 1:
        raise ValueError(
            f"SDCGuard(model=...): the model's parameters are sharded on {len(meshes)} "
            "different meshes; the guard supports one data-parallel mesh. Pass the same mesh "
            f"to every fully_shard call. {FSDP_FIX}")
    mesh = next(iter(meshes.values()))
    if mesh.ndim > 2:
        raise ValueError(f"SDCGuard(model=...): a {mesh.ndim}-D mesh {tuple(mesh.shape)}: the "
                         f"guard supports FSDP (1-D) and HSDP (2-D: replicate, shard). {FSDP_FIX}")
    if mesh.shape[-1] < 2:
        raise ValueError(
            f"SDCGuard(model=...): the model's mesh {tuple(mesh.shape)} has a shard dimension "
            "of 1, so nothing is sharded: wrap the model in DistributedDataParallel instead "
            "(the same replicas, the guard's DDP path).")
    if mesh.size() != world:
        raise ValueError(
            f"SDCGuard(model=...): the model's mesh {tuple(mesh.shape)} spans {mesh.size()} "
            f"ranks, the process group {world}. Build the mesh over every rank "
            "(init_device_mesh(device, shape) with a shape whose product is the world size).")
    return mesh


def _layout(mesh: Any, group: dist.ProcessGroup | None) -> Layout:
    """Which ranks of ``group`` hold each shard: ``mesh.mesh``'s columns (HSDP), or one rank
    each (FSDP)."""
    ranks = mesh.mesh.reshape(-1, mesh.mesh.shape[-1]) if mesh.ndim == 2 else mesh.mesh.reshape(1, -1)

    def local(r: int) -> int:
        return r if group is None else dist.get_group_rank(group, r)

    sets = tuple(tuple(sorted(local(int(r)) for r in ranks[:, j].tolist()))
                 for j in range(ranks.shape[1]))
    me = dist.get_rank(group)
    part = next(j for j, s in enumerate(sets) if me in s)
    replica_group = mesh.get_group(0) if mesh.ndim == 2 and mesh.shape[0] > 1 else None
    return Layout(sets, part, replica_group)
