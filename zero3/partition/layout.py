"""Shard geometry: how one flattened parameter splits across N ranks.

Each parameter is padded to a multiple of N and split into N equal shards;
rank r keeps elements [r*s, (r+1)*s) of the flattened, padded tensor.
"""

from __future__ import annotations


def shard_numel(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's shard within the unpadded flattened parameter (may be empty)."""
    size = shard_numel(numel, world_size)
    start = min(rank * size, numel)
    end = min(start + size, numel)
    return start, end
