"""Leaf modules: DeepSpeed's z3_leaf family and the `leaf_module` config. A leaf's
parameters, its descendants' included, are one gather unit held by the leaf's forward; ranks that run
different experts inside it train like one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zero3
from tests import models
from tests.distributed import run_ranks

LR, MICRO, STEPS = 3e-3, 4, 4
ROUTES = ((0,), (1, 2), (2, 0), (), (1,))


class Experts(nn.Module):
    """A mixture of experts: which experts run (and in which order) depends on the batch (its route
    is read from the input data, so rounding cannot change it between zero3 and the reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(self, h: torch.Tensor, route: int) -> torch.Tensor:
        for index in ROUTES[route]:
            h = h + torch.tanh(self.experts[index](h))
        return h


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.moe = Experts()
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.moe(torch.relu(self.stem(x)), route_of(x))), y)


def route_of(x: torch.Tensor) -> int:
    """Which of ROUTES a batch takes: read from its data, so rounding cannot change it."""
    return int(abs(x[0, 1].item()) * 1000) % len(ROUTES)


def config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        # SGD: an update proportional to the gradient, so summation-order rounding stays rounding (Adam
        # turns a near-zero gradient's rounding into a whole-lr step of either sign).
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = MoEModel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in models.batches("x8", STEPS, MICRO * world):
        (sum(model(xs, ys) for xs, ys in zip(x.chunk(world), y.chunk(world))) / world).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def train(rank: int, world: int, how: str) -> dict:
    torch.manual_seed(0)
    model = MoEModel()
    zero: dict = {}
    if how == "function":
        assert zero3.set_z3_leaf_modules(model, [Experts]) == [model.moe]
    elif how == "config":
        zero = {"leaf_module": {"classes": ["Experts"]}}
    engine = zero3.initialize(model=model, config=config(**zero))[0]
    out = {
        "leaves": [type(m).__name__ for m in zero3.get_z3_leaf_modules(model)],
        "leaf_parameters": sorted(name for name, p in model.named_parameters() if zero3.z3_leaf_parameter(p)),
        "units": sorted(unit.label for unit in engine.units),
        "hooked_inside_leaf": [type(m).__name__ for m in model.moe.modules()
                               if m is not model.moe and engine.coordinator._module_units.get(m)],
    }
    out["routes"] = []
    for x, y in models.batches("x8", STEPS, MICRO * world):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        out["routes"].append(route_of(xs))
        engine.backward(engine(xs, ys))
        engine.step()
    out["params"] = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    out["live_after"] = engine.coordinator.live_numel()
    engine.destroy()
    dist.barrier()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["function", "config"])
def test_a_leaf_is_one_unit_and_ranks_on_different_experts_train_like_one_process(how: str) -> None:
    expected = reference(2)
    for out in run_ranks(2, train, how):
        assert out["leaves"] == ["Experts"]
        assert out["leaf_parameters"] == [f"moe.experts.{i}.{kind}" for i in range(3) for kind in ("bias", "weight")]
        assert out["units"] == ["head", "moe", "stem"]  # the three experts are one unit, the leaf's
        assert out["hooked_inside_leaf"] == []
        for name, ref in expected.items():
            diff = (out["params"][name] - ref).abs().max().item()
            assert torch.allclose(out["params"][name], ref, rtol=1e-4, atol=1e-6), (name, diff, out["routes"])
        assert out["live_after"] == 0


def test_setting_and_unsetting_leaves_by_class_name_and_suffix() -> None:
    model = MoEModel()
    assert zero3.set_z3_leaf_modules(model, ["Linear"]) == [model.stem, *model.moe.experts, model.head]
    assert zero3.unset_z3_leaf_modules(model, [nn.Linear]) == [model.stem, *model.moe.experts, model.head]
    assert zero3.get_z3_leaf_modules(model) == []
    found, missing = zero3.set_z3_leaf_modules_by_name(model, ["moe", "nope"], raise_if_not_found=False)
    assert found == [model.moe] and missing == ["nope"] and zero3.z3_leaf_module(model.moe)
    zero3.set_z3_leaf_module(model.moe, False)
    found, missing = zero3.set_z3_leaf_modules_by_suffix(model, ["experts.1", "absent"], raise_if_not_found=False)
    assert found == [model.moe.experts[1]] and missing == ["absent"]
    with pytest.raises(ValueError, match="no module of the classes"):
        zero3.set_z3_leaf_modules(model, ["Conv2d"])
    with pytest.raises(ValueError, match="no modules named"):
        zero3.set_z3_leaf_modules_by_name(model, ["missing"])
    with pytest.raises(TypeError, match="list of classes or class names"):
        zero3.set_z3_leaf_modules(model, nn.Linear)  # type: ignore[arg-type]


def test_module_granularity_threshold_makes_the_first_fine_grained_module_a_leaf() -> None:
    from zero3.partition.leaf_modules import set_leaves_by_granularity

    model = MoEModel()
    # Experts: 3 linears of 32*32+32 = 1056 elements in 4 layers (3 and itself): 792 per layer. The whole
    # model: 544 + 3168 + 264 = 3976 elements in 7 layers: 568 per layer, so top-down it comes first.
    assert set_leaves_by_granularity(model, 500) == []
    assert set_leaves_by_granularity(model, 600) == [model]
    # A container is never a leaf (its own forward may never run): under one, Experts is the candidate.
    model = nn.Sequential(nn.Linear(16, 32), Experts(), nn.Linear(32, 8))
    assert set_leaves_by_granularity(model, 791) == []
    assert set_leaves_by_granularity(model, 792) == [model[1]]
