"""Which way a load reads. At the layout a checkpoint was saved with, each rank reads its own items (no
DCP planning), bit for bit what DCP's load gives, checking every item; at another world size, or where
any rank cannot, every rank loads through DCP, which reshards.

Each scenario runs in spawned ranks. A rank counts DCP's loads by wrapping `dcp.load` where
zero3.checkpoint.state calls it, and forces the DCP path by making `SameLayoutLoad.plan` find no match.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.devices import cpu_ranks_or_one_gpu
from tests.distributed import run_ranks

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3
TAG = "t"
VARIANTS = ("fp32", "bf16", "optimizer_nvme")  # in memory, a 16-bit model with fp32 masters, a disk tier


def config(variant: str, root: str) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64},
    }
    if variant == "bf16":
        cfg["bf16"] = {"enabled": True}
    if variant == "optimizer_nvme":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": root}
    return cfg


def build(variant: str, root: str, seed: int) -> zero3.ZeroEngine:
    torch.manual_seed(seed)
    engine, *_ = zero3.initialize(model=models.TiedTransformer(), config=config(variant, root))
    return engine


def data(steps: int) -> list:
    return models.batches("tokens", steps, GLOBAL_BATCH)


def snapshot(engine: zero3.ZeroEngine) -> dict[str, Any]:
    """This rank's whole state: every parameter's 16-bit and fp32 shards, moments and step count."""
    out: dict[str, Any] = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}/lp"] = zero3.safe_get_local_lp_param(p).detach().cpu().clone()
        out[f"{name}/hp"] = zero3.safe_get_local_fp32_param(p).detach().cpu().clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{moment}"] = zero3.safe_get_local_optimizer_state(p, moment).detach().cpu().clone()
    assert engine.optimizer is not None
    for sp in engine.parts.sharded_params:
        out[f"{sp.name}/scalars"] = engine.optimizer.scalar_state(sp)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
        return torch.equal(x, y)

    return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)


def count_dcp_loads() -> list[int]:
    """Every later DCP load in this rank appends to the returned list."""
    from zero3.checkpoint import state

    calls: list[int] = []
    original = state.dcp.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    state.dcp.load = counted  # type: ignore[assignment]
    return calls


def force_dcp() -> None:
    from zero3.checkpoint.same_layout import SameLayoutLoad

    SameLayoutLoad.plan = classmethod(lambda cls, wanted, metadata: None)  # type: ignore[method-assign,assignment]


def save(rank: int, world: int, root: str, variants: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    out = {}
    for variant in variants:
        engine = build(variant, root, seed=0)
        models.train_steps(engine, rank, world, data(2))
        engine.save_checkpoint(os.path.join(root, variant), tag=TAG)
        out[variant] = {"state": snapshot(engine), "full": engine.consolidated_16bit_state_dict()}
        engine.destroy()
    return out


# ---- the same layout: no DCP, bit for bit DCP's result ----------------------------------------------------
def load_both_ways(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    # The losses of the two ways are compared bit for bit: on CUDA, kernels that add in a fixed order.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = {}
    calls = count_dcp_loads()
    for variant in VARIANTS:
        engine = build(variant, root, seed=99)  # other values: only the load restores them
        before = len(calls)
        engine.load_checkpoint(os.path.join(root, variant), tag=TAG)
        direct = {"state": snapshot(engine), "dcp_loads": len(calls) - before, "gc_on": gc.isenabled(),
                  "losses": models.train_steps(engine, rank, world, data(4)[2:])}
        engine.destroy()
        out[variant] = {"direct": direct}
    force_dcp()
    for variant in VARIANTS:
        engine = build(variant, root, seed=99)
        before = len(calls)
        engine.load_checkpoint(os.path.join(root, variant), tag=TAG)
        out[variant]["dcp"] = {"state": snapshot(engine), "dcp_loads": len(calls) - before,
                               "losses": models.train_steps(engine, rank, world, data(4)[2:])}
        engine.destroy()
    return out


@cpu_ranks_or_one_gpu(2)
def test_a_load_at_the_saved_layout_reads_without_dcp_what_dcp_reads_bit_for_bit(
    tmp_path: Path, world: int, device: str
) -> None:
    saved = run_ranks(world, save, str(tmp_path), VARIANTS)
    loaded = run_ranks(world, load_both_ways, str(tmp_path))
    for rank, (before, after) in enumerate(zip(saved, loaded)):
        for variant in VARIANTS:
            direct, through_dcp = after[variant]["direct"], after[variant]["dcp"]
            assert direct["dcp_loads"] == 0 and through_dcp["dcp_loads"] == 1, (variant, rank)
            assert same(direct["state"], before[variant]["state"]), (variant, rank)
            assert same(direct["state"], through_dcp["state"]), (variant, rank)
            assert direct["losses"] == through_dcp["losses"], (variant, rank)
            assert direct["gc_on"], "the load leaves Python's garbage collector as it found it"


# ---- damage is still found, on every rank, with nothing changed -------------------------------------------
def largest_item(tag_dir: Path, file_name: str) -> tuple[str, int, int]:
    """(its key, offset, length) of the largest item DCP wrote into `file_name`."""
    with open(tag_dir / ".metadata", "rb") as source:
        metadata = pickle.load(source)  # the test's own file: read plainly
    index, info = max(((index, info) for index, info in metadata.storage_data.items()
                       if info.relative_path == file_name), key=lambda found: found[1].length)
    return index.fqn, info.offset, info.length


def load_damaged(rank: int, world: int, root: str) -> dict[str, Any]:
    calls = count_dcp_loads()
    engine = build("fp32", root, seed=5)
    models.train_steps(engine, rank, world, data(1))
    before, steps = snapshot(engine), engine.global_steps
    try:
        engine.load_checkpoint(os.path.join(root, "damaged"), tag=TAG)
        error = "no error"
    except zero3.CheckpointError as raised:
        error = str(raised)
    unchanged = engine.global_steps == steps and same(before, snapshot(engine))
    engine.destroy()
    return {"error": error, "unchanged": unchanged, "dcp_loads": len(calls)}


def test_a_damaged_item_read_by_one_rank_is_refused_on_every_rank_and_nothing_changes(tmp_path: Path) -> None:
    run_ranks(2, save, str(tmp_path), ("fp32",))
    damaged = tmp_path / "damaged" / TAG
    shutil.copytree(tmp_path / "fp32" / TAG, damaged)
    key, offset, length = largest_item(damaged, "__1_0.distcp")  # read by rank 1 alone
    with open(damaged / "__1_0.distcp", "r+b") as file:
        file.seek(offset + length // 2)  # inside the tensor's bytes
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0x10]))
    results = run_ranks(2, load_damaged, str(tmp_path))
    for rank, result in enumerate(results):
        assert result["dcp_loads"] == 0, rank  # found at the saved layout, without DCP
        assert result["unchanged"], rank
        assert f"__1_0.distcp': item {key} at " in result["error"], result["error"]
        assert "(corrupted)" in result["error"], result["error"]
    assert results[0]["error"] == results[1]["error"]  # rank 0 raises rank 1's finding, word for word


# ---- another world size, or a rank that cannot: DCP, on every rank ----------------------------------------
def reload_full(rank: int, world: int, root: str, disagree: bool) -> dict[str, Any]:
    calls = count_dcp_loads()
    if disagree and rank == 1:
        force_dcp()  # this rank alone finds no match: the ranks must still take one way together
    engine = build("fp32", root, seed=99)
    engine.load_checkpoint(os.path.join(root, "fp32"), tag=TAG)
    out = {"full": engine.consolidated_16bit_state_dict(), "dcp_loads": len(calls)}
    engine.destroy()
    return out


def check_reloaded(saved: list[dict], results: list[dict], expect_dcp: Callable[[int], bool]) -> None:
    expected = saved[0]["fp32"]["full"]
    assert results[0]["full"].keys() == expected.keys()
    assert all(torch.equal(results[0]["full"][name], value) for name, value in expected.items())
    for rank, result in enumerate(results):
        assert result["dcp_loads"] == int(expect_dcp(rank)), rank


@pytest.mark.parametrize("world", [1, 3])
def test_a_load_at_another_world_size_reshards_through_dcp(tmp_path: Path, world: int) -> None:
    saved = run_ranks(2, save, str(tmp_path), ("fp32",))
    check_reloaded(saved, run_ranks(world, reload_full, str(tmp_path), False), lambda rank: True)


def test_ranks_that_cannot_all_read_at_the_saved_layout_load_through_dcp_together(tmp_path: Path) -> None:
    saved = run_ranks(2, save, str(tmp_path), ("fp32",))
    check_reloaded(saved, run_ranks(2, reload_full, str(tmp_path), True), lambda rank: True)
    check_reloaded(saved, run_ranks(2, reload_full, str(tmp_path), False), lambda rank: False)


# ---- reading ahead is advice only -------------------------------------------------------------------------
def test_reading_ahead_pages_in_own_files_at_the_saved_world_size_and_never_fails(tmp_path: Path) -> None:
    from zero3.checkpoint.read_ahead import PageIn, advise, page_in_own_files

    data = tmp_path / "__0_0.distcp"
    data.write_bytes(os.urandom(3 << 20))
    (tmp_path / "__1_0.distcp").write_bytes(b"")
    assert page_in_own_files(tmp_path, 0, 3) is None  # written by two ranks, loaded by three
    assert page_in_own_files(tmp_path, 1, 2) is None  # an empty file: nothing to page in
    paging = page_in_own_files(tmp_path, 0, 2)
    assert paging is not None
    paging.stop()
    PageIn([tmp_path / "missing", data]).stop()  # a file it cannot read ends it quietly
    advise(tmp_path / "missing", [(0, 10)])
    advise(data, [(1 << 20, 4), (5, 10), (10 << 20, 8)])  # out of order, past the end: still no error
