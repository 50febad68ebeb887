"""``bench.fsdp``'s checksum run over launches (it times both configurations in every launch
and reports the overhead with an interval over whole launches) and its replay audit run
(the exact and the tolerant audit beside their ideal)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import fsdp


def test_the_checksum_launches_time_both_configurations_and_render_their_section() -> None:
    res = fsdp.checksum_launches(rounds=4, launches=2, block=1)
    assert (res["world"], res["rounds"], res["block"], res["launches"]) == (2, 4, 1, 2)
    assert res["step_ms"] > 0 and res["step_ms_checksum"] > 0
    assert math.isfinite(res["overhead"]) and res["overhead"] > -1.0
    lo, hi = res["overhead_interval_90"]
    assert lo <= hi
    assert len(res["overhead_per_launch"]) == 2
    assert {len(v) for v in res["round_step_s"].values()} == {4}  # 2 rounds in each launch
    text = "\n".join(fsdp.checksum_launches_md(res))
    assert "over 2 launches" in text and "4 rounds in 2 launches of 2 rounds" in text


def test_a_round_count_that_does_not_split_over_the_launches_is_named() -> None:
    with pytest.raises(SystemExit):
        fsdp.main(["--checksum-rounds", "5", "--launches", "2"])


def test_the_audit_run_times_the_exact_and_the_tolerant_audit_beside_their_ideal() -> None:
    res = fsdp.audit(rounds=3, block=2 * fsdp.AUDIT_EVERY, batch=2, launches=1)
    assert res["ideal_extra_ms"] != 0 and res["replay_extra_ms"] != 0
    for key, interval in (("ratio", "interval"), ("tolerant_ratio", "tolerant_interval"),
                          ("tolerant_over_exact", "tolerant_over_exact_interval")):
        lo, hi = res[interval]
        assert math.isfinite(res[key]) and lo <= hi
    text = "\n".join(fsdp.audit_md(res))
    assert "| exact |" in text and "| tolerant |" in text and "over the exact one's" in text
    old = {k: v for k, v in res.items() if not k.startswith("tolerant")}
    assert "| tolerant |" not in "\n".join(fsdp.audit_md(old))  # a run before the arm


def test_only_audit_amends_a_run_of_this_cpu_and_names_what_it_cannot(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):  # nothing to amend
        fsdp.main(["--only-audit", "--out", str(tmp_path)])
    (tmp_path / "fsdp.json").write_text(json.dumps({"machine": "Another CPU, 2 ranks"}))
    with pytest.raises(SystemExit):  # another machine's
        fsdp.main(["--only-audit", "--out", str(tmp_path)])
