"""`zero3.initialize` hands the host memory its build freed back to the OS.

Partitioning frees every whole value it shards (under zero3.Init, every
module's), in between shards that stay. glibc keeps such pages resident in its
heap, free, where later allocations of other sizes rarely fit: at GPT 12 x 1024
fp32 on 2 ranks, 450-570 MiB per rank stayed resident after initialize. The
measure here: of what this rank's resident anonymous memory grew by across the
build, how much is neither in use by glibc's allocator nor mapped apart by it:
freed heap still resident, plus what no malloc statistic counts (Python's own
object arenas, thread stacks; about 60 MiB here, trimmed or not).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_ranks
from zero3.accelerator import host_heap_bytes

pytestmark = pytest.mark.skipif(host_heap_bytes() is None or not Path("/proc/self/status").exists(),
                                reason="glibc's malloc statistics (2.33+) and /proc are Linux's")


def _resident_and_allocated() -> tuple[int, int]:
    """(resident anonymous bytes, bytes glibc's allocator has handed out: heap in use plus mapped apart)."""
    heap = host_heap_bytes()
    assert heap is not None
    anon = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("RssAnon:"))
    return anon, heap["in_use"] + heap["mmapped"]


def freed_but_resident_after_initialize(rank: int, world: int, trim: bool) -> float:
    import zero3
    from zero3 import accelerator
    from zero3.models.gpt import GPT, GPTConfig

    if not trim:  # what initialize did before it handed the memory back
        accelerator.release_host_memory = lambda: None
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3}}
    before = _resident_and_allocated()
    with zero3.Init(config=config):
        model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=6, n_head=8, n_embd=768))
    engine = zero3.initialize(model=model, config=config)[0]
    after = _resident_and_allocated()
    engine.destroy()
    return ((after[0] - before[0]) - (after[1] - before[1])) / 2**20


@pytest.mark.timeout(300)
def test_initialize_hands_the_builds_freed_memory_back() -> None:
    kept = run_ranks(2, freed_but_resident_after_initialize, False)
    handed_back = run_ranks(2, freed_but_resident_after_initialize, True)
    print(f"\nfreed heap still resident after initialize (MiB per rank): kept {kept}, handed back {handed_back}")
    # Measured: kept 206-215 MiB, handed back 63 (the part no malloc statistic counts).
    assert max(handed_back) < 0.5 * min(kept)
