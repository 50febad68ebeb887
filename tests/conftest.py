"""Fixtures shared by every test package. Multi-rank tests start their ranks with
``tests.launch.run_ranks`` and take their rank functions from ``tests.workers``.

The suite's speed factor (``tests.launch.speed_factor``) is settled here once per session,
before any test worker or rank starts: taken from ``SDC_GUARD_TEST_SPEED`` when set, else
measured (``measure_speed_factor``) and put into that variable, which every process the
session starts inherits. Every ``timeout`` mark (and pytest-timeout's default) is multiplied
by it, as ``run_ranks`` multiplies its own timeout: a slow or busy machine waits longer, and a
hang still fails. The header of the run names the factor and where it came from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.launch import SPEED_ENV, measure_speed_factor, parse_speed, speed_factor

_source_key = pytest.StashKey[str]()
"""Where this session's speed factor came from, for the header."""


def pytest_configure(config: pytest.Config) -> None:
    raw = os.environ.get(SPEED_ENV)
    if raw is not None:
        try:
            parse_speed(raw)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        # an xdist worker inherits the controller's value: it measured, the worker did not
        config.stash[_source_key] = "set by " + SPEED_ENV
        return
    factor = measure_speed_factor()
    os.environ[SPEED_ENV] = f"{factor:.2f}"
    config.stash[_source_key] = f"measured; set {SPEED_ENV} to impose one"


def pytest_report_header(config: pytest.Config) -> str:
    return (f"sdc-guard test speed factor: {speed_factor():g} ({config.stash[_source_key]}); "
            "hang timeouts are multiplied by it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Multiply every test's timeout (its mark, else the configured default) by the factor."""
    factor = speed_factor()
    if factor == 1.0 or not config.pluginmanager.hasplugin("timeout"):
        return
    # the plugin's own reading of its settings (it ships no type information)
    from pytest_timeout import get_env_settings  # type: ignore[import-untyped]

    default = get_env_settings(config).timeout
    for item in items:
        mark = item.get_closest_marker("timeout")
        args = () if mark is None else mark.args
        kwargs = {} if mark is None else dict(mark.kwargs)
        base = args[0] if args else kwargs.pop("timeout", default)
        if not base:  # no timeout, or 0: none to scale
            continue
        # prepended: the closest mark, ahead of the test's own (pytest-timeout reads that one)
        item.add_marker(pytest.mark.timeout(float(base) * factor, *args[1:], **kwargs),
                        append=False)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo process group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _library_log_level() -> Iterator[None]:
    """The ``sdc_guard`` logger's level as each test found it: the harness's commands, run in
    this process by some tests, quieten it (as they do in their own process), which hid the
    warnings later tests of the same worker look for."""
    logger = logging.getLogger("sdc_guard")
    level = logger.level
    yield
    logger.setLevel(level)
