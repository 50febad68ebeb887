"""``ChecksumCheck``: the check protocol's side of the checksum check, and the layers it takes.

**Contained in the step, with no new collective.** A rank whose products fail writes the
largest finite value of the dtype into its own slot (element ``rank``) of the step's last
gradient bucket, after the non-finite scan and before the all-reduce (the DDP backend's
*veto sentinel*, ``sdc_guard.parallel.ddp``). The all-reduce then carries it to every rank,
where that element is at least half the largest finite value (no real gradient is): every
rank withholds its optimizer step, the same step, without a word exchanged. The sentinel is
finite, also when several ranks veto at once (each writes its own slot), so the non-finite
check does not report it, and a ``GradScaler`` does not see an overflow (the guard skips its
``step`` and ``update``: the scale is kept). With a comm hook of the user's own (which may
compress or keep state), the sentinel is not written: the backend carries the veto in a
one-word all-reduce started just before the last gradient all-reduce and waited for before
the optimizer step instead. The check only answers ``veto`` and reads the answer it is
handed (``vetoed``). ``GuardConfig.skip_step_on_detection=False`` turns containment off
(nothing is written into the gradients).

**Under FSDP2** (``fully_shard``: FSDP, HSDP) no bucket is the step's last: the backend
asks ``veto`` after the step's last backward and carries the answer in a word over every
rank (``sdc_guard.parallel.fsdp``), with nothing written into the gradients. The weight a
layer multiplies by exists only while FSDP2 has it gathered: the hooks take it at each call
(``gathered``), and the weight gradient's rows are summed in each module's reduce-scatter
input, this rank's local gradients before they are reduced (``_gathered_rows``).

**Naming the rank needs one word**, exchanged like the non-finite check's
(``flagword.DeferredFlags``): every rank puts the products that failed (three bits) and the
index of the first failing layer as bits of int64 words; the words of ``exchange_interval``
steps travel in one small all-reduce that nobody waits for and are judged a step later, so
the detection, with its own step, names the rank, the layer and the products on every rank,
one to ``exchange_interval`` steps after the step. On the suspect rank the detection's
evidence also holds every failing entry (layer, product, micro-batch, residual, bound).
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parametrize

from sdc_guard.checks.base import Check, Verdict
from sdc_guard.checks.checksum.bounds import cpu_tolerance, tolerance
from sdc_guard.checks.checksum.cpu import F32_DTYPE, rows_ok
from sdc_guard.checks.checksum.graph import FrontHook, gradient_hooked
from sdc_guard.checks.checksum.hooks import Hooks
from sdc_guard.checks.checksum.state import Entries, Failure, Layer
from sdc_guard.checks.flagword import DeferredFlags
from sdc_guard.checks.weightpass import WeightPass
from sdc_guard.config import PRODUCTS, ChecksumConfig
from sdc_guard.fingerprints.native import active_kernel
from sdc_guard.hostread import StepRead, on_host
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

log = logging.getLogger("sdc_guard.checks.checksum")


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


class ChecksumCheck(Hooks, Check, GradientListener):
    """Checksums of every checked linear layer's three products (``sdc_guard.checks.checksum``).

    The hooks and the two ways of taking the sums are mixed in (``hooks.Hooks``,
    ``cpu.CpuPath``, ``torchpath.TorchPath``); this class builds the check and answers the
    guard (``Check``) and the backend (``GradientListener``)."""

    name = "checksum"
    withholds = True
    wants_veto = True
    veto_early = True
    """Every product of the step is computed and compared before the step's last gradient
    reduction starts (its weight gradients are checked as they reach their reduction):
    under FSDP2 the veto rides that reduction, with no word of its own."""

    _read: tuple[StepRead, int] | None = None
    """This step's failure flag's handle in the step's read (``ask``)."""

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
        self.layers = [Layer(n, i, m) for i, (n, m) in
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
        self.gathered = any(isinstance(layer.module.weight, DTensor) for layer in self.layers)
        """FSDP2 (``fully_shard``, FSDP or HSDP): outside a forward and backward a layer's
        ``weight`` is this rank's shard (a ``DTensor``); FSDP2 gathers the whole weight, a
        plain tensor, into the attribute for each forward and backward and frees it after.
        The hooks then take the weight at each call (``Hooks._gathered``), the weight
        gradient's row sums come from the local gradients before the reduce-scatter
        (``row_sums``), and no sums are taken in the weights check's pass, which reads the
        shards."""
        self._kernel = active_kernel() if self.exact and device.type == "cpu" else None
        """The C passes, for float32 layers on the CPU with the exact bound (the same
        identities and tolerances as the torch ops; one read of each matrix)."""
        self._generation = 0
        self._layer_bits = max(1, (len(self.layers) + 1).bit_length())
        self._clean_flags = (False,) * (len(PRODUCTS) + self._layer_bits)
        """A step's bits where no product failed (``_local_flags``)."""
        self._active = False
        self._micro = 0
        self._failures: list[Failure] = []
        self._entries: list[Entries] = []
        self._batch: list[Failure] | None = None
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._front = FrontHook()
        self._local: dict[int, list[dict[str, Any]]] = {}
        """This rank's failing entries per step, kept until the step is judged."""
        self._deferred = DeferredFlags(len(PRODUCTS) + self._layer_bits, config.exchange_interval,
                                       device=device, group=group)
        """Every rank's bits per step (``_local_flags``), judged a step after they travel."""
        self._answer: Containment | None = None
        """This step's containment answer (``vetoed``)."""
        self.bucket_weight_grad = self.gathered or (self._kernel is not None and all(
            layer.module.weight.dtype == torch.float32 for layer in self.layers))
        """The weight-gradient identity is checked on the local gradient bucket, its row
        sums taken by the comm hook's scaling pass in the same read (``row_sums``), instead of
        by a hook on each weight (a read of ``GW`` of its own): float32 weights on the CPU
        with the C kernel, and always under FSDP2 (``gathered``: the gathered weight's
        gradient reaches the shard through the reduce-scatter, never a hook on the shard).
        ``GW e`` is then the step's weight gradient summed over its micro-batches, against
        the right-hand sides summed likewise."""
        self._by_weight = {id(layer.module.weight): layer for layer in self.layers}
        self._rows_pending: list[tuple[Layer, torch.Tensor]] = []
        self._bucket_weights: dict[int, tuple[tuple[int, int], list[tuple[Layer, torch.Tensor]]]] = {}
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
        if self.gathered:  # (that pass reads the shards: the gathered weight is freed by then)
            self._weight_pass = None
        elif weight_pass is not None:  # the weights' sums taken in the weights check's read
            weight_pass.subscribe(self.weight_sums)

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

    # -- the gradient buckets (GradientListener) ----------------------------------------------
    def row_sums(self, bucket: Bucket) -> list[RowSums] | None:
        """The checked layers' weight gradients in this local bucket, whose row sums the
        comm hook's scaling pass takes (``bucket_weight_grad``)."""
        if not (self.bucket_weight_grad and self._active):
            return None
        if self.gathered:
            return self._gathered_rows(bucket)
        requests: list[RowSums] = []
        self._rows_pending = []
        for layer, g in self._weights_in(bucket):
            if layer.gw_rhs is None:
                continue
            out = layer.buffers.gw[2] if layer.buffers is not None else torch.empty(g.shape[0])
            requests.append((g, out))
            self._rows_pending.append((layer, out))
        return requests or None

    def _gathered_rows(self, chunk: Bucket) -> list[RowSums] | None:
        """FSDP2's ``row_sums``: the checked layers' local weight gradients in one module's
        reduce-scatter input (``ShardChunk``), before it is reduced. Each gradient is split
        by rows among the shard ranks, padded at the end (``gradient_of``): one request per
        rank's block of rows that holds any of the weight's, its sums written into their
        place in ``GW e``. An FSDP2 that reduces in float16 divides the input before the
        reduce-scatter: its gradients are not ``GW`` then, and not checked."""
        gradient_of = getattr(chunk, "gradient_of", None)
        buf = chunk.buffer()
        self._rows_pending = []
        if gradient_of is None or buf.dtype == torch.float16:
            return None
        requests: list[RowSums] = []
        # (the shard, or the gathered weight if FSDP2 did not reshard before reducing)
        now = {id(layer.module.weight): layer for layer in self.layers}
        for p in chunk.parameters():
            layer = self._by_weight.get(id(p)) or now.get(id(p))
            if layer is None or layer.gw_rhs is None or p.dim() != 2:
                continue
            g = gradient_of(p)
            if g is None:
                continue
            rows, cols = int(p.shape[0]), int(p.shape[1])
            shards = g.shape[0]
            per = g.shape[1] // cols if cols else 0
            if per * cols != g.shape[1] or per * shards < rows:
                continue  # (not the layout FSDP2 gives a 2-D weight)
            out = (layer.buffers.gw[2] if layer.buffers is not None
                   else torch.empty(rows, device=buf.device))
            blocks = g.view(shards, per, cols)
            for j in range(shards):
                first, last = j * per, min((j + 1) * per, rows)
                if last > first:
                    requests.append((blocks[j, :last - first], out[first:last]))
            self._rows_pending.append((layer, out))
        return requests or None

    def _weights_in(self, bucket: Bucket) -> list[tuple[Layer, torch.Tensor]]:
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
            tol = (cpu_tolerance(self.config.tolerance_scale, n, 2 * inner + n)
                   if compute == x_dtype == torch.float32 else
                   tolerance(self.config.tolerance_scale, k=n, checked=2 * inner + n,
                             compute=compute, operands=(x_dtype,), device=self.device))
            if self._kernel is not None:
                self._compare(layer, "weight_grad", micro, lhs, layer.gw_rhs, layer.gw_bound,
                              tol)
            elif layer.gw_rhs is not None and layer.gw_bound is not None:  # (FSDP2, no C)
                self._record(layer, "weight_grad", micro, lhs, layer.gw_rhs,
                             layer.gw_bound * tol)
            layer.gw_rhs = layer.gw_bound = None
            layer.gw_rows = 0

    def _done(self) -> None:
        """The step's products are all checked: let go of the step's inputs (as autograd
        does after the backward, not a step later)."""
        self._active = False
        for layer in self.layers:
            layer.calls.clear()

    # -- per step -----------------------------------------------------------------------------
    def on_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's forward is done: forwards from now on belong to the next one."""
        self._micro += 1
        self._forward_phase = False

    def begin_step(self, step: int) -> None:
        self._active = True
        self._read = None
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
            if self.gathered:  # (the shards now: the weight is taken at its calls)
                layer.w = layer.b = layer.w_at = None
                layer.native = layer.gw_at_node = False
                layer.gw_step = layer.gw_checked and m.weight.requires_grad
                continue
            w = layer.w = m.weight
            b = layer.b = m.bias
            layer.native = kernel and rows_ok(w) and (
                b is None or (b.dtype is F32_DTYPE and b.is_contiguous()))
            layer.gw_step = layer.gw_checked and w.requires_grad
            layer.gw_at_node = layer.gw_step and gradient_hooked(w, layer.weight_hook)

    def _flags(self) -> tuple[Flag, list[Failure]]:
        """Whether any entry failed (a host bool on the CPU, else a 0-d device bool)."""
        failures = self._failures + (self._compared() if self._entries else [])
        if not failures:
            return False, []
        if len(failures) == 1:
            flag = failures[0].bad
        else:
            flag = torch.stack([f.bad.to(failures[-1].bad.device) for f in failures]).any()
        return (bool(flag) if on_host(flag) else flag), failures

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

    def ask(self, step: int, read: StepRead) -> None:
        """The step's failure flag (a device flag), the containment answer and the flags word
        in flight, for the step's one read."""
        if self._active:  # no veto was asked for (no gradient all-reduce ran)
            self._done()
        if self._answer is not None and self.contain:
            self._answer.ask(read)
        self._deferred.ask(read)
        self._read = None
        if self._failures or self._entries:
            flag, _ = self._flags()
            if isinstance(flag, torch.Tensor):
                self._read = (read, read.ask(flag))

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
        asked, self._read = self._read, None
        if isinstance(flag, torch.Tensor) and asked is not None:
            read, handle = asked
            flag = bool(read.get(handle)[0])  # in the step's one read
        if bool(flag):  # a device flag not asked for: a read of its own
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
