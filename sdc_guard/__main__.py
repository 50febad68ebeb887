"""``python -m sdc_guard``: operator commands (``quarantine list|show|release``,
``events summarize``)."""

from __future__ import annotations

import argparse
import sys

from sdc_guard import summary
from sdc_guard.remediation import cli as quarantine_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sdc_guard",
                                     description=(__doc__ or "").replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    quarantine_cli.add_parser(sub)
    summary.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "events":
        return summary.run(args)
    return quarantine_cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
