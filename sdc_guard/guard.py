"""SDCGuard: sequences the checks around one data-parallel training step (DDP, FSDP2, HSDP)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.checkpoint import CheckpointManager
from sdc_guard.checks import Check, build_checks
from sdc_guard.checks.base import Verdict
from sdc_guard.checks.weights import WeightsCheck
from sdc_guard.collectives import STEPS_FIX, all_gather_rows, steps_disagree
from sdc_guard.config import INT64_MAX, GuardConfig
from sdc_guard.determinism import enable_determinism, rng_stream
from sdc_guard.events import EventLog
from sdc_guard.hostread import StepRead
from sdc_guard.metrics import GuardMetrics, MetricsSink
from sdc_guard.optimizers import Optimizers, as_optimizers
from sdc_guard.parallel.ddp import CommHook, GuardCommHook
from sdc_guard.remediation import Remediation
from sdc_guard.report import Detection, StepReport
from sdc_guard.telemetry import gpu_snapshot
from sdc_guard.topology import Topology, gather_topology
from sdc_guard.types import (
    BYPASS,
    BatchFor,
    LossFn,
    StepHook,
    fetch_micro_batches,
    scalar_loss,
)
from sdc_guard.watchdog import Watchdog

log = logging.getLogger(__name__)


FORWARD_BACKWARD = "the forward and backward passes (the gradients' reduction)"
"""Where a rank waits for a rank that stopped calling ``step`` (the watchdog's mark)."""


def _refuse_foreign_optimizer(model: torch.nn.Module,
                              optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
    """Does the optimizer hold any of the model's trained parameters? One that holds none
    (built for another model, or for a copy made before the DDP wrap) trains nothing, and
    every check would call the untrained run clean."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    held = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
    if trained and not trained & held:
        raise ValueError(
            "SDCGuard(optimizer=...) holds none of the model's trained parameters, so the "
            "model would never change (and every check would call that run clean): build the "
            "optimizer from the parameters of the model you pass, after wrapping it in DDP "
            "(torch.optim.AdamW(ddp_model.parameters())), not from another model or a copy.")


def _timed(into: dict[str, float], name: str, call: Callable[..., Any], step: int,
           *more: Any) -> Any:
    """``call(step, *more)``, its host time added to ``into[name]``."""
    t = time.perf_counter()
    try:
        return call(step, *more)
    finally:
        into[name] = into.get(name, 0.0) + time.perf_counter() - t


def _is_fsdp(model: torch.nn.Module) -> bool:
    """Is ``model`` FSDP2's (``fully_shard``)? Asked without importing FSDP2 for DDP users
    (a torch without the public ``FSDPModule`` has no model of it to pass)."""
    import sys

    module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    return module is not None and isinstance(model, module)


def _sparse_gradients(model: torch.nn.Module) -> bool:
    """Does a trained parameter get a sparse gradient (``nn.Embedding`` or
    ``nn.EmbeddingBag`` with ``sparse=True``)?"""
    return any(isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse
               and m.weight.requires_grad for m in model.modules())


class SDCGuard:
    """Runs forward, backward, the checks and the optimizer step of a DDP model.

    It coordinates; the checks (one protocol each: docs/architecture.md, "The check
    protocol") know themselves. ``guard.step(step)`` does, in order: the ``before_step`` hooks;
    ``begin_step`` of every check due at this step (the replay audit replays its
    ring neighbour's batch here); zero the gradients; per micro-batch,
    ``loss_fn(model, batch)``, the checks' ``on_loss`` and backward (the comm hook
    hands each bucket to the checks that subscribed); the checks' pre-step verdicts;
    the optimizer step, unless a verdict withholds it; the post-step verdicts; the
    event log and ``on_detection`` callback. Some detections arrive a few steps after
    their step (``Detection.step`` says which); call ``flush()`` after the last step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optimizers,
        *,
        loss_fn: LossFn,
        batch_for: BatchFor | None = None,
        config: GuardConfig | None = None,
        on_detection: Callable[[Detection], None] | None = None,
        before_optimizer_step: Callable[[SDCGuard], None] | None = None,
        grad_scaler: Any = None,
        comm_hook: CommHook | None = None,
        comm_hook_state: Any = None,
        process_group: dist.ProcessGroup | None = None,
        remediation: Remediation | None = None,
        checkpoints: CheckpointManager | None = None,
        metrics: GuardMetrics | MetricsSink | None = None,
    ) -> None:
        config = GuardConfig() if config is None else config
        if not isinstance(config, GuardConfig):
            raise TypeError(
                f"SDCGuard(config=...) must be a sdc_guard.GuardConfig, got {type(config).__name__}."
            )
        if isinstance(getattr(model, "_orig_mod", None), DistributedDataParallel):
            raise TypeError(
                "SDCGuard(model=...) got torch.compile(DistributedDataParallel(...)): pass the "
                "DistributedDataParallel itself, with the module inside it compiled: "
                "DistributedDataParallel(torch.compile(module)) (the replay audit recomputes "
                "through that module, which must run the same compiled code as the step)."
            )
        sharded = _is_fsdp(model)
        if not isinstance(model, DistributedDataParallel) and not sharded:
            raise TypeError(
                f"SDCGuard(model=...) must be a torch.nn.parallel.DistributedDataParallel or a "
                f"model wrapped by FSDP2's fully_shard (its root), got {type(model).__name__}. "
                "Wrap it first: DistributedDataParallel(model), or fully_shard each block and "
                "then the model."
            )
        if sharded and comm_hook is not None:
            raise ValueError(
                "SDCGuard(comm_hook=...) is DDP's: a fully_shard model reduces its gradients "
                "through FSDP2's own collectives, which the guard hooks itself. Drop comm_hook "
                "(FSDP2's set_custom_reduce_scatter is the guard's to set).")
        optimizers = as_optimizers(optimizer, "SDCGuard(optimizer=...)")
        _refuse_foreign_optimizer(model, optimizers)
        if not callable(loss_fn):
            raise TypeError("SDCGuard(loss_fn=...) must be callable: loss_fn(model, batch) -> loss.")
        if batch_for is not None and not callable(batch_for):
            raise TypeError("SDCGuard(batch_for=...) must be callable: batch_for(rank, step).")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SDCGuard needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group) before it is built."
            )
        self.model: Any = model
        """The DDP model or FSDP2's ``fully_shard`` root, as given."""
        self.optimizer = optimizer
        self.optimizers = optimizers
        """``optimizer`` as a tuple: the one, or each of several, stepped in that order."""
        if metrics is not None and not isinstance(metrics, GuardMetrics):
            metrics = GuardMetrics(metrics)  # (a sink: refused there, with the fix, if not one)
        self.metrics: GuardMetrics | None = metrics
        """Counters and timings of every step and of the event records
        (``sdc_guard.metrics``; docs/observability.md). None: none kept."""
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        self.config = config
        self.on_detection = on_detection
        self.before_optimizer_step = before_optimizer_step
        self.grad_scaler = grad_scaler
        self.group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.device = next(model.parameters()).device
        self.topology: Topology = gather_topology(
            process_group, node_env=config.node_name_env, pod_env=config.pod_name_env,
            device=self.device)
        """Every rank's hostname, pod and node, and what decides its kernels' bits (its compute
        signature), gathered once here (docs/quarantine.md)."""
        versions = self.topology.fingerprint_mismatch()
        if versions is not None:
            raise ValueError(
                f"SDCGuard: the ranks compute different fingerprints ({versions}): their votes "
                "would never agree. Install one sdc_guard release on every rank.")
        mismatch = self.topology.compute_mismatch()
        if mismatch is not None:
            log.warning(
                "sdc-guard: the ranks do not compute alike (%s). The replay audit is refused "
                "while they differ, and the weights check assumes every rank applies the "
                "optimizer's update alike, which kernels of another instruction set need not do.",
                mismatch)
        self.remediation: Remediation | None = None
        self.before_step: list[StepHook] = []
        """Callables run with the step number at the start of ``step`` (fault injectors use it)."""
        if getattr(model, "_comm_hooks", None):
            raise ValueError(
                "SDCGuard(model=...) already has a DDP comm hook registered, and DDP takes one "
                "per model: build the DDP model without it and pass it to the guard instead, "
                "SDCGuard(..., comm_hook=my_hook, comm_hook_state=my_state).")
        self.backend: Any
        """How gradients are observed and reduced, the containment channel and which ranks
        hold the same state (docs/architecture.md, "The backend seam": DDP's comm hook, or
        FSDP2's reduce-scatter and all-reduce hooks). Fault injectors add their gradient
        callbacks to it."""
        if sharded:
            from sdc_guard.parallel.fsdp import FSDPBackend  # torch.distributed.fsdp on demand

            self.backend = FSDPBackend(model, process_group)
        else:
            self.backend = GuardCommHook(process_group, model=model, inner_hook=comm_hook,
                                         inner_state=comm_hook_state,
                                         sparse_gradients=_sparse_gradients(model))
        self._step_agreed = False
        """Have the ranks been seen at one step (``_agree_on_step``) since the last restore?"""
        self._forwards = [0]
        """Calls of the DDP model, counted until a step has seen one (``_refuse_bypass``)."""
        self._counting: Any = model.register_forward_pre_hook(self._count_forward)
        """The hook that counts them (removed then: a hook on DDP itself would take every
        call of the model off its fast path)."""
        self._start_checked = False
        """Has the first step with a check that ``checks_start`` asked it whether the replicas
        start from the same state (``Check.check_start``)?"""
        self._writes_checked = False
        """Has a step with a check that ``compares_replicas`` seen whether the model's forward
        writes its parameters (``_refuse_written``)?"""
        self._check_start = False
        self._check_writes = False
        """Are those questions still to be asked, with the checks of now (``reconfigure``)?"""
        self.checks: list[Check] = []
        self.events: EventLog | None = None
        self.watchdog: Watchdog | None = None
        """Names a rank that fell out rather than waiting for it (``sdc_guard.watchdog``;
        ``GuardConfig.collective_timeout_s``)."""
        self._withheld: dict[int, tuple[str, ...]] = {}
        """The steps this rank withheld, recently, and the checks that withheld them: a
        detection that arrives later is ``contained`` when its step is here (``_placed``)."""
        self._explained: dict[int, tuple[int, ...]] = {}
        """Recent withheld steps whose HSDP weights vote named ranks, and those ranks
        (``_vote_weights_now``)."""
        self._weights_now: WeightsCheck | None = None
        # Bound before the checks are built and the comm hook registered with DDP: a bad
        # argument must not leave the model hooked (DDP takes one hook, once).
        self.set_remediation(remediation)
        self.checkpoints: CheckpointManager | None = None
        """Told of every unrepaired detection and its suspect window (docs/recovery.md)."""
        self.set_checkpoints(checkpoints)
        self.reconfigure(config)

    def set_checkpoints(self, checkpoints: CheckpointManager | None) -> None:
        """Record suspect windows in ``checkpoints`` from now on (None: nowhere)."""
        if checkpoints is not None and not isinstance(checkpoints, CheckpointManager):
            raise TypeError(f"SDCGuard(checkpoints=...) must be a sdc_guard.CheckpointManager, "
                            f"got {type(checkpoints).__name__}.")
        if self.checkpoints is not None and self.checkpoints is not checkpoints:
            self.checkpoints.bind(None)
        self.checkpoints = checkpoints
        if checkpoints is not None:
            checkpoints.bind(self)

    def set_remediation(self, remediation: Remediation | None) -> None:
        """Hand every detection from now on to ``remediation`` (None: to nobody).

        ``remediation`` is bound to this guard's topology and event log here; the campaign
        harness gives each trial a quarantine of its own this way.
        """
        if remediation is not None and not isinstance(remediation, Remediation):
            raise TypeError(
                f"SDCGuard(remediation=...) must be a sdc_guard.remediation.Remediation (e.g. "
                f"KubeQuarantine(...)), got {type(remediation).__name__}."
            )
        if remediation is not None:
            remediation.bind(topology=self.topology, rank=self.rank, log_event=self.log_event)
        self.remediation = remediation

    def reconfigure(self, config: GuardConfig) -> None:
        """Switch to ``config`` for the steps that follow: the checks are built anew.

        Call on every rank between steps, after ``flush()`` if the old config had the
        non-finite check on (its words still in flight belong to the old checks).
        Benchmarks use it to alternate configurations on one model.
        """
        if not isinstance(config, GuardConfig):
            raise TypeError(f"SDCGuard.reconfigure(config): a sdc_guard.GuardConfig, got "
                            f"{type(config).__name__}.")
        if config.replay_interval and self.batch_for is None:
            raise ValueError(
                f"GuardConfig.replay_interval={config.replay_interval} needs batch_for: the "
                "replay audit recomputes a neighbour's micro-batch, so pass "
                "SDCGuard(..., batch_for=lambda rank, step: ...) or set replay_interval=0."
            )
        mismatch = self.topology.compute_mismatch()
        if config.replay_interval and config.replay_mode == "exact" and mismatch is not None:
            raise ValueError(
                f"GuardConfig.replay_interval={config.replay_interval}: the replay audit "
                "compares each rank's loss and gradients with its neighbour's recomputation bit "
                "for bit, so every rank must compute alike, but these do not (as the guard was "
                f"built): {mismatch}. A healthy rank would be convicted at every audit step. "
                "Make them alike, or set replay_interval=0 (the other checks compare no "
                "computation across ranks).")
        if config.micro_batches > 1 and getattr(self.model, "static_graph", False):
            raise ValueError(
                f"GuardConfig.micro_batches={config.micro_batches} with "
                "DistributedDataParallel(static_graph=True): the guard accumulates the first "
                "micro-batches under no_sync(), which PyTorch's reducer does not support with a "
                "static graph (an internal assert on the first backward, then gradients no "
                "longer all-reduced: pytorch/pytorch#143580). Build DDP without static_graph, "
                "or set micro_batches=1."
            )
        events = None
        if config.event_log is not None:
            try:  # now, not at the first detection, where it would stop the remediation
                events = EventLog(config.event_log, rank=self.rank)
            except OSError as e:
                raise ValueError(
                    f"GuardConfig.event_log={str(config.event_log)!r} cannot be written "
                    f"({e.strerror or e}): give a path in a writable directory, or "
                    "event_log=None") from e
        if config.deterministic:
            enable_determinism(config.seed)
        for check in self.checks:  # each unsubscribes what it subscribed
            check.close()
        # What the old checks' detections were placed against: the new checks report only
        # steps from here (a harness that starts over at step 0 reuses the step numbers).
        self._withheld = {}
        self._explained = {}
        self.config = config
        self.checks = build_checks(
            config, model=self.model, optimizer=self.optimizer, backend=self.backend,
            loss_fn=self.loss_fn, batch_for=self.batch_for, grad_scaler=self.grad_scaler)
        # What the next steps ask once (weighed here: a step with its checks off runs no
        # more Python than it must, and its lines run on caches the step's products filled).
        self._check_start = not self._start_checked and any(
            c.checks_start for c in self.checks)
        self._check_writes = not self._writes_checked and any(
            c.compares_replicas for c in self.checks)
        layout = self.backend.layout
        self._weights_now = next(
            (c for c in self.checks if isinstance(c, WeightsCheck)), None
        ) if layout.sharded and layout.replicas != 2 else None
        """HSDP with a majority per shard, and pure FSDP (at rest): the weights check, asked
        to vote at once on a step another check withheld (``_vote_weights_now``)."""
        self.events = events
        timeout = config.collective_timeout_s
        if self.watchdog is not None and (timeout is None or self.watchdog.timeout_s != timeout):
            self.watchdog.close()
            self.watchdog = None
        if timeout is not None and self.watchdog is None:
            self.watchdog = Watchdog(timeout, group=self.group, fire=self._watchdog_fired)
        self.backend.attach()

    @property
    def comm(self) -> Any:
        """``backend`` under the name fault injectors and harnesses first knew it by."""
        return self.backend

    @property
    def comm_hook_registered(self) -> bool:
        """Is the guard's comm hook registered with DDP (``GuardCommHook.attach``: only once
        something needs the gradient buckets)?"""
        return bool(self.backend.attached)

    # -- the step ---------------------------------------------------------------------------
    def step(self, step: int) -> StepReport:
        """Train one step with every configured check. Collective: call on every rank."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT64_MAX:
            raise ValueError(f"SDCGuard.step(step): step must be an int in 0..2**63-1, got "
                             f"{step!r}.")
        if self.batch_for is None:
            raise ValueError(
                "SDCGuard.step needs batch_for(rank, step) to fetch the batch; pass it to "
                "SDCGuard(..., batch_for=...)."
            )
        watch = self.watchdog
        timed: dict[str, float] | None = None if self.metrics is None else {}
        t0 = 0.0 if timed is None else time.perf_counter()
        try:
            report = self._step(step, watch, timed)
        finally:
            if watch is not None:
                watch.between()
        if self.metrics is not None:
            assert timed is not None
            self.metrics.step(report, seconds=time.perf_counter() - t0, check_seconds=timed,
                              due=list(timed), verified_step=self.clean_through)
        return report

    def _step(self, step: int, watch: Watchdog | None,
              timed: dict[str, float] | None) -> StepReport:
        """``step``'s work; ``timed``: None, or where each due check's host time in its step
        calls (``begin_step``, ``pre_step``, ``post_step``) is added up, by name."""
        if watch is not None:
            watch.at(step, "the start of the step (the step agreement, the checks' begin_step)")
        if not self._step_agreed:
            self._agree_on_step(step)
        if self._check_start:
            self._start_checked = True
            self._check_start = False
            for check in self.checks:
                if check.checks_start:
                    check.check_start(step)
        for hook in self.before_step:
            hook(step)
        if not self.backend.attached:  # a fault injector may have joined the backend's lists
            self.backend.attach()
        cfg = self.config
        # The gradients go before the batch comes, as in a plain loop: fetched first, the
        # batch took memory that glibc then trimmed and faulted back in at every step.
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        assert self.batch_for is not None  # (refused in ``step``)
        batches = list(fetch_micro_batches(self.batch_for, self.rank, step, cfg.micro_batches))
        due = [c for c in self.checks if c.due(step)] if self.checks else []
        self.backend.begin_step(step)
        versions = None
        if self._check_writes:
            versions = [p._version for p in self.model.parameters()]
        for check in due:
            if timed is None:
                check.begin_step(step)
            else:
                t = time.perf_counter()
                check.begin_step(step)
                timed[check.name] = time.perf_counter() - t
        losses: list[torch.Tensor] = []
        self._forwards[0] = 0
        if watch is not None:
            watch.at(step, FORWARD_BACKWARD)
        for i in range(len(batches)):
            if i == len(batches) - 1:  # the gradients are reduced in this backward
                self._micro_batch(batches, i, step, due, losses)
            else:
                with self.backend.no_sync():
                    self._micro_batch(batches, i, step, due, losses)
        self.backend.after_backward()
        if self._counting is not None:
            self._refuse_bypass()
        if versions is not None:
            self._refuse_written(versions)

        detections: list[Detection] = []
        withheld_by: tuple[str, ...] = ()
        verdicts: list[tuple[Check, Verdict]] = []
        pre = due + [c for c in self.checks if c not in due and c.awaiting(step)]
        if pre:
            if watch is not None:
                watch.at(step, "the checks' verdicts before the optimizer step")
            read = StepRead()  # every check asks, then the first to get reads for all
            for check in pre:
                if timed is None:
                    check.ask(step, read)
                else:
                    _timed(timed, check.name, check.ask, step, read)
            verdicts = [(check, check.pre_step(step) if timed is None
                         else _timed(timed, check.name, check.pre_step, step)) for check in pre]
            detections = [d for _, v in verdicts for d in v.detections]
            for check in pre:
                for record in check.records():
                    if self.rank == 0:  # one record per job
                        self.log_event(record)
            if cfg.skip_step_on_detection:
                withheld_by = tuple(c.name for c, v in verdicts if v.withhold)
        skipped = bool(withheld_by)
        everywhere = skipped and any(v.withhold and not v.alone for _, v in verdicts)
        if everywhere and self._weights_now is not None and "weights" not in withheld_by:
            detections += self._vote_weights_now(step)
        if skipped:
            self._withheld = {s: w for s, w in self._withheld.items() if s > step - 100_000}
            self._withheld[step] = withheld_by
        elif watch is not None:
            watch.at(step, "the optimizer step")
        if not skipped:
            if self.before_optimizer_step is not None:
                self.before_optimizer_step(self)
            if self.grad_scaler is not None:
                for opt in self.optimizers:
                    self.grad_scaler.step(opt)
                self.grad_scaler.update()
            else:
                for opt in self.optimizers:
                    opt.step()
        if due and watch is not None:
            watch.at(step, "the checks after the optimizer step (the weights vote)")
        for check in due:
            detections += (check.post_step(step) if timed is None
                           else _timed(timed, check.name, check.post_step, step))

        mean_loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        if detections:
            detections = [self._placed(d) for d in detections]
        report = StepReport(step=step, loss=mean_loss, skipped=skipped,
                            detections=detections, withheld_by=withheld_by)
        for d in detections:
            self._record(d)
        return report

    def _micro_batch(self, batches: list[Any], i: int, step: int, due: list[Check],
                     losses: list[torch.Tensor]) -> None:
        """Forward and backward of micro-batch ``i`` of ``batches``, its loss appended to
        ``losses``. The micro-batch goes once its forward is done, as in a plain loop: its
        graph keeps what the backward needs and lets each tensor go when the backward is
        done with it."""
        mb, batches[i] = batches[i], None
        cfg = self.config
        if cfg.deterministic or cfg.replay_interval:
            with rng_stream(cfg.seed, self.rank, step, i, self.device):
                loss = scalar_loss(self.loss_fn(self.model, mb))
        else:
            loss = scalar_loss(self.loss_fn(self.model, mb))
        del mb
        losses.append(loss.detach())
        for check in due:
            check.on_loss(losses[-1])
        scaled = self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss
        scaled.backward()
        del loss, scaled  # the graph goes now, as in a plain loop, not after the step

    def _count_forward(self, module: Any, args: Any) -> None:
        self._forwards[0] += 1

    def _refuse_bypass(self) -> None:
        """Did ``loss_fn`` call the DDP model in the first step? Without that call DDP does not
        all-reduce the gradients: the replicas train apart, and the weights check would
        report them at every step. Every rank runs the same ``loss_fn``: they raise alike."""
        if self._forwards[0] == 0:
            raise ValueError(f"SDCGuard.step: loss_fn(model, batch) did not call the DDP model. "
                             f"{BYPASS}")
        self._counting.remove()
        self._counting = None

    def _refuse_written(self, versions: list[int]) -> None:
        """Did this step's forwards (the replay's included) write a parameter in place? Asked
        once, on every rank alike (one small all-reduce), when the weights check or the
        replay audit is on.

        An ``nn.Embedding`` with ``max_norm`` renormalises the rows it looks up, in place,
        under ``no_grad``: under DDP each replica renormalises the rows of its own batch and
        the replicas drift apart, which the weights check reports as corruption (a rank
        whose batch alone touched such rows would be convicted, healthy), and the replay of
        a neighbour's batch writes this rank's weights before its own step (every rank
        convicted at every audit step)."""
        self._writes_checked = True
        self._check_writes = False
        named = list(self.model.named_parameters())
        written = [n for (n, p), v in zip(named, versions, strict=True) if p._version != v]
        flag = torch.tensor([int(bool(written))], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()):
            raise ValueError(
                f"SDCGuard.step: the model's forward writes parameters "
                f"{[n.removeprefix('module.') for n in written] or '(on another rank)'} in "
                "place (an nn.Embedding with max_norm renormalises the rows it looks up). Under "
                "DDP each replica then changes the rows of its own batch and the replicas drift "
                "apart without any fault: the weights check would report healthy ranks, and the "
                "replay audit's recomputation of a neighbour's batch would change this rank's "
                "weights. Renormalise outside the forward, after the optimizer step and on every "
                "rank alike (max_norm=None), or turn the weights check and the replay off "
                "(weights_interval=0, replay_interval=0).")

    def _agree_on_step(self, step: int) -> None:
        """Are all ranks at ``step``? Asked at the first step and at the first after a restore
        (one all-gather of a word), where a start step read per rank (a per-rank checkpoint
        that one rank failed to write) would put a rank at another step: DDP trains on
        unaware, and the replay audit would convict that rank at every audit step."""
        steps = all_gather_rows(torch.tensor([step], dtype=torch.int64, device=self.device),
                                self.group)[:, 0].tolist()
        differ = steps_disagree(steps)
        if differ is not None:
            raise ValueError(f"SDCGuard.step: the ranks are not at one step ({differ}); "
                             f"{STEPS_FIX}")
        self._step_agreed = True

    def flush(self) -> list[Detection]:
        """Detections still due after the last ``step``. Collective: call once on every rank.

        The non-finite check sends its flags every ``nonfinite_exchange_interval`` steps and
        collects them a step later (docs/checks/nonfinite.md); the words still out are
        sent and collected here. Detections are recorded like any other (event log,
        ``on_detection``).
        """
        watch = self.watchdog
        if watch is not None:
            watch.at(watch.step, "flush (the checks' last words)")
        try:
            found = [self._placed(d) for check in self.checks for d in check.flush()]
        finally:
            if watch is not None:
                watch.between()
        for d in found:
            self._record(d)
        if self.remediation is not None:
            self.remediation.drain()
        return found

    def _vote_weights_now(self, step: int) -> list[Detection]:
        """Under HSDP, a step another check withheld on every rank: do the replicas' weight
        shards differ now? Every rank of a shard group computes with the parameters gathered
        from its group, so one rank's changed shard makes the whole group's computation
        differ: the replay audit and the non-finite check then name the group (or more: the
        ring's edges into it). The vote names the holder and repairs it from the majority
        (under pure FSDP, at rest, it names the rank whose shard changed, where a non-finite
        gradient hid the answer the reduction carried: ``WeightsCheck.vote_now``); the
        step's other detections that name a rank of that group are narrowed to it (here, and
        when the non-finite check's word for ``step`` comes later: ``_placed``). Collective:
        called where a check withheld on every rank alike (a verdict not ``alone``), which
        every rank's verdicts say alike."""
        assert self._weights_now is not None
        found = self._weights_now.vote_now(step)
        named = tuple(sorted({r for d in found for r in d.suspect_ranks}))
        if found:  # (named may be empty: shards changed, no majority to name a holder)
            self._explained = {s: n for s, n in self._explained.items() if s > step - 1000}
            self._explained[step] = named
        return found

    def _narrowed(self, d: Detection) -> Detection:
        """``d`` with its suspects narrowed to the ranks whose weight shards the vote of its
        step found changed, where it names a rank that computes with them
        (``_vote_weights_now``)."""
        named = self._explained.get(d.step)
        if named is None or d.check == "weights":
            return d
        before = set(d.suspect_ranks)
        # a recomputation gathers weight shards too: where the vote found them changed, a
        # recomputation that came out non-finite was not the batch's doing
        reproduced = {int(r) for r in d.evidence.get("reproduced_by", {})}
        if not named:  # changed, but no majority names a holder: the owners stay suspects
            if not reproduced:
                return d
            suspects = tuple(sorted(before | reproduced))
            return dataclasses.replace(
                d, suspect_ranks=suspects,
                detail=f"{d.detail}; but the weights vote of step {d.step} found weight "
                "shards changed, which the recomputations gathered too: rank(s) "
                f"{sorted(reproduced)} stay suspects",
                evidence={**d.evidence, "suspects_before": list(d.suspect_ranks),
                          "explained_by": "weights"})
        if not before:
            before = reproduced
        layout = self.backend.layout
        rows = {r for n in named for r in layout.computes_with(n)}
        if not rows & before or set(d.suspect_ranks) == set(named):
            return d
        why = (f"narrowed from rank(s) {list(d.suspect_ranks)} to {list(named)}"
               if d.suspect_ranks else
               f"rank(s) {list(named)} named: the recomputations of the batches of rank(s) "
               f"{sorted(before)} gathered the same weights")
        return dataclasses.replace(
            d, suspect_ranks=named,
            detail=f"{d.detail}; {why}: the weights vote of step {d.step} found their weight "
            f"shards changed, which the ranks of their shard groups {sorted(rows)} computed "
            "with",
            evidence={**d.evidence, "suspects_before": list(d.suspect_ranks),
                      "explained_by": "weights"})

    def _placed(self, d: Detection) -> Detection:
        """``d`` with its suspects' nodes, whether it was contained, and, on a suspect rank,
        this rank's GPU snapshot."""
        if self._explained:
            d = self._narrowed(d)
        d = dataclasses.replace(d, suspect_nodes=self.topology.nodes_of(d.suspect_ranks),
                                contained=self._contained(d))
        if self.rank in d.suspect_ranks:
            d = dataclasses.replace(d, evidence={**d.evidence,
                                                 "telemetry": gpu_snapshot(self.device)})
        return d

    def _contained(self, d: Detection) -> bool:
        """Did ``d``'s fault stay out of the weights? Its check withholds steps, its step was
        withheld here and (where a check's withholding can differ between ranks: its
        evidence's ``"withheld_ranks"``) on every rank, and every enabled check had verified
        the run clean through the step before."""
        if d.repaired or d.step not in self._withheld:
            return False
        if not any(c.name == d.check and c.withholds for c in self.checks):
            return False
        ranks = d.evidence.get("withheld_ranks")
        if ranks is not None and set(ranks) != set(range(self.world_size)):
            return False
        clean = self.clean_through
        return clean is None or clean >= d.step - 1

    def saved_state(self) -> dict[str, Any]:
        """What the checks keep in a checkpoint, by check name (a ``CheckpointManager`` saves
        it beside the verified steps: the tolerant replay's calibrated tolerance)."""
        return {c.name: s for c in self.checks if (s := c.saved())}

    def load_saved_state(self, state: dict[str, Any]) -> None:
        """Hand each enabled check what it kept in the restored checkpoint."""
        for c in self.checks:
            if isinstance(state.get(c.name), dict):
                c.load_saved(state[c.name])

    def verified(self) -> tuple[int | None, dict[str, int]]:
        """``clean_through``, and each check's own (what a ``CheckpointManager`` records)."""
        return self.clean_through, {c.name: c.clean_through for c in self.checks}

    @property
    def clean_through(self) -> int | None:
        """The newest step every enabled check has verified clean (-1: none yet; None: no
        check is enabled). A suspect window starts after it (docs/recovery.md)."""
        return min((c.clean_through for c in self.checks), default=None)

    def rewind(self, step: int) -> None:
        """The run was restored to the state after ``step``: every check counts it verified
        (``CheckpointManager.restore`` calls this)."""
        self._step_agreed = False
        self._withheld = {}
        self._explained = {}
        for c in self.checks:
            c.rewind(step)
        record = {"event": "restore", "step": step}
        if self.metrics is not None:  # every rank counts it; one record per job
            self.metrics.event(record)
        if self.rank == 0:
            self._write_event(record)

    def close(self) -> None:
        """Stop the watchdog's thread and unhook the checks (the model stays as it is, its
        DDP comm hook included: DDP takes one per model). For a guard that is done before
        its process ends; a guard left open is closed with the process."""
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
        for check in self.checks:
            check.close()
        self.checks = []
        self._weights_now = None

    def _watchdog_fired(self, message: str, record: dict[str, Any]) -> None:
        self.log_event({"event": "watchdog", **record, "detail": message})

    def _record(self, d: Detection) -> None:
        """One log line and event record per job, from the lowest rank; a suspect rank's own
        telemetry record beside it, keyed by the same (check, step); the checkpoint manager,
        the remediation and ``on_detection`` on every rank."""
        withheld = self._withheld.get(d.step, ())
        if self.rank == 0:
            outcome = ("repaired in place" if d.repaired else
                       "contained: step withheld, nothing to roll back" if d.contained else
                       f"withheld by {', '.join(withheld)} on this rank" if withheld else
                       "not contained")
            if d.transient:
                outcome += "; transient (it did not come back): not quarantined"
            log.warning("SDC detection at step %d by %s: suspects %s on %s; %s (%s)", d.step,
                        d.check, list(d.suspect_ranks), list(d.suspect_nodes), outcome, d.detail)
            record = d.to_json()
            record["evidence"] = {k: v for k, v in d.evidence.items() if k != "telemetry"}
            self.log_event({**record, "withheld_by": list(withheld),
                            "optimizer_step_skipped": bool(withheld)})
        if self.rank in d.suspect_ranks:
            self.log_event({"event": "telemetry", "check": d.check, "step": d.step,
                            "telemetry": d.evidence.get("telemetry")})
        try:  # a repair keeps the checkpoint before it; a contained one changes nothing
            if self.checkpoints is not None:
                self.checkpoints.record_detection(
                    d, verified_through=self.clean_through,
                    repair_window_steps=self.config.repair_window_steps)
        finally:  # a window the manager could not record (it logs why) still quarantines
            if self.remediation is not None and not (d.repaired or d.transient):
                # a repair, or a fault that did not come back, does not quarantine
                self.remediation.act(d)
        if self.on_detection is not None:
            self.on_detection(d)

    @property
    def phase(self) -> str:
        """What the model is computing now: "train", or "replay"/"arbitrate" inside the audit."""
        return next((c.phase for c in self.checks if c.phase != "train"), "train")

    def log_event(self, record: dict[str, Any]) -> None:
        """Append a record to the event log (no-op without one) and count it in the metrics.
        Injectors and the remediation write here. A write that fails (a full disk, a
        vanished volume) is logged at ERROR, never raised: the detection it records is
        acted on all the same."""
        if self.metrics is not None:
            self.metrics.event(record)
        self._write_event(record)

    def _write_event(self, record: dict[str, Any]) -> None:
        if self.events is None:
            return
        try:
            self.events.write(record)
        except OSError as e:
            log.error("sdc-guard: the event log %s could not be written (%s); record %s",
                      self.events.path, e, record.get("check", record.get("event", "?")))
