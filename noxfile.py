"""Developer sessions: ``nox -s tests`` (default), ``nox -s lint``, ``nox -s bench``, ``nox -s inject``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

CONSTRAINTS = ("-c", "constraints.txt")


def _install(session: nox.Session) -> None:
    # torch is pinned to the CPU wheel in constraints.txt: a bare requirement would pull CUDA.
    session.install(*CONSTRAINTS, "-e", ".[dev]")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (multi-rank tests on gloo, two workers)."""
    _install(session)
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on everything, mypy --strict on the library and the injectors."""
    _install(session)
    session.run("ruff", "check", ".")
    session.run("mypy", "sdc_guard", "injectors")


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Fingerprint throughput and per-check overhead; writes bench/results.json and RESULTS.md."""
    _install(session)
    session.run("python", "-m", "bench", *session.posargs)


@nox.session(default=False)
def shards(session: nox.Session) -> None:
    """What sharding a campaign costs: the quick campaign whole and as 2 shards; bench/shards.json."""
    _install(session)
    session.run("python", "-m", "bench.shards", *session.posargs)


@nox.session(default=False)
def inject(session: nox.Session) -> None:
    """The main job: the default fault-injection campaign into reports/default/ (-- --quick: short)."""
    _install(session)
    session.run(
        "python", "-m", "scenarios", "campaign", "scenarios/configs/default.toml", *session.posargs
    )
