"""SDCGuard: sequences the checks around one DDP training step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sdc_guard.checks import NonFiniteCheck, WeightsCheck
from sdc_guard.checks.replay import ReplayAudit, micro_batches
from sdc_guard.comm_hook import CommHook, GuardCommHook
from sdc_guard.config import GuardConfig
from sdc_guard.determinism import enable_determinism, rng_stream
from sdc_guard.events import EventLog
from sdc_guard.report import Detection, StepReport

log = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]
BatchFor = Callable[[int, int], Any]
StepHook = Callable[[int], None]


class SDCGuard:
    """Runs forward, backward, the checks and the optimizer step of a DDP model.

    ``guard.step(step)`` does, in order: the ``before_step`` hooks; on audit steps
    the replay of the ring neighbour's batch; zero the gradients;
    ``loss_fn(model, batch_for(rank, step))``; backward (the comm hook flags
    non-finite gradients per bucket); the pre-step verdicts (the non-finite flags,
    and the replay audit's agreement on audit steps); the optimizer step, unless
    this step's gradients are withheld (non-finite here, or a replay detection on
    every rank); the post-step weight check; the event log and ``on_detection``
    callback. Non-finite detections arrive a few steps after their step (see
    ``sdc_guard.checks.nonfinite``); call ``flush()`` after the last step.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
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
    ) -> None:
        config = GuardConfig() if config is None else config
        if not isinstance(config, GuardConfig):
            raise TypeError(
                f"SDCGuard(config=...) must be a sdc_guard.GuardConfig, got {type(config).__name__}."
            )
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                f"SDCGuard(model=...) must be a torch.nn.parallel.DistributedDataParallel, got "
                f"{type(model).__name__}. Wrap it first: DistributedDataParallel(model)."
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"SDCGuard(optimizer=...) must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}."
            )
        if not callable(loss_fn):
            raise TypeError("SDCGuard(loss_fn=...) must be callable: loss_fn(model, batch) -> loss.")
        if batch_for is not None and not callable(batch_for):
            raise TypeError("SDCGuard(batch_for=...) must be callable: batch_for(rank, step).")
        if config.replay_interval and batch_for is None:
            raise ValueError(
                f"GuardConfig.replay_interval={config.replay_interval} needs batch_for: the "
                "replay audit recomputes a neighbour's micro-batch, so pass "
                "SDCGuard(..., batch_for=lambda rank, step: ...) or set replay_interval=0."
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SDCGuard needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group) before it is built."
            )
        self.model = model
        self.optimizer = optimizer
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
        self.before_step: list[StepHook] = []
        """Callables run with the step number at the start of ``step`` (fault injectors use it)."""
        self.comm = GuardCommHook(
            process_group,
            check_nonfinite=config.nonfinite,
            inner_hook=comm_hook,
            inner_state=comm_hook_state,
        )
        model.register_comm_hook(self.comm, GuardCommHook.hook)
        self.nonfinite = NonFiniteCheck(
            self.comm, group=process_group, expect_overflow=grad_scaler is not None,
            exchange_interval=config.nonfinite_exchange_interval,
        )
        self.weights = WeightsCheck(
            model,
            optimizer,
            include_optimizer_state=config.include_optimizer_state,
            group=process_group,
        )
        self.replay: ReplayAudit | None = None
        if config.deterministic:
            enable_determinism(config.seed)
        if config.replay_interval:
            assert batch_for is not None  # validated above
            self.replay = ReplayAudit(
                model,
                loss_fn=loss_fn,
                batch_for=batch_for,
                comm=self.comm,
                rank=self.rank,
                world_size=self.world_size,
                seed=config.seed,
                micro_batch_count=config.micro_batches,
                group=process_group,
                scale=grad_scaler.scale if grad_scaler is not None else None,
            )
        self.events: EventLog | None = (
            EventLog(config.event_log, rank=self.rank) if config.event_log is not None else None
        )

    # -- the step ---------------------------------------------------------------------------
    def step(self, step: int) -> StepReport:
        """Train one step with every configured check. Collective: call on every rank."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"SDCGuard.step(step): step must be an int >= 0, got {step!r}.")
        if self.batch_for is None:
            raise ValueError(
                "SDCGuard.step needs batch_for(rank, step) to fetch the batch; pass it to "
                "SDCGuard(..., batch_for=...)."
            )
        for hook in self.before_step:
            hook(step)
        cfg = self.config
        batches = micro_batches(self.batch_for(self.rank, step), cfg.micro_batches)
        audit = bool(cfg.replay_interval) and step % cfg.replay_interval == 0
        self.comm.begin_step(step)
        losses: list[torch.Tensor] = []
        if self.replay is not None:  # on audit steps: the neighbour's replay, first
            self.replay.begin(audit, step, losses)
        self.optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with (rng_stream(cfg.seed, self.rank, step, i, self.device)
                      if cfg.deterministic else contextlib.nullcontext()):
                    loss = self.loss_fn(self.model, mb)
                losses.append(loss.detach())
                scaled = self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss
                scaled.backward()

        detections = self._pre_step_verdict(step, audit)
        # Withheld: a check fired on this step's gradients (detections that arrive now
        # about earlier steps were contained when those steps ran).
        skipped = ((self.nonfinite.withheld_here or any(d.step == step for d in detections))
                   and self.config.skip_step_on_detection)
        if not skipped:
            if self.before_optimizer_step is not None:
                self.before_optimizer_step(self)
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)
                self.grad_scaler.update()
            else:
                self.optimizer.step()
        if self.config.weights_interval and step % self.config.weights_interval == 0:
            detections += self.weights.verdict(step, self.device)

        mean_loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
        report = StepReport(step=step, loss=float(mean_loss.item()), skipped=skipped,
                            detections=detections)
        for d in detections:
            self._record(d, skipped)
        return report

    def _pre_step_verdict(self, step: int, audit: bool) -> list[Detection]:
        """The non-finite check and, on audit steps, the replay audit: before the optimizer step.

        The non-finite check needs no agreement to contain (``NonFiniteCheck.verdict``): it
        returns the detections of its last word, and ``withheld_here``. The replay audit
        must agree before the optimizer step: through one int64 word whose sum over the
        ranks is 0 exactly when every ring edge matches, started in the comm hook just
        before the last gradient all-reduce so that it travels in that all-reduce's
        shadow (one small all-reduce, the cheapest collective), and its evidence is
        gathered only when the sum is not 0.
        """
        found = (self.nonfinite.verdict(step, self.device) if self.config.nonfinite
                 else self.nonfinite.collect())
        if audit and self.replay is not None:
            found += self.replay.verdict(step)
        return found

    def flush(self) -> list[Detection]:
        """Detections still due after the last ``step``. Collective: call once on every rank.

        The non-finite check sends its flags every ``nonfinite_exchange_interval`` steps and
        collects them a step later (``sdc_guard.checks.nonfinite``); the words still out are
        sent and collected here. Detections it returns are recorded like any other (event
        log, ``on_detection``).
        """
        found = self.nonfinite.flush(self.device)
        for d in found:
            self._record(d, False)
        return found

    def _record(self, d: Detection, skipped: bool) -> None:
        log.warning("SDC detection at step %d by %s: suspects %s (%s)", d.step, d.check,
                    list(d.suspect_ranks), d.detail)
        if self.events is not None:
            self.events.write({**d.to_json(), "optimizer_step_skipped": skipped})
        if self.on_detection is not None:
            self.on_detection(d)

    @property
    def phase(self) -> str:
        """What the model is computing now: "train", or "replay"/"arbitrate" inside the audit."""
        return self.replay.phase if self.replay is not None else "train"

    def log_event(self, record: dict[str, Any]) -> None:
        """Append a record to the event log (no-op without one). Injectors write here."""
        if self.events is not None:
            self.events.write(record)
