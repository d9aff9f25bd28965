"""A load at the layout a checkpoint was saved with: each saved item read whole into the box it came from.

[Note: loads at the saved layout]
The common restart loads a checkpoint at the world size and shard layout it
was saved at: then every box a rank loads (zero3.checkpoint.chunks' [Note:
checkpoint chunks]) is exactly one saved item, nearly all of them in the
rank's own file. DCP's load would still plan (each rank's plan gathered to
the coordinator and sent back) and intersect every box with every saved
chunk. Here each rank looks its boxes up in the metadata it has already read
and reads their items as DCP's reader does (each checked against its sum and
held: zero3.checkpoint.trust's [Note: verified reads]); once every rank says
its reads passed, it copies them into place, with the copy DCP's load makes.
Whether a rank can load this way, and what its reads found, travel in the one
exchange a load makes anyway (zero3.checkpoint.state's `load`): where any
rank has a box that is not one saved item (another world size, another
layout), every rank lets go of what it read and loads through DCP, which
reshards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.tags import CheckpointError, Checksum, FileSums
from zero3.checkpoint.read_ahead import advise
from zero3.checkpoint.trust import read_items, tensor_item


@dataclass(frozen=True)
class _Box:
    """A box of a state-dict entry that one saved item fills whole."""

    entry: RangeChunks | torch.Tensor
    offsets: torch.Size  # in the entry's global shape
    sizes: tuple[int, ...]


class SameLayoutLoad:
    """This rank's boxes, each matched to the saved item that is exactly it (see the Note)."""

    def __init__(self, boxes: dict[MetadataIndex, _Box], storage: Mapping[MetadataIndex, Any]) -> None:
        self._boxes = boxes
        self._storage = storage  # DCP's `_StorageInfo` of each saved item: its file, offset and length
        self._held: list[tuple[_Box, torch.Tensor]] = []

    @classmethod
    def plan(cls, wanted: Mapping[str, Any], metadata: Metadata) -> SameLayoutLoad | None:
        """The load of `wanted` (this rank's state-dict for DCP) as whole saved items; None where a box of
        it is not one saved item (the load then reshards through DCP)."""
        boxes: dict[MetadataIndex, _Box] = {}
        storage = metadata.storage_data or {}
        for key, entry in wanted.items():
            meta = metadata.state_dict_metadata.get(key)
            if not isinstance(meta, TensorStorageMetadata):
                return None
            if isinstance(entry, RangeChunks):
                wanted_boxes = entry.boxes
            elif isinstance(entry, torch.Tensor):
                wanted_boxes = [([0] * entry.dim(), list(entry.shape))]
            else:
                return None
            saved = {tuple(chunk.offsets): tuple(chunk.sizes) for chunk in meta.chunks}
            for offsets, sizes in wanted_boxes:
                index = MetadataIndex(key, offsets)
                if saved.get(tuple(offsets)) != tuple(sizes) or index not in storage:
                    return None
                boxes[index] = _Box(entry, torch.Size(offsets), tuple(sizes))
        return cls(boxes, storage)

    def read(self, path: Path, sums: Mapping[str, FileSums], checksum: Checksum) -> list[str]:
        """Read and check every box's item, holding each as a tensor (nothing copied into the engine); one
        line per problem found. A failure that is not damage (an item naming a foreign global) raises."""
        per_file: dict[str, dict[MetadataIndex, Any]] = {}
        for index in self._boxes:
            info = self._storage[index]
            per_file.setdefault(info.relative_path, {})[index] = info
        for name, items in per_file.items():
            advise(path / name, ((info.offset, info.length) for info in items.values()))
        problems: list[str] = []
        self._held = []
        for name, items in sorted(per_file.items()):
            file = path / name
            checked, found = read_items(file, sums.get(file.name), items, checksum)
            problems += found
            for index, (raw, what) in checked.items():
                box, tensor = self._boxes[index], tensor_item(raw, file, what)
                if tuple(tensor.shape) != box.sizes:
                    raise CheckpointError(f"{str(file)!r}: {what} holds a tensor of shape {list(tensor.shape)}, "
                                          f"where the metadata says {list(box.sizes)}")
                self._held.append((box, tensor))
        if problems:
            self._held = []
        return problems

    def commit(self) -> None:
        """Copy what `read` held into the boxes (once every rank's reads passed), then let the files go."""
        held, self._held = self._held, []
        for box, tensor in held:
            if isinstance(box.entry, RangeChunks):
                box.entry.receive(box.offsets, tensor)
            else:
                box.entry.detach().copy_(tensor)

    def release(self) -> None:
        """Let go of what was read and not committed (a load that failed, or that goes through DCP)."""
        self._held = []
