"""A pruned tag's data files written over by the next save (zero3.checkpoint.tags' [Note: recycled data
files]): the new tag's files are the old ones' inodes, every kept tag loads exactly, a recycled file that
is longer than the new data is cut, one a larger world left is removed, and one hard-linked elsewhere is
left alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from tests import models
from tests.distributed import run_ranks
from tests.test_shared_state import GLOBAL_BATCH, build, raw_state, same, tag_state
from zero3.checkpoint.data_files import DirectFile
from zero3.checkpoint.tags import ENGINE_FILE, RECYCLED, new_staging_dir, prune


def _inodes(tag_dir: Path) -> dict[str, int]:
    return {path.name: path.stat().st_ino for path in tag_dir.glob("__*_0.distcp")}


def saved_over_recycled_files(rank: int, world: int, root: str, outside: str) -> dict[str, Any]:
    data = models.batches("tokens", 5, GLOBAL_BATCH)
    engine = build("fp32", root, keep_last=2)  # automatic async saves every step
    ckpt = Path(root)
    inodes, states, seen = {}, {}, {}
    for step, batch in enumerate(data, start=1):
        if step == 4 and rank == 0:
            # What a larger world's save left, a file longer than the new one, junk, and a file someone
            # hard-linked elsewhere (a backup): the save must not write over the backup's data.
            recycled = ckpt / RECYCLED
            (recycled / "__5_0.distcp").write_bytes(b"x" * 100)
            (recycled / "sub").mkdir()
            with open(recycled / "__0_0.distcp", "ab") as grown:
                grown.write(b"y" * 10_000)
            os.link(recycled / "__1_0.distcp", outside)
            seen["outside_before"] = Path(outside).read_bytes()
        torch.distributed.barrier()
        models.train_steps(engine, rank, world, [batch])  # saves global_step<step>
        engine.wait_for_checkpoint()
        states[step] = raw_state(engine)
        inodes[step] = _inodes(ckpt / f"global_step{step}")
        seen[f"listing{step}"] = sorted(p.name for p in ckpt.iterdir())
    engine.destroy()
    seen["inodes"] = inodes
    seen["tags_hold_their_steps"] = [same(tag_state("fp32", root, f"global_step{step}"), states[step])
                                     for step in (4, 5)]
    if rank == 0:
        seen["outside_after"] = Path(outside).read_bytes()
    return seen


def test_a_pruned_tags_files_are_written_over_by_the_next_save_and_every_tag_loads_exactly(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "backup.distcp"
    results = run_ranks(2, saved_over_recycled_files, str(root), str(outside))
    for rank, seen in enumerate(results):
        assert seen["tags_hold_their_steps"] == [True, True], rank
        inodes = seen["inodes"]
        # Step 3's save pruned global_step1 into .recycled; step 4's was written over it (its files, in place).
        assert seen["listing2"] == ["global_step1", "global_step2", "latest"]
        assert seen["listing3"] == [RECYCLED, "global_step2", "global_step3", "latest"]
        assert seen["listing5"] == [RECYCLED, "global_step4", "global_step5", "latest"]
        assert inodes[3]["__0_0.distcp"] not in inodes[1].values()
        assert inodes[4]["__0_0.distcp"] == inodes[1]["__0_0.distcp"]  # grown by 10,000 bytes: cut back
        assert inodes[4]["__1_0.distcp"] != inodes[1]["__1_0.distcp"]  # hard-linked elsewhere: a new file
        assert inodes[5] == inodes[2]
        assert sorted(inodes[4]) == ["__0_0.distcp", "__1_0.distcp"]  # __5_0 (a larger world's) removed
    assert results[0]["outside_after"] == results[0]["outside_before"]
    assert not (root / "global_step4" / "sub").exists()


def test_prune_keeps_the_oldest_removed_tag_aside_and_the_next_save_starts_from_its_data_files(
        tmp_path: Path) -> None:
    for index in range(4):
        tag = tmp_path / f"t{index}"
        tag.mkdir()
        (tag / "__0_0.distcp").write_bytes(b"data")
        (tag / "__2_0.distcp").write_bytes(b"a larger world's")
        (tag / ".metadata").write_bytes(b"meta")
        (tag / ENGINE_FILE).write_bytes(b"engine")
        os.utime(tag / ENGINE_FILE, ns=(index * 10**9, index * 10**9))  # completed in this order
    assert prune(tmp_path, 1, "t3") == ["t0", "t1", "t2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECYCLED, "t3"]
    recycled_inode = (tmp_path / RECYCLED / "__0_0.distcp").stat().st_ino
    staged = new_staging_dir(tmp_path, "t4", world_size=2)
    assert sorted(p.name for p in staged.iterdir()) == ["__0_0.distcp"]  # only a file this world writes
    assert (staged / "__0_0.distcp").stat().st_ino == recycled_inode
    assert not (tmp_path / RECYCLED).exists()
    assert sorted(p.name for p in new_staging_dir(tmp_path, "t5", world_size=2).iterdir()) == []  # none left


def test_a_file_written_over_holds_exactly_what_was_written(tmp_path: Path) -> None:
    path = tmp_path / "file"
    for direct in (True, False):
        path.write_bytes(b"z" * 50_000)  # longer than what comes
        file = DirectFile(path, direct=direct)
        file.write(b"a" * 5000)
        large = torch.arange(4096, dtype=torch.uint8).numpy().tobytes()
        file.write_large(memoryview(large), 0)
        assert file.close() == 5000 + len(large)
        assert path.read_bytes() == b"a" * 5000 + large, direct
