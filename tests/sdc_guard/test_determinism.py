"""``rng_stream``: each (seed, rank, step, micro-batch) its own random stream, and the caller's
generator state back afterwards, whatever the block did."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sdc_guard.determinism import rng_stream, stream_seed

CPU = torch.device("cpu")


def test_stream_is_the_generator_seeded_with_stream_seed() -> None:
    with rng_stream(7, 1, 3, 0, CPU):
        got = torch.rand(64)
    want = torch.rand(64, generator=torch.Generator().manual_seed(stream_seed(7, 1, 3, 0)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("other", [(8, 1, 3, 0), (7, 2, 3, 0), (7, 1, 4, 0), (7, 1, 3, 1)])
def test_each_key_draws_its_own_stream(other: tuple[int, int, int, int]) -> None:
    with rng_stream(7, 1, 3, 0, CPU):
        a = torch.rand(64)
    with rng_stream(*other, CPU):
        b = torch.rand(64)
    assert not torch.equal(a, b)


def test_the_callers_state_comes_back_even_when_the_block_raises() -> None:
    torch.manual_seed(123)
    torch.rand(5)
    before = torch.get_rng_state()
    expected = torch.rand(16)
    torch.set_rng_state(before)
    with pytest.raises(RuntimeError, match="inside"), rng_stream(7, 1, 3, 0, CPU):
        torch.rand(1000)
        raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), before)
    with rng_stream(7, 1, 3, 0, CPU):
        with rng_stream(7, 1, 3, 1, CPU):  # nested: each restores its caller's state
            torch.rand(3)
        torch.rand(3)
    assert torch.equal(torch.rand(16), expected)


def test_the_compute_signature_names_what_decides_a_cpu_ranks_bits() -> None:
    from sdc_guard.determinism import compute_signature

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compute_signature(CPU)
        torch.set_num_threads(2)
        two = compute_signature(CPU)
    finally:
        torch.set_num_threads(before)
    assert one["CPU threads"] == "1" and two["CPU threads"] == "2"
    assert one["torch build"] == torch.__version__
    assert one["CPU instruction set"] == torch.backends.cpu.get_cpu_capability()
    assert {k: v for k, v in one.items() if k != "CPU threads"} == {
        k: v for k, v in two.items() if k != "CPU threads"}


def test_a_signature_mismatch_names_each_value_its_ranks_and_the_fix() -> None:
    from sdc_guard.determinism import signature_mismatch

    alike = {"torch build": "2.13.0+cpu", "CPU threads": "4"}
    assert signature_mismatch([alike] * 3) is None
    assert signature_mismatch([]) is None
    got = signature_mismatch([alike, {**alike, "CPU threads": "8"}, alike,
                              {**alike, "torch build": "2.12.1+cpu"}])
    assert got is not None
    assert ("CPU threads: 4 (ranks 0, 2, 3) vs 8 (rank 1); fix: the same thread count on "
            "every rank") in got, got
    assert "torch build: 2.13.0+cpu (ranks 0, 1, 2) vs 2.12.1+cpu (rank 3); fix: one " in got
    assert "CPU instruction set" not in got  # only what differs


def test_python_and_numpy_global_generators_get_the_stream_and_come_back() -> None:
    import random

    import numpy as np

    random.seed(5)
    np.random.seed(5)
    before = (random.random(), float(np.random.uniform()))
    random.seed(5)
    np.random.seed(5)
    draws = []
    for key in ((7, 1, 3, 0), (7, 1, 3, 0), (7, 2, 3, 0)):
        with rng_stream(*key, CPU):
            draws.append((random.random(), float(np.random.uniform())))
    assert draws[0] == draws[1] != draws[2]  # per key, not the caller's
    assert (random.random(), float(np.random.uniform())) == before  # the caller's, untouched


def test_module_state_kept_puts_plain_attributes_back() -> None:
    from torch import nn

    from sdc_guard.determinism import module_state_kept, state_tensors_written

    outer = nn.Sequential(nn.Linear(2, 2))
    inner: Any = outer[0]
    inner.calls, inner.phase, inner.cache = 3, "warm", torch.zeros(1)
    with module_state_kept(outer):
        inner.calls += 1
        inner.phase = "hot"
        inner.added = 7  # a plain attribute a forward adds: gone after
        inner.cache = torch.ones(1)  # a tensor rebound: the old one back
        outer.train(False)  # `training` is plain too: back to True
    assert (inner.calls, inner.phase, outer.training) == (3, "warm", True)
    assert not hasattr(inner, "added") and float(inner.cache) == 0.0
    kept = inner.cache
    # Which tensors a forward writes in place is learned on the first recomputation (the one
    # above, which rebound it): one first written in place later keeps that update once...
    with module_state_kept(outer):
        inner.cache += 5
    assert inner.cache is kept and float(kept) == 5.0
    with module_state_kept(outer):  # ... and is copied before the next ones, and put back
        inner.cache.add_(2)
    assert inner.cache is kept and float(kept) == 5.0
    assert state_tensors_written(outer) == ["0.cache"]
    fresh: Any = nn.Linear(2, 2)
    fresh.count = torch.zeros(())
    with module_state_kept(fresh):  # written in place on the first recomputation: put back
        fresh.count += 1
    assert float(fresh.count) == 0.0

    inner.lazy = 1  # created by a training forward after the first recomputation
    with module_state_kept(outer):
        inner.lazy += 1
    assert inner.lazy == 1
    inner.gen = torch.Generator().manual_seed(3)  # a generator of its own: its state back
    first = torch.rand(4, generator=torch.Generator().manual_seed(3))
    with module_state_kept(outer):
        torch.rand(4, generator=inner.gen)
    assert torch.equal(torch.rand(4, generator=inner.gen), first)


def test_a_large_tensor_attribute_is_not_copied_before_it_is_known_to_be_written(
        monkeypatch: Any, caplog: Any) -> None:
    from torch import nn

    from sdc_guard import determinism

    monkeypatch.setattr(determinism, "FIRST_COPY_LIMIT", 16)
    m: Any = nn.Linear(2, 2)
    m.table = torch.zeros(8)  # 32 bytes: over the limit
    m.small = torch.zeros(2)
    with caplog.at_level("WARNING"), determinism.module_state_kept(m):
        m.table += 1
        m.small += 1
    assert float(m.table[0]) == 1.0 and float(m.small[0]) == 0.0
    assert "Linear.table" in caplog.text and "small" not in caplog.text
    with determinism.module_state_kept(m):  # known now: copied, and put back
        m.table += 1
    assert float(m.table[0]) == 1.0


def test_module_state_kept_puts_containers_back_in_place() -> None:
    import collections

    from torch import nn

    from sdc_guard.determinism import module_state_kept

    m: Any = nn.Linear(2, 2)
    t = torch.zeros(1)
    m.log, m.cache, m.seen = [1.0], {"a": t}, {3}
    m.window = collections.deque([1, 2], maxlen=2)
    log, cache, window = m.log, m.cache, m.window
    with module_state_kept(m):
        m.log.append(2.0)  # appended, changed, added, dropped: the same objects, refilled
        m.cache["b"] = torch.ones(1)
        del m.cache["a"]
        m.seen.add(4)
        m.window.append(3)
        m.extra = []  # a container a forward adds: gone after
    assert m.log is log and log == [1.0]
    assert m.cache is cache and list(cache) == ["a"] and cache["a"] is t
    assert m.seen == {3} and m.window is window and list(window) == [1, 2]
    assert window.maxlen == 2 and not hasattr(m, "extra")
    with module_state_kept(m):
        m.log = []  # rebound: the old list back
        cache["a"] = torch.ones(1)  # another tensor under the same key: the old one back
    assert m.log is log and log == [1.0] and m.cache["a"] is t
    nested: Any = nn.Linear(2, 2)
    nested.groups = {"x": [1]}
    with module_state_kept(nested):
        nested.groups["x"].append(2)  # inside an item: not followed (the top level only)
    assert nested.groups == {"x": [1, 2]}
