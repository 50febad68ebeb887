"""CheckpointManager on one real gloo rank and real files: round trip with RNG states,
atomic files, corrupt / truncated / missing / unsafe checkpoints, keep, suspect windows."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import sdc_guard
from sdc_guard import CheckpointManager, Detection
from tests import workers


def _train(model: DDP, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        opt.zero_grad()
        workers.loss_fn(model, workers.batch_for(0, s)).backward()  # type: ignore[no-untyped-call]
        opt.step()


def _state(model: DDP, opt: torch.optim.Optimizer) -> int:
    return sdc_guard.fingerprint(sdc_guard.state_tensors(model.module, opt))


@pytest.fixture
def setup(one_rank: None, tmp_path: Path) -> tuple[DDP, torch.optim.Optimizer, CheckpointManager]:
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, CheckpointManager(tmp_path / "ckpt", keep=2)


def test_round_trip_restores_weights_optimizer_and_rng(setup: Any) -> None:
    model, opt, ckpt = setup
    _train(model, opt, range(3))
    random.seed(5)
    torch.manual_seed(7)
    info = ckpt.save(2, model, opt)
    assert info is not None and info.file.exists() and info.manifest.exists()
    saved = _state(model, opt)
    expect = (torch.rand(3).tolist(), random.random())
    _train(model, opt, range(3, 6))
    assert _state(model, opt) != saved
    assert ckpt.restore(model, opt) == 3
    assert _state(model, opt) == saved
    assert (torch.rand(3).tolist(), random.random()) == expect
    assert not list(ckpt.directory.glob(".*tmp*"))  # no temporary files left


def test_keep_bounds_the_others(setup: Any) -> None:
    model, opt, ckpt = setup
    for s in range(5):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt)
    assert [c.step for c in ckpt.checkpoints()] == [4, 3]
    assert len(list(ckpt.directory.glob("*.pt"))) == 2


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), "corrupt"),
    (lambda p: p.unlink(), "cannot be read"),
])
def test_a_damaged_checkpoint_is_refused_by_name_and_the_older_one_used(
        setup: Any, caplog: Any, damage: Any, reason: str) -> None:
    model, opt, ckpt = setup
    ckpt.save(0, model, opt)
    old = _state(model, opt)
    _train(model, opt, range(1, 2))
    newest = ckpt.save(1, model, opt)
    damage(newest.file)
    with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
        assert ckpt.restore(model, opt) == 1
    assert _state(model, opt) == old
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any(str(newest.file) in m and reason in m for m in errors), errors


def test_a_state_that_does_not_match_its_fingerprint_is_refused(setup: Any, caplog: Any) -> None:
    model, opt, ckpt = setup
    info = ckpt.save(0, model, opt)
    rec = json.loads(info.manifest.read_text())
    rec["fingerprint"] = "0" * 16
    info.manifest.write_text(json.dumps(rec))
    with caplog.at_level(logging.ERROR):
        assert ckpt.restore(model, opt) == 0
    assert any("fingerprint" in r.getMessage() for r in caplog.records)
    assert any("from scratch" in r.getMessage() for r in caplog.records)


def test_a_manifest_of_fingerprint_version_1_is_verified_with_version_1(
        setup: Any, caplog: Any) -> None:
    # Releases before fingerprint version 2 wrote format 2 manifests with no version and a
    # version 1 fingerprint: each is verified in the version it records, and one this release
    # does not compute is named unreadable.
    model, opt, ckpt = setup
    info = ckpt.save(0, model, opt)
    rec = json.loads(info.manifest.read_text())
    assert (rec["format"], rec["fingerprint_version"]) == (3, 2)
    tensors = sdc_guard.state_tensors(model.module, opt, every=True)
    v1, v2 = (f"{sdc_guard.fingerprint(tensors, version=v):016x}" for v in (1, 2))
    assert rec["fingerprint"] == v2 != v1
    saved = _state(model, opt)
    del rec["fingerprint_version"]
    rec.update(format=2, fingerprint=v1)
    info.manifest.write_text(json.dumps(rec))
    assert ckpt.checkpoints()[0].fingerprint_version == 1
    _train(model, opt, range(1, 3))
    assert ckpt.restore(model, opt) == 1 and _state(model, opt) == saved
    rec["fingerprint"] = v2  # a version 2 value where version 1 is recorded: refused
    info.manifest.write_text(json.dumps(rec))
    with caplog.at_level(logging.ERROR):
        assert ckpt.restore(model, opt) == 0
    assert any("fingerprint" in r.getMessage() for r in caplog.records)
    caplog.clear()
    rec.update(format=3, fingerprint=v2, fingerprint_version=9)
    info.manifest.write_text(json.dumps(rec))
    with caplog.at_level(logging.ERROR):
        assert ckpt.checkpoints() == []
    assert any(info.manifest.name in r.getMessage() and "fingerprint version 9" in r.getMessage()
               for r in caplog.records)


class _Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("arbitrary code ran",))


def test_loading_never_unpickles_arbitrary_objects(setup: Any, caplog: Any) -> None:
    model, opt, ckpt = setup
    info = ckpt.save(0, model, opt)
    import hashlib
    import io

    buf = io.BytesIO()
    torch.save({"format": 1, "model": _Payload()}, buf)
    data = buf.getvalue()
    info.file.write_bytes(data)
    rec = json.loads(info.manifest.read_text())
    rec.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    info.manifest.write_text(json.dumps(rec))
    with caplog.at_level(logging.ERROR):
        assert ckpt.restore(model, opt) == 0
    assert any("weights_only" in r.getMessage() for r in caplog.records)


def test_the_suspect_window_refuses_checkpoints_inside_it_and_survives_a_restart(
        setup: Any) -> None:
    model, opt, ckpt = setup
    ckpt.keep = 10
    for s in range(4):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt)
        if s == 1:
            at_1 = _state(model, opt)
    d = Detection("replay", 3, (1,), "", {})
    ckpt.record_detection(d, verified_through=1)  # the window opens at step 2
    assert ckpt.save(4, model, opt) is None  # the state is suspect: no new checkpoint
    again = CheckpointManager(ckpt.directory, keep=10)  # a restarted job reads windows.json
    refused = [c.step for c in again.checkpoints() if again.refused(c)]
    assert refused == [3, 2]
    assert again.restore(model, opt) == 2
    assert _state(model, opt) == at_1
    # a new timeline: checkpoints after the restore are not covered by the old window
    _train(model, opt, range(2, 3))
    info = again.save(2, model, opt)
    assert info is not None and again.refused(info) is None
    assert again.restore(model, opt) == 3


def test_keep_never_deletes_the_newest_checkpoint_verified_clean(one_rank: None,
                                                                 tmp_path: Path) -> None:
    """With the replay audit every 4 steps, only audited steps are verified clean (and the
    non-finite check's steps only once their flags are collected, a step later here); keep=1
    would otherwise delete the last checkpoint at or before the last audit."""
    model = DDP(workers.make_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointManager(tmp_path / "c", keep=1)
    guard = sdc_guard.SDCGuard(model, opt, loss_fn=workers.loss_fn, batch_for=workers.batch_for,
                               config=sdc_guard.GuardConfig(replay_interval=4,
                                                            deterministic=True,
                                                            nonfinite_exchange_interval=1),
                               checkpoints=ckpt)
    for s in range(7):
        guard.step(s)
        ckpt.save(s, model, opt)
    assert guard.clean_through == 4
    assert [c.step for c in ckpt.checkpoints()] == [6, 4]


def _scheduled(model: DDP, opt: torch.optim.Optimizer, sched: Any, steps: range) -> None:
    for s in steps:
        _train(model, opt, range(s, s + 1))
        sched.step()


def test_extra_states_resume_the_schedule_where_it_was_saved(setup: Any) -> None:
    """An LR scheduler and a GradScaler saved beside the model: after a rollback, training
    from the restored step on reproduces the uninterrupted run bit for bit. Restored
    without them, the schedule stays where the run had got to and the run diverges."""
    model, opt, ckpt = setup
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))  # its scale tensor exists from the first scaled loss on
    extra = {"lr": sched, "scaler": scaler}
    _scheduled(model, opt, sched, range(3))
    ckpt.save(2, model, opt, extra=extra)
    _scheduled(model, opt, sched, range(3, 7))
    scaler.update(new_scale=3.0)
    uninterrupted = _state(model, opt)
    assert ckpt.restore(model, opt, extra=extra) == 3
    assert (sched.last_epoch, scaler.get_scale()) == (3, 2.0 ** 10)
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups] == [1e-2 * 0.5 ** 3]
    _scheduled(model, opt, sched, range(3, 7))
    assert _state(model, opt) == uninterrupted
    assert ckpt.restore(model, opt) == 3  # the schedule left at step 7: another run
    _scheduled(model, opt, sched, range(3, 7))
    assert _state(model, opt) != uninterrupted


class _NoState:
    def state_dict(self) -> dict[str, Any]:
        return {"f": print}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_extra_states_are_checked_by_name_before_anything_is_written(setup: Any) -> None:
    model, opt, ckpt = setup
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with pytest.raises(ValueError, match=r"extra=\{'lr': \.\.\.\}\): a int has no state_dict"):
        ckpt.save(0, model, opt, extra={"lr": 3})
    with pytest.raises(ValueError, match=r"extra=\{'f': \.\.\.\}\).*_NoState does not load "
                                         r"with torch.load\(weights_only=True\)"):
        ckpt.save(0, model, opt, extra={"f": _NoState()})
    with pytest.raises(ValueError, match=r"the key 0 must be a non-empty str"):
        ckpt.save(0, model, opt, extra={0: sched})
    assert ckpt.checkpoints() == []
    ckpt.save(0, model, opt)
    with pytest.raises(ValueError, match=r"holds no state for \['lr'\] \(it holds \[\]\)"):
        ckpt.restore(model, opt, extra={"lr": sched})
    ckpt.save(1, model, opt, extra={"lr": sched})
    with pytest.raises(ValueError, match=r"extra=\{'lr': \.\.\.\}\): this GradScaler's "
                                         r"load_state_dict refused"):
        ckpt.restore(model, opt, extra={"lr": torch.amp.GradScaler("cpu")})


def test_a_background_save_holds_the_state_of_its_step_and_commits_on_a_thread(
        setup: Any) -> None:
    model, opt, ckpt = setup
    _train(model, opt, range(2))
    info = ckpt.save(1, model, opt, background=True)
    saved = _state(model, opt)
    _train(model, opt, range(2, 4))  # the parameters change in place while it writes
    ckpt.wait()
    assert [c.step for c in ckpt.checkpoints()] == [1]
    assert ckpt.checkpoints()[0].sha256 == info.sha256
    assert ckpt.restore(model, opt) == 2  # waits for any write in flight first
    assert _state(model, opt) == saved
    _train(model, opt, range(2, 3))
    ckpt.save(2, model, opt, background=True)
    assert ckpt.restore(model, opt) == 3  # the write in flight was committed first


def test_a_failed_background_write_is_raised_by_wait_and_leaves_no_manifest(
        setup: Any, caplog: Any) -> None:
    model, opt, ckpt = setup
    ckpt.save(0, model, opt)
    (ckpt.directory / "step-000000001-g0.pt").mkdir()  # the data file cannot be renamed there
    ckpt.save(1, model, opt, background=True)
    with pytest.raises(sdc_guard.checkpoint.CheckpointError,
                       match=r"background write of checkpoint .*step-000000001-g0\.pt failed"):
        ckpt.wait()
    assert [c.step for c in ckpt.checkpoints()] == [0]
    (ckpt.directory / "step-000000002-g0.pt").mkdir()
    ckpt.save(2, model, opt, background=True)
    with caplog.at_level(logging.ERROR):  # restore logs the failure and uses what is there
        assert ckpt.restore(model, opt) == 1
    assert any("step-000000002-g0.pt failed" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"save\(background=...\): a bool, got 'yes'"):
        ckpt.save(3, model, opt, background="yes")


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_before_anything_loads(
        setup: Any) -> None:
    # A model changed since the checkpoint (a wider layer, one more layer): the optimizer
    # loaded first, then the model's load_state_dict raised a torch error after copying the
    # tensors that fit, leaving the run half restored (the optimizer's moments of other
    # shapes) and the file unnamed. Both are now compared first and nothing loads.
    model, opt, ckpt = setup
    _train(model, opt, range(2))
    info = ckpt.save(1, model, opt)
    assert info is not None
    wider = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4)))
    deeper = torch.nn.Sequential(*list(workers.make_mlp().children()), torch.nn.Linear(4, 4))
    for other in (wider, DDP(deeper)):
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        before = _state(other, other_opt)
        with pytest.raises(ValueError, match="holds another model than the one given") as e:
            ckpt.restore(other, other_opt)
        assert str(info.file) in str(e.value) and "Nothing was loaded" in str(e.value)
        assert _state(other, other_opt) == before and not other_opt.state
    assert "(32, 8) in the model" in _refusal(ckpt, wider)
    # The same model with its parameters grouped otherwise (no weight decay on the biases)
    fresh = DDP(workers.make_mlp())
    groups: list[dict[str, Any]] = [
        {"params": [p for p in fresh.parameters() if p.dim() == 2]},
        {"params": [p for p in fresh.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    grouped = torch.optim.AdamW(groups, lr=1e-2)
    with pytest.raises(ValueError, match=r"param groups of \[6\] parameters, the one given "
                                         r"\[3, 3\]"):
        ckpt.restore(fresh, grouped)
    assert not grouped.state
    # Several optimizers: the second refused before the first loads
    first = torch.optim.AdamW(list(fresh.parameters())[:4], lr=1e-2)
    second = torch.optim.AdamW(list(fresh.parameters())[4:], lr=1e-2)
    ckpt2 = CheckpointManager(ckpt.directory.parent / "two")
    _train(fresh, grouped, range(1))
    ckpt2.save(0, fresh, [first, second])
    third = torch.optim.AdamW(list(fresh.parameters())[4:5], lr=1e-2)
    with pytest.raises(ValueError, match=r"optimizer 1 \(AdamW\) has param groups"):
        ckpt2.restore(fresh, [first, third])
    assert not first.state
    assert ckpt2.restore(fresh, [first, second]) == 1


def _refusal(ckpt: CheckpointManager, model: DDP) -> str:
    try:
        ckpt.restore(model, torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
def test_a_quantisation_aware_model_restores_into_a_fresh_one(one_rank: None,
                                                              tmp_path: Path) -> None:
    # Its observers' ranges and its fake quantisers' scales start empty or 1-long and take
    # their shapes from training; their own loaders resize them. The check for another
    # model compares the parameters' shapes, not those buffers'.
    import torch.ao.quantization as quant

    def make() -> DDP:
        net: Any = torch.nn.Sequential(quant.QuantStub(), *workers.make_mlp().children(),
                                       quant.DeQuantStub())
        net.qconfig = quant.get_default_qat_qconfig("x86")  # type: ignore[no-untyped-call]
        quant.prepare_qat(net.train(), inplace=True)  # type: ignore[no-untyped-call]
        return DDP(net)

    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, range(2))
    ckpt = CheckpointManager(tmp_path / "qat")
    ckpt.save(1, model, opt)
    fresh = make()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert ckpt.restore(fresh, fresh_opt) == 2
    a, b = model.module.state_dict(), fresh.module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


@pytest.mark.parametrize(
    ("step", "verified", "since", "start"),
    [
        (5, 2, None, 3),      # after the newest step every check verified
        (5, None, None, 5),   # no check keeps a verified step: the detection's own
        (5, 7, None, 5),      # verified past it (a check that lags less): never after d.step
        (9, 8, 4, 4),         # repaired before from step 4: a permanent fault's first sign
    ])
def test_the_window_rule_lives_with_the_windows(step: int, verified: int | None,
                                                since: int | None, start: int) -> None:
    evidence = {} if since is None else {"repair": {"since": since}}
    d = Detection("weights", step, (1,), "", evidence)
    assert sdc_guard.checkpoint.SuspectWindows.start_of(d, verified) == start


class _Verifier:
    """A verifier of our own (the Verifier protocol): no guard."""

    group = None

    def __init__(self) -> None:
        self.through: int | None = -1
        self.rewound: list[int] = []

    def verified(self) -> tuple[int | None, dict[str, int]]:
        return self.through, {"mine": -1 if self.through is None else self.through}

    def rewind(self, step: int) -> None:
        self.rewound.append(step)


def test_a_manager_takes_what_it_needs_as_values_and_a_small_protocol(setup: Any) -> None:
    model, opt, ckpt = setup
    ckpt.keep = 1
    # Without a verifier: save(verified_through=) keeps the newest verified checkpoint.
    for s in range(4):
        _train(model, opt, range(s, s + 1))
        ckpt.save(s, model, opt, verified_through=1)
    assert [c.step for c in ckpt.checkpoints()] == [3, 1]
    # A bound verifier is asked on save's thread; a background write prunes with the value
    # read then, not with what the verifier says while the write runs.
    v = _Verifier()
    ckpt.bind(v)
    v.through = 3
    _train(model, opt, range(4, 5))
    info = ckpt.save(4, model, opt, background=True)
    v.through = None  # changes after save returned: the writer must not read it
    ckpt.wait()
    assert info is not None and info.clean_through == 3
    assert [c.step for c in ckpt.checkpoints()] == [4, 3]
    with pytest.raises(ValueError, match="verified_through"):
        ckpt.save(5, model, opt, verified_through=4)
    with pytest.raises(TypeError, match="not a Verifier"):
        ckpt.bind(object())
    with pytest.raises(ValueError, match="verified_through"):
        ckpt.record_detection(Detection("weights", 3, (1,), "", {}),
                              verified_through="2")
    assert ckpt.restore(model, opt) == 5 and v.rewound == [4]


def test_the_checkpoint_package_imports_nothing_of_the_guard() -> None:
    # What its modules import, read from their source (sdc_guard/__init__ imports the guard
    # itself, so sys.modules after an import could not tell).
    import ast

    root = Path(sdc_guard.__file__).parent / "checkpoint"
    imported: set[str] = set()
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
    ours = sorted(m for m in imported if m.startswith("sdc_guard"))
    assert ours and not [m for m in ours if m.startswith(("sdc_guard.guard", "sdc_guard.checks"))], ours


def test_a_filter_on_the_checkpoint_logger_sees_its_records(setup: Any, caplog: Any) -> None:
    # A harness silences the from-scratch record with a filter on "sdc_guard.checkpoint";
    # a filter on a logger does not see its children's records, so the name must be that.
    model, opt, ckpt = setup
    seen: list[str] = []
    logger = logging.getLogger("sdc_guard.checkpoint")

    def keep(record: logging.LogRecord) -> bool:
        seen.append(getattr(record, "sdc_event", ""))
        return True

    logger.addFilter(keep)
    try:
        with caplog.at_level(logging.ERROR, logger="sdc_guard.checkpoint"):
            assert ckpt.restore(model, opt) == 0
    finally:
        logger.removeFilter(keep)
    assert CheckpointManager.FROM_SCRATCH in seen
