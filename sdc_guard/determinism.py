"""Deterministic mode: the precondition for a bit-exact replay audit.

``enable_determinism(seed)`` turns on PyTorch's deterministic algorithms, pins
cuDNN, sets the cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``; set before the
first CUDA call for it to take effect) and seeds every generator.
``rng_stream(seed, rank, step, micro)`` then gives each micro-batch of each
(rank, step) its own random stream, restoring the previous RNG state on exit, so
dropout and other random ops replay exactly on another rank.

What the user must guarantee: ``batch_for(rank, step)`` returns the same batch
every time it is called with the same arguments (no iterator state, no
data-dependent host randomness), and the loss function draws randomness only
from torch's generators, Python's ``random`` module or NumPy's global generator, which
``rng_stream`` seeds per (rank, step, micro-batch). The guard refuses to build a replay audit without
``GuardConfig(deterministic=True)``.

Determinism within a rank is not enough for the audit: a neighbour recomputes the batch with
its own kernels. ``compute_signature(device)`` names what decides their bits beside the
model, the batch and the seed (the torch build; on the CPU the instruction set torch's
kernels use and their thread count; on a GPU its model and libraries); the guard gathers
every rank's once, with its place (``sdc_guard.topology``), and refuses the replay when they
differ (``signature_mismatch``): a healthy rank would be convicted at every audit step.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import random
import sys
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from sdc_guard.fingerprints.words import MASK64, SEED, mix64_int


def enable_determinism(seed: int = 0) -> None:
    """Deterministic kernels, pinned cuDNN, the cuBLAS workspace setting, seeded generators."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(seed)


SIGNATURE_FIXES = {
    "torch build": "one container image (the same torch build) on every rank",
    "float32 matmul precision": "the same torch.set_float32_matmul_precision(...) on every rank",
    "CPU instruction set": "every rank on one CPU class (a node selector)",
    "CPU threads": ("the same thread count on every rank: torch.set_num_threads(n) before the "
                    "guard is built, or OMP_NUM_THREADS=n in every rank's environment"),
    "oneDNN": "the same torch.backends.mkldnn.enabled on every rank",
    "GPU": "every rank on one GPU type (a node selector)",
    "CUDA": "one container image (the same CUDA build of torch) on every rank",
    "cuDNN": "one container image (the same cuDNN) on every rank",
    "TF32 matmul": "the same torch.backends.cuda.matmul.allow_tf32 on every rank",
    "TF32 cuDNN": "the same torch.backends.cudnn.allow_tf32 on every rank",
}
"""What each entry of ``compute_signature`` is, and how a job makes it the same everywhere."""


def compute_signature(device: torch.device) -> dict[str, str]:
    """What decides the bits of this rank's forward and backward, beside the model, the batch
    and the seed. On the CPU torch's own kernels split reductions by thread and vectorise by
    instruction set: the same batch gives other gradient bits with 1 thread than with 2, and
    with AVX2 kernels than with AVX-512 ones (seen on the reference MLP's bias gradients);
    on a GPU the kernels follow its model and the CUDA libraries."""
    sig = {"torch build": torch.__version__,
           "float32 matmul precision": torch.get_float32_matmul_precision()}
    if device.type == "cpu":
        sig["CPU instruction set"] = torch.backends.cpu.get_cpu_capability()
        sig["CPU threads"] = str(torch.get_num_threads())
        sig["oneDNN"] = str(bool(torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
                                 and torch.backends.mkldnn.enabled))
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sig["GPU"] = f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"
        sig["CUDA"] = str(torch.version.cuda)
        sig["cuDNN"] = str(torch.backends.cudnn.version())  # type: ignore[no-untyped-call]
        sig["TF32 matmul"] = str(torch.backends.cuda.matmul.allow_tf32)
        sig["TF32 cuDNN"] = str(torch.backends.cudnn.allow_tf32)
    return sig


def signature_mismatch(signatures: Sequence[Mapping[str, str]]) -> str | None:
    """Where the ranks' ``compute_signature`` differ, in words (each value with its ranks,
    and the fix), or None when every rank computes alike."""
    parts = []
    for key in dict.fromkeys(k for sig in signatures for k in sig):
        by_value: dict[str, list[int]] = {}
        for rank, sig in enumerate(signatures):
            by_value.setdefault(sig.get(key, "unknown"), []).append(rank)
        if len(by_value) > 1:
            where = " vs ".join(f"{v} (rank{'s' if len(r) > 1 else ''} "
                                f"{', '.join(map(str, r))})" for v, r in by_value.items())
            parts.append(f"{key}: {where}; fix: {SIGNATURE_FIXES.get(key, 'make it alike')}")
    return "; ".join(parts) or None


def derive_seed(*parts: int) -> int:
    """A 64-bit seed determined by the integers ``parts`` alone: the same in every process
    and on every machine (no Python ``hash()``). Fault models draw from it."""
    h = SEED
    for p in parts:
        h = mix64_int(h + (p & MASK64))
    return h


def stream_seed(seed: int, rank: int, step: int, micro: int = 0) -> int:
    """A 63-bit seed for one (rank, step, micro-batch); the same in every process."""
    z = seed & MASK64
    for part in (rank, step, micro):
        z = mix64_int(z + SEED + part)
    return z >> 1


@contextlib.contextmanager
def rng_stream(
    seed: int, rank: int, step: int, micro: int, device: torch.device
) -> Iterator[None]:
    """Run a block on the random stream of (rank, step, micro); restore the RNG state after.

    What ``torch.random.fork_rng(devices=[device])`` does for the CPU generator (and
    ``device``'s, on CUDA), without its accelerator lookup: this runs every training step
    in deterministic mode and again in every replay, where that lookup costs more than
    saving and restoring the generator's state (the caches are cold after a step).

    Python's ``random`` module and NumPy's global generator (``np.random.*``, when NumPy's
    random module is loaded) get the stream too: a layer that draws from them (a LayerDrop
    written with ``random.uniform``, as some models do) would otherwise compute another
    rank's batch differently in the replay, and every audit would convict a healthy rank.
    Their states come back afterwards as well.
    """
    cpu = torch.default_generator
    s = stream_seed(seed, rank, step, micro)
    cpu_state = cpu.get_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    py_state = random.getstate()
    np_random = sys.modules.get("numpy.random")
    np_state = np_random.get_state() if np_random is not None else None
    # Not torch.manual_seed: on CPU-only builds its lazy CUDA seeding costs more than the seed.
    cpu.manual_seed(s)
    try:
        random.seed(s)
        if np_random is not None:
            np_random.seed((s ^ (s >> 32)) & 0xFFFFFFFF)  # 32-bit seeds; an int seeds fastest
        if cuda_state is not None:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(s)
        yield
    finally:
        cpu.set_state(cpu_state)
        random.setstate(py_state)
        if np_random is not None:
            np_random.set_state(np_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)


_PLAIN = (bool, int, float, str, type(None))
_CONTAINERS = (list, dict, set, collections.deque)
"""Containers a forward may keep state in (a list of auxiliary losses it appends to, a
cache dict): their top level is put back after a recomputation."""
_ABSENT = object()
_PLAIN_NAMES: weakref.WeakKeyDictionary[torch.nn.Module, list[list[Any]]] = (
    weakref.WeakKeyDictionary())
"""Per root module: each of its modules, the names of its plain attributes, and how many
attributes it had when they were found (``_plain_names``)."""
_log = logging.getLogger(__name__)
FIRST_COPY_LIMIT = 64 << 20
"""Bytes: a tensor attribute larger than this is not copied on the first recomputation (a
cached table on a GPU could not spare its size twice); if that recomputation writes it in
place, it keeps that update once, with a warning, and is copied from then on."""


def _is_state_tensor(v: Any) -> bool:
    """A tensor a module keeps as a plain attribute (not a parameter: those are its own)."""
    return isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)


def _names_of(m: torch.nn.Module) -> list[Any]:
    d = vars(m)
    return [m, [k for k, v in d.items() if k[0] != "_" and isinstance(v, _PLAIN)], len(d),
            [k for k, v in d.items() if isinstance(v, torch.Generator)],
            [k for k, v in d.items() if k[0] != "_" and _is_state_tensor(v)], None, set(),
            [k for k, v in d.items() if k[0] != "_" and isinstance(v, _CONTAINERS)]]


def _plain_names(module: torch.nn.Module) -> list[list[Any]]:
    """``[module, plain attribute names, attribute count, generator attribute names, tensor
    attribute names, the tensor attributes a recomputation wrote in place (None: not known
    yet), those it rebound, container attribute names]`` for each module of ``module``,
    found once and again for a module that has gained or lost attributes since."""
    known = _PLAIN_NAMES.get(module)
    if known is None:  # (a model's modules stay: one given new ones later keeps them unkept)
        known = _PLAIN_NAMES[module] = [_names_of(m) for m in module.modules()]
    for i, (m, _, size, *_) in enumerate(known):
        if len(vars(m)) != size:
            known[i] = _names_of(m)
    return known


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter (None for an inference tensor, which keeps none)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


@contextlib.contextmanager
def module_state_kept(module: torch.nn.Module) -> Iterator[None]:
    """Run a recomputation (the replay audit's, the non-finite check's) without leaving the
    module's plain Python attributes changed: numbers, flags and strings that a forward keeps
    in its modules (a call counter behind a warm-up, a phase switched after some calls) come
    back as they were, and ones it added go. The owner's training forward then starts from
    the values the recomputation started from, as it would without the recomputation: the
    neighbour's recomputation of the step and the owner's step see the same counter, and
    training is the unguarded run's. A ``torch.Generator`` a module keeps (a masking layer
    seeded once) gets its state back too, so the owner draws what the recomputation drew.
    So does a tensor a module keeps as a plain attribute rather than a buffer (a step count
    kept as a tensor, an EMA teacher's weights): one the forward rebinds gets its old tensor back, one it
    updates in place its old values. Which tensors a forward writes in place is learned on
    the first recomputation, which copies every tensor attribute (up to ``FIRST_COPY_LIMIT``
    bytes each) and compares version counters; later ones copy only those. (A tensor first
    written on a later recomputation, or a larger one on the first, keeps that update once,
    with a warning.)
    A list, dict, set or deque a module keeps (auxiliary losses a forward appends to, a
    cache it fills) gets its top level back, in place: the same object, with the items it
    held (the items themselves are not copied: a tensor in a list that a forward writes in
    place, or a list inside a dict that it appends to, is not put back).
    (Buffers are the caller's: it restores them itself.)
    Attributes whose names start with ``_`` are torch's own and left alone. Which attributes
    are plain is found once per model (``_plain_names``); later calls only visit those."""
    saved = []
    generators = []
    tensors: list[tuple[list[Any], str, torch.Tensor, int, torch.Tensor | None]] = []
    containers: list[tuple[Any, Any]] = []
    known = _plain_names(module)
    for entry in known:
        m, names, _, gens, tensor_names, writers, _, container_names = entry
        d = vars(m)
        saved.append((m, d, len(d), [(k, d.get(k, _ABSENT))
                                     for k in (*names, *tensor_names, *container_names)]))
        containers += [(c, c.copy()) for k in container_names
                       if isinstance(c := d.get(k), _CONTAINERS)]
        generators += [(g, g.get_state()) for k in gens
                       if isinstance(g := d.get(k), torch.Generator)]
        for k in tensor_names:
            t = d.get(k)
            if _is_state_tensor(t) and (v := _version(t)) is not None:
                copy = t.detach().clone() if (
                    k in writers if writers is not None
                    else t.numel() * t.element_size() <= FIRST_COPY_LIMIT) else None
                tensors.append((entry, k, t, v, copy))
    try:
        yield
    finally:
        for g, state in generators:
            g.set_state(state)
        for c, items in containers:
            _refill(c, items)
        for entry in known:
            if entry[5] is None:
                entry[5] = set()
        for entry, k, t, v, copy in tensors:
            if _version(t) == v:
                continue
            if copy is not None:
                with torch.no_grad():
                    t.copy_(copy)
            elif k not in entry[5]:
                _log.warning(
                    "sdc_guard: %s.%s (a tensor kept as a plain attribute) was updated in "
                    "place by a recomputation for the first time; it keeps that update once "
                    "(from the next recomputation on it is restored). Register it as a buffer "
                    "to have it kept with the model's state.", type(entry[0]).__name__, k)
            entry[5].add(k)
        rebound = {id(e[0]): e[6] for e in known}
        for m, d, size, before in saved:
            for k, v in before:
                if d.get(k, _ABSENT) is not v:
                    if _is_state_tensor(v):
                        rebound[id(m)].add(k)
                    if v is _ABSENT:
                        delattr(m, k)
                    else:
                        setattr(m, k, v)
            if len(d) > size:  # attributes the recomputation added
                known_names = {k for k, _ in before}
                for k in [k for k, v in d.items() if k[0] != "_" and k not in known_names
                          and (isinstance(v, (*_PLAIN, *_CONTAINERS)) or _is_state_tensor(v))]:
                    delattr(m, k)


def _refill(c: Any, items: Any) -> None:
    """Give container ``c`` the items of its copy ``items`` again (in place: other references
    to it see them too), unless it still holds exactly those objects."""
    if isinstance(c, dict):
        if len(c) == len(items) and all(
                k1 is k2 and v1 is v2
                for (k1, v1), (k2, v2) in zip(c.items(), items.items(), strict=True)):
            return
        c.clear()
        c.update(items)
    elif isinstance(c, set):
        if c == items:
            return
        c.clear()
        c.update(items)
    else:
        if len(c) == len(items) and all(a is b for a, b in zip(c, items, strict=True)):
            return
        c.clear()
        c.extend(items)


SavedBuffers = list[tuple[torch.nn.Module, str, str, torch.Tensor]]
"""``(module, buffer name, qualified name, copy)`` for each buffer of a model
(``buffers_saved``)."""


def buffers_saved(module: torch.nn.Module) -> SavedBuffers:
    """Copies of ``module``'s buffers, each with its module and names (``buffers_set``)."""
    return [(m, n, f"{prefix}.{n}" if prefix else n, b.detach().clone())
            for prefix, m in module.named_modules() for n, b in m._buffers.items()
            if b is not None]


def buffers_set(module: torch.nn.Module, saved: SavedBuffers) -> None:
    """Give ``module``'s buffers the values ``saved`` again, in place. A buffer the forward
    resized (a quantisation observer's per-channel ranges start empty and take their shape
    at the first forward) is resized back first, as the observers themselves resize theirs;
    one it registered anew under the same name gets the old values; one it registered that
    was not there (a table built lazily at the first forward) is removed, as a plain
    attribute it added is (``module_state_kept``): the next forward that needs it builds it
    again, as it would have without the recomputation."""
    kept = {(id(m), n) for m, n, _, _ in saved}
    with torch.no_grad():
        for m, n, _, value in saved:
            b = m._buffers.get(n)
            if b is None:  # (a forward that deleted a buffer: put back)
                m._buffers[n] = value.clone()
                continue
            if b.shape != value.shape:
                b.resize_(value.shape)
            b.copy_(value)
    for m in module.modules():
        for n in [n for n, b in m._buffers.items() if b is not None and (id(m), n) not in kept]:
            del m._buffers[n]


def state_tensors_written(module: torch.nn.Module) -> list[str]:
    """The tensor attributes (qualified names) that ``module``'s recomputations have written,
    in place or by rebinding: state kept outside the parameters and buffers, which DDP does
    not keep equal across ranks (evidence when every replay edge disagrees)."""
    known = _PLAIN_NAMES.get(module)
    if not known:
        return []
    names = {id(m): n for n, m in module.named_modules()}
    return sorted(f"{names.get(id(e[0]), '?')}.{k}".lstrip(".") for e in known
                  for k in (e[5] or set()) | e[6])
