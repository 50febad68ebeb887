"""Validation of GuardConfig and SDCGuard arguments: errors name the field and the fix."""

from __future__ import annotations

import pytest
import torch

from sdc_guard import GuardConfig, SDCGuard
from sdc_guard.collectives import majority_outliers
from sdc_guard.events import EventLog, read_events


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weights_interval": -1}, "weights_interval must be >= 0"),
        ({"replay_interval": -3}, "replay_interval must be >= 0"),
        ({"weights_interval": 1.5}, "weights_interval must be an int"),
        ({"replay_interval": True}, "replay_interval must be an int"),
        ({"nonfinite": "yes"}, "nonfinite must be True or False"),
        ({"micro_batches": 0}, "micro_batches must be an int >= 1"),
        ({"seed": -1}, "seed must be an int >= 0"),
        ({"replay_interval": 5}, "replay_interval=5 needs deterministic=True"),
        ({"event_log": 3}, "event_log must be a path"),
        ({"nonfinite_exchange_interval": 0}, "nonfinite_exchange_interval must be an int >= 1"),
        ({"nonfinite_exchange_interval": True}, "nonfinite_exchange_interval must be an int"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GuardConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        GuardConfig(True)  # type: ignore[misc]


def test_guard_refuses_a_model_that_is_not_ddp() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        SDCGuard(model, opt, loss_fn=lambda m, b: m(b).sum())  # type: ignore[arg-type]


def test_majority_vote() -> None:
    assert majority_outliers([5, 5, 5]) == ()
    assert majority_outliers([5, 7, 5]) == (1,)
    assert majority_outliers([5, 7, 5, 5]) == (1,)
    assert majority_outliers([5, 7]) is None  # world size 2: no strict majority
    assert majority_outliers([5, 7, 5, 7]) is None
    assert majority_outliers([1, 2, 3]) is None


def test_event_log_appends_whole_lines_and_skips_a_torn_tail(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log = EventLog(tmp_path / "sub" / "events.jsonl", rank=2)
    log.write({"event": "detection", "step": 3, "suspects": (1,)})
    log.write({"event": "injection", "step": 4})
    with open(tmp_path / "sub" / "events.jsonl", "a") as f:
        f.write('{"event": "torn')
    events = read_events(tmp_path / "sub" / "events.jsonl")
    assert [e["event"] for e in events] == ["detection", "injection"]
    assert events[0]["rank"] == 2 and events[0]["suspects"] == [1]
