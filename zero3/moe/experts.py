"""A model's expert layers, found from the model itself.

A Hugging Face model names them in its expert-parallel plan (transformers 5's
`config.base_model_ep_plan`): the module a pattern marks `ep_dispatch_experts`
(`layers.*.mlp.experts`) holds every expert of a layer as 3-D weights whose first
dimension is the expert (`gate_up_proj`, `down_proj`, and gpt-oss's 2-D biases),
the ones marked `grouped_gemm`. Patterns are relative to the base model
(`base_model_prefix`), and `*` stands for one name (a layer's index). So every
family with a plan is found, whatever its preset name in DeepSpeed's AutoEP;
layers a plan does not reach (DeepSeek-V3's first dense layers, shared experts,
the router) stay dense. A model of one's own marks its experts module with
`mark_experts`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from zero3.config.base import ConfigError
from zero3.shard_mesh import TopologyError, expert_group_size

DISPATCH = "ep_dispatch_experts"  # the plan's style for a module holding a layer's experts
GROUPED = "grouped_gemm"  # ... and for the expert weights in it
_MARK = "_zero3_experts"


@dataclass(frozen=True)
class ExpertLayer:
    """One layer's experts: the module holding them and its expert weights, each `[num_experts, ...]`."""

    name: str  # the module's name in the model
    module: nn.Module
    num_experts: int
    weights: tuple[str, ...]  # the module's own parameter names that hold one slice per expert


def mark_experts(module: nn.Module, weights: tuple[str, ...] | None = None) -> nn.Module:
    """Mark `module` as one layer's experts (for a model without a Hugging Face plan): its own parameters
    `weights` (default: all of them) each hold one slice per expert along their first dimension. Returns
    the module."""
    names = tuple(name for name, _ in module.named_parameters(recurse=False)) if weights is None else tuple(weights)
    if not names:
        raise ValueError(f"mark_experts: {type(module).__name__} has no parameters of its own to hold experts")
    missing = [name for name in names if not isinstance(getattr(module, name, None), nn.Parameter)]
    if missing:
        raise ValueError(f"mark_experts: {type(module).__name__} has no parameter {missing[0]!r}")
    setattr(module, _MARK, names)
    return module


def find_experts(model: nn.Module) -> list[ExpertLayer]:
    """Every expert layer of `model`, in module order: those its Hugging Face expert-parallel plan names and
    those marked with `mark_experts`. Raises ValueError where a layer's weights disagree on the number of
    experts."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    modules = [_pattern(key) for key, style in plan.items() if style == DISPATCH]
    grouped = [(_pattern(owner), weight) for owner, weight in
               (key.rsplit(".", 1) for key, style in plan.items() if style == GROUPED)]
    prefix = _base_prefix(model)
    found: list[ExpertLayer] = []
    for name, module in model.named_modules():
        weights: tuple[str, ...] | None = getattr(module, _MARK, None)
        relative = name[len(prefix):] if name.startswith(prefix) else None
        if weights is None and relative is not None and any(pattern.fullmatch(relative) for pattern in modules):
            weights = tuple(weight for owner, weight in grouped
                            if owner.fullmatch(relative) and isinstance(getattr(module, weight, None), nn.Parameter))
        if weights:
            found.append(_layer(name, module, weights))
    return found


def check_autoep_size(layers: list[ExpertLayer], autoep_size: int, world_size: int, local_world_size: int) -> None:
    """Refuse an expert-parallel size that cannot lay the experts out: a ConfigError naming the key and the
    numbers (nothing is changed; every rank reaches the same verdict)."""
    try:
        expert_group_size(autoep_size, world_size, local_world_size)
    except TopologyError as error:
        raise ConfigError(str(error)) from None
    if not layers:
        raise ConfigError(
            "expert_parallel is enabled, but the model has no expert layers: none is named by a Hugging Face "
            "expert-parallel plan (config.base_model_ep_plan) or marked with zero3.moe.mark_experts")
    uneven = sorted({layer.num_experts for layer in layers if layer.num_experts % autoep_size})
    if uneven:
        raise ConfigError(f"expert_parallel.autoep_size={autoep_size} does not divide the number of experts of "
                          f"every layer ({', '.join(map(str, uneven))}): each expert-parallel rank owns a whole share")


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(r"[^.]+".join(re.escape(part) for part in key.split("*")))


def _base_prefix(model: nn.Module) -> str:
    """The base model's name inside `model` and a dot ("model." in a ...ForCausalLM), or "" if it is the base."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    return f"{prefix}." if isinstance(base, nn.Module) and base is not model else ""


def _shape(param: torch.Tensor) -> torch.Size:
    return getattr(param, "ds_shape", param.shape)  # a partitioned parameter's whole shape


def _layer(name: str, module: nn.Module, weights: tuple[str, ...]) -> ExpertLayer:
    shapes = {weight: tuple(_shape(getattr(module, weight))) for weight in weights}
    counts = {shape[0] if shape else None for shape in shapes.values()}
    if len(counts) != 1 or None in counts:
        described = ", ".join(f"{weight} {list(shape)}" for weight, shape in shapes.items())
        raise ValueError(f"expert layer {name or type(module).__name__!r}: its expert weights do not share a "
                         f"first dimension (the expert): {described}")
    return ExpertLayer(name, module, counts.pop(), weights)
