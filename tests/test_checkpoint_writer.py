"""Async saves are written by a checkpoint writer process per rank (zero3.checkpoint.writer_process).

What a save writes is the blocking save's, bit for bit; the writer goes with the engine, and with its
rank when the rank is killed; a writer that died is replaced at the next save on every rank; and where
a writer cannot be had (a job on a file store, or no room in /dev/shm on one rank) every rank writes in
a thread instead, and the save still works.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import zero3
from tests import models
from tests.distributed import children_of, run_ranks, script_env
from tests.logs import zero3_messages

REPO = Path(__file__).resolve().parents[1]
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
WRITER = b"zero3.checkpoint.writer_process"


def step(engine: zero3.ZeroEngine, rank: int, world: int, seed: int) -> None:
    x, y = models.batches("tokens", 1, 2 * world, seed=seed)[0]
    engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
    engine.step()


def same_tags(one: Path, other: Path, tmp_path: Path) -> bool:
    """Two tags hold the same tensors, bit for bit (read whole by DCP's own converter: zero3's files hold no
    pickled object)."""
    states = []
    for path in (one, other):
        whole = tmp_path / f"{path.name}.pt"
        dcp_to_torch_save(path, whole)
        states.append(torch.load(whole, weights_only=True))
    return states[0].keys() == states[1].keys() and all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def writers() -> list[int]:
    return children_of(os.getpid(), WRITER)


def segments() -> list[str]:
    """This process's staging segments in /dev/shm."""
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"zero3-ckpt-{os.getpid()}-"))


def saved_by_a_writer(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(0)
    engine = zero3.initialize(model=models.TiedTransformer(), config=CONFIG)[0]
    step(engine, rank, world, 0)
    engine.save_checkpoint(root, tag="blocking")
    engine.save_checkpoint(root, tag="async", async_save=True)
    during = writers()
    staged = segments()
    engine.wait_for_checkpoint()
    out = {"writers": during, "staged": staged, "staged_after": segments()}
    if rank == 1:
        os.kill(during[0], signal.SIGKILL)  # one rank's writer dies between saves
        # Until it has let go of its memory: it may not have closed its connection yet, nor be reapable.
        while writers():
            time.sleep(0.01)
    dist.barrier()
    step(engine, rank, world, 1)
    engine.save_checkpoint(root, tag="after_a_writer_died", async_save=True)
    engine.wait_for_checkpoint()
    out["replaced"] = writers()
    expected = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    step(engine, rank, world, 2)
    engine.load_checkpoint(root, tag="after_a_writer_died")
    out["restored"] = all(torch.equal(expected[n], zero3.safe_get_full_fp32_param(p))
                          for n, p in engine.module.named_parameters())
    engine.destroy()
    out["after_destroy"] = writers()
    return out


def test_an_async_save_is_the_blocking_saves_bytes_written_by_a_process_replaced_when_it_dies(tmp_path: Path) -> None:
    results = run_ranks(2, saved_by_a_writer, str(tmp_path))
    for result in results:
        assert len(result["writers"]) == 1, result  # a writer of its own per rank
        assert len(result["replaced"]) == 1, result
        assert result["restored"] and result["after_destroy"] == []
        # An occasional save's staging memory is freed once it is written (automatic checkpoints keep it).
        assert len(result["staged"]) == 1 and result["staged_after"] == [], result
    assert results[0]["replaced"] != results[0]["writers"]  # rank 0's live writer was replaced too (a new group)
    assert same_tags(tmp_path / "async", tmp_path / "blocking", tmp_path)


def thread_written(rank: int, world: int, root: str, why: str) -> dict:
    if why == "file store":
        dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=world)
    elif why == "no room in /dev/shm" and rank == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.unshare(0x00020000) == 0, os.strerror(ctypes.get_errno())  # CLONE_NEWNS: this rank alone
        for command in (["mount", "--make-rprivate", "/"], ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/dev/shm"]):
            subprocess.run(command, check=True, capture_output=True)
    warnings = zero3_messages()
    torch.manual_seed(0)
    engine = zero3.initialize(model=models.TiedTransformer(), config=CONFIG)[0]
    step(engine, rank, world, 0)
    engine.save_checkpoint(root, tag="async", async_save=True)
    during = writers()
    engine.wait_for_checkpoint()
    engine.save_checkpoint(root, tag="blocking")
    expected = {n: zero3.safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    step(engine, rank, world, 1)
    engine.load_checkpoint(root, tag="async")
    restored = all(torch.equal(expected[n], zero3.safe_get_full_fp32_param(p))
                   for n, p in engine.module.named_parameters())
    engine.destroy()
    return {"writers": during, "restored": restored, "warnings": [w for w in warnings if "/dev/shm" in w]}


@pytest.mark.parametrize("why", ["file store", "no room in /dev/shm"])
def test_where_no_writer_can_be_had_every_rank_writes_in_a_thread(tmp_path: Path, why: str) -> None:
    if why == "no room in /dev/shm" and os.geteuid() != 0:
        pytest.skip("mounting a small /dev/shm for one rank needs root (this process is not)")
    results = run_ranks(2, thread_written, str(tmp_path), why)
    for rank, result in enumerate(results):
        assert result["writers"] == [] and result["restored"], result
        assert len(result["warnings"]) == (1 if why == "no room in /dev/shm" and rank == 1 else 0), result
    assert same_tags(tmp_path / "async", tmp_path / "blocking", tmp_path)


KILLED_RANK = """
import os, signal, sys, time, torch, zero3
from tests import models
torch.manual_seed(0)
engine = zero3.initialize(model=models.TiedTransformer(), config={config!r})[0]
engine.save_checkpoint(sys.argv[1], tag="first", async_save=True)
engine.wait_for_checkpoint()
engine.save_checkpoint(sys.argv[1], tag="second", async_save=True)
from tests.distributed import children_of
print(children_of(os.getpid(), {writer!r})[0], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_rank_takes_its_writer_with_it(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(KILLED_RANK.format(config=CONFIG, writer=WRITER))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=script_env(str(REPO)))
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    writer = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{writer}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = not Path(f"/proc/{writer}").exists() or b"zombie" in Path(f"/proc/{writer}/status").read_bytes().lower()
    assert gone, f"writer {writer} outlived its rank"
