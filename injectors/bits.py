"""Bit-level corruption of tensor elements, in place, by reinterpreting the storage.

Every supported dtype is read through an integer view of the same width
(``t.view(torch.int32)`` for float32, ``torch.int16`` for float16 and
bfloat16, ...): a bit flip is an XOR on that integer word, a value fault is a
write of a whole word. Nothing goes through strings or Python floats, and the
code is the same on CPU and CUDA (one gather, one scatter and one small
host transfer per call, whatever the tensor's size).

Bit numbering: **bit 0 is the least significant bit** of the element's word;
bit ``width - 1`` is the sign bit of signed and floating-point dtypes. For
float32 the sign is bit 31, the exponent bits 23..30 and the mantissa bits
0..22 (IEEE 754 binary32).

Element numbering: ``index`` is the element's position in the tensor's
logical row-major order (what ``t.flatten()[index]`` would be), whatever the
strides, so non-contiguous tensors (transposes, slices) are corrupted at the
element a reader of the tensor sees. A burst of length ``n`` covers the
logically adjacent elements ``index .. index + n - 1``, or with a ``stride``
the elements ``index, index + stride, ..., index + (n - 1) * stride`` (a
column of a matrix: ``stride`` its row length).

Raw bits are returned as unsigned Python ints (``0 <= word < 2**width``) in
``BitChange.before`` / ``BitChange.after``: the ground truth an injector
records.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import torch

__all__ = [
    "FIELDS",
    "LAYOUTS",
    "BitChange",
    "BitLayout",
    "bits_of",
    "choose_bits",
    "dtype_from_name",
    "dtype_name",
    "flip_bits",
    "flip_each",
    "layout_of",
    "random_bits",
    "read_bits",
    "set_bits",
    "set_value",
    "stick_bits",
    "value_of",
    "zero",
]


@dataclass(frozen=True, slots=True)
class BitLayout:
    """How one dtype's elements are laid out as integer words."""

    dtype: torch.dtype
    """The tensor dtype this layout describes."""
    word: torch.dtype
    """The integer dtype of the same width the storage is reinterpreted as."""
    width: int
    """Bits per element."""
    fields: MappingProxyType[str, range]
    """Named bit ranges (bit 0 = least significant). Every layout has ``"any"`` (all bits)."""

    @property
    def signed_word(self) -> bool:
        """Whether ``word`` is a signed integer dtype (every word dtype but uint8)."""
        return self.word != torch.uint8

    def field(self, name: str) -> range:
        """The bit range of a named field; ``ValueError`` naming the valid fields otherwise."""
        try:
            return self.fields[name]
        except KeyError:
            raise ValueError(
                f"{dtype_name(self.dtype)} has no bit field {name!r}; its fields are "
                f"{sorted(self.fields)}."
            ) from None


def _layout(dtype: torch.dtype, word: torch.dtype, width: int, **fields: range) -> BitLayout:
    return BitLayout(dtype, word, width, MappingProxyType({**fields, "any": range(width)}))


def _float(dtype: torch.dtype, word: torch.dtype, width: int, mantissa: int) -> BitLayout:
    return _layout(dtype, word, width, sign=range(width - 1, width),
                   exponent=range(mantissa, width - 1), mantissa=range(0, mantissa))


def _signed(dtype: torch.dtype, width: int) -> BitLayout:
    return _layout(dtype, dtype, width, sign=range(width - 1, width), value=range(0, width - 1))


LAYOUTS: Final[MappingProxyType[torch.dtype, BitLayout]] = MappingProxyType({
    torch.float32: _float(torch.float32, torch.int32, 32, 23),
    torch.float64: _float(torch.float64, torch.int64, 64, 52),
    torch.float16: _float(torch.float16, torch.int16, 16, 10),
    torch.bfloat16: _float(torch.bfloat16, torch.int16, 16, 7),
    torch.int8: _signed(torch.int8, 8),
    torch.int16: _signed(torch.int16, 16),
    torch.int32: _signed(torch.int32, 32),
    torch.int64: _signed(torch.int64, 64),
    torch.uint8: _layout(torch.uint8, torch.uint8, 8, value=range(0, 8)),
})
"""dtype -> layout. Floats have fields sign / exponent / mantissa; signed integers sign /
value (two's complement); uint8 has value. Every layout also has ``"any"``."""

FIELDS: Final[frozenset[str]] = frozenset(f for lay in LAYOUTS.values() for f in lay.fields)
"""Every field name some supported dtype has."""

_BY_NAME: Final[dict[str, torch.dtype]] = {str(d).removeprefix("torch."): d for d in LAYOUTS}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling used in fault records)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` (or ``"torch.float32"``) -> ``torch.float32``, for supported dtypes only."""
    key = name.removeprefix("torch.")
    if key not in _BY_NAME:
        raise ValueError(
            f"dtype {name!r} is not supported; supported dtypes are {sorted(_BY_NAME)}."
        )
    return _BY_NAME[key]


def layout_of(dtype: torch.dtype) -> BitLayout:
    """The layout of a supported dtype; ``TypeError`` listing the supported ones otherwise."""
    lay = LAYOUTS.get(dtype)
    if lay is None:
        raise TypeError(
            f"bit-level injection does not support dtype {dtype}; supported dtypes are "
            f"{sorted(_BY_NAME)}."
        )
    return lay


@dataclass(frozen=True, slots=True)
class BitChange:
    """What one call changed: the raw words of ``burst`` elements before and after."""

    dtype: torch.dtype
    index: int
    """Logical (row-major) index of the first element touched."""
    before: tuple[int, ...]
    """Unsigned raw words of elements ``index, index + stride, ...`` before the call."""
    after: tuple[int, ...]
    """Unsigned raw words after the call."""
    stride: int = 1
    """Logical distance between the elements touched (1: adjacent)."""

    @property
    def flipped(self) -> tuple[tuple[int, ...], ...]:
        """For each element, the bit indices that differ between before and after."""
        return tuple(
            tuple(b for b in range((x ^ y).bit_length()) if (x ^ y) >> b & 1)
            for x, y in zip(self.before, self.after, strict=True)
        )


# -- word conversions -------------------------------------------------------------------
def _to_storage(word: int, lay: BitLayout) -> int:
    """An unsigned word -> the integer the word dtype stores for it (two's complement)."""
    if lay.signed_word and word >= 1 << (lay.width - 1):
        return word - (1 << lay.width)
    return word


def _to_unsigned(v: int, lay: BitLayout) -> int:
    return v & ((1 << lay.width) - 1)


def bits_of(value: float | int | bool, dtype: torch.dtype) -> int:
    """The unsigned raw word of ``value`` converted (by torch) to ``dtype``."""
    lay = layout_of(dtype)
    word = torch.tensor([value], dtype=dtype).view(lay.word)
    return _to_unsigned(int(word[0]), lay)


def value_of(word: int, dtype: torch.dtype) -> float | int:
    """The ``dtype`` value whose raw bits are the unsigned ``word``."""
    lay = layout_of(dtype)
    _check_word(word, lay)
    t = torch.tensor([_to_storage(word, lay)], dtype=lay.word).view(dtype)
    return t[0].item()


def _check_word(word: int, lay: BitLayout) -> None:
    if isinstance(word, bool) or not isinstance(word, int) or not 0 <= word < 1 << lay.width:
        raise ValueError(
            f"a raw {dtype_name(lay.dtype)} word must be an int in [0, 2**{lay.width}), "
            f"got {word!r}."
        )


# -- addressing -------------------------------------------------------------------------
def _words_and_positions(
    t: torch.Tensor, index: int, burst: int, stride: int = 1
) -> tuple[BitLayout, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The integer view of ``t`` and the advanced index of elements ``index``, ``index +
    stride``, ... (``burst`` of them)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}.")
    if t.layout != torch.strided:
        raise TypeError(f"only dense (strided) tensors can be corrupted, got layout {t.layout}.")
    lay = layout_of(t.dtype)
    for name, v in (("index", index), ("burst", burst), ("stride", stride)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}.")
    if burst < 1:
        raise ValueError(f"burst must be >= 1 (number of adjacent elements), got {burst}.")
    if stride < 1:
        raise ValueError(f"stride must be >= 1 (1: adjacent elements), got {stride}.")
    n = t.numel()
    span = (burst - 1) * stride + 1
    if index < 0 or index + span > n:
        raise IndexError(
            f"elements {index}..{index + span - 1} are out of range for a tensor of "
            f"{n} element(s) (shape {tuple(t.shape)}); use 0 <= index <= {n - span}."
        )
    # A same-width dtype view is legal for any strides; it shares the storage.
    words = t.detach().view(lay.word)
    if words.dim() == 0:
        words = words.unsqueeze(0)
    flat = torch.arange(index, index + span, stride, device=t.device)
    return lay, words, torch.unravel_index(flat, words.shape)


def _rewrite(
    t: torch.Tensor, index: int, burst: int, op: Callable[[torch.Tensor], torch.Tensor],
    stride: int = 1,
) -> BitChange:
    """Replace the words of the addressed elements by ``op(words)``; return before/after."""
    lay, words, pos = _words_and_positions(t, index, burst, stride)
    with torch.no_grad():
        before = words[pos]
        after = op(before)
        words.index_put_(pos, after)
        both = torch.stack((before, after)).tolist()  # the one host transfer
    return BitChange(
        dtype=t.dtype,
        index=index,
        before=tuple(_to_unsigned(v, lay) for v in both[0]),
        after=tuple(_to_unsigned(v, lay) for v in both[1]),
        stride=stride,
    )


def _check_bits(bits: Sequence[int], lay: BitLayout) -> tuple[int, ...]:
    out = tuple(bits)
    if not out:
        raise ValueError("bits must name at least one bit index.")
    for b in out:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < lay.width:
            raise ValueError(
                f"bit {b!r} is out of range for {dtype_name(lay.dtype)}: use 0..{lay.width - 1} "
                "(bit 0 = least significant)."
            )
    if len(set(out)) != len(out):
        raise ValueError(f"bits must be distinct, got {out}.")
    return out


# -- the operations ---------------------------------------------------------------------
def _mask(bits: Sequence[int], lay: BitLayout) -> int:
    """The word with ``bits`` set, as the word dtype stores it."""
    mask = 0
    for b in _check_bits(bits, lay):
        mask |= 1 << b
    return _to_storage(mask, lay)


def flip_bits(
    t: torch.Tensor, index: int, bits: int | Sequence[int], *, burst: int = 1,
    stride: int = 1,
) -> BitChange:
    """XOR the given bits of ``burst`` elements of ``t`` from ``index`` on (``stride`` apart),
    in place.

    Flipping the same bits again restores the tensor exactly.
    """
    mask = _mask((bits,) if isinstance(bits, int) else bits, layout_of(t.dtype))
    return _rewrite(t, index, burst, lambda w: w ^ torch.tensor(mask, dtype=w.dtype,
                                                                 device=w.device), stride)


def flip_each(
    t: torch.Tensor, index: int, bits: Sequence[Sequence[int]], *, stride: int = 1
) -> BitChange:
    """XOR bits of ``len(bits)`` elements from ``index`` on (``stride`` apart), each element
    its own: element ``j`` gets ``bits[j]`` flipped. Flipping again restores them."""
    lay = layout_of(t.dtype)
    masks = [_mask(b, lay) for b in bits]
    if not masks:
        raise ValueError("flip_each needs the bits of at least one element.")
    new = torch.tensor(masks, dtype=lay.word)
    return _rewrite(t, index, len(masks), lambda w: w ^ new.to(w.device), stride)


def stick_bits(
    t: torch.Tensor, index: int, bits: int | Sequence[int], value: int, *, burst: int = 1,
    stride: int = 1,
) -> BitChange:
    """Hold the given bits of ``burst`` elements from ``index`` on (``stride`` apart) at
    ``value`` (0 or 1), in place: a stuck-at fault, which changes only the elements whose
    bit held the other value."""
    if value not in (0, 1) or isinstance(value, bool):
        raise ValueError(f"a stuck bit holds 0 or 1, got {value!r}.")
    mask = _mask((bits,) if isinstance(bits, int) else bits, layout_of(t.dtype))
    if value:
        return _rewrite(t, index, burst, lambda w: w | torch.tensor(mask, dtype=w.dtype,
                                                                     device=w.device), stride)
    return _rewrite(t, index, burst, lambda w: w & ~torch.tensor(mask, dtype=w.dtype,
                                                                  device=w.device), stride)


def set_bits(
    t: torch.Tensor, index: int, words: int | Sequence[int], *, burst: int = 1,
    stride: int = 1,
) -> BitChange:
    """Overwrite the raw words of ``burst`` elements (``stride`` apart): one word for all, or
    one per element."""
    lay = layout_of(t.dtype)
    seq = [words] * burst if isinstance(words, int) else list(words)
    if len(seq) != burst:
        raise ValueError(f"set_bits got {len(seq)} word(s) for a burst of {burst} element(s).")
    for w in seq:
        _check_word(w, lay)
    new = torch.tensor([_to_storage(w, lay) for w in seq], dtype=lay.word)
    return _rewrite(t, index, burst, lambda w: new.to(w.device), stride)


def set_value(t: torch.Tensor, index: int, value: float | int, *, burst: int = 1,
              stride: int = 1) -> BitChange:
    """Set ``burst`` elements to ``value`` converted to ``t.dtype`` (``nan``, ``inf`` allowed)."""
    return set_bits(t, index, bits_of(value, t.dtype), burst=burst, stride=stride)


def zero(t: torch.Tensor, index: int, *, burst: int = 1, stride: int = 1) -> BitChange:
    """Set ``burst`` elements to all-zero bits (+0.0 for floats)."""
    return set_bits(t, index, 0, burst=burst, stride=stride)


def random_bits(t: torch.Tensor, index: int, rng: random.Random, *, burst: int = 1,
                stride: int = 1) -> BitChange:
    """Set ``burst`` elements to uniformly random words drawn from ``rng`` (reproducible)."""
    width = layout_of(t.dtype).width
    return set_bits(t, index, [rng.getrandbits(width) for _ in range(burst)], burst=burst,
                    stride=stride)


def read_bits(t: torch.Tensor, index: int, *, burst: int = 1,
              stride: int = 1) -> tuple[int, ...]:
    """The unsigned raw words of ``burst`` elements from ``index`` on, ``stride`` apart
    (nothing is written)."""
    lay, words, pos = _words_and_positions(t, index, burst, stride)
    return tuple(_to_unsigned(v, lay) for v in words[pos].tolist())


def choose_bits(
    dtype: torch.dtype, field: str, count: int | None, rng: random.Random
) -> tuple[int, ...]:
    """``count`` distinct bits of a named field, drawn with ``rng``; ``None`` = every bit.

    The result is sorted, so it reads the same in every record.
    """
    span = layout_of(dtype).field(field)
    if count is None:
        return tuple(span)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(span):
        raise ValueError(
            f"count must be an int in 1..{len(span)} for field {field!r} of "
            f"{dtype_name(dtype)} (or None for every bit), got {count!r}."
        )
    return tuple(sorted(rng.sample(span, count)))
