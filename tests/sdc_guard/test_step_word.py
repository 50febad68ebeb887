"""The one-word fast path of the pre-step checks: its sum is 0 exactly when every check is clean."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdc_guard.checks.replay import (
    add_words,
    replay_term,
    replay_term_device,
    replay_term_host,
    words_tensor,
)
from sdc_guard.collectives import flag_rows, flag_words
from sdc_guard.fingerprints.digest import _loss_word_tensor, host_loss_word, loss_word
from sdc_guard.fingerprints.words import to_signed64, to_unsigned64

words64 = st.integers(min_value=0, max_value=(1 << 64) - 1).map(to_signed64)


def _rows(own: list[tuple[int, int]], replayed: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [torch.tensor([*own[r], *replayed[r]], dtype=torch.int64) for r in range(len(own))]


def _ring_sum(rows: list[torch.Tensor]) -> int:
    total = torch.zeros((), dtype=torch.int64)
    for row in rows:
        total = total + replay_term(row)
    return int(total)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(words64, words64), min_size=2, max_size=9))
def test_the_ring_sum_is_zero_when_every_edge_agrees(own: list[tuple[int, int]]) -> None:
    n = len(own)
    replayed = [own[(r + 1) % n] for r in range(n)]  # rank r replays rank r+1 correctly
    assert _ring_sum(_rows(own, replayed)) == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(words64, words64), min_size=2, max_size=9), st.data())
def test_one_bad_edge_always_leaves_a_non_zero_sum(own: list[tuple[int, int]],
                                                    data: st.DataObject) -> None:
    n = len(own)
    replayed = [own[(r + 1) % n] for r in range(n)]
    bad = data.draw(st.integers(0, n - 1))
    loss, grad = replayed[bad]
    which = data.draw(st.sampled_from(["loss", "grad", "both"]))
    new_loss = data.draw(words64.filter(lambda v: v != loss)) if which != "grad" else loss
    new_grad = data.draw(words64.filter(lambda v: v != grad)) if which != "loss" else grad
    replayed[bad] = (new_loss, new_grad)
    assert _ring_sum(_rows(own, replayed)) != 0


def test_a_rank_wrong_both_times_leaves_a_non_zero_sum() -> None:
    own = [(11, 101), (12, 102), (13, 103), (14, 104)]
    replayed = [own[(r + 1) % 4] for r in range(4)]
    own[2] = (13, 103 ^ 4)        # rank 2's own gradients are wrong ...
    replayed[2] = (14, 104 ^ 8)   # ... and so is its replay of rank 3's batch
    assert _ring_sum(_rows(own, replayed)) != 0


@settings(max_examples=200, deadline=None)
@given(st.lists(words64, min_size=4, max_size=4))
def test_the_host_term_equals_the_device_term(words: list[int]) -> None:
    row = torch.tensor(words, dtype=torch.int64)
    assert int(replay_term_host(row)) == int(replay_term_device(row))


@settings(max_examples=200, deadline=None)
@given(st.lists(words64, min_size=1, max_size=6), st.lists(st.booleans(), min_size=6, max_size=6))
def test_host_words_and_tensor_words_give_the_same_bits(words: list[int],
                                                        as_int: list[bool]) -> None:
    """The audit keeps a word as an unsigned int on the host and a 0-d int64 tensor
    elsewhere (``Word``); sums and rows built from any mix have the same bits."""
    mixed = [to_unsigned64(w) if i else torch.tensor(w, dtype=torch.int64)
             for w, i in zip(words, as_int, strict=False)]
    total = None
    for w in mixed:
        total = add_words(total, w)
    assert total is not None
    assert to_unsigned64(int(total)) == sum(to_unsigned64(w) for w in words) % (1 << 64)
    row = words_tensor(mixed, torch.device("cpu"))
    assert row.dtype == torch.int64 and row.tolist() == words


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True), min_size=1, max_size=5),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_the_host_loss_word_is_the_tensor_loss_word(values: list[float],
                                                    dtype: torch.dtype) -> None:
    losses = [torch.tensor(v, dtype=dtype) for v in values]
    host = host_loss_word(losses)
    assert host is not None
    assert to_signed64(host) == int(loss_word(losses)) == int(_loss_word_tensor(losses))
    assert host_loss_word([losses[0], losses[0].double() if dtype != torch.float64
                           else losses[0].float()]) is None  # mixed dtypes: the tensor path


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 70).flatmap(lambda world: st.integers(1, 20).flatmap(
    lambda k: st.lists(st.lists(st.booleans(), min_size=k, max_size=k),
                       min_size=world, max_size=world))))
def test_flag_words_summed_over_the_ranks_name_every_flag(flags: list[list[bool]]) -> None:
    world, k = len(flags), len(flags[0])
    per_rank = [flag_words(f, r, world) for r, f in enumerate(flags)]
    assert len({len(w) for w in per_rank}) == 1
    # The SUM all-reduce, in int64 as the collective does it: no word overflows.
    total = [sum(col) for col in zip(*per_rank, strict=True)]
    assert all(0 <= t < 2**63 for t in total)
    assert flag_rows(total, k, world) == [[int(b) for b in f] for f in flags]
    if k * world <= 63:
        assert len(total) == 1  # one word: gloo's cheapest all-reduce
