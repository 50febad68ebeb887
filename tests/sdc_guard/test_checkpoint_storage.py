"""Checkpoints on storage that fails: no space left, read-only, a second job in the directory.

No space is simulated at the OS boundary only: ``os.write`` or ``os.replace`` raise
``OSError(ENOSPC)`` (a full small file system needs root to mount). Read-only storage is a
directory chmod 0o555, and, where the tests run as root (which chmod does not stop), the
same ``os.open`` refusal (``EROFS``) for every file opened to write.
"""

from __future__ import annotations

import builtins
import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from sdc_guard import CheckpointManager, Detection
from sdc_guard.checkpoint import CheckpointOwnerError, CheckpointWriteError
from tests import workers
from tests.launch import run_ranks
from tests.sdc_guard.test_checkpoint import _state, _train

BIG = 4096
"""Bytes above which a write is a checkpoint's data (manifests, windows and the owner
marker are smaller)."""


def _full_disk_for_big_writes(monkeypatch: Any) -> None:
    """``os.write`` of a checkpoint's data writes what fits and then fails for space."""
    real = os.write

    def write(fd: int, data: Any) -> int:
        if len(data) > BIG:
            real(fd, bytes(data[:BIG]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def _left_behind(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name.startswith(".") or (p.suffix == ".pt"
                                                and not p.with_suffix(".json").exists()))


@pytest.fixture
def setup(one_rank: None, tmp_path: Path) -> tuple[DDP, torch.optim.Optimizer, CheckpointManager]:
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, CheckpointManager(tmp_path / "ckpt", keep=2)


def test_a_save_without_space_leaves_nothing_and_names_the_file_and_the_free_space(
        setup: Any, monkeypatch: Any) -> None:
    model, opt, ckpt = setup
    ckpt.save(0, model, opt)
    _full_disk_for_big_writes(monkeypatch)
    with pytest.raises(CheckpointWriteError) as e:
        ckpt.save(1, model, opt)
    assert e.value.errno == errno.ENOSPC and e.value.path.name == "step-000000001-g0.pt"
    assert e.value.free_bytes is not None
    assert f"{e.value.free_bytes} bytes free on {ckpt.directory}" in str(e.value)
    assert "No space left on device" in str(e.value)
    assert _left_behind(ckpt.directory) == []  # no temporary file, no data without manifest
    assert [c.step for c in ckpt.checkpoints()] == [0]
    # The same in the background: raised by the next save, nothing left behind either
    ckpt.save(2, model, opt, background=True)
    with pytest.raises(CheckpointWriteError, match=r"step-000000002-g0\.pt could not be written"):
        ckpt.save(3, model, opt)
    assert _left_behind(ckpt.directory) == []
    monkeypatch.undo()
    assert ckpt.save(4, model, opt) is not None
    assert [c.step for c in ckpt.checkpoints()] == [4, 0]


def test_a_manifest_that_finds_no_space_takes_its_data_file_with_it(
        setup: Any, monkeypatch: Any) -> None:
    model, opt, ckpt = setup
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name.startswith("step-") and Path(dst).suffix == ".json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointWriteError, match=r"step-000000000-g0\.json could not be"):
        ckpt.save(0, model, opt)
    assert sorted(p.name for p in ckpt.directory.iterdir()) == ["owner.json", "windows.json"]


def test_what_a_killed_save_left_is_found_logged_and_removed_by_the_next_save(
        setup: Any, caplog: Any) -> None:
    model, opt, ckpt = setup
    ckpt.save(0, model, opt)
    orphan = ckpt.directory / "step-000000001-g0.pt"  # committed data, killed before its manifest
    orphan.write_bytes(b"x" * 100)
    tmp = ckpt.directory / ".step-000000002-g0.pt.tmp99999"  # killed while writing
    tmp.write_bytes(b"y" * 100)
    with caplog.at_level(logging.WARNING, logger="sdc_guard.checkpoint"):
        ckpt.save(3, model, opt)
    assert not orphan.exists() and not tmp.exists()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert str(orphan) in said and "without its manifest" in said and str(tmp) in said
    assert [c.step for c in ckpt.checkpoints()] == [3, 0]


def _read_only(monkeypatch: Any, directory: Path) -> None:
    """``directory`` read-only: chmod 0o555, and (root ignores modes) every open to write
    a file in it refused with EROFS, as a read-only mount does (``os.open`` and the
    built-in ``open``, whichever a writer uses)."""
    directory.chmod(0o555)
    real, real_io = os.open, builtins.open

    def refuse(path: Any) -> None:
        if Path(path).parent == directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real(path, flags, *args, **kwargs)

    def open_io(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, Path)) and set(mode) & set("wax+"):
            refuse(file)
        return real_io(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(builtins, "open", open_io)


@pytest.mark.parametrize("simulated", [False, True])
def test_restore_on_read_only_storage_succeeds_when_a_good_checkpoint_exists(
        one_rank: None, tmp_path: Path, monkeypatch: Any, caplog: Any, simulated: bool) -> None:
    if not simulated and os.geteuid() == 0:
        pytest.skip("running as root: chmod 0o555 does not stop root from writing (the "
                    "simulated case refuses the writes where files are opened instead)")
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(tmp_path / "ro", keep=5)
    for s in range(3):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt)
        if s == 1:
            at_1 = _state(model, opt)
    ckpt.record_detection(Detection("replay", 2, (1,), "", {}), verified_through=1)
    if simulated:
        _read_only(monkeypatch, ckpt.directory)
    else:
        ckpt.directory.chmod(0o555)
    try:
        with caplog.at_level(logging.WARNING, logger="sdc_guard.checkpoint"):
            again = CheckpointManager(ckpt.directory, keep=5)  # a restarted job
            assert again.restore(model, opt) == 2
        assert _state(model, opt) == at_1
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "restoring without recording the new timeline" in said
        assert "owner marker cannot be written" in said
        with pytest.raises(CheckpointWriteError, match="could not be written"):
            again.save(3, model, opt)
    finally:
        monkeypatch.undo()
        ckpt.directory.chmod(0o755)
    # writable again: the next save records the new timeline first
    info = again.save(3, model, opt)
    assert info is not None and info.generation == 1
    assert json.loads((ckpt.directory / "windows.json").read_text())["generation"] == 1


def test_a_detection_whose_window_cannot_be_written_is_logged_not_raised(
        setup: Any, monkeypatch: Any, caplog: Any) -> None:
    """The window holds in memory: no save, and its checkpoints are not restored."""
    model, opt, ckpt = setup
    ckpt.keep = 5
    for s in range(3):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt)
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        if Path(dst).name == "windows.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        ckpt.record_detection(Detection("replay", 2, (1,), "", {}), verified_through=0)
    assert any("recorded in memory only" in r.getMessage() and "windows.json" in r.getMessage()
               for r in caplog.records)
    assert ckpt.save(3, model, opt) is None
    assert [c.step for c in ckpt.checkpoints() if ckpt.refused(c)] == [2, 1]
    assert ckpt.restore(model, opt) == 1
    assert not list(ckpt.directory.glob(".*"))


def failing_writer_run(rank: int, world: int, directory: str, background: bool
                       ) -> dict[str, Any]:
    """Rank 0's storage is full; what each rank's ``save`` raises."""
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(directory)
    ckpt.save(0, model, opt)
    if rank == 0:
        mp = pytest.MonkeyPatch()
        _full_disk_for_big_writes(mp)
    got: dict[str, Any] = {}
    try:
        ckpt.save(1, model, opt, background=background)
        if background:
            ckpt.save(2, model, opt)  # the background write's failure, raised by the next save
    except CheckpointWriteError as e:
        got = {"type": type(e).__name__, "message": str(e), "errno": e.errno}
    if rank == 0:
        mp.undo()
    got["after"] = ckpt.save(3, model, opt) is not None  # every rank goes on together
    got["left"] = _left_behind(Path(directory))
    return got


@pytest.mark.parametrize("background", [False, True])
def test_every_rank_raises_the_writers_storage_error(tmp_path: Path, background: bool) -> None:
    res = run_ranks(failing_writer_run, 2, str(tmp_path / "c"), background)
    assert res[0]["type"] == res[1]["type"] == "CheckpointWriteError"
    assert res[0]["message"] == res[1]["message"]
    assert "step-000000001-g0.pt could not be written" in res[1]["message"]
    assert res[1]["errno"] == errno.ENOSPC
    assert [r["after"] for r in res] == [True, False]  # rank 0 returns the manifest
    assert res[0]["left"] == []


def test_a_second_job_is_refused_with_the_reason_and_the_fix(
        one_rank: None, tmp_path: Path, monkeypatch: Any) -> None:
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = tmp_path / "shared"
    monkeypatch.setenv("SDC_GUARD_JOB", "job-a")
    a = CheckpointManager(d)
    a.save(0, model, opt)
    assert json.loads((d / "owner.json").read_text())["job"] == "job-a"
    CheckpointManager(d)  # the same job, restarted: its own directory
    with pytest.raises(CheckpointOwnerError) as e:
        CheckpointManager(d, job_id="job-b")
    msg = str(e.value)
    assert "belongs to job 'job-a'" in msg and "this is job 'job-b'" in msg
    assert "a directory of its own" in msg and str(d / "owner.json") in msg
    monkeypatch.delenv("SDC_GUARD_JOB")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's placeholder: unnamed
    with pytest.raises(CheckpointOwnerError, match="this is an unnamed job"):
        CheckpointManager(d)
    # job b takes over while job a is still running (its lease expired): a's save refuses
    rec = json.loads((d / "owner.json").read_text())
    rec["renewed_at"] = time.time() - rec["lease_s"] - 1
    (d / "owner.json").write_text(json.dumps(rec))
    b = CheckpointManager(d, job_id="job-b")
    with pytest.raises(CheckpointOwnerError, match="belongs to job 'job-b'"):
        a.save(1, model, opt)
    assert [c.step for c in b.checkpoints()] == [0]
    with pytest.raises(ValueError, match=r"lease_s=...\) must be seconds > 0"):
        CheckpointManager(d, job_id="job-b", lease_s=0)
