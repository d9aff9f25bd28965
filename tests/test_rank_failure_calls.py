"""One rank's failure between steps is every rank's: initialize's checks, offload_states, reload_states,
load_checkpoint, a plain `loss.backward()` that raises on one rank, and the user's code raising inside a
`GatheredParameters` block on one rank (with and without a modifier rank). The fault is injected on one rank
only; every rank must raise the same exception type naming the failing rank, no rank may hang (each
spawn has a deadline), and nothing may be half-applied: after the failure, training goes on exactly as
in a run that never saw it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks
from zero3.checkpoint import state as checkpoint_state
from zero3.offload import disk as disk_io

FAILING_RANK = 1
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def engine_and_model(config: dict = CONFIG) -> tuple[zero3.ZeroEngine, torch.nn.Module]:
    torch.manual_seed(0)
    model = models.MLP()
    return zero3.initialize(model=model, config=config)[0], model


def train(engine: zero3.ZeroEngine, rank: int, world: int, steps: int, seed: int = 0) -> None:
    for x, y in models.batches("x8", steps, 2 * world, seed=seed):
        engine.backward(engine(x.chunk(world)[rank], y.chunk(world)[rank]))
        engine.step()


def masters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [zero3.safe_get_full_fp32_param(p).clone() for p in model.parameters()]


def caught(action: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        action()
    except Exception as error:  # noqa: BLE001 - what each rank saw is the result
        return type(error).__name__, str(error)
    return None


def on_failing_rank(rank: int, module: Any, name: str, replacement: Any) -> Callable[[], None]:
    """Patch module.name on the failing rank only; returns the undo."""
    original = getattr(module, name)
    if rank == FAILING_RANK:
        setattr(module, name, replacement)
    return lambda: setattr(module, name, original)


def scenario(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}

    # initialize: the tier directory exists on every rank but the failing one (its own disk).
    tier_dir = os.path.join(root, f"tier-rank{rank}") if rank == FAILING_RANK else os.path.join(root, "tier")
    os.makedirs(os.path.join(root, "tier"), exist_ok=True)
    nvme = {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"],
                                            "offload_optimizer": {"device": "nvme", "nvme_path": tier_dir}}}
    out["init"] = caught(lambda: zero3.initialize(model=models.MLP(), config=nvme))

    engine, model = engine_and_model()
    train(engine, rank, world, 2)
    engine.save_checkpoint(os.path.join(root, "ckpt"), tag="two")
    reference = masters(model)

    # offload_states: the failing rank's writes fail; no rank keeps the states offloaded.
    undo = on_failing_rank(rank, disk_io, "_pwrite_all",
                           lambda fd, data, offset, path, write=disk_io._pwrite_all: write(-1, data, offset, path))
    park = os.path.join(root, "park")
    os.makedirs(park, exist_ok=True)
    out["offload"] = caught(lambda: engine.offload_states(device="nvme", nvme_path=park))
    undo()
    out["offloaded_after_failure"] = [state.value for state in engine.offloader.offloaded()]

    # reload_states: the failing rank's reads fail; what failed stays parked there, and a second call works.
    engine.offload_states(device="nvme", nvme_path=park)
    undo = on_failing_rank(rank, disk_io, "_pread_all",
                           lambda fd, into, offset, path, read=disk_io._pread_all: read(-1, into, offset, path))
    out["reload"] = caught(lambda: engine.reload_states())
    undo()
    out["reload_again"] = caught(lambda: engine.reload_states())
    out["masters_after_offloads"] = masters(model)

    # load_checkpoint: the failing rank cannot read the engine file; nothing is loaded anywhere.
    train(engine, rank, world, 1, seed=1)
    before_load = masters(model)

    def unreadable(path: Path, weights_only: bool) -> dict:
        raise PermissionError(13, "Permission denied", str(path / "zero3_engine.pt"))

    undo = on_failing_rank(rank, checkpoint_state, "read_engine_state", unreadable)
    out["load"] = caught(lambda: engine.load_checkpoint(os.path.join(root, "ckpt"), tag="two"))
    undo()
    out["unchanged_by_failed_load"] = all(torch.equal(a, b) for a, b in zip(masters(model), before_load))
    engine.load_checkpoint(os.path.join(root, "ckpt"), tag="two")
    out["loaded"] = all(torch.equal(a, b) for a, b in zip(masters(model), reference))

    # A plain loss.backward() that raises on one rank: the others raise at engine.step().
    def out_of_memory(module: torch.nn.Module, grad_output: Any) -> None:
        if rank == FAILING_RANK:
            raise torch.OutOfMemoryError("injected")

    handle = model.fc2.register_full_backward_pre_hook(out_of_memory)  # before the forward that sets it up
    x, y = models.batches("x8", 1, 2 * world, seed=2)[0]
    loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
    out["plain_backward"] = None
    try:
        loss.backward()
        engine.step()  # the other ranks raise here: their backward ended without them knowing
    except Exception as error:  # noqa: BLE001 - the README's pattern: zero_grad inside the except clause
        out["plain_backward"] = (type(error).__name__, str(error))
        engine.zero_grad()  # tells the others what ended this rank's backward
    handle.remove()
    out["after_plain_backward"] = all(torch.equal(a, b) for a, b in zip(masters(model), reference))
    # The failing rank's own code raises between the engine's calls: in its data, between forward and
    # backward, between backward and step. The others are in the next call by then, and raise there.
    for where in ("data", "loss", "gradients"):
        x, y = models.batches("x8", 1, 2 * world, seed=4)[0]
        failing = rank == FAILING_RANK
        try:
            if failing and where == "data":
                raise ValueError("bad token in this rank's batch")
            loss = engine(x.chunk(world)[rank], y.chunk(world)[rank])
            if failing and where == "loss":
                raise FloatingPointError("the loss is not finite")
            engine.backward(loss)
            if failing and where == "gradients":
                raise RuntimeError("a gradient hook of the user failed")
            engine.step()
            out[f"between {where}"] = None
        except Exception as error:  # noqa: BLE001 - the README's pattern
            out[f"between {where}"] = (type(error).__name__, str(error))
            engine.zero_grad()
        out[f"between {where} unchanged"] = all(torch.equal(a, b) for a, b in zip(masters(model), reference))
    # GatheredParameters: the failing rank's own code raises inside the block, while rank 0 edits under
    # modifier_rank=0, or with no modifier. Every rank raises at the block's exit; no rank keeps the edit.
    for modifier in (0, None):
        def block(modifier: int | None = modifier) -> None:
            with zero3.GatheredParameters(model.fc1.weight, modifier_rank=modifier):
                if rank == 0 and modifier == 0:
                    model.fc1.weight.data.add_(1.0)
                if rank == FAILING_RANK:
                    raise LookupError("the user's code in the block failed")

        out[f"gathered {modifier}"] = caught(block)
        out[f"gathered {modifier} unchanged"] = all(torch.equal(a, b) for a, b in zip(masters(model), reference))
    train(engine, rank, world, 1, seed=3)
    out["trained_on"] = masters(model)
    engine.destroy()

    # The reference for what training on looks like: the checkpoint, then the same last step.
    engine, model = engine_and_model()
    engine.load_checkpoint(os.path.join(root, "ckpt"), tag="two")
    train(engine, rank, world, 1, seed=3)
    out["reference_trained_on"] = masters(model)
    out["reference"] = reference
    engine.destroy()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_failures_between_steps_on_one_rank_are_every_ranks(tmp_path: Path, world: int) -> None:
    results = run_ranks(world, scenario, str(tmp_path))

    def check(key: str, kind: str, where: str, also: str = "") -> None:
        for rank, out in enumerate(results):
            seen = out[key]
            assert seen is not None and seen[0] == kind, (key, rank, seen)
            if rank != FAILING_RANK:
                assert seen[1].startswith(f"rank {FAILING_RANK} failed in {where}: {kind}: "), (key, seen)
                assert also in seen[1], (key, seen)

    check("init", "TierConfigError", "initialize", "does not exist")
    check("offload", "OffloadIOError", "offload_states", "no rank keeps this call's states offloaded")
    check("reload", "OffloadIOError", "reload_states", "call engine.reload_states() again")
    check("load", "PermissionError", "load_checkpoint")
    check("plain_backward", "OutOfMemoryError", "backward")
    check("between data", "ValueError", "forward", "bad token")
    check("between loss", "FloatingPointError", "backward", "not finite")
    check("between gradients", "RuntimeError", "step", "gradient hook")
    check("gathered 0", "LookupError", "GatheredParameters", "no rank kept an edit made in the block")
    check("gathered None", "LookupError", "GatheredParameters", "no rank kept an edit made in the block")
    for rank, out in enumerate(results):
        assert out["offloaded_after_failure"] == [], (rank, out["offloaded_after_failure"])
        assert out["reload_again"] is None, out["reload_again"]
        assert all(torch.equal(a, b) for a, b in zip(out["masters_after_offloads"], out["reference"]))
        assert out["unchanged_by_failed_load"] and out["loaded"]
        assert out["after_plain_backward"]
        for where in ("data", "loss", "gradients"):
            assert out[f"between {where} unchanged"], (rank, where)
        assert out["gathered 0 unchanged"] and out["gathered None unchanged"], rank
        assert all(torch.equal(a, b) for a, b in zip(out["trained_on"], out["reference_trained_on"]))


def params_on_disk(root: str, rank: int, **zero: Any) -> dict:
    """CONFIG with the 16-bit parameters on disk (offload_param nvme, none kept in memory), in a directory
    of this rank's own."""
    tier = os.path.join(root, f"params-rank{rank}")
    os.makedirs(tier, exist_ok=True)
    return {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], **zero,
                                            "offload_param": {"device": "nvme", "nvme_path": tier, "max_in_cpu": 0}}}


def trained_once(config: dict, rank: int, world: int) -> tuple[zero3.ZeroEngine, torch.nn.Module, dict[str, Any]]:
    """An engine after one step, and its masters then (`out["reference"]`)."""
    engine, model = engine_and_model(config)
    train(engine, rank, world, 1)
    return engine, model, {"reference": masters(model)}


def train_on_beside_reference(engine: zero3.ZeroEngine, model: torch.nn.Module, config: dict, rank: int, world: int,
                              out: dict[str, Any]) -> dict[str, Any]:
    """One more step after the fault, and the same two steps on a fresh engine that never saw it."""
    train(engine, rank, world, 1, seed=3)
    out["trained_on"] = masters(model)
    engine.destroy()
    engine, model = engine_and_model(config)
    train(engine, rank, world, 1)
    train(engine, rank, world, 1, seed=3)
    out["reference_trained_on"] = masters(model)
    engine.destroy()
    return out


def failing_fetch_on_enter(rank: int, world: int, root: str) -> dict[str, Any]:
    """The parameters live on disk (offload_param nvme); the failing rank's reads of them fail, every
    time, while it enters a GatheredParameters block (with and without a modifier rank)."""
    config = params_on_disk(root, rank)
    engine, model, out = trained_once(config, rank, world)
    undo = on_failing_rank(rank, disk_io, "_pread_all",
                           lambda fd, into, offset, path, read=disk_io._pread_all: read(-1, into, offset, path))
    for modifier in (0, None, 0):  # the fault persists: the second entry with a modifier fails as the first
        def block(modifier: int | None = modifier) -> None:
            with zero3.GatheredParameters([model.fc1.weight, model.fc2.weight], modifier_rank=modifier):
                model.fc1.weight.data.add_(1.0)

        out.setdefault("entered", []).append(caught(block))
    undo()
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(masters(model), out["reference"]))
    with zero3.GatheredParameters(model.fc1.weight):
        out["whole"] = model.fc1.weight.detach().clone()
    return train_on_beside_reference(engine, model, config, rank, world, out)


@pytest.mark.timeout(240)
def test_a_failing_fetch_on_entering_gathered_parameters_raises_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(2, failing_fetch_on_enter, str(tmp_path))
    for rank, out in enumerate(results):
        assert len(out["entered"]) == 3, out["entered"]
        for seen in out["entered"]:
            assert seen is not None and seen[0] == "OSError", (rank, seen)
            if rank != FAILING_RANK:
                assert seen[1].startswith(f"rank {FAILING_RANK} failed in GatheredParameters: OSError: "), seen
                assert "nothing was gathered" in seen[1], seen
        assert out["unchanged"], rank
        assert torch.equal(out["whole"], out["reference"][0]), rank
        assert all(torch.equal(a, b) for a, b in zip(out["trained_on"], out["reference_trained_on"])), rank


def failing_write_back(rank: int, world: int, root: str) -> dict[str, Any]:
    """The parameters live on disk (offload_param nvme); rank 0 edits fc1's weight and bias (the bias is kept
    gathered: persistent) under GatheredParameters(modifier_rank=0), and the failing rank's writes to its
    parameter files fail, every time, while the block exits (its put-back of the old shard fails too)."""
    config = params_on_disk(root, rank, stage3_param_persistence_threshold=64)
    engine, model, out = trained_once(config, rank, world)
    undo = on_failing_rank(rank, disk_io, "_pwrite_all",
                           lambda fd, data, offset, path, write=disk_io._pwrite_all: write(-1, data, offset, path))

    def block() -> None:
        with zero3.GatheredParameters([model.fc1.weight, model.fc1.bias], modifier_rank=0):
            if rank == 0:
                model.fc1.weight.data.add_(1.0)
                model.fc1.bias.data.add_(1.0)

    out["exited"] = caught(block)
    undo()
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(masters(model), out["reference"]))
    return train_on_beside_reference(engine, model, config, rank, world, out)


@pytest.mark.timeout(240)
def test_a_modifiers_write_back_that_fails_on_one_rank_is_kept_on_none(tmp_path: Path) -> None:
    for rank, out in enumerate(run_ranks(2, failing_write_back, str(tmp_path))):
        seen = out["exited"]
        assert seen is not None and seen[0] == "OSError", (rank, seen)
        if rank != FAILING_RANK:
            assert seen[1].startswith(f"rank {FAILING_RANK} failed in GatheredParameters: OSError: "), seen
            assert "no rank kept the modifier's values" in seen[1], seen
        assert out["unchanged"], rank
        assert all(torch.equal(a, b) for a, b in zip(out["trained_on"], out["reference_trained_on"])), rank
