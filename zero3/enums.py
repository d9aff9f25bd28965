"""Public enums. Member names are DeepSpeed's, so user code ports unchanged."""

from __future__ import annotations

from enum import Enum


class OffloadStateType(str, Enum):
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    optim_states = "optim_states"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDevice(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class ParamStatus(Enum):
    NOT_AVAILABLE = 1
    INFLIGHT = 2
    AVAILABLE = 3


def parse_state(value: object) -> OffloadStateType:
    """An OffloadStateType from itself or its name; ValueError naming the choices otherwise."""
    try:
        return OffloadStateType(value)
    except ValueError:
        raise ValueError(
            f"unknown state {value!r}; expected one of {[s.value for s in OffloadStateType]}"
        ) from None


def parse_states(include: object) -> list[OffloadStateType]:
    """`include` of offload_states: None (every state), one state, or a collection of states."""
    if include is None:
        return list(OffloadStateType)
    if isinstance(include, (str, OffloadStateType)):
        return [parse_state(include)]
    try:
        items = list(include)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(
            f"include must be None, a state or a collection of states, got {type(include).__name__}"
        ) from None
    return list(dict.fromkeys(parse_state(item) for item in items))


def parse_offload_device(value: object) -> OffloadDevice:
    """The target of offload_states: "cpu" or "nvme" ("none" moves nothing, so it is refused)."""
    try:
        device = OffloadDevice(value)
    except ValueError:
        device = None
    if device is None or device is OffloadDevice.none:
        raise ValueError(f"unknown offload device {value!r}; expected 'cpu' or 'nvme' (OffloadDevice.cpu / .nvme)")
    return device
