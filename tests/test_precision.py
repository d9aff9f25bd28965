"""Gradient precision: accumulation dtype (data_types.grad_accum_dtype) and pre-division across ranks."""

from __future__ import annotations

import torch
from torch import nn

import zero3
from tests.distributed import run_ranks
from zero3.shard_mesh import ShardMesh

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
    dtype = engine.optimizer.grads.dtype
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


# ---- an fp32 engine keeps one copy of its parameters ----------------------------------------------------
def one_copy(rank: int, world: int, root: str, offload: bool) -> dict:
    """An fp32 engine trained 4 steps, small sub-groups (pieces of shards); with `offload`, the 16-bit
    shards (which are the masters here) parked on disk after the first step and the whole state after
    the second, each time brought back."""
    from tests import models
    from zero3.partition.sharded_param import sharded
    from zero3.step.masters import master_slots

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64, "sub_group_size": 700},
    }
    torch.manual_seed(0)
    model = models.TiedTransformer()
    reference = models.TiedTransformer()
    reference.load_state_dict(model.state_dict())
    engine, *_ = zero3.initialize(model=model, config=cfg)
    states = engine.model_state_bytes()
    shared = [master_slots(sharded(p)).hp.buffer is sharded(p).lp_slot.buffer for p in model.parameters()]
    data = models.batches("tokens", 4, 2 * world)
    losses = []
    for index, batch in enumerate(data):
        losses += models.mean_losses(engine, rank, world, [batch])
        if offload and index == 0:
            engine.offload_states(include=["lp_params"], device="nvme", nvme_path=root)
            engine.reload_states()
        if offload and index == 1:
            engine.offload_states(device="nvme", nvme_path=root)
            engine.reload_states()
    masters_equal_shards = all(
        torch.equal(zero3.safe_get_local_fp32_param(p), zero3.safe_get_local_lp_param(p)) for p in model.parameters()
    )
    full = [models.full_value(p) for p in model.parameters()]
    ref_losses, reference = models.reference_losses(reference, data, 1e-2, 0.01, 1.0)
    engine.destroy()
    return {"states": states, "shared": shared, "losses": losses, "masters_equal_shards": masters_equal_shards,
            "full": full, "ref_losses": ref_losses, "ref_full": [p.detach().clone() for p in reference.parameters()]}


def optimizer_bytes(rank: int, world: int, precision: str, offload_optimizer: str) -> dict:
    from tests import models

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": offload_optimizer}},
    }
    torch.manual_seed(0)
    engine, *_ = zero3.initialize(model=models.MLP(), config=cfg)
    states = engine.model_state_bytes()
    engine.destroy()
    return states


def test_an_fp32_engine_keeps_one_copy_of_its_parameters(tmp_path) -> None:
    """The fp32 masters are the parameter shards (no hp_params bytes: 12 bytes per element, not 16), they
    train as plain torch does, and moving lp_params moves them: training goes on bit for bit."""
    world = 2
    plain = run_ranks(world, one_copy, str(tmp_path), False)
    moved = run_ranks(world, one_copy, str(tmp_path), True)
    for result, offloaded in zip(plain, moved):
        states = result["states"]
        assert states["hp_params"] == 0 and all(result["shared"]), states
        # 12 bytes an element; at 2 CPU ranks the gradient shards exist only from a backward to its step.
        assert states["lp_params"] > 0 and states["lp_grads"] == 0 and states["optim_states"] == 2 * states["lp_params"]
        assert result["masters_equal_shards"]
        assert offloaded["losses"] == result["losses"] and len(set(result["losses"])) > 1
        assert all(torch.equal(a, b) for a, b in zip(offloaded["full"], result["full"]))
        for loss, ref in zip(result["losses"], result["ref_losses"]):
            assert abs(loss - ref) <= 1e-5 * abs(ref), (result["losses"], result["ref_losses"])
        assert max((a - b).abs().max().item() for a, b in zip(result["full"], result["ref_full"])) < 1e-5


def test_masters_stay_a_copy_where_they_differ_from_the_shards() -> None:
    """A 16-bit engine, and an fp32 one whose masters live on the host (ZeRO-Offload), keep fp32 masters
    of their own, one per trained element."""
    for precision, offload in (("bf16", "none"), ("fp32", "cpu")):
        for states in run_ranks(2, optimizer_bytes, precision, offload):
            itemsize = 2 if precision == "bf16" else 4
            assert states["hp_params"] == states["lp_params"] * 4 // itemsize > 0, (precision, offload, states)


def output_dtypes(rank: int, world: int) -> dict[str, torch.dtype]:
    out = {}
    for name, section in (("bf16", {"bf16": {"enabled": True, "auto_cast": False}}),
                          ("bf16_auto", {"bf16": {"enabled": True}}), ("fp16_auto", {"fp16": {"enabled": True}})):
        cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}, **section,
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
        model = Scaled(8)
        engine, *_ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x = torch.full((8,), 1.0 + 2.0**-12)  # not representable in bf16 or fp16
        loss = engine(x)
        out[name] = loss.dtype
        out[f"{name}_exact"] = loss.item() == 8 * (1.0 + 2.0**-12)
        engine.destroy()
    return out


def test_floating_inputs_are_cast_unless_auto_cast_is_false_as_in_deepspeed() -> None:
    """By default floating inputs follow the compute dtype (FSDP2's cast_forward_inputs); `auto_cast: false`
    (`fp16.auto_cast` is DeepSpeed's key) passes them as given, as DeepSpeed does: in bf16 an fp32 input stays
    fp32, and an elementwise op with the bf16 weights computes in fp32."""
    for out in run_ranks(2, output_dtypes):
        assert out["bf16"] == torch.float32 and out["bf16_exact"]
        assert out["bf16_auto"] == torch.bfloat16 and not out["bf16_auto_exact"]
        assert out["fp16_auto"] == torch.float16 and not out["fp16_auto_exact"]
