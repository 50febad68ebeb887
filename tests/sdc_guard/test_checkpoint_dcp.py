"""``ShardedCheckpointManager``: sharded state (FSDP2, HSDP) saved and restored through DCP.

Real gloo process groups (``tests.launch.run_ranks``), real ``fully_shard`` models, real
files in ``tmp_path``: restored state is compared bit for bit with the saved step's (every
rank's local shards of every parameter and optimizer state, and its RNG state).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from sdc_guard.checkpoint import CheckpointManager
from sdc_guard.checkpoint.dcp import ShardedCheckpointManager
from sdc_guard.checkpoint.dcp_shards import Box, piece_digest, whole_digests
from tests.launch import run_ranks
from tests.sdc_guard import dcp_workers as w


def _errors(log: list[tuple[str, str]]) -> list[str]:
    return [m for level, m in log if level == "ERROR"]


def test_fsdp2_restore_is_bit_identical_keep_rule_and_leftovers(tmp_path: Path) -> None:
    res = run_ranks(w.fsdp_keep_and_restore, 2, str(tmp_path))
    for r in res:
        assert r["changed"], "training on must change the state, or the test proves nothing"
        assert r["start"] == 4
        assert r["diff"] == [], f"restored state differs from step 3's: {r['diff']}"
    listed = res[0]["after_save"]
    # keep=1: the newest (3) and the newest verified clean (1, verified_through=1) stay;
    # step 2 goes, and what killed saves left is swept.
    assert listed == ["owner.json", "step-000000001-g0", "step-000000001-g0.json",
                      "step-000000003-g0", "step-000000003-g0.json", "windows.json"]
    rec = json.loads((tmp_path / "step-000000003-g0.json").read_text())
    assert rec["kind"] == "dcp" and rec["world_size"] == 2 and len(rec["ranks"]) == 2
    assert rec["mesh"] == {"shape": [2], "dim_names": []}
    assert ".metadata" in rec["files"] and any(f.endswith(".distcp") for f in rec["files"])


def test_a_format_1_manifest_is_verified_with_fingerprint_version_1(tmp_path: Path) -> None:
    res = run_ranks(w.fsdp_version1, 2, str(tmp_path))
    for r in res:
        assert r["recorded"] == (2, 2, True)
        assert r["start"] == 2 and r["diff"] == []
        assert r["refused"] == 0
        assert any("fingerprint" in m for level, m in r["log"] if level == "ERROR"), r["log"]


def test_background_saves_commit_behind_training_and_failures_reach_every_rank(
        tmp_path: Path) -> None:
    """``save(background=True)``: the state is staged in the call, written while training
    goes on, committed once every rank has written; a restore brings the newest back bit for
    bit. A commit that fails on rank 0 raises from the next ``save`` on every rank and from
    ``wait()`` on rank 0, and leaves nothing of itself."""
    res = run_ranks(w.fsdp_background, 2, str(tmp_path))
    for rank, r in enumerate(res):
        assert r["first"] is None  # (the manifest is not known before the commit)
        assert r["after_save"] == ["owner.json", "step-000000001-g0", "step-000000001-g0.json",
                                   "step-000000002-g0", "step-000000002-g0.json",
                                   "windows.json"]
        assert r["start"] == 3 and r["restored"] == []
        assert "No space left on device" in r["raised"], r
        assert ("No space left on device" in r["waited"]) == (rank == 0), r
        assert r["final"] == r["after_save"]  # nothing of steps 3 and 5 is left
    assert any("background save of checkpoint" in m for m in res[0]["errors"])


def test_corrupt_shard_is_named_and_the_older_checkpoint_restored(tmp_path: Path) -> None:
    res = run_ranks(w.fsdp_corrupt, 2, str(tmp_path))
    flipped = res[0]["flipped"]
    assert flipped is not None, "the shard's bytes were not found in any .distcp file"
    for r in res:
        assert r["start"] == 2
        assert r["diff"] == []
        errors = _errors(r["log"])
        other = "__1_0.distcp" if flipped == "__0_0.distcp" else "__0_0.distcp"
        assert any("step-000000002-g0" in e and flipped in e and "0.weight" in e
                   and other not in e for e in errors), errors


def test_suspect_window_skips_checkpoints_and_nothing_usable_returns_0(
        tmp_path: Path) -> None:
    res = run_ranks(w.fsdp_window, 2, str(tmp_path))
    for r in res:
        assert r["refused"] is None
        assert r["start"] == 2
        assert r["diff"] == []
        assert r["scratch"] == 0 and r["untouched"] == [] and r["fresh"] == []
        assert any("not restoring" in m and "step-000000003-g0" in m for _, m in r["log"])
    assert any("no usable checkpoint" in e for e in _errors(res[0]["log"]))


def test_hsdp_2x2_restore_is_bit_identical_and_diverged_replicas_are_not_saved(
        tmp_path: Path) -> None:
    res = run_ranks(w.hsdp_roundtrip, 4, str(tmp_path))
    for r in res:
        assert r["start"] == 2 and r["diff"] == []
        assert "replicas hold different values" in r["refused"], r["refused"]
        assert "model.0.weight (ranks [0, 2])" in r["refused"]
        assert not any(n.startswith(("step-000000002", ".step-000000002"))
                       for n in r["listing"]), r["listing"]
    rec = json.loads((tmp_path / "step-000000001-g0.json").read_text())
    assert rec["mesh"] == {"shape": [2, 2], "dim_names": ["replicate", "shard"]}


def test_resharded_restore_is_verified_by_whole_tensor_digests(tmp_path: Path) -> None:
    saved = run_ranks(w.reshard_save, 2, str(tmp_path))[0]
    res = run_ranks(w.reshard_restore, 1, str(tmp_path))[0]
    assert res["start"] == 2
    assert saved.keys() == res["state"].keys()
    for k, v in saved.items():
        assert v == res["state"][k], k
    # One value flipped in the files: the resharded restore sees it and restores nothing.
    d = tmp_path / "step-000000001-g0"
    needle = saved["0.weight"][:5 * 6 * 4]  # rank 0's shard: rows 0-4 of the 10x6 weight
    for p in sorted(d.glob("*.distcp")):
        data = bytearray(p.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + 3] ^= 0x01
            p.write_bytes(bytes(data))
            break
    else:
        pytest.fail("rank 0's shard of 0.weight was not found in the .distcp files")
    res = run_ranks(w.reshard_restore, 1, str(tmp_path))[0]
    assert res["start"] == 0
    assert any("0.weight" in e and "differs" in e for e in _errors(res["log"])), res["log"]


def test_pieces_of_any_tiling_add_up_to_the_whole_digest() -> None:
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.complex128):
        whole = torch.randn(7, 5, generator=g).to(dtype)
        ref = piece_digest(whole, Box((7, 5), (0, 0), (7, 5), str(dtype)))
        for cut in (1, 3, 6):  # rows (FSDP's Shard(0))
            parts = [piece_digest(whole[:cut], Box((7, 5), (0, 0), (cut, 5), "")),
                     piece_digest(whole[cut:], Box((7, 5), (cut, 0), (7 - cut, 5), ""))]
            assert sum(parts) % 2**64 == ref
        cols = [piece_digest(whole[:, :2], Box((7, 5), (0, 0), (7, 2), "")),
                piece_digest(whole[:, 2:], Box((7, 5), (0, 2), (7, 3), ""))]
        assert sum(cols) % 2**64 == ref
        flipped = whole.clone()
        flipped.view(torch.uint8).reshape(-1)[9] ^= 0x04
        assert piece_digest(flipped, Box((7, 5), (0, 0), (7, 5), "")) != ref
    scalar = torch.tensor(3.0)
    assert piece_digest(scalar, Box((), (), (), "float32")) != 0
    b = Box((4,), (0,), (2,), "float32")
    c = Box((4,), (2,), (2,), "float32")
    digests, differ = whole_digests([{"x": (b, 1)}, {"x": (c, 2)}, {"x": (b, 5)}])
    assert differ == ["x (ranks [0, 2])"] and digests["x"] is not None
    digests, _ = whole_digests([{"x": (b, 1)}])
    assert digests["x"] is None  # half the tensor: cannot be checked after resharding


def test_plain_module_without_process_group_and_extra_states(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched.step()
    ckpt = ShardedCheckpointManager(tmp_path)
    ckpt.save(5, model, opt, extra={"lr": sched})
    weight, lr, rng = model.weight.detach().clone(), sched.state_dict(), torch.get_rng_state()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched.step()
    assert not torch.equal(weight, model.weight)
    assert ckpt.restore(model, opt, extra={"lr": sched}) == 6
    assert torch.equal(weight, model.weight) and sched.state_dict() == lr
    assert torch.equal(rng, torch.get_rng_state())


def test_bad_input_is_refused_by_name(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ckpt = ShardedCheckpointManager(tmp_path)
    with pytest.raises(ValueError, match=r"background=\.\.\.\): a bool"):
        ckpt.save(1, model, opt, background="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save\(step\)"):
        ckpt.save(-1, model, opt)
    with pytest.raises(ValueError, match=r"keep"):
        ShardedCheckpointManager(tmp_path, keep=0)
    ckpt.save(1, model, opt)
    other = torch.nn.Linear(3, 4)
    from sdc_guard.checkpoint import CheckpointMismatchError
    with pytest.raises(CheckpointMismatchError,
                       match=r"shapes or dtypes.*model.weight float32\[2, 3\] saved"):
        ckpt.restore(other, torch.optim.AdamW(other.parameters()))


def test_each_manager_refuses_the_others_checkpoints_by_name(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    ShardedCheckpointManager(tmp_path / "dcp").save(1, model, opt)
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        assert CheckpointManager(tmp_path / "dcp").checkpoints() == []
    assert "ShardedCheckpointManager" in caplog.text
