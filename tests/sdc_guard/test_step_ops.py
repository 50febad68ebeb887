"""The ops a guarded step adds do not grow with the number of parameters (the path GPUs take).

On a GPU each aten op is a kernel launch or more, and a step that launches per parameter
tensor pays for it on a large model. The default checks' own work (the non-finite flags and
scan, the weights fingerprint of every parameter and optimizer state, the vote) runs in a
number of ops that does not depend on the model's depth: counted here against a plain loop
with the same model, optimizer and data, on a model with 1 hidden layer (6 parameter tensors,
18 with AdamW's state) and with 7 (18, 54). View ops (``detach``, ``view``, ``t``...) launch
nothing and are left out. DDP's own bucket copies differ between its built-in all-reduce
(a ``mul`` per gradient) and a comm hook (a ``copy_`` per gradient), one for one, so they are
counted together. The replay's digests are counted in ``test_dispatch_counts.py``; its
recomputation is a forward and backward, as deep as the model.
"""

from __future__ import annotations

import collections

from tests.launch import run_ranks
from tests.sdc_guard import read_workers

_VIEWS = {"detach", "view", "_unsafe_view", "t", "slice", "select", "alias", "as_strided",
          "_reshape_alias", "expand", "unsqueeze", "squeeze", "transpose", "permute", "unbind",
          "split", "narrow", "view_as_real", "reshape", "_to_copy_view"}


def _added(config: dict[str, object] | None, layers: int) -> collections.Counter[str]:
    per = run_ranks(read_workers.reads_per_step, 2, config, "adamw", 5, layers, True)[0]
    last = collections.Counter(per[-1])
    for v in _VIEWS:
        last.pop(v, None)
    last["copy_ or mul"] = last.pop("copy_", 0) + last.pop("mul", 0)
    return last


def test_the_default_checks_add_as_many_ops_to_a_deep_model_as_to_a_shallow_one() -> None:
    added = {}
    for layers in (1, 7):
        plain, guarded = _added(None, layers), _added({}, layers)
        guarded.subtract(plain)
        added[layers] = {k: v for k, v in guarded.items() if v}
    assert added[1] == added[7], added
    assert sum(added[1].values()) > 0  # the checks ran: they add ops of their own
