"""``python -m bench.guard_off`` runs end to end and writes what it prints."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the harness runs from the clone's root


def test_guard_off_writes_its_table_and_json(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.guard_off", "--rounds", "2", "--block",
                          "1", "--out", str(tmp_path)], check=True, capture_output=True,
                         text=True, timeout=300, cwd=ROOT).stdout
    res = json.loads((tmp_path / "guard_off.json").read_text())
    assert set(res["models"]) == {"reference MLP (512-1024-1024-10), batch 128",
                                  "tiny MLP (16-16-10), batch 8"}
    for m in res["models"].values():
        lo, hi = m["extra_cpu_interval_90_s"]
        assert m["plain_step_cpu_s"] > 0 and lo <= hi
    assert "guard's extra (us)" in out and "does not grow with the model" in out
    bad = subprocess.run([sys.executable, "-m", "bench.guard_off", "--rounds", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--rounds and --block must be at least 1" in bad.stderr


def test_the_three_rank_guard_off_table_runs_under_the_allocator_it_is_given() -> None:
    # bench.overhead.check_guard_off has each rank set glibc's mallopt first: with the heap
    # kept (no trimming) a step no longer faults AdamW's temporaries back in (6 MB a step on
    # this model: the full bench's ranks fault 400-600 pages a step when glibc trims). Some
    # faults remain that no malloc setting reaches (the interpreter maps its own object arenas;
    # a loaded CI machine measured 131 a step in both loops), so the bound is set between the
    # two; how often the defaults fault depends on the process's history, so no count is
    # asserted for them. The page gets a section of its own for that run, with the page
    # faults per step.
    from bench.overhead import NO_TRIM, check_guard_off
    from bench.reference import PLAIN_DDP_VIEWS
    from bench.results import guard_off_md
    from scenarios.spec.overhead import CHECKS_OFF

    configs = (PLAIN_DDP_VIEWS, CHECKS_OFF)
    kept = check_guard_off(2, rounds=6, block=2, batch=8, configs=configs, allocator=NO_TRIM)
    assert kept["allocator"] == {"M_TRIM_THRESHOLD": 2**31 - 1, "M_MMAP_THRESHOLD": 32 << 20}
    assert kept["configs"] == [PLAIN_DDP_VIEWS.name, CHECKS_OFF.name]
    assert set(kept["page_faults_per_step"]) == set(kept["configs"])
    assert max(kept["page_faults_per_step"].values()) < 300, kept["page_faults_per_step"]
    (pair, (ratio, (lo, hi))), = kept["guard_off_vs_plain"].items()
    assert pair == f"{CHECKS_OFF.name} / {PLAIN_DDP_VIEWS.name}" and lo <= hi
    assert -1.0 < ratio < 1.0
    # The ratio is estimated over whole rotations (2 rounds here), from samples kept per round.
    assert kept["rotation_rounds"] == 2
    assert {len(v) for v in kept["round_step_s"].values()} == {6}
    assert {len(v) for v in kept["round_main_thread_cpu_s"].values()} == {6}
    page = "\n".join(guard_off_md(kept, reference=True))
    assert "glibc's heap trimming off" in page and "mallopt(M_TRIM_THRESHOLD, 2147483647)" in page
    assert "Minor page faults per step" in page
    assert "the median over whole rotations (2 rounds: every configuration once" in page
    # The default allocator's section says how the blocks were timed; a run published
    # before the untimed first step says what it measured.
    trimming = {**kept, "allocator": {}}
    assert "Blocks of 2 steps after one untimed step (the first after a switch" in "\n".join(
        guard_off_md(trimming, reference=True))
    before = "\n".join(guard_off_md({k: v for k, v in trimming.items()
                                      if k not in ("untimed_first", "rotation_rounds")},
                                     reference=True))
    assert "Blocks of 2 steps with no barrier" in before and "untimed" not in before
    assert "the median over rounds of each round's ratio" in before and "rotation" not in before


def test_whole_rotations_cancel_what_a_blocks_position_adds() -> None:
    # Three configurations rotated round by round, b truly 2% slower than a, and a block's
    # position in its round scaling its time (+5% second, -1% third): each round's ratio
    # carries the difference of two positions, and their median is off by 1%; the ratio of
    # each rotation's means is b's own.
    from bench.timing import per_rotation

    names = ("a", "b", "c")
    truth = {"a": 1.0, "b": 1.02, "c": 0.9}
    position = (1.0, 1.05, 0.99)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(9):
        order = names[r % 3:] + names[:r % 3]
        for p, name in enumerate(order):
            times[name].append(truth[name] * position[p])
    per_round = statistics.median(b / a for a, b in zip(times["a"], times["b"], strict=True))
    assert abs(per_round - 1.02) > 0.009
    rot = per_rotation(times, 3)
    assert {len(v) for v in rot.values()} == {3}
    assert all(abs(b / a - 1.02) < 1e-12 for a, b in zip(rot["a"], rot["b"], strict=True))


def test_a_block_timed_run_refuses_rounds_that_are_not_whole_rotations() -> None:
    from bench.overhead import BLOCK_CONFIGS, check_guard_off, check_overhead_blocks

    with pytest.raises(ValueError, match=r"rounds=6: give a positive multiple of 4"):
        check_guard_off(2, rounds=6, block=2, batch=8)
    with pytest.raises(ValueError, match=r"rounds=0: give a positive multiple of "
                       + str(len(BLOCK_CONFIGS))):
        check_overhead_blocks(2, rounds=0, block=2, batch=8)


def test_launches_are_what_the_guard_off_intervals_resample() -> None:
    # Four launches of two rotations each; the guard with its checks off is 0%, 1%, 2% and
    # 6% slower than plain DDP by launch (the allocator's draw of each launch's processes),
    # the same in every rotation of a launch. Resampling rotations as if they were
    # independent would count each launch's draw twice; the launch is the unit.
    from bench.overhead import block_stats
    from bench.reference import CHECKS_OFF_COPIED, PLAIN_DDP_VIEWS
    from bench.results import guard_off_md
    from scenarios.spec.overhead import CHECKS_OFF, PLAIN_DDP

    names = [PLAIN_DDP.name, PLAIN_DDP_VIEWS.name, CHECKS_OFF.name, CHECKS_OFF_COPIED.name]
    slower = (0.0, 0.01, 0.02, 0.06)
    raw: dict[str, dict[str, list[float]]] = {w: {k: [] for k in names}
                                              for w in ("times", "cpu", "main", "faults")}
    for launch, d in enumerate(slower):
        for _ in range(2 * len(names)):
            for k in names:
                t = 0.04 * (1 + d) if k == CHECKS_OFF.name else 0.04
                raw["times"][k].append(t)
                raw["cpu"][k].append(t)
                raw["main"][k].append(t / 2)
                raw["faults"][k].append(100.0 * launch)
    res = block_stats(names, raw, launches=4)
    pair = f"{CHECKS_OFF.name} / {PLAIN_DDP_VIEWS.name}"
    assert res["launches"] == 4
    assert res["guard_off_vs_plain_per_launch"][pair] == pytest.approx(list(slower))
    ratio, (lo, hi) = res["guard_off_vs_plain"][pair]
    assert ratio == pytest.approx(0.015)  # the median of the 8 rotations
    # Whole launches drawn: four of them, so the interval spans most of what they measured.
    eps = 1e-9
    assert -eps <= lo <= 0.005 + eps and 0.04 - eps <= hi <= 0.06 + eps
    assert res["page_faults_per_step_per_launch"][PLAIN_DDP.name] == [0, 100, 200, 300]
    copied = f"{CHECKS_OFF_COPIED.name} / {PLAIN_DDP.name}"
    assert res["guard_off_vs_plain_per_launch"][copied] == pytest.approx([0.0] * 4)
    page = "\n".join(guard_off_md({**res, "world": 3, "batch": 128, "rounds": 32, "block": 16,
                                   "configs": names, "allocator": {}}, reference=True))
    assert "32 rounds in 4 launches of 8 rounds (new rank processes each time" in page
    assert "(90% bootstrap interval over launches)" in page
    assert f"{pair}: +0.00%, +1.00%, +2.00%, +6.00%" in page
    assert f"The same per launch: {PLAIN_DDP.name} 0, 100, 200, 300" in page


def test_a_guard_off_run_refuses_launches_that_do_not_divide_its_rounds() -> None:
    from bench.overhead import check_guard_off

    with pytest.raises(ValueError, match=r"launches=3: give a positive divisor of rounds=8"):
        check_guard_off(2, rounds=8, block=2, batch=8, launches=3)
    with pytest.raises(ValueError, match=r"rounds=6: give a positive multiple of 4"):
        check_guard_off(2, rounds=12, block=2, batch=8, launches=2)
