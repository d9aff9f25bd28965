"""Process-group setup and every collective the engine issues.

All engine communication goes through this module so that the choice of
collective (torch 2.13's `all_gather_single` / `reduce_scatter_single`, or the
older `*_into_tensor` / `*_tensor` names) is made once.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from zero3 import accelerator

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device: torch.device) -> None:
    """Join (or create) the default process group.

    Under torchrun the env:// variables are set. A plain `python train.py` has
    none of them: it becomes a world of one on a private loopback port.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ["RANK"] = "0"
            os.environ["WORLD_SIZE"] = "1"
            os.environ.setdefault("LOCAL_RANK", "0")
        backend = accelerator.communication_backend(device)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)


class Communicator:
    """The collectives of one data-parallel group, on flat tensors only."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather_flat(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output[r*n:(r+1)*n] = rank r's `shard` (n = shard.numel())."""
        if self.world_size == 1:
            output.copy_(shard)
            return None
        return _all_gather_flat(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter_flat(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output = sum over ranks of full[rank*n:(rank+1)*n] (n = output.numel())."""
        if self.world_size == 1:
            output.copy_(full)
            return None
        return _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
