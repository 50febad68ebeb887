"""Scenarios as data: TOML files validated into frozen dataclasses.

A scenario file describes one small DDP training run and, optionally, the
faults to inject into it::

    name = "mlp"                 # default: the file name without .toml
    seed = 0
    world_size = 3
    steps = 20
    batch = 32                   # per rank and micro-batch
    micro_batches = 1            # gradient accumulation
    dtype = "float32"            # float32 | bfloat16
    backend = "auto"             # auto (nccl + cuda when available, else gloo + cpu) | gloo | nccl

    [model]
    kind = "mlp"                 # mlp | cnn | cnn_bn | transformer
    width = 32
    depth = 2

    [optimizer]
    kind = "adamw"               # adamw | sgd (with momentum)
    lr = 0.01

    [guard]                      # maps to sdc_guard.GuardConfig
    replay_interval = 2

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
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from injectors import MODELS as FAULT_MODELS
from injectors import SITES, Fault, FaultError
from scenarios.models import (
    MODEL_KINDS,
    activation_targets,
    build_model,
    parameter_targets,
    synthetic_batch,
)
from sdc_guard import GuardConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPES: Final = ("float32", "bfloat16")
BACKENDS: Final = ("auto", "gloo", "nccl")
OPTIMIZERS: Final = ("adamw", "sgd")
STATE_KEYS: Final = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
FIELDS: Final = ("sign", "exponent", "mantissa", "any", "nan", "inf")
"""Bit fields of a campaign: one random bit of the sign / exponent / mantissa / any field
(a bit flip), or the whole element set to NaN / +Inf (a value fault)."""
MODES: Final = ("matrix", "sample")
_TRAINING_CODE: Final = ("models.py", "rank.py")
"""Source files whose contents are part of ``Scenario.training_key`` (the golden cache key),
with ``sdc_guard/fingerprints.py`` (the golden run stores fingerprints)."""


class ScenarioError(ValueError):
    """A scenario or campaign file that cannot be run as written.

    ``file``, ``field`` (a dotted path such as ``optimizer.kind``), ``value`` and
    ``allowed`` say what is wrong and what would be accepted.
    """

    def __init__(self, field: str, value: Any, allowed: str, *, reason: str = "",
                 file: str | Path | None = None) -> None:
        self.file = None if file is None else str(file)
        self.field = field
        self.value = value
        self.allowed = allowed
        self.reason = reason
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.file}: " if self.file else ""
        why = f" ({self.reason})" if self.reason else ""
        return f"{where}{self.field} = {self.value!r} is not valid{why}; allowed: {self.allowed}"

    def in_file(self, file: str | Path, prefix: str = "") -> ScenarioError:
        """The same error, located in ``file`` (and under table ``prefix``)."""
        name = f"{prefix}.{self.field}" if prefix and not self.field.startswith(prefix) else (
            self.field)
        return ScenarioError(name, self.value, self.allowed, reason=self.reason,
                             file=self.file or file)


# -- small validators --------------------------------------------------------------------------
def _int(name: str, v: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ScenarioError(name, v, rng)


def _float(name: str, v: Any, lo: float, hi: float, *, lo_open: bool = False) -> None:
    ok = (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
          and (v > lo if lo_open else v >= lo) and v <= hi)
    if not ok:
        raise ScenarioError(name, v, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def _choice(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    if v not in allowed:
        raise ScenarioError(name, v, f"one of {list(allowed)}")


def _bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ScenarioError(name, v, "true or false")


def _choices(name: str, v: Any, allowed: tuple[str, ...]) -> None:
    if not isinstance(v, tuple) or not v:
        raise ScenarioError(name, v, f"a non-empty list of {list(allowed)}")
    for x in v:
        _choice(name, x, allowed)
    if len(set(v)) != len(v):
        raise ScenarioError(name, list(v), f"distinct values from {list(allowed)}")


def _ints(name: str, v: Any, lo: int, *, empty: bool = False) -> None:
    if not isinstance(v, tuple) or (not v and not empty):
        raise ScenarioError(name, v, f"a {'' if empty else 'non-empty '}list of integers >= {lo}")
    for x in v:
        _int(name, x, lo)


# -- the parts of a scenario -------------------------------------------------------------------
@dataclass(kw_only=True, frozen=True, slots=True)
class ModelSpec:
    """Which model to train."""

    kind: str = "mlp"
    """One of ``scenarios.models.MODEL_KINDS``: mlp, cnn, cnn_bn (BatchNorm), transformer."""
    width: int = 32
    """Hidden units (mlp), channels of the first convolution (cnn), model width (transformer)."""
    depth: int = 2
    """Hidden layers (mlp) or transformer blocks; the CNNs always have two convolutions."""

    def __post_init__(self) -> None:
        _choice("model.kind", self.kind, MODEL_KINDS)
        _int("model.width", self.width, 2, 4096)
        if self.kind == "transformer" and self.width % 2:
            raise ScenarioError("model.width", self.width, "an even integer (2 attention heads)")
        _int("model.depth", self.depth, 1, 64)


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerSpec:
    """The optimizer: SGD with momentum or AdamW."""

    kind: str = "adamw"
    """``"adamw"`` or ``"sgd"``."""
    lr: float = 0.01
    """Learning rate."""
    momentum: float = 0.9
    """SGD only: momentum (> 0, so there is a momentum buffer to corrupt)."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) or L2 (SGD) weight decay."""

    def __post_init__(self) -> None:
        _choice("optimizer.kind", self.kind, OPTIMIZERS)
        _float("optimizer.lr", self.lr, 0.0, 10.0, lo_open=True)
        _float("optimizer.momentum", self.momentum, 0.0, 1.0, lo_open=True)
        _float("optimizer.weight_decay", self.weight_decay, 0.0, 1.0)


@dataclass(kw_only=True, frozen=True, slots=True)
class GuardSpec:
    """The guard's checks (``sdc_guard.GuardConfig``; seed and micro-batches come from the
    scenario). In a campaign, ``replay_interval`` is set per trial from the matrix."""

    nonfinite: bool = True
    nonfinite_exchange_interval: int = GuardConfig().nonfinite_exchange_interval
    weights_interval: int = 1
    replay_interval: int = 0
    include_optimizer_state: bool = True
    skip_step_on_detection: bool = True
    deterministic: bool = False
    """Deterministic mode; switched on for every run with a replay interval > 0 (the audit
    needs it), as a user would. Our models draw no random numbers, so it does not change
    the trajectory: clean trials at every interval are checked against one golden run."""

    def __post_init__(self) -> None:
        for name in ("nonfinite", "include_optimizer_state", "skip_step_on_detection",
                     "deterministic"):
            _bool(f"guard.{name}", getattr(self, name))
        _int("guard.nonfinite_exchange_interval", self.nonfinite_exchange_interval, 1)
        _int("guard.weights_interval", self.weights_interval, 0)
        _int("guard.replay_interval", self.replay_interval, 0)

    def config(self, *, seed: int, micro_batches: int,
               replay_interval: int | None = None) -> GuardConfig:
        """The ``GuardConfig`` for a run (``replay_interval`` overrides the file's)."""
        k = self.replay_interval if replay_interval is None else replay_interval
        return GuardConfig(
            nonfinite=self.nonfinite, weights_interval=self.weights_interval, replay_interval=k,
            nonfinite_exchange_interval=self.nonfinite_exchange_interval,
            include_optimizer_state=self.include_optimizer_state,
            skip_step_on_detection=self.skip_step_on_detection,
            deterministic=self.deterministic or k > 0, seed=seed, micro_batches=micro_batches,
        )


@dataclass(kw_only=True, frozen=True, slots=True)
class FaultSpace:
    """A campaign's faults: a full matrix of its axes, or a random sample from them.

    Each trial gets one fault: a site, a bit field, a fault model, a first step, a
    rank and a replay interval from the axes; its target (a module for activation
    sites, a parameter otherwise) and the element inside it are drawn from the
    trial's seed. ``optimizer_state`` faults at step 0 are left out of a matrix
    (optimizers create their state in the first step).
    """

    mode: str = "matrix"
    """``"matrix"`` (every combination of the axes) or ``"sample"`` (random draws)."""
    sites: tuple[str, ...] = SITES
    fields: tuple[str, ...] = ("sign", "exponent", "mantissa")
    """Bit fields: ``FIELDS`` (sign / exponent / mantissa / any: one random bit; nan / inf)."""
    models: tuple[str, ...] = ("transient",)
    """Fault models: transient, intermittent, permanent."""
    steps: tuple[int, ...] = ()
    """First steps; empty = every step from 1 to the scenario's last (sample mode)."""
    ranks: tuple[int, ...] = ()
    """Faulty ranks; empty = every rank."""
    replay_intervals: tuple[int, ...] = (0,)
    """Replay audit intervals to run the trials under (0 = audit off)."""
    p: float = 0.5
    """Intermittent faults: probability of firing at each step."""
    repeat: int = 1
    """Matrix mode: trials per combination (each with its own seed: other targets, elements)."""
    trials_per_site: int = 0
    """Sample mode: trials per site; 0 = sized by ``margin`` (Leveugle et al. 2009)."""
    margin: float = 0.1
    """Sample mode: target margin of error of each site's coverage."""
    confidence: float = 0.95
    """Sample mode: confidence level of ``margin`` (0.90, 0.95 or 0.99)."""
    seed: int = 0
    """Seeds the sample, the targets and the elements: trial ids are a function of it."""

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choices("sites", self.sites, SITES)
        _choices("fields", self.fields, FIELDS)
        _choices("models", self.models, FAULT_MODELS)
        _ints("steps", self.steps, 0, empty=True)
        _ints("ranks", self.ranks, 0, empty=True)
        _ints("replay_intervals", self.replay_intervals, 0)
        _float("p", self.p, 0.0, 1.0, lo_open=True)
        _int("repeat", self.repeat, 1, 1000)
        _int("trials_per_site", self.trials_per_site, 0)
        _float("margin", self.margin, 0.0, 0.5, lo_open=True)
        _choice("confidence", self.confidence, (0.9, 0.95, 0.99))  # type: ignore[arg-type]
        _int("seed", self.seed, 0)
        if self.mode == "matrix" and not self.steps:
            raise ScenarioError("steps", [], "a non-empty list of steps in matrix mode")

    def check_against(self, scenario: Scenario) -> None:
        for s in self.steps:
            if s >= scenario.steps:
                raise ScenarioError("steps", s, f"steps in [0, {scenario.steps - 1}] "
                                    f"(scenario {scenario.name!r} trains {scenario.steps} steps)")
        for r in self.ranks:
            if r >= scenario.world_size:
                raise ScenarioError("ranks", r, f"ranks in [0, {scenario.world_size - 1}] "
                                    f"(scenario {scenario.name!r} has {scenario.world_size})")


@dataclass(kw_only=True, frozen=True, slots=True)
class Scenario:
    """One small DDP training run, and the faults to inject into it."""

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
    guard: GuardSpec = field(default_factory=GuardSpec)
    seed: int = 0
    """Seeds the initial weights, the data and the guard's random streams."""
    backend: str = "auto"
    """auto: nccl with one CUDA device per rank when there are enough, else gloo on CPU."""
    trial_timeout_s: float = 120.0
    """A trial whose ranks have not all answered by then is recorded as hung."""
    stop_on_detection: bool = True
    """End a trial at its first detection (the outcome is known; saves time)."""
    faults: tuple[Fault, ...] = ()
    """Explicit faults, one trial each (``[[faults]]``)."""
    space: FaultSpace | None = None
    """Or a matrix / sample of faults (``[matrix]`` or ``[sample]``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not all(
                c.isalnum() or c in "-_." for c in self.name):
            raise ScenarioError("name", self.name, "a non-empty name of letters, digits, - _ .")
        _int("world_size", self.world_size, 1, 1024)
        _int("steps", self.steps, 1, 100_000)
        _int("batch", self.batch, 1, 65_536)
        _int("micro_batches", self.micro_batches, 1, 1024)
        _choice("dtype", self.dtype, DTYPES)
        _int("seed", self.seed, 0)
        _choice("backend", self.backend, BACKENDS)
        _float("trial_timeout_s", self.trial_timeout_s, 1.0, 86_400.0)
        _bool("stop_on_detection", self.stop_on_detection)
        if self.faults and self.space is not None:
            raise ScenarioError("faults", f"{len(self.faults)} fault(s)",
                                "either [[faults]] or [matrix]/[sample], not both")
        if self.space is not None:
            try:
                self.space.check_against(self)
            except ScenarioError as e:
                raise ScenarioError(f"{self.space.mode}.{e.field}", e.value, e.allowed,
                                    reason=e.reason) from None
        for i, f in enumerate(self.faults):
            self._check_fault(i, f)

    def _check_fault(self, i: int, f: Fault) -> None:
        where = f"faults[{i}]"
        if f.rank >= self.world_size:
            raise ScenarioError(f"{where}.rank", f.rank, f"a rank in [0, {self.world_size - 1}]")
        if f.step >= self.steps:
            raise ScenarioError(f"{where}.step", f.step, f"a step in [0, {self.steps - 1}]")
        targets = self.targets(f.site)
        name = f.target.removeprefix("module.")
        if name not in targets:
            raise ScenarioError(f"{where}.target", f.target, f"one of {targets}")
        if f.site == "optimizer_state":
            keys = STATE_KEYS[self.optimizer.kind]
            if f.state_key not in keys:
                raise ScenarioError(f"{where}.state_key", f.state_key, f"one of {list(keys)} "
                                    f"for optimizer {self.optimizer.kind!r}")
            if f.step == 0:
                raise ScenarioError(f"{where}.step", 0, "a step >= 1 for optimizer_state",
                                    reason="optimizers create their state in the first step")
        try:
            f.check_dtype(self.dtype)
        except FaultError as e:
            raise ScenarioError(f"{where}.{e.field}", getattr(f, e.field, None),
                                e.message) from None
        if f.index is not None:
            n = self.target_sizes(f.site)[name]
            if f.index + f.burst > n:
                raise ScenarioError(f"{where}.index", f.index, f"an index in [0, {n - f.burst}] "
                                    f"({f.target!r} has {n} element(s), burst {f.burst})")

    # -- derived ------------------------------------------------------------------------------
    def targets(self, site: str) -> list[str]:
        """The names a fault at ``site`` may target in this scenario's model."""
        model = build_model(self.model.kind, width=self.model.width, depth=self.model.depth,
                            seed=self.seed)
        if site in ("activation", "activation_grad"):
            return activation_targets(model)
        return parameter_targets(model)

    def target_sizes(self, site: str) -> dict[str, int]:
        """Elements of each possible target of ``site``: parameters, or module outputs."""
        import torch

        model = build_model(self.model.kind, width=self.model.width, depth=self.model.depth,
                            seed=self.seed)
        names = self.targets(site)
        if site not in ("activation", "activation_grad"):
            params = dict(model.named_parameters())
            return {n: params[n].numel() for n in names}
        sizes: dict[str, int] = {}
        modules = dict(model.named_modules())

        def recorder(name: str) -> Any:
            def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
                sizes.setdefault(name, out.numel())
            return hook

        hooks = [modules[n].register_forward_hook(recorder(n)) for n in names]
        with torch.no_grad():
            model(synthetic_batch(self.model.kind, self.seed, 0, 0, 0, batch=self.batch)[0])
        for h in hooks:
            h.remove()
        return {n: sizes.get(n, 1) for n in names}

    def guard_config(self, replay_interval: int | None = None) -> GuardConfig:
        return self.guard.config(seed=self.seed, micro_batches=self.micro_batches,
                                 replay_interval=replay_interval)

    def training_key(self) -> str:
        """A hash of everything that determines the fault-free trajectory (the golden run)."""
        import torch

        import sdc_guard

        d = asdict(self)
        for k in ("name", "guard", "faults", "space", "trial_timeout_s", "stop_on_detection"):
            d.pop(k)
        d["versions"] = [torch.__version__, sdc_guard.__version__, _code_hash()]
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@functools.cache
def _code_hash() -> str:
    """The code that builds the model, the data and the optimizer is part of the golden key."""
    import sdc_guard.fingerprints

    here = Path(__file__).parent
    files = [here / f for f in _TRAINING_CODE] + [Path(sdc_guard.fingerprints.__file__)]
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


# -- TOML -> dataclasses -----------------------------------------------------------------------
def _known(cls: type, table: Mapping[str, Any], prefix: str, extra: tuple[str, ...] = ()) -> None:
    names = [f.name for f in fields(cls) if f.name not in ("faults", "space")] + list(extra)
    for key in table:
        if key not in names:
            raise ScenarioError(f"{prefix}{key}", table[key], f"the keys {sorted(names)}",
                                reason="unknown key")


def _tuples(table: Mapping[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    v = data.get(key, {})
    if not isinstance(v, Mapping):
        raise ScenarioError(key, v, "a TOML table ([" + key + "])")
    return v


def fault_space(table: Mapping[str, Any], mode: str) -> FaultSpace:
    """A ``FaultSpace`` from a ``[matrix]`` or ``[sample]`` table."""
    if not isinstance(table, Mapping):
        raise ScenarioError(mode, table, f"a TOML table ([{mode}])")
    _known(FaultSpace, table, f"{mode}.")
    if "mode" in table and table["mode"] != mode:
        raise ScenarioError(f"{mode}.mode", table["mode"], f"{mode!r} (or leave it out)")
    try:
        return FaultSpace(**{**_tuples(table), "mode": mode})
    except ScenarioError as e:
        raise ScenarioError(f"{mode}.{e.field}", e.value, e.allowed, reason=e.reason) from None


def scenario_from_dict(data: Mapping[str, Any], *, name: str) -> Scenario:
    """Build a ``Scenario`` from plain data (a parsed TOML document)."""
    _known(Scenario, data, "", extra=("faults", "matrix", "sample"))
    kw: dict[str, Any] = {k: v for k, v in data.items()
                          if k not in ("model", "optimizer", "guard", "faults", "matrix",
                                       "sample")}
    kw.setdefault("name", name)
    for key, cls in (("model", ModelSpec), ("optimizer", OptimizerSpec), ("guard", GuardSpec)):
        table = _table(data, key)
        _known(cls, table, f"{key}.")
        kw[key] = cls(**table)
    spaces = [m for m in MODES if m in data]
    if len(spaces) > 1:
        raise ScenarioError("sample", "[matrix] and [sample]", "one of [matrix] or [sample]")
    if spaces:
        kw["space"] = fault_space(data[spaces[0]], spaces[0])
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


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ScenarioError("file", str(p), "an existing TOML file", file=p) from None
    except OSError as e:
        raise ScenarioError("file", str(p), "a readable TOML file", reason=e.strerror or str(e),
                            file=p) from None
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError("toml", str(e), "valid TOML", file=p) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem is a ``ScenarioError`` naming it."""
    p = Path(path)
    data = read_toml(p)
    try:
        return scenario_from_dict(data, name=p.stem)
    except ScenarioError as e:
        raise e.in_file(p) from None
    except TypeError as e:  # e.g. a table where a number was expected
        raise ScenarioError("?", str(e), "see the scenario format in scenarios/spec.py",
                            file=p) from None


def with_replay(scenario: Scenario, interval: int) -> Scenario:
    """The scenario with the guard's replay interval set (``deterministic`` on when needed)."""
    guard = replace(scenario.guard, replay_interval=interval,
                    deterministic=scenario.guard.deterministic or interval > 0)
    return replace(scenario, guard=guard)
