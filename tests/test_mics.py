"""MiCS / HSDP: every state sharded within groups of S ranks, replicated across the groups
(`zero_optimization.mics_shard_size`, or `zero3.initialize(mesh=...)` with a 2-D (replicate, shard)
DeviceMesh, FSDP2's way), at 4 ranks as 2 simulated nodes of 2.

Judged against plain ZeRO-3 over all 4 ranks on the same batches (within fp32 rounding: the sums run in
another order), against the 16P/S bytes computed from the model, and across a checkpoint written under
MiCS and read back at 2 ranks without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.config import load_config
from zero3.estimate import EstimateSettings, estimate
from zero3.topology import TopologyError

MICRO, STEPS = 4, 4


def config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _train(rank: int, world: int, zero: dict, mesh_shape: tuple[int, int] | None, save_dir: str | None,
           park_at: int | None = None, under_init: bool = False) -> dict:
    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    zero3.init_distributed()
    torch.manual_seed(0)
    numels = [p.numel() for p in models.MLP().parameters()]
    torch.manual_seed(0)
    if under_init:  # partitioned over all 4 ranks as it is built; initialize partitions it again in its group
        with zero3.MiCS_Init(config=config(**zero)):
            model = models.MLP()
        assert all(zero3.param_status(p) is zero3.ParamStatus.NOT_AVAILABLE for p in model.parameters())
    else:
        model = models.MLP()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")) if mesh_shape else None
    engine, *_ = zero3.initialize(model=model, config=config(**zero), mesh=mesh)
    losses, parked_exactly = [], None
    batches = models.batches("x8", STEPS + 1, MICRO * world)
    for step, (x, y) in enumerate(batches[:STEPS]):
        if step == park_at:  # every state off the device and back, between two steps
            before = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
            engine.offload_states()
            engine.reload_states()
            parked_exactly = all(torch.equal(zero3.safe_get_full_fp32_param(p), before[name])
                                 for name, p in model.named_parameters())
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    if save_dir is not None:
        engine.save_checkpoint(save_dir)
        x, y = batches[STEPS]
        engine.eval()
        with torch.no_grad():
            next_loss = engine(x.chunk(world)[rank], y.chunk(world)[rank]).detach().reshape(1).clone()
        dist.all_reduce(next_loss)
        losses.append(next_loss.item() / world)
    params = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    result = {"losses": losses, "params": params, "parked_exactly": parked_exactly, "bytes": engine.model_state_bytes(),
              "shard": (engine.mesh.shard_size, engine.mesh.replicate_size),
              "numels": numels}
    engine.destroy()
    return result


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return run_ranks(4, _train, {}, None, None)


@pytest.mark.parametrize(("zero", "mesh_shape", "under_init"), [
    ({"mics_shard_size": 2}, None, False), ({}, (2, 2), False), ({"mics_shard_size": 2}, None, True),
], ids=["mics_shard_size", "mesh", "MiCS_Init"])
def test_shard_groups_of_two_train_like_plain_zero3_with_half_the_groups_bytes_doubled(
    plain: list[dict], zero: dict, mesh_shape: tuple[int, int] | None, under_init: bool,
) -> None:
    results = run_ranks(4, _train, zero, mesh_shape, None, None, under_init)
    for ours, reference in zip(results, plain):
        assert ours["shard"] == (2, 2) and reference["shard"] == (4, 1)
        assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for name, value in reference["params"].items():
            torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-7)
        # 16P/S: each rank holds a 1/S shard of every state (fp32 here: 4 bytes each of parameter,
        # gradient, and Adam's two moments), S = 2 beside plain ZeRO-3's S = 4.
        for size, found in ((2, ours["bytes"]), (4, reference["bytes"])):
            shard_elements = sum(-(-numel // size) for numel in ours["numels"])
            assert found["lp_params"] == 4 * shard_elements
            assert found["optim_states"] == 2 * 4 * shard_elements
        # zero3 estimate, told the group size, predicts each rank's bytes exactly
        with torch.device("meta"):
            meta = models.MLP()
        settings = EstimateSettings.from_config(load_config(config(mics_shard_size=2)), accelerator="cpu")
        assert ours["bytes"] == estimate(model=meta, ranks_per_node=2, nodes=2, settings=settings).model_state_bytes()
    replicas = [results[0]["params"], results[2]["params"]]  # shard rank 0 of each replica
    for name in replicas[0]:
        assert torch.equal(replicas[0][name], replicas[1][name])  # the replicas stayed identical


TIERS = {
    "offload_optimizer cpu": lambda tmp: {"offload_optimizer": {"device": "cpu"}},
    "optimizer and params on nvme": lambda tmp: {
        "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp / "nvme")},
        "offload_param": {"device": "nvme", "nvme_path": str(tmp / "nvme")},
    },
}


@pytest.mark.parametrize("tier", list(TIERS))
def test_mics_with_each_tier_trains_like_plain_zero3_and_parks_every_state_exactly(
    plain: list[dict], tier: str, tmp_path: Path,
) -> None:
    """DeepSpeed refuses MiCS with CPU offload ("Local sharding has no support for CPU offloading"). Against
    plain ZeRO-3 without a tier (a tier moves the states, not the arithmetic); every state parked and
    restored between two steps."""
    (tmp_path / "nvme").mkdir()
    zero = TIERS[tier](tmp_path)
    for ours, reference in zip(run_ranks(4, _train, {**zero, "mics_shard_size": 2}, None, None, 2), plain):
        assert ours["shard"] == (2, 2)
        assert ours["parked_exactly"] is True
        assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for name, value in reference["params"].items():
            torch.testing.assert_close(ours["params"][name], value, rtol=1e-5, atol=1e-7)


def _resume_without_mics(rank: int, world: int, save_dir: str) -> dict:
    zero3.init_distributed()
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = models.MLP()
    engine, *_ = zero3.initialize(model=model, config=config())
    engine.load_checkpoint(save_dir)
    x, y = models.batches("x8", STEPS + 1, MICRO * 4)[STEPS]
    engine.eval()
    with torch.no_grad():
        loss = engine(x.chunk(world)[rank], y.chunk(world)[rank]).detach().reshape(1).clone()
    dist.all_reduce(loss)
    params = {name: zero3.safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()}
    engine.destroy()
    return {"loss": loss.item() / world, "params": params}


def test_a_mics_checkpoint_loads_at_two_ranks_without_mics(tmp_path: Path) -> None:
    saved = run_ranks(4, _train, {"mics_shard_size": 2}, None, str(tmp_path))
    loaded = run_ranks(2, _resume_without_mics, str(tmp_path))
    for result in loaded:
        for name, value in saved[0]["params"].items():
            assert torch.equal(result["params"][name], value), name
    # the same 16 rows, evaluated as 2 ranks of 8 instead of 4 of 4: the mean loss is the same
    assert loaded[0]["loss"] == pytest.approx(saved[0]["losses"][-1], rel=1e-6)


def _bad_size(rank: int, world: int, size: int) -> str:
    zero3.init_distributed()
    try:
        zero3.initialize(model=models.MLP(), config=config(mics_shard_size=size))
    except TopologyError as error:
        return str(error)
    return "no error"


def test_a_shard_size_that_does_not_divide_the_world_is_refused_on_every_rank() -> None:
    results = run_ranks(2, _bad_size, 3)
    assert results[0] == results[1]
    assert "zero_optimization.mics_shard_size=3 does not divide the world size 2" in results[0]


def test_a_shard_size_of_zero_is_a_config_error() -> None:
    with pytest.raises(zero3.ConfigError, match="mics_shard_size"):
        zero3.load_config(config(mics_shard_size=0))


def test_the_estimate_refuses_a_shard_size_that_does_not_divide_the_world() -> None:
    with torch.device("meta"):
        meta = models.MLP()
    with pytest.raises(ValueError, match="mics_shard_size=3 does not divide the world size 4"):
        estimate(model=meta, ranks_per_node=2, nodes=2, settings=EstimateSettings(mics_shard_size=3))


def test_ranks_on_different_routes_under_mics_train_like_one_process() -> None:
    """Each rank routes its batch through its own experts (tests/test_divergent.py's model), in 2 MiCS groups."""
    from tests.test_divergent import reference, train_routed

    ref_losses, ref_params = reference(4)
    for result in run_ranks(4, train_routed, {"mics_shard_size": 2}):
        for ours, ref in zip(result["losses"], ref_losses):
            assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)), (result["losses"], ref_losses)
        for name, ref in ref_params.items():
            assert torch.allclose(result["params"][name], ref, rtol=1e-4, atol=1e-6), name
