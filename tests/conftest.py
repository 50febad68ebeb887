"""Fixtures shared by every test package. Multi-rank tests start their ranks with
``tests.launch.run_ranks`` and take their rank functions from ``tests.workers``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo process group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
