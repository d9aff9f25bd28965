"""Which optimizer an engine steps its shards with, and what torch needs to build it.

[Note: any elementwise optimizer]
zero3 steps each rank's flat fp32 shard of every parameter, a sub-group at a
time, so a parameter may be stepped in pieces on several ranks. That gives
the same values as stepping it whole exactly when the update of each element
depends on that element alone (SGD, the Adam family, Adagrad, RMSprop, ...).
So the engine builds the user's optimizer class, with its hyperparameters and
groups, over the shards; torch's own kernels do the math (fused, else
foreach). Which state tensors the class keeps per element (Adam: exp_avg,
exp_avg_sq; SGD with momentum: momentum_buffer) is learned by stepping it
once on a 3-element tensor (`probe`): those become flat buffers that the
offload tiers move and checkpoints save per parameter; scalar state (step
counts) stays in torch's state dict. A class outside torch's elementwise ones
declares itself with `elementwise = True`.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from zero3.config import (
    TORCH_ELEMENTWISE, AdamConfig, LionConfig, MuonConfig, MuonParams, OptimizerConfig, TorchOptimizerConfig,
)
from zero3.optim.lion import Lion
from zero3.optim.muon import MuonAdamW


class OptimizerNotSupportedError(ValueError):
    """An optimizer zero3 cannot step on shards."""


def is_elementwise(cls: type) -> bool:
    """torch's elementwise classes exactly; any other class only by declaring `elementwise = True`
    (a subclass of one of torch's may have changed its update)."""
    if cls.__module__.startswith("torch.optim") and cls.__name__ in TORCH_ELEMENTWISE:
        return True
    return getattr(cls, "elementwise", None) is True


def check_elementwise(cls: type) -> None:
    if not is_elementwise(cls):
        raise OptimizerNotSupportedError(
            f"{cls.__module__}.{cls.__qualname__} is not an elementwise optimizer: zero3 steps each rank's "
            "shard of a parameter on its own, which gives the same result only when every element's update "
            f"depends on that element alone (torch's {', '.join(sorted(TORCH_ELEMENTWISE))}, zero3.optim.Lion; "
            "Muon through the config's 'Muon' type). If its update is elementwise, set `elementwise = True` "
            "on the class."
        )


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and its constructor's keyword arguments; `group_options[i]` overrides them
    for the i-th group of parameters (`groups` lists the client's parameters, when it gave them)."""

    cls: type[torch.optim.Optimizer]
    defaults: Mapping[str, Any]
    groups: list[list[torch.Tensor]] | None = None
    group_options: list[dict[str, Any]] = field(default_factory=list)
    client: torch.optim.Optimizer | None = None
    # Muon's settings: its matrices step through zero3.optim.muon's exchange (not elementwise).
    muon: MuonParams | None = None

    @property
    def name(self) -> str:
        return self.cls.__name__


def from_config(config: OptimizerConfig) -> OptimizerSpec:
    if isinstance(config, AdamConfig):
        p = config.params
        cls = torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam
        return OptimizerSpec(cls, {"lr": p.lr, "betas": tuple(p.betas), "eps": p.eps, "weight_decay": p.weight_decay})
    if isinstance(config, LionConfig):
        p = config.params
        return OptimizerSpec(Lion, {"lr": p.lr, "betas": tuple(p.betas), "weight_decay": p.weight_decay})
    if isinstance(config, MuonConfig):
        return OptimizerSpec(MuonAdamW, {"settings": config.params}, muon=config.params)
    if isinstance(config, TorchOptimizerConfig):
        return OptimizerSpec(getattr(torch.optim, config.type), dict(config.params))
    raise OptimizerNotSupportedError(f"optimizer type {config.type!r} has no elementwise path")


def from_client(optimizer: torch.optim.Optimizer) -> OptimizerSpec:
    """The same class, hyperparameters and groups as a client's optimizer (its state is read later)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_elementwise(type(optimizer))
    defaults = dict(optimizer.defaults)
    groups, options = [], []
    for group in optimizer.param_groups:
        groups.append(list(group["params"]))
        # Only what the group sets apart from the defaults: torch fills every default into each group.
        options.append({k: v for k, v in group.items() if k != "params" and not _same(defaults.get(k, _MISSING), v)})
    return OptimizerSpec(type(optimizer), defaults, groups, options, optimizer)


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    if a is _MISSING:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # values that do not compare: kept per group
        return False


# torch classes whose fused kernel is chosen when the caller chose no implementation, and the device
# types it has one for (None: every device torch's fused optimizers support). Not SGD's: it fails on a
# group where some parameters have a momentum buffer and others not yet. Adagrad's is host-only, and
# torch only says so at the first step.
FUSED_BY_DEFAULT: dict[str, frozenset[str] | None] = {"Adam": None, "AdamW": None, "Adagrad": frozenset({"cpu"})}


def build(spec: OptimizerSpec, groups: list[dict[str, Any]]) -> tuple[torch.optim.Optimizer, bool]:
    """The optimizer over `groups`, with torch's fused kernel for the classes in FUSED_BY_DEFAULT when
    the caller chose no implementation, else its foreach one where it has it; returns (optimizer, fused)."""
    accepts = inspect.signature(spec.cls.__init__).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepts.values())
    kwargs = {k: v for k, v in spec.defaults.items() if open_ended or k in accepts}
    # A default the constructor does not take (AdamW's decoupled_weight_decay) is set on each group.
    fixed = {k: v for k, v in spec.defaults.items() if k not in kwargs}
    groups = [{**fixed, **group} for group in groups]
    chosen = any(kwargs.get(key) is not None for key in ("fused", "foreach")) or any(
        group.get(key) is not None for group in groups for key in ("fused", "foreach"))
    devices = {p.device.type for group in groups for p in group["params"]}
    fused_on = FUSED_BY_DEFAULT.get(spec.cls.__name__, frozenset())
    by_default = spec.cls.__module__.startswith("torch.optim") and spec.cls.__name__ in FUSED_BY_DEFAULT and (
        fused_on is None or devices <= fused_on)
    if by_default and "fused" in accepts and not chosen and not kwargs.get("differentiable"):
        try:
            return spec.cls(groups, **{**kwargs, "fused": True}), True
        except (RuntimeError, ValueError, TypeError):
            pass  # no fused kernel for these options or this device: foreach
    if "foreach" in accepts and not chosen and not kwargs.get("differentiable"):
        # torch picks foreach on its own only for CUDA tensors; a sub-group's pieces are many small
        # tensors on the host too.
        try:
            return spec.cls(groups, **{**kwargs, "foreach": True}), False
        except (RuntimeError, ValueError, TypeError):
            pass
    optimizer = spec.cls(groups, **kwargs)
    fused = bool(optimizer.defaults.get("fused")) or any(bool(group.get("fused")) for group in optimizer.param_groups)
    return optimizer, fused


@dataclass(frozen=True)
class StateLayout:
    """What the optimizer keeps per parameter: `elementwise` tensors of the parameter's shape (flat
    buffers in zero3) and `scalars` (step counts), as torch's state dict names them. `eager` are the
    elementwise states the class creates in its constructor rather than at the first step (Adagrad's
    sum), with the value it fills them with."""

    elementwise: tuple[str, ...]
    scalars: tuple[str, ...]
    eager: Mapping[str, float] = field(default_factory=dict)


def probe(spec: OptimizerSpec, device: torch.device) -> StateLayout:
    """Step the optimizer twice on a 3-element tensor per group (see the Note) and read its state."""
    options = spec.group_options or [{}]
    params = [torch.zeros(3, device=device, requires_grad=True) for _ in options]
    optimizer, _ = build(spec, [{"params": [p], **o} for p, o in zip(params, options)])
    eager: dict[str, float] = {}
    for param in params:
        for key, value in optimizer.state[param].items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                fill = value.flatten()[0].item()
                if not torch.all(value == fill) or eager.get(key, fill) != fill:
                    raise OptimizerNotSupportedError(
                        f"{spec.cls.__qualname__} creates its state {key!r} from the parameters' values in its "
                        "constructor; zero3 builds the optimizer before its shards hold values"
                    )
                eager[key] = fill
    elementwise: dict[str, None] = {}
    scalars: dict[str, None] = {}
    first: dict[tuple[int, str], int] = {}
    for round_ in range(2):
        for param in params:
            param.grad = torch.full_like(param, 0.5)
        optimizer.step()
        for index, param in enumerate(params):
            for key, value in optimizer.state[param].items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    elementwise[key] = None
                    if round_ == 0:
                        first[(index, key)] = value.data_ptr()
                    elif first.get((index, key), value.data_ptr()) != value.data_ptr():
                        raise OptimizerNotSupportedError(
                            f"{spec.cls.__qualname__} replaces its state tensor {key!r} at every step instead of "
                            "updating it in place; zero3 keeps that state in its own flat buffers"
                        )
                else:
                    scalars[key] = None
    return StateLayout(tuple(elementwise), tuple(scalars), eager)
