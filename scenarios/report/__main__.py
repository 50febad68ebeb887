"""``python -m scenarios.report DIR [--gpus N ...]``: rebuild a report with cost-model overrides.

The same as ``python -m scenarios report DIR``, plus the ``[cluster]`` fields as options
(``scenarios.spec.cluster.add_cluster_arguments``), which win over the campaign's table,
and ``--overhead-file`` (your hardware's overheads, ``scenarios.report.overheads``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scenarios.report.render import summary_text, write_report
from scenarios.spec.cluster import add_cluster_arguments, cluster_overrides
from scenarios.spec.errors import ScenarioError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scenarios.report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", help="a campaign output directory (with trials.csv)")
    add_cluster_arguments(ap)
    ap.add_argument("--overhead-file", metavar="FILE",
                    help="your hardware's per-check overheads: bench/results.json from "
                         "python -m bench on it, or a JSON mapping such as "
                         '{"weights": 0.05} (docs/cost-model.md); --check-overhead wins')
    args = ap.parse_args(argv)
    out = Path(args.dir)
    try:
        if not (out / "trials.csv").exists():
            raise ScenarioError("dir", str(out), "a campaign output directory with trials.csv")
        print(summary_text(write_report(out, cluster_overrides(args), args.overhead_file),
                           out))
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
