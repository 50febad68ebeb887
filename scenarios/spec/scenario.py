"""Scenarios as data: TOML files validated into frozen dataclasses.

A scenario file describes one small data-parallel training run (DDP, FSDP2 or
HSDP) and, optionally, the faults to inject into it::

    name = "mlp"                 # default: the file name without .toml
    seed = 0
    world_size = 3
    steps = 20
    batch = 32                   # per rank and micro-batch
    micro_batches = 1            # gradient accumulation
    dtype = "float32"            # float32 | bfloat16
    backend = "auto"             # auto (nccl + cuda when available, else gloo + cpu) | gloo | nccl
    parallel = "ddp"             # ddp | fsdp (FSDP2 on a 1-D mesh) | hsdp (replicas x shards)
    mesh = [3]                   # [world_size] (ddp, fsdp; the default), [R, S] for hsdp
    noise_ulps = 0               # > 0: kernels that are not deterministic (a testbed)

    [model]
    kind = "mlp"                 # mlp | cnn | cnn_bn | transformer | llama
    width = 32
    depth = 2

    [optimizer]
    kind = "adamw"               # adamw | sgd (with momentum) | muon (2-D) + adamw
    lr = 0.01

    [guard]                      # a sdc_guard.GuardConfig: any of its fields but seed and
    replay_interval = 2          # micro_batches (the scenario's own); deterministic is on
                                 # whenever the replay audit is (it needs it)

    [quarantine]                 # optional: each rank runs as if on its own node (node-<rank>)
    max_nodes = 1                # and a sdc_guard KubeQuarantine acts on every detection,
    max_fraction = 0.34          # against a loopback Kubernetes API stand-in started per trial
    dry_run = false              # (kube_standin); the report shows the cordons

    [recovery]                   # optional: trials roll back (or repair) and train to the end;
    checkpoint_every = 4         # the last state is compared with golden's bit for bit
    keep = 3

    [[faults]]                   # an explicit list (one trial per entry: injectors.Fault fields)
    site = "weight_storage"
    rank = 1
    step = 5
    target = "net.0.weight"
    bits = [30]

    # ... or a sampling spec / matrix instead of [[faults]] (see FaultSpace):
    # [sample]
    # sites = ["activation", "weight_storage"]
    # trials_per_site = 20

Every problem is a ``ScenarioError`` naming the file, the field, the bad value
and what is allowed; ``python -m scenarios`` prints it on one line and exits 2.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from injectors import Fault, FaultError
from scenarios.spec.errors import ScenarioError, need_bool, need_choice, need_int, need_number
from scenarios.spec.faults import STATE_KEYS, FaultSpace, space_of, state_keys
from scenarios.spec.limits import MAX_PARAMETERS, MAX_SEED, MAX_STEPS, MAX_WORLD_SIZE
from scenarios.spec.models import (
    DTYPES,
    MODEL_KINDS,
    activation_targets,
    build_model,
    linear_targets,
    parameter_targets,
    synthetic_batch,
)
from scenarios.spec.paths import need_name, need_relative
from scenarios.spec.sharding import PARALLELS
from scenarios.spec.tables import known_keys, read_toml, table_of, tuples
from sdc_guard import ChecksumConfig, GuardConfig

BACKENDS: Final = ("auto", "gloo", "nccl")
OPTIMIZERS: Final = tuple(STATE_KEYS)


@functools.lru_cache(maxsize=256)
def parameter_count(kind: str, width: int, depth: int) -> int:
    """Parameters of a scenario model, counted on the meta device (no memory, no data; the
    global random state is left as it was)."""
    import torch

    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(kind, width=width, depth=depth, seed=0)
    return sum(p.numel() for p in model.parameters())


@functools.lru_cache(maxsize=64)
def _param_dims(kind: str, width: int, depth: int, seed: int) -> dict[str, int]:
    """Each parameter's number of dimensions in a scenario model (built once per shape)."""
    model = build_model(kind, width=width, depth=depth, seed=seed)
    return {n: p.dim() for n, p in model.named_parameters()}
FROM_SCENARIO: Final = ("seed", "micro_batches")
"""``GuardConfig`` fields the scenario sets itself (its data and batches depend on them too)."""
TRAINING_CODE: Final = ("spec/models.py", "spec/sharding.py", "run/session.py",
                         "run/rank.py")
"""Harness files (relative to ``scenarios/``) that build the model, the data and the optimizer
and train them: with the ``sdc_guard`` sources, part of ``Scenario.training_key``."""


NOISE_ULPS: Final = 4
"""The campaign's testbed noise (``Scenario.nondeterministic``): up to 4 ulps on every linear
output, about what a GPU's split reductions move a float32 product by."""
SHARDED_SITES: Final = ("weight_storage", "optimizer_state", "gradient_after_allreduce")
"""Fault sites that reach this rank's shard under FSDP2 (the others: the local, unsharded
gradients before the reduce-scatter, activations, products)."""


def shard_numel(shape: tuple[int, ...], index: int, count: int) -> int:
    """Elements of shard ``index`` of ``count`` of a tensor of ``shape`` split along dim 0
    as FSDP2 splits it (``torch.chunk``: ``ceil(rows / count)`` rows each, the last ones
    fewer or none)."""
    if not shape:
        return 1 if index == 0 else 0
    rows = shape[0]
    per = -(-rows // count)
    mine = max(0, min(rows, (index + 1) * per) - index * per)
    return mine * (math.prod(shape[1:]) if len(shape) > 1 else 1)


# -- the parts of a scenario -------------------------------------------------------------------
@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSpec:
    """Which model to train."""

    kind: str = "mlp"
    """One of ``scenarios.spec.models.MODEL_KINDS``: mlp, cnn, cnn_bn (BatchNorm), transformer,
    llama (RMSNorm, rotary grouped-query attention, SwiGLU: torchtitan's debug model, tiny)."""
    width: int = 32
    """Hidden units (mlp), channels of the first convolution (cnn), model width (transformer,
    llama: a multiple of 8, 4 heads of an even size for the rotary embeddings)."""
    depth: int = 2
    """Hidden layers (mlp) or transformer (llama) blocks; the CNNs always have two convolutions."""

    def __post_init__(self) -> None:
        need_choice("model.kind", self.kind, MODEL_KINDS)
        need_int("model.width", self.width, 2, 4096)
        if self.kind == "transformer" and self.width % 2:
            raise ScenarioError("model.width", self.width, "an even integer (2 attention heads)")
        if self.kind == "llama" and self.width % 8:
            raise ScenarioError("model.width", self.width, "a multiple of 8 for llama, e.g. "
                                f"{max(8, self.width - self.width % 8)}",
                                reason="4 attention heads of an even size (rotary embeddings "
                                       "turn pairs of features)")
        need_int("model.depth", self.depth, 1, 64)
        n = parameter_count(self.kind, self.width, self.depth)
        if n > MAX_PARAMETERS:
            raise ScenarioError("model.width", self.width, f"a width and depth with at most "
                                f"{MAX_PARAMETERS:,} parameters",
                                reason=f"a {self.kind} of width {self.width} and depth "
                                       f"{self.depth} has {n:,}")


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerSpec:
    """The optimizer: SGD with momentum, AdamW, or Muon (every 2-D parameter) with AdamW
    (the rest) beside it."""

    kind: str = "adamw"
    """``"adamw"``, ``"sgd"`` or ``"muon"``."""
    lr: float = 0.01
    """Learning rate."""
    momentum: float = 0.9
    """SGD and Muon: momentum (> 0, so there is a momentum buffer to corrupt)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) or L2 (SGD) weight decay."""

    def __post_init__(self) -> None:
        need_choice("optimizer.kind", self.kind, OPTIMIZERS)
        need_number("optimizer.lr", self.lr, 0.0, 10.0, lo_open=True)
        need_number("optimizer.momentum", self.momentum, 0.0, 1.0, lo_open=True)
        need_number("optimizer.weight_decay", self.weight_decay, 0.0, 1.0)


@dataclass(kw_only=True, frozen=True, slots=True)
class QuarantineSpec:
    """``[quarantine]``: trials quarantine suspect nodes (``sdc_guard.remediation``) on a
    loopback stand-in for the Kubernetes API server, one node per rank."""

    max_nodes: int = 1
    """The breaker's absolute limit (``KubeQuarantine(max_nodes=...)``)."""
    max_fraction: float = 0.34
    """The breaker's fraction of the job's nodes (3 ranks: one node)."""
    window_s: float = 3600.0
    """The breaker's sliding window."""
    dry_run: bool = False
    """Send every write with ``dryRun=All`` (the report then shows what would be cordoned)."""

    def __post_init__(self) -> None:
        need_int("quarantine.max_nodes", self.max_nodes, 0, 100_000)
        need_number("quarantine.max_fraction", self.max_fraction, 0.0, 1.0)
        need_number("quarantine.window_s", self.window_s, 0.0, 10.0**9, lo_open=True)
        need_bool("quarantine.dry_run", self.dry_run)

    def kwargs(self) -> dict[str, Any]:
        """``KubeQuarantine`` arguments (besides the kubeconfig and the job's name)."""
        return {"max_nodes": self.max_nodes, "max_fraction": self.max_fraction,
                "window_s": self.window_s, "dry_run": self.dry_run}


@dataclass(kw_only=True, frozen=True, slots=True)
class RecoverySpec:
    """``[recovery]``: trials do not stop at a detection; they save checkpoints, and on the
    first unrepaired detection the faulty rank's node is replaced (its fault disarmed), the
    run restored from the last clean checkpoint (``sdc_guard.CheckpointManager``) and trained
    to its last step; the final state is compared with the golden run's, bit for bit."""

    checkpoint_every: int = 4
    """Save a checkpoint after every N-th step (steps N-1, 2N-1, ...: the state after them)."""
    keep: int = 3
    """``CheckpointManager(keep=...)``."""

    def __post_init__(self) -> None:
        need_int("recovery.checkpoint_every", self.checkpoint_every, 1, 100_000)
        need_int("recovery.keep", self.keep, 1, 1000)


def guard_from_table(table: Mapping[str, Any]) -> GuardConfig:
    """The ``GuardConfig`` of a ``[guard]`` table (``seed`` and ``micro_batches`` are the
    scenario's: ``Scenario`` fills them in). Deterministic mode is on when the table turns
    the replay audit on and does not say otherwise, as the audit needs it."""
    names = [f.name for f in fields(GuardConfig) if f.name not in FROM_SCENARIO]
    for key in FROM_SCENARIO:
        if key in table:
            raise ScenarioError(f"guard.{key}", table[key], f"{key} at the top level of the "
                                "scenario, not in [guard]", reason="the scenario's data uses it too")
    known_keys(table, names, "guard.")
    kw = dict(table)
    if isinstance(kw.get("checksum"), Mapping):  # [guard.checksum]: a ChecksumConfig
        try:
            kw["checksum"] = ChecksumConfig(**tuples(kw["checksum"]))
        except (TypeError, ValueError) as e:
            raise ScenarioError("guard.checksum", dict(kw["checksum"]),
                                "a table of sdc_guard.ChecksumConfig fields",
                                reason=str(e).rstrip(".")) from None
    k = kw.get("replay_interval", 0)
    if "deterministic" not in kw and isinstance(k, int) and not isinstance(k, bool) and k > 0:
        kw["deterministic"] = True
    try:
        return GuardConfig(**kw)
    except ValueError as e:  # GuardConfig names the field first: "GuardConfig.<field> ..."
        m = re.search(r"GuardConfig\.(\w+)", str(e))
        key = m.group(1) if m and m.group(1) in kw else next(iter(kw), "?")
        raise ScenarioError(f"guard.{key}", kw.get(key), "a value sdc_guard.GuardConfig accepts",
                            reason=str(e).rstrip(".")) from None


@dataclass(kw_only=True, frozen=True, slots=True)
class Scenario:
    """One small data-parallel training run (DDP, FSDP2 or HSDP), and the faults to inject
    into it."""

    name: str
    model: ModelSpec = field(default_factory=ModelSpec)
    world_size: int = 3
    """Ranks (processes). Three or more let the guard attribute a fault to one rank."""
    steps: int = 20
    batch: int = 32
    """Samples per rank and micro-batch."""
    micro_batches: int = 1
    """Gradient accumulation: micro-batches per step (all but the last under ``no_sync``)."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    dtype: str = "float32"
    """Parameter and activation dtype: float32 or bfloat16 (the loss is taken in float32)."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The guard's checks (``[guard]``); its ``seed`` and ``micro_batches`` are the
    scenario's own (filled in here). In a campaign the replay interval is set per trial
    (``guard_config``)."""
    seed: int = 0
    """Seeds the initial weights, the data and the guard's random streams."""
    backend: str = "auto"
    """auto: nccl with one CUDA device per rank when there are enough, else gloo on CPU."""
    parallel: str = "ddp"
    """How the model is spread over the ranks (``scenarios.spec.sharding.shard_model``):
    ``"ddp"`` (DistributedDataParallel), ``"fsdp"`` (FSDP2's ``fully_shard`` on a 1-D mesh
    of every rank) or ``"hsdp"`` (``fully_shard`` on a 2-D mesh: ``R`` replicas of ``S``
    shards). Every check guards FSDP2 as it guards DDP (docs/fsdp.md)."""
    mesh: tuple[int, ...] = ()
    """The mesh shape: ``[world_size]`` for ddp and fsdp (empty: that), ``[R, S]`` with
    ``R * S == world_size`` and ``R >= 2`` for hsdp (required)."""
    trial_timeout_s: float = 120.0
    """A trial whose ranks have not all answered by then is recorded as hung."""
    stop_on_detection: bool = True
    """End a trial at its first detection (the outcome is known; saves time)."""
    quarantine: QuarantineSpec | None = None
    """``[quarantine]``: trials quarantine suspect nodes on a loopback API stand-in."""
    recovery: RecoverySpec | None = None
    """``[recovery]``: trials roll back to a checkpoint (or repair) and train to the end."""
    noise_ulps: int = 0
    """The testbed for kernels that are not deterministic (``injectors.noise.LinearNoise``
    with keyed draws): every ``nn.Linear`` output moves by ``-n..n`` ulps, drawn afresh at
    every recomputation, while a rank's training pass stays reproducible (the golden run is
    its oracle, bit for bit). 0: off. Above 0 the replay audit runs tolerant
    (``replay_mode="tolerant"``) and deterministic mode is off. DDP only. The
    campaign's ``deterministic = [true, false]`` axis runs its ``false`` trials on
    ``nondeterministic()``."""
    faults: tuple[Fault, ...] = ()
    """Explicit faults, one trial each (``[[faults]]``)."""
    space: FaultSpace | None = None
    """Or a matrix / sample of faults (``[matrix]`` or ``[sample]``)."""

    def __post_init__(self) -> None:
        need_name("name", self.name)
        need_int("world_size", self.world_size, 1, MAX_WORLD_SIZE)
        need_int("steps", self.steps, 1, MAX_STEPS)
        need_int("batch", self.batch, 1, 65_536)
        need_int("micro_batches", self.micro_batches, 1, 1024)
        need_choice("dtype", self.dtype, tuple(DTYPES))
        need_int("seed", self.seed, 0, MAX_SEED)
        need_choice("backend", self.backend, BACKENDS)
        self._check_parallel()
        need_number("trial_timeout_s", self.trial_timeout_s, 1.0, 86_400.0)
        need_bool("stop_on_detection", self.stop_on_detection)
        need_int("noise_ulps", self.noise_ulps, 0, 64)
        if not isinstance(self.guard, GuardConfig):
            raise ScenarioError("guard", self.guard, "a sdc_guard.GuardConfig")
        if (self.guard.seed, self.guard.micro_batches) != (self.seed, self.micro_batches):
            object.__setattr__(self, "guard", replace(self.guard, seed=self.seed,
                                                      micro_batches=self.micro_batches))
        if self.faults and self.space is not None:
            raise ScenarioError("faults", f"{len(self.faults)} fault(s)",
                                "either [[faults]] or [matrix]/[sample], not both")
        if self.space is not None:
            self.space.check_against(self)
        for i, f in enumerate(self.faults):
            self._check_fault(i, f)

    def _check_parallel(self) -> None:
        need_choice("parallel", self.parallel, PARALLELS)
        mesh = self.mesh
        if not isinstance(mesh, tuple) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh):
            raise ScenarioError("mesh", mesh, "a list of positive ints: [world_size], or "
                                "[replicas, shards] for hsdp")
        w = self.world_size
        if self.parallel == "hsdp":
            example = next(([r, w // r] for r in (2, 3) if w % r == 0 and w // r >= 1), None)
            hint = f", e.g. {example}" if example else " (world_size must not be prime)"
            if len(mesh) != 2 or mesh[0] * mesh[1] != w or mesh[0] < 2:
                raise ScenarioError("mesh", list(mesh), f"[replicas, shards] with replicas >= 2 "
                                    f"and replicas * shards == world_size ({w}){hint}",
                                    reason="parallel = 'hsdp' replicates shards across a 2-D "
                                           "mesh" if not mesh else "")
        elif mesh not in ((), (w,)):
            raise ScenarioError("mesh", list(mesh), f"[{w}] (world_size) or leave it out",
                                reason=f"parallel = {self.parallel!r} spreads over a 1-D mesh "
                                       "of every rank; a 2-D mesh is parallel = 'hsdp'")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """``mesh``, or ``(world_size,)`` when the file leaves it out."""
        return self.mesh or (self.world_size,)

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded by FSDP2 (``parallel`` fsdp or hsdp)."""
        return self.parallel != "ddp"

    @property
    def parallel_label(self) -> str:
        """The report's name of the parallelism: ``ddp``, ``fsdp4``, ``hsdp3x2``."""
        if self.parallel == "ddp":
            return "ddp"
        return self.parallel + "x".join(str(n) for n in self.mesh_shape)

    def shard_of(self, rank: int) -> tuple[int, int]:
        """``(index, count)``: which of the parameters' dim-0 shards ``rank`` holds, of how
        many (FSDP: every rank its own; HSDP: rank ``r`` holds shard ``r % S``; DDP: the whole
        of each, ``(0, 1)``)."""
        if self.parallel == "ddp":
            return 0, 1
        shards = self.mesh_shape[-1]
        return rank % shards, shards

    def _check_fault(self, i: int, f: Fault) -> None:
        where = f"faults[{i}]"
        if f.rank >= self.world_size:
            raise ScenarioError(f"{where}.rank", f.rank, f"a rank in [0, {self.world_size - 1}]")
        if f.step >= self.steps:
            raise ScenarioError(f"{where}.step", f.step, f"a step in [0, {self.steps - 1}]")
        need_int(f"{where}.seed", f.seed, 0, MAX_SEED)
        targets = self.targets(f.site)
        name = f.target.removeprefix("module.")
        if name not in targets:
            raise ScenarioError(f"{where}.target", f.target, f"one of {targets}")
        if f.site == "optimizer_state":
            keys = self.state_keys(name)
            if f.state_key not in keys:
                raise ScenarioError(f"{where}.state_key", f.state_key, f"one of {list(keys)} "
                                    f"for optimizer {self.optimizer.kind!r} on {name!r}")
            if f.step == 0:
                raise ScenarioError(f"{where}.step", 0, "a step >= 1 for optimizer_state",
                                    reason="optimizers create their state in the first step")
        try:
            f.check_dtype(self.dtype)
        except FaultError as e:
            raise ScenarioError(f"{where}.{e.field}", getattr(f, e.field, None),
                                e.message) from None
        n = self.target_sizes(f.site, f.rank)[name]
        held = f"{f.target!r} has {n} element(s)"
        if f.site in SHARDED_SITES and self.sharded:
            held = f"rank {f.rank}'s shard of {f.target!r} has {n} element(s)"
            if n == 0:
                raise ScenarioError(f"{where}.target", f.target, "a parameter whose shard on "
                                    f"rank {f.rank} is not empty", reason=held)
        if f.burst > n:
            raise ScenarioError(f"{where}.burst", f.burst, f"a burst in [1, {n}] ({held})")
        if f.index is not None and f.index + f.burst > n:
            raise ScenarioError(f"{where}.index", f.index, f"an index in [0, {n - f.burst}] "
                                f"({held}, burst {f.burst})")

    # -- derived ------------------------------------------------------------------------------
    def state_keys(self, target: str) -> tuple[str, ...]:
        """The optimizer state tensors of the parameter ``target`` (``faults.state_keys``)."""
        if self.optimizer.kind != "muon":
            return STATE_KEYS[self.optimizer.kind]
        dims = _param_dims(self.model.kind, self.model.width, self.model.depth, self.seed)
        return state_keys(self.optimizer.kind, dims.get(target.removeprefix("module."), 2))

    def targets(self, site: str) -> list[str]:
        """The names a fault at ``site`` may target in this scenario's model."""
        model = build_model(self.model.kind, width=self.model.width, depth=self.model.depth,
                            seed=self.seed)
        if site in ("activation", "activation_grad"):
            return activation_targets(model)
        if site == "linear_product":
            return linear_targets(model)
        return parameter_targets(model)

    def target_sizes(self, site: str, rank: int | None = None) -> dict[str, int]:
        """Elements of each possible target of ``site``: parameters, or module outputs. Under
        FSDP2, for a site in ``SHARDED_SITES`` and a ``rank``: the elements of that rank's
        shard (FSDP2 splits dim 0 as ``torch.chunk`` does; a shard may be empty)."""
        if site in ("activation", "activation_grad"):  # the module's output, as it meets it
            return {n: math.prod(shape) for n, shape in self.target_shapes(site).items()}
        model = build_model(self.model.kind, width=self.model.width, depth=self.model.depth,
                            seed=self.seed)
        names = self.targets(site)
        if site == "linear_product":  # the weight's elements: the products scale with it
            modules = dict(model.named_modules())
            return {n: modules[n].weight.numel() for n in names}
        params = dict(model.named_parameters())
        if rank is None or site not in SHARDED_SITES or not self.sharded:
            return {n: params[n].numel() for n in names}
        index, count = self.shard_of(rank)
        return {n: shard_numel(tuple(params[n].shape), index, count) for n in names}

    def target_shapes(self, site: str, rank: int | None = None,
                      product: str | None = None) -> dict[str, tuple[int, ...]]:
        """The shape of each possible target of ``site`` as a fault meets it: a parameter
        (under FSDP2, for a site in ``SHARDED_SITES`` and a ``rank``, its shard: dim 0 split
        as ``torch.chunk`` does), a module's output, or for ``linear_product`` the
        ``product``'s (``"forward"``: the output, ``"input_grad"``: the input, ``"weight_grad"``:
        the weight). What a fault pattern's span must fit (``injectors.patterns``)."""
        import torch

        model = build_model(self.model.kind, width=self.model.width, depth=self.model.depth,
                            seed=self.seed)
        names = self.targets(site)
        modules = dict(model.named_modules())
        if site == "linear_product" and product == "weight_grad":
            return {n: tuple(modules[n].weight.shape) for n in names}
        if site not in ("activation", "activation_grad", "linear_product"):
            params = dict(model.named_parameters())
            out = {n: tuple(params[n].shape) for n in names}
            if rank is not None and site in SHARDED_SITES and self.sharded:
                index, count = self.shard_of(rank)
                for n, shape in out.items():
                    rows = shard_numel(shape[:1], index, count) if shape else 1
                    out[n] = (rows, *shape[1:]) if shape else shape
            return out
        shapes: dict[str, tuple[int, ...]] = {}

        def recorder(name: str) -> Any:
            def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
                seen = args[0] if product == "input_grad" else out
                shapes.setdefault(name, tuple(seen.shape))
            return hook

        hooks = [modules[n].register_forward_hook(recorder(n)) for n in names]
        with torch.no_grad():
            model(synthetic_batch(self.model.kind, self.seed, 0, 0, 0, batch=self.batch)[0])
        for h in hooks:
            h.remove()
        return {n: shapes.get(n, (1,)) for n in names}

    def guard_config(self, replay_interval: int | None = None,
                     checksum: bool | None = None) -> GuardConfig:
        """The guard's configuration for a run at ``replay_interval`` (None: the file's),
        deterministic mode on when the audit is (it needs it; our models draw no random
        numbers, so it does not change the trajectory: one golden run serves them all);
        ``checksum`` turns the checksum check on or off (None: as ``[guard]`` says). With
        ``noise_ulps`` the audit is the tolerant one and deterministic mode off (the testbed
        stands for kernels that are not deterministic)."""
        k = self.guard.replay_interval if replay_interval is None else replay_interval
        if self.noise_ulps:  # kernels that are not deterministic: the tolerant audit
            mode = "tolerant" if k else self.guard.replay_mode
            cfg = replace(self.guard, replay_interval=k, replay_mode=mode, deterministic=False)
        else:
            cfg = replace(self.guard, replay_interval=k,
                          deterministic=self.guard.deterministic or k > 0)
        if checksum is not None and bool(cfg.checksum) != checksum:
            cfg = replace(cfg, checksum=checksum)
        return cfg

    def nondeterministic(self, ulps: int = NOISE_ULPS) -> Scenario:
        """This scenario on the testbed for kernels that are not deterministic
        (``noise_ulps``), under a name of its own (its golden run is another)."""
        if self.noise_ulps:
            return self
        guard = replace(self.guard, deterministic=False, replay_mode=(
            "tolerant" if self.guard.replay_interval else self.guard.replay_mode))
        return replace(self, name=f"{self.name[:120]}-nondet", noise_ulps=ulps, guard=guard)

    def training_key(self) -> str:
        """A hash of everything that determines the fault-free trajectory (the golden run)."""
        import torch

        import sdc_guard

        d = asdict(self)
        for k in ("name", "guard", "faults", "space", "trial_timeout_s", "stop_on_detection",
                  "quarantine", "recovery"):
            d.pop(k)
        if not self.noise_ulps:  # a scenario's key as it was before the testbed came in
            d.pop("noise_ulps")
        if self.parallel == "ddp":  # a DDP scenario's key as it was before FSDP2 came in
            d.pop("parallel")
            d.pop("mesh")
        else:
            d["mesh"] = list(self.mesh_shape)
        d["versions"] = [torch.__version__, sdc_guard.__version__, _code_hash()]
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def _code_hash() -> str:
    """The code that trains a scenario (the harness's and the library's) is part of the
    golden key: a golden run computed by other code is not reused."""
    import sdc_guard

    here = Path(__file__).parents[1]
    lib = Path(sdc_guard.__file__).parent
    files = [here / f for f in TRAINING_CODE] + sorted(
        p for p in lib.rglob("*") if p.suffix in (".py", ".c", ".h"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


# -- TOML -> dataclasses -----------------------------------------------------------------------
def scenario_from_dict(data: Mapping[str, Any], *, name: str) -> Scenario:
    """Build a ``Scenario`` from plain data (a parsed TOML document)."""
    known_keys(data, [f.name for f in fields(Scenario) if f.name not in ("faults", "space")]
               + ["faults", "matrix", "sample"], "")
    kw: dict[str, Any] = {k: v for k, v in data.items()
                          if k not in ("model", "optimizer", "guard", "faults", "matrix",
                                       "sample", "quarantine", "recovery")}
    kw.setdefault("name", name)
    if isinstance(kw.get("mesh"), list):
        kw["mesh"] = tuple(kw["mesh"])
    for key, cls in (("model", ModelSpec), ("optimizer", OptimizerSpec)):
        table = table_of(data, key)
        known_keys(table, [f.name for f in fields(cls)], f"{key}.")
        kw[key] = cls(**table)
    kw["guard"] = guard_from_table(table_of(data, "guard"))
    if kw["guard"].event_log is not None:  # the runner writes it under --out
        need_relative("guard.event_log", kw["guard"].event_log)
    if "quarantine" in data:
        table = table_of(data, "quarantine")
        known_keys(table, [f.name for f in fields(QuarantineSpec)], "quarantine.")
        kw["quarantine"] = QuarantineSpec(**table)
    if "recovery" in data:
        table = table_of(data, "recovery")
        known_keys(table, [f.name for f in fields(RecoverySpec)], "recovery.")
        kw["recovery"] = RecoverySpec(**table)
    space = space_of(data)
    if space is not None:
        kw["space"] = space
    raw = data.get("faults", [])
    if not isinstance(raw, list) or not all(isinstance(x, Mapping) for x in raw):
        raise ScenarioError("faults", raw, "an array of tables ([[faults]])")
    faults = []
    for i, entry in enumerate(raw):
        try:
            faults.append(Fault.from_dict(entry))
        except FaultError as e:
            raise ScenarioError(f"faults[{i}].{e.field}", entry.get(e.field), e.message) from None
        except TypeError as e:  # a missing required field
            raise ScenarioError(f"faults[{i}]", dict(entry), "a table with site, rank, step, "
                                "target and the fault's kind", reason=str(e)) from None
    kw["faults"] = tuple(faults)
    return Scenario(**kw)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem is a ``ScenarioError`` naming it."""
    p = Path(path)
    data = read_toml(p)
    try:
        return scenario_from_dict(data, name=p.stem)
    except ScenarioError as e:
        raise e.in_file(p) from None
    except TypeError as e:  # e.g. a table where a number was expected
        raise ScenarioError("?", str(e), "see the scenario format in scenarios/spec/scenario.py",
                            file=p) from None
