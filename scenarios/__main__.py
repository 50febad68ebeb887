"""``python -m scenarios``: see ``scenarios.cli``."""

from scenarios.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
