"""Sites, handles and arming in one process (no process group): the plain-loop path.

The gradient sites need a DDP comm hook and are covered by ``test_injectors_dist.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from injectors import Fault, FaultError, InjectionContext, arm
from injectors.bits import read_bits
from sdc_guard import EventLog, read_events


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


X = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
Y = torch.tensor([0, 1, 2, 0, 1])


def _train(model: nn.Module, ctx: InjectionContext | None, steps: int,
           opt: torch.optim.Optimizer | None = None) -> list[dict[str, Any]]:
    """A plain loop; returns per-step loss, output and parameter gradients."""
    out = []
    for s in range(steps):
        if ctx is not None:
            ctx.begin_step(s)
        model.zero_grad(set_to_none=True)
        logits = model(X)
        loss = F.cross_entropy(logits, Y)
        loss.backward()  # type: ignore[no-untyped-call]
        out.append({"loss": loss.item(), "logits": logits.detach().clone(),
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                              if p.grad is not None}})
        if opt is not None:
            opt.step()
    return out


def _no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._backward_hooks for m in model.modules())


def test_activation_flip_changes_the_output_at_that_step_and_backward_still_works() -> None:
    clean = _train(_model(), None, 3)
    model = _model()
    records: list[dict[str, Any]] = []
    ctx = InjectionContext.plain(model, events=records)
    # Module "1" is a ReLU, which saves its output for backward: in-place corruption would
    # break autograd; the injector corrupts a clone.
    with arm(Fault(site="activation", rank=0, step=1, target="1", index=9, bits=(30,)),
             context=ctx) as h:
        faulty = _train(model, ctx, 3)
        assert h.active
    assert not h.active and _no_hooks(model)
    assert faulty[0]["loss"] == clean[0]["loss"]
    assert faulty[1]["loss"] != clean[1]["loss"]
    assert faulty[2]["loss"] == clean[2]["loss"]  # transient, and no optimizer: back to clean
    assert h.records == records and len(records) == 1
    rec = records[0]
    assert rec["event"] == "injection" and rec["site"] == "activation" and rec["step"] == 1
    assert rec["target"] == "1" and rec["index"] == 9 and rec["bits"] == [30]
    assert rec["before"][0] ^ rec["after"][0] == 1 << 30 and rec["phase"] == "train"


def test_activation_grad_changes_gradients_not_the_loss() -> None:
    clean = _train(_model(), None, 2)
    model = _model()
    ctx = InjectionContext.plain(model)
    with arm(Fault(site="activation_grad", rank=0, step=0, target="2", index=4, bits=(23,)),
             context=ctx) as h:
        faulty = _train(model, ctx, 2)
    assert faulty[0]["loss"] == clean[0]["loss"]
    assert torch.equal(faulty[0]["logits"], clean[0]["logits"])
    # dL/dlogits[1, 1] doubled or halved: the last layer's gradients differ in row 1 only.
    diff = faulty[0]["grads"]["2.weight"] != clean[0]["grads"]["2.weight"]
    assert diff[1].any() and not diff[0].any() and not diff[2].any()
    assert torch.equal(faulty[1]["grads"]["2.weight"], clean[1]["grads"]["2.weight"])
    assert [r["step"] for r in h.records] == [0] and _no_hooks(model)


def test_activation_grad_does_not_fire_without_a_backward() -> None:
    model = _model()
    ctx = InjectionContext.plain(model)
    with arm(Fault(site="activation_grad", rank=0, step=0, target="2", bits=(3,)),
             context=ctx) as h:
        ctx.begin_step(0)
        with torch.no_grad():
            model(X)
    assert h.records == []


def test_weight_storage_and_optimizer_state_at_the_start_of_the_step(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    log = tmp_path / "inj.jsonl"
    ctx = InjectionContext.plain(model, optimizer=opt, events=EventLog(log, rank=0))
    first, last = model[0], model[2]
    assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
    w = first.weight
    weight = arm(Fault(site="weight_storage", rank=0, step=1, target="0.weight", index=13,
                       kind="set", value=-2.5), context=ctx)
    moment = arm(Fault(site="optimizer_state", rank=0, step=2, target="2.bias",
                       state_key="exp_avg", index=1, bits=(31,)), context=ctx)
    ctx.begin_step(0)
    assert weight.records == [] and moment.records == []
    opt.step()  # (no gradients yet: Adam skips parameters without grad)
    _train(model, None, 1, opt)  # creates Adam's state
    ctx.begin_step(1)
    assert w.view(-1)[13].item() == -2.5
    rec = weight.records[0]
    assert rec["after"] == [read_bits(w, 13)[0]] and rec["kind"] == "set" and rec["bits"] == []
    m = opt.state[last.bias]["exp_avg"]
    before = m[1].item()
    ctx.begin_step(1)  # the same step again: nothing fires twice
    ctx.begin_step(2)
    assert m[1].item() == -before and moment.records[0]["state_key"] == "exp_avg"
    weight.remove()
    moment.remove()
    assert ctx.step_hooks == []
    logged = read_events(log)
    assert [(e["site"], e["step"], e["rank"]) for e in logged] == [
        ("weight_storage", 1, 0), ("optimizer_state", 2, 0)]


def test_optimizer_state_missing_at_the_firing_step_is_a_named_error() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ctx = InjectionContext.plain(model, optimizer=opt)
    arm(Fault(site="optimizer_state", rank=0, step=0, target="0.bias",
              state_key="momentum_buffer", bits=(1,)), context=ctx)
    with pytest.raises(FaultError, match=r"Fault\.state_key: .*first optimizer\.step\(\)"):
        ctx.begin_step(0)


def test_permanent_and_intermittent_faults_hit_the_same_element_every_time() -> None:
    model = _model()
    ctx = InjectionContext.plain(model)
    perm = arm(Fault(site="weight_storage", rank=0, step=2, target="2.weight",
                     field="exponent", count=2, model="permanent", seed=5), context=ctx)
    inter = arm(Fault(site="activation", rank=0, step=0, target="0", kind="random",
                      model="intermittent", p=0.5, seed=5), context=ctx)
    for s in range(12):
        ctx.begin_step(s)
        model(X)
    assert [r["step"] for r in perm.records] == list(range(2, 12))
    assert len({(r["index"], tuple(r["bits"])) for r in perm.records}) == 1
    assert all(b in range(23, 31) for b in perm.records[0]["bits"])
    fired = [r["step"] for r in inter.records]
    assert fired == [s for s in range(12) if inter.fault.active_at(s)]
    assert len({r["index"] for r in inter.records}) == 1  # same element ...
    assert len({tuple(r["after"]) for r in inter.records}) == len(fired)  # ... fresh words


def test_field_fault_models_land_as_they_say_and_repeat_where_a_broken_cell_would() -> None:
    """A column burst in a linear layer's product (one lane of a matrix unit wrong in each
    row), a burst of neighbouring lanes each at its own random bit, and a bit stuck at 1
    in a weight over several steps: each lands where its record says, the same element and
    bits at every step it fires (the permanent ones), and the stuck bit changes the weight
    only where it held 0."""
    model = _model()
    ctx = InjectionContext.plain(model)
    column = arm(Fault(site="linear_product", rank=0, step=0, target="0", index=2, burst=4,
                       along="column", bits=(30,)), context=ctx)
    lanes = arm(Fault(site="activation", rank=0, step=1, target="1", burst=5,
                      field="any", burst_bits="each", model="permanent", seed=3), context=ctx)
    stuck = arm(Fault(site="weight_storage", rank=0, step=1, target="2.weight", index=4,
                      kind="stuck", stuck=1, bits=(30,), burst=3, model="permanent"),
                context=ctx)
    last = model[2]
    assert isinstance(last, nn.Linear)
    w = last.weight
    for s in range(4):
        ctx.begin_step(s)
        model(X)
    rec = column.records[0]
    assert (rec["index"], rec["stride"], rec["bits"]) == (2, 8, [30])  # rows of 8 outputs
    assert [r["step"] for r in lanes.records] == [1, 2, 3]
    each = lanes.records[0]["bits_each"]
    assert len(each) == 5 and len({tuple(b) for b in each}) > 1  # their own bits
    assert all(r["bits_each"] == each and r["index"] == lanes.records[0]["index"]
               for r in lanes.records)
    assert [[a ^ b for a, b in zip(r["before"], r["after"], strict=True)] for r in lanes.records] \
        == [[sum(1 << b for b in bits) for bits in each]] * 3
    first, *later = stuck.records
    assert first["stuck"] == 1 and all(a >> 30 & 1 for a in first["after"])
    assert all(r["before"] == r["after"] for r in later)  # held, not flipped again
    assert all(v >> 30 & 1 for v in read_bits(w, 4, burst=3))


def test_a_fault_for_another_rank_validates_but_touches_nothing() -> None:
    model = _model()
    ctx = InjectionContext.plain(model, rank=0, world_size=3)
    h = arm(Fault(site="activation", rank=2, step=0, target="0", bits=(31,)), context=ctx)
    # One hook that does nothing, where the armed rank has its own (torch.compile then
    # splits the model alike on every rank); gone with the handle.
    assert not h.armed and not h.active and len(model[0]._forward_hooks) == 1
    clean = _train(_model(), None, 1)
    assert _train(model, ctx, 1)[0]["loss"] == clean[0]["loss"] and h.records == []
    h.remove()
    assert _no_hooks(model)
    with pytest.raises(FaultError, match="close matches"):
        arm(Fault(site="weight_storage", rank=2, step=0, target="2.weigh", bits=(1,)),
            context=ctx)
    with pytest.raises(FaultError, match="rank 3 does not exist"):
        arm(Fault(site="weight_storage", rank=3, step=0, target="2.weight", bits=(1,)),
            context=ctx)


@pytest.mark.parametrize(
    ("fault", "field", "hint"),
    [
        (Fault(site="activation", rank=0, step=0, target="3", bits=(1,)), "target",
         "no module '3'"),
        (Fault(site="weight_storage", rank=0, step=0, target="0.weights", bits=(1,)), "target",
         "close matches: ['0.weight'"),
        (Fault(site="weight_storage", rank=0, step=0, target="2.bias", index=2, burst=2,
               bits=(1,)), "index", "use index <= 1"),
        (Fault(site="weight_storage", rank=0, step=0, target="2.bias", burst=4, bits=(1,)),
         "burst", "do not fit"),
        (Fault(site="weight_storage", rank=0, step=0, target="2.bias", dtype="float64",
               bits=(1,)), "dtype", "not float64"),
        (Fault(site="gradient_before_allreduce", rank=0, step=0, target="2.bias", bits=(1,)),
         "site", "GuardCommHook"),
        (Fault(site="optimizer_state", rank=0, step=0, target="2.bias", state_key="exp_avg",
               bits=(1,)), "site", "needs the optimizer"),
    ],
)
def test_arming_refuses_what_the_model_cannot_take(fault: Fault, field: str, hint: str) -> None:
    ctx = InjectionContext.plain(_model())
    with pytest.raises(FaultError, match=rf"^Fault\.{field}: ") as info:
        arm(fault, context=ctx)
    assert hint in str(info.value) and info.value.field == field


def test_bits_beyond_the_tensors_width_are_refused_when_armed() -> None:
    model = _model().to(torch.float16)
    with pytest.raises(FaultError, match="bit 20 is out of range for a 16-bit float16"):
        arm(Fault(site="weight_storage", rank=0, step=0, target="0.bias", bits=(20,)),
            context=InjectionContext.plain(model))
    act = arm(Fault(site="activation", rank=0, step=0, target="0", bits=(20,)),
              context=(ctx := InjectionContext.plain(model)))
    ctx.begin_step(0)
    with pytest.raises(FaultError, match="16-bit float16"):  # activations: known at forward
        model(X.half())
    act.remove()


def test_module_without_a_tensor_output_is_a_named_error() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x

    model = nn.Sequential()
    model.add_module("pair", Pair())
    ctx = InjectionContext.plain(model)
    arm(Fault(site="activation", rank=0, step=0, target="pair", bits=(1,)), context=ctx)
    ctx.begin_step(0)
    with pytest.raises(FaultError, match="returned a tuple"):
        model(X)


def test_hooks_do_not_fire_on_a_deepcopy_of_the_model() -> None:
    model = _model()
    ctx = InjectionContext.plain(model)
    h = arm(Fault(site="activation", rank=0, step=0, target="2", bits=(31,), model="permanent"),
            context=ctx)
    twin = copy.deepcopy(model)  # carries the forward hook along
    ctx.begin_step(0)
    twin(X)
    assert h.records == []
    model(X)
    assert len(h.records) == 1


def test_the_step_source_and_arm_arguments() -> None:
    model = _model()
    guarded = InjectionContext(model, optimizer=None, comm=None, rank=0, world_size=1,
                               sink=lambda r: None, step_source=lambda: 4, step_hooks=[])
    assert guarded.step == 4 and guarded.phase == "train"
    with pytest.raises(RuntimeError, match="do not call begin_step"):
        guarded.begin_step(5)
    fault = Fault(site="activation", rank=0, step=0, target="0", bits=(1,))
    with pytest.raises(TypeError, match="exactly one of guard"):
        arm(fault)
    with pytest.raises(TypeError, match=r"expected an injectors\.Fault"):
        arm({"site": "activation"}, context=guarded)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank < world_size"):
        InjectionContext.plain(model, rank=1, world_size=1)
    with pytest.raises(TypeError, match="events must be"):
        InjectionContext.plain(model, events=3)  # type: ignore[arg-type]
    plain = InjectionContext.plain(model)
    assert plain.step == -1 and (plain.rank, plain.world_size) == (0, 1)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        plain.begin_step(-1)
