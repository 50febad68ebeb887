"""``python -m scenarios``: see ``scenarios.cli``."""

if __name__ == "__main__":
    import sys

    from scenarios.run.forkserver import start_for

    start_for(sys.argv[1:])  # the ranks' fork server imports torch while this process does
    from scenarios.cli import main

    raise SystemExit(main())
