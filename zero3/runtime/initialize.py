"""`zero3.initialize`: the one call that turns a model into an engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from zero3 import accelerator, comm
from zero3.config import Zero3Config, load_config
from zero3.partition.mesh import ShardMesh
from zero3.runtime.engine import ZeroEngine
from zero3.runtime.optimizer import ZeroOptimizer


def initialize(
    model: nn.Module,
    model_parameters: Iterable[Any] | None = None,
    config: dict | str | Zero3Config | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    config_params: dict | None = None,
    device: torch.device | str | None = None,
) -> tuple[ZeroEngine, ZeroOptimizer | None, None, Any]:
    """Returns (engine, optimizer, dataloader, lr_scheduler), as DeepSpeed does.

    The optimizer comes from the config's `optimizer` section; a client
    optimizer instance cannot be sharded and is refused. `lr_scheduler` may be
    a scheduler factory taking the torch optimizer. `training_data` is not
    supported (the dataloader slot is always None). `device` picks the device
    as `zero3.Init` does (see `zero3.accelerator.resolve_device`).
    """
    if config is not None and config_params is not None:
        raise ValueError("pass the config as `config` or `config_params`, not both")
    cfg = load_config(config if config is not None else (config_params or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None:
        raise ValueError(
            "zero3 builds its sharded optimizer from the config's 'optimizer' section; "
            f"a client optimizer ({type(optimizer).__name__}) cannot be sharded"
        )
    if training_data is not None:
        raise ValueError("training_data is not supported: build your DataLoader yourself")
    device = accelerator.resolve_device(device)
    accelerator.set_device(device)
    comm.init_distributed(device)
    engine = ZeroEngine(model, cfg, comm.Communicator(), ShardMesh.of_group(), device, model_parameters, lr_scheduler)
    return engine, engine.optimizer, None, engine.lr_scheduler
