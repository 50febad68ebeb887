"""Detections a person can follow, the step agreement every step and the watchdog, on real
gloo process groups (3 ranks, one thread each)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from sdc_guard import GuardConfig, read_events
from sdc_guard.exits import EXIT_RANK_LOST
from sdc_guard.watchdog import BETWEEN, Mark, behind
from tests.launch import RankFailure, run_ranks, scaled
from tests.sdc_guard import watch_workers

pytestmark = pytest.mark.timeout(240)


def test_a_withheld_step_says_so_at_once_and_its_late_detection_says_contained(
        tmp_path: Path) -> None:
    # Step 3 was withheld with no word of why, and the detection that came later said it was
    # not ("optimizer_step_skipped": false), so a rollback undid steps a fault never reached.
    log = tmp_path / "events.jsonl"
    for r in run_ranks(watch_workers.followed_run, 3, "grad_nan", str(log)):
        assert r["withheld"] == [(3, True, ("nonfinite",))]
        assert r["arrived"] == [(4, "nonfinite", 3, (1,), True)]
        assert r["found"] == [("nonfinite", 3, True, False)]
    events = read_events(log)
    detections = [e for e in events if e["event"] == "detection"]
    assert len(detections) == 1, "one record per job, not one per rank"
    d = detections[0]
    assert (d["rank"], d["check"], d["step"], d["suspect_ranks"]) == (0, "nonfinite", 3, [1])
    assert d["contained"] is True and d["withheld_by"] == ["nonfinite"]
    assert d["optimizer_step_skipped"] is True
    telemetry = [e for e in events if e["event"] == "telemetry"]
    assert [(e["rank"], e["check"], e["step"]) for e in telemetry] == [(1, "nonfinite", 3)]
    assert "telemetry" not in d["evidence"]


def test_a_fault_in_the_weights_is_not_contained(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    for r in run_ranks(watch_workers.followed_run, 3, "weight_flip", str(log)):
        # The state of every step from 3 on differs (no repair here), each vote read in the
        # next step, which it withholds on every rank (its gradients came in part from the
        # odd replica); the last one is read by flush(). Never contained: the weights were
        # hit, not a step's computation.
        assert r["withheld"] == [(s, True, ("weights",)) for s in range(4, 8)]
        assert r["arrived"] == [(s + 1, "weights", s, (1,), False) for s in range(3, 7)]
        assert ("weights", 7, False, False) in r["found"]
    d = [e for e in read_events(log) if e["event"] == "detection"]
    # (steps 4-7 were withheld themselves, by the vote of the step before)
    assert [(e["rank"], e["step"], e["contained"], e["optimizer_step_skipped"]) for e in d] == [
        (0, s, False, s > 3) for s in range(3, 8)]


@pytest.mark.parametrize("cfg", [{"nonfinite_exchange_interval": 2},
                                 {"checksum": True, "nonfinite": False},
                                 {"nonfinite": False}],
                         ids=["nonfinite-word", "checksum-word", "weights-vote"])
def test_a_rank_at_another_step_is_a_named_error_on_every_rank(cfg: dict[str, object]) -> None:
    # Rank 1 skipped step 3: DDP trained on unaware (the steps were agreed only at the start).
    res = run_ranks(watch_workers.out_of_step_run, 3, cfg)
    for r in res:
        assert r["type"] == "StepsDisagree", r
        assert "the ranks are not at one step (step 3 on ranks 0, 2; step 4 on rank 1" in \
            r["error"]
    assert len({r["at"] for r in res}) == 1  # every rank, at the same call


def test_a_rank_that_stops_calling_step_is_named_by_the_others(tmp_path: Path) -> None:
    # It hung the others until the process group's timeout (30 minutes by default), then a raw
    # gloo error that named nobody.
    log = tmp_path / "events.jsonl"
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=f"exit code {EXIT_RANK_LOST}"):
        run_ranks(watch_workers.fallen_out_run, 3, str(log), 2.0, timeout=120)
    assert time.monotonic() - t0 < 100
    fired = [e for e in read_events(log) if e["event"] == "watchdog"]
    assert fired, "no watchdog record"
    for e in fired:
        assert e["rank"] in (0, 2) and e["step"] == 3
        assert e["waiting_in"].startswith("the forward and backward passes")
        assert len(e["behind"]) == 1 and e["behind"][0].startswith("rank 1 ")
        assert f"{BETWEEN} after step 2" in e["behind"][0]
        assert "rank 1 " in e["detail"] and f"exit code {EXIT_RANK_LOST}" in e["detail"]


def test_behind_names_ranks_elsewhere_silent_or_never_heard_and_spares_the_just_moved() -> None:
    now = 1000.0
    me = Mark(0, 7, "x", since=900.0, at=now)
    marks: dict[int, Mark | None] = {
        0: me,
        1: Mark(1, 7, "x", since=900.0, at=999.0),       # with me: fine
        2: Mark(2, 6, BETWEEN, since=890.0, at=999.0),   # left step 6 and never came back
        3: Mark(3, 7, "y", since=998.0, at=999.0),       # just moved on: progressing
        4: Mark(4, 7, "x", since=900.0, at=800.0),       # silent for 200 s
        5: None,
    }
    out = behind(me, marks, silent_after=60.0, settled_after=30.0, now=now)
    assert [s.split(" ")[1].rstrip(":") for s in out] == ["2", "4", "5"]
    assert "between steps after step 6 for 110 s" in out[0]
    assert "silent" in out[1] and "never heard from" in out[2]
    assert behind(me, {0: me, 1: marks[1]}, silent_after=60.0, settled_after=30.0,
                  now=now) == []
    json.dumps(out)


class _GoneStore:
    """The store of a job whose rank 0 (which serves it) is gone: every call fails, as a
    TCPStore's client does once its server's socket is closed."""

    def set(self, key: str, value: str) -> None:
        raise OSError("Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise OSError("Connection reset by peer")

    def get(self, key: str) -> bytes:
        raise OSError("Connection reset by peer")


def _wait_for(cond: object, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def test_the_watchdog_waits_while_every_rank_is_alive_at_the_same_place(
        one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    from sdc_guard.watchdog import Watchdog

    codes: list[int] = []
    dog = Watchdog(0.5, exit=codes.append)
    try:
        with caplog.at_level("WARNING"):
            dog.at(3, "the forward and backward passes")
            _wait_for(lambda: any("none fell out" in r.getMessage() for r in caplog.records),
                      scaled(10))
        assert codes == [] and dog.fired is None
        assert any("none fell out" in r.getMessage() for r in caplog.records)
    finally:
        dog.close()


def test_the_watchdog_still_fires_when_the_store_is_gone(one_rank: None) -> None:
    from sdc_guard.watchdog import Watchdog

    codes: list[int] = []
    fired: list[str] = []
    dog = Watchdog(0.5, exit=codes.append, fire=lambda message, record: fired.append(message))
    dog._store = _GoneStore()
    try:
        dog.at(3, "the forward and backward passes")
        _wait_for(lambda: codes, scaled(10))
        assert codes == [EXIT_RANK_LOST]
        assert fired and "the process group's store is out of reach" in fired[0]
        assert "step 3 in the forward and backward passes" in fired[0]
    finally:
        dog.close()


def test_a_guard_dropped_without_close_is_freed_and_its_watchdog_stops(one_rank: None) -> None:
    # The thread held the watchdog, the watchdog the guard's bound method: a campaign that
    # builds a guard per trial kept every trial's model and optimizer alive, and the old
    # watchdogs' marks spoke for the new one under the same keys.
    import gc
    import threading
    import weakref

    from tests.sdc_guard.test_config import _one_rank_guard

    def dogs() -> int:
        return sum(t.name == "sdc-guard-watchdog" and t.is_alive() for t in threading.enumerate())

    before = dogs()
    guard = _one_rank_guard(config=GuardConfig(collective_timeout_s=1.0))
    guard.step(0)
    first = guard.watchdog
    assert first is not None and dogs() == before + 1
    other = _one_rank_guard(config=GuardConfig(collective_timeout_s=1.0))
    other.step(0)
    second = other.watchdog
    assert second is not None and first._prefix != second._prefix
    gone = [weakref.ref(guard), weakref.ref(other)]
    del guard, other, first, second
    gc.collect()
    assert [g() for g in gone] == [None, None]
    _wait_for(lambda: dogs() == before, scaled(10))
    assert dogs() == before
