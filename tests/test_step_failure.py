"""One rank's failure in the optimizer step is every rank's, and the step lands on every rank or on none.

Each case trains with the README's recovery pattern (forward, backward and step in one `try`; `except`:
`engine.zero_grad(); continue`) and injects its fault on one rank only, at BAD_STEP. Every rank must raise
the same exception type, no rank may abort or hang (each spawn has a deadline), and after recovery the
fp32 masters must be equal on every rank and bit-identical to the reference: a run that skipped the batch
when the step was applied nowhere, a run that trained on it when the step landed everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.offload import disk as disk_io

STEPS, BAD_STEP, FAILING_RANK = 4, 2, 1


def config(zero: dict, optimizer: str = "AdamW", top_level: dict | None = None) -> dict:
    return {**(top_level or {}),
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": optimizer, "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1500, **zero},
        "aio": {"block_size": 4096, "queue_depth": 4, "thread_count": 2},
    }


def tier(root: str, name: str) -> dict:
    nvme = {"device": "nvme", "nvme_path": root}
    return {
        "memory": {},
        "bf16_grads": {},
        "muon": {},
        "optimizer_nvme": {"offload_optimizer": {**nvme, "buffer_count": 2}},
        "params_nvme": {"offload_param": {**nvme, "max_in_cpu": 0, "buffer_count": 2}},
    }[name]


# ---- the faults, each armed on the failing rank for BAD_STEP's engine.step() only ----------------------
def out_of_memory_taking_the_step_memory(engine: zero3.ZeroEngine) -> Callable[[], None]:
    """An allocation failure where the step takes its working memory (the fp32 gradients it steps from)."""
    optimizer = engine.optimizer
    take = optimizer._fp32_grads

    def failing(numel: int, device: torch.device) -> torch.Tensor:
        raise torch.OutOfMemoryError(f"injected: tried to allocate {numel * 4} bytes")

    optimizer._fp32_grads = failing  # type: ignore[method-assign]
    return lambda: setattr(optimizer, "_fp32_grads", take)


def failing_disk_writes(engine: zero3.ZeroEngine) -> Callable[[], None]:
    """Every tier file write fails, with a real EBADF from the real write."""
    write = disk_io._pwrite_all
    disk_io._pwrite_all = lambda fd, data, offset, path: write(-1, data, offset, path)  # type: ignore[assignment]
    return lambda: setattr(disk_io, "_pwrite_all", write)


def failing_update(engine: zero3.ZeroEngine) -> Callable[[], None]:
    """Torch's optimizer raises inside its update (a bug in an optimizer's code, say)."""
    torch_optimizer = engine.optimizer.optimizer

    def failing(*args: Any, **kwargs: Any) -> None:
        raise ValueError("injected: the update failed")

    torch_optimizer.step = failing  # type: ignore[method-assign]
    return lambda: delattr(torch_optimizer, "step")


def out_of_memory_in_newton_schulz(engine: zero3.ZeroEngine) -> Callable[[], None]:
    """Muon's orthogonalization runs out of memory on the rank that owns a matrix (after the exchange
    that brought it the shards, before the one that returns the update)."""
    from zero3.optim import muon

    orthogonalize = muon._zeropower_via_newtonschulz

    def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("injected: Newton-Schulz")

    muon._zeropower_via_newtonschulz = failing  # type: ignore[assignment]
    return lambda: setattr(muon, "_zeropower_via_newtonschulz", orthogonalize)


FAULTS = {
    "newton-schulz": out_of_memory_in_newton_schulz,
    "step memory": out_of_memory_taking_the_step_memory,
    "disk": failing_disk_writes,
    "update": failing_update,
}


def run(rank: int, world: int, root: str, tier_name: str, fault: str | None, skip_bad_batch: bool) -> dict:
    torch.manual_seed(0)
    model = models.MLP()
    optimizer = "Muon" if tier_name == "muon" else "AdamW"
    # fp32 gradients in memory are stepped in place (ZeroOptimizer.grads_in_place): the step takes working
    # memory for its fp32 gradients where they are accumulated in another dtype.
    top_level = {"data_types": {"grad_accum_dtype": "bf16"}} if tier_name == "bf16_grads" else None
    engine = zero3.initialize(model=model, config=config(tier(root, tier_name), optimizer, top_level))[0]
    seen: list[tuple[str, str, Any] | None] = []
    after_failure: str | None = None
    for step, (x, y) in enumerate(models.batches("x8", STEPS, 2 * world)):
        if skip_bad_batch and step == BAD_STEP:
            seen.append(None)
            continue
        if fault == "update" and step == BAD_STEP:
            engine.save_checkpoint(f"{root}/ckpt", tag="before")
        disarm = None
        try:
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            engine.backward(loss)
            if fault is not None and step == BAD_STEP and rank == FAILING_RANK:
                disarm = FAULTS[fault](engine)
            engine.step()
            seen.append(None)
        except Exception as error:  # noqa: BLE001 - the pattern under test
            seen.append((type(error).__name__, str(error), getattr(error, "step_applied", None)))
            engine.zero_grad()
            if fault == "update":  # the ranks' states differ: the engine says so until a checkpoint is loaded
                try:
                    engine(x.chunk(world)[rank], y.chunk(world)[rank])
                except RuntimeError as refused:
                    after_failure = str(refused)
                engine.load_checkpoint(f"{root}/ckpt", tag="before")
        finally:
            if disarm is not None:
                disarm()
    full = [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]
    local = [zero3.safe_get_local_fp32_param(p).clone() for p in model.parameters()]
    engine.destroy()
    return {"seen": seen, "full": full, "local": local, "after_failure": after_failure}


CASES = [  # (tier, fault, whether the step lands everywhere)
    ("bf16_grads", "step memory", False),
    ("optimizer_nvme", "disk", False),
    ("params_nvme", "disk", True),
    ("memory", "update", False),
    ("muon", "newton-schulz", False),
]


def scenario(rank: int, world: int, root: str, cases: list[tuple[str, str, bool]]) -> dict:
    out: dict[str, Any] = {}
    for tier_name, fault, _ in cases:
        out[f"{tier_name} {fault}"] = run(rank, world, f"{root}/{tier_name}-{fault}", tier_name, fault, False)
    for tier_name in sorted({tier_name for tier_name, _, _ in cases}):
        for skip in (False, True):
            out[f"{tier_name} reference skip={skip}"] = run(rank, world, f"{root}/{tier_name}-ref", tier_name, None,
                                                          skip)
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
def test_a_step_that_fails_on_one_rank_fails_on_every_rank_and_lands_on_all_or_none(
    tmp_path: Path, world: int
) -> None:
    cases = CASES if world == 2 else [CASES[0], CASES[1], CASES[4]]
    for tier_name, fault, _ in cases:
        (tmp_path / f"{tier_name}-{fault}").mkdir()
    for tier_name in {tier_name for tier_name, _, _ in cases}:
        (tmp_path / f"{tier_name}-ref").mkdir()
    results = run_ranks(world, scenario, str(tmp_path), cases)
    for tier_name, fault, lands in cases:
        name = f"{tier_name} {fault}"
        expected_type = {"step memory": "OutOfMemoryError", "disk": "StepIOError", "update": "ValueError",
                         "newton-schulz": "OutOfMemoryError"}[fault]
        for rank, result in enumerate(results):
            seen = result[name]["seen"]
            assert [step for step, what in enumerate(seen) if what is not None] == [BAD_STEP], (name, rank, seen)
            kind, message, applied = seen[BAD_STEP]
            assert kind == expected_type, (name, rank, kind, message)
            if rank != FAILING_RANK:
                assert message.startswith(f"rank {FAILING_RANK} failed in step: {expected_type}: "), (name, message)
            if fault == "disk":
                assert applied is lands, (name, rank, message)
                assert "Bad file descriptor" in message and f"zero3-rank{FAILING_RANK}-" in message, message
            if fault == "update":
                assert "load the last checkpoint" in message or rank == FAILING_RANK, message
                assert "load the last checkpoint" in result[name]["after_failure"], result[name]["after_failure"]
            elif rank != FAILING_RANK:
                assert ("(the step was applied on no rank)" in message) is not lands, (name, message)
            reference = result[f"{tier_name} reference skip={not lands}"]
            for after, expected in zip(result[name]["full"], reference["full"]):
                assert torch.equal(after, expected), (name, rank)  # as if the step never ran, or ran everywhere
            for after, expected in zip(result[name]["local"], reference["local"]):
                assert torch.equal(after, expected), (name, rank)  # this rank's own shard too
