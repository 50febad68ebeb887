"""The checksum section of ``python -m bench`` runs and reports both baselines."""

from __future__ import annotations

import math

import pytest

import bench.checksum as section


def test_the_checksum_section_times_both_baselines_and_renders_its_table(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # One small workload on 2 ranks (the full bench runs three on 3); the ranks assert that
    # the headline baseline never registered a comm hook.
    monkeypatch.setattr(section, "WORKLOADS", {"reference MLP, batch 8": ("mlp", 8)})
    res = section.checksum_overhead(2, rounds=7, block=2)
    assert (res["world"], res["rounds"], res["block"]) == (2, 7, 2)
    (name, w), = res["workloads"].items()
    assert name == "reference MLP, batch 8"
    assert w["step_ms_off"] > 0 and w["step_ms_off_hooked"] > 0
    assert set(w["bounds"]) == {"exact", "norm"}
    for b in w["bounds"].values():
        assert b["step_ms"] > 0
        for key in ("overhead", "cpu_overhead", "overhead_vs_hooked"):
            assert math.isfinite(b[key]) and b[key] > -1.0
        for key in ("overhead_interval_90", "overhead_vs_hooked_interval_90"):
            lo, hi = b[key]
            assert lo <= hi
    d = w["defaults"]  # the defaults with the check against the defaults alone
    assert d["step_ms"] > 0 and d["step_ms_checksum"] > 0
    assert math.isfinite(d["overhead"]) and d["overhead"] > -1.0
    assert math.isfinite(d["cpu_overhead"]) and d["overhead_interval_90"][0] <= \
        d["overhead_interval_90"][1]
    table = "\n".join(section.checksum_md(res))
    assert "(2 ranks x 1 thread)" in table and "Blocks of 2 steps after one untimed step (the " \
        "first after a switch builds the check" in table and "once in a training run), 7 rounds" \
        in table and "the median over whole rotations (7 rounds: every configuration once" in table
    assert {len(v) for v in w["round_step_s"].values()} == {7}  # kept per round
    # A run published before the untimed step and the rotations says what it measured.
    old = "\n".join(section.checksum_md({k: v for k, v in res.items()
                                         if k not in ("untimed_first", "rotation_rounds")}))
    assert "Blocks of 2 steps, 7 rounds" in old and "untimed" not in old
    assert "the median over rounds of each round's ratio" in old and "rotation" not in old
    with pytest.raises(ValueError, match=r"rounds=3: give a positive multiple of 7"):
        section.checksum_overhead(2, rounds=3, block=2)
    rows = [line for line in table.splitlines() if line.startswith("| reference MLP, batch 8")]
    assert [row.split(" | ")[1] for row in rows[:2]] == ["exact", "norm"]
    assert len(rows) == 3 and rows[2].count("|") == 7  # the defaults' table: one row
    assert "`GuardConfig(checksum=True)` against `GuardConfig()`" in table
    # The defaults with the checksum's weight sums in a read of their own, beside them.
    assert d["step_ms_own_read"] > 0 and math.isfinite(d["overhead_own_read"])
    assert "taken in a read of its own" in table
    # A run published before the defaults were timed renders without their table.
    older = {**res, "workloads": {name: {k: v for k, v in w.items() if k != "defaults"}}}
    assert "GuardConfig()" not in "\n".join(section.checksum_md(older))
