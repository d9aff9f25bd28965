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
