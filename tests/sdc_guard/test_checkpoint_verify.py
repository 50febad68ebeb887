"""What restore verifies before anything loads, the windows' file failing safe, and the
checkpoint kept before a repair: one real gloo rank and real files."""

from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sdc_guard import CheckpointManager, Detection
from sdc_guard.checkpoint import CheckpointMismatchError
from tests import workers
from tests.sdc_guard.test_checkpoint import _state, _train


@pytest.fixture
def setup(one_rank: None, tmp_path: Path) -> tuple[DDP, torch.optim.Optimizer, CheckpointManager]:
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, CheckpointManager(tmp_path / "ckpt", keep=10)


def _rewrite(info: Any, payload: dict[str, Any], **manifest: Any) -> None:
    """``payload`` as ``info``'s data, its manifest's size and SHA-256 fixed up to match."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    info.file.write_bytes(data)
    rec = json.loads(info.manifest.read_text())
    rec.update(size=len(data), sha256=hashlib.sha256(data).hexdigest(), **manifest)
    info.manifest.write_text(json.dumps(rec))


def _payload(info: Any) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(info.file, weights_only=True)
    return loaded


def test_a_refused_checkpoint_leaves_the_model_as_it_was(setup: Any, caplog: Any) -> None:
    # Its data replaced and its manifest's size and hash fixed up to match: only the
    # fingerprint tells. It used to be loaded into the model before that check failed, and
    # with no older checkpoint the rejected weights stayed.
    model, opt, ckpt = setup
    _train(model, opt, range(2))
    info = ckpt.save(1, model, opt)
    payload = _payload(info)
    payload["model"]["0.weight"] += 1.0
    _rewrite(info, payload)
    _train(model, opt, range(2, 3))
    before = _state(model, opt)
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        assert ckpt.restore(model, opt) == 0
    assert _state(model, opt) == before
    assert any(str(info.file) in r.getMessage() and "fingerprint" in r.getMessage()
               and "nothing was loaded" in r.getMessage() for r in caplog.records)


def test_the_manifest_and_the_payload_must_agree_on_step_and_generation(
        setup: Any, caplog: Any) -> None:
    model, opt, ckpt = setup
    first = ckpt.save(0, model, opt)
    at_0 = _state(model, opt)
    _train(model, opt, range(1, 2))
    second = ckpt.save(1, model, opt)
    # step 0's file under step 1's name, its manifest made to match it
    second.file.write_bytes(first.file.read_bytes())
    rec = json.loads(first.manifest.read_text())
    json_1 = json.loads(second.manifest.read_text())
    json_1.update(size=rec["size"], sha256=rec["sha256"], fingerprint=rec["fingerprint"])
    second.manifest.write_text(json.dumps(json_1))
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        assert ckpt.restore(model, opt) == 1  # step 0's, under its own name
    assert _state(model, opt) == at_0
    assert any("holds step 0, its manifest step-000000001-g0.json says 1" in r.getMessage()
               for r in caplog.records)
    # the generation likewise
    payload = _payload(first)
    payload["generation"] = 7
    _rewrite(first, payload)
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        assert ckpt.restore(model, opt) == 0
    assert any("holds generation 7" in r.getMessage() for r in caplog.records)


def test_a_manifest_that_points_at_another_checkpoints_file_is_refused(
        setup: Any, caplog: Any) -> None:
    # It was restored as step 1 with step 0's state, and pruning it would delete step 0's data.
    model, opt, ckpt = setup
    first = ckpt.save(0, model, opt)
    _train(model, opt, range(1, 2))
    second = ckpt.save(1, model, opt)
    rec = json.loads(first.manifest.read_text())
    rec["step"] = 1
    second.manifest.write_text(json.dumps(rec))  # step 1's manifest names step 0's file
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        assert [c.step for c in ckpt.checkpoints()] == [0]
    assert any("names the data file 'step-000000000-g0.pt', not its own step-000000001-g0.pt"
               in r.getMessage() for r in caplog.records)
    ckpt.keep = 2
    ckpt.save(2, model, opt)  # prunes nothing: the misnamed manifest is not a checkpoint
    assert first.file.exists() and [c.step for c in ckpt.checkpoints()] == [2, 0]


def _windows_case(ckpt: CheckpointManager, model: DDP, opt: torch.optim.Optimizer,
                  verified: int | None) -> dict[int, int]:
    states = {}
    for s in range(4):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt, verified_through=verified)
        states[s] = _state(model, opt)
    ckpt.record_detection(Detection("replay", 3, (1,), "", {}), verified_through=2)
    return states  # the window opens at step 3


@pytest.mark.parametrize("damage", ["deleted", "edited", "older", "unparseable"])
def test_windows_lost_or_damaged_fail_safe(one_rank: None, tmp_path: Path, caplog: Any,
                                           damage: str) -> None:
    """Only checkpoints the manifests vouch for (verified clean through step 1 here) are
    restored, never "no window" (which restored step 3, inside the window)."""
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(tmp_path / "w", keep=10)
    path = ckpt.directory / "windows.json"
    states = _windows_case(ckpt, model, opt, verified=1)
    if damage == "deleted":
        path.unlink()
    elif damage == "edited":
        rec = json.loads(path.read_text())
        rec["windows"][0]["start"] = 99
        path.write_text(json.dumps(rec))
    elif damage == "older":  # an older copy put back: revision below the manifests'
        ckpt2 = CheckpointManager(tmp_path / "old", keep=10)
        ckpt2.windows.flush(writer=True)
        path.write_bytes((ckpt2.directory / "windows.json").read_bytes())
        rec = json.loads(path.read_text())
        assert rec["revision"] == 0
        for m in ckpt.directory.glob("step-*.json"):  # the manifests saw a later revision
            mrec = json.loads(m.read_text())
            mrec["windows"]["revision"] = 3
            m.write_text(json.dumps(mrec))
    else:
        path.write_text("{not json")
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        again = CheckpointManager(ckpt.directory, keep=10)  # the restarted job
        assert again.restore(model, opt) == 2
    assert _state(model, opt) == states[1]
    assert any("the suspect windows are not known" in r.getMessage() for r in caplog.records)
    # The safe state is written: a later restart keeps refusing the unvouched checkpoints
    third = CheckpointManager(ckpt.directory, keep=10)
    assert [c.step for c in third.checkpoints() if third.refused(c)] == [3, 2]


def test_windows_lost_without_any_verified_step_restore_nothing(one_rank: None,
                                                               tmp_path: Path) -> None:
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(tmp_path / "w", keep=10)
    _windows_case(ckpt, model, opt, verified=None)
    (ckpt.directory / "windows.json").unlink()
    before = _state(model, opt)
    assert CheckpointManager(ckpt.directory).restore(model, opt) == 0
    assert _state(model, opt) == before


def test_a_checkpoint_of_another_optimizer_type_is_refused_by_name(setup: Any) -> None:
    model, opt, ckpt = setup
    _train(model, opt, range(2))
    info = ckpt.save(1, model, opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = _state(model, sgd)
    with pytest.raises(CheckpointMismatchError, match=r"saved with the optimizer\(s\) "
                                                      r"\['AdamW'\], and \['SGD'\] were given"):
        ckpt.restore(model, sgd)
    assert _state(model, sgd) == before and not sgd.state
    assert str(info.file) in _refusal(ckpt, model, sgd)


def _refusal(ckpt: CheckpointManager, model: DDP, opt: torch.optim.Optimizer) -> str:
    try:
        ckpt.restore(model, opt)
    except ValueError as e:
        return str(e)
    return ""


def test_a_checkpoint_of_another_dtype_is_refused_not_called_corrupt(setup: Any) -> None:
    model, opt, ckpt = setup
    _train(model, opt, range(2))
    ckpt.save(1, model, opt)
    half = DDP(workers.make_mlp().to(torch.bfloat16))
    half_opt = torch.optim.AdamW(half.parameters(), lr=1e-2)
    before = _state(half, half_opt)
    with pytest.raises(CheckpointMismatchError,
                       match=r"other dtypes: \['0.weight torch.float32 saved, torch.bfloat16 "
                             r"in the model'"):
        ckpt.restore(half, half_opt)
    assert _state(half, half_opt) == before and not half_opt.state


class _Scaled(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) * self.scale.sum()
        return out


def test_a_checkpoint_with_buffers_of_other_shapes_is_refused_before_anything_loads(
        one_rank: None, tmp_path: Path) -> None:
    # load_state_dict raised after the optimizer and the fitting tensors had loaded.
    model = DDP(_Scaled(4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(tmp_path / "b")
    model.module.scale.fill_(2.0)
    ckpt.save(0, model, opt)
    other = DDP(_Scaled(8))
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    lin = other.module.lin.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"other shapes: \['scale \(4,\) saved, "
                                                      r"\(8,\) in the model'\]"):
        ckpt.restore(other, other_opt)
    assert torch.equal(other.module.lin.weight, lin) and not other_opt.state
    assert torch.equal(other.module.scale, torch.ones(8))


def test_the_newest_checkpoint_before_a_repair_is_kept_inside_the_repair_window(
        setup: Any) -> None:
    """A rank repaired at step 2 and convicted at step 6: the window opens at the first
    repair, and the checkpoint before it (step 1) is still there to restore."""
    model, opt, ckpt = setup
    ckpt.keep = 1
    for s in range(2):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt)
    at_1 = _state(model, opt)
    repaired = Detection("weights", 2, (1,), "", {}, repaired=True)
    ckpt.record_detection(repaired, verified_through=2, repair_window_steps=10)
    again = CheckpointManager(ckpt.directory, keep=1)  # the repair survives a restart
    for s in range(2, 6):
        _train(model, opt, range(s, s + 1))
        again.save(s, model, opt)
    assert [c.step for c in again.checkpoints()] == [5, 1]
    again.record_detection(Detection("weights", 6, (1,), "", {"repair": {"since": 2}}),
                           verified_through=5, repair_window_steps=10)
    assert again.restore(model, opt) == 2
    assert _state(model, opt) == at_1
    # Once the newest save is past the repair window, keep holds again (for the usable ones;
    # the newest the window refuses, step 5 of the abandoned timeline, is kept beside them).
    for s in range(2, 14):
        _train(model, opt, range(s, s + 1))
        again.save(s, model, opt)
    assert [(c.step, again.refused(c) is None) for c in again.checkpoints()] == [
        (13, True), (5, False)]


def test_a_repaired_or_contained_detection_opens_no_window(setup: Any) -> None:
    model, opt, ckpt = setup
    ckpt.save(0, model, opt)
    ckpt.record_detection(Detection("weights", 1, (1,), "", {}, repaired=True),
                          verified_through=0, repair_window_steps=5)
    ckpt.record_detection(Detection("checksum", 1, (1,), "", {}, contained=True),
                          verified_through=0, repair_window_steps=5)
    assert ckpt.windows.opened() == []
    assert ckpt.save(1, model, opt) is not None
    with pytest.raises(ValueError, match=r"repair_window_steps=...\): an int >= 1"):
        ckpt.record_detection(Detection("weights", 1, (1,), "", {}, repaired=True),
                              verified_through=0, repair_window_steps=0)


def test_checkpoints_of_format_1_stay_readable(setup: Any) -> None:
    """A directory written before schema versions: manifests and payloads of format 1,
    windows.json without schema, revision or checksum."""
    model, opt, ckpt = setup
    _train(model, opt, range(2))
    info = ckpt.save(1, model, opt)
    saved = _state(model, opt)
    payload = _payload(info)
    payload["format"] = 1
    del payload["optimizers"]
    _rewrite(info, payload)
    rec = json.loads(info.manifest.read_text())
    for key in ("optimizers", "job", "windows"):
        del rec[key]
    rec["format"] = 1
    info.manifest.write_text(json.dumps(rec))
    (ckpt.directory / "windows.json").write_text(json.dumps(
        {"generation": 0, "windows": [{"start": 5, "generation": 0, "check": "replay",
                                       "step": 6, "suspect_ranks": [1], "suspect_nodes": [],
                                       "time": 0.0, "open": False}]}))
    _train(model, opt, range(2, 3))
    old = CheckpointManager(ckpt.directory)
    assert old.restore(model, opt) == 2 and _state(model, opt) == saved
    assert json.loads((ckpt.directory / "windows.json").read_text())["schema"] == 2


def test_a_damaged_windows_file_without_checkpoints_is_replaced_by_the_first_save(
        one_rank: None, tmp_path: Path, caplog: Any) -> None:
    # With no checkpoint for a window to refuse, the next save writes a sound file;
    # left damaged, every later restart would distrust the checkpoints saved since.
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = tmp_path / "fresh"
    d.mkdir()
    (d / "windows.json").write_text("{damaged")
    ckpt = CheckpointManager(d, keep=10)
    ckpt.save(0, model, opt, verified_through=None)
    ckpt.save(1, model, opt, verified_through=None)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        again = CheckpointManager(d, keep=10)
        assert again.restore(model, opt) == 2
    assert not any("not known" in r.getMessage() for r in caplog.records)


def test_checkpoints_a_window_refuses_do_not_count_against_keep(setup: Any) -> None:
    """After a rollback, the checkpoints of the abandoned timeline that a window refuses took
    ``keep``'s places: the clean one the run had rolled back to was pruned by the next save,
    and when the fault came back the rollback found nothing (restore returned 0)."""
    model, opt, ckpt = setup
    ckpt.keep = 2
    for s in range(4):  # the run verified one step behind its saves (a deferred word)
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt, verified_through=s - 1)
    ckpt.record_detection(Detection("replay", 3, (1,), "", {}), verified_through=2)
    assert ckpt.restore(model, opt) == 3  # step 2's checkpoint: the window starts at 3
    at_2 = _state(model, opt)
    _train(model, opt, range(3, 4))
    ckpt.save(3, model, opt, verified_through=2)  # the new timeline's first save
    assert [(c.step, c.generation) for c in ckpt.checkpoints()] == [(3, 1), (3, 0), (2, 0)]
    # The fault comes back at step 3 of the new timeline: only step 2 is left to go back to.
    ckpt.record_detection(Detection("replay", 3, (1,), "", {}), verified_through=2)
    assert ckpt.restore(model, opt) == 3
    assert _state(model, opt) == at_2
