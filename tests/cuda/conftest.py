"""Every test under tests/cuda carries the ``cuda`` marker and is skipped, saying why, where
torch finds no CUDA device (the test modules import no pytest: the device script runs them
without it)."""

from __future__ import annotations

import pytest
import torch

NO_CUDA = pytest.mark.skip(reason="needs a CUDA device: torch.cuda.is_available() is False "
                                  "(python -m bench.device_check runs these on a GPU machine)")


def pytest_itemcollected(item: pytest.Item) -> None:
    item.add_marker(pytest.mark.cuda)
    if not torch.cuda.is_available():
        item.add_marker(NO_CUDA)
