"""`deepspeed.comm`: DeepSpeed's communication functions on `torch.distributed` (the job's default group).

DeepSpeed's versions assert that its backend was set up; here a call before any process group exists
raises a RuntimeError that says how to make one (`deepspeed.init_distributed()`, or `deepspeed.initialize`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from zero3 import init_distributed

__all__ = [
    "ReduceOp", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all_single", "barrier", "broadcast",
    "destroy_process_group", "gather", "get_backend", "get_global_rank", "get_local_rank", "get_rank",
    "get_world_group", "get_world_size", "init_distributed", "is_available", "is_initialized", "new_group",
    "reduce", "reduce_scatter_tensor", "scatter",
]


def _require_group() -> None:
    if not dist.is_initialized():
        raise RuntimeError("deepspeed.comm: no process group yet; call deepspeed.init_distributed() (or "
                           "deepspeed.initialize, which joins one) first")


def is_available() -> bool:
    return dist.is_available()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    _require_group()
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    _require_group()
    return dist.get_world_size(group)


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    _require_group()
    return dist.get_global_rank(group, group_rank) if group is not None else group_rank


def get_local_rank() -> int:
    """This process's rank on its node, as the launcher set it (LOCAL_RANK; 0 in a plain process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group() -> Any:
    _require_group()
    return dist.group.WORLD


def get_backend(group: Any = None) -> str:
    _require_group()
    return str(dist.get_backend(group))


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None) -> Any:
    _require_group()
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
    _require_group()
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, group: Any = None,
           async_op: bool = False) -> Any:
    _require_group()
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
    _require_group()
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Any:
    _require_group()
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Any:
    _require_group()
    return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    _require_group()
    return dist.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False) -> Any:
    _require_group()
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=group,
                                  async_op=async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, group: Any = None,
           async_op: bool = False) -> Any:
    _require_group()
    return dist.gather(tensor, gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, group: Any = None,
            async_op: bool = False) -> Any:
    _require_group()
    return dist.scatter(tensor, scatter_list, src=src, group=group, async_op=async_op)


def new_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    _require_group()
    return dist.new_group(ranks, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    dist.destroy_process_group(group)
