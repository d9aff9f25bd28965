"""A module `_parameters` dict that reports reads of partitioned parameters.

`module.weight` goes through `Module.__getattr__`, which reads
`module._parameters["weight"]`. Routing that read through here lets a runtime
gather a parameter that is used outside its owner's forward (a tied weight read
by another module, a parent reading a child's weight) at the moment of use.
Iteration (`parameters()`, `state_dict()`) does not call `__getitem__` and so
never triggers a gather.
"""

from __future__ import annotations

from torch import nn

from zero3.partition.sharded_param import ATTR


class ZeroParamDict(dict):
    def __getitem__(self, key: str):  # type: ignore[override]
        param = dict.__getitem__(self, key)
        sp = getattr(param, ATTR, None) if param is not None else None
        if sp is not None and sp.on_access is not None:
            sp.on_access(sp)
        return param


def install(module: nn.Module) -> None:
    if not isinstance(module._parameters, ZeroParamDict):
        module.__dict__["_parameters"] = ZeroParamDict(module._parameters)


def uninstall(module: nn.Module) -> None:
    if isinstance(module._parameters, ZeroParamDict):
        module.__dict__["_parameters"] = dict(module._parameters)
