"""Per-parameter access to the engine's state (API.md's `safe_get_*`).

Local getters return views that share storage with the engine's flat buffers,
except for a state whose home is disk (ZeRO-Infinity): there they return a
copy read from its file (writing to it changes nothing).
"""

from __future__ import annotations

import torch

from zero3.enums import ParamStatus
from zero3.partition.sharded_param import require_sharded
from zero3.partition.unit import unit_of
from zero3.runtime.grad_shards import GradShards
from zero3.runtime.optimizer import master_slots


def param_status(param: torch.Tensor) -> ParamStatus:
    unit = unit_of(require_sharded(param, "param_status"))
    if unit is None:
        raise ValueError("param_status: the parameter's engine was destroyed")
    return unit.status


def safe_get_local_lp_param(param: torch.Tensor) -> torch.Tensor:
    """This rank's 16-bit shard (zero padded to the shard size)."""
    sp = require_sharded(param, "safe_get_local_lp_param")
    assert sp.lp_slot is not None
    return sp.lp_slot.read()


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's fp32 master shard; None for a parameter the optimizer does not train."""
    slots = master_slots(require_sharded(param, "safe_get_local_fp32_param"))
    return slots.hp.read() if slots is not None else None


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's reduced gradient shard (16-bit, fp16 loss scale not removed); None if frozen."""
    sp = require_sharded(param, "safe_get_local_grad")
    grads = GradShards.of(sp)
    return grads.view(sp) if grads is not None else None


def safe_get_local_optimizer_state(param: torch.Tensor, name: str) -> torch.Tensor | None:
    """This rank's shard of an optimizer state ("exp_avg", "exp_avg_sq")."""
    slots = master_slots(require_sharded(param, "safe_get_local_optimizer_state"))
    if slots is None:
        return None
    if name not in slots.moments:
        raise ValueError(f"unknown optimizer state {name!r}; expected one of {sorted(slots.moments)}")
    return slots.moments[name].read()


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 parameter, gathered from every rank's master shard (collective)."""
    sp = require_sharded(param, "safe_get_full_fp32_param")
    unit = unit_of(sp)
    assert unit is not None, f"parameter {sp.name} has no gather unit"
    assert sp.lp_slot is not None
    slots = master_slots(sp)
    shard = slots.hp.read() if slots is not None else sp.lp_slot.read().float()
    full = unit.gather.exact().gather(shard.to(unit.device).contiguous())
    return full[: sp.numel].view(sp.shape)
