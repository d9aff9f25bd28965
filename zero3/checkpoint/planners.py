"""DCP's default planners, taught zero3's `RangeChunks` entries (zero3.checkpoint.chunks' Note)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.tags import CheckpointError


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner; a `RangeChunks` entry answers with its boxes.

    With a `cache_key`, DCP's plan caching: a rank whose plan is the one it sent last time under that key
    sends an empty one, and the coordinator reuses the global plan and metadata it made then. A zero3 save
    repeats its plan exactly (the same entries, boxes and item sizes), so a save's plan exchange carries no
    items after the first. The key must name the ranks a save runs on (the group, its size): DCP keeps the
    cache per process, and a rank that sent an empty plan to a coordinator with no cache would leave its
    items out of the metadata."""

    def __init__(self, cache_key: str | None = None) -> None:
        super().__init__(enable_plan_caching=cache_key is not None)
        if cache_key is not None:
            self._cached_plans_key = cache_key

    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        # (DCP reads this signature: one without `storage_meta` is called the old way, with a warning.)
        super().set_up_planner(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)
        # A save hands DCP its entries grouped by kind (zero3.checkpoint.tag_write's `grouped`); the names it
        # records are the flat ones (`model.<name>`), so that torch's tools (`dcp_to_torch_save`) read the
        # checkpoint as one flat dict, as before the grouping.
        self.mappings = {fqn: (fqn,) for fqn in self.mappings}

    def lookup_object(self, index: MetadataIndex) -> Any:
        entry = self.state_dict.get(index.fqn)
        if isinstance(entry, RangeChunks):
            return entry.box(index.offset)[1]
        return super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner; a `RangeChunks` entry receives into its boxes (disk-backed ones are written
    back when a read into them lands)."""

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        entry = self.state_dict.get(index.fqn)
        if isinstance(entry, RangeChunks):
            cursor, tensor = entry.box(index.offset)
            if entry.write is not None:
                self._pending[(index.fqn, tuple(index.offset or ()))] = (entry, cursor, tensor)
            return tensor
        return super().lookup_tensor(index)

    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # DCP's set-up rewrites every value it does not know as None (in place): keep ours aside.
        ours = {key: value for key, value in state_dict.items() if isinstance(value, RangeChunks)}
        super().set_up_planner(state_dict, *args, **kwargs)
        state_dict.update(ours)
        self.state_dict.update(ours)
        self._pending: dict[tuple[str, tuple[int, ...]], tuple[RangeChunks, int, torch.Tensor]] = {}

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # DCP would torch.load(weights_only=False) a BYTE_IO entry; zero3 saves none, so one is refused.
        raise CheckpointError(
            f"the checkpoint holds a pickled object under {read_item.dest_index.fqn!r}; zero3 never saves one "
            "and does not unpickle it (it could run code)"
        )

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset or ()))
        pending = self._pending.pop(key, None)
        if pending is not None:
            entry, cursor, box = pending
            assert entry.write is not None
            entry.write(cursor, box.reshape(-1))
