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
