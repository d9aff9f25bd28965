"""Sharded checkpoints: exact resume, resharding at load, crash-safe tags, bad input.

Each scenario runs in spawned ranks; a resume always starts fresh processes
whose model was built from another seed, so only the checkpoint can make the
losses match.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.devices import cpu_ranks_or_one_gpu, worlds_on_devices
from tests.distributed import run_ranks
from tests.logs import zero3_messages

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


train = models.train_steps


def data() -> list:
    return models.batches("tokens", STEPS, GLOBAL_BATCH)


VARIANTS = ["fp32", "bf16", "fp16", "optimizer_cpu", "optimizer_nvme"]

# A world-2 scenario on the CPU, and the same scenario at world 1 on CUDA (two nccl ranks cannot share one GPU).
TWO_RANKS_OR_ONE_GPU = cpu_ranks_or_one_gpu(2)


def deterministic(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn` on torch's deterministic kernels. On CUDA, attention's and the embedding's backward accumulate
    with atomics by default: two runs compared bit for bit must add in the same order."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    return fn(rank, world, *args)


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
    return str(root), run_ranks(2, train_and_save, str(root))  # on the CPU: the session is pinned there


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


@pytest.mark.cuda
def test_resume_on_cuda_gives_the_same_losses_bit_for_bit(tmp_path: Path) -> None:
    """The module fixture's world-2 scenario cannot go on one GPU: every variant saved and resumed at world 1
    on CUDA (staging from device memory, the optimizer tiers beside it), in fresh processes, bit for bit."""
    root = str(tmp_path)
    (before,) = run_ranks(1, deterministic, train_and_save, root)
    (again,) = run_ranks(1, deterministic, resume, root)
    for variant in VARIANTS:
        assert again[variant]["losses"] == before[variant]["losses"][SAVED_AT:], variant
        assert again[variant]["scale"] == before[variant]["scale"] and again[variant]["lr"] == before[variant]["lr"]
        assert again[variant]["loaded"]["steps"] == SAVED_AT and again[variant]["steps"] == STEPS
        assert again[variant]["client"] == {"variant": variant, "rank_count": 1}
    assert before["fp16"]["scale"] != 2.0**8


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


@worlds_on_devices(1, 3)
def test_a_world_2_checkpoint_loads_at_another_world_size(saved: tuple[str, list[dict]], world: int, device: str) -> None:
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


# ---- 5: crash safety and keep_last ------------------------------------------------------------------------
def crashing_save(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ZERO3_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from zero3.checkpoint.data_files import DataFileWriter

    engine = build("fp32", root)
    train(engine, rank, world, data()[:1])
    engine.save_checkpoint(os.path.join(root, "run"), tag="a")
    train(engine, rank, world, data()[1:2])
    if rank == 1:  # dies after its DCP file is written, before the tag is published
        write_data = DataFileWriter.write_data

        def written_then_killed(self: DataFileWriter, plan: object, planner: object) -> None:
            write_data(self, plan, planner)  # type: ignore[arg-type]
            os._exit(3)

        DataFileWriter.write_data = written_then_killed  # type: ignore[method-assign]
    engine.save_checkpoint(os.path.join(root, "run"), tag="b")


def continue_from_latest(rank: int, world: int, root: str) -> dict:
    engine = build("fp32", root, seed=99)
    path, _ = engine.load_checkpoint(os.path.join(root, "run"))
    out = {"path": path, "steps": engine.global_steps, "losses": train(engine, rank, world, data()[1:3])}
    engine.destroy()
    return out


def uninterrupted(rank: int, world: int, root: str) -> list[float]:
    engine = build("fp32", root)
    losses = train(engine, rank, world, data()[:3])
    engine.destroy()
    return losses[1:]


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from tests.distributed import free_port

    root = str(tmp_path)
    with pytest.raises(mp.ProcessExitedException):
        mp.start_processes(crashing_save, args=(2, free_port(), root), nprocs=2, join=True, start_method="spawn")
    run = tmp_path / "run"
    assert (run / "latest").read_text() == "a"
    assert not (run / "b").exists() and (run / ".b.incomplete").is_dir()
    results = run_ranks(2, continue_from_latest, root)
    expected = run_ranks(2, uninterrupted, root)
    for result, losses in zip(results, expected):
        assert result["path"] == str(run / "a") and result["steps"] == 1
        assert result["losses"] == losses


def keep_and_mark(rank: int, world: int, root: str) -> dict:
    import time

    import zero3.checkpoint.tag_write as tag_write

    if rank == 0:  # rank 0 prunes slowly: the other ranks' saves must still return only once it has pruned
        real_prune = tag_write.prune

        def slow_prune(*args: Any) -> list[str]:
            time.sleep(0.3)
            return real_prune(*args)

        tag_write.prune = slow_prune
    engine = build("fp32", root)
    seen = {}
    for index, batch in enumerate(data()[:4]):
        train(engine, rank, world, [batch])
        engine.save_checkpoint(root, tag=f"t{index}", keep_last=2)
        seen[f"t{index}"] = sorted(p for p in os.listdir(root) if not p.startswith("."))
    engine.save_checkpoint(root, tag="side", save_latest=False)
    seen["side"] = open(os.path.join(root, "latest")).read()
    if rank == 0:  # an old tag that cannot be removed: the new one is saved all the same, with a warning

        def refusing_prune(save_dir: Any, *args: Any) -> list[str]:
            raise PermissionError(13, "Permission denied", os.path.join(save_dir, "t2"))

        tag_write.prune = refusing_prune
    warnings = zero3_messages(logging.WARNING)
    engine.save_checkpoint(root, tag="t4", keep_last=2)
    seen["t4"] = sorted(p for p in os.listdir(root) if not p.startswith("."))
    seen["latest_after_t4"] = open(os.path.join(root, "latest")).read()
    warned = [line for line in warnings if "could not all be removed" in line]
    try:
        engine.save_checkpoint(root, tag="../escape")
    except zero3.CheckpointError as error:
        seen["bad_tag"] = str(error)
    engine.destroy()
    return {"seen": seen, "warned": warned}


def test_keep_last_removes_older_tags_only_after_the_new_one_is_complete(tmp_path: Path) -> None:
    rank_0, rank_1 = run_ranks(2, keep_and_mark, str(tmp_path))
    seen = rank_0["seen"]
    assert seen["t0"] == ["latest", "t0"]
    assert seen["t1"] == ["latest", "t0", "t1"]
    assert seen["t3"] == ["latest", "t2", "t3"]
    assert rank_1["seen"] == seen  # a save returns on every rank once rank 0 has pruned
    assert seen["t4"] == ["latest", "side", "t2", "t3", "t4"] and seen["latest_after_t4"] == "t4"
    assert len(rank_0["warned"]) == 1 and "'t4' was saved" in rank_0["warned"][0] and "t2" in rank_0["warned"][0]
    assert rank_1["warned"] == []
    assert seen["side"] == "t3"  # save_latest=False leaves the marker alone
    assert "'../escape'" in seen["bad_tag"]


# ---- 8: bad input leaves the engine as it was -------------------------------------------------------------
def snapshot(engine: zero3.ZeroEngine) -> dict[str, torch.Tensor]:
    from tests.test_tiers import local_state  # every local state: lp, hp and both moments

    return local_state(engine, engine.module)


DAMAGED_FILES = ("truncated", "corrupted", "unfinished", "engine_flip", "metadata_shift")


def bad_loads(rank: int, world: int, root: str, good: str, only: tuple[str, ...] | None = None) -> dict:
    import shutil

    cases: dict[str, tuple[Any, str, dict]] = {}
    damaged = os.path.join(root, "damaged")
    if rank == 0:
        shutil.copytree(good, os.path.join(damaged, "trunc", "global_step3"))
        shutil.copytree(good, os.path.join(damaged, "flip", "global_step3"))
        shutil.copytree(good, os.path.join(damaged, "unfinished", "global_step3"))
        shutil.copytree(good, os.path.join(damaged, "engine_flip", "global_step3"))
        shutil.copytree(good, os.path.join(damaged, "metadata_shift", "global_step3"))
        engine_file = os.path.join(damaged, "engine_flip", "global_step3", "zero3_engine.pt")
        with open(engine_file, "r+b") as f:  # one bit, anywhere: here in the middle of the file
            f.seek(os.path.getsize(engine_file) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
        import pickle

        metadata_file = os.path.join(damaged, "metadata_shift", "global_step3", ".metadata")
        with open(metadata_file, "rb") as f:
            metadata = pickle.load(f)  # our own file: the test may read it plainly
        info = next(iter(metadata.storage_data.values()))
        info.offset += 8  # still a valid pickle of allowed classes, pointing at the wrong bytes
        with open(metadata_file, "wb") as f:
            pickle.dump(metadata, f)
        with open(os.path.join(damaged, "trunc", "global_step3", "__1_0.distcp"), "r+b") as f:
            f.truncate(100)
        with open(os.path.join(damaged, "flip", "global_step3", "__0_0.distcp"), "r+b") as f:
            f.seek(300)
            byte = f.read(1)
            f.seek(300)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.remove(os.path.join(damaged, "unfinished", "global_step3", "zero3_engine.pt"))
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    ckpt = os.path.dirname(good)
    cases = {
        "no_dir": ({}, os.path.join(root, "absent"), {"tag": "global_step3"}),  # without a tag: (None, None)
        "no_tag": ({}, ckpt, {"tag": "global_step99"}),
        "bigger_model": ({"layers": 3}, ckpt, {}),
        "other_vocab": ({"vocab": 80}, ckpt, {}),
        "truncated": ({}, os.path.join(damaged, "trunc"), {"tag": "global_step3"}),
        "corrupted": ({}, os.path.join(damaged, "flip"), {"tag": "global_step3"}),
        "unfinished": ({}, os.path.join(damaged, "unfinished"), {"tag": "global_step3"}),
        "engine_flip": ({}, os.path.join(damaged, "engine_flip"), {"tag": "global_step3"}),
        "metadata_shift": ({}, os.path.join(damaged, "metadata_shift"), {"tag": "global_step3"}),
        "adam": ({}, ckpt, {}),
    }
    out: dict[str, Any] = {}
    for case, (model_args, where, kwargs) in cases.items():
        if only is not None and case not in only:
            continue
        cfg = config("fp32", root)
        if case == "adam":
            cfg["optimizer"] = {"type": "Adam", "params": {"lr": 3e-3, "adam_w_mode": False}}  # L2, not AdamW
        torch.manual_seed(5)
        engine, *_ = zero3.initialize(model=models.TiedTransformer(**model_args), config=cfg)
        train(engine, rank, world, data()[:1])
        before, steps = snapshot(engine), engine.global_steps
        try:
            engine.load_checkpoint(where, **kwargs)
            out[case] = "no error"
        except zero3.CheckpointError as error:
            out[case] = str(error)
        after = snapshot(engine)
        out[f"{case}/unchanged"] = engine.global_steps == steps and all(torch.equal(before[k], after[k]) for k in before)
        engine.destroy()
    return out


def test_bad_checkpoints_are_refused_naming_the_file_and_nothing_changes(
    saved: tuple[str, list[dict]], tmp_path: Path
) -> None:
    root, _ = saved
    good = os.path.join(root, "fp32", f"global_step{SAVED_AT}")
    out = run_ranks(2, bad_loads, str(tmp_path), good)[0]
    for case in ("no_dir", "no_tag", "bigger_model", "other_vocab", "truncated", "corrupted", "unfinished", "adam",
                 "engine_flip", "metadata_shift"):
        assert out[f"{case}/unchanged"], case
    assert "does not exist" in out["no_dir"] and "absent" in out["no_dir"]
    assert "'global_step99' not found" in out["no_tag"] and "global_step3" in out["no_tag"]
    assert "model.blocks.2.qkv.weight: in this model, not in the checkpoint" in out["bigger_model"]
    assert "model.embed.weight: shape [80, 32] here, [64, 32] in the checkpoint" in out["other_vocab"]
    assert "__1_0.distcp" in out["truncated"] and "truncated" in out["truncated"]
    assert "__0_0.distcp" in out["corrupted"] and "corrupted" in out["corrupted"]
    assert "zero3_engine.pt" in out["unfinished"] and "did not complete" in out["unfinished"]
    assert "optimizer is AdamW" in out["adam"] and "Adam" in out["adam"]
    check_damaged_files_refused(out)


def check_damaged_files_refused(out: dict[str, Any]) -> None:
    for case in DAMAGED_FILES:
        assert out[f"{case}/unchanged"], case
    assert "__1_0.distcp" in out["truncated"] and "truncated" in out["truncated"]
    assert "__0_0.distcp" in out["corrupted"] and "corrupted" in out["corrupted"]
    assert "__0_0.distcp': item model." in out["corrupted"], out["corrupted"]  # the item, by name
    assert "zero3_engine.pt" in out["unfinished"] and "did not complete" in out["unfinished"]
    assert "zero3_engine.pt" in out["engine_flip"] and "corrupted" in out["engine_flip"], out["engine_flip"]
    assert ".metadata" in out["metadata_shift"] and "corrupted" in out["metadata_shift"], out["metadata_shift"]


def test_damaged_checkpoint_files_are_refused_on_every_rank_at_three_ranks(
    saved: tuple[str, list[dict]], tmp_path: Path
) -> None:
    """The 2-rank checkpoint's damaged copies, loaded by 3 ranks: every rank refuses, naming the file."""
    root, _ = saved
    good = os.path.join(root, "fp32", f"global_step{SAVED_AT}")
    for out in run_ranks(3, bad_loads, str(tmp_path), good, DAMAGED_FILES):
        check_damaged_files_refused(out)


def flip_byte(file: str, at: int) -> None:
    with open(file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def other_reads(rank: int, world: int, root: str, good: str) -> dict:
    """The checkpoint loaded in other ways than a save of today is: as saved (its small items read, not
    mapped), with every item read through the mapping, from a copy summed as the zero3 before XXH3 summed
    it (each item's CRC-32, no "checksum" named), and from one whose engine file sums each data file whole
    with CRC-32 (a tag saved before item sums); a flipped byte refused each way, and a checksum this zero3
    does not know refused, changing nothing."""
    import shutil

    from zero3.checkpoint import trust
    from zero3.checkpoint.tags import CRC32, checksums, dcp_files, item_checksums, write_engine_sum

    engine = build("fp32", root, seed=99)  # (joins the process group)
    cases = ("whole", "whole_flip", "crc32", "crc32_flip", "flip", "unknown")
    copies = {case: os.path.join(root, case, f"global_step{SAVED_AT}") for case in cases}
    if rank == 0:
        for case, copy in copies.items():
            shutil.copytree(good, copy)
            engine_file = Path(copy) / "zero3_engine.pt"
            state = torch.load(engine_file, weights_only=True)
            if case.startswith(("whole", "crc32")):
                del state["checksum"]
            if case.startswith("whole"):
                state["files"] |= checksums(dcp_files(Path(copy)), CRC32)
                state["files"][".metadata"] = checksums([Path(copy) / ".metadata"], CRC32)[".metadata"]
            if case.startswith("crc32"):
                for file in dcp_files(Path(copy)):
                    _, items = state["files"][file.name]
                    spans = [(offset, length) for offset, (length, _) in items.items()]
                    state["files"][file.name] = item_checksums(file, spans, CRC32)
                state["files"][".metadata"] = checksums([Path(copy) / ".metadata"], CRC32)[".metadata"]
            if case == "unknown":
                state["checksum"] = "sha3_512"
            torch.save(state, engine_file)
            write_engine_sum(engine_file)
        for case in ("whole_flip", "crc32_flip"):
            flip_byte(os.path.join(copies[case], "__0_0.distcp"), 300)
        flip_byte(os.path.join(copies["flip"], "__1_0.distcp"), 300)
    torch.distributed.barrier()
    out: dict[str, Any] = {}
    read_as_saved = trust._READ_BELOW
    for case, where, read_below in (("items", good, read_as_saved), ("whole", copies["whole"], read_as_saved),
                                    ("crc32", copies["crc32"], read_as_saved), ("mapped", good, 0),
                                    ("whole_flip", copies["whole_flip"], read_as_saved),
                                    ("crc32_flip", copies["crc32_flip"], 0), ("flip", copies["flip"], 0),
                                    ("unknown", copies["unknown"], read_as_saved)):
        trust._READ_BELOW, kept = read_below, trust._READ_BELOW
        before = snapshot(engine)
        try:
            engine.load_checkpoint(os.path.dirname(where), tag=f"global_step{SAVED_AT}")
            out[case] = snapshot(engine)
        except zero3.CheckpointError as error:
            out[case] = str(error)
            out[f"{case}/unchanged"] = all(torch.equal(before[k], value) for k, value in snapshot(engine).items())
        trust._READ_BELOW = kept
        train(engine, rank, world, data()[:1])  # every state moves on: the next load must bring it back
    engine.destroy()
    for case in ("whole", "crc32", "mapped"):
        out[case] = all(torch.equal(out["items"][k], value) for k, value in out[case].items())
    del out["items"]
    return out


def test_items_read_through_the_mapping_or_summed_as_older_tags_load_alike_and_are_checked(
    saved: tuple[str, list[dict]], tmp_path: Path
) -> None:
    root, _ = saved
    good = os.path.join(root, "fp32", f"global_step{SAVED_AT}")
    for out in run_ranks(2, other_reads, str(tmp_path), good):
        assert out["whole"] is True and out["crc32"] is True and out["mapped"] is True
        assert out["whole_flip/unchanged"] and out["crc32_flip/unchanged"] and out["flip/unchanged"]
        assert out["unknown/unchanged"]
        assert "__0_0.distcp' does not match the checksum" in out["whole_flip"], out["whole_flip"]
        assert "__0_0.distcp': item " in out["crc32_flip"] and "(corrupted)" in out["crc32_flip"], out["crc32_flip"]
        assert "__1_0.distcp': item " in out["flip"] and "(corrupted)" in out["flip"], out["flip"]
        assert "summed with 'sha3_512', which this zero3 does not know" in out["unknown"], out["unknown"]


# ---- 6: async save ----------------------------------------------------------------------------------------
def async_job(rank: int, world: int, root: str) -> dict:
    import threading

    import torch.distributed.checkpoint as dcp

    may_write = threading.Event()
    real_save = dcp.save

    def held_save(*args: Any, **kwargs: Any) -> Any:
        may_write.wait(timeout=120)  # the files are written only after training moved on
        return real_save(*args, **kwargs)

    dcp.save = held_save  # type: ignore[assignment]
    run = os.path.join(root, "async")
    engine = build("fp32", root)
    train(engine, rank, world, data()[:SAVED_AT])
    engine.save_checkpoint(run, async_save=True)
    returned_before_written = not os.path.exists(os.path.join(run, "latest"))
    losses = train(engine, rank, world, data()[SAVED_AT:])  # changes every master while the save waits
    may_write.set()
    engine.save_checkpoint(run, tag="end", async_save=True)  # waits for the first, then starts its own
    first_done = open(os.path.join(run, "latest")).read() if rank == 0 else None
    engine.destroy()  # waits for the second
    dcp.save = real_save  # type: ignore[assignment]
    return {"returned_before_written": returned_before_written, "losses": losses, "first_done": first_done,
            "latest": open(os.path.join(run, "latest")).read()}


def resume_async(rank: int, world: int, root: str) -> list[float]:
    engine = build("fp32", root, seed=99)
    engine.load_checkpoint(os.path.join(root, "async"), tag=f"global_step{SAVED_AT}")
    losses = train(engine, rank, world, data()[SAVED_AT:])
    engine.destroy()
    return losses


@TWO_RANKS_OR_ONE_GPU
def test_async_save_returns_once_staged_and_holds_the_state_of_the_moment_it_was_called(
    tmp_path: Path, world: int, device: str
) -> None:
    root = str(tmp_path)
    # (on CUDA on deterministic kernels: the resumed losses are compared bit for bit)
    job, resumed_job = ((deterministic, async_job), (deterministic, resume_async)) if device == "cuda" else \
        ((async_job,), (resume_async,))
    results = run_ranks(world, *job, root)
    assert all(r["returned_before_written"] for r in results)
    assert results[0]["first_done"] == f"global_step{SAVED_AT}"
    assert all(r["latest"] == "end" for r in results)  # destroy() waited for the last save
    resumed = run_ranks(world, *resumed_job, root)
    for result, again in zip(results, resumed):
        assert again == result["losses"]


# ---- 7: weights users can take away -----------------------------------------------------------------------
def plain_loss(state: dict[str, torch.Tensor] | str, batch: tuple, rank: int, world: int) -> float:
    from safetensors.torch import load_model

    model = models.TiedTransformer()
    if isinstance(state, str):
        load_model(model, state)  # restores the tied head from the embedding
    else:
        model.load_state_dict(state, strict=False)
        model.head.weight = model.embed.weight
    x, y = batch
    with torch.no_grad():
        return model(x.chunk(world)[rank], y.chunk(world)[rank]).item()


def same_safetensors(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    first, second = load_file(a), load_file(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def live_export(rank: int, world: int, root: str) -> dict:
    out: dict[str, Any] = {}
    for variant in ("fp32", "bf16"):
        engine = build(variant, root)
        train(engine, rank, world, data()[:2])
        target = os.path.join(root, f"live-{variant}")
        engine.save_16bit_model(target)
        # With every state parked on disk, the 16-bit shards are streamed from their files; they stay parked.
        engine.offload_states(device="nvme", nvme_path=os.path.join(root, "park"))
        engine.save_16bit_model(target + "-parked")
        still_parked = set(engine.state_report()["lp_params"]) == {"nvme"}
        engine.reload_states()
        x, y = (t.chunk(world)[rank].to(engine.device) for t in data()[2])
        with torch.no_grad():
            out[variant] = {"engine": engine(x, y).item()}
        out[variant]["plain"] = plain_loss(os.path.join(target, "model.safetensors"), data()[2], rank, world)
        out[variant]["parked"] = {"still_parked": still_parked, "same": rank != 0 or same_safetensors(
            os.path.join(target, "model.safetensors"), os.path.join(target + "-parked", "model.safetensors"))}
        engine.destroy()
    return out


@TWO_RANKS_OR_ONE_GPU
def test_save_16bit_model_writes_weights_a_plain_module_loads_with_the_engines_outputs(
    tmp_path: Path, world: int, device: str
) -> None:
    from safetensors import safe_open

    results = run_ranks(world, live_export, str(tmp_path))
    # The plain module runs on the host: against a CUDA engine's forward (other kernels) close, not equal.
    rel = 1e-6 if device == "cpu" else 1e-5
    for result in results:
        assert result["fp32"]["plain"] == pytest.approx(result["fp32"]["engine"], rel=rel)
        for variant in ("fp32", "bf16"):
            assert result[variant]["parked"] == {"still_parked": True, "same": True}, variant
        # bf16 weights in a fp32 module compute in fp32: close to the engine's bf16 forward, not equal
        assert result["bf16"]["plain"] == pytest.approx(result["bf16"]["engine"], rel=2e-2)
    with safe_open(str(tmp_path / "live-bf16" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16
    assert "embed.weight" in keys and "head.weight" not in keys  # the tied weight is written once
    assert keys == {n for n, _ in models.TiedTransformer().named_parameters()}


def test_zero3_export_writes_one_file_or_hf_shards_from_a_checkpoint(
        saved: tuple[str, list[dict]], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    from zero3 import cli

    root, before = saved
    ckpt = os.path.join(root, "fp32")
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    proc = subprocess.run([sys.executable, "-m", "zero3.cli", "export", ckpt, str(whole)],  # the command itself
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert cli.main(["export", ckpt, str(sharded), "--max-shard-size", "40KB"]) == 0  # (it needs no process group)
    # The exported step-3 weights give the loss the engine computed at step 4 (on each rank's rows).
    for rank, result in enumerate(before):
        expected = result["fp32"]["losses"][SAVED_AT]
        assert plain_loss(str(whole / "model.safetensors"), data()[SAVED_AT], rank, 2) == pytest.approx(expected, rel=1e-5)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    state: dict[str, torch.Tensor] = {}
    for name in shards:
        part = load_file(str(sharded / name))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 40_000 or len(part) == 1
        state.update(part)
    assert plain_loss(state, data()[SAVED_AT], 0, 2) == pytest.approx(before[0]["fp32"]["losses"][SAVED_AT], rel=1e-5)
    capsys.readouterr()
    assert cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def llama_job(rank: int, world: int, root: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = zero3.initialize(model=model, config=cfg)
    batch = torch.randint(0, 64, (2 * world, 16), generator=torch.Generator().manual_seed(3))
    mine = batch.chunk(world)[rank].to(engine.device)
    for _ in range(2):
        engine.backward(engine(input_ids=mine, labels=mine).loss)
        engine.step()
    target = os.path.join(root, "llama")
    engine.save_16bit_model(target, max_shard_size="30KB")
    engine.save_16bit_model(os.path.join(root, "bin"), "pytorch_model.bin")  # DeepSpeed's default name and format
    blocked = os.path.join(root, f"a-file-{rank}")
    open(blocked, "w").close()
    try:  # rank 0 cannot make the directory (a file is in the way): every rank raises
        engine.save_16bit_model(os.path.join(root, "a-file-0", "weights"))
        blocked_error = None
    except OSError as error:
        blocked_error = f"{type(error).__name__}: {error}"
    engine.save_checkpoint(os.path.join(root, "llama-ckpt"))
    if rank == 0:
        config.save_pretrained(target)
        config.save_pretrained(os.path.join(root, "llama-export"))
    engine.comm.barrier()
    with torch.no_grad():
        logits = engine(input_ids=mine).logits
    logits, mine = logits.cpu(), mine.cpu()  # compared with the plain model on the host, and returned
    loaded = LlamaForCausalLM.from_pretrained(target)
    with torch.no_grad():
        plain = loaded(input_ids=mine).logits
    engine.destroy()
    from safetensors.torch import load_file

    bin_state = torch.load(os.path.join(root, "bin", "pytorch_model.bin"), weights_only=True)
    shards = {}
    for name in os.listdir(target):
        if name.endswith(".safetensors"):
            shards.update(load_file(os.path.join(target, name)))
    return {"max_diff": (plain - logits).abs().max().item(), "files": sorted(os.listdir(target)),
            "logits": logits, "input_ids": mine, "blocked": blocked_error,
            "bin_equal": sorted(bin_state) == sorted(shards) and all(torch.equal(bin_state[k], shards[k]) for k in shards)}


@TWO_RANKS_OR_ONE_GPU
def test_the_weights_load_into_a_hugging_face_model_with_the_engines_logits(
    tmp_path: Path, world: int, device: str
) -> None:
    import subprocess
    import sys

    from transformers import LlamaForCausalLM

    results = run_ranks(world, llama_job, str(tmp_path))
    for rank, result in enumerate(results):  # save_16bit_model's shards
        assert result["max_diff"] < 1e-5
        assert "model.safetensors.index.json" in result["files"]
        assert result["bin_equal"]  # pytorch_model.bin: a torch.save of the same state dict
        assert result["blocked"] is not None and result["blocked"].startswith("NotADirectoryError"), result["blocked"]
        if rank != 0:
            assert "rank 0 failed in save_16bit_model" in result["blocked"], result["blocked"]
    exported = tmp_path / "llama-export"  # and `zero3 export` of the checkpoint
    proc = subprocess.run([sys.executable, "-m", "zero3.cli", "export", str(tmp_path / "llama-ckpt"), str(exported)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = LlamaForCausalLM.from_pretrained(str(exported))
    for result in results:
        with torch.no_grad():
            logits = loaded(input_ids=result["input_ids"]).logits
        assert (logits - result["logits"]).abs().max().item() < 1e-5
