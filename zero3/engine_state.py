"""The engine's state, one list: every flat buffer that holds model state, by its state type.

The state offloader moves what this list names, fault tolerance sends it to a recovering peer,
`model_state_bytes` adds it up and the estimate predicts the same states by name (`MODEL_STATES`). The
checkpoint reads the same states a parameter at a time instead (it reshards), through each
parameter's slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from zero3.enums import OffloadStateType
from zero3.partition.flat_buffer import FlatBuffer

# Model state, in the order `engine.model_state_bytes()` reports it (what its "total" adds up); the scratch
# bucket (`contiguous_grad_buffer`) is reported beside the total.
BUFFERED_STATES = ("lp_params", "hp_params", "lp_grads", "optim_states")  # held in this list's buffers
MODEL_STATES = (*BUFFERED_STATES, "persistent_params", "hpz_secondary")


class GradientBuffers(Protocol):
    def buffers(self) -> list[FlatBuffer]: ...


class OptimizerBuffers(Protocol):
    """The optimizer's buffers (zero3.step.optimizer's `ZeroOptimizer`)."""

    hp_params: FlatBuffer | None  # the fp32 masters (None: the masters are the 16-bit shards)
    moments: Mapping[str, FlatBuffer]
    grads: GradientBuffers


@dataclass(frozen=True)
class StateBuffer:
    state: OffloadStateType
    key: str  # its name among the engine's buffers, the same on every rank of a shard group
    buffer: FlatBuffer


def state_list(lp_buffers: Sequence[FlatBuffer], optimizer: OptimizerBuffers | None) -> list[StateBuffer]:
    """Every buffer of the engine's model state, as it is now (gradient shards made on demand come and go
    between steps). The scratch bucket is the reducer's, asked directly."""
    out = [StateBuffer(OffloadStateType.lp_params, f"lp_params.{index}", buffer)
           for index, buffer in enumerate(lp_buffers)]
    if optimizer is None:
        return out
    if optimizer.hp_params is not None:
        out.append(StateBuffer(OffloadStateType.hp_params, "hp_params", optimizer.hp_params))
    out += [StateBuffer(OffloadStateType.lp_grads, f"lp_grads.{index}", buffer)
            for index, buffer in enumerate(optimizer.grads.buffers())]
    out += [StateBuffer(OffloadStateType.optim_states, f"optim_states.{name}", buffer)
            for name, buffer in optimizer.moments.items()]
    return out


def buffers_of(entries: Sequence[StateBuffer], state: OffloadStateType) -> list[FlatBuffer]:
    return [entry.buffer for entry in entries if entry.state is state]


def bytes_by_state(entries: Sequence[StateBuffer]) -> dict[str, int]:
    """Bytes held now by each of the four buffered states (0 for one with no buffer)."""
    out = dict.fromkeys(BUFFERED_STATES, 0)
    for entry in entries:
        out[entry.state.value] += entry.buffer.nbytes
    return out
