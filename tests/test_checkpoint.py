"""Sharded checkpoints: exact resume, resharding at load, crash-safe tags, bad input.

Each scenario runs in spawned ranks; a resume always starts fresh processes
whose model was built from another seed, so only the checkpoint can make the
losses match.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks

STEPS = 6
SAVED_AT = 3
GLOBAL_BATCH = 12  # divisible by 1, 2 and 3: every world size sees the same global batches


def config(variant: str, root: str) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64, "sub_group_size": 1500},
    }
    if variant == "bf16":
        cfg["bf16"] = {"enabled": True}
    if variant == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if variant == "optimizer_cpu":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if variant == "optimizer_nvme":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": root}
    return cfg


def build(variant: str, root: str, seed: int = 0) -> zero3.ZeroEngine:
    torch.manual_seed(seed)
    engine, *_ = zero3.initialize(model=models.TiedTransformer(), config=config(variant, root))
    return engine


def train(engine: zero3.ZeroEngine, rank: int, world: int, batches: list) -> list[float]:
    losses = []
    for x, y in batches:
        loss = models.loss_of(engine(x.chunk(world)[rank], y.chunk(world)[rank]), engine.module)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def data() -> list:
    return models.batches("tokens", STEPS, GLOBAL_BATCH)


VARIANTS = ["fp32", "bf16", "fp16", "optimizer_cpu", "optimizer_nvme"]


# ---- 3: exact resume ------------------------------------------------------------------------------------
def train_and_save(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        engine = build(variant, root)
        losses = train(engine, rank, world, data()[:SAVED_AT])
        engine.save_checkpoint(os.path.join(root, variant), client_state={"variant": variant, "rank_count": world})
        losses += train(engine, rank, world, data()[SAVED_AT:])
        out[variant] = {"losses": losses, "scale": engine.loss_scale, "lr": engine.get_lr(),
                        "steps": engine.global_steps}
        engine.destroy()
    return out


def resume(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        engine = build(variant, root, seed=99)  # other initial values: only the load can restore them
        path, client = engine.load_checkpoint(os.path.join(root, variant))
        loaded = {"steps": engine.global_steps, "scale": engine.loss_scale, "lr": engine.get_lr()}
        losses = train(engine, rank, world, data()[SAVED_AT:])
        out[variant] = {"losses": losses, "path": path, "client": client, "loaded": loaded,
                        "scale": engine.loss_scale, "lr": engine.get_lr(), "steps": engine.global_steps}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    root = tmp_path_factory.mktemp("ckpt")
    return str(root), run_ranks(2, train_and_save, str(root))


@pytest.fixture(scope="module")
def resumed(saved: tuple[str, list[dict]]) -> list[dict]:
    return run_ranks(2, resume, saved[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_in_fresh_processes_gives_the_same_losses_bit_for_bit(
    saved: tuple[str, list[dict]], resumed: list[dict], variant: str
) -> None:
    root, before = saved
    for rank, (full, again) in enumerate(zip(before, resumed)):
        assert again[variant]["losses"] == full[variant]["losses"][SAVED_AT:], (variant, rank)
        assert again[variant]["scale"] == full[variant]["scale"] and again[variant]["lr"] == full[variant]["lr"]
        assert again[variant]["loaded"]["steps"] == SAVED_AT and again[variant]["steps"] == STEPS
        assert again[variant]["client"] == {"variant": variant, "rank_count": 2}
        assert again[variant]["path"] == os.path.join(root, variant, f"global_step{SAVED_AT}")
    if variant == "fp16":
        assert before[0]["fp16"]["scale"] != 2.0**8  # the dynamic scale moved, and the load restored it


def test_each_parameter_is_saved_once_under_its_name_with_its_global_shape(saved: tuple[str, list[dict]]) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    root, _ = saved
    metadata = FileSystemReader(os.path.join(root, "fp32", f"global_step{SAVED_AT}")).read_metadata()
    shapes = {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}
    model = models.TiedTransformer()
    for name, param in model.named_parameters():  # the tied head weight is the embedding's, saved once
        assert shapes[f"model.{name}"] == tuple(param.shape)
        assert shapes[f"optim.{name}.exp_avg"] == tuple(param.shape)
    assert not any(key.startswith("model.head.") for key in shapes)
    # Every chunk lies inside its tensor: the flat buffers' padding never reaches the file.
    for key, meta in metadata.state_dict_metadata.items():
        for chunk in getattr(meta, "chunks", []):
            assert all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, meta.size)), key


# ---- 4: resharding at load --------------------------------------------------------------------------------
def reshard(rank: int, world: int, root: str) -> list[float]:
    engine = build("fp32", root, seed=99)
    engine.load_checkpoint(os.path.join(root, "fp32"))
    losses = train(engine, rank, world, data()[SAVED_AT:])
    engine.destroy()
    return losses


def save_at_three(rank: int, world: int, root: str) -> list[float]:
    engine = build("fp32", root)
    losses = train(engine, rank, world, data()[:SAVED_AT])
    engine.save_checkpoint(os.path.join(root, "three"))
    losses += train(engine, rank, world, data()[SAVED_AT:])
    engine.destroy()
    return losses


def mean_per_step(per_rank: list[list[float]]) -> torch.Tensor:
    return torch.tensor(per_rank, dtype=torch.float64).mean(dim=0)  # equal chunks: the global batch's loss


@pytest.mark.parametrize("world", [1, 3])
def test_a_world_2_checkpoint_loads_at_another_world_size(saved: tuple[str, list[dict]], world: int) -> None:
    root, before = saved
    expected = mean_per_step([r["fp32"]["losses"][SAVED_AT:] for r in before])
    got = mean_per_step(run_ranks(world, reshard, root))
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected)


def test_a_world_3_checkpoint_loads_at_world_2(tmp_path: Path) -> None:
    root = str(tmp_path)
    full = mean_per_step(run_ranks(3, save_at_three, root))
    os.rename(os.path.join(root, "three"), os.path.join(root, "fp32"))
    got = mean_per_step(run_ranks(2, reshard, root))
    assert torch.allclose(got, full[SAVED_AT:], rtol=1e-5, atol=1e-6), (got, full)
