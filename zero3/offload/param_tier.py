"""Where the 16-bit parameter shards live between uses: host memory or disk (ZeRO-Infinity).

[Note: shards on disk]
With `offload_param.device = "nvme"` the units' shards are laid out in two
flat buffers: the first `max_in_cpu` elements (the persistent unit first,
then units in order) in host memory, the rest in one file. A unit's shard
is read into host memory just before its all-gather and dropped once the
gather completes. Reads run ahead along the order units were asked for:
the tier remembers, for each pair of consecutive units, which came next
(a pair, not a single unit, so a forward and a backward, which visit units
in opposite orders, are told apart), and keeps up to `buffer_count` of the
predicted next shards read ahead. A shard that was not predicted (the
order changed) is read on demand: never an error. Any write to the file
(the optimizer step, a GatheredParameters edit) first drops every read
ahead, so a stale value is never gathered.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zero3.offload.disk import DiskFile, FileIO, Transfer
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.unit import GatherUnit

class HostShardSource:
    """Shards in host memory beside a GPU: each is copied to the device just before its all-gather
    (the walk issues gathers ahead along the prefetch trace, so the copy runs ahead with them)."""

    hands_over_fresh = False  # (a world of one copies the shard into the gathered values)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def acquire(self, unit: GatherUnit) -> torch.Tensor:
        assert unit.lp_slot is not None
        return unit.lp_slot.view().to(self.device, non_blocking=True)

class DiskShardTier:
    """The on-disk part of the 16-bit shards: the file store, the unit source, the reads ahead."""

    hands_over_fresh = False  # (a world of one copies the shard into the gathered values)

    def __init__(
        self, disk: FileIO, root: Path, numel: int, dtype: torch.dtype, device: torch.device, read_ahead: int,
    ) -> None:
        self.disk = disk
        self.dtype = dtype
        self.device = device
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.read_ahead = read_ahead
        self.file: DiskFile = disk.reserve(
            root, {"lp_params": numel * self.element_size}, purpose="keep the parameters (offload_param)"
        )["lp_params"]
        self.buffer: FlatBuffer | None = None
        self._ahead: dict[GatherUnit, tuple[torch.Tensor, Transfer]] = {}
        self._next: dict[tuple[GatherUnit | None, GatherUnit], GatherUnit] = {}
        self._previous: tuple[GatherUnit | None, GatherUnit | None] = (None, None)
        self.reads_on_demand = 0
        self.reads_ahead_used = 0

    # ---- the buffer's backing store (element offsets) ---------------------------
    def read(self, offset: int, into: torch.Tensor) -> None:
        self.disk.read_now(self.file, into, offset * self.element_size)

    def write(self, offset: int, source: torch.Tensor) -> None:
        self.drop_reads_ahead()
        self.disk.write_now(self.file, source, offset * self.element_size)

    def adopt(self, units: list[GatherUnit], name: str) -> FlatBuffer:
        """Move these units' shards into the file, one unit at a time, and make it their home.

        Host memory never holds more than one unit's shard on the way: a model whose shards exceed
        RAM is built unit by unit under zero3.Init, and must not be gathered into one buffer here.
        """
        numel = sum(unit.shard_numel for unit in units)
        buffer = FlatBuffer(name, torch.empty(numel, dtype=self.dtype, device="meta"), state="lp_params")
        buffer.keep_in(self, "lives on disk (zero_optimization.offload_param)")
        cursor = 0
        for unit in units:
            shard = torch.cat([sp.lp_slot.read().reshape(-1) for sp in unit.params])  # type: ignore[union-attr]
            unit.assign_lp(buffer, cursor, self)  # the unit's own buffer is freed with its last reference
            # Under Init on a GPU the shard was built on the device; the file is written from host memory.
            self.disk.write_now(self.file, shard.to(device="cpu", dtype=self.dtype), cursor * self.element_size)
            cursor += unit.shard_numel
        self.buffer = buffer
        return buffer

    # ---- the units' source ---------------------------------------------------------
    def acquire(self, unit: GatherUnit) -> torch.Tensor:
        ahead = self._ahead.pop(unit, None)
        if ahead is not None:
            shard, transfer = ahead
            error = transfer.wait()
            if error is not None:
                raise error
            self.reads_ahead_used += 1
        else:
            shard = self._start_read(unit)[0]
            self.reads_on_demand += 1
        self._learn(unit)
        self._read_ahead(unit)
        return shard.to(self.device, non_blocking=True) if self.device.type != "cpu" else shard

    def _start_read(self, unit: GatherUnit, wait: bool = True) -> tuple[torch.Tensor, Transfer]:
        assert unit.lp_slot is not None
        shard = torch.empty(unit.shard_numel, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        transfer = Transfer(lambda error: None).track(
            self.disk.read(self.file, shard, unit.lp_slot.offset * self.element_size)
        )
        if wait:
            error = transfer.wait()
            if error is not None:
                raise error
        return shard, transfer

    def _learn(self, unit: GatherUnit) -> None:
        before, last = self._previous
        if last is not None:
            self._next[(before, last)] = unit
        self._previous = (last, unit)

    def _read_ahead(self, unit: GatherUnit) -> None:
        before, current = self._previous
        seen = {unit}
        while current is not None and len(self._ahead) < self.read_ahead:
            following = self._next.get((before, current))
            if following is None or following in seen:
                return
            seen.add(following)
            if following not in self._ahead and self._on_disk(following):
                self._ahead[following] = self._start_read(following, wait=False)
            before, current = current, following

    def _on_disk(self, unit: GatherUnit) -> bool:
        return unit.lp_slot is not None and unit.lp_slot.buffer is self.buffer

    def drop_reads_ahead(self) -> None:
        for _, transfer in self._ahead.values():
            transfer.wait()  # a read still filling memory finishes before it is dropped
        self._ahead.clear()

    def close(self) -> None:
        self.drop_reads_ahead()
        self.file.remove()

def split_units(units: list[GatherUnit], max_in_cpu: int) -> tuple[list[GatherUnit], list[GatherUnit]]:
    """(units kept in host memory, units on disk): persistent first, then in order, within `max_in_cpu`."""
    ordered = sorted(units, key=lambda unit: not unit.persistent)
    in_memory: list[GatherUnit] = []
    on_disk: list[GatherUnit] = []
    budget = max_in_cpu
    for unit in ordered:
        if unit.persistent or (unit.shard_numel <= budget and not on_disk):
            in_memory.append(unit)
            budget -= unit.shard_numel if not unit.persistent else 0
        else:
            on_disk.append(unit)
    return in_memory, on_disk
