"""Lean memory mode: no resident 16-bit shards for the parameters the optimizer trains.

[Note: lean memory]
DeepSpeed's layout, zero3's default, keeps each rank's 16-bit shards between
steps beside their fp32 masters: 2 bytes per parameter / N that only a gather
reads, rewritten from the masters after every step. FSDP2 keeps none: it
casts each block from the fp32 parameter as it gathers. Lean memory mode
(`zero_optimization.lean_memory`) does the same: a unit whose every
parameter has a master of its own (the optimizer trains it, and the masters
are not the shards themselves: a 16-bit engine, or fp32 masters on the host)
keeps no 16-bit shard. Its shard source (`MasterCast`, the unit's `source`,
as a parameter tier's is) casts the masters into a fresh gather input as the
gather starts, with the rounding a step's write would have made, so every
gathered value, and so training, is bit-identical to the default layout.
Each parameter's `lean_master` is the slot it is cast from; readers of a
16-bit shard outside a gather (the accessors, `ds_tensor`,
`iter_full_params`) cast it the same way (`ShardedParam.read_lp`), and
writers reach the master through the parameter's followers. Frozen
parameters have no master to cast from: a unit with one keeps its 16-bit
shards. Parking the masters (`offload_states` of `hp_params`) parks the
lean units' values too, so a forward needs them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam
from zero3.partition.unit import GatherUnit


class MasterCast:
    """A lean unit's shard source: its parameters' fp32 masters, cast to the unit's dtype on `device`.

    `acquire` runs for every gather of a lean unit (the forward's, and the backward's again), so what it
    can know ahead it keeps: per unit, the masters' range when they lie end to end in one buffer (one
    cast), else their slots (one multi-tensor cast)."""

    hands_over_fresh = True  # (each cast is a new tensor: a world of one gathers it as it is)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._plans: dict[GatherUnit, tuple[FlatBuffer, int] | list[Slot]] = {}

    def _plan(self, unit: GatherUnit) -> tuple[FlatBuffer, int] | list[Slot]:
        plan = self._plans.get(unit)
        if plan is None:
            slots = []
            for sp in unit.params:
                assert sp.lean_master is not None, f"{sp.name} is not a lean parameter"
                slots.append(sp.lean_master)
            end_to_end = all(a.buffer is slots[0].buffer and a.offset + a.numel == b.offset
                             for a, b in zip(slots, slots[1:]))
            end_to_end = end_to_end and all(slot.numel == sp.shard_numel for slot, sp in zip(slots, unit.params))
            plan = (slots[0].buffer, slots[0].offset) if end_to_end else slots
            self._plans[unit] = plan
        return plan

    def acquire(self, unit: GatherUnit) -> torch.Tensor:
        shard = torch.empty(unit.shard_numel, dtype=unit.dtype, device=self.device)
        plan = self._plan(unit)
        if isinstance(plan, tuple):
            buffer, offset = plan
            shard.copy_(buffer.view(offset, unit.shard_numel), non_blocking=True)
            return shard
        pieces = list(shard.split([sp.shard_numel for sp in unit.params]))
        torch._foreach_copy_(pieces, [slot.view() for slot in plan], non_blocking=True)
        return shard


def masters_are_shards(compute_dtype: torch.dtype, offload_optimizer: str, offload_param: str) -> bool:
    """Whether an engine's fp32 masters are its parameter shards themselves: an fp32 engine with both
    in the same memory (neither tier offloaded) keeps one copy, not two (see zero3.step.layout's
    [Note: masters that are the shards])."""
    return compute_dtype == torch.float32 and offload_optimizer == "none" and offload_param == "none"


def in_effect(lean_memory: bool, compute_dtype: torch.dtype, offload_optimizer: str, offload_param: str) -> bool:
    """Whether `lean_memory` drops any shard: only where the masters are not the shards themselves."""
    return lean_memory and not masters_are_shards(compute_dtype, offload_optimizer, offload_param)


def lean_units(units: Iterable[GatherUnit], trained: set[ShardedParam]) -> list[GatherUnit]:
    """The units that keep no 16-bit shard in lean memory mode: every parameter of theirs is trained."""
    return [unit for unit in units if all(sp in trained for sp in unit.params)]


def go_lean(units: Iterable[GatherUnit], masters: Mapping[ShardedParam, Slot], device: torch.device) -> None:
    """Let these units' 16-bit shards go: each gather casts them from `masters` (each parameter's fp32
    master slot) from now on. Called once the masters hold the parameters' values."""
    source = MasterCast(device)
    for unit in units:
        for sp in unit.params:
            sp.lean_master = masters[sp]
            sp.lp_slot = None
        unit.lp_slot = None
        unit.source = source
