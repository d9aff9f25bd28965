"""DeepSpeed's module paths, each bound to zero3's own object: `import zero3.deepspeed as deepspeed`.

A DeepSpeed training script ports by changing its import line; every name below is zero3's (no DeepSpeed
code is copied). Where zero3 has no counterpart, the name raises an error that says what to use instead.
Nothing here registers itself as `deepspeed` in `sys.modules`: a library that looks for DeepSpeed (Hugging
Face's integration) would take zero3 for it and reach into DeepSpeed's internals.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

import zero3
from zero3 import init_distributed
from zero3.config import Zero3Config
from zero3.config.loading import read_config_file
from zero3.engine.engine import ZeroEngine as DeepSpeedEngine
from zero3.deepspeed import accelerator, checkpointing, comm, ops, runtime, utils
from zero3.deepspeed.runtime import lr_schedules, zero

__all__ = [
    "DeepSpeedEngine", "accelerator", "add_config_arguments", "checkpointing", "comm", "init_distributed",
    "initialize", "lr_schedules", "ops", "runtime", "utils", "zero",
]


def initialize(
    args: argparse.Namespace | None = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: dict | str | None = None,
    mesh_param: Any = None,
    config_params: dict | None = None,
) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's `deepspeed.initialize`: (engine, optimizer, dataloader, lr_scheduler) from zero3.

    The config comes from `config`, else `config_params`, else `args.deepspeed_config` (DeepSpeed's order).
    A callable `optimizer` (DeepSpeed's optimizer factory, called with the parameters) is called with the
    model's parameters first.
    """
    if mpu is not None:
        raise NotImplementedError(
            "deepspeed.initialize(mpu=...): zero3 has no model-parallel unit; it shards over data-parallel "
            "ranks (pass mesh= to zero3.initialize for a 2-D replicate x shard layout)")
    if mesh_param is not None:
        raise NotImplementedError("deepspeed.initialize(mesh_param=...): pass a torch DeviceMesh as "
                                  "zero3.initialize(..., mesh=init_device_mesh(...)) instead")
    if model is None:
        raise ValueError("deepspeed.initialize: model is required")
    if config is None and config_params is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize: pass the config as `config` or `config_params`, not both")
    chosen = config if config is not None else config_params
    if chosen is None:
        raise ValueError("deepspeed.initialize: no config: pass config=..., config_params=..., or args with "
                         "--deepspeed_config (deepspeed.add_config_arguments adds it)")
    if dist_init_required is not False and distributed_port is not None and not dist.is_initialized():
        init_distributed(distributed_port=distributed_port)  # else zero3.initialize joins the default group
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        # DeepSpeed's optimizer factory: called with the parameters it is to optimize.
        model_parameters = list(model_parameters) if model_parameters is not None else list(model.parameters())
        optimizer = optimizer(model_parameters)
    return zero3.initialize(model=model, model_parameters=model_parameters, config=deepspeed_defaults(chosen),
                            optimizer=optimizer, lr_scheduler=lr_scheduler, training_data=training_data,
                            collate_fn=collate_fn)


def deepspeed_defaults(config: dict | str | os.PathLike[str] | Zero3Config) -> dict | Zero3Config:
    """`config` with DeepSpeed's defaults where zero3's differ and the config says nothing: the forward passes
    its inputs as given (`auto_cast` false in `bf16` and `fp16`: DeepSpeed casts only under `fp16.auto_cast`),
    so a script ported by its import line computes what it did. A `Zero3Config` is zero3's own: kept as it is."""
    if isinstance(config, Zero3Config):
        return config
    data = read_config_file(config) if isinstance(config, (str, os.PathLike)) else copy.deepcopy(config)
    if not isinstance(data, dict):
        return data  # zero3.initialize names what it expected
    for section in ("bf16", "fp16"):
        if isinstance(data.get(section), dict):
            data[section].setdefault("auto_cast", False)
    return data


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's `--deepspeed` and `--deepspeed_config` (and the old `--deepscale` names) on `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed (zero3: the engine is always on; kept for scripts that pass it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
