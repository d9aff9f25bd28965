"""Full and read-only disks. A save that fails on I/O (a small tmpfs, full; a directory read-only for one
rank only, through that rank's own mount namespace) is every rank's CheckpointError in words; the
partial tag is removed, `latest` still names the previous tag, training goes on, the next save works.
Tier files of ranks that share a disk are counted together: every rank refuses, before writing."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import zero3
from tests import models
from tests.distributed import run_ranks
from tests.tmpfs import small_tmpfs

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
SIZE = "800k"  # one checkpoint of the model below (about 520 KB) fits, a second does not


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "tmpfs", SIZE) as root:
        yield root


def step(engine: zero3.ZeroEngine, rank: int, world: int, seed: int) -> None:
    x, y = models.batches("tokens", 1, 2 * world, seed=seed)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()


def fill_then_recover(rank: int, world: int, root: str) -> list[dict]:
    """A synchronous save, then an async one, into a disk with room for one checkpoint: each time the
    previous tag `kept` is there, the save of a second fails, then room is made and a third works."""
    torch.manual_seed(0)
    model = models.TiedTransformer()
    engine = zero3.initialize(model=model, config=CONFIG)[0]
    step(engine, rank, world, 0)
    engine.save_checkpoint(root, tag="a")
    rounds = []
    for kept, failing, next_tag, async_save in (("a", "b", "c", False), ("c", "d", "e", True)):
        step(engine, rank, world, 1)
        before = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
        error = ""
        try:
            engine.save_checkpoint(root, tag=failing, async_save=async_save)  # no room for a second one
            if async_save:
                step(engine, rank, world, 2)  # the steps in between are unaffected
                engine.wait_for_checkpoint()
        except zero3.CheckpointError as failure:
            error = str(failure)
        untouched = async_save or all(
            torch.equal(before[n], zero3.safe_get_full_fp32_param(p)) for n, p in model.named_parameters())
        leftovers = sorted(os.listdir(root))
        latest = Path(root, "latest").read_text().strip()
        path, _ = engine.load_checkpoint(root)  # what latest names still loads
        step(engine, rank, world, 3)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(Path(root, kept))  # room again
        dist.barrier()
        engine.save_checkpoint(root, tag=next_tag, async_save=async_save)
        engine.wait_for_checkpoint()
        rounds.append({"kept": kept, "next": next_tag, "error": error, "untouched": untouched,
                       "leftovers": leftovers, "latest": latest, "loaded": Path(path).name,
                       "after": sorted(os.listdir(root))})
    engine.destroy()
    return rounds


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_disk_fails_the_save_on_every_rank_and_loses_nothing(small_disk: Path, world: int) -> None:
    """Sync and async, on 1 and 2 ranks (3 ranks' first checkpoint does not fit this disk; the read-only
    directory below fails one rank of 3)."""
    per_rank = run_ranks(world, fill_then_recover, str(small_disk))
    for rounds in zip(*per_rank):  # the sync round on every rank, then the async one
        for result in rounds:
            kept = result["kept"]
            assert "no space left on device" in result["error"] and str(small_disk) in result["error"], result
            assert f"'latest' still names '{kept}'" in result["error"]
            assert result["untouched"]
            assert result["leftovers"] == [kept, "latest"]  # no partial tag holding the space
            assert result["latest"] == kept and result["loaded"] == kept
            assert result["after"] == [result["next"], "latest"]
        assert len({result["error"] for result in rounds}) == 1


CLONE_NEWNS = 0x00020000


def read_only_for(root: str) -> str:
    """Make `root` read-only for this process alone: a mount namespace of its own, with `root` bound
    read-only onto itself (the other ranks still write there). Returns "" or why it cannot be done."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    for command in (["mount", "--make-rprivate", "/"], ["mount", "--bind", root, root],
                    ["mount", "-o", "remount,bind,ro", root]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(command)}: {done.stderr.strip()}"
    return ""


def read_only_on_one_rank(rank: int, world: int, root: str, every_rank: bool = False) -> dict:
    torch.manual_seed(0)
    model = models.TiedTransformer()
    engine = zero3.initialize(model=model, config=CONFIG)[0]
    step(engine, rank, world, 0)
    engine.save_checkpoint(root, tag="a")
    dist.barrier()
    why_not = read_only_for(root) if rank == 1 or every_rank else ""
    reasons: list = [None] * world
    dist.all_gather_object(reasons, why_not)
    out: dict = {}
    if any(reasons):
        out["skipped"] = next(reason for reason in reasons if reason)
        engine.destroy()
        return out
    step(engine, rank, world, 1)
    before = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    try:
        engine.save_checkpoint(root, tag="b")
        out["error"] = None
    except zero3.CheckpointError as error:
        out["error"] = str(error)
    out["untouched"] = all(torch.equal(before[n], zero3.safe_get_full_fp32_param(p))
                           for n, p in model.named_parameters())
    out["listing"] = sorted(os.listdir(root))
    out["latest"] = Path(root, "latest").read_text().strip()
    step(engine, rank, world, 2)  # training goes on
    engine.destroy()
    return out


@pytest.mark.parametrize("world,every_rank", [(2, False), (3, False), (2, True)],
                         ids=["2-one-rank", "3-one-rank", "2-every-rank"])
def test_a_checkpoint_directory_read_only_on_one_rank_fails_the_save_on_every_rank(
    tmp_path: Path, world: int, every_rank: bool,
) -> None:
    """Read-only for rank 1, or for every rank (the directory nobody can write: rank 0 finds it as the save
    starts, before any rank writes)."""
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount for one rank needs root (this process is not)")
    results = run_ranks(world, read_only_on_one_rank, str(tmp_path), every_rank)
    if "skipped" in results[0]:
        pytest.skip(f"no mount namespace for one rank here: {results[0]['skipped']}")
    failing = "rank 0" if every_rank else "rank 1"
    for rank, result in enumerate(results):
        assert result["error"] is not None and failing in result["error"], (rank, result)
        assert "read-only file system" in result["error"] and "'latest' still names 'a'" in result["error"], result
        assert result["untouched"], rank
        assert result["listing"] == ["a", "latest"] and result["latest"] == "a", result  # no partial tag
    assert len({result["error"] for result in results}) == 1


def shared_tier_disk(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    model = models.TiedTransformer()
    cfg = CONFIG | {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                          "offload_optimizer": {"device": "nvme", "nvme_path": root}}}
    try:
        zero3.initialize(model=model, config=cfg)
        return {"error": ""}
    except zero3.TierConfigError as error:
        return {"error": str(error), "left": sorted(os.listdir(root))}


def test_tier_files_of_ranks_sharing_a_disk_are_counted_together(small_disk: Path) -> None:
    """With 400 KiB of the 800 KiB disk taken, each rank's optimizer files (about 340 KiB: two generations
    of the master and Adam's moments) fit alone; both ranks' do not."""
    Path(small_disk, "filler").write_bytes(b"\0" * 400 * 1024)
    results = run_ranks(2, shared_tier_disk, str(small_disk))
    for result in results:
        assert "too little free disk space" in result["error"], result
        assert "(ranks 0, 1 together)" in result["error"] and "KiB" in result["error"], result["error"]
        assert result["left"] == ["filler"]  # nothing was written
    assert results[0]["error"] == results[1]["error"]
