"""Periodic async saves that read the engine's host state in place (zero3.checkpoint.shared_state): the
buffers move into the writer's shared memory at the first save, training is bit for bit what it is without
saves, every tag holds the state of its step even where the state is changed while the writer has yet to
read it (a step, an accessor's write to a trained or a frozen parameter, parking and reloading), a step
waits only until the save has read the state, not until it is published, and parking frees the shared
memory.

The ranks' checkpoint writers start with tests/hooks on their path, whose sitecustomize makes each wait
before it writes (ZERO3_TEST_SLOW_WRITES), or holds each tag once written (ZERO3_TEST_HOLD_SAVES): without
the waits on the engine's side, those tags would hold the changed values.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import zero3
from tests import models
from tests.distributed import run_ranks

HOOKS = str(Path(__file__).parent / "hooks")
GLOBAL_BATCH = 4


def config(variant: str, root: str | None, interval_steps: int = 1, keep_last: int = 10) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 64},
    }
    if variant in ("bf16", "lean"):
        cfg["bf16"] = {"enabled": True}
    if variant == "lean":  # no 16-bit shards: the gathers cast the masters (zero3.partition.lean)
        cfg["zero_optimization"]["lean_memory"] = True
    if root is not None:
        cfg["checkpoint"] = {"dir": root, "interval_steps": interval_steps, "async_save": True,
                             "keep_last": keep_last}
    return cfg


FROZEN = "blocks.1.mlp.0.weight"  # its saved values are its 16-bit shard's


def build(variant: str, root: str | None, interval_steps: int = 1, keep_last: int = 10) -> zero3.ZeroEngine:
    torch.manual_seed(0)
    model = models.TiedTransformer()
    model.get_parameter(FROZEN).requires_grad_(False)
    engine, *_ = zero3.initialize(model=model, config=config(variant, root, interval_steps, keep_last))
    return engine


def raw_state(engine: zero3.ZeroEngine) -> dict[str, torch.Tensor]:
    """This rank's masters and moments, and the frozen parameter's shard, as the buffers hold them now (read
    without the accessors, which would wait for a save in flight)."""
    optimizer = engine.optimizer
    assert optimizer is not None
    out = {}
    for sp in engine.parts.sharded_params:
        slots = optimizer.masters.get(sp)
        if slots is None:
            assert sp.lp_slot is not None
            out[f"{sp.name}/lp"] = sp.lp_slot.read().clone()
            continue
        out[f"{sp.name}/hp"] = slots.hp.read().clone()
        for name, slot in slots.moments.items():
            out[f"{sp.name}/{name}"] = slot.read().clone()
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def shared_buffers(engine: zero3.ZeroEngine) -> list[str]:
    """The engine's buffers that live in the shared state now."""
    optimizer = engine.optimizer
    assert optimizer is not None
    state = engine.saves._state
    buffers = {slot.buffer for slots in optimizer.masters.values() for slot in (slots.hp, *slots.moments.values())}
    return sorted(buffer.name for buffer in buffers if state.holds(buffer))


def tag_state(variant: str, root: str, tag: str) -> dict[str, torch.Tensor]:
    engine = build(variant, None)
    engine.load_checkpoint(root, tag=tag)
    state = raw_state(engine)
    engine.destroy()
    return state


def train_and_save(rank: int, world: int, root: str, variant: str) -> dict[str, Any]:
    data = models.batches("tokens", 3, GLOBAL_BATCH)
    plain = build(variant, None)
    plain_losses = models.train_steps(plain, rank, world, data)
    plain_state = raw_state(plain)
    plain.destroy()

    engine = build(variant, root)
    losses, states, shared = [], {}, []
    for batch in data:
        losses += models.train_steps(engine, rank, world, [batch])  # each step saves global_step<n>
        states[engine.global_steps] = raw_state(engine)
        shared.append(shared_buffers(engine))
    engine.wait_for_checkpoint()
    out = {"same_training": losses == plain_losses and same(raw_state(engine), plain_state), "shared": shared,
           "tags_hold_their_steps": [same(tag_state(variant, root, f"global_step{step}"), state)
                                     for step, state in states.items()]}
    engine.destroy()
    return out


@pytest.mark.parametrize("variant", ["fp32", "bf16", "lean"])
def test_periodic_saves_read_the_state_in_place_and_change_nothing(tmp_path: Path, variant: str) -> None:
    for rank, result in enumerate(run_ranks(2, train_and_save, str(tmp_path), variant)):
        assert result["same_training"], rank
        assert all(result["tags_hold_their_steps"]), (rank, result["tags_hold_their_steps"])
        # The masters and both moments moved at the first save and stayed (the fp32 masters are the shards).
        assert all(len(names) == 3 for names in result["shared"]), (rank, result["shared"])


def changed_while_writing(rank: int, world: int, root: str) -> dict[str, Any]:
    sys.path.insert(0, HOOKS)  # the writers this rank starts import tests/hooks/sitecustomize.py
    os.environ["ZERO3_TEST_SLOW_WRITES"] = "0.5"
    data = models.batches("tokens", 4, GLOBAL_BATCH)
    engine = build("fp32", root)
    states: dict[int, dict[str, torch.Tensor]] = {}
    segments: dict[str, bool] = {}
    # Each save is left writing (its writer asleep) while the next change comes:
    models.train_steps(engine, rank, world, data[:1])  # global_step1
    states[1] = raw_state(engine)
    models.train_steps(engine, rank, world, data[1:2])  # a step: global_step2
    states[2] = raw_state(engine)
    param = next(sp.param for sp in engine.parts.sharded_params if len(sp.shape) == 2)
    full = zero3.safe_get_full_fp32_param(param)  # (waits: it reads the state)
    assert full is not None
    models.train_steps(engine, rank, world, data[2:3])  # global_step3
    states[3] = raw_state(engine)
    zero3.safe_set_full_fp32_param(param, full + 1.0)  # an accessor's write, while global_step3 is written
    zero3.safe_set_full_optimizer_state(param, torch.zeros_like(full), "exp_avg")
    engine.wait_for_checkpoint()
    models.train_steps(engine, rank, world, data[3:4])  # global_step4
    states[4] = raw_state(engine)
    frozen = next(sp for sp in engine.parts.sharded_params if sp.name == FROZEN)
    zero3.safe_set_local_fp32_param(frozen.param, torch.zeros(frozen.shard_numel))  # while global_step4 is written
    # Parked on disk while global_step4 is written (on the CPU, "cpu" is where the states are already): the
    # shared memory is let go.
    engine.offload_states(device="nvme", nvme_path=os.path.join(root, "parked"))
    segments["parked"] = engine.saves._state.segment is not None
    engine.reload_states()
    segments["reloaded"] = engine.saves._state.segment is not None
    engine.save_checkpoint(root, tag="again", async_save=True)  # not periodic: staged, as before
    engine.wait_for_checkpoint()
    out = {"tags_hold_their_steps": [same(tag_state("fp32", root, f"global_step{step}"), state)
                                     for step, state in states.items()],
           "again": same(tag_state("fp32", root, "again"), raw_state(engine)), "segments": segments}
    engine.destroy()
    return out


def test_a_state_changed_while_a_save_reads_it_in_place_waits_for_the_save(tmp_path: Path) -> None:
    for rank, result in enumerate(run_ranks(2, changed_while_writing, str(tmp_path))):
        assert result["tags_hold_their_steps"] == [True] * 4, (rank, result)
        assert result["again"], rank
        assert result["segments"] == {"parked": False, "reloaded": False}, (rank, result["segments"])


def stepped_while_publishing(rank: int, world: int, root: str, gate: str) -> dict[str, Any]:
    sys.path.insert(0, HOOKS)  # the writers this rank starts import tests/hooks/sitecustomize.py
    os.environ["ZERO3_TEST_HOLD_SAVES"] = gate  # rank 0's writer holds each tag, written, until `gate` exists
    data = models.batches("tokens", 3, GLOBAL_BATCH)
    engine = build("fp32", root, interval_steps=2)
    models.train_steps(engine, rank, world, data[:2])  # global_step2, read in place, held before publication
    saved = raw_state(engine)
    models.train_steps(engine, rank, world, data[2:])  # a step: it waits for the read alone
    pending = engine.saves._pending
    seen = {"stepped": engine.global_steps == 3, "save_still_pending": pending is not None and not pending.done(),
            "published": (Path(root) / "global_step2").exists()}
    torch.distributed.barrier()  # every rank has looked before the gate opens
    if rank == 0:
        Path(gate).touch()
    engine.wait_for_checkpoint()
    seen["tag_holds_its_step"] = same(tag_state("fp32", root, "global_step2"), saved)
    engine.destroy()
    return seen


def test_a_step_waits_for_a_save_to_read_the_state_not_to_publish_it(tmp_path: Path) -> None:
    for rank, seen in enumerate(run_ranks(2, stepped_while_publishing, str(tmp_path), str(tmp_path / "gate"))):
        assert seen == {"stepped": True, "save_still_pending": True, "published": False,
                        "tag_holds_its_step": True}, (rank, seen)
