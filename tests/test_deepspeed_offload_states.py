"""DeepSpeed's own ZeRO-3 state-offloading test, ported: `TestDynamicOffloadStatesZero3` of
`tests/unit/v1/zero/test_offload_states.py` (the test DeepSpeed's `offload_states` API was specified with).

Every case of its grid (the included state, `pin_memory`, `non_blocking`, a statically offloaded optimizer)
at 2 ranks on the CPU, and at a world of one on CUDA where a device is (two nccl ranks cannot share one GPU).
As there, each case trains a step of `SimpleModel(1024, nlayers=4)` in bf16, offloads the included states to
the host, asks `get_state_devices` where each is (the host; nothing for the freed scratch bucket), reloads,
and checks every state bit for bit and where it is again (the optimizer's device for the optimizer's states
and the gradients, the accelerator for the rest). The gradients are read as DeepSpeed reads them
(`engine.optimizer.grad_partitions_flat_buffer`) and by zero3's getters. Device memory is checked
where there is a device: a CPU engine's states already live in host memory, so an offload to the host moves
nothing there (zero3.offload.manager logs it). DeepSpeed's `validate_device` tells the offload's check from
the reload's by the device ("cpu": the scratch bucket must be gone), which on a CPU accelerator is both; the
port says which check it is.

The cases share one engine per optimizer placement (each case is two steps, where DeepSpeed's runs ten):
what a case checks does not depend on the steps before it, and the grid at 2 ranks runs in one launch.
"""

from __future__ import annotations

import itertools
import traceback
from typing import Any

import pytest
import torch

import zero3
from tests.devices import cpu_ranks_or_one_gpu
from tests.distributed import run_ranks
from zero3 import OffloadStateType

HIDDEN = 1024
STEPS_PER_CASE = 2
INCLUDED = [OffloadStateType.hp_params, OffloadStateType.lp_params, OffloadStateType.optim_states,
            OffloadStateType.lp_grads, OffloadStateType.contiguous_grad_buffer, None]
CASES = list(itertools.product(INCLUDED, [False, True], [False, True]))  # included, pin_memory, non_blocking
STATIC_OFFLOAD = [False, True]


class SimpleModel(torch.nn.Module):
    """DeepSpeed's tests/unit/simple_model.py `SimpleModel`, as it is there."""

    def __init__(self, hidden_dim: int, nlayers: int = 1) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden_dim, hidden_dim) for _ in range(nlayers)])
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return self.cross_entropy_loss(x, y)


def config(static_offload_optimizer: bool) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-6}},
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
    }
    if static_offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return cfg


def is_only_offload_optimizer_states(offloaded: list[OffloadStateType] | None) -> bool:
    optimizer_states = {OffloadStateType.optim_states, OffloadStateType.hp_params, OffloadStateType.lp_grads}
    return offloaded is not None and set(offloaded) <= optimizer_states


def device_problems(engine: zero3.ZeroEngine, state_device: dict[OffloadStateType, torch.device],
                    offloaded: list[OffloadStateType] | None, after_offload: bool) -> list[str]:
    """DeepSpeed's `validate_device`: each included state on exactly its device, the scratch bucket freed
    after the offload."""
    problems = []
    for state in OffloadStateType:
        if offloaded is not None and state not in offloaded:
            continue
        devices = zero3.get_state_devices(engine, state)
        if state is OffloadStateType.contiguous_grad_buffer and after_offload:
            if devices:
                problems.append(f"{state.value} must be removed after offload_states(), found on {devices}")
        elif not (len(devices) == 1 and state_device[state] in devices):
            problems.append(f"{state.value} is on {devices}, expected {state_device[state]}")
    return problems


def local_states(engine: zero3.ZeroEngine, model: torch.nn.Module) -> dict[str, list[torch.Tensor | None]]:
    def cloned(value: torch.Tensor | None) -> torch.Tensor | None:
        return value.clone() if value is not None else None

    params = list(model.parameters())
    return {
        "hp_params": [cloned(zero3.safe_get_local_fp32_param(p)) for p in params],
        "lp_params": [p.ds_tensor.clone() for p in params],
        "lp_grads": [cloned(zero3.safe_get_local_grad(p)) for p in params],
        "grad_partitions_flat_buffer": [engine.optimizer.grad_partitions_flat_buffer.clone()],
        "exp_avg": [cloned(zero3.safe_get_local_optimizer_state(p, "exp_avg")) for p in params],
        "exp_avg_sq": [cloned(zero3.safe_get_local_optimizer_state(p, "exp_avg_sq")) for p in params],
    }


def changed(before: dict[str, list[torch.Tensor | None]], after: dict[str, list[torch.Tensor | None]]) -> list[str]:
    return [
        name for name in before
        if any((a is None) != (b is None) or (a is not None and b is not None and not torch.equal(a, b))
               for a, b in zip(before[name], after[name]))
    ]


def allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def one_case(engine: zero3.ZeroEngine, model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             static_offload: bool, included: OffloadStateType | None, pin_memory: bool, non_blocking: bool) -> list[str]:
    """DeepSpeed's `run_model_zero3` for one case; the problems found (none: the case passes)."""
    offloaded = None if included is None else [included]
    host, accelerator = torch.device("cpu"), engine.device
    optimizer_device = host if static_offload else accelerator
    expect_memory_change = not (static_offload and is_only_offload_optimizer_states(offloaded))
    offload_device = dict.fromkeys(OffloadStateType, host)
    reload_device = {
        OffloadStateType.hp_params: optimizer_device, OffloadStateType.lp_params: accelerator,
        OffloadStateType.optim_states: optimizer_device, OffloadStateType.lp_grads: optimizer_device,
        OffloadStateType.contiguous_grad_buffer: accelerator,
    }
    problems: list[str] = []
    for x, y in batches:
        loss = engine(x.to(accelerator), y.to(accelerator))
        engine.backward(loss)
        engine.step()
        expected = local_states(engine, model)

        before_offload = allocated(accelerator)
        engine.offload_states(include=offloaded, device="cpu", pin_memory=pin_memory, non_blocking=non_blocking)
        after_offload = allocated(accelerator)
        if expect_memory_change and before_offload is not None and after_offload is not None \
                and not after_offload < before_offload:
            problems.append(f"device memory should drop after offload: {before_offload} -> {after_offload}")
        if expect_memory_change:
            problems += [f"after offload_states: {p}" for p in device_problems(engine, offload_device, offloaded, True)]

        engine.reload_states()
        after_reload = allocated(accelerator)
        if expect_memory_change and after_offload is not None and after_reload is not None \
                and not after_reload > after_offload:
            problems.append(f"device memory should grow after reload: {after_offload} -> {after_reload}")
        problems += [f"{name} changed across offload and reload" for name in changed(expected, local_states(engine, model))]
        problems += [f"after reload_states: {p}" for p in device_problems(engine, reload_device, offloaded, False)]
    return problems


def dynamic_offload_grid(rank: int, world: int) -> dict[tuple[Any, ...], list[str]]:
    results: dict[tuple[Any, ...], list[str]] = {}
    for static_offload in STATIC_OFFLOAD:
        cfg = config(static_offload)
        torch.manual_seed(0)
        with zero3.Init(config=cfg):
            model = SimpleModel(HIDDEN, nlayers=4)
        param_groups = [
            {"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0},
        ]
        engine, *_ = zero3.initialize(model=model, model_parameters=param_groups, config=cfg)
        data = torch.Generator().manual_seed(rank)
        for included, pin_memory, non_blocking in CASES:
            batches = [(torch.randn(1, HIDDEN, generator=data, dtype=torch.float32).to(torch.bfloat16),
                        torch.randint(0, HIDDEN, (1,), generator=data)) for _ in range(STEPS_PER_CASE)]
            try:
                found = one_case(engine, model, batches, static_offload, included, pin_memory, non_blocking)
            except Exception:  # noqa: BLE001 - reported as the case's failure; the grid goes on
                found = [traceback.format_exc()]
                engine.reload_states()  # whatever the failed case left offloaded (a no-op if nothing)
            results[(static_offload, included, pin_memory, non_blocking)] = found
        # Needed in ZeRO 3 (DeepSpeed's comment); here, so the next placement's engine starts clean.
        engine.destroy()
    return results


_GRIDS: dict[tuple[int, str], list[dict[tuple[Any, ...], list[str]]]] = {}


def grid(world: int, device: str) -> list[dict[tuple[Any, ...], list[str]]]:
    """The whole grid, run once per world and device (the first case asking runs it)."""
    key = (world, device)
    if key not in _GRIDS:
        _GRIDS[key] = run_ranks(world, dynamic_offload_grid)
    return _GRIDS[key]


@cpu_ranks_or_one_gpu(2)
@pytest.mark.parametrize("static_offload_optimizer", STATIC_OFFLOAD)
@pytest.mark.parametrize("non_blocking", [False, True])
@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("included_state", INCLUDED, ids=lambda s: s.value if s is not None else "all")
def test_dynamic_offload_states_zero3(world: int, device: str, included_state: OffloadStateType | None,
                                      pin_memory: bool, non_blocking: bool, static_offload_optimizer: bool) -> None:
    for rank, results in enumerate(grid(world, device)):
        problems = results[(static_offload_optimizer, included_state, pin_memory, non_blocking)]
        assert not problems, f"rank {rank}: " + "\n".join(problems)
