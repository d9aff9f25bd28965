"""One rank's failure in forward or backward is every rank's: each rank raises the failing rank's exception type,
no rank aborts or waits forever, and after `engine.zero_grad()` training goes on bit-identical to a run
that never saw the bad batch (the README's recovery pattern, with the fault on one rank only)."""

from __future__ import annotations

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
STEPS, BAD_STEP, FAILING_RANK = 4, 1, 1
FAULTS = {
    "IndexError": lambda: IndexError("index out of range in self"),
    "OutOfMemoryError": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
}


def run(rank: int, world: int, fault: str | None, where: str = "forward", zero: dict | None = None) -> dict:
    """Train STEPS batches with the README's pattern; with `fault`, the failing rank raises it in `where`
    (fc2's forward, or its backward) on BAD_STEP; without, every rank skips BAD_STEP's batch (the
    reference)."""
    torch.manual_seed(0)
    model = models.MLP()
    config = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], **(zero or {})}}
    engine = zero3.initialize(model=model, config=config)[0]
    inject = [False]

    def maybe_fail(*_: object) -> None:
        if inject[0]:
            raise FAULTS[fault]()  # type: ignore[index]

    if fault is not None and rank == FAILING_RANK:
        if where == "forward":
            model.fc2.register_forward_pre_hook(maybe_fail)
        else:
            model.fc2.register_full_backward_pre_hook(maybe_fail)
    seen: list[tuple[str, str] | None] = []
    for step, (x, y) in enumerate(models.batches("x8", STEPS, 2 * world)):
        if fault is None and step == BAD_STEP:
            seen.append(None)
            continue
        inject[0] = step == BAD_STEP
        try:
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            engine.backward(loss)
        except Exception as error:  # noqa: BLE001 - the pattern under test
            seen.append((type(error).__name__, str(error)))
            engine.zero_grad()
            continue
        engine.step()
        seen.append(None)
    full = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    engine.destroy()
    return {"seen": seen, "full": full}


def faulted_and_reference(rank: int, world: int, faults: list[tuple[str, str]], zero: dict | None = None) -> dict:
    return {
        "faulted": {f"{where} {fault}": run(rank, world, fault, where, zero) for where, fault in faults},
        "reference": run(rank, world, None, zero=zero),
    }


def check_every_rank_raised(results: list[dict], where: str, fault: str) -> None:
    for rank, result in enumerate(results):
        faulted = result["faulted"][f"{where} {fault}"]
        seen = faulted["seen"]
        assert [step for step, what in enumerate(seen) if what is not None] == [BAD_STEP], (rank, seen)
        kind, message = seen[BAD_STEP]
        assert kind == fault, (rank, kind, message)  # the same type on every rank: one except clause
        if rank != FAILING_RANK:
            assert message.startswith(f"rank {FAILING_RANK} failed in {where}: {fault}: "), message
        for after, reference in zip(faulted["full"], result["reference"]["full"]):
            assert torch.equal(after, reference)  # bit-identical to never having seen the batch


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_a_forward_or_backward_failure_on_one_rank_is_every_ranks(world: int) -> None:
    faults = [("forward", "IndexError"), ("backward", "OutOfMemoryError")]
    if world == 3:
        faults = [("forward", "OutOfMemoryError"), ("backward", "IndexError")]
    results = run_ranks(world, faulted_and_reference, faults)
    for where, fault in faults:
        check_every_rank_raised(results, where, fault)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [{"mics_shard_size": 2}, {"zero_hpz_partition_size": 2}], ids=["mics", "hpz"])
def test_one_ranks_failure_reaches_every_rank_of_every_replica_and_secondary_group(zero: dict) -> None:
    """4 ranks in 2 MiCS groups of 2: rank 1's failure is raised on its own group and on the other replica.
    Under hpZ (secondary groups of 2), a failure in backward leaves secondary shards a forward made: the
    ranks forget them together, and training goes on bit-identical."""
    faults = [("forward", "IndexError"), ("backward", "OutOfMemoryError")]
    results = run_ranks(4, faulted_and_reference, faults, zero)
    for where, fault in faults:
        check_every_rank_raised(results, where, fault)


def test_a_failure_that_cannot_be_rebuilt_under_its_type_is_a_rank_failed_error() -> None:
    from zero3.rank_failure import rebuild

    error = rebuild("builtins", "UnicodeDecodeError", "rank 2 failed in forward: UnicodeDecodeError: ...")
    assert isinstance(error, zero3.RankFailedError) and str(error).startswith("rank 2 failed in forward")
    assert isinstance(rebuild("no.such.module", "Gone", "m"), zero3.RankFailedError)
    assert type(rebuild("builtins", "KeyError", "m")) is zero3.RankFailedError  # KeyError('m') reads "'m'"
    assert type(rebuild("torch", "OutOfMemoryError", "m")) is torch.OutOfMemoryError


def run_persistent(rank: int, world: int, kind: str, where: str, root: str, extra: dict) -> dict:
    """`run`'s pattern with a fault that fires on every call from BAD_STEP's forward (or backward) on until
    every rank has raised and called zero_grad: every allocation of a gather output on the failing rank
    ("alloc"), or every read of its parameter tier's files ("read", the parameters on disk). Following the
    pass through to its end must not meet the fault again (zero3.passes.gather_walk's Note)."""
    from zero3.offload import disk as disk_io
    from zero3.partition.collectives import ParamGather
    from zero3.partition.secondary import SecondaryShards

    zero = {"offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}} if kind == "read" else {}
    zero = {**zero, **extra}
    torch.manual_seed(0)
    model = models.MLP()
    engine = zero3.initialize(model=model, config={**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"],
                                                                                   **zero}})[0]
    armed = [False]
    secondary_stand_ins = [0]
    if rank == FAILING_RANK:
        start, read = ParamGather.start, disk_io._pread_all

        def failing_start(self, shard, output=None):  # type: ignore[no-untyped-def]
            if armed[0] and kind == "alloc" and output is None:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
            return start(self, shard, output)

        def failing_read(fd, into, offset, path):  # type: ignore[no-untyped-def]
            return read(-1 if armed[0] and kind == "read" else fd, into, offset, path)

        secondary_start = SecondaryShards.start_gather

        def failing_secondary_start(self, unit):  # type: ignore[no-untyped-def]
            if armed[0] and kind == "alloc" and self.usable(unit):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")
            return secondary_start(self, unit)

        secondary_stand_in = SecondaryShards.start_stand_in

        def counted_secondary_stand_in(self, unit, reserve):  # type: ignore[no-untyped-def]
            secondary_stand_ins[0] += 1
            return secondary_stand_in(self, unit, reserve)

        ParamGather.start = failing_start  # type: ignore[method-assign]
        SecondaryShards.start_gather = failing_secondary_start  # type: ignore[method-assign]
        SecondaryShards.start_stand_in = counted_secondary_stand_in  # type: ignore[method-assign]
        disk_io._pread_all = failing_read
    seen: list[tuple[str, str] | None] = []
    for step, (x, y) in enumerate(models.batches("x8", STEPS, 2 * world)):
        try:
            armed[0] = step == BAD_STEP and where == "forward"
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            armed[0] = armed[0] or (step == BAD_STEP and where == "backward")
            engine.backward(loss)
        except Exception as error:  # noqa: BLE001 - the pattern under test
            seen.append((type(error).__name__, str(error)))
            engine.zero_grad()  # (the fault still fires here)
            armed[0] = False
            continue
        engine.step()
        seen.append(None)
    stand_ins = engine.parts.coordinator.forward_walk.stand_ins + engine.parts.coordinator.backward_walk.stand_ins
    full = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    engine.destroy()
    return {"seen": seen, "full": full, "stand_ins": stand_ins, "secondary_stand_ins": secondary_stand_ins[0],
            "reference": run(rank, world, None, zero=zero) if where == "forward" else None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, kind, extra", [
    (2, "alloc", {}), (2, "read", {}),
    (3, "alloc", {"zero_quantized_weights": True}),  # the stand-ins carry qwZ's wire format
    (4, "alloc", {"zero_hpz_partition_size": 2}),  # the backward's stand-ins are hpZ's secondary gathers
], ids=["alloc", "read", "alloc-3-qwz", "alloc-4-hpz"])
def test_a_fault_that_repeats_while_the_failed_rank_follows_the_pass_through(
    world: int, kind: str, extra: dict, tmp_path,
) -> None:
    expected = {"alloc": "OutOfMemoryError", "read": "OSError"}[kind]
    results = {where: run_ranks(world, run_persistent, kind, where, str(tmp_path), extra)
               for where in ("forward", "backward")}
    for where, per_rank in results.items():
        for rank, result in enumerate(per_rank):
            seen = result["seen"]
            assert [step for step, what in enumerate(seen) if what is not None] == [BAD_STEP], (where, rank, seen)
            assert seen[BAD_STEP][0] == expected, (where, rank, seen[BAD_STEP])
            if rank != FAILING_RANK:
                assert seen[BAD_STEP][1].startswith(f"rank {FAILING_RANK} failed in {where}: {expected}: "), seen
            else:
                assert result["stand_ins"] > 0, where  # it followed through with stand-ins
                if "zero_hpz_partition_size" in extra and where == "backward":
                    assert result["secondary_stand_ins"] > 0
            reference = results["forward"][rank]["reference"]["full"]
            assert all(torch.equal(a, b) for a, b in zip(result["full"], reference)), (where, rank)
