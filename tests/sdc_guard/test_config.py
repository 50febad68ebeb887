"""Validation of GuardConfig and SDCGuard arguments: errors name the field and the fix."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

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
        ({"seed": -1}, r"seed must be an int in 0\.\.2\*\*63-1"),
        ({"seed": 2**64}, r"seed must be an int in 0\.\.2\*\*63-1"),
        ({"collective_timeout_s": 0}, "collective_timeout_s must be a number of seconds > 0"),
        ({"collective_timeout_s": float("nan")}, "collective_timeout_s must be a number"),
        ({"collective_timeout_s": True}, "collective_timeout_s must be a number"),
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
        GuardConfig(True)  # type: ignore[call-arg]


def test_guard_refuses_a_model_that_is_not_ddp() -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        SDCGuard(model, opt, loss_fn=lambda m, b: m(b).sum())


def test_guard_refuses_a_ddp_model_with_a_comm_hook_of_its_own(one_rank: None) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(2, 2))
    ddp.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"SDCGuard\(\.\.\., comm_hook=my_hook"):
        SDCGuard(ddp, opt, loss_fn=lambda m, b: m(b).sum())


def test_guard_refuses_accumulation_on_a_static_graph(one_rank: None) -> None:
    # PyTorch's reducer asserts under no_sync() with static_graph=True (pytorch#143580).
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(2, 2), static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"micro_batches=2 with .*static_graph=True.*micro_batches=1"):
        SDCGuard(ddp, opt, loss_fn=lambda m, b: m(b).sum(), config=GuardConfig(micro_batches=2))
    guard = SDCGuard(ddp, opt, loss_fn=lambda m, b: m(b).sum())  # one micro-batch: fine
    with pytest.raises(ValueError, match="static_graph"):
        guard.reconfigure(GuardConfig(micro_batches=3))


def _one_rank_guard(**kwargs: object) -> SDCGuard:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    args: dict[str, object] = {
        "loss_fn": lambda m, b: m(b).pow(2).mean(),
        "batch_for": lambda r, s: torch.ones(3, 4) * (s + 1),
        **kwargs}
    return SDCGuard(ddp, opt, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"loss_fn": lambda m, b: m(b).pow(2)}, ValueError,
         r"must return a scalar loss, got a tensor of shape \[3, 2\]: reduce it"),
        ({"loss_fn": lambda m, b: 1.0}, TypeError, "must return the loss as a torch.Tensor"),
        ({"batch_for": lambda r, s: None}, ValueError, r"batch_for\(0, 0\) returned None"),
        # in the replay too, which fetches and computes the neighbour's batch first
        ({"loss_fn": lambda m, b: m(b), "config": GuardConfig(replay_interval=1,
                                                              deterministic=True)},
         ValueError, "must return a scalar loss"),
    ])
def test_a_bad_batch_or_loss_is_named(one_rank: None, kwargs: dict[str, object],
                                      error: type[Exception], match: str) -> None:
    guard = _one_rank_guard(**kwargs)
    with pytest.raises(error, match=match):
        guard.step(0)


def test_replay_refuses_a_batch_for_that_is_not_a_function_of_its_arguments(
        one_rank: None) -> None:
    # Drawn from the global generator: another batch on every call. Every edge of the ring
    # would disagree, every rank a suspect; the audit names the cause on its first step.
    cfg = GuardConfig(replay_interval=1, deterministic=True)
    guard = _one_rank_guard(batch_for=lambda r, s: torch.randn(3, 4), config=cfg)
    with pytest.raises(ValueError, match=r"batch_for\(0, 0\) returned a different batch"):
        guard.step(0)
    fine = _one_rank_guard(config=cfg)  # seeded by (rank, step): audited as before
    assert [fine.step(s).detections for s in range(3)] == [[], [], []]


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor


@pytest.mark.parametrize("wrap", ["userdict", "dataclass"])
def test_a_batch_in_a_mapping_or_a_dataclass_is_compared_too(one_rank: None, wrap: str) -> None:
    # Hugging Face tokenizers return a BatchEncoding (a UserDict, not a dict); others a
    # dataclass. Their == compares tensors ambiguously, so the probe took any two as equal
    # and let a batch_for that draws anew each call through.
    def make(x: torch.Tensor) -> Any:
        return collections.UserDict({"x": x}) if wrap == "userdict" else _Batch(x)

    def loss(m: Any, b: Any) -> torch.Tensor:
        out: torch.Tensor = m(b["x"] if wrap == "userdict" else b.x).pow(2).mean()
        return out

    cfg = GuardConfig(replay_interval=1, deterministic=True)
    guard = _one_rank_guard(batch_for=lambda r, s: make(torch.randn(3, 4)), loss_fn=loss,
                            config=cfg)
    with pytest.raises(ValueError, match=r"batch_for\(0, 0\) returned a different batch"):
        guard.step(0)
    fine = _one_rank_guard(batch_for=lambda r, s: make(torch.full((3, 4), float(s))),
                           loss_fn=loss, config=cfg)
    assert [fine.step(s).detections for s in range(3)] == [[], [], []]


def test_a_compiled_ddp_is_refused_where_the_replay_would_run_other_code(one_rank: None) -> None:
    # The replay recomputes through the module inside DDP: with DDP itself compiled, the step
    # ran other kernels and every audit convicted every rank. Neither call compiles anything.
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    kw: dict[str, object] = {"loss_fn": lambda m, b: m(b).pow(2).mean(),
                             "batch_for": lambda r, s: torch.ones(3, 4),
                             "config": GuardConfig(replay_interval=1, deterministic=True)}
    with pytest.raises(TypeError, match=r"got torch.compile\(DistributedDataParallel"):
        SDCGuard(torch.compile(ddp), opt, **kw)  # type: ignore[arg-type]
    guard = SDCGuard(ddp, opt, **kw)  # type: ignore[arg-type]
    ddp.compile()  # after the guard was built: refused at the next audit step
    with pytest.raises(ValueError, match=r"the DistributedDataParallel itself is compiled"):
        guard.step(0)
    compiled = DDP(torch.nn.Linear(4, 2))
    compiled.compile()  # before: refused when the guard is built
    with pytest.raises(ValueError, match=r"DistributedDataParallel\(torch.compile\(module\)\)"):
        SDCGuard(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1),
                 **kw)  # type: ignore[arg-type]


def test_replay_refuses_sync_batchnorm() -> None:
    # Its statistics come from every rank's batch: in the replay, the same set merged in
    # another order. DDP refuses SyncBatchNorm on the CPU, so the rule is tested alone.
    from sdc_guard.checks.replay import _refuse_sync_batchnorm

    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(  # type: ignore[no-untyped-call]
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)))
    with pytest.raises(ValueError, match=r"SyncBatchNorm layers \['1'\].*turn the replay off"):
        _refuse_sync_batchnorm(model)
    _refuse_sync_batchnorm(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)))


def test_checkpoints_must_share_the_guards_group(one_rank: None, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sdc_guard import CheckpointManager

    group = dist.new_group([0])
    ddp = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    kw: dict[str, object] = {"loss_fn": lambda m, b: m(b).pow(2).mean(),
                             "batch_for": lambda r, s: torch.ones(3, 4), "process_group": group,
                             "config": GuardConfig(checksum=True)}
    with pytest.raises(ValueError, match=r"CheckpointManager\(directory, group=process_group\)"):
        SDCGuard(ddp, opt, checkpoints=CheckpointManager(tmp_path / "a"), **kw)  # type: ignore[arg-type]
    # Refused before the comm hook was registered: the same model takes a guard afterwards.
    guard = SDCGuard(ddp, opt, checkpoints=CheckpointManager(tmp_path / "b", group=group),
                     **kw)  # type: ignore[arg-type]
    assert guard.checkpoints is not None and guard.checkpoints.group is group
    assert guard.step(0).detections == []


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


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"products": ("forward", "gx")}, "products must be a non-empty tuple"),
    ({"products": ()}, "products must be a non-empty tuple"),
    ({"interval": 0}, "interval must be an int >= 1"),
    ({"exchange_interval": True}, "exchange_interval must be an int >= 1"),
    ({"tolerance_scale": 0.0}, "tolerance_scale must be a finite number > 0"),
    ({"tolerance_scale": float("inf")}, "tolerance_scale must be a finite number > 0"),
    ({"layers": "net.0"}, "layers must be a tuple of module names"),
])
def test_checksum_config_errors_name_the_field(kwargs: dict[str, object], match: str) -> None:
    from sdc_guard import ChecksumConfig

    with pytest.raises(ValueError, match=match):
        ChecksumConfig(**kwargs)  # type: ignore[arg-type]


def test_checksum_true_means_the_defaults() -> None:
    from sdc_guard import ChecksumConfig

    assert GuardConfig().checksum_config is None
    assert GuardConfig(checksum=True).checksum_config == ChecksumConfig()
    mine = ChecksumConfig(layers=["net.*"], products=["forward"], interval=2)  # type: ignore[arg-type]
    assert mine.layers == ("net.*",) and mine.products == ("forward",)
    assert GuardConfig(checksum=mine).checksum_config is mine
    with pytest.raises(ValueError, match=r"GuardConfig\.checksum must be True, False or a"):
        GuardConfig(checksum="yes")  # type: ignore[arg-type]


def test_checksum_tolerance_follows_the_rounding_bound() -> None:
    from sdc_guard.checks.checksum import tolerance, unit_roundoff

    cpu = torch.device("cpu")
    f32 = tolerance(1.0, k=1024, checked=3072, compute=torch.float32,
                    operands=(torch.float32, torch.float32), device=cpu)
    # g(K, u) + u + g(L + R + 2, u) with u = 2^-24, times the 1e-3 margin
    u = 2.0 ** -24
    expect = (1024 * u / (1 - 1024 * u) + u + 3074 * u / (1 - 3074 * u)) * 1.001
    assert f32 == pytest.approx(expect, rel=1e-12)
    bf16 = tolerance(1.0, k=1024, checked=3072, compute=torch.bfloat16,
                     operands=(torch.float32, torch.bfloat16), device=cpu)
    assert bf16 > f32 + 2 * unit_roundoff(torch.bfloat16)  # output and one operand rounded
    assert tolerance(2.0, k=8, checked=8, compute=torch.float32, operands=(), device=cpu) == \
        pytest.approx(2 * tolerance(1.0, k=8, checked=8, compute=torch.float32, operands=(),
                                    device=cpu))
    with pytest.raises(ValueError, match="float32, float64, bfloat16 and float16"):
        unit_roundoff(torch.int8)


def test_checksum_names_the_layers_whose_forward_never_ran(
        one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    # nn.MultiheadAttention multiplies by out_proj.weight in a functional call: the layer is
    # chosen (an nn.Linear subclass) but its hooks never run, so it is not checked; say so.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sdc_guard.checks.checksum import ChecksumCheck

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, _ = self.mha(x, x, x, need_weights=False)
            out: torch.Tensor = self.head(a.mean(1))
            return out

    ddp = DDP(Attn())
    guard = SDCGuard(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1),
                     loss_fn=lambda m, b: m(b).pow(2).mean(),
                     batch_for=lambda r, s: torch.ones(2, 3, 8), config=GuardConfig(checksum=True))
    with caplog.at_level("WARNING", logger="sdc_guard"):
        for s in range(3):
            assert guard.step(s).detections == []
    check = next(c for c in guard.checks if isinstance(c, ChecksumCheck))
    assert check.uncalled == ["mha.out_proj"]
    assert [r.getMessage() for r in caplog.records].count(
        "checksum: layer(s) ['mha.out_proj'] did not run their forward in step 0: a layer is "
        "checked only in the steps that run its forward, so one used through a functional call "
        "that bypasses it (as nn.MultiheadAttention does with out_proj) is never checked") == 1
    plain = _one_rank_guard(config=GuardConfig(checksum=True))
    plain.step(0)
    assert next(c for c in plain.checks if isinstance(c, ChecksumCheck)).uncalled == []


def test_one_batch_taken_for_micro_batches_is_named(one_rank: None) -> None:
    # With micro_batches=2, a batch_for that returns one (x, y) batch was taken as the two
    # micro-batches x and y, and the user's loss_fn failed on x ("too many values to
    # unpack"). Micro-batches of one step share one form; x and y do not.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from sdc_guard.types import micro_batches

    ddp = DDP(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = b
        return torch.nn.functional.cross_entropy(m(x), y)

    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    guard = SDCGuard(ddp, opt, loss_fn=loss_fn, batch_for=lambda r, s: (x, y),
                     config=GuardConfig(micro_batches=2, replay_interval=0))
    with pytest.raises(ValueError, match=r"micro_batches=2: batch_for\(rank, step\) returned 2 "
                                         r"items of different forms \(2-d float32 tensor; 1-d "
                                         r"int64 tensor\).*one batch.*\[\(x0, y0\), \(x1, y1\)\]"):
        guard.step(0)
    # what micro-batches of one step look like: same form, any lengths, ragged lists
    assert len(micro_batches([(x, y), (x[:3], y[:3])], 2)) == 2
    assert len(micro_batches([[x, x[:2]], [x]], 2)) == 2
    assert len(micro_batches([{"x": x, "y": y}, {"y": y[:1], "x": x[:1]}], 2)) == 2
    guard.reconfigure(GuardConfig(micro_batches=2, replay_interval=0))
    guard.batch_for = lambda r, s: [(x[:3], y[:3]), (x[3:], y[3:])]
    assert not guard.step(0).skipped


def test_an_unwritable_event_log_is_named_at_once_and_never_stops_a_detection(
        one_rank: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The log was first opened at the first detection: an unwritable path raised there, from
    # inside the step, before the detection reached the remediation and the checkpoints.
    import logging
    import shutil

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"GuardConfig.event_log='.*file/events.jsonl' cannot "
                                         r"be written .*writable directory, or event_log=None"):
        _one_rank_guard(config=GuardConfig(event_log=str(blocker / "events.jsonl")))
    log = tmp_path / "logs" / "events.jsonl"
    guard = _one_rank_guard(config=GuardConfig(event_log=str(log)),
                            batch_for=lambda r, s: torch.full((3, 4), float("nan")))
    assert log.exists()
    shutil.rmtree(tmp_path / "logs")  # the volume went away mid-run
    with caplog.at_level(logging.ERROR, logger="sdc_guard.guard"):
        found = guard.step(0).detections + guard.flush()
    assert [d.check for d in found] == ["nonfinite"]
    assert any("could not be written" in r.getMessage() for r in caplog.records)


class _Recorder:
    """A remediation that records what it was asked to act on."""

    def __init__(self) -> None:
        self.acted: list[tuple[str, int]] = []

    def bind(self, **kwargs: object) -> None:
        pass

    def act(self, detection: object) -> None:
        self.acted.append((detection.check, detection.step))  # type: ignore[attr-defined]

    def drain(self, timeout: float | None = None) -> bool:
        return True


def test_a_suspect_window_that_cannot_be_recorded_still_quarantines(
        one_rank: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The window was recorded first and a failure there (windows.json unwritable) raised
    # before the remediation ran: the suspect node stayed in service. Now the failure to
    # write is an ERROR naming the file (the window held in memory, no rank waiting on
    # another), and the remediation acts.
    from sdc_guard import CheckpointManager

    ckpt = CheckpointManager(tmp_path / "ckpt")
    (ckpt.directory / "windows.json").mkdir()  # cannot be read or replaced by a file
    quarantine = _Recorder()
    guard = _one_rank_guard(checkpoints=ckpt, remediation=quarantine,
                            batch_for=lambda r, s: torch.full((3, 4), float("nan")),
                            # applied: not contained, so it opens a window
                            config=GuardConfig(skip_step_on_detection=False))
    with caplog.at_level("ERROR"):
        guard.step(0)
        guard.flush()
    assert quarantine.acted == [("nonfinite", 0)]
    assert any("windows.json could not be written" in r.getMessage() for r in caplog.records)


def test_metrics_count_what_the_guard_did(one_rank: None) -> None:
    from sdc_guard import GuardMetrics

    metrics = GuardMetrics()
    nan_at = {2}
    guard = _one_rank_guard(
        metrics=metrics, config=GuardConfig(nonfinite_exchange_interval=1),
        batch_for=lambda r, s: torch.full((3, 4), float("nan") if s in nan_at else 1.0))
    for s in range(4):
        guard.step(s)
    guard.close()
    assert metrics.value("sdc_guard_steps_total") == 4
    assert metrics.value("sdc_guard_withheld_steps_total") == 1
    assert metrics.value("sdc_guard_withholds_total", "nonfinite") == 1
    assert metrics.value("sdc_guard_audits_total", "nonfinite") == 4
    assert metrics.value("sdc_guard_audits_total", "weights") == 4
    assert metrics.value("sdc_guard_detections_total", "nonfinite") == 1
    assert metrics.value("sdc_guard_contained_total", "nonfinite") == 1
    assert metrics.value("sdc_guard_verified_step") == 1  # stops before the detection's step
    with pytest.raises(TypeError, match="a sink needs record"):
        _one_rank_guard(metrics=object())


def test_an_optimizer_of_another_model_is_refused(one_rank: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(torch.nn.Linear(4, 2))
    other = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="holds none of the model's trained parameters"):
        SDCGuard(ddp, other, loss_fn=lambda m, b: m(b).sum(),
                 batch_for=lambda r, s: torch.ones(3, 4))


def test_a_step_beyond_64_bits_is_named(one_rank: None) -> None:
    # It was an "Overflow when unpacking long long" from deep inside a collective.
    guard = _one_rank_guard()
    for bad in (2**63, -1, 1.0):
        with pytest.raises(ValueError, match=r"step must be an int in 0\.\.2\*\*63-1"):
            guard.step(bad)  # type: ignore[arg-type]
    guard.step(2**63 - 1)  # the largest is a step like any other
