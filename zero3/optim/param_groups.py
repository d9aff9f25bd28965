"""The optimizer's parameter groups, chosen before the model is partitioned.

What the user hands in (`model_parameters`, a client optimizer's groups) is checked against the model,
and Muon's matrices are split from the rest, while every parameter is still the model's own: a bad
group is refused with nothing partitioned. Groups name their parameters, since partitioning may
replace a parameter built on the meta device by a new one of the same name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zero3.optim.muon import split_groups
from zero3.optim.spec import OptimizerSpec

# Each group's trained parameters, by name, and the group's options.
GroupPlan = list[tuple[list[str], dict[str, Any]]]


def plan_groups(model: nn.Module, model_parameters: Iterable[Any] | None, spec: OptimizerSpec) -> GroupPlan:
    """The trained parameters of each group (`spec`'s client groups, else `model_parameters`, else one
    group of all), each parameter in its first group only, Muon's matrices in groups of their own
    (zero3.optim.muon's `split_groups`) when the optimizer is Muon."""
    if spec.groups is not None:
        model_parameters = [{"params": params, **options} for params, options in zip(spec.groups, spec.group_options)]
    entries = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if entries and all(isinstance(e, dict) for e in entries):
        raw_groups = [(list(e["params"]), {k: v for k, v in e.items() if k != "params"}) for e in entries]
    elif all(isinstance(e, torch.Tensor) for e in entries):
        raw_groups = [(entries, {})]
    else:
        raise TypeError("model_parameters must be parameters or parameter-group dicts with a 'params' key")
    name_of = {id(param): name for name, param in model.named_parameters()}
    seen: set[int] = set()
    groups: list[tuple[list[nn.Parameter], dict[str, Any]]] = []
    for params, options in raw_groups:
        trained: list[nn.Parameter] = []
        for param in params:
            if id(param) not in name_of:
                raise ValueError(
                    f"model_parameters holds a tensor of shape {tuple(param.shape)} that is not a parameter of the model"
                )
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            trained.append(param)
        groups.append((trained, options))
    if spec.muon is not None:
        groups = split_groups(groups, model, spec.muon)  # matrices to Muon, the rest to AdamW
    return [([name_of[id(param)] for param in params], options) for params, options in groups]
