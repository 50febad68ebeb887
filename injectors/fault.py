"""``Fault``: one fault, described as one frozen, validated record.

A fault says *where* (``site``, ``rank``, ``target``, ``state_key``, ``index``),
*what* (``kind`` and its bits or value, ``burst``) and *when* (``step`` and the
fault ``model``). Everything that can be checked without a model is checked
in ``__post_init__``; the rest (names, index range, dtype) when the fault is
armed against a model (``injectors.arm``). Errors are ``FaultError``
(a ``ValueError``) naming the field and the fix.

Sites (the names used in every table and report)::

    activation                 forward output of module `target` (a named_modules name)
    activation_grad            gradient flowing back into that output
    gradient_before_allreduce  this rank's local gradient of parameter `target`
    gradient_after_allreduce   the all-reduced gradient of `target`, on this rank only
    optimizer_state            optimizer.state[param `target`][`state_key`], start of the step
    weight_storage             parameter `target` at rest, before the forward of the step
    linear_product             inside nn.Linear `target`: its matmul's output before the bias
                               (`product="forward"`), or its backward's input gradient
                               ("input_grad") or weight gradient ("weight_grad"), before
                               any hook sees them

Fault models: ``transient`` fires at ``step`` only; ``intermittent`` fires at
each step ``s >= step`` with probability ``p``, decided by an RNG seeded with
``(seed, rank, s)`` (so a rerun fires at the same steps, whatever else ran);
``permanent`` fires at every step ``s >= step``.

Activation faults fire, by default, only while the model computes the rank's
own training step (``phase="train"``); under an ``SDCGuard`` with the replay
audit, ``phase="replay"`` / ``"arbitrate"`` / ``"any"`` target the audit's
recomputations on the same module instead.

Where a fault lands inside its tensor (``index=None``, ``field=...``) is drawn
from an RNG seeded with ``(seed, rank)`` only: a permanent fault hits the same
element and bits at every step, as a broken cell would. ``kind="random"``
draws fresh random words at each firing step from ``(seed, rank, step)``.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

from injectors.bits import FIELDS, dtype_from_name, layout_of
from sdc_guard.determinism import derive_seed

__all__ = [
    "KINDS", "MODELS", "PARAMETER_SITES", "PHASES", "SITES", "Fault", "FaultError", "seeded_rng",
]

SITES: Final = (
    "activation",
    "activation_grad",
    "gradient_before_allreduce",
    "gradient_after_allreduce",
    "optimizer_state",
    "weight_storage",
    "linear_product",
)
MODULE_SITES: Final = frozenset({"activation", "activation_grad", "linear_product"})
"""Sites whose ``target`` is a module name (``named_modules``)."""
PARAMETER_SITES: Final = frozenset(SITES) - MODULE_SITES
"""Sites whose ``target`` is a parameter name (``named_parameters``)."""
GRADIENT_SITES: Final = frozenset({"gradient_before_allreduce", "gradient_after_allreduce"})
STEP_SITES: Final = frozenset({"optimizer_state", "weight_storage"})
"""Sites injected at the start of a step (``guard.before_step`` or ``handle.begin_step``)."""
MODELS: Final = ("transient", "intermittent", "permanent")
PRODUCTS: Final = ("forward", "input_grad", "weight_grad")
"""linear_product: which of an ``nn.Linear``'s products the fault corrupts."""
PHASES: Final = ("train", "replay", "arbitrate", "any")
"""What the model is computing when an activation fault may fire: the rank's own training
step, the guard's replay of a neighbour's batch, its arbitration replay, or any of them."""
KINDS: Final = ("bitflip", "set", "random", "zero", "stuck")
BIT_KINDS: Final = frozenset({"bitflip", "stuck"})
"""Kinds that name bits (``bits`` or ``field``)."""
BURST_BITS: Final = ("same", "each")
ALONG: Final = ("row", "column")
_DEFAULTS: Final = {"burst_bits": "same", "along": "row", "stuck": None}
"""Fields added to the record after the first campaigns: left out of ``to_dict`` at these
values, so every fault described before them keeps its dict (and every key made from it)."""

_FIRE: Final = 1
_WHERE: Final = 2
_VALUE: Final = 3


class FaultError(ValueError):
    """A fault that cannot be injected as described. ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"Fault.{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[FaultError], tuple[str, str]]:
        return (type(self), (self.field, self.message))  # picklable across spawned ranks


def seeded_rng(*parts: int) -> random.Random:
    """A ``random.Random`` determined by the integers ``parts`` alone (same in every process)."""
    return random.Random(derive_seed(*parts))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One fault: where, what and when. Validated on construction; see the module docstring."""

    site: str
    """One of ``SITES``."""
    rank: int
    """The only rank the fault touches (arming on other ranks gives an inert handle)."""
    step: int
    """First (for transient: only) step at which the fault fires; >= 0."""
    target: str
    """A module name from ``named_modules()`` (activation sites) or a parameter name from
    ``named_parameters()`` (other sites), relative to the model inside DDP (``"0.weight"``,
    not ``"module.0.weight"``; the ``"module."`` prefix is accepted and dropped)."""
    state_key: str | None = None
    """optimizer_state only: the state entry, e.g. ``"exp_avg"``, ``"exp_avg_sq"``,
    ``"momentum_buffer"``."""
    index: int | None = None
    """Element in logical row-major order; ``None`` = drawn from ``(seed, rank)``."""
    kind: str = "bitflip"
    """``"bitflip"`` (XOR ``bits``), ``"set"`` (write ``value`` / ``value_bits``),
    ``"random"`` (random words), ``"zero"`` (all-zero bits), ``"stuck"`` (``bits`` held at
    ``stuck``)."""
    bits: tuple[int, ...] = ()
    """bitflip: bit indices to flip in each element (0 = least significant)."""
    field: str | None = None
    """bitflip, instead of ``bits``: a named field (``"sign"``, ``"exponent"``, ``"mantissa"``,
    ``"value"``, ``"any"``) whose bits are drawn from ``(seed, rank)``."""
    count: int | None = 1
    """With ``field``: how many distinct bits of the field to flip; ``None`` = all of them."""
    value: float | None = None
    """set: the value to write (converted by torch to the tensor's dtype; nan/inf allowed)."""
    value_bits: int | None = None
    """set, instead of ``value``: the raw unsigned word to write."""
    burst: int = 1
    """How many elements, from ``index`` on (adjacent, or a column: ``along``), get the same
    treatment."""
    burst_bits: str = "same"
    """bitflip or stuck with ``field``, over a burst: ``"same"`` (one draw of ``count`` bits,
    the same in every element: one bit position wrong across neighbouring lanes) or
    ``"each"`` (each element draws its own ``count`` bits of the field: a burst of lanes at
    random bits)."""
    along: str = "row"
    """Where a burst's elements lie: ``"row"`` (logically adjacent: ``index``, ``index + 1``,
    ...) or ``"column"`` (the same place in consecutive rows of the tensor's last dimension:
    ``index``, ``index + n``, ... for rows of ``n``: one lane of a vector or matrix unit,
    wrong in each row it computes)."""
    stuck: int | None = None
    """stuck: the value, 0 or 1, the ``bits`` (or the ``field``'s drawn bits) are held at;
    an element whose bit already holds it is left unchanged."""
    model: str = "transient"
    """``"transient"``, ``"intermittent"`` or ``"permanent"``."""
    p: float = 1.0
    """intermittent: probability of firing at each step from ``step`` on, in (0, 1]."""
    seed: int = 0
    """Seeds every random choice (index, field bits, random words, intermittent firing)."""
    phase: str = "train"
    """Activation sites: fire only while the model computes this phase (``SDCGuard.phase``):
    ``"train"`` (the rank's own step), ``"replay"``, ``"arbitrate"`` (the replay audit's
    recomputations on the same module) or ``"any"``. Plain loops are always ``"train"``."""
    product: str | None = None
    """linear_product only: ``"forward"`` (the default there), ``"input_grad"`` or
    ``"weight_grad"``."""
    dtype: str | None = None
    """Optional: the dtype the target tensor must have (``"float32"``). Lets bits, fields and
    ``value_bits`` be checked on construction; a tensor of another dtype is refused."""

    def __post_init__(self) -> None:
        self._check_where()
        self._check_what()
        self._check_when()

    # -- static validation --------------------------------------------------------------
    def _check_where(self) -> None:
        if self.site not in SITES:
            raise FaultError("site", f"unknown site {self.site!r}; use one of {list(SITES)}.")
        if not _is_int(self.rank) or self.rank < 0:
            raise FaultError("rank", f"must be an int >= 0, got {self.rank!r}.")
        if not isinstance(self.target, str) or not self.target:
            what = "module" if self.site in MODULE_SITES else "parameter"
            raise FaultError(
                "target", f"must name a {what} of the model for site {self.site!r}, "
                f"got {self.target!r}."
            )
        if self.site == "optimizer_state":
            if not isinstance(self.state_key, str) or not self.state_key:
                raise FaultError(
                    "state_key", "site 'optimizer_state' needs the optimizer state entry to "
                    "corrupt, e.g. state_key='exp_avg' (Adam) or 'momentum_buffer' (SGD)."
                )
        elif self.state_key is not None:
            raise FaultError(
                "state_key", f"only applies to site 'optimizer_state', not {self.site!r}; "
                "drop it."
            )
        if self.site == "linear_product":
            if self.product is None:
                object.__setattr__(self, "product", "forward")
            elif self.product not in PRODUCTS:
                raise FaultError("product", f"unknown product {self.product!r}; use one of "
                                 f"{list(PRODUCTS)}.")
        elif self.product is not None:
            raise FaultError("product", f"only applies to site 'linear_product', not "
                             f"{self.site!r}; drop it.")
        if self.phase not in PHASES:
            raise FaultError("phase", f"unknown phase {self.phase!r}; use one of {list(PHASES)}.")
        if self.phase != "train" and self.site not in MODULE_SITES:
            raise FaultError(
                "phase", f"only activation sites see the replay audit's recomputations; a "
                f"{self.site} fault has no phase. Drop phase={self.phase!r}."
            )
        if self.index is not None and (not _is_int(self.index) or self.index < 0):
            raise FaultError("index", f"must be an int >= 0 or None (random), got {self.index!r}.")
        if not _is_int(self.burst) or self.burst < 1:
            raise FaultError(
                "burst", f"must be an int >= 1 (adjacent elements), got {self.burst!r}."
            )
        if self.dtype is not None:
            try:
                dtype_from_name(self.dtype)
            except ValueError as e:
                raise FaultError("dtype", str(e)) from None

    def _check_what(self) -> None:
        if self.kind not in KINDS:
            raise FaultError("kind", f"unknown kind {self.kind!r}; use one of {list(KINDS)}.")
        if self.burst_bits not in BURST_BITS:
            raise FaultError("burst_bits", f"unknown {self.burst_bits!r}; use one of "
                             f"{list(BURST_BITS)}.")
        if self.burst_bits == "each" and (self.kind not in BIT_KINDS or self.field is None):
            raise FaultError("burst_bits", "'each' draws each element's bits from a field: it "
                             "needs kind 'bitflip' or 'stuck' with field=... (bits=(...) are the "
                             "same in every element).")
        if self.along not in ALONG:
            raise FaultError("along", f"unknown {self.along!r}; use one of {list(ALONG)}.")
        if self.kind == "stuck":
            if self.stuck not in (0, 1) or isinstance(self.stuck, bool):
                raise FaultError("stuck", f"kind 'stuck' holds its bits at 0 or 1: give "
                                 f"stuck=0 or stuck=1, got {self.stuck!r}.")
        elif self.stuck is not None:
            raise FaultError("stuck", f"only applies to kind 'stuck', not {self.kind!r}; drop it.")
        if not isinstance(self.bits, tuple):
            if isinstance(self.bits, (list, range)):
                object.__setattr__(self, "bits", tuple(self.bits))
            elif _is_int(self.bits):
                object.__setattr__(self, "bits", (self.bits,))
            else:
                raise FaultError("bits", f"must be a tuple of bit indices, got {self.bits!r}.")
        uses_bits = bool(self.bits) or self.field is not None
        if self.kind in BIT_KINDS:
            if bool(self.bits) == (self.field is not None):
                raise FaultError(
                    "bits", f"a {self.kind} needs exactly one of bits=(b, ...) or "
                    "field='exponent' (with count=k, or None for every bit of the field)."
                )
        elif uses_bits:
            raise FaultError(
                "bits" if self.bits else "field",
                f"only applies to kinds 'bitflip' and 'stuck', not {self.kind!r}; drop it.",
            )
        for b in self.bits:
            if not _is_int(b) or not 0 <= b < 64:
                raise FaultError("bits", f"bit {b!r} is out of range: bits are 0..63 at most "
                                 "(0 = least significant).")
        if len(set(self.bits)) != len(self.bits):
            raise FaultError("bits", f"must be distinct, got {self.bits}.")
        if self.field is not None and self.field not in FIELDS:
            raise FaultError("field", f"unknown field {self.field!r}; use one of {sorted(FIELDS)}.")
        if self.count is not None and (not _is_int(self.count) or self.count < 1):
            raise FaultError(
                "count", f"must be an int >= 1 or None (every bit), got {self.count!r}."
            )
        if self.kind == "set":
            if (self.value is None) == (self.value_bits is None):
                raise FaultError(
                    "value", "kind 'set' needs exactly one of value=... (e.g. float('nan')) "
                    "or value_bits=... (a raw unsigned word)."
                )
            if self.value is not None and (
                isinstance(self.value, bool) or not isinstance(self.value, (int, float))
            ):
                raise FaultError("value", f"must be a number, got {self.value!r}.")
            vb = self.value_bits
            if vb is not None and (not _is_int(vb) or vb < 0):
                raise FaultError("value_bits", f"must be an unsigned int, got {self.value_bits!r}.")
        else:
            for name in ("value", "value_bits"):
                if getattr(self, name) is not None:
                    raise FaultError(name, f"only applies to kind 'set', not {self.kind!r}.")
        if self.dtype is not None:
            self.check_dtype(self.dtype)

    def _check_when(self) -> None:
        if not _is_int(self.step) or self.step < 0:
            raise FaultError("step", f"must be an int >= 0, got {self.step!r}.")
        if self.model not in MODELS:
            raise FaultError(
                "model", f"unknown fault model {self.model!r}; use one of {list(MODELS)}."
            )
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 < self.p <= 1:
            raise FaultError("p", f"must be a probability in (0, 1], got {self.p!r}.")
        if self.model != "intermittent" and self.p != 1:
            raise FaultError(
                "p", f"only applies to model 'intermittent'; a {self.model} fault fires "
                "deterministically. Drop p or use model='intermittent'."
            )
        if not _is_int(self.seed):
            raise FaultError("seed", f"must be an int, got {self.seed!r}.")

    def check_dtype(self, dtype_or_name: Any) -> None:
        """Refuse bits, fields, counts and raw words that a tensor of this dtype cannot hold."""
        name = dtype_or_name if isinstance(dtype_or_name, str) else str(dtype_or_name)
        try:
            dtype = dtype_from_name(name)
            lay = layout_of(dtype)
        except (ValueError, TypeError) as e:
            raise FaultError("target", f"the {self.site} target's dtype: {e}") from None
        where = f"{lay.width}-bit {name.removeprefix('torch.')}"
        if self.dtype is not None and dtype_from_name(self.dtype) != dtype:
            raise FaultError("dtype", f"the target tensor is {where}, not {self.dtype}.")
        for b in self.bits:
            if b >= lay.width:
                raise FaultError("bits", f"bit {b} is out of range for a {where}: use "
                                 f"0..{lay.width - 1}.")
        if self.field is not None:
            if self.field not in lay.fields:
                raise FaultError("field", f"a {where} has no field {self.field!r}; its fields are "
                                 f"{sorted(lay.fields)}.")
            size = len(lay.fields[self.field])
            if self.count is not None and self.count > size:
                raise FaultError("count", f"field {self.field!r} of a {where} has only {size} "
                                 f"bit(s), cannot flip {self.count}.")
        if self.value_bits is not None and self.value_bits >= 1 << lay.width:
            raise FaultError("value_bits", f"{self.value_bits:#x} does not fit a {where}.")

    def stride(self, shape: Sequence[int]) -> int:
        """The logical distance between a burst's elements in a tensor of ``shape``: 1 along a
        row; the last dimension's size along a column."""
        return int(shape[-1]) if self.along == "column" and len(shape) > 0 else 1

    def span(self, shape: Sequence[int]) -> int:
        """How many elements of a tensor of ``shape`` the burst reaches over, from ``index``."""
        return (self.burst - 1) * self.stride(shape) + 1

    # -- when it fires ----------------------------------------------------------------
    def active_at(self, step: int) -> bool:
        """Whether the fault fires at ``step`` on its rank (pure; the same in every process)."""
        if step < self.step:  # also every step < 0 (before the first step starts)
            return False
        if self.model == "transient":
            return step == self.step
        if self.model == "permanent":
            return True
        return seeded_rng(self.seed, self.rank, step, _FIRE).random() < self.p

    def where_rng(self) -> random.Random:
        """The RNG for the element index and field bits (seeded by ``(seed, rank)`` only)."""
        return seeded_rng(self.seed, self.rank, _WHERE)

    def value_rng(self, step: int) -> random.Random:
        """The RNG for ``kind="random"`` words at ``step``."""
        return seeded_rng(self.seed, self.rank, step, _VALUE)

    # -- plain data -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/TOML-friendly); ``Fault.from_dict`` reads it back."""
        d = asdict(self)
        d["bits"] = list(self.bits)
        if d["product"] is None:  # other sites: the dict (and every key made from it) as before
            del d["product"]
        for key, default in _DEFAULTS.items():
            if d[key] == default:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fault:
        """Build a fault from plain data (e.g. a TOML table); unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FaultError(unknown[0], f"unknown field(s) {unknown}; known fields are "
                             f"{sorted(known)}.")
        kw = dict(data)
        if "bits" in kw and isinstance(kw["bits"], list):
            kw["bits"] = tuple(kw["bits"])
        return cls(**kw)
