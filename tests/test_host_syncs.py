"""A steady-state step reads no device value on the host where the config allows it.

On a GPU such a read (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`...) drains
the device's queue. Here every tensor lives in host memory, so the test
counts the reads themselves: a TorchFunctionMode sees each one and names the
zero3 function that made it. The reads of the gloo control group's host
tensors (the gather walk's markers, the gradient flags) are allowed: they
were never on a device. Everything else must be absent, except the one read
a dynamic fp16 loss scale needs (did the step overflow?). The CUDA test runs
the same step under `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import zero3
from tests import models
from tests.distributed import run_ranks

READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}
# Host tensors of the gloo control group (zero3.topology's Note "the engine's groups"): never on a device.
CONTROL_READS = {"comm.py:any_of_flags", "gather_walk.py:_drain"}
ZERO3_DIR = os.path.dirname(zero3.__file__)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values, by the zero3 function that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in READS:
            self.reads[_zero3_caller()] += 1
        return func(*args, **(kwargs or {}))


def _zero3_caller() -> str:
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(ZERO3_DIR) and not frame.f_code.co_name.startswith("<"):  # past comprehensions
            return f"{os.path.basename(path)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside zero3"


def cfg(precision: str, clipping: float) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": clipping,
        "steps_per_print": 1,  # the progress line reads the norm only when INFO logging is on (it is off)
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16-dynamic":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "fp16-static":
        config["fp16"] = {"enabled": True, "loss_scale": 256.0}
    return config


def count_step_reads(rank: int, world: int, precision: str, clipping: float) -> dict:
    torch.manual_seed(0)
    with zero3.Init(config=cfg(precision, clipping)):
        model = models.TiedTransformer(vocab=256, dim=64, heads=4, layers=2)
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg(precision, clipping))
    data = models.batches("tokens", 4, 4 * world)
    for x, y in data[:3]:  # warm: the walk has learned its order, every buffer exists
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()
    x, y = data[3]
    counter = HostReads()
    with counter:
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    result = {"reads": dict(counter.reads), "norm": engine.last_grad_norm, "skipped": engine.skipped_steps}
    engine.destroy()
    return result


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision,clipping", [("bf16", 1.0), ("fp32", 0.0), ("fp16-static", 1.0)])
def test_a_steady_step_reads_no_device_value(world: int, precision: str, clipping: float) -> None:
    for result in run_ranks(world, count_step_reads, precision, clipping):
        device_reads = {where: n for where, n in result["reads"].items() if where not in CONTROL_READS}
        assert device_reads == {}, device_reads
        assert result["norm"] is not None and result["norm"] > 0  # still there, read once asked for
        assert result["skipped"] == 0


def test_a_dynamic_loss_scale_reads_one_value_per_step() -> None:
    for result in run_ranks(2, count_step_reads, "fp16-dynamic", 1.0):
        device_reads = {where: n for where, n in result["reads"].items() if where not in CONTROL_READS}
        assert device_reads == {"optimizer.py:_unscale_and_clip": 1}, device_reads


def nonfinite_static_step(rank: int, world: int) -> dict:
    """bf16: one rank's loss is inf. The update is skipped on the device, on every rank."""
    torch.manual_seed(0)
    config = cfg("bf16", 1.0)
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config)
    data = models.batches("x8", 3, 4 * world)
    unchanged = []
    for step, (x, y) in enumerate(data):
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        if step == 1 and rank == 0:
            loss = loss * float("inf")
        before = zero3.safe_get_full_fp32_param(model.fc1.weight).clone()
        moment = zero3.safe_get_local_optimizer_state(model.fc1.weight, "exp_avg").clone()
        engine.backward(loss)
        engine.step()
        after = zero3.safe_get_full_fp32_param(model.fc1.weight)
        unchanged.append(
            torch.equal(before, after)
            and torch.equal(moment, zero3.safe_get_local_optimizer_state(model.fc1.weight, "exp_avg"))
        )
    count = engine.optimizer.scalar_state(engine.sharded_params[0])["step"].item()
    result = {"unchanged": unchanged, "skipped": engine.skipped_steps, "steps": count}
    engine.destroy()
    return result


def test_a_nonfinite_gradient_under_a_static_scale_is_skipped_on_the_device() -> None:
    for result in run_ranks(2, nonfinite_static_step):
        assert result["unchanged"] == [False, True, False]
        assert result["skipped"] == 1
        assert result["steps"] == 2  # torch's step count did not advance on the skipped step


@pytest.mark.cuda
def test_a_steady_cuda_step_never_synchronizes() -> None:
    torch.manual_seed(0)
    config = cfg("bf16", 1.0)
    device = torch.device("cuda")
    with zero3.Init(config=config, device=device):
        model = models.TiedTransformer(vocab=256, dim=64, heads=4, layers=2)
    engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=config, device=device)
    data = [(x.to(device), y.to(device)) for x, y in models.batches("tokens", 4, 4)]
    for x, y in data[:3]:
        engine.backward(engine(x, y))
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x, y = data[3]
        engine.backward(engine(x, y))
        engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.last_grad_norm > 0
    engine.destroy()
