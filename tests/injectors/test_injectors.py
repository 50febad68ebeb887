"""The bit-level core (``injectors.bits``) and the fault record (``injectors.fault``)."""

from __future__ import annotations

import dataclasses
import pickle
import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from injectors import bits as B
from injectors.fault import KINDS, MODELS, SITES, Fault, FaultError

DTYPES = list(B.LAYOUTS)


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` with uniformly random bits (NaN payloads included)."""
    lay = B.layout_of(dtype)
    g = torch.Generator().manual_seed(seed)
    if lay.word == torch.uint8:
        words = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    else:
        info = torch.iinfo(lay.word)
        words = torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=g).to(lay.word)
    return words.view(dtype)


def _words(t: torch.Tensor) -> list[int]:
    """Unsigned words of ``t`` in logical row-major order."""
    lay = B.layout_of(t.dtype)
    return [v & ((1 << lay.width) - 1) for v in t.detach().reshape(-1).view(lay.word).tolist()]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Random dtype, shape (0-d to 3-d) and bits; half of them non-contiguous."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    t = _random_tensor(dtype, shape, draw(st.integers(0, 2**31)))
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, -1)
    elif t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]
    return t


@settings(max_examples=300, deadline=None)
@given(t=tensors(), data=st.data())
def test_flipping_twice_restores_and_exactly_the_named_bits_change(
    t: torch.Tensor, data: st.DataObject
) -> None:
    lay = B.layout_of(t.dtype)
    n = t.numel()
    burst = data.draw(st.integers(1, n))
    index = data.draw(st.integers(0, n - burst))
    bits = data.draw(st.lists(st.integers(0, lay.width - 1), min_size=1, max_size=4, unique=True))
    original = _words(t)
    change = B.flip_bits(t, index, bits, burst=burst)
    mask = sum(1 << b for b in bits)
    now = _words(t)
    for i, (a, b) in enumerate(zip(original, now, strict=True)):
        assert a ^ b == (mask if index <= i < index + burst else 0)
    assert change.before == tuple(original[index : index + burst])
    assert change.after == tuple(now[index : index + burst])
    assert change.flipped == (tuple(sorted(bits)),) * burst
    B.flip_bits(t, index, bits, burst=burst)
    assert _words(t) == original


@settings(max_examples=150, deadline=None)
@given(t=tensors(), data=st.data())
def test_value_faults_write_exactly_the_addressed_elements(
    t: torch.Tensor, data: st.DataObject
) -> None:
    lay = B.layout_of(t.dtype)
    n = t.numel()
    burst = data.draw(st.integers(1, n))
    index = data.draw(st.integers(0, n - burst))
    word = data.draw(st.integers(0, (1 << lay.width) - 1))
    original = _words(t)
    rng_seed = data.draw(st.integers(0, 1000))
    twin = random.Random(rng_seed)
    ops: list[tuple[Callable[[], B.BitChange], list[int]]] = [
        (lambda: B.set_bits(t, index, word, burst=burst), [word] * burst),
        (lambda: B.zero(t, index, burst=burst), [0] * burst),
        (lambda: B.random_bits(t, index, random.Random(rng_seed), burst=burst),
         [twin.getrandbits(lay.width) for _ in range(burst)]),
    ]
    for op, expect in ops:
        change = op()
        now = _words(t)
        assert list(change.after) == expect == now[index : index + burst]
        assert now[:index] == original[:index] and now[index + burst :] == original[index + burst :]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layout_partitions_its_word(dtype: torch.dtype) -> None:
    lay = B.layout_of(dtype)
    assert torch.empty(0, dtype=dtype).element_size() * 8 == lay.width
    assert torch.empty(0, dtype=lay.word).element_size() * 8 == lay.width
    named = [b for name, r in lay.fields.items() if name != "any" for b in r]
    assert sorted(named) == list(range(lay.width)) == list(lay.fields["any"])


@pytest.mark.parametrize(
    ("dtype", "one", "sign", "exponent", "mantissa"),
    [
        (torch.float32, 0x3F80_0000, 31, range(23, 31), range(0, 23)),
        (torch.float64, 0x3FF0_0000_0000_0000, 63, range(52, 63), range(0, 52)),
        (torch.float16, 0x3C00, 15, range(10, 15), range(0, 10)),
        (torch.bfloat16, 0x3F80, 15, range(7, 15), range(0, 7)),
    ],
)
def test_float_layouts_known_answers(
    dtype: torch.dtype, one: int, sign: int, exponent: range, mantissa: range
) -> None:
    lay = B.layout_of(dtype)
    assert lay.fields["sign"] == range(sign, sign + 1)
    assert lay.fields["exponent"] == exponent and lay.fields["mantissa"] == mantissa
    assert B.bits_of(1.0, dtype) == one
    assert B.value_of(one, dtype) == 1.0
    t = torch.tensor([1.0, 1.0, 1.0], dtype=dtype)
    B.flip_bits(t, 0, sign)  # sign bit: negate
    B.flip_bits(t, 1, exponent.start)  # exponent LSB of 1.0 (exponent = bias, odd): halve
    B.flip_bits(t, 2, mantissa.stop - 1)  # top mantissa bit: 1.5
    assert t.tolist() == [-1.0, 0.5, 1.5]
    B.set_value(t, 0, float("inf"), burst=3)
    assert torch.isinf(t).all()


def test_integer_layouts_known_answers() -> None:
    assert B.bits_of(-1, torch.int8) == 0xFF and B.bits_of(-1, torch.int64) == 2**64 - 1
    assert B.value_of(0x80, torch.int8) == -128 and B.value_of(0x80, torch.uint8) == 128
    t = torch.tensor([0, 5], dtype=torch.int32)
    B.flip_bits(t, 0, 31)
    B.flip_bits(t, 1, (0, 1))
    assert t.tolist() == [-(2**31), 6]
    assert "sign" not in B.layout_of(torch.uint8).fields


def test_non_contiguous_tensors_are_addressed_in_logical_order() -> None:
    base = torch.zeros(3, 4)
    view = base.t()  # shape (4, 3), element (i, j) is base[j, i]
    B.flip_bits(view, 4, 30, burst=2)  # logical elements 4 and 5: view[1, 1], view[1, 2]
    assert view[1, 1] == 2.0 and view[1, 2] == 2.0
    assert base[1, 1] == 2.0 and base[2, 1] == 2.0 and base.count_nonzero() == 2
    sliced = torch.zeros(10)[::3]
    B.set_value(sliced, 2, 7.0)
    assert sliced.tolist() == [0.0, 0.0, 7.0, 0.0]


def test_zero_dim_and_grad_requiring_tensors() -> None:
    s = torch.tensor(1.0)
    B.flip_bits(s, 0, 31)
    assert s.item() == -1.0
    p = torch.nn.Parameter(torch.ones(3))
    B.flip_bits(p, 1, 31)  # on a leaf that requires grad: through a detached view
    assert p.tolist() == [1.0, -1.0, 1.0] and p.requires_grad


def test_read_bits_does_not_write() -> None:
    t = torch.tensor([1.0, 2.0], dtype=torch.float16)
    assert B.read_bits(t, 0, burst=2) == (0x3C00, 0x4000)
    assert t.tolist() == [1.0, 2.0]


def test_bad_calls_are_refused_clearly() -> None:
    t = torch.zeros(4)
    with pytest.raises(IndexError, match="use 0 <= index <= 2"):
        B.flip_bits(t, 3, 0, burst=2)
    with pytest.raises(ValueError, match=r"bit 32 is out of range for float32: use 0\.\.31"):
        B.flip_bits(t, 0, 32)
    with pytest.raises(ValueError, match="distinct"):
        B.flip_bits(t, 0, (1, 1))
    with pytest.raises(ValueError, match="burst must be >= 1"):
        B.zero(t, 0, burst=0)
    with pytest.raises(TypeError, match=r"does not support dtype torch\.complex64"):
        B.flip_bits(torch.zeros(2, dtype=torch.complex64), 0, 0)
    with pytest.raises(TypeError, match=r"does not support dtype torch\.bool"):
        B.zero(torch.zeros(2, dtype=torch.bool), 0)
    with pytest.raises(TypeError, match="dense"):
        B.zero(torch.zeros(2, 2).to_sparse(), 0)
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*16\)"):
        B.set_bits(torch.zeros(2, dtype=torch.bfloat16), 0, 1 << 16)
    with pytest.raises(ValueError, match="no bit field 'exponent'"):
        B.choose_bits(torch.int32, "exponent", 1, random.Random(0))
    with pytest.raises(ValueError, match="supported dtypes"):
        B.dtype_from_name("float8")


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32), data=st.data())
def test_choose_bits_stays_in_its_field_and_is_reproducible(
    dtype: torch.dtype, seed: int, data: st.DataObject
) -> None:
    lay = B.layout_of(dtype)
    field = data.draw(st.sampled_from(sorted(lay.fields)))
    span = lay.fields[field]
    count = data.draw(st.integers(1, len(span)))
    chosen = B.choose_bits(dtype, field, count, random.Random(seed))
    assert len(set(chosen)) == count and all(b in span for b in chosen)
    assert chosen == B.choose_bits(dtype, field, count, random.Random(seed))
    assert B.choose_bits(dtype, field, None, random.Random(seed)) == tuple(span)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_take_the_same_path() -> None:
    t = torch.ones(1000, 3, device="cuda").t()
    change = B.flip_bits(t, 1500, (31, 23), burst=4)
    assert change.before == (0x3F80_0000,) * 4
    assert t.flatten()[1500:1504].tolist() == [-0.5] * 4 and t.sum().item() == 3000 - 6


# -- the fault record ---------------------------------------------------------------------
BASE = {"site": "weight_storage", "rank": 0, "step": 0, "target": "0.weight", "bits": (3,)}


@pytest.mark.parametrize(
    ("changes", "field", "hint"),
    [
        ({"site": "weights"}, "site", "use one of"),
        ({"step": -1}, "step", ">= 0"),
        ({"rank": -2}, "rank", ">= 0"),
        ({"target": ""}, "target", "parameter"),
        ({"model": "sometimes"}, "model", "transient"),
        ({"kind": "flip"}, "kind", "bitflip"),
        ({"model": "intermittent", "p": 0.0}, "p", "(0, 1]"),
        ({"model": "intermittent", "p": 1.5}, "p", "(0, 1]"),
        ({"p": 0.5}, "p", "only applies to model 'intermittent'"),
        ({"bits": (64,)}, "bits", "0..63"),
        ({"bits": (2, 2)}, "bits", "distinct"),
        ({"bits": ()}, "bits", "exactly one of"),
        ({"field": "exponent"}, "bits", "exactly one of"),
        ({"bits": (), "field": "exponant"}, "field", "unknown field"),
        ({"bits": (), "field": "exponent", "count": 0}, "count", ">= 1"),
        ({"kind": "zero"}, "bits", "only applies to kinds 'bitflip' and 'stuck'"),
        ({"burst_bits": "some"}, "burst_bits", "use one of"),
        ({"burst_bits": "each"}, "burst_bits", "needs kind 'bitflip' or 'stuck' with field"),
        ({"along": "diagonal"}, "along", "use one of"),
        ({"kind": "stuck"}, "stuck", "stuck=0 or stuck=1"),
        ({"kind": "stuck", "stuck": 2}, "stuck", "stuck=0 or stuck=1"),
        ({"stuck": 1}, "stuck", "only applies to kind 'stuck'"),
        ({"kind": "stuck", "stuck": 0, "bits": ()}, "bits", "a stuck needs exactly one of"),
        ({"kind": "set", "bits": ()}, "value", "exactly one of"),
        ({"kind": "set", "bits": (), "value": 1.0, "value_bits": 3}, "value", "exactly one"),
        ({"kind": "random", "bits": (), "value": 1.0}, "value", "only applies to kind 'set'"),
        ({"burst": 0}, "burst", ">= 1"),
        ({"index": -1}, "index", ">= 0"),
        ({"state_key": "exp_avg"}, "state_key", "only applies to site 'optimizer_state'"),
        ({"site": "optimizer_state"}, "state_key", "exp_avg"),
        ({"phase": "replay"}, "phase", "only activation sites"),
        ({"site": "activation", "target": "0", "phase": "eval"}, "phase", "unknown phase"),
        ({"dtype": "float8"}, "dtype", "supported dtypes"),
        ({"dtype": "float16", "bits": (16,)}, "bits", "out of range for a 16-bit float16"),
        ({"dtype": "int8", "bits": (), "field": "exponent"}, "field", "has no field"),
        ({"dtype": "bfloat16", "bits": (), "field": "mantissa", "count": 8}, "count",
         "only 7 bit(s)"),
        ({"dtype": "uint8", "bits": (), "kind": "set", "value_bits": 256}, "value_bits",
         "does not fit"),
    ],
)
def test_bad_faults_are_refused_naming_the_field(
    changes: dict[str, object], field: str, hint: str
) -> None:
    with pytest.raises(FaultError, match=rf"^Fault\.{field}: .*{_re(hint)}") as info:
        Fault(**{**BASE, **changes})  # type: ignore[arg-type]
    assert info.value.field == field
    assert isinstance(info.value, ValueError)
    again = pickle.loads(pickle.dumps(info.value))  # errors cross process boundaries intact
    assert (again.field, str(again)) == (field, str(info.value))


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_a_fault_is_a_frozen_record_that_round_trips_as_plain_data() -> None:
    f = Fault(site="optimizer_state", rank=2, step=5, target="fc.weight", state_key="exp_avg",
              field="exponent", count=None, model="intermittent", p=0.25, seed=9, burst=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.step = 6  # type: ignore[misc]
    assert Fault.from_dict(f.to_dict()) == f
    g = Fault.from_dict({**BASE, "bits": [1, 2]})  # lists from TOML/JSON become tuples
    assert g.bits == (1, 2) and hash(g) == hash(Fault(**{**BASE, "bits": (1, 2)}))  # type: ignore[arg-type]
    with pytest.raises(FaultError, match="unknown field"):
        Fault.from_dict({**BASE, "bit": 3})
    assert set(SITES) == {"activation", "activation_grad", "gradient_before_allreduce",
                          "gradient_after_allreduce", "optimizer_state", "weight_storage",
                          "linear_product"}
    assert MODELS == ("transient", "intermittent", "permanent")
    assert KINDS == ("bitflip", "set", "random", "zero", "stuck")
    # the fields added later are left out of the dict at their defaults (every key made from
    # an earlier fault's dict stays as it was), and round-trip when set
    assert not {"burst_bits", "along", "stuck"} & set(f.to_dict())
    h = Fault(**{**BASE, "bits": (), "field": "exponent", "kind": "stuck", "stuck": 1,  # type: ignore[arg-type]
                 "burst": 4, "burst_bits": "each", "along": "column"})
    assert Fault.from_dict(h.to_dict()) == h and h.to_dict()["along"] == "column"


def test_fault_models_fire_when_they_say() -> None:
    kw = {**BASE, "step": 3}
    transient = Fault(**kw)  # type: ignore[arg-type]
    permanent = Fault(**kw, model="permanent")  # type: ignore[arg-type]
    assert [s for s in range(10) if transient.active_at(s)] == [3]
    assert [s for s in range(10) if permanent.active_at(s)] == list(range(3, 10))
    inter = Fault(**kw, model="intermittent", p=0.5, seed=4)  # type: ignore[arg-type]
    fired = [s for s in range(3, 4003) if inter.active_at(s)]
    assert 1800 < len(fired) < 2200 and not inter.active_at(2)
    again = Fault(**kw, model="intermittent", p=0.5, seed=4)  # type: ignore[arg-type]
    assert fired == [s for s in range(3, 4003) if again.active_at(s)]  # reproducible
    other_rank = dataclasses.replace(inter, rank=1)
    assert fired != [s for s in range(3, 4003) if other_rank.active_at(s)]
    always = Fault(**kw, model="intermittent", p=1.0)  # type: ignore[arg-type]
    assert all(always.active_at(s) for s in range(3, 100))


def test_a_column_burst_touches_one_place_in_consecutive_rows() -> None:
    t = torch.zeros(4, 5)
    change = B.flip_bits(t, 2, (31,), burst=3, stride=5)  # column 2 of rows 0..2
    assert change.stride == 5 and change.flipped == ((31,),) * 3
    changed = (t.view(torch.int32) != 0).nonzero().tolist()
    assert [(r, c) for r, c in changed] == [(0, 2), (1, 2), (2, 2)]
    assert all(str(v) == "-0.0" for v in t[:3, 2].tolist())
    B.flip_bits(t, 2, (31,), burst=3, stride=5)
    assert torch.equal(t.view(torch.int32), torch.zeros(4, 5, dtype=torch.int32))
    with pytest.raises(IndexError, match=r"use 0 <= index <= 9"):
        B.flip_bits(t, 10, (0,), burst=3, stride=5)  # rows 2..4: no row 4


def test_each_element_of_a_burst_can_take_its_own_bits() -> None:
    t = torch.randn(8, generator=torch.Generator().manual_seed(0))
    before = t.clone()
    change = B.flip_each(t, 2, [(30,), (1, 5), (22,)])
    assert change.flipped == ((30,), (1, 5), (22,))
    assert torch.equal(t[:2], before[:2]) and torch.equal(t[5:], before[5:])
    B.flip_each(t, 2, [(30,), (1, 5), (22,)])
    assert torch.equal(t.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_a_stuck_bit_changes_only_the_elements_that_held_the_other_value(
        dtype: torch.dtype) -> None:
    lay = B.layout_of(dtype)
    top = lay.width - 1  # the sign bit
    words = [0, 1 << top, 3, (1 << top) | 3]
    t = torch.tensor([B._to_storage(w, lay) for w in words], dtype=lay.word).view(dtype)
    set_ = B.stick_bits(t.clone(), 0, (top,), 1, burst=4)
    assert set_.flipped == ((top,), (), (top,), ())
    clear = B.stick_bits(t.clone(), 0, (top, 0), 0, burst=4)
    assert clear.flipped == ((), (top,), (0,), (0, top))
    with pytest.raises(ValueError, match="0 or 1"):
        B.stick_bits(t, 0, (0,), 2)
