"""torch is the library's only hard dependency: no path of a guarded run needs NumPy.

torch's object collectives (``all_gather_object``) read the gathered bytes back through
NumPy; the library gathers pickled bytes as a tensor of its own instead
(``collectives.gather_objects``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from sdc_guard.collectives import gather_objects
from tests.launch import run_ranks, scaled

ROOT = Path(__file__).resolve().parents[2]


def _gather(rank: int, world: int) -> list[Any]:
    mine = {"rank": rank, "payload": "x" * (10 ** rank), "none": None}  # sizes differ by rank
    return gather_objects(mine, None)


def test_objects_of_every_size_come_back_in_rank_order() -> None:
    for got in run_ranks(_gather, 3):
        assert got == [{"rank": r, "payload": "x" * (10 ** r), "none": None} for r in range(3)]


_SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import sdc_guard

    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def loss_fn(m, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(m(x), y)

    def batch_for(rank, step):
        g = torch.Generator().manual_seed(1000 * rank + step)
        return torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)

    ckpt = sdc_guard.CheckpointManager(sys.argv[2], keep=2)
    guard = sdc_guard.SDCGuard(model, opt, loss_fn=loss_fn, batch_for=batch_for,
                               config=sdc_guard.GuardConfig(), checkpoints=ckpt)
    for step in range(3):
        guard.step(step)
        ckpt.save(step, model, opt)
    assert ckpt.restore(model, opt) == 3
    guard.flush()
    dist.destroy_process_group()
    print("ok")
""")


def test_a_guarded_run_with_checkpoints_needs_no_numpy(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "store"),
                          str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True, text=True,
                         timeout=scaled(240), check=False)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
