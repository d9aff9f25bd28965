"""DeepSpeed's `register_external_parameter`: a parameter that a module's forward uses but another
module owns (a tied weight read by attribute, a parameter passed in).

zero3 finds such uses itself (an attribute read of a partitioned parameter inside a forward gathers
it into that forward's frame: zero3.passes.coordinator's `on_access`), so ported code needs no
call. The call is accepted and does what DeepSpeed's does: the parameter is gathered with the
module, every time the module's forward runs, whether or not it reads it.
"""

from __future__ import annotations

import torch
from torch import nn

_ATTR = "_zero3_external_params"


def register_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_external_parameter: expected a module, got {type(module).__name__}")
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(f"register_external_parameter: expected a parameter, got {type(parameter).__name__}")
    external: list[nn.Parameter] = module.__dict__.setdefault(_ATTR, [])
    if not any(p is parameter for p in external):
        external.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: torch.Tensor) -> None:
    external: list[nn.Parameter] = module.__dict__.get(_ATTR, [])
    module.__dict__[_ATTR] = [p for p in external if p is not parameter]


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """What was registered on `module` (the engine gathers these with it)."""
    return list(module.__dict__.get(_ATTR, []))
