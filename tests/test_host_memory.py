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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

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


# ---- the gradient shards hold no resident memory between a step and the next backward ----------------------
def resident_fraction(tensor) -> float:
    """Of `tensor`'s whole pages, the fraction in the resident set now (mincore)."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    pages = (end - start) // page
    assert pages > 0
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(byte & 1 for byte in vector) / pages


def test_droppable_zeros_are_zeroed_by_dropping_their_pages() -> None:
    from zero3.accelerator import DroppableZeros

    zeros = DroppableZeros(4 << 20, torch.float32)  # 16 MiB
    assert resident_fraction(zeros.tensor) == 0.0 and not zeros.tensor.any()
    zeros.tensor.fill_(3.0)
    assert resident_fraction(zeros.tensor) == 1.0
    view = zeros.tensor[5:9]
    zeros.zero()
    assert resident_fraction(zeros.tensor) == 0.0
    assert not zeros.tensor.any()  # read back as zeros (a read maps the zero page: nothing resident)
    view.add_(2.0)  # views stay valid: the memory is the same, only its pages were handed back
    assert zeros.tensor[4:10].tolist() == [0.0, 2.0, 2.0, 2.0, 2.0, 0.0]


def accumulated_steps(rank: int, world: int, measure: Callable[[Any], Any]) -> tuple[Any, dict]:
    """An engine of a small tied transformer (shards of 6 MiB, 3 at 2 ranks), 2 micro-steps a step, 4
    micro-steps run: `measure(engine)` once built, after each backward and after each step. Returns the engine
    (to be destroyed) and what was measured."""
    import zero3
    from tests import models

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    model = models.TiedTransformer(vocab=64, dim=256, heads=4, layers=2)
    engine = zero3.initialize(model=model, config=config)[0]
    seen = {"built": measure(engine)}
    for micro, (x, y) in enumerate(models.batches("tokens", 4, 4 * world)):
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        engine.backward(engine(x, y))
        seen[f"backward {micro}"] = measure(engine)
        engine.step()
        seen[f"step {micro}"] = measure(engine)
    return engine, seen


def gradient_residency(rank: int, world: int, drop_from_bytes: int) -> dict:
    from zero3.step import grad_shards

    grad_shards.DROP_PAGES_FROM_BYTES = drop_from_bytes
    engine, seen = accumulated_steps(rank, world, lambda engine: resident_fraction(engine.optimizer.grads.buffer.tensor))
    engine.destroy()
    return seen


def test_gradient_shards_are_resident_only_from_backward_to_step() -> None:
    """A flat lp_grads (a world of one on the CPU: gradients added straight into it; at least
    DROP_PAGES_FROM_BYTES) holds no resident page after a step until the next backward fills it again;
    between the micro-steps of an accumulation it keeps its pages (they hold the sum so far)."""
    for seen in run_ranks(1, gradient_residency, 1 << 20):
        assert seen["built"] == 0.0, seen
        for micro in range(4):
            assert seen[f"backward {micro}"] > 0.9, seen
            assert seen[f"step {micro}"] == (0.0 if micro % 2 == 1 else seen[f"backward {micro}"]), seen


def test_small_gradient_shards_are_zeroed_in_place() -> None:
    """Under DROP_PAGES_FROM_BYTES lp_grads is written with zeros, not handed back: its pages stay resident
    from step to step (a returning page costs a fault at every gradient), and it still starts each
    accumulation at zero (the losses and masters are the suite's reference tests')."""
    seen = run_ranks(1, gradient_residency, 64 << 20)[0]
    assert seen["built"] == 1.0, seen  # torch.zeros wrote it
    assert all(seen[f"step {micro}"] == 1.0 for micro in range(4)), seen


# ---- the heap a backward frees goes back to the OS as the gradient shards fill ------------------------------
def freed_but_resident_in_backward(rank: int, world: int, hand_back: bool) -> dict:
    """Across a forward and the backward up to block 0's gradients (every later block's activations freed,
    their gradients landed): how much this rank's resident anonymous memory grew beyond what glibc's
    allocator has handed out (MiB), and the hand-backs the backward made. lp_grads is one flat buffer here,
    even at 2 ranks (where the engine would make its shards on demand)."""
    import ctypes
    import ctypes.util

    import zero3
    from zero3 import accelerator
    from tests import models
    from zero3.models.gpt import GPT, GPTConfig

    # Deterministic glibc: every block under 32 MiB (each activation here) from the heap, and free() never
    # trims the heap's top, so a freed activation's pages stay resident unless something hands them back.
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3
    assert libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 40) == 1
    config = {"train_micro_batch_size_per_gpu": 32, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 200_000}}
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=8, n_embd=256))
    with models.flat_gradients():
        engine = zero3.initialize(model=model, config=config)[0]
    engine.parts.reducer.heap_return.enabled = hand_back
    engine.parts.reducer.heap_return.every_bytes = 1 << 20  # this model's shards are 6 MiB: several hand-backs
    tokens = torch.randint(0, 65, (32, 65), generator=torch.Generator().manual_seed(rank))
    x, y = tokens[:, :-1], tokens[:, 1:]
    engine.backward(engine(x, y)["loss"])  # a first step: lp_grads' pages and the optimizer state exist after it
    engine.step()
    grown: list[float] = []
    accelerator.release_host_memory()  # both runs start from no freed page resident
    before = _resident_and_allocated()

    def at_block_0(*_: object) -> None:
        after = _resident_and_allocated()
        grown.append(((after[0] - before[0]) - (after[1] - before[1])) / 2**20)

    handle = model.blocks[0].register_full_backward_hook(at_block_0)
    calls = engine.parts.reducer.heap_return.calls
    engine.backward(engine(x, y)["loss"])
    handle.remove()
    seen = {"grown": grown[0], "hand_backs": engine.parts.reducer.heap_return.calls - calls,
            "buckets": len(engine.parts.reducer.buckets)}
    engine.destroy()
    return seen


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])  # a world of one adds each gradient straight to lp_grads
def test_the_backward_hands_the_heap_it_frees_back_as_gradients_land(world: int) -> None:
    """On the CPU the activations are heap blocks: freed by the backward, they would stay resident beside a
    flat lp_grads' fresh pages. zero3 hands them back at the backward's start and as gradients land (at 2
    ranks a flat lp_grads is forced here: the engine makes its shards on demand there, the test below)."""
    kept = run_ranks(world, freed_but_resident_in_backward, False)
    handed_back = run_ranks(world, freed_but_resident_in_backward, True)
    print(f"\nfreed heap still resident at block 0's backward (MiB per rank): "
          f"kept {[k['grown'] for k in kept]}, handed back {[h['grown'] for h in handed_back]}")
    for rank_kept, rank_handed_back in zip(kept, handed_back):
        assert rank_kept["hand_backs"] == 0
        # One at the start, then one per `every_bytes` (1 MiB here) of landed gradients: several before the end.
        assert rank_handed_back["hand_backs"] >= min(4, rank_handed_back["buckets"]), rank_handed_back
        assert rank_kept["grown"] > 40, rank_kept  # the activations' freed pages, kept
        assert rank_handed_back["grown"] < 0.5 * rank_kept["grown"], (rank_kept, rank_handed_back)


def gradient_bytes_held(rank: int, world: int) -> dict:
    """lp_grads' bytes once built, after each backward and each step, and whether the engine hands freed heap
    back."""
    engine, seen = accumulated_steps(rank, world, lambda engine: engine.optimizer.grads.nbytes)
    grads = engine.optimizer.grads
    seen.update(flat=grads.buffer is not None, hand_back=engine.parts.reducer.heap_return.enabled,
                whole=grads.numel * grads.dtype.itemsize, model_state=engine.model_state_bytes()["lp_grads"])
    engine.destroy()
    return seen


def test_gradient_shards_at_two_cpu_ranks_are_held_only_from_backward_to_step() -> None:
    for seen in run_ranks(2, gradient_bytes_held):
        assert not seen["flat"] and not seen["hand_back"], seen
        assert seen["built"] == 0 and seen["model_state"] == 0, seen
        for micro in range(4):
            # Every shard made by the backward (with at most ALIGN_BYTES a chunk ahead of it), kept through
            # the accumulation's first micro-step, dropped by the step that ends it.
            assert seen["whole"] <= seen[f"backward {micro}"] < seen["whole"] + 4096, seen
            assert seen[f"step {micro}"] == (0 if micro % 2 == 1 else seen[f"backward {micro}"]), seen


def test_heap_hand_backs_follow_the_landed_bytes_on_the_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from zero3 import accelerator
    from zero3.passes.host_heap import FreedHeapReturn

    calls: list[int] = []
    monkeypatch.setattr(accelerator, "release_host_memory", lambda: calls.append(1))
    on_cpu = FreedHeapReturn(torch.device("cpu"), every_bytes=10)
    on_cpu.backward_begins()
    on_cpu.landed(4)
    on_cpu.landed(4)
    assert len(calls) == 1  # the backward's start; 8 bytes landed, under the cadence
    on_cpu.landed(4)
    assert len(calls) == 2 and on_cpu.calls == 2
    on_cpu.landed(9)
    assert len(calls) == 2  # the count restarted at the last hand-back
    on_device = FreedHeapReturn(torch.device("cuda", 0), every_bytes=10)
    on_device.backward_begins()
    on_device.landed(100)
    assert len(calls) == 2 and on_device.calls == 0  # the activations are in device memory there
    beside_shards_on_demand = FreedHeapReturn(torch.device("cpu"), every_bytes=10, needed=False)
    beside_shards_on_demand.backward_begins()
    beside_shards_on_demand.landed(100)
    assert len(calls) == 2 and beside_shards_on_demand.calls == 0  # the shards reuse the freed heap
    with pytest.raises(ValueError, match="every_bytes must be positive, got 0"):
        FreedHeapReturn(torch.device("cpu"), every_bytes=0)
