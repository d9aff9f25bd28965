"""A forward never backpropagated frees its activations; an exception leaves nothing behind."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero3
from tests import models
from tests.distributed import run_ranks

CFG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


# ---- no activation leak ------------------------------------------------------------------------
class KeepsRefs(nn.Module):
    """tanh saves its own output for backward: the case that makes a cycle if saved as-is."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.out = nn.Linear(16, 8)
        self.activation: weakref.ref | None = None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        self.activation = weakref.ref(h)
        return F.mse_loss(self.out(h), y)


def dropped_forward(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = KeepsRefs()
    engine, *_ = zero3.initialize(model=model, config=CFG)
    x, y = models.batches("x8", 1, 4)[0]
    gc.disable()
    try:
        out = engine(x, y)  # grad enabled, never backpropagated
        activation = model.activation
        del out
        freed = activation is not None and activation() is None
        # Training goes on normally afterwards.
        engine.backward(engine(x, y))
        engine.step()
    finally:
        gc.enable()
    engine.destroy()
    return {"freed": freed}


def test_a_dropped_forward_frees_its_activations_by_reference_counting() -> None:
    for result in run_ranks(2, dropped_forward):
        assert result["freed"], "the forward's activations outlived its output (a reference cycle)"


# ---- recovery after an exception ------------------------------------------------------------------
class FailInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if FailInBackward.armed:
            raise RuntimeError("injected failure in backward")
        return grad


class Flaky(nn.Module):
    """Raises mid-forward (after fc1 ran) or mid-backward (between fc2 and fc1) when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 8)
        self.fail_forward = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.fail_forward:
            raise ValueError("injected failure in forward")
        h = FailInBackward.apply(torch.relu(self.fc2(h)))
        return F.mse_loss(self.fc3(h), y)


def train_with_failure(rank: int, world: int, fail: str | None) -> dict:
    torch.manual_seed(0)
    model = Flaky()
    engine, *_ = zero3.initialize(model=model, config=CFG)
    data = models.batches("x8", 6, 4 * world)
    losses, checks = [], []
    for step, (x, y) in enumerate(data):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if step == 3 and fail is not None:
            model.fail_forward = fail == "forward"
            FailInBackward.armed = fail == "backward"
            try:
                engine.backward(engine(xs, ys))
            except (ValueError, RuntimeError) as error:
                checks.append(str(error))
            model.fail_forward = FailInBackward.armed = False
            engine.zero_grad()
            statuses = {zero3.param_status(p) for p in model.parameters()}
            checks.append({
                "statuses": statuses, "live": engine.coordinator.live_numel(),
                "reducer_open": engine.parts.reducer.open, "in_flight": len(engine.parts.reducer._inflight),
                "grads_zero": all(not grads.read(sp).any() for grads in [engine.optimizer.grads] for sp in grads.params),
            })
        loss = engine(xs, ys)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "checks": checks}


@pytest.mark.parametrize("fail", ["forward", "backward"])
def test_after_an_exception_and_zero_grad_training_is_bit_identical(fail: str) -> None:
    clean = run_ranks(2, train_with_failure, None)
    failed = run_ranks(2, train_with_failure, fail)
    for ours, reference in zip(failed, clean):
        message, state = ours["checks"]
        assert f"injected failure in {fail}" in message
        assert state == {"statuses": {zero3.ParamStatus.NOT_AVAILABLE}, "live": 0, "reducer_open": False,
                         "in_flight": 0, "grads_zero": True}
        assert ours["losses"] == reference["losses"]
        for name, value in reference["params"].items():
            assert torch.equal(ours["params"][name], value), name
