"""Any elementwise optimizer, from the client or from the config, steps the shards exactly as torch steps
the whole model in one process: per-step losses and every parameter match a single-process reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import zero3
from tests import models
from tests.devices import ON_DEVICES, cpu_ranks_or_one_gpu
from tests.distributed import run_ranks
from zero3.optim import Lion

MICRO, STEPS, CLIP = 4, 4, 1.0
Factory = Callable[[Any], torch.optim.Optimizer]
# The world of two on the CPU, and a world of one on CUDA (two ranks cannot share one GPU): the client's
# step then runs on the device's tensors, against the CPU reference (to 1e-5, not bit for bit).
TWO_OR_CUDA = cpu_ranks_or_one_gpu(2)


class ElementwiseSGD(torch.optim.SGD):
    """A user's subclass that declares its update elementwise."""

    elementwise = True


class UndeclaredAdam(torch.optim.Adam):
    """A subclass of an elementwise class that says nothing: its step may have changed."""


# Client optimizers: a factory over (param groups), built the same way for zero3 and for the reference.
CLIENTS: dict[str, Factory] = {
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.05),
    "SGD-momentum-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True,
                                                            weight_decay=0.01),
    "SGD-dampening": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, dampening=0.3),
    "Adam": lambda groups: torch.optim.Adam(groups, lr=3e-3, weight_decay=0.01),
    "AdamW-amsgrad": lambda groups: torch.optim.AdamW(groups, lr=3e-3, amsgrad=True),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1, lr_decay=0.01),
    "RMSprop-centered-momentum": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5, centered=True),
    "Adamax": lambda groups: torch.optim.Adamax(groups, lr=3e-3),
    "NAdam": lambda groups: torch.optim.NAdam(groups, lr=3e-3, weight_decay=0.01),
    "RAdam": lambda groups: torch.optim.RAdam(groups, lr=3e-3, decoupled_weight_decay=True, weight_decay=0.01),
    "user-subclass": lambda groups: ElementwiseSGD(groups, lr=0.05, momentum=0.8),
}


def groups_of(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups, as Hugging Face's Trainer makes them: biases without decay, and their own lr."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0, "lr": 0.02},
    ]


def config(world: int, optimizer: dict | None = None, **zero: Any) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 300, **zero},
    }
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    return cfg


def reference_run(make: Factory, data: list) -> tuple[list[float], nn.Module]:
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = make(groups_of(model))
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


def zero3_run(rank: int, world: int, data: list, engine_of: Callable[[nn.Module], Any]) -> tuple[list[float], list]:
    torch.manual_seed(0)
    model = models.MLP()
    engine = engine_of(model)
    losses = models.mean_losses(engine, rank, world, data)
    full = [models.full_value(p).clone() for p in model.parameters()]  # on the host, beside the reference
    engine.destroy()
    return losses, full


def compare(losses: list[float], full: list, reference: tuple[list[float], nn.Module]) -> dict:
    ref_losses, ref_model = reference
    return {
        "loss_error": max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses)),
        "param_error": max((f - r.detach()).abs().max().item() for f, r in zip(full, ref_model.parameters())),
    }


def clients_train(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    data = models.batches("x8", STEPS, MICRO * world)
    out = {}
    for name in names:
        make = CLIENTS[name]

        def engine_of(model: nn.Module) -> Any:
            return zero3.initialize(model=model, optimizer=make(groups_of(model)), config=config(world))[0]

        out[name] = compare(*zero3_run(rank, world, data, engine_of), reference_run(make, data))
    return out


@TWO_OR_CUDA
def test_every_elementwise_client_optimizer_matches_torch(world: int, device: str) -> None:
    for result in run_ranks(world, clients_train, list(CLIENTS)):
        for name, errors in result.items():
            assert errors["loss_error"] <= 1e-5, (name, errors)
            assert errors["param_error"] <= 1e-5, (name, errors)


def lion_reference(groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], weight_decay: float):
    """Lion written out in plain torch, independently of zero3.optim.Lion."""

    class PlainLion(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})

        @torch.no_grad()
        def step(self) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    m = self.state[p].setdefault("m", torch.zeros_like(p))
                    update = (betas[0] * m + (1 - betas[0]) * p.grad).sign()
                    p.mul_(1 - group["lr"] * group["weight_decay"]).sub_(group["lr"] * update)
                    m.mul_(betas[1]).add_((1 - betas[1]) * p.grad)

    return PlainLion()


# Config sections and the reference each stands for (single-process torch on the same groups).
CONFIG_TYPES: dict[str, tuple[dict, Factory]] = {
    "SGD": ({"type": "sgd", "params": {"lr": 0.05, "momentum": 0.9}},
            lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9)),
    "Adagrad": ({"type": "Adagrad", "params": {"lr": 0.05, "initial_accumulator_value": 0.1}},
                lambda groups: torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1)),
    "RMSprop": ({"type": "RMSprop", "params": {"lr": 1e-3, "alpha": 0.9}},
                lambda groups: torch.optim.RMSprop(groups, lr=1e-3, alpha=0.9)),
    "NAdam": ({"type": "NAdam", "params": {"lr": 3e-3}}, lambda groups: torch.optim.NAdam(groups, lr=3e-3)),
    "Lion": ({"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1}},
             lambda groups: lion_reference(groups, 1e-3, (0.9, 0.99), 0.1)),
}
# Only on the tiers (three states per element).
TIER_TYPES = {
    "RMSprop-centered": ({"type": "RMSprop", "params": {"lr": 1e-3, "momentum": 0.5, "centered": True}},
                         lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5, centered=True)),
}


def config_types_train(rank: int, world: int, names: list[str], zero: dict) -> dict[str, dict]:
    data = models.batches("x8", STEPS, MICRO * world)
    out = {}
    for name in names:
        section, make = {**CONFIG_TYPES, **TIER_TYPES}[name]

        def engine_of(model: nn.Module) -> Any:
            return zero3.initialize(model=model, model_parameters=groups_of(model), config=config(world, section, **zero))[0]

        out[name] = compare(*zero3_run(rank, world, data, engine_of), reference_run(make, data))
    return out


@TWO_OR_CUDA
def test_config_types_match_torch(world: int, device: str) -> None:
    for result in run_ranks(world, config_types_train, list(CONFIG_TYPES), {}):
        for name, errors in result.items():
            assert errors["loss_error"] <= 1e-5, (name, errors)
            assert errors["param_error"] <= 1e-5, (name, errors)


@TWO_OR_CUDA
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_other_optimizers_on_the_offload_tiers(tier: str, tmp_path, world: int, device: str) -> None:
    """The tiers keep whatever states the optimizer has (RMSprop centered with momentum: three; Adagrad's
    sum, made in its constructor)."""
    zero = {"offload_optimizer": {"device": tier, **({"nvme_path": str(tmp_path)} if tier == "nvme" else {})}}
    for result in run_ranks(world, config_types_train, ["RMSprop-centered", "SGD", "Adagrad"], zero):
        for name, errors in result.items():
            assert errors["loss_error"] <= 1e-5, (name, errors)
            assert errors["param_error"] <= 1e-5, (name, errors)


def client_state_and_live_groups(rank: int, world: int) -> dict:
    """A client optimizer that has already stepped hands its state over; and changing lr in
    engine.optimizer.param_groups changes the step."""
    data = models.batches("x8", STEPS + 1, MICRO * world)
    make = CLIENTS["SGD-momentum-nesterov"]
    torch.manual_seed(0)
    model = models.MLP()
    client = make(groups_of(model))
    x, y = data[0]
    model(x, y).backward()  # one step in plain torch, on the whole batch, before zero3 takes over
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    client.step()
    client.zero_grad()
    engine = zero3.initialize(model=model, optimizer=client, config=config(world))[0]
    losses = models.mean_losses(engine, rank, world, data[1:])
    full = [models.full_value(p).clone() for p in model.parameters()]  # on the host, beside the reference
    result = compare(losses, full, reference_run_after(make, data))
    # lr 0 in every group: a plain SGD step with momentum still moves (the buffer); zero the momentum too.
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    before = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    x, y = data[-1]
    engine.backward(engine(x.chunk(world)[rank].to(engine.device), y.chunk(world)[rank].to(engine.device)))
    engine.step()
    result["moved_at_lr_0"] = any(
        not torch.equal(b, zero3.safe_get_full_fp32_param(p)) for b, p in zip(before, model.parameters()))
    result["lrs"] = engine.get_lr()
    engine.destroy()
    return result


def reference_run_after(make: Factory, data: list) -> tuple[list[float], nn.Module]:
    losses, model = reference_run(make, data)
    return losses[1:], model


@TWO_OR_CUDA  # on CUDA the state the client made on the host is taken over onto the device
def test_a_client_optimizers_state_is_taken_over_and_param_groups_are_live(world: int, device: str) -> None:
    for result in run_ranks(world, client_state_and_live_groups):
        assert result["loss_error"] <= 1e-5 and result["param_error"] <= 1e-5, result
        assert result["moved_at_lr_0"] is False
        assert result["lrs"] == [0.0, 0.0]


def refused(rank: int, world: int, case: str) -> str:
    model = models.MLP()
    if case == "lbfgs":
        client: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters())
        cfg = config(world)
    elif case == "undeclared":
        client = UndeclaredAdam(model.parameters())
        cfg = config(world)
    else:
        client = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = config(world, {"type": "AdamW"})
    with pytest.raises((ValueError, TypeError)) as info:
        zero3.initialize(model=model, optimizer=client, config=cfg)
    return str(info.value)


@pytest.mark.parametrize(("case", "expected"), [
    ("lbfgs", "torch.optim.lbfgs.LBFGS is not an elementwise optimizer"),
    ("undeclared", "UndeclaredAdam is not an elementwise optimizer"),
])
@ON_DEVICES
def test_refused_client_optimizers_name_the_problem(case: str, expected: str, device: str) -> None:
    (message,) = run_ranks(1, refused, case)
    assert expected in message


def test_lion_steps_like_its_formula() -> None:
    """zero3.optim.Lion on its own (foreach and per-tensor) against the formula."""
    torch.manual_seed(0)
    weights = [torch.randn(5, 3), torch.randn(7)]
    grads = [[torch.randn_like(w) for w in weights] for _ in range(3)]
    results = []
    for foreach in (True, False):
        params = [nn.Parameter(w.clone()) for w in weights]
        lion = Lion(params, lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, foreach=foreach)
        reference = [nn.Parameter(w.clone()) for w in weights]
        plain = lion_reference([{"params": reference}], 0.01, (0.8, 0.95), 0.1)
        for step_grads in grads:
            for p, r, g in zip(params, reference, step_grads):
                p.grad, r.grad = g.clone(), g.clone()
            lion.step()
            plain.step()
        results.append(all(torch.allclose(p, r, atol=1e-7) for p, r in zip(params, reference)))
    assert results == [True, True]


class TwoHeads(nn.Module):
    """Head `b` joins only later: until then the optimizer has no state for it (torch creates it lazily)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)
        self.use_b = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.a(x) + (self.b(x) if self.use_b else 0.0)
        return torch.nn.functional.mse_loss(out, y)


def _two_heads_engine(world: int) -> tuple[Any, TwoHeads]:
    torch.manual_seed(0)
    model = TwoHeads()
    # Dampening makes a first step differ from a step over a zero buffer: a lost "no state yet" shows.
    client = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.3)
    return zero3.initialize(model=model, optimizer=client, config=config(world))[0], model


def _steps(engine: Any, rank: int, world: int, batches: list) -> list[float]:
    losses = []
    for x, y in batches:
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def save_then_continue(rank: int, world: int, root: str) -> dict:
    data = models.batches("x8", 4, MICRO * world)
    engine, model = _two_heads_engine(world)
    _steps(engine, rank, world, data[:2])
    engine.save_checkpoint(root, tag="t")
    model.use_b = True
    after = _steps(engine, rank, world, data[2:])
    engine.destroy()
    return {"after": after}


def resume_two_heads(rank: int, world: int, root: str) -> list[float]:
    data = models.batches("x8", 4, MICRO * world)
    engine, model = _two_heads_engine(world)
    engine.load_checkpoint(root, tag="t")
    model.use_b = True
    losses = _steps(engine, rank, world, data[2:])
    engine.destroy()
    return losses


def test_a_checkpoint_keeps_which_parameters_have_optimizer_state(tmp_path) -> None:
    root = str(tmp_path)
    continued = run_ranks(2, save_then_continue, root)
    resumed = run_ranks(2, resume_two_heads, root)
    assert [r["after"] for r in continued] == resumed  # bit for bit
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(tmp_path / "t")).read_metadata().state_dict_metadata)
    assert {"optim.a.weight.momentum_buffer", "optim.a.bias.momentum_buffer"} <= keys
    assert not any(key.startswith("optim.b.") for key in keys)


def test_a_fused_kernel_is_chosen_only_for_the_devices_torch_has_it_for() -> None:
    """Adagrad's fused kernel is host-only, and torch says so only at the first step (on CUDA it raised
    there); Adam's is on every device. A parameter on another device (meta here, CUDA on a GPU) makes
    Adagrad foreach instead."""
    from zero3.optim import spec as optimizer_spec

    for device, fused in [("cpu", True), ("meta", False)]:
        params = [torch.nn.Parameter(torch.zeros(4, device=device))]
        adagrad = optimizer_spec.OptimizerSpec(torch.optim.Adagrad, {"lr": 0.1})
        _, chosen = optimizer_spec.build(adagrad, [{"params": params}])
        assert chosen is fused, device
    _, chosen = optimizer_spec.build(optimizer_spec.OptimizerSpec(torch.optim.AdamW, {"lr": 0.1}),
                                     [{"params": [torch.nn.Parameter(torch.zeros(4, device="meta"))]}])
    assert chosen


def client_beside_the_config(rank: int, world: int) -> dict:
    from tests.logs import zero3_messages

    records = zero3_messages()
    model = models.MLP()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, optimizer, *_ = zero3.initialize(model=model, optimizer=client, config=config(world, {"type": "AdamW"}))
    stepped = type(optimizer.optimizer).__name__
    lr = optimizer.param_groups[0]["lr"]
    engine.destroy()
    return {"stepped": stepped, "lr": lr, "warned": [m for m in records if "is ignored" in m]}


def test_a_client_optimizer_beside_the_configs_section_is_the_one_stepped_as_in_deepspeed() -> None:
    for rank, out in enumerate(run_ranks(2, client_beside_the_config)):
        assert out["stepped"] == "SGD" and out["lr"] == 0.1
        # Said once, by rank 0, naming both.
        assert len(out["warned"]) == (1 if rank == 0 else 0)
        assert all("AdamW" in m and "SGD" in m for m in out["warned"])
