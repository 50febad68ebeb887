"""The attack catalogue itself: enough attacks, every area and every failure class of issue
60, every test a real one that collects, none listed twice; and the runner's judgement of an
outcome."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.attack import __main__ as runner
from tests.attack.catalogue import AREAS, ATTACKS, FAILURES, Attack
from tests.launch import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_at_least_80_attacks_over_every_area_and_failure_class() -> None:
    assert len(ATTACKS) >= 80
    assert set(AREAS) == {a.area for a in ATTACKS}
    assert set(FAILURES) == {a.guards_against for a in ATTACKS}
    # issue 60's table, in its words
    assert FAILURES == ("silently wrong", "lost data", "hung", "crashed", "unclear error")


def test_no_attack_is_listed_twice() -> None:
    tests = Counter(a.test for a in ATTACKS)
    whats = Counter(a.what for a in ATTACKS)
    assert [t for t, n in tests.items() if n > 1] == []
    assert [w for w, n in whats.items() if n > 1] == []


@pytest.mark.parametrize("words", [
    # issue 60, Why 1-5 and "And:": each failure it names has an attack
    "repaired once", "full disk", "between a data file's commit and its manifest",
    "killed save's temporary file", "refuses every write", "window cannot be written",
    "fixed up to match", "generation", "name step 0's data file", "windows.json deleted",
    "SGD checkpoint into an AdamW", "float32 checkpoint into a bfloat16", "buffers have other",
    "max_nodes=1", "request_timeout_s=1, retries=0", "fails every time",
    "--request-timeout 3", "several MiB", "another tool holds a taint",
    "administrator cordons", "killed from outside", "two campaigns on one --out",
    "invalid UTF-8", "nested 5000 deep", "2**64", "not an object", "'..'", "absolute path",
    "seed of 2**64", "clean_trials = 10**9", "skips a step", "runs one step twice",
    "goes back a step", "stops calling step", "holds none of the model's parameters",
    "kubeconfig",
    # the ones handled well before
    "data file truncated", "runs code when unpickled", "kill -9", "500", "403", "409",
    "hangs", "dry run", "trials.csv", "SIGKILL of the campaign's coordinator",
    "world_size = 0",
])
def test_every_failure_of_the_issue_has_an_attack(words: str) -> None:
    assert [a for a in ATTACKS if words in a.what], f"no attack says {words!r}"


def test_every_attack_is_a_test_that_collects(request: pytest.FixtureRequest) -> None:
    ids = [a.test for a in ATTACKS]
    # A run of the whole suite has collected every test already (each xdist worker collects
    # them all): look the ids up there. A run of part of it collects the attacks' tests anew.
    session = {item.nodeid for item in request.session.items}
    if set(ids) <= session:
        assert len(set(ids)) == len(ids)  # one test each (a node id names one test)
        return
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly",
         "-p", "no:cacheprovider", *ids],
        cwd=ROOT, capture_output=True, text=True, timeout=scaled(300), check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    collected = [line for line in res.stdout.splitlines() if "::" in line]
    missing = sorted(set(ids) - set(collected))
    assert missing == [], missing
    assert len(collected) == len(ids)  # one test each, no node id that stands for several


def test_a_bad_attack_record_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"area='disks'"):
        Attack(area="disks", what="x", guards_against="hung", test="t.py::t")
    with pytest.raises(ValueError, match=r"guards_against='slow'"):
        Attack(area="guard", what="x", guards_against="slow", test="t.py::t")
    with pytest.raises(ValueError, match=r"test='t.py'.*node id"):
        Attack(area="guard", what="x", guards_against="hung", test="t.py")


_A = Attack(area="checkpoints", what="x", guards_against="lost data", test="t.py::t")


@pytest.mark.parametrize(("kind", "message", "outcome"), [
    ("passed", "", "handled well"),
    ("skipped", "running as root", "skipped"),
    ("failure", "AssertionError: assert 3 == 2", "lost data"),
    ("error", "fixture 'x' not found", "lost data"),
    ("failure", "Failed: Timeout >300.0s\n+++ Timeout +++", "hung"),
    ("failure", "tests.launch.RankFailure: no result within 120s (timeout=120s x speed "
                "factor 1) from ranks [1]", "hung"),
    ("failure", "tests.launch.RankFailure: rank 1 died with exit code -9", "crashed"),
])
def test_the_runner_classifies_each_outcome(kind: str, message: str, outcome: str) -> None:
    assert runner.classify(_A, kind, message) == outcome


def test_the_runner_reads_junit_and_writes_the_table(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a.test_b" name="test_ok[x]" time="1.5"/>'
        '<testcase classname="tests.a.test_b" name="test_bad" time="2">'
        '<failure message="AssertionError: lost">trace</failure></testcase>'
        '<testcase classname="tests.a.test_b" name="test_skip" time="0">'
        '<skipped message="no GPU"/></testcase>'
        '</testsuite></testsuites>')
    cases = runner.read_junit(xml)
    assert cases["tests/a/test_b.py::test_ok[x]"] == ("passed", "", 1.5)
    assert cases["tests/a/test_b.py::test_bad"][0] == "failure"
    attacks = [Attack(area=area, what=f"attack {i}", guards_against="lost data",
                      test=f"tests/a/test_b.py::{name}")
               for i, (area, name) in enumerate([("checkpoints", "test_ok[x]"),
                                                 ("guard", "test_bad"),
                                                 ("guard", "test_skip"),
                                                 ("quarantine", "test_gone")])]
    records = runner.judge(attacks, cases, rc=1)
    assert [r["outcome"] for r in records] == ["handled well", "lost data", "skipped",
                                               "lost data"]
    assert "no result for this test" in records[3]["detail"]
    rows = runner.table(records)
    assert rows["total"] == {"tried": 4, "handled well": 1, "silently wrong": 0,
                             "lost data": 2, "hung": 0, "crashed": 0, "unclear error": 0,
                             "skipped": 1}
    assert rows["guard"]["tried"] == 2 and rows["event log"]["tried"] == 0
    report = {"date": "d", "torch": "t", "python": "p", "cpu": "c", "workers": 2,
              "table": rows, "attacks": records}
    md = runner.markdown(report)
    assert "| **total** | 4 | 1 | 0 | 2 | 0 | 0 | 0 | 1 |" in md
    assert "## Not handled well" in md and "`tests/a/test_b.py::test_gone`" in md
