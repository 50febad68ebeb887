"""``python -m bench.compare``: its pure parts, and that a measurement process imports its own
tree's modules (the measurements themselves are the bench's own, tested beside them)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from bench.compare import (
    MARKER,
    ROWS,
    call_with,
    check_paths,
    difference_interval,
    markdown,
    parse_report,
    run_child,
    signature,
    source_digest,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]


def _report(values: dict[str, list[list[float]]], seconds: float = 1.0) -> dict[str, Any]:
    """A measurement process's report with the given units per row."""
    sections: dict[str, Any] = {}
    for row in ROWS:
        if row.key in values:
            sec = sections.setdefault(row.section, {"rows": {}, "seconds": seconds,
                                                    "signature": f"{row.section}(x)",
                                                    "dropped": []})
            sec["rows"][row.key] = values[row.key]
    return {"paths": {}, "sections": sections}


def test_the_report_is_the_last_marker_line_whatever_else_is_printed() -> None:
    out = f"noise\n{MARKER}{{\"a\": 1}}\nrank says hi\n{MARKER}{{\"a\": 2}}\ntrailing\n"
    assert parse_report(out) == {"a": 2}
    with pytest.raises(ValueError, match="printed no report"):
        parse_report("Traceback ...\nboom\n")


def test_call_with_leaves_out_what_a_tree_s_function_does_not_take() -> None:
    def old(world: int, rounds: int, batch: int = 128) -> dict[str, Any]:
        return {"world": world, "rounds": rounds, "batch": batch}

    res, dropped = call_with(old, {"world": 3, "rounds": 2, "launches": 4})
    assert res == {"world": 3, "rounds": 2, "batch": 128} and dropped == ["launches"]
    with pytest.raises(TypeError, match=r"needs \['rounds'\]"):
        call_with(old, {"world": 3})

    def anything(**kwargs: Any) -> dict[str, Any]:
        return kwargs

    assert call_with(anything, {"x": 1}) == ({"x": 1}, [])
    assert signature(old).endswith(".old(world, rounds, batch=...)")


def test_the_interval_of_the_difference_pairs_units_and_needs_three() -> None:
    before = [[1.00, 1.01], [1.02, 0.99], [1.00, 1.00], [1.01, 1.02], [0.99, 1.00]]
    after = [[x + 0.10 for x in u] for u in before]
    lo, hi = difference_interval(before, after) or (None, None)
    assert lo is not None and hi is not None
    assert lo == pytest.approx(0.10) and hi == pytest.approx(0.10)  # the shift every pair shares
    lo, hi = difference_interval(before, before[::-1]) or (None, None)
    assert lo is not None and hi is not None and lo < 0 < hi  # the same samples, reordered
    assert difference_interval(before[:2], after[:2]) is None  # too few pairs
    assert difference_interval(before, after[:4]) is None  # one side lost a process


def test_summary_medians_ratios_and_verdicts() -> None:
    base = {"overhead_defaults": 1.12, "guard_off": 1.003, "fingerprint_c": 1.0}
    shift = {"overhead_defaults": 0.05, "guard_off": 0.0, "fingerprint_c": -0.2}
    noise = (-0.002, 0.0, 0.002)
    before = [_report({k: [[v + e]] for k, v in base.items()}) for e in noise]
    after = [_report({k: [[v + shift[k] + e]] for k, v in base.items()}) for e in noise]
    rows = {r["key"]: r for r in summarize(before, after)}
    d = rows["overhead_defaults"]
    assert d["before"] == pytest.approx(1.12) and d["after"] == pytest.approx(1.17)
    assert d["after_over_before"] == pytest.approx(1.17 / 1.12)
    assert d["difference"] == pytest.approx(0.05) and d["units"] == [3, 3]
    assert d["verdict"] == "worse"  # a step-time ratio: lower is better
    assert rows["fingerprint_c"]["verdict"] == "worse"  # throughput: higher is better
    lo, hi = rows["guard_off"]["difference_interval_90"]
    assert lo <= 0 <= hi and rows["guard_off"]["verdict"] == "no difference shown"
    assert rows["replay"]["before"] is None and rows["replay"]["verdict"] == "-"


def test_the_table_names_both_trees_every_row_and_the_missing() -> None:
    before = [_report({"checksum": [[1.02, 1.03]]})]
    after = [_report({"checksum": [[1.02, 1.04]]})]
    res = {"cpu": "Some CPU (AVX2), x86_64", "quick": True, "rounds": 1, "torch": "2.x",
           "threads": 2, "seconds": 90.0,
           "trees": {"before": {"path": "/b", "commit": "5c622e6", "changes": 0, "digest": "ab" * 32},
                     "after": {"path": "/a", "commit": "90a4912", "changes": 7, "digest": "cd" * 32}},
           "rows": summarize(before, after), "notes": ["replay, after: failed"],
           "section_seconds": {"checksum": {"before": 10.0, "after": 11.0}}}
    md = markdown(res)
    assert "Some CPU (AVX2)" in md and "5c622e6" in md and "90a4912 with 7 changed" in md
    assert all(row.label in md for row in ROWS)
    line = next(x for x in md.splitlines() if x.startswith("| defaults + checksum / defaults"))
    assert "| 1.0250 | 1.0300 |" in line and line.endswith("| 1 / 1 | - |")
    assert "| fingerprint, C kernel / torch.sum | higher | - | - |" in md
    assert "replay, after: failed" in md


def test_paths_outside_the_tree_are_refused(tmp_path: Path) -> None:
    inside = {"paths": {"sdc_guard": str(tmp_path / "sdc_guard" / "__init__.py")},
              "rank_sdc_guard": str(tmp_path / "sdc_guard" / "__init__.py")}
    check_paths(inside, tmp_path)
    with pytest.raises(RuntimeError, match="outside"):
        check_paths({**inside, "rank_sdc_guard": "/elsewhere/sdc_guard/__init__.py"}, tmp_path)
    with pytest.raises(RuntimeError, match="outside"):
        check_paths({"paths": {"bench": "not importable: ModuleNotFoundError"}}, tmp_path)


def _tree(root: Path, *, with_sdc_guard: bool = True) -> Path:
    """A source tree with stand-in packages (the measurement process needs bench.timing)."""
    for name in ("sdc_guard", "bench", "scenarios"):
        if name != "sdc_guard" or with_sdc_guard:
            (root / name).mkdir(parents=True)
            (root / name / "__init__.py").write_text(f"TREE = {str(root)!r}\n")
    shutil.copy(ROOT / "bench" / "timing.py", root / "bench" / "timing.py")
    return root


def test_a_measurement_process_imports_its_own_tree(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    report = run_child(tree, {"sections": {}, "probe_ranks": False}, timeout=120)
    assert report["paths"] == {name: str((tree / name / "__init__.py").resolve())
                               for name in ("sdc_guard", "bench", "scenarios")}
    assert Path(report["cwd"]).resolve() == tree.resolve()
    # A tree without sdc_guard gets another's (the editable install's) or none: refused.
    bare = _tree(tmp_path / "bare", with_sdc_guard=False)
    with pytest.raises(RuntimeError, match="outside"):
        run_child(bare, {"sections": {}, "probe_ranks": False}, timeout=120)


def test_the_digest_follows_the_sources(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "tree")
    first = source_digest(tree)
    (tree / "sdc_guard" / "__pycache__").mkdir()
    (tree / "sdc_guard" / "__pycache__" / "x.py").write_text("ignored")
    assert source_digest(tree) == first
    (tree / "sdc_guard" / "kernel.c").write_text("int x;")
    assert source_digest(tree) != first


def test_rows_are_taken_from_the_sections_results_as_the_bench_takes_them() -> None:
    from bench.checksum import DEFAULTS, DEFAULTS_CHECKSUM
    from bench.compare import _checksum_rows, _fingerprint_rows, _replay_rows

    # 2 launches of 4 rounds: each launch 2 rotations of the pair, the ratio of their means.
    res = {"rotation_rounds": 2, "launches": 2,
           "round_step_s": {DEFAULTS: [1.0, 1.0, 2.0, 2.0, 1.0, 3.0, 1.0, 1.0],
                            DEFAULTS_CHECKSUM: [1.1, 1.1, 2.0, 2.4, 2.0, 2.0, 1.0, 1.0]}}
    assert _checksum_rows(res) == {"checksum": [[pytest.approx(1.1), pytest.approx(1.1)],
                                                [pytest.approx(1.0), pytest.approx(1.0)]]}
    fp = {"methods": {"torch.sum (one read pass)": {"ratio_to_sum": 1.0},
                      "sdc_guard.fingerprint (torch ops: no C compiler)": {"ratio_to_sum": 0.4},
                      "sdc_guard.fingerprint (C kernel, the default: avx2)": {"ratio_to_sum": 0.98},
                      "sdc_guard.fingerprint (C kernel, baseline forced)": {"ratio_to_sum": 0.9}}}
    assert _fingerprint_rows(fp) == {"fingerprint_c": [[0.98]], "fingerprint_torch": [[0.4]]}
    del fp["methods"]["sdc_guard.fingerprint (C kernel, the default: avx2)"]  # no compiler
    assert set(_fingerprint_rows(fp)) == {"fingerprint_torch"}
    replay = {"intervals": {str(k): {"per_audit_step_ratio": 1 + k / 100} for k in (1, 2, 5)}}
    assert _replay_rows(replay) == {"replay": [[1.01, 1.02, 1.05]]}
