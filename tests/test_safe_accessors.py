"""DeepSpeed's `safe_*` family on zero3, at 2 ranks against plain PyTorch: the full
getters gather what a single process holds, the setters write through every copy so that the next
forward and the next step see the value, frozen parameters answer None, parked states still read."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import zero3
from tests import models
from tests.devices import cpu_ranks_or_one_gpu
from tests.distributed import run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    # Biases (at most 64 elements) stay gathered: the setters must reach that copy too.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64},
}


def build() -> tuple[zero3.ZeroEngine, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    plain = models.MLP()
    model = models.MLP()
    model.load_state_dict(plain.state_dict())
    model.fc1.weight.requires_grad_(False)  # frozen: no master, no gradient, no optimizer state
    plain.fc1.weight.requires_grad_(False)
    engine = zero3.initialize(model=model, config=CONFIG)[0]
    return engine, model, plain


def accessors(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine, model, plain = build()
    # Plain torch runs beside the engine, on its device: the step's comparison stays bit for bit (one
    # elementwise kernel on both sides), and every value a setter gets is where the engine keeps its own.
    device = engine.device
    plain.to(device)
    x, y = (t.to(device) for t in models.batches("x8", 1, 2 * world)[0])
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    plain(x, y).backward()  # the whole batch: its mean loss's gradient is the ranks' average

    names = [name for name, _ in model.named_parameters()]
    grads = {name: zero3.safe_get_full_grad(p) for name, p in model.named_parameters()}
    out["grad_close"] = {name: torch.allclose(grads[name], p.grad, atol=1e-6)
                         for name, p in plain.named_parameters() if p.requires_grad}
    out["frozen"] = (grads["fc1.weight"], zero3.safe_get_full_fp32_param(model.fc1.weight),
                     zero3.safe_get_full_optimizer_state(model.fc1.weight, "exp_avg"),
                     zero3.safe_get_local_grad(model.fc1.weight))

    # The step uses a gradient set in full: compare with torch's fused AdamW given the same gradient.
    # A released parameter holds no elements: its whole shape is ds_shape (DeepSpeed's attribute).
    new_grad = torch.linspace(-1, 1, model.fc2.weight.ds_numel, device=device).view(model.fc2.weight.ds_shape)
    zero3.safe_set_full_grad(model.fc2.weight, new_grad)
    zero3.safe_update_full_grad_vectorized([model.fc3.weight, model.fc1.weight], lambda g, p: g * 0.5)
    out["halved"] = torch.allclose(zero3.safe_get_full_grad(model.fc3.weight), 0.5 * grads["fc3.weight"])
    plain.fc2.weight.grad = new_grad.clone()
    plain.fc3.weight.grad = 0.5 * grads["fc3.weight"].clone()
    for name, p in plain.named_parameters():
        if p.requires_grad and name not in ("fc2.weight", "fc3.weight"):
            p.grad = grads[name].clone()  # the engine's own reduced gradients, to compare the step alone
    reference = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0,
                                  fused=True)
    reference.step()
    engine.step()
    out["step_equal"] = {name: torch.equal(zero3.safe_get_full_fp32_param(p), q.detach())
                         for (name, p), q in zip(model.named_parameters(), plain.parameters()) if p.requires_grad}

    # Optimizer state: set in full and locally, read back; the next step reads it.
    exp_avg = torch.full(model.fc2.weight.ds_shape, 0.25, device=device)
    zero3.safe_set_full_optimizer_state(model.fc2.weight, exp_avg, "exp_avg")
    out["exp_avg"] = torch.equal(zero3.safe_get_full_optimizer_state(model.fc2.weight, "exp_avg"), exp_avg)
    local = torch.full((model.fc3.weight.ds_tensor.numel(),), float(rank + 1), device=device)
    zero3.safe_set_local_optimizer_state(model.fc3.weight, local, "exp_avg_sq")
    out["exp_avg_sq_local"] = torch.equal(zero3.safe_get_local_optimizer_state(model.fc3.weight, "exp_avg_sq"), local)

    # Parameters: a full value (a sharded weight, and a persistent bias gathered now), and each rank's shard
    # of a persistent bias; the next forward computes with them.
    weight = torch.randn(model.fc2.weight.ds_shape, generator=torch.Generator().manual_seed(3)).to(device)
    zero3.safe_set_full_fp32_param(model.fc2.weight, weight)
    zero3.safe_set_full_fp32_param(model.fc2.bias, torch.full(model.fc2.bias.ds_shape, 0.5, device=device))
    start, end = model.fc3.bias.ds_tensor.numel() * rank, model.fc3.bias.ds_tensor.numel() * (rank + 1)
    bias = torch.arange(8, dtype=torch.float32, device=device) / 8
    shard = torch.zeros(model.fc3.bias.ds_tensor.numel(), device=device)
    shard[: max(0, min(end, 8) - start)] = bias[start:end]
    zero3.safe_set_local_fp32_param(model.fc3.bias, shard)
    with torch.no_grad():
        plain.load_state_dict({name: zero3.safe_get_full_fp32_param(p) if p.requires_grad else p.detach()
                               for name, p in model.named_parameters()} | {"fc1.weight": plain.fc1.weight.detach()})
        out["values_set"] = (torch.equal(plain.fc2.weight, weight), torch.equal(plain.fc3.bias, bias),
                             bool((plain.fc2.bias == 0.5).all()))
        inputs = x.chunk(world)[rank]
        out["forward_sees_them"] = torch.allclose(engine(inputs, y.chunk(world)[rank]),
                                                  F.mse_loss(plain.fc3(torch.relu(plain.fc2(torch.relu(
                                                      plain.fc1(inputs))))), y.chunk(world)[rank]), atol=1e-6)
    out["names"] = names

    # A state parked by offload_states still reads; a setter on it is refused.
    engine.offload_states(device="nvme", nvme_path=root)
    out["parked_read"] = torch.equal(zero3.safe_get_full_fp32_param(model.fc2.weight), weight)
    try:
        zero3.safe_set_full_fp32_param(model.fc2.weight, weight)
        out["parked_write"] = None
    except zero3.StateOffloadedError as error:
        out["parked_write"] = str(error)
    engine.reload_states()
    out["shape_error"] = ""
    try:
        zero3.safe_set_full_fp32_param(model.fc2.weight, torch.zeros(3, device=device))
    except ValueError as error:
        out["shape_error"] = str(error)
    engine.destroy()

    # Before a parameter's first step there is no optimizer state to set (torch creates it at that step).
    engine, model, _ = build()
    try:
        zero3.safe_set_full_optimizer_state(model.fc2.weight, torch.zeros(model.fc2.weight.ds_shape, device=device),
                                            "exp_avg")
        out["unstepped"] = None
    except ValueError as error:
        out["unstepped"] = str(error)
    engine.destroy()
    return out


# At two ranks on the CPU, and at one on CUDA (two nccl ranks cannot share a GPU): there each rank's shard
# is the whole parameter, but every getter and setter still goes through the device's copies.
@pytest.mark.timeout(300)
@cpu_ranks_or_one_gpu(2)
def test_the_safe_family_reads_and_writes_every_copy_at_two_ranks(tmp_path: Any, world: int, device: str) -> None:
    for out in run_ranks(world, accessors, str(tmp_path)):
        assert all(out["grad_close"].values()), out["grad_close"]
        assert out["frozen"] == (None, None, None, None)
        assert out["halved"]
        assert all(out["step_equal"].values()), out["step_equal"]  # bit-identical: an elementwise kernel
        assert out["exp_avg"] and out["exp_avg_sq_local"]
        assert out["values_set"] == (True, True, True) and out["forward_sees_them"]
        assert out["parked_read"]
        assert out["parked_write"] is not None and "reload_states()" in out["parked_write"]
        assert "fc2.weight has shape (64, 64), the value (3,)" in out["shape_error"], out["shape_error"]
        assert out["unstepped"] is not None and "before its first step" in out["unstepped"]


def set_on_one_rank(rank: int, world: int, how: str) -> dict[str, Any]:
    """Rank 1 alone gives one persistent parameter (fc3.bias: kept gathered on every rank) and one sharded
    weight new values for its shard: with `safe_set_local_fp32_param` on that rank only ("local"), or with
    the same whole values (rank 1's new shard beside the others' old ones) through `safe_set_full_fp32_param`
    on every rank ("full"). Then training goes on."""
    torch.manual_seed(0)
    model = models.MLP()
    engine = zero3.initialize(model=model, config=CONFIG)[0]
    losses = []

    def train(steps: int, seed: int) -> None:
        for x, y in models.batches("x8", steps, 2 * world, seed=seed):
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())

    train(1, seed=0)
    for param in (model.fc3.bias, model.fc2.weight):
        whole = zero3.safe_get_full_fp32_param(param).reshape(-1)  # on every rank, in both runs
        shard_numel = param.ds_tensor.numel()
        start, end = shard_numel, min(2 * shard_numel, whole.numel())  # rank 1's elements
        if how == "full":
            whole[start:end] += 1.0
            zero3.safe_set_full_fp32_param(param, whole.view(param.ds_shape))
        elif rank == 1:
            shard = zero3.safe_get_local_fp32_param(param).clone()
            shard[: end - start] += 1.0
            zero3.safe_set_local_fp32_param(param, shard)
    train(2, seed=1)
    out = {"losses": losses, "masters": [zero3.safe_get_full_fp32_param(p) for p in model.parameters()]}
    engine.destroy()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_a_local_setter_on_one_rank_starts_no_collective_of_its_own(world: int) -> None:
    local = run_ranks(world, set_on_one_rank, "local")
    full = run_ranks(world, set_on_one_rank, "full")
    for rank in range(world):
        assert local[rank]["losses"] == full[rank]["losses"], (rank, local[rank]["losses"], full[rank]["losses"])
        assert all(torch.equal(a, b) for a, b in zip(local[rank]["masters"], full[rank]["masters"])), rank
