"""Where a parameter's shards live: the shard group beside the replicate group.

A parameter is split across the ranks of its shard group and, where there is
more than one copy of the model's shards (hierarchical partitioning: FSDP2's
HSDP, DeepSpeed's hpZ and MiCS), replicated across a replicate group. The
code that shards, gathers, reduces and estimates (zero3.partition, the gather
walk, the gradient reducer, Muon's exchange, `zero3 estimate`) reads this
rank's place from one `ShardMesh`. Two places still read the world: the
engine takes its rank from the default group (`dist.get_rank()`: rank 0's
logs, the per-rank disk directory, the data sampler, a checkpoint's per-rank
state), and `zero3.initialize` and `zero3.Init` build their mesh over the
whole job (`of_group`: one replica), so today the two agree.

The geometry is the one DeepSpeed and FSDP2 use: each flattened parameter is
padded to a multiple of the shard group's size and split into equal shards;
shard rank r keeps elements [r*s, (r+1)*s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
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
