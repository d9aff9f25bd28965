"""Each parameter's master slots (its fp32 master and elementwise states), where the per-parameter accessors
(zero3.safe_get_local_fp32_param, ...) find them, and what they ask of the optimizer that owns them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from zero3.partition.flat_buffer import Slot
from zero3.partition.sharded_param import ShardedParam


class MasterOwner(Protocol):
    """The optimizer that steps a parameter, as the accessors see it."""

    def before_state_change(self) -> None: ...

    def undo_early_steps(self, why: str) -> None: ...

    def has_state(self, sp: ShardedParam) -> bool: ...


@dataclass
class MasterSlots:
    """One parameter's optimizer-side shards: its fp32 master and its elementwise states ("moments")."""

    hp: Slot
    moments: dict[str, Slot]
    owner: MasterOwner  # the optimizer that steps the parameter (zero3.accessors asks whether it has yet)




def undo_early_step_of(sp: ShardedParam) -> None:
    """Before an accessor reads `sp`'s master or moments, or writes its gradient or master: the backward's
    early steps are undone (zero3.step.early_step), so it sees no speculated value."""
    slots: MasterSlots | None = sp.master_slots
    if slots is not None:
        slots.owner.before_state_change()  # (a write must not reach a save reading the state in place)
        slots.owner.undo_early_steps("an accessor read or wrote the optimizer's state")


def master_slots(sp: ShardedParam) -> MasterSlots | None:
    """The master and moments of `sp` in the optimizer that steps it; None if none does. For a reader
    outside the step (the accessors): settled first (`undo_early_step_of`)."""
    undo_early_step_of(sp)
    slots: MasterSlots | None = sp.master_slots
    return slots
