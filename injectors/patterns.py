"""Named shapes of field faults: what a campaign's ``patterns`` axis draws from.

Each pattern is a set of ``Fault`` fields laid over a one-bit fault (``site``, ``target``,
``field``, ``step``, ``rank`` and ``model`` come from the campaign's other axes), with the
study or the hardware structure its shape comes from (docs/harness.md, "Shapes of field
faults"). ``single`` adds nothing: a campaign without the axis plans exactly the trials it
planned before it existed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

BURST: Final = 8
"""Lanes of a burst or a column: the float32 lanes of a 256-bit vector unit (AVX2, one
NEON pair), and the rows of a small systolic array's column."""


@dataclass(frozen=True, slots=True)
class Pattern:
    """One shape of a field fault."""

    name: str
    fields: Mapping[str, Any]
    """``Fault`` fields set over the one-bit fault the other axes describe."""
    source: str
    """Where the shape comes from: a study, or the hardware structure it imitates."""
    bit_field: bool = True
    """Does it use the trial's bit field (sign / exponent / mantissa / any)? A pattern that
    replaces whole values does not."""
    model: str | None = None
    """The fault model it forces (a stuck lane stays stuck), or None: the trial's."""

    @property
    def span(self) -> tuple[int, str]:
        """``(elements, "row" | "column")``: how many elements it reaches and along what."""
        return int(self.fields.get("burst", 1)), str(self.fields.get("along", "row"))


def _p(name: str, source: str, **fields: Any) -> Pattern:
    bit_field = fields.pop("bit_field", True)
    model = fields.pop("model", None)
    return Pattern(name, MappingProxyType(fields), source, bit_field, model)


PATTERNS: Final[Mapping[str, Pattern]] = MappingProxyType({p.name: p for p in (
    _p("single", "one flipped bit: the single-event upset every earlier campaign injects"),
    _p("multi_bit", "three bits of one word: multi-bit errors in one word, reported by "
       "RTL-level injection into GPU datapaths (LLM-PRISM, arXiv 2604.10390) and by "
       "defective processors in the field (arXiv 2502.12340)", field="any", count=3),
    _p("burst_same", f"the same bit wrong in {BURST} neighbouring lanes: one bit slice of a "
       "vector unit, shared by its lanes", burst=BURST, burst_bits="same"),
    _p("burst_random", f"{BURST} neighbouring lanes, each wrong at its own bit: a multi-bit "
       "upset spread across adjacent words of a register file or word line", burst=BURST,
       burst_bits="each"),
    _p("column", f"one column wrong by the same bit in {BURST} rows: a broken lane of a "
       "matrix unit (a systolic array's column) computes every row's value there",
       burst=BURST, along="column", burst_bits="same"),
    _p("whole_value", "a whole value replaced by random bits: a wrong multiply-accumulate "
       "result (arXiv 2502.12340 traces SDC to single faulty MAC units)", kind="random",
       bit_field=False),
    _p("stuck", "one bit stuck at 1 from its first step on: a stuck-at cell of a register "
       "or lane (wrong only where the data holds 0 there)", kind="stuck", stuck=1,
       model="permanent"),
)})
"""Every pattern by name."""


def pattern_fields(name: str, fault: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Fault`` keyword arguments of a one-bit ``fault`` (its keywords) in pattern
    ``name``. A value fault (``kind="set"``: NaN, Inf) takes only the pattern's span."""
    p = PATTERNS[name]
    out = dict(fault)
    if out.get("kind", "bitflip") == "set":
        out.update({k: v for k, v in p.fields.items() if k in ("burst", "along")})
        return out
    out.update(p.fields)
    if not p.bit_field:
        out.pop("field", None)
    if p.model is not None:
        out["model"] = p.model
        out.pop("p", None)
    return out
