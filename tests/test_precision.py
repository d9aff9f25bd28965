"""Gradient precision: accumulation dtype (data_types.grad_accum_dtype) and pre-division across ranks."""

from __future__ import annotations

import torch
from torch import nn

import zero3
from tests.distributed import run_ranks
from zero3.partition.mesh import ShardMesh

MICRO_STEPS = 8


class Scaled(nn.Module):
    """d(loss)/d(weight) = x: with bf16-exact inputs, each micro-step's gradient is exact in bf16."""

    def __init__(self, n: int = 64) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def micro_step_inputs(world: int, n: int = 64) -> list[list[torch.Tensor]]:
    """[micro-step][rank]: integers in [64, 127] times 2^e, e varying by micro-step.

    Each rank's gradient and their sum across ranks (at most 254 * 2^e) are
    exact in bf16; only their sum over micro-steps, whose exponents differ,
    needs more than bf16's 8 significant bits.
    """
    g = torch.Generator().manual_seed(3)
    steps = []
    for step in range(MICRO_STEPS):
        scale = 2.0 ** (step % 4 - 2)
        steps.append([torch.randint(64, 128, (n,), generator=g).float() * scale for _ in range(world)])
    return steps


def accumulated_grad(rank: int, world: int, accum: str | None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": MICRO_STEPS,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    model = Scaled()
    engine, *_ = zero3.initialize(model=model, config=cfg)
    for inputs in micro_step_inputs(world):  # no optimizer step: the gradients stay accumulated
        engine.backward(engine(inputs[rank]))
    grad = zero3.safe_get_local_grad(model.weight).double().clone()
    dtype = engine.optimizer.lp_grads.dtype
    engine.destroy()
    return {"grad": grad, "dtype": dtype}


def test_fp32_accumulation_of_bf16_micro_steps_is_closer_to_the_fp32_reference() -> None:
    world = 2
    # The fp32 reference: the mean over ranks of the sum over micro-steps of grad / gas.
    reference = sum(sum(step) for step in micro_step_inputs(world)).double() / (MICRO_STEPS * world)
    low = run_ranks(world, accumulated_grad, None)
    high = run_ranks(world, accumulated_grad, "fp32")
    for rank in range(world):
        start, end = ShardMesh.geometry(world, rank).shard_range(reference.numel())
        expected = reference[start:end]
        assert low[rank]["dtype"] == torch.bfloat16 and high[rank]["dtype"] == torch.float32
        err_low = (low[rank]["grad"][: end - start] - expected).norm().item()
        err_high = (high[rank]["grad"][: end - start] - expected).norm().item()
        assert err_high < err_low, (err_high, err_low)
        assert err_high <= 1e-6 * expected.norm().item()  # fp32 holds these sums exactly
        assert err_low > 1e-3 * expected.norm().item()  # bf16 rounds them


class Big(nn.Module):
    """d(loss)/d(weight) = x: 40000 per rank, finite in fp16, but 80000 summed over two ranks is not."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * x).sum()


def predivided(rank: int, world: int, factor: float | None, prescale: bool) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "fp16": {"enabled": True, "loss_scale": 1.0},  # a fixed scale: the overflow is not rescued
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if factor is not None:
        cfg["gradient_predivide_factor"] = factor
    if prescale:
        cfg["prescale_gradients"] = True
    model = Big()
    engine, *_ = zero3.initialize(model=model, config=cfg)
    engine.backward(engine(torch.full((4,), 40000.0)))
    grad = zero3.safe_get_local_grad(model.weight).float().clone()
    engine.destroy()
    return {"grad": grad}


def test_predivision_keeps_an_fp16_sum_across_ranks_from_overflowing() -> None:
    for result in run_ranks(2, predivided, None, False):
        assert torch.isinf(result["grad"]).all()  # summed first: 80000 overflows fp16
    for factor, prescale in ((2.0, False), (None, True)):
        for result in run_ranks(2, predivided, factor, prescale):
            assert torch.equal(result["grad"], torch.full((2,), 40000.0))  # the mean, exactly
