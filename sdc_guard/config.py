"""Typed, validated configuration for SDCGuard."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

PRODUCTS = ("forward", "input_grad", "weight_grad")
"""The three products of a linear layer's training step (``sdc_guard.checks.checksum``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ChecksumConfig:
    """Which linear layers and products the checksum check verifies, and how often.

    ``GuardConfig(checksum=True)`` means ``ChecksumConfig()``: every ``nn.Linear`` with the
    stock ``forward``, all three products, every step.
    """

    layers: tuple[str, ...] | None = None
    """Module names (``fnmatch`` patterns, relative to the model inside DDP) of the layers to
    check; None = every ``nn.Linear`` whose ``forward`` is ``nn.Linear.forward``. A name here
    may also pick a subclass with a forward of its own: naming it asserts that its output is
    ``F.linear(input, weight, bias)``."""
    products: tuple[str, ...] = PRODUCTS
    """Which of "forward", "input_grad", "weight_grad" to verify."""
    interval: int = 1
    """Check every N-th step (steps with ``step % N == 0``)."""
    tolerance_scale: float = 1.0
    """Multiplies the rounding-error bound (``docs/checks/checksum.md``). Below 1 risks false
    positives."""
    exchange_interval: int = 8
    """Steps whose flags travel in one word (the detection arrives 1 to N steps late)."""
    bound: str = "exact"
    """How ``M`` (the terms' absolute values in the tolerance) is computed: ``"exact"`` (one
    more pass over ``|W|`` per layer and micro-batch) or ``"norm"`` (through Frobenius norms:
    cheaper, and several times looser for the forward and input-gradient products, so
    smaller corruptions pass; ``docs/checks/checksum.md``)."""

    def __post_init__(self) -> None:
        if self.layers is not None:
            if isinstance(self.layers, str) or not all(
                    isinstance(x, str) and x for x in self.layers):
                raise ValueError("ChecksumConfig.layers must be a tuple of module names or "
                                 f"patterns (or None for every nn.Linear), got {self.layers!r}.")
            object.__setattr__(self, "layers", tuple(self.layers))
        products = tuple(self.products) if not isinstance(self.products, str) else ()
        if not products or any(p not in PRODUCTS for p in products):
            raise ValueError(f"ChecksumConfig.products must be a non-empty tuple drawn from "
                             f"{PRODUCTS}, got {self.products!r}.")
        object.__setattr__(self, "products", products)
        for name in ("interval", "exchange_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChecksumConfig.{name} must be an int >= 1, got {value!r}.")
        if self.bound not in ("exact", "norm"):
            raise ValueError(f"ChecksumConfig.bound must be 'exact' or 'norm', got "
                             f"{self.bound!r}.")
        scale = self.tolerance_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (
                math.isfinite(scale) and scale > 0):
            raise ValueError(f"ChecksumConfig.tolerance_scale must be a finite number > 0, "
                             f"got {scale!r}.")





INT64_MAX = 2**63 - 1
"""The largest step and seed: both travel as, and seed, 64-bit integers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GuardConfig:
    """Which checks run, how often, and what happens on a detection. Frozen: derive variants
    with ``dataclasses.replace``."""

    nonfinite: bool = True
    """Check gradients for NaN/Inf before and after the all-reduce (every step)."""

    nonfinite_exchange_interval: int = 8
    """The non-finite check's flags of N steps travel in one small all-reduce, started at
    the end of the N steps and collected a step later, never waited for
    (``docs/checks/nonfinite.md``). Containment does not wait for it: a rank withholds
    its own step at once when its reduced gradients are non-finite. The detection, with
    its own step and suspects, is reported when the word arrives: 1 to N steps later.
    1 = a word every step. Each word is a collective, and on a host whose cores the ranks
    share even one that nobody waits for costs step time (``bench/RESULTS.md``)."""

    weights_interval: int = 1
    """Compare fingerprints of the updated weights across ranks every N steps (0 = off)."""

    replay_interval: int = 0
    """Ring replay audit every N steps (0 = off). Needs ``batch_for``; in the exact mode (the
    default) also deterministic mode."""

    replay_mode: str = "exact"
    """How the replay audit compares a recomputation with the owner's step: ``"exact"``, bit
    for bit (needs ``deterministic=True`` and every rank computing alike), or
    ``"tolerant"``, a float64 sketch of the loss and gradients within a tolerance calibrated
    from the run, with a rerun on the same rank and on a third before anyone is blamed (for
    non-deterministic kernels; ``docs/checks/replay.md``, "Tolerant mode")."""

    replay_trigger: bool = True
    """Tolerant mode, with ``replay_interval`` above 1: between audits, each rank watches its
    local gradient norm, and a norm far from its recent ones audits the step at once, before
    its optimizer step (the vote rides the containment channel, so it needs
    ``skip_step_on_detection=True`` and two ranks or more; ``docs/checks/replay.md``,
    "Tolerant mode")."""

    checksum: bool | ChecksumConfig = False
    """Checksums of every ``nn.Linear`` product (forward, input and weight gradients), every
    step, contained in the step (``docs/checks/checksum.md``). True = ``ChecksumConfig()``;
    a ``ChecksumConfig`` chooses layers, products, interval and tolerance scale."""

    include_optimizer_state: bool = True
    """Fold the optimizer state tensors (Adam moments, momentum buffers) into the weight check."""

    repair_by_majority: bool = True
    """When the weights check's suspects are a strict minority, repair their parameters and
    optimizer state in place by a broadcast from the majority and verify it with a second
    vote (``docs/checks/weights.md``): reported with ``Detection.repaired``, no quarantine,
    no rollback. False: report only."""

    repair_window_steps: int = 1000
    """A rank repaired twice within this many steps has a permanent fault: the second
    detection is reported unrepaired (quarantine, suspect window, rollback)."""

    skip_step_on_detection: bool = True
    """Containment: withhold ``optimizer.step()`` on every rank when a pre-step check fires."""

    deterministic: bool = False
    """Deterministic kernels. Required by the exact replay audit, which compares
    recomputations bit for bit (``docs/checks/replay.md``). The per-(rank, step,
    micro-batch) RNG streams are on whenever this or the replay audit is."""

    seed: int = 0
    """Root seed of the per-(rank, step, micro-batch) random streams."""

    micro_batches: int = 1
    """Gradient accumulation: ``batch_for`` returns this many micro-batches per step; all
    but the last run under ``no_sync``. Scale the loss inside ``loss_fn`` if you want a mean."""

    event_log: str | Path | None = None
    """Append one JSON line per detection (and per injection, from the injectors) to this file."""

    node_name_env: str = "NODE_NAME"
    """The environment variable that holds this rank's Kubernetes node name (the downward API's
    ``spec.nodeName``); without it, the hostname names the node (``docs/quarantine.md``)."""

    pod_name_env: str = "POD_NAME"
    """The environment variable that holds this rank's pod name (``metadata.name``)."""

    collective_timeout_s: float | None = 600.0
    """The watchdog: a rank that has waited this many seconds in one part of
    ``SDCGuard.step`` while another rank fell out (stopped calling ``step``, died, or is at
    another step) logs which rank, at which step, and what it was waiting for, writes it to
    the event log, and ends its process with ``EXIT_RANK_LOST`` (a code a restart policy
    retries), rather than waiting for the process group's own timeout (30 minutes by
    default) to end in an error that names nobody (``docs/architecture.md``, "Ranks at one
    step, and ranks that fall out"). Raise it above the longest work one rank does alone
    while the others wait for it inside a step (a save on rank 0 with no barrier after it).
    None: no watchdog."""

    @property
    def checksum_config(self) -> ChecksumConfig | None:
        """The checksum check's settings, or None when it is off."""
        if self.checksum is True:
            return ChecksumConfig()
        return self.checksum or None

    def __post_init__(self) -> None:
        if not isinstance(self.checksum, (bool, ChecksumConfig)):
            raise ValueError(f"GuardConfig.checksum must be True, False or a "
                             f"sdc_guard.ChecksumConfig, got {self.checksum!r}.")
        value = self.nonfinite_exchange_interval
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                "GuardConfig.nonfinite_exchange_interval must be an int >= 1 (steps whose "
                f"non-finite flags travel in one word; 1 = every step), got {value!r}."
            )
        if isinstance(self.repair_window_steps, bool) or not isinstance(
                self.repair_window_steps, int) or self.repair_window_steps < 1:
            raise ValueError(f"GuardConfig.repair_window_steps must be an int >= 1, got "
                             f"{self.repair_window_steps!r}.")
        for name in ("weights_interval", "replay_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"GuardConfig.{name} must be an int (steps between checks, 0 = off), "
                    f"got {value!r} of type {type(value).__name__}."
                )
            if value < 0:
                raise ValueError(
                    f"GuardConfig.{name} must be >= 0 (0 turns the check off), got {value}."
                )
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or (
            self.micro_batches < 1
        ):
            raise ValueError(
                f"GuardConfig.micro_batches must be an int >= 1 (1 = no gradient accumulation), "
                f"got {self.micro_batches!r}."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not (
                0 <= self.seed <= INT64_MAX):
            raise ValueError(f"GuardConfig.seed must be an int in 0..2**63-1 (it seeds 64-bit "
                             f"generators), got {self.seed!r}.")
        timeout = self.collective_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or not (math.isfinite(timeout) and timeout > 0)):
            raise ValueError(f"GuardConfig.collective_timeout_s must be a number of seconds "
                             f"> 0, or None for no watchdog, got {timeout!r}.")
        if self.replay_mode not in ("exact", "tolerant"):
            raise ValueError(f"GuardConfig.replay_mode must be 'exact' (bit for bit, with "
                             f"deterministic=True) or 'tolerant' (within a calibrated "
                             f"tolerance), got {self.replay_mode!r}.")
        if self.replay_interval and self.replay_mode == "exact" and not self.deterministic:
            raise ValueError(
                f"GuardConfig.replay_interval={self.replay_interval} needs deterministic=True: "
                "the exact replay audit compares recomputations bit for bit, which only holds "
                "with deterministic kernels. Set GuardConfig(deterministic=True, ...), or "
                "replay_mode='tolerant' to compare within a calibrated tolerance, or "
                "replay_interval=0."
            )
        for name in ("nonfinite", "include_optimizer_state", "skip_step_on_detection",
                     "replay_trigger", "deterministic", "repair_by_majority"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"GuardConfig.{name} must be True or False, got {value!r}.")
        for name in ("node_name_env", "pod_name_env"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"GuardConfig.{name} must be the name of an environment "
                                 f"variable, got {value!r}.")
        if self.event_log is not None and not isinstance(self.event_log, (str, Path)):
            raise ValueError(
                f"GuardConfig.event_log must be a path (str or pathlib.Path) or None, "
                f"got {type(self.event_log).__name__}."
            )
