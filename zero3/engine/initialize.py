"""`zero3.initialize`: the one call that turns a model into an engine."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader

from zero3 import accelerator, activation_checkpointing, comm, default_group
from zero3.config import Zero3Config, load_config
from zero3.fault_tolerance import replicas as fault_tolerance
from zero3.optim import spec as optimizer_spec
from zero3.partition.init_context import Init
from zero3.partition.sharded_param import released_by_destroy
from zero3.engine.dataloader import check_dataset, training_loader
from zero3.engine.engine import ZeroEngine
from zero3.step.optimizer import ZeroOptimizer
from zero3.topology import Topology


def initialize(
    model: nn.Module,
    model_parameters: Iterable[Any] | None = None,
    config: dict | str | Zero3Config | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    training_data: Any = None,
    config_params: dict | None = None,
    device: torch.device | str | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    mesh: DeviceMesh | None = None,
) -> tuple[ZeroEngine, ZeroOptimizer | None, DataLoader | None, Any]:
    """Returns (engine, optimizer, dataloader, lr_scheduler), as DeepSpeed does.

    The optimizer comes from the config's `optimizer` section, or is the
    client's `optimizer` (a torch.optim.Optimizer whose update is elementwise:
    the engine builds the same class, hyperparameters and groups over its fp32
    shards, and takes over any state it has; the client object is not used
    afterwards). Not both. `training_data` (a map-style dataset) comes back
    as a DataLoader over this rank's share of it (see zero3.engine.dataloader),
    batched by `collate_fn` if given. `lr_scheduler` may be
    a scheduler factory taking the torch optimizer. `device` picks the device
    as `zero3.Init` does (see `zero3.accelerator.resolve_device`). `mesh` (a torch DeviceMesh over the
    whole job, FSDP2's way) lays the ranks out: 1-D shards over every rank, 2-D is (replicate, shard);
    the engine makes groups of its own over the same ranks (zero3.topology's [Note: one topology]).
    """
    if config is not None and config_params is not None:
        raise ValueError("pass the config as `config` or `config_params`, not both")
    cfg = load_config(config if config is not None else (config_params or {}))
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    released = [name for name, param in model.named_parameters() if released_by_destroy(param)]
    if released:
        named = ", ".join(released[:3]) + (", ..." if len(released) > 3 else "")
        raise ValueError(
            f"zero3.initialize: the model's parameters ({named}) were released by an earlier engine's "
            "destroy(), which frees every buffer, the parameters' data included: build the model again (under zero3.Init), or give the parameters their values first "
            "(p.data = ...), or keep the first engine and park it with engine.offload_states() instead of "
            "destroying it"
        )
    if cfg.activation_checkpointing:
        activation_checkpointing.configure(deepspeed_config=cfg)  # as DeepSpeed's initialize does; refusals first
    if optimizer is not None:
        optimizer_spec.from_client(optimizer)  # refused before anything is set up
    if training_data is not None:
        check_dataset(training_data)
    if cfg.fault_tolerance.enabled:
        if mesh is not None and mesh.ndim != 1:
            raise ValueError(f"fault_tolerance.enabled: torchft's replica groups are the replicas, so the mesh must "
                             f"be 1-D (this group's shards), got {mesh.ndim} dimensions")
        fault_tolerance.check_setup(cfg.fault_tolerance)  # before anything is built
    device = accelerator.resolve_device(device)
    accelerator.set_device(device)
    default_group.join_default_group(device, cfg.comm_timeout_s)
    topology = Topology.build(device, default_group.engine_timeout(cfg.comm_timeout_s), mesh,
                              cfg.zero_optimization.mics_shard_size, cfg.zero_optimization.zero_hpz_partition_size,
                              cfg.zero_optimization.zero_quantized_gradients, cfg.expert_parallel.size)
    communicator = comm.Communicator(topology)
    try:
        with Init.paused_for_engine_build():
            engine = ZeroEngine(
                model, cfg, communicator, topology.shard, device, model_parameters, lr_scheduler, optimizer,
            )
    except BaseException:
        communicator.close()
        raise
    # Partitioning freed every whole value it sharded (under zero3.Init, every module's) between shards that
    # stay: glibc keeps those pages resident in its heap, where later allocations of other sizes rarely fit.
    # Hand them back once the build is done.
    accelerator.release_host_memory()
    engine.resume_from_config()  # checkpoint.resume: the newest complete checkpoint, if there is one
    loader = None
    if training_data is not None:
        loader = training_loader(
            training_data, engine.batch.micro_batch_per_gpu, engine.global_rank, engine.world_size, collate_fn,
            cfg.dataloader_drop_last,
        )
    return engine, engine.optimizer, loader, engine.lr_scheduler
