"""The shard geometry: this rank's coordinates (`ShardMesh`) and the group sizes a config may ask for.

Nothing here makes a process group: zero3.topology makes the groups and hands each `ShardMesh` its
own, and layout code that never communicates (`zero3 estimate`) reads the same geometry the engine does.

[Note: shard geometry]
A parameter is split across the ranks of its shard group and, where there is
more than one copy of the model's shards (hierarchical partitioning: FSDP2's
HSDP, DeepSpeed's MiCS and hpZ), replicated across a replicate group. The
code that shards, gathers, reduces and estimates reads this rank's place from
one `ShardMesh`. The geometry is the one DeepSpeed and FSDP2 use: each
flattened parameter is padded to a multiple of the shard group's size and
split into equal shards; shard rank r keeps elements [r*s, (r+1)*s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class ShardMesh:
    """This rank's coordinates: its shard group (size, rank, group) and its replicate group.

    A group of None is the default process group; `geometry` builds a mesh with
    sizes and ranks alone, for layout code that issues no collective (`zero3 estimate`).
    """

    shard_size: int
    shard_rank: int
    shard_group: dist.ProcessGroup | None = None
    replicate_size: int = 1
    replicate_rank: int = 0
    replicate_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        for what, size, rank in (("shard", self.shard_size, self.shard_rank),
                                 ("replicate", self.replicate_size, self.replicate_rank)):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"ShardMesh: {what} rank {rank} outside a {what} group of size {size}")

    # ---- construction ----------------------------------------------------------
    @classmethod
    def of_group(cls, group: dist.ProcessGroup | None = None) -> ShardMesh:
        """Shard over every rank of `group` (default: the whole job), one replica: plain ZeRO-3."""
        return cls(shard_size=dist.get_world_size(group), shard_rank=dist.get_rank(group), shard_group=group)

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> ShardMesh:
        """A 1-D mesh shards over its one dimension; a 2-D mesh is (replicate, shard), as FSDP2's HSDP."""
        if device_mesh.ndim == 1:
            return cls(shard_size=device_mesh.size(), shard_rank=device_mesh.get_local_rank(),
                       shard_group=device_mesh.get_group())
        if device_mesh.ndim == 2:
            return cls(
                shard_size=device_mesh.size(1), shard_rank=device_mesh.get_local_rank(1),
                shard_group=device_mesh.get_group(1),
                replicate_size=device_mesh.size(0), replicate_rank=device_mesh.get_local_rank(0),
                replicate_group=device_mesh.get_group(0),
            )
        raise ValueError(f"ShardMesh: a device mesh of 1 (shard) or 2 (replicate, shard) dimensions, got {device_mesh.ndim}")

    @classmethod
    def geometry(cls, shard_size: int, shard_rank: int = 0) -> ShardMesh:
        """Sizes and ranks only: for code that lays shards out and never communicates."""
        return cls(shard_size=shard_size, shard_rank=shard_rank)

    # ---- facts -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Ranks the model's state is spread over: shard group times replicas."""
        return self.shard_size * self.replicate_size

    @property
    def sharded(self) -> bool:
        """Whether a parameter is split at all (a shard group of one holds it whole)."""
        return self.shard_size > 1

    def shard_numel(self, numel: int) -> int:
        """Elements of one rank's shard of a `numel`-element parameter (padded)."""
        return -(-numel // self.shard_size)

    def shard_range(self, numel: int) -> tuple[int, int]:
        """[start, end) of this rank's shard within the unpadded flattened parameter (may be empty)."""
        size = self.shard_numel(numel)
        start = min(self.shard_rank * size, numel)
        return start, min(start + size, numel)


class TopologyError(ValueError):
    """The job's layout (its nodes, a group size from the config, a mesh) cannot be built."""


def mics_group_size(mics_shard_size: int, world_size: int) -> int:
    """The ranks each state is sharded over at `world_size` (`zero_optimization.mics_shard_size`, -1: every
    rank); a `TopologyError` naming both numbers where the size does not divide the world."""
    if mics_shard_size == -1:
        return world_size
    if mics_shard_size < 1 or world_size % mics_shard_size:
        raise TopologyError(
            f"zero_optimization.mics_shard_size={mics_shard_size} does not divide the world size {world_size}: "
            "expected a divisor of it (ranks per shard group), or -1"
        )
    return mics_shard_size


def hpz_group_size(hpz_partition_size: int, shard_size: int, ranks_per_node: int) -> int:
    """The ranks of an hpZ secondary group (`zero_optimization.zero_hpz_partition_size`; 1 or 0: off, as in
    DeepSpeed); a `TopologyError` naming the numbers where the size does not divide the shard group or
    the node (a secondary group must lie inside both: its gathers are to stay on the node)."""
    size = hpz_partition_size
    if size <= 1:
        return 1
    if shard_size % size:
        raise TopologyError(
            f"zero_optimization.zero_hpz_partition_size={size} does not divide the shard group's {shard_size} "
            "ranks (the world size, or mics_shard_size): expected a divisor of it, usually the ranks per node"
        )
    if ranks_per_node % size:
        raise TopologyError(
            f"zero_optimization.zero_hpz_partition_size={size} does not divide the {ranks_per_node} ranks per "
            "node (LOCAL_WORLD_SIZE): expected a divisor of it, so that each secondary group lies inside a node"
        )
    return size


def expert_group_size(autoep_size: int, world_size: int, ranks_per_node: int, shard_size: int | None = None) -> int:
    """The ranks of an expert-parallel group (`expert_parallel.autoep_size`; 1: off): consecutive ranks, inside
    one node or over whole nodes, and inside one of the dense part's shard groups (`shard_size`, where the
    model's shards have replicas: MiCS, HSDP), so that the experts' replicas are the dense part's; a
    `TopologyError` naming the numbers where the size cannot be laid out so."""
    key = "expert_parallel.autoep_size"
    if autoep_size < 1:
        raise TopologyError(f"{key}={autoep_size}: expected a positive number of ranks")
    if world_size % autoep_size:
        raise TopologyError(f"{key}={autoep_size} does not divide the world size {world_size}")
    if shard_size is not None and shard_size % autoep_size:
        raise TopologyError(f"{key}={autoep_size} does not divide the shard group's {shard_size} ranks "
                            "(zero_optimization.mics_shard_size, or the mesh's shard dimension): an expert-parallel "
                            "group lies inside one shard group")
    if ranks_per_node % autoep_size and autoep_size % ranks_per_node:
        raise TopologyError(f"{key}={autoep_size} neither divides a node's {ranks_per_node} ranks nor spans "
                            "whole nodes: an expert-parallel group lies inside one node, or over whole nodes")
    return autoep_size


def qgz_inside_size(shard_size: int, ranks_per_node: int) -> int:
    """The ranks of a shard group on one node, for qgZ's all-to-all inside the node: the node's ranks where
    shard groups span nodes, the shard group where it lies inside one; a `TopologyError` where neither
    size divides the other (the group's ranks on a node would differ from node to node)."""
    if shard_size % ranks_per_node == 0:
        return ranks_per_node
    if ranks_per_node % shard_size == 0:
        return shard_size
    raise TopologyError(
        f"zero_optimization.zero_quantized_gradients with shard groups of {shard_size} ranks on nodes of "
        f"{ranks_per_node}: expected one of the two sizes to divide the other, so that every node holds the "
        "same part of each shard group"
    )
