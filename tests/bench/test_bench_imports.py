"""bench/ reaches below the public API only through ``sdc_guard.internal`` (its promise)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_bench_imports_only_the_public_api_and_the_internal_interface() -> None:
    seen: dict[str, set[str]] = {}
    for f in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.startswith("sdc_guard"):
                    seen.setdefault(name, set()).add(f.name)
    assert "sdc_guard.internal" in seen  # the check looks where bench imports
    private = {m: sorted(files) for m, files in seen.items()
               if m not in ("sdc_guard", "sdc_guard.internal")}
    assert not private, private
