"""The replay audit's digest of gradients: the fingerprint's version 2 lane sum, unmixed.

A tensor's bytes are read as unsigned 32-bit lanes ``L_k`` (the last zero-padded), and a
tensor whose bytes start at 64-bit word ``o`` of a concatenation (lane ``2o``) contributes

    ``sum_k (2**8 (2 (2o + k) + 1) + 2**rho(k)) L_k = P + 2**10 o S``  (mod 2**64)

with ``P = sum_k (2**8 (2k + 1) + 2**rho(k)) L_k`` and ``S = sum_k L_k`` its parts
(``digest_parts``) and ``rho`` the fingerprint's (``sdc_guard.fingerprints.public``),
counted from the tensor's own first lane. So the digest of tensors laid end to end is a sum
of per-tensor parts in any grouping (``concat_digest``): one flat DDP bucket, its gradients
as spans, and the same gradients as separate tensors give the same value, which lets the
comm hook digest the local gradients in the scaling pass while the replay digests its own
one by one.

The replay audit compares two computations of the same gradients, where a swap is not a
fault model, so no mixing or keys: one read of the bytes, no widening pass on the CPU.
Guaranteed to change it: any change inside one lane (every single-element change of
dtypes of up to 4 bytes, every single bit flip of any dtype), and a burst at one bit over
up to 64 adjacent lanes of one tensor (``fingerprint``'s proofs: the odd parts differ by
``4o``, the powers of 2 are the same). Not proven: a change across both lanes of one
8-byte element, bursts that cross from one tensor into the next.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import torch

from sdc_guard.fingerprints.batched import split, stream_total
from sdc_guard.fingerprints.native import active_kernel
from sdc_guard.fingerprints.weighted import (
    INT_OF_SIZE,
    odd_weights,
    prep_lanes,
    raw_bytes,
    tail_word,
    weighted_sum,
)
from sdc_guard.fingerprints.words import LANES_V2, MASK64, lane_weight, to_signed64

OFFSET_FACTOR = 1 << 10
"""A tensor at word offset ``o`` adds ``OFFSET_FACTOR * o * S`` to its part ``P``."""


def digest_value(t: torch.Tensor) -> torch.Tensor:
    """The digest of ``t`` alone (its part ``P``; module docstring), a 0-d int64 on its
    device. Cheaper than ``tensor_value`` where the bytes need no copy, and not a
    fingerprint: no key, no mixing, swaps of equal-weight lanes are not promised."""
    return digest_parts(t)[0]


def word_count(t: torch.Tensor) -> int:
    """How many 64-bit words hold ``t``'s bytes (the last one zero-padded)."""
    return (t.numel() * t.element_size() + 7) // 8


def digest_parts(t: torch.Tensor) -> torch.Tensor:
    """int64 ``[P, S]`` of ``t``'s lanes: its part of the digest at offset 0 and the lanes'
    plain sum (mod 2**64)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"digest_parts: expected a torch.Tensor, got {type(t).__name__}.")
    raw = raw_bytes(t)
    full = raw.numel() // 4 * 4
    parts = weighted_sum(raw[:full].view(torch.uint32), prep_lanes, with_sum=True, version=2)
    if full < raw.numel():
        last = tail_word(raw, full, 4)[0]
        parts = parts + torch.stack([to_signed64(lane_weight(full // 4, 2)) * last, last])
    return parts


def _host_parts(kernel: object, address: int, lanes: int) -> tuple[int, int]:
    """``[P, S]`` of ``lanes`` uint32 lanes at ``address`` by one call of the C kernel."""
    return kernel.words_at(address, lanes, LANES_V2)  # type: ignore[attr-defined, no-any-return]


def host_concat_digest(pieces: Iterable[tuple[torch.Tensor, int]]) -> int | None:
    """The digest of CPU tensors laid end to end, as an unsigned int, by the C kernel; else
    None.

    ``pieces`` are (tensor, word offset in the concatenation). Each tensor is read
    once by the kernel and the parts are combined in Python integers (no torch op
    per tensor), which is what the replay audit does per gradient. ``None`` when the
    kernel is not in use or a tensor is not a CPU tensor; the caller then uses
    ``digest_parts`` and ``concat_digest``, which give the same value.
    """
    kernel = active_kernel()
    if kernel is None:
        return None
    total = 0
    for t, offset in pieces:
        if not isinstance(t, torch.Tensor) or isinstance(offset, bool) or not isinstance(offset,
                                                                                          int):
            raise TypeError(f"host_concat_digest: pieces must be (torch.Tensor, int word offset) "
                            f"pairs, got ({type(t).__name__}, {type(offset).__name__}).")
        if t.device.type != "cpu":
            return None
        nbytes = t.numel() * t.element_size()
        if nbytes % 4 == 0 and t.is_contiguous() and t.data_ptr() % 8 == 0:
            d, s = _host_parts(kernel, t.data_ptr(), nbytes // 4)
        else:
            d, s = (v & MASK64 for v in digest_parts(t).tolist())
        total += d + OFFSET_FACTOR * offset * s
    return total & MASK64


def host_spans_digest(buf: torch.Tensor, spans: Iterable[tuple[int, int, int]]) -> int | None:
    """The digest of word ranges of one flat CPU buffer, moved to new offsets, by the C
    kernel; else None.

    ``spans`` are (first word, end word, word offset in the concatenation): the replay
    audit's view of a DDP bucket, whose gradients lie at other offsets in the bucket
    than in parameter order. ``buf`` must be contiguous and 8-byte aligned.
    """
    kernel = active_kernel()
    if (kernel is None or buf.device.type != "cpu" or not buf.is_contiguous()
            or buf.data_ptr() % 8):
        return None
    base = buf.data_ptr()
    end = buf.numel() * buf.element_size() // 8
    total = 0
    for a, b, offset in spans:
        if not 0 <= a <= b <= end:
            raise ValueError(f"host_spans_digest: span [{a}, {b}) lies outside the buffer's "
                             f"{end} words.")
        d, s = _host_parts(kernel, base + 8 * a, 2 * (b - a))
        total += d + OFFSET_FACTOR * offset * s
    return total & MASK64


def concat_digest(parts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The digest of tensors laid end to end, from their ``[P, S]`` rows (``digest_parts``)
    and their word offsets: ``sum P + 2**10 o S`` (module docstring). ``parts`` is
    ``[n, 2]``, ``offsets`` ``[n]`` (int64, same device); returns a 0-d int64.
    """
    if (parts.dim() != 2 or parts.shape[1] != 2 or offsets.shape != (parts.shape[0],)
            or parts.dtype != torch.int64 or offsets.dtype != torch.int64):
        raise ValueError(
            f"concat_digest: parts must be int64 [n, 2] (rows of digest_parts) and offsets "
            f"int64 [n]; got parts {parts.dtype} {list(parts.shape)}, offsets {offsets.dtype} "
            f"{list(offsets.shape)}."
        )
    return (parts[:, 0] + OFFSET_FACTOR * offsets * parts[:, 1]).sum()


def tensors_digest(tensors: Sequence[torch.Tensor], offsets: Sequence[int],
                   device: torch.device) -> torch.Tensor:
    """The digest of tensors laid at word ``offsets`` of a concatenation, a 0-d int64 on
    ``device``, in
    a number of torch ops that does not grow with the number of tensors: the value of
    ``concat_digest`` over their ``digest_parts``, which takes a dozen ops per tensor.

    The tensors on ``device`` under ``batched.alone_bytes`` are read in one multi-tensor pass
    per chunk (``sdc_guard.fingerprints.batched``: a copy into a scratch, read as version 2
    lanes weighted from each tensor's lane offset); each larger one alone (at most total
    bytes / ``alone_bytes`` of those); the tensors on another device are digested there and
    the value moved, one copy per device. The replay audit's digest of the gradients it
    recomputes takes it once per replay, whatever the number of parameters.
    """
    if len(tensors) != len(offsets):
        raise ValueError(f"tensors_digest: {len(tensors)} tensors but {len(offsets)} offsets; "
                         "give each tensor the word offset where it starts.")
    for i, (t, o) in enumerate(zip(tensors, offsets, strict=True)):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            raise TypeError(f"tensors_digest: item {i} is not a dense torch.Tensor "
                            f"({type(t).__name__}); digest a sparse tensor's indices and "
                            "values as two dense pieces.")
        if isinstance(o, bool) or not isinstance(o, int) or o < 0:
            raise TypeError(f"tensors_digest: offsets[{i}] is {o!r}; give a word offset, an "
                            "int >= 0.")
    parts_of = split(tensors, device)
    batch = parts_of.batched
    total = stream_total([tensors[i] for i in batch], [offsets[i] for i in batch], device)
    for i in parts_of.alone:
        parts = digest_parts(tensors[i])
        total = total + parts[0] + OFFSET_FACTOR * offsets[i] * parts[1]
    for other, idx in parts_of.elsewhere.items():
        part = tensors_digest([tensors[i] for i in idx], [offsets[i] for i in idx], other)
        total = total + part.to(device, non_blocking=True)
    return total


def loss_word(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """A 0-d int64 word that changes with any bit of any of ``losses`` (the replay audit's).

    ``sum_k (2k+1) v_k`` over the losses' bits as sign-extended integers ``v_k``: a
    few tiny ops, where a fingerprint would cost tens. A changed loss changes its
    ``v`` by ``0 < |d| < 2**64``, times an odd weight; swapping two unequal losses of
    at most 4 bytes changes it by ``2(i-j)(v_j-v_i) != 0``.
    """
    host = host_loss_word(losses)
    if host is not None:
        return torch.tensor(to_signed64(host), dtype=torch.int64)
    return device_loss_word(losses)


_BITS = {torch.float32: (struct.Struct("<f"), struct.Struct("<i"), 0),
         torch.float64: (struct.Struct("<d"), struct.Struct("<q"), 0),
         torch.float16: (struct.Struct("<e"), struct.Struct("<h"), 0),
         torch.bfloat16: (struct.Struct("<f"), struct.Struct("<i"), 16)}
"""dtype -> (pack the value, read its bits as a signed int, shift): a float loss's bits from
its Python float, exactly (a bfloat16 is the top half of its float32)."""


def _loss_bits(t: torch.Tensor) -> int:
    """The bits of a one-element CPU loss as a signed integer of its size.

    One ``.item()``: right after a backward pass every tensor op is dear (the caches hold
    the step's data, not the dispatcher's code). A NaN goes through the tensor's own bits:
    a Python float does not keep every NaN payload.
    """
    value = t.item()
    form = _BITS.get(t.dtype)
    if form is None or value != value:
        return int(t.detach().reshape(()).view(INT_OF_SIZE[t.element_size()]).item())
    pack, bits, shift = form
    word: int = bits.unpack(pack.pack(value))[0]
    return word >> shift


def host_loss_word(losses: Sequence[torch.Tensor]) -> int | None:
    """``loss_word`` of CPU losses of one dtype as an unsigned int (one ``.item()`` per loss,
    Python integers, no tensor op); None for losses elsewhere, which ``loss_word`` digests
    on their device."""
    if not losses or any(t.device.type != "cpu" or t.dtype != losses[0].dtype for t in losses):
        return None
    total = sum((2 * k + 1) * _loss_bits(t) for k, t in enumerate(losses))
    return total & MASK64


def device_loss_word(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """``loss_word`` in tensor ops on the losses' device, never a read to the host (CPU losses
    too: the path a GPU takes, where ``loss_word`` reads CPU losses with ``.item()``); five ops
    however many losses (one-element losses of another shape than ``()`` take a view each)."""
    with torch.no_grad():
        flat = list(losses)
        if any(t.dim() != 0 for t in flat):
            flat = [t.reshape(()) for t in flat]
        stacked = torch.stack(flat)
    v = stacked.view(INT_OF_SIZE[stacked.element_size()]).to(torch.int64)
    return (v * odd_weights(v.numel(), v.device)).sum()


_loss_word_tensor = device_loss_word
"""The former name (``tests/sdc_guard/test_step_word.py``)."""
