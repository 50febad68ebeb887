"""The torch path (the one GPUs take) values a list of tensors in a number of ops that does
not grow with the number of tensors, with the values of every other path, and no host read.

Counted with ``tests/hostsync.py``'s ``DispatchedOps`` (each aten op is a kernel launch or
more on a GPU) and ``HostReads``, with the C kernel off, after a first call that builds the
cached layouts. The lists are kept within one chunk (``batched.chunk_bytes``) and under
``batched.alone_bytes`` a tensor: beyond them the ops grow with the bytes (a pass per chunk,
a pass per tensor of ``alone_bytes`` or more), not with the number of tensors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sdc_guard import fingerprint, fingerprint_tensor, native_kernel
from sdc_guard.fingerprints import batched as B
from sdc_guard.fingerprints import digest as D
from sdc_guard.fingerprints import public as P
from sdc_guard.fingerprints.words import to_signed64
from tests.hostsync import DispatchedOps, HostReads

CPU = torch.device("cpu")
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaNs with any payload included)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    if dtype.is_complex:
        return raw.view(torch.float32 if size == 8 else torch.float64).view(dtype).reshape(shape)
    return raw.view(INT_VIEW[size]).view(dtype).reshape(shape)


def _mixed(count: int, seed: int = 0) -> list[torch.Tensor]:
    """``count`` tensors of mixed sizes and dtypes: weights over 64 KiB, 8-byte dtypes, a
    non-contiguous one, bfloat16, 0-d step counters, partial last lanes: four kinds of
    dtype and contiguity, all of them in any ``count`` from 4 up."""
    kinds = [
        lambda k: _bits(torch.float32, (130, 150), k),  # 76 KiB
        lambda k: _bits(torch.float64, (9000,), k),  # 70 KiB of 8-byte words
        lambda k: _bits(torch.bfloat16, (33, 17), k),
        lambda k: _bits(torch.float32, (200, 100), k).t(),  # non-contiguous
        lambda k: _bits(torch.float32, (), k),  # an optimizer's step
        lambda k: _bits(torch.float64, (3,), k),
        lambda k: _bits(torch.bfloat16, (7,), k),  # 14 bytes: a zero-padded last lane
        lambda k: _bits(torch.float32, (40_000,), k),  # 156 KiB
    ]
    return [kinds[k % len(kinds)](seed + k) for k in range(count)]


def _counted(fn: object, *args: object) -> tuple[DispatchedOps, HostReads, torch.Tensor]:
    """``fn(*args)`` once to build the cached layouts, then counted."""
    fn(*args)  # type: ignore[operator]
    with DispatchedOps() as ops, HostReads() as reads:
        out = fn(*args)  # type: ignore[operator]
    return ops, reads, out


def test_fingerprint_ops_do_not_grow_with_the_number_of_tensors() -> None:
    few, many = _mixed(4), _mixed(40)
    assert sum(t.numel() * t.element_size() for t in many) < B.CPU_CHUNK_BYTES
    assert max(t.numel() * t.element_size() for t in many) < B.CPU_ALONE_BYTES
    with native_kernel(False):
        ops_few, reads_few, fp_few = _counted(fingerprint_tensor, few)
        ops_many, reads_many, fp_many = _counted(fingerprint_tensor, many)
        per_tensor = [[int(P.tensor_value(t)) for t in ts] for ts in (few, many)]
        batched = [P.tensor_values(ts, CPU).tolist() for ts in (few, many)]
    assert ops_few.counts == ops_many.counts, (ops_few.counts, ops_many.counts)
    assert reads_few.total == reads_many.total == 0, (reads_few.counts, reads_many.counts)
    # the values: the per-tensor torch path's, and the C kernel's (or the same torch path
    # where no compiler built it)
    assert batched == per_tensor
    assert [int(fp_few), int(fp_many)] == [to_signed64(fingerprint(ts)) for ts in (few, many)]


def test_the_weights_checks_state_takes_the_same_ops_at_every_depth() -> None:
    """The weights check's read: an MLP's parameters and AdamW state (``state_tensors``) at
    4 and at 16 layers."""
    from scenarios.spec.models import MLP
    from sdc_guard.state import state_tensors

    counts = []
    for depth in (4, 16):
        torch.manual_seed(depth)
        model = MLP(64, depth)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        state = state_tensors(model, opt)
        with native_kernel(False):
            ops, reads, value = _counted(fingerprint_tensor, state)
        assert reads.total == 0, reads.counts
        assert int(value) == to_signed64(fingerprint(state))
        counts.append(ops.total)
    assert counts[0] == counts[1], counts


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
           torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
           torch.complex128, *(getattr(torch, name) for name in ("uint16", "uint32", "uint64",
                                                                  "float8_e4m3fn", "float8_e5m2")
                               if hasattr(torch, name))]


@st.composite
def _lists(draw: st.DrawFn) -> list[torch.Tensor]:
    specs = draw(st.lists(st.tuples(st.sampled_from(_DTYPES),
                                    st.sampled_from([(), (0,), (1,), (3,), (5, 7), (130, 33),
                                                     (1025,), (17_000,)]),
                                    st.booleans()), min_size=2, max_size=10))
    seed = draw(st.integers(0, 2**20))
    out = []
    for k, (dtype, shape, strided) in enumerate(specs):
        t = _bits(dtype, shape, seed + k)
        if dtype == torch.bool:  # any byte, not only 0 and 1: the fingerprint is of the bytes
            t = _bits(torch.uint8, shape, seed + k).view(torch.bool)
        if strided and t.dim() == 2:
            t = t.t()
        elif strided and t.dim() == 1 and t.numel() > 2:
            t = t[1::2]
        out.append(t)
    return out


@settings(max_examples=30, deadline=None)
@given(tensors=_lists(), chunk=st.sampled_from([B.CPU_CHUNK_BYTES, 1 << 14]),
       lane_sums=st.booleans())
def test_batched_values_are_the_per_tensor_values(tensors: list[torch.Tensor], chunk: int,
                                                  lane_sums: bool) -> None:
    """Any dtypes, shapes and strides, in one chunk or in many (with tensors that go alone),
    lanes widened first or summed as they are read (``LANE_SUM_DEVICES``, CUDA's way): each
    value is the one-tensor torch path's, the fingerprint is the C kernel's, and a list
    taken twice takes the same ops as once (bool tensors aside: a view each)."""
    with pytest.MonkeyPatch.context() as mp, native_kernel(False):
        mp.setattr(B, "CPU_CHUNK_BYTES", chunk)
        mp.setattr(B, "CPU_ALONE_BYTES", chunk // 2)  # the small chunk: some tensors alone
        mp.setattr(B, "LANE_SUM_DEVICES", {"cpu"} if lane_sums else set())
        got = P.tensor_values(tensors, CPU).tolist()
        want = [int(P.tensor_value(t)) for t in tensors]
        fp = int(fingerprint_tensor(tensors))
    assert got == want
    assert fp == to_signed64(fingerprint(tensors))
    if chunk == B.CPU_CHUNK_BYTES:
        plain = [t for t in tensors if t.dtype != torch.bool]
        if (len(plain) >= 2 and 2 * sum(t.numel() * t.element_size() for t in plain) < chunk
                and all(t.numel() * t.element_size() < B.CPU_ALONE_BYTES for t in plain)):
            with native_kernel(False):
                fingerprint_tensor(plain)  # (a first call builds the constants it caches)
                fingerprint_tensor(plain + plain)
                once, _, _ = _counted(fingerprint_tensor, plain)
                twice, _, _ = _counted(fingerprint_tensor, plain + plain)
            assert once.counts == twice.counts


def test_a_device_list_with_host_tensors_has_the_same_value() -> None:
    """CPU tensors in a device's list (AdamW's step counters) are valued on the host and their
    terms added as a Python int (``_device_fingerprint``): the same value, whichever they are."""
    tensors = _mixed(9)
    for version in (1, 2):
        metas = tuple(P._meta_word(t, version) for t in tensors)
        want = to_signed64(fingerprint(tensors, version=version))
        with native_kernel(False):
            for host in ([], [4], [1, 4, 8], list(range(1, 9))):
                got = int(P._device_fingerprint(tensors, True, metas, CPU, host, version))
                assert got == want, (host, version)


def _offsets(tensors: list[torch.Tensor], seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(v) for v in torch.randint(0, 1 << 40, (len(tensors),), generator=g)]


def test_digest_ops_do_not_grow_with_the_number_of_tensors() -> None:
    few, many = _mixed(4, seed=7), _mixed(40, seed=7)
    at_few, at_many = _offsets(few, 1), _offsets(many, 2)
    with native_kernel(False):
        ops_few, reads_few, d_few = _counted(D.tensors_digest, few, at_few, CPU)
        ops_many, reads_many, d_many = _counted(D.tensors_digest, many, at_many, CPU)
        per_tensor = [int(D.concat_digest(torch.stack([D.digest_parts(t) for t in ts]),
                                          torch.tensor(at))) for ts, at in ((few, at_few),
                                                                             (many, at_many))]
    assert ops_few.counts == ops_many.counts, (ops_few.counts, ops_many.counts)
    assert reads_few.total == reads_many.total == 0
    assert [int(d_few), int(d_many)] == per_tensor
    host = [D.host_concat_digest(zip(ts, at, strict=True)) for ts, at in ((few, at_few),
                                                                          (many, at_many))]
    if host[0] is not None:  # the C kernel's value too, where it was built
        assert [to_signed64(h) for h in host if h is not None] == per_tensor


@settings(max_examples=20, deadline=None)
@given(tensors=_lists(), seed=st.integers(0, 2**20))
def test_batched_digest_is_the_per_tensor_digest(tensors: list[torch.Tensor],
                                                 seed: int) -> None:
    at = _offsets(tensors, seed)
    with native_kernel(False):
        got = int(D.tensors_digest(tensors, at, CPU))
        want = int(D.concat_digest(torch.stack([D.digest_parts(t) for t in tensors]),
                                   torch.tensor(at)))
    assert got == want


def test_tensors_digest_refuses_what_it_cannot_digest() -> None:
    with pytest.raises(ValueError, match="2 tensors but 1 offsets"):
        D.tensors_digest([torch.zeros(2), torch.zeros(3)], [0], CPU)
    with pytest.raises(TypeError, match=r"offsets\[0\] is -1"):
        D.tensors_digest([torch.zeros(2)], [-1], CPU)
    with pytest.raises(TypeError, match="item 0 is not a dense"):
        D.tensors_digest([torch.zeros(2).to_sparse()], [0], CPU)


def test_loss_word_ops_do_not_grow_with_the_number_of_losses() -> None:
    """On a device the loss word is a few ops however many micro-batches' losses."""
    g = torch.Generator().manual_seed(0)
    two = list(torch.randn(2, generator=g).unbind())
    eight = list(torch.randn(8, generator=g).unbind())
    ops_two, reads_two, w_two = _counted(D.device_loss_word, two)
    ops_eight, reads_eight, w_eight = _counted(D.device_loss_word, eight)
    assert ops_two.counts == ops_eight.counts, (ops_two.counts, ops_eight.counts)
    assert reads_two.total == reads_eight.total == 0
    assert [to_signed64(D.host_loss_word(ls) or 0) for ls in (two, eight)] == [
        int(w_two), int(w_eight)]
    shaped = [loss.reshape(1) for loss in eight]  # losses of shape [1]: the same word
    assert int(D.device_loss_word(shaped)) == int(w_eight)


def test_threads_that_value_at_once_get_the_values() -> None:
    """A comm hook's thread may digest while another thread fingerprints: each thread has
    its own scratch and layouts, so neither overwrites the other's copy mid-pass."""
    import threading

    lists = [_mixed(6, seed=s) for s in range(3)]
    want = [[int(P.tensor_value(t)) for t in ts] for ts in lists]
    got: list[list[list[int]]] = [[] for _ in lists]

    def run(k: int) -> None:
        for _ in range(15):
            got[k].append(P.tensor_values(lists[k], CPU).tolist())

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(lists))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [[w] * 15 for w in want]


def test_a_first_call_in_inference_mode_leaves_the_scratch_writable() -> None:
    """The scratch and the layouts' views are made outside inference mode even when the first
    call is inside it (a checkpoint verified under ``torch.inference_mode()``): made inside,
    a later call outside could not write them. In a new thread: its scratch is new."""
    import threading

    tensors = _mixed(6, seed=3)
    want = [int(P.tensor_value(t)) for t in tensors]
    got: list[object] = []

    def run() -> None:
        try:
            with torch.inference_mode():
                inside = P.tensor_values(tensors, CPU).tolist()
                P.tensor_value(torch.randn(300_000))  # the per-tensor pass's scratch too
            got.extend([inside, P.tensor_values(tensors, CPU).tolist()])
            P.tensor_value(torch.randn(300_000))
        except RuntimeError as e:
            got.append(e)

    with native_kernel(False):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert got == [want, want]
