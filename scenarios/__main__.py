"""``python -m scenarios``: see ``scenarios.cli``."""

HARNESS = ("matplotlib", "tqdm", "pandas", "numpy", "scipy", "kubernetes", "jsonpatch")
"""What the ``harness`` extra installs (pyproject.toml), by import name."""


def missing_harness() -> list[str]:
    """The harness's dependencies that cannot be imported here (none imported to find out)."""
    from importlib.util import find_spec

    return [name for name in HARNESS if find_spec(name) is None]


if __name__ == "__main__":
    import sys

    missing = missing_harness()
    if missing:
        sys.exit(f"python -m scenarios needs the harness's dependencies ({', '.join(missing)} "
                 "missing): in the clone, pip install -e '.[harness]' (or run it through nox: "
                 "python3 -m nox -s inject)")
    from scenarios.run.forkserver import start_for

    start_for(sys.argv[1:])  # the ranks' fork server imports torch while this process does
    from scenarios.cli import main

    raise SystemExit(main())
