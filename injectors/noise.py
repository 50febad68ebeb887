"""Recomputation noise on the CPU: the testbed for the tolerant replay audit.

A GPU without deterministic kernels computes the same batch with other roundings on every
run (atomics in a reduction, split-K matrix products, a non-deterministic attention
backward). A CPU does not: with one thread count its kernels give the same bits every
time. ``LinearNoise`` makes them differ the way the GPU does: every ``nn.Linear`` output
element moves by a random whole number of units in the last place, from ``-ulps`` to
``ulps``, drawn afresh at every call (so a recomputation of the same batch, on the same
rank or another, never rounds alike). Ranks at different thread counts (1 and 2) add the
CPU's own difference: torch's kernels split their reductions by thread.

In half precision the output's own ulps are far coarser than what a GPU's reduction order
changes: its products accumulate in float32 and round once to bfloat16 or float16, so a
reordered sum moves the accumulator by a few float32 ulps and changes the rounded output
only where the accumulator lay near a rounding boundary (then by one ulp). ``where =
"accumulator"`` imitates that: a half-precision output is taken again in float32 from the
layer's input and weight, moved by up to ``ulps`` float32 ulps, and rounded to the output's
dtype (a float32 output is moved as with ``"output"``: its rounding is the accumulator's).
``"output"`` (the default) moves every output element by up to ``ulps`` of its own dtype
(in bfloat16 4 ulps are 1.6% of each element, beyond what any reduction order does).

It is noise, not a fault: it stays within a few ulps of each output, and the tolerant
audit must accept it (0 false positives is the target). Faults stay defined by site and
bit (``injectors.Fault``). Reproducible: the draws come from one generator per rank seeded
by ``(seed, rank)``, in call order.

Keyed draws (``begin(key)``) make a noisy run reproducible whatever the audit does: each
computation of a batch seeds the generator from ``(seed, rank, key, n)``, where ``n`` counts
this rank's earlier computations of that batch. A rank's training pass is its first
computation of its own batch, so the trajectory is the same at every replay interval and
whatever the audit recomputes (the campaign's golden run stays its oracle, bit for bit),
while every recomputation (the neighbour's batch on another rank, or a rerun on the same
one) rounds differently. ``forget()`` starts the count over (a rollback: the steps trained
again are first computations again, as on a replaced node).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sdc_guard.determinism import derive_seed

_BITS = {torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
         torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
         torch.float16: (torch.int16, 0x7FFF, 0x7C00)}
"""Per float dtype: the integer view, the magnitude mask, and the magnitude of Inf."""


def nudge(out: torch.Tensor, ulps: int, gen: torch.Generator) -> torch.Tensor:
    """``out`` with each finite element moved by a random ``-ulps..ulps`` units in the last
    place (its magnitude's bit pattern plus the step, which is one ulp at every exponent);
    elements within ``ulps`` of zero or of Inf are left as they are (no sign change, no
    overflow)."""
    if out.dtype not in _BITS:
        raise ValueError(f"LinearNoise: outputs of dtype {out.dtype} are not supported "
                         f"(float32, bfloat16, float16)")
    itype, mask, inf = _BITS[out.dtype]
    steps = torch.randint(-ulps, ulps + 1, out.shape, generator=gen, dtype=itype)
    bits = out.detach().contiguous().view(itype)
    mag = bits & mask
    safe = (mag >= ulps) & (mag < inf - ulps)
    moved = torch.where(safe, bits + steps.to(out.device), bits)
    return moved.view(out.dtype)


WHERE = ("output", "accumulator")
"""Where ``LinearNoise`` moves a product (module doc)."""


def _in_float32(module: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The linear layer's product of ``x`` summed in float32, of the operands the half
    precision ``dtype`` kernel multiplies (under autocast: ``x``, the weight and the bias
    rounded to ``dtype`` first), before its rounding to ``dtype``."""
    def operand(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).float()

    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        return F.linear(operand(x), operand(weight), None if bias is None else operand(bias))


class LinearNoise:
    """Random ``-ulps..ulps`` ulp noise on every ``nn.Linear`` output of ``model``; see the
    module doc. ``remove()`` takes the hooks off."""

    def __init__(self, model: nn.Module, *, ulps: int = 4, seed: int = 0, rank: int = 0,
                 where: str = "output") -> None:
        if isinstance(ulps, bool) or not isinstance(ulps, int) or not 0 < ulps <= 64:
            raise ValueError(f"LinearNoise(ulps=...) must be an int in 1..64, got {ulps!r}.")
        if where not in WHERE:
            raise ValueError(f"LinearNoise(where=...) must be one of {', '.join(WHERE)}, got "
                             f"{where!r}.")
        self.ulps = ulps
        self.where = where
        self.gen = torch.Generator().manual_seed(derive_seed(seed, rank) >> 1)
        self.calls = 0
        self.seed = seed
        self.rank = rank
        self._passes: dict[int, int] = {}
        self._hooks = [m.register_forward_hook(self._hook) for m in model.modules()
                       if isinstance(m, nn.Linear)]
        if not self._hooks:
            raise ValueError("LinearNoise: the model has no nn.Linear layer to perturb.")

    def _hook(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.where == "accumulator" and out.dtype in (torch.bfloat16, torch.float16):
            noisy = nudge(_in_float32(module, args[0], out.dtype), self.ulps,
                          self.gen).to(out.dtype)
        else:
            noisy = nudge(out, self.ulps, self.gen)
        return out + (noisy - out).detach()  # the gradient flows as through the layer's output

    def begin(self, key: int) -> None:
        """A computation of the batch ``key`` (e.g. its fingerprint) starts: seed the draws
        from ``(seed, rank, key, how many times this rank computed it before)``."""
        if isinstance(key, bool) or not isinstance(key, int):
            raise TypeError(f"LinearNoise.begin(key): key must be an int that names the batch "
                            f"(e.g. sdc_guard.fingerprint of its inputs), got {key!r}.")
        n = self._passes.get(key, 0)
        self._passes[key] = n + 1
        self.gen.manual_seed(derive_seed(self.seed, self.rank, key, n) >> 1)

    def forget(self) -> None:
        """Start the per-batch counts over (the next computation of every batch is a first)."""
        self._passes.clear()

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
