"""Per-parameter access to the engine's state: DeepSpeed's `safe_*` family, same names and signatures.

Local getters return views that share storage with the engine's flat buffers,
except for a state whose home is disk (ZeRO-Infinity) or that `offload_states`
parked on disk: there they return a copy read from its file (writing to it
changes nothing). Full getters gather every rank's shard (collective: call
them on every rank); like DeepSpeed's, they answer None for a parameter the
optimizer does not train.

Setters write through every copy the engine keeps, so the next forward and
the next step see the value: the fp32 master, the 16-bit shard (in memory or
in its disk tier) and a copy gathered now (a persistent parameter). A full
setter takes the whole value on every rank (each keeps its shard); a local
setter takes this rank's shard (`ds_tensor`'s size), on every rank (a
persistent parameter is gathered again at the next forward). A state parked
by `offload_states` is refused: reload it first.
"""

from __future__ import annotations

import torch

from collections.abc import Callable, Iterable

from zero3.enums import ParamStatus
from zero3.partition.flat_buffer import Slot, StateOffloadedError
from zero3.partition.sharded_param import ShardedParam, require_sharded
from zero3.partition.unit import UnitState, unit_of
from zero3.step.grad_shards import GradShards
from zero3.step.masters import master_slots, undo_early_step_of


def param_status(param: torch.Tensor) -> ParamStatus:
    unit = unit_of(require_sharded(param, "param_status"))
    if unit is None:
        raise ValueError("param_status: the parameter's engine was destroyed")
    return unit.status


def _read(slot: Slot) -> torch.Tensor:
    """The slot's values wherever they are: a view in memory, a copy from a disk tier or a parked file."""
    buffer = slot.buffer
    if buffer.parked and buffer.file is not None and buffer.store is None:
        into = torch.empty(slot.numel, dtype=buffer.dtype)
        buffer.read_into(slot.offset, into)
        return into
    return slot.read()


def _refuse_parked(slots: Iterable[Slot | None], what: str) -> None:
    """A setter writes every copy or none: a state parked by offload_states is refused before any write."""
    for slot in slots:
        if slot is not None and slot.buffer.parked and slot.buffer.store is None:
            raise StateOffloadedError(
                f"{what}: state {slot.buffer.state!r} is offloaded by offload_states(); "
                "call engine.reload_states() first"
            )


def _write(slot: Slot, values: torch.Tensor, what: str) -> None:
    _refuse_parked([slot], what)
    slot.write(values)


def _gather_full(sp: ShardedParam, shard: torch.Tensor) -> torch.Tensor:
    unit = unit_of(sp)
    if unit is None:
        raise ValueError(f"parameter {sp.name}: its engine was destroyed")
    full = unit.gather.exact().gather(shard.to(unit.device).contiguous())
    return full[: sp.numel].view(sp.shape)


def _full_value(sp: ShardedParam, value: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != sp.numel:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what}: {sp.name} has shape {tuple(sp.shape)}, the value {got}")
    return value.detach()


def _local_value(sp: ShardedParam, value: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != sp.shard_numel:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{what}: this rank's shard of {sp.name} has {sp.shard_numel} elements (ds_tensor's size), the value {got}"
        )
    return value.detach().reshape(-1)


def _moment(sp: ShardedParam, name: str, what: str) -> Slot | None:
    slots = master_slots(sp)
    if slots is None:
        return None
    if name not in slots.moments:
        raise ValueError(f"{what}: unknown optimizer state {name!r}; expected one of {sorted(slots.moments)}")
    return slots.moments[name]


# ---- local ----------------------------------------------------------------------------------------------
def safe_get_local_lp_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's 16-bit shard (zero padded to the shard size)."""
    sp = require_sharded(param, "safe_get_local_lp_param")
    if sp.lp_slot is None:  # lean memory mode: the master, cast (zero3.partition.lean)
        assert sp.lean_master is not None
        return _read(sp.lean_master).to(sp.dtype)
    return _read(sp.lp_slot)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fp32 master shard; None for a parameter the optimizer does not train."""
    slots = master_slots(require_sharded(param, "safe_get_local_fp32_param"))
    return _read(slots.hp) if slots is not None else None


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's shard of the parameter: its master and its 16-bit shard (for a frozen parameter, the
    16-bit shard). Local: it may be called on one rank alone. A copy gathered now (a persistent
    parameter's) holds the other ranks' shards too: the next forward agrees on one flag, and every rank
    gathers it again (zero3.passes.coordinator), so the setting rank never gathers alone."""
    sp = require_sharded(param, "safe_set_local_fp32_param")
    shard = _local_value(sp, value, "safe_set_local_fp32_param")
    slots = master_slots(sp)
    _refuse_parked([sp.lp_slot, slots.hp if slots is not None else None], "safe_set_local_fp32_param")
    if slots is not None:
        slots.hp.write(shard.float())
    if sp.lp_slot is not None:  # (none in lean memory mode: the master is the shard's home)
        sp.lp_slot.write(shard)
    unit = unit_of(sp)
    if unit is not None:
        unit.shards_changed()


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's reduced gradient shard (16-bit, fp16 loss scale not removed); None if frozen."""
    sp = require_sharded(param, "safe_get_local_grad")
    grads = GradShards.of(sp)
    return grads.read(sp) if grads is not None else None


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """This rank's shard of the reduced gradient (the next step uses it); a frozen parameter has none."""
    sp = require_sharded(param, "safe_set_local_grad")
    grads = GradShards.of(sp)
    if grads is None:
        return
    undo_early_step_of(sp)  # (the backward's early steps used the gradients as they were)
    grads.view(sp).copy_(_local_value(sp, value, "safe_set_local_grad"))
    grads.mark_arrived(sp)


def safe_get_local_optimizer_state(param: torch.Tensor, name: str) -> torch.Tensor | None:
    """This rank's shard of an optimizer state ("exp_avg", "exp_avg_sq")."""
    slot = _moment(require_sharded(param, "safe_get_local_optimizer_state"), name, "safe_get_local_optimizer_state")
    return _read(slot) if slot is not None else None


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """This rank's shard of an optimizer state (DeepSpeed's argument order: value, then the state's name)."""
    sp = require_sharded(param, "safe_set_local_optimizer_state")
    slot = _moment(sp, name, "safe_set_local_optimizer_state")
    if slot is not None:
        _require_stepped(sp, "safe_set_local_optimizer_state")
        _write(slot, _local_value(sp, value, "safe_set_local_optimizer_state").float(), "safe_set_local_optimizer_state")


def _require_stepped(sp: ShardedParam, what: str) -> None:
    slots = master_slots(sp)
    if slots is not None and not slots.owner.has_state(sp):
        raise ValueError(
            f"{what}: {sp.name} has no optimizer state before its first step (torch creates it then, as the "
            "optimizer class does); set it after a step"
        )


# ---- full (collective) ----------------------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 parameter, gathered from every rank's master shard (collective); None for a
    parameter the optimizer does not train (as DeepSpeed's)."""
    sp = require_sharded(param, "safe_get_full_fp32_param")
    slots = master_slots(sp)
    if slots is None:
        return None
    return _gather_full(sp, _read(slots.hp))


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """The whole parameter, given on every rank: each rank's shard goes to its master and its 16-bit
    shard, and a copy gathered now takes the value (for a frozen parameter, the 16-bit copies)."""
    sp = require_sharded(param, "safe_set_full_fp32_param")
    full = _full_value(sp, value, "safe_set_full_fp32_param")
    undo_early_step_of(sp)
    _refuse_parked([sp.lp_slot, *sp.followers], "safe_set_full_fp32_param")
    sp.write_full(full.float())
    unit = unit_of(sp)
    if unit is not None and unit.state is UnitState.UNSHARDED:
        with torch.no_grad():
            sp.param.data.copy_(full.view(sp.shape))


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole reduced gradient in fp32, gathered (collective); None if frozen."""
    sp = require_sharded(param, "safe_get_full_grad")
    grads = GradShards.of(sp)
    if grads is None:
        return None
    return _gather_full(sp, grads.read(sp).float())


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """The whole reduced gradient, given on every rank (the next step uses it); a frozen parameter has none."""
    sp = require_sharded(param, "safe_set_full_grad")
    grads = GradShards.of(sp)
    if grads is None:
        return
    undo_early_step_of(sp)  # (the backward's early steps used the gradients as they were)
    grads.view(sp).copy_(sp.shard_of(_full_value(sp, value, "safe_set_full_grad")))
    grads.mark_arrived(sp)


def safe_get_full_optimizer_state(param: torch.Tensor, name: str) -> torch.Tensor | None:
    """The whole optimizer state `name` in fp32, gathered (collective); None if frozen."""
    sp = require_sharded(param, "safe_get_full_optimizer_state")
    slot = _moment(sp, name, "safe_get_full_optimizer_state")
    return _gather_full(sp, _read(slot)) if slot is not None else None


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """The whole optimizer state `name`, given on every rank (DeepSpeed's argument order)."""
    sp = require_sharded(param, "safe_set_full_optimizer_state")
    slot = _moment(sp, name, "safe_set_full_optimizer_state")
    if slot is not None:
        _require_stepped(sp, "safe_set_full_optimizer_state")
        full = _full_value(sp, value, "safe_set_full_optimizer_state")
        _write(slot, sp.shard_of(full.float()), "safe_set_full_optimizer_state")


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.Tensor], update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """For each parameter with a gradient: its whole gradient becomes `update_func(full_grad, param)`
    (collective: every rank, the same list)."""
    for param in param_list:
        full = safe_get_full_grad(param)
        if full is not None:
            safe_set_full_grad(param, update_func(full, param))
