"""``bench.fsdp``'s checksum run over launches: it times both configurations in every launch
and reports the overhead with an interval over whole launches."""

from __future__ import annotations

import math

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
