"""Turning a module's whole parameters into shards, one module at a time."""

from __future__ import annotations

import torch
from torch import nn

from zero3.comm import Communicator
from zero3.partition import param_dict
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.sharded_param import ShardedParam, sharded
from zero3.partition.unit import GatherUnit


class Partitioner:
    """Partitions parameters into per-module gather units.

    Every rank shards rank 0's values (one coalesced broadcast per module), as
    DeepSpeed does, so ranks seeded differently still hold one model.
    """

    def __init__(self, comm: Communicator, device: torch.device, dtype: torch.dtype) -> None:
        self.comm = comm
        self.device = device
        self.dtype = dtype

    def partition_module(self, module: nn.Module, label: str) -> GatherUnit | None:
        fresh = [(name, p) for name, p in module._parameters.items() if p is not None and sharded(p) is None]
        param_dict.install(module)
        if not fresh:
            return None
        values = self._broadcast_values([p for _, p in fresh])
        sps = [
            ShardedParam(p, f"{label}.{name}" if label else name, self.comm.world_size, self.comm.rank,
                         self.dtype, self.device)
            for name, p in fresh
        ]
        unit = GatherUnit(sps, self.comm, label or type(module).__name__)
        buffer = FlatBuffer.zeros(f"lp:{unit.label}", unit.shard_numel, self.dtype, self.device)
        unit.assign_lp(buffer, 0)
        for sp, full in zip(sps, values):
            sp.hp_seed = sp.shard_of(full).float()
            sp.lp_shard().copy_(sp.hp_seed)
            sp.set_released()
        return unit

    def _broadcast_values(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Rank 0's fp32 values of `params`, moved to the engine device."""
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(self.device, torch.float32) for p in params])
        self.comm.broadcast(flat, src=0)
        out, cursor = [], 0
        for p in params:
            out.append(flat[cursor : cursor + p.numel()].view(p.shape))
            cursor += p.numel()
        return out
