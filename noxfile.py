"""Developer sessions: ``nox -s tests`` (default), ``lint``, ``attack``, ``bench``, ``inject``, ``docs``,
and the stand-alone benchmarks (``shards``, ``fsdp_bench``, ``tolerant_bench``, ...)."""

from __future__ import annotations

from pathlib import Path

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


def _tests_python(session: nox.Session) -> Path | None:
    """The interpreter of the ``tests`` session's environment, when one exists beside this one."""
    if not session.virtualenv.location:
        return None
    envdir = Path(session.virtualenv.location).parent / "tests"
    found = [p for p in (envdir / "bin" / "python", envdir / "Scripts" / "python.exe") if p.exists()]
    return found[0] if found else None


@nox.session
def lint(session: nox.Session) -> None:
    """ruff on everything; mypy --strict on sdc_guard, injectors, scenarios, bench and tests.

    mypy reads torch's (and the other dependencies') types from the ``tests`` session's
    environment when it exists, rather than installing a second copy of torch and the harness
    (1.2 GB; a CI machine's disk ran out on it). Run alone on a fresh clone, lint installs them.
    """
    session.install(*CONSTRAINTS, "ruff", "mypy")
    tests_python = _tests_python(session)
    if tests_python is None:
        _install(session)
    where = [] if tests_python is None else ["--python-executable", str(tests_python)]
    session.run("ruff", "check", ".")
    session.run("mypy", *where, "sdc_guard", "injectors", "scenarios", "bench", "kube_standin", "tests")


@nox.session(default=False)
def attack(session: nox.Session) -> None:
    """Issue 60's attack table: every attack's test run and judged; reports/ATTACK.md, attack.json.

    It runs in the ``tests`` session's environment when one exists (the same install: torch,
    the harness, pytest-xdist), else installs that environment's packages here.
    """
    tests_python = _tests_python(session)
    if tests_python is None:
        _install(session)
        session.run("python", "-m", "tests.attack", *session.posargs)
    else:
        session.run(str(tests_python), "-m", "tests.attack", *session.posargs, external=True)


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
def tolerant_bench(session: nox.Session) -> None:
    """The tolerant replay audit on the CPU testbed, beside the exact one (``bench/TOLERANT.md``)."""
    _install(session)
    session.run("python", "-m", "bench.tolerant", *session.posargs)


@nox.session(default=False)
def fsdp_bench(session: nox.Session) -> None:
    """The guard's cost over plain FSDP2 (and DDP) on the Llama-style model; bench/fsdp.json."""
    _install(session)
    session.run("python", "-m", "bench.fsdp", *session.posargs)


@nox.session(default=False)
def bursts(session: nox.Session) -> None:
    """Bursts of flipped bits that escape the fingerprint and the digest; bench/BURSTS.md."""
    _install(session)
    session.run("python", "-m", "bench.bursts", *session.posargs)


@nox.session(default=False)
def versions(session: nox.Session) -> None:
    """The fingerprint's version 2 beside version 1 and torch.sum; bench/VERSIONS.md."""
    _install(session)
    session.run("python", "-m", "bench.versions", *session.posargs)


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """False positives of every check on clean FSDP2 and HSDP runs; bench/soak.json."""
    _install(session)
    session.run("python", "-m", "bench.soak", *session.posargs)


@nox.session(default=False)
def guard_off(session: nox.Session) -> None:
    """The guard's own cost per step with its checks off, measured directly; bench/guard_off.json."""
    _install(session)
    session.run("python", "-m", "bench.guard_off", *session.posargs)


@nox.session(default=False)
def compare(session: nox.Session) -> None:
    """The bench's headline ratios of two trees, interleaved (-- --before DIR); bench/COMPARE.md."""
    _install(session)
    session.run("python", "-m", "bench.compare", *session.posargs)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The API reference from the docstrings (pdoc) into docs/_build/api; fails on a broken one."""
    session.install(*CONSTRAINTS, "-e", ".", "pdoc")
    session.run("python", "docs/build_api.py", *session.posargs)


@nox.session(default=False)
def inject(session: nox.Session) -> None:
    """The main job: the default fault-injection campaign into reports/default/ (-- --quick: short)."""
    _install(session)
    session.run(
        "python", "-m", "scenarios", "campaign", "scenarios/configs/default.toml", *session.posargs
    )
