"""A rank's flat shard of a parameter, described to torch.distributed.checkpoint in the global shape.

[Note: checkpoint chunks]
A rank owns a contiguous range [start, end) of each parameter's flattened
values (`ShardedParam.shard_range`, zero3.shard_mesh's [Note: shard
geometry]); the padding past `numel` is never part of it. DCP describes
a rank's piece of a tensor as boxes (offsets and sizes in the tensor's
global shape). A row-major range is not one box in general,
but it is a few: a partial innermost row, whole slabs, another partial row,
recursively. Each box is contiguous in the flat order, so it is a view of
the rank's range. `RangeChunks` is the state-dict entry that says so: it
hands DCP one write item per box on save and one chunk per box on load, so
DCP writes each parameter under its own name with its global shape, and
reshards at load by intersecting the saved boxes with the loading rank's.
The boxes are views of the engine's own buffers where the state lives in
memory; where it lives on disk, `read` and `write` move a box at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from zero3.partition.flat_buffer import Slot

# DCP's own types are imported where a save or load uses them: importing torch.distributed.checkpoint
# takes about a second (it brings DTensor and sympy), and the engine imports this module to stage its
# saves, so `import zero3` would pay it in every process, saving or not (zero3.checkpoint.planners).

Box = tuple[list[int], list[int]]  # (offsets, sizes) in the global shape


def range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The row-major flat range [start, end) of a tensor of `shape`, as contiguous boxes in order."""
    if end <= start:
        return []
    if len(shape) == 0:
        return [([], [])]
    boxes: list[Box] = []

    def cover(dim: int, origin: list[int], lo: int, hi: int) -> None:
        # [lo, hi) is a flat range inside the sub-tensor at `origin` spanning dims dim.. of `shape`.
        if lo >= hi:
            return
        lead = [1] * dim
        if dim == len(shape) - 1:
            boxes.append((origin + [lo], lead + [hi - lo]))
            return
        slab = math.prod(shape[dim + 1:])
        first, last = -(-lo // slab), hi // slab  # the whole slabs [first, last)
        if first > last:  # inside one slab
            cover(dim + 1, origin + [lo // slab], lo % slab, hi - lo // slab * slab)
            return
        if lo < first * slab:
            cover(dim + 1, origin + [first - 1], lo - (first - 1) * slab, slab)
        if last > first:
            boxes.append((origin + [first] + [0] * (len(shape) - dim - 1), lead + [last - first, *shape[dim + 1:]]))
        if hi > last * slab:
            cover(dim + 1, origin + [last], 0, hi - last * slab)

    cover(0, [], start, end)
    return boxes


@dataclass
class RangeChunks:
    """One parameter's state on this rank for DCP: the flat range [start, end) of a tensor of `shape`.

    Either `values` (a 1-D tensor of end - start elements, written and read in place) or a
    `read(offset, numel)` / `write(offset, tensor)` pair over the flat range (disk-backed state).
    `home` is the engine's slot that `values` views, where there is one: periodic async saves move its
    buffer into memory their writer reads (zero3.checkpoint.shared_state).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int
    values: torch.Tensor | None = None
    read: Callable[[int, int], torch.Tensor] | None = None
    write: Callable[[int, torch.Tensor], None] | None = None
    home: Slot | None = None

    def __post_init__(self) -> None:
        self.boxes = range_boxes(self.shape, self.start, self.end)
        self._at: dict[tuple[int, ...], tuple[int, list[int]]] = {}
        cursor = 0
        for offsets, sizes in self.boxes:
            self._at[tuple(offsets)] = (cursor, sizes)
            cursor += math.prod(sizes)

    # ---- DCP's _Checkpointable hooks (duck-typed by its planner helpers) ----------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=torch.Size(self.shape),
                ),
            )
            for offsets, sizes in self.boxes
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in self.boxes]

    # ---- a box's values ------------------------------------------------------------
    def box(self, offsets: torch.Size | None) -> tuple[int, torch.Tensor]:
        """(flat offset within the range, the box's tensor): a view, or a fresh host copy from disk."""
        cursor, sizes = self._at[tuple(offsets or ())]
        numel = math.prod(sizes)
        if self.values is not None:
            return cursor, self.values[cursor : cursor + numel].view(sizes)
        assert self.read is not None
        return cursor, self.read(cursor, numel).view(sizes)

    def receive(self, offsets: torch.Size | None, values: torch.Tensor) -> None:
        """Store a box's loaded values (of the box's shape), as DCP's load does through `LoadPlanner`: copied
        into the box where the state is in memory, else into a fresh box that is written to disk."""
        cursor, sizes = self._at[tuple(offsets or ())]
        if self.values is not None:
            self.values[cursor : cursor + math.prod(sizes)].view(sizes).copy_(values)
            return
        assert self.write is not None
        box = torch.empty(sizes, dtype=self.dtype)
        box.copy_(values)
        self.write(cursor, box.reshape(-1))
