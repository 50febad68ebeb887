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


def test_the_launches_section_times_the_defaults_with_and_without_the_check() -> None:
    res = section.checksum_launches(2, rounds=4, block=2, launches=2, batch=8)
    assert (res["world"], res["rounds"], res["block"], res["launches"]) == (2, 4, 2, 2)
    assert {k: len(v) for k, v in res["round_step_s"].items()} == {
        section.DEFAULTS: 4, section.DEFAULTS_CHECKSUM: 4}  # both launches' rounds, pooled
    assert res["step_ms"] > 0 and res["step_ms_checksum"] > 0
    assert math.isfinite(res["overhead"]) and res["overhead"] > -1.0
    assert len(res["overhead_per_launch"]) == 2
    table = "\n".join(section.checksum_launches_md(res))
    assert "over 2 launches (2 ranks x 1 thread)" in table
    assert "4 rounds in 2 launches of 2 rounds" in table
    assert f"**{res['overhead'] * 100:+.1f}%**" in table
    with pytest.raises(ValueError, match=r"launches=3: give a positive divisor of rounds=4"):
        section.checksum_launches(2, rounds=4, block=2, launches=3, batch=8)
    with pytest.raises(ValueError, match=r"rounds=3: give a positive multiple of 2"):
        section.checksum_launches(2, rounds=3, block=2, launches=1, batch=8)


def test_the_launches_interval_resamples_whole_launches() -> None:
    # Four launches of two rotations each, the check costing 0%, 1%, 2% and 3% in them; the
    # rounds of a rotation alternate which configuration ran first (+0.3% for the second).
    off, on = section.PAIR
    times: dict[str, list[float]] = {off: [], on: []}
    for cost in (0.00, 0.01, 0.02, 0.03):
        for _ in range(2):
            times[off] += [1.000, 1.003]
            times[on] += [(1.0 + cost) * 1.003, 1.0 + cost]
    res = section.launch_stats(times, times, launches=4)
    assert [round(x, 6) for x in res["overhead_per_launch"]] == [0.0, 0.01, 0.02, 0.03]
    assert abs(res["overhead"] - 0.015) < 1e-9  # the median over the 8 rotations
    lo, hi = res["overhead_interval_90"]
    assert lo <= 0.005 and hi >= 0.025  # launches drawn whole: it spans most of their spread
    assert res["cpu_overhead_interval_90"] == res["overhead_interval_90"]
    # One launch: the interval resamples rotations, all of them alike here.
    one = section.launch_stats({off: [1.0, 1.0] * 4, on: [1.02, 1.02] * 4},
                               {off: [1.0] * 8, on: [1.0] * 8}, launches=1)
    assert [round(x, 6) for x in one["overhead_interval_90"]] == [0.02, 0.02]
    assert one["cpu_overhead"] == 0.0
