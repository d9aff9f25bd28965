"""hpZ: the secondary shards a forward leaves behind, so that the backward gathers inside the node.

[Note: hpZ's secondary shards]
With `zero_hpz_partition_size: K`, each rank keeps, after a unit's all-gather
in a training forward, 1/K of the gathered unit: the N/K primary shards of
its place j in its secondary group (K consecutive ranks of one node, of one
shard group of N), primary shards [j*N/K, (j+1)*N/K). In the backward the
unit is gathered from those, on the secondary group: the gathered buffer is
the same bytes in the same rank-major layout as the primary all-gather's, so
the backward computes with exactly the values plain ZeRO-3 gathers, and the
losses and masters are bit-identical. Only the route changes: the backward's
gathers stay on the node. The cost is P/K 16-bit elements per rank (2P/K
bytes), one buffer made with the engine, as DeepSpeed does.

Every rank must issue each gather on the same group, so which units have a
usable secondary shard is agreed, not assumed: each rank records the units
whose gathers completed in a root forward that records a graph, sends the
set in the forward walk's last marker, and every rank keeps the
intersection. A secondary shard is usable from the end of that forward to
the end of the next backward (the step that follows changes the weights),
and forgotten when the next root forward begins otherwise: the backward
computes with the values its forward used. It is not state worth keeping:
`offload_states` drops the buffer and the next training forward makes it
again and fills it; checkpoints hold none, so a resumed job rebuilds it in
its first forward (DeepSpeed #7606's high first loss after loading an hpZ
checkpoint cannot happen here).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from zero3.comm import Communicator
from zero3.partition.collectives import PendingGather, stand_in_nbytes, stand_in_room
from zero3.partition.unit import GatherUnit
from zero3.shard_mesh import ShardMesh

BITS_PER_WORD = 62  # units per int64 of the marker's bitmap (clear of the sign bit)


class SecondaryShards:
    """Every unit's secondary shard on this rank, in one buffer, and which of them the ranks agree are usable."""

    def __init__(self, units: list[GatherUnit], primary: ShardMesh, secondary: ShardMesh,
                 comm: Communicator | None, device: torch.device, dtype: torch.dtype) -> None:
        if primary.shard_size % secondary.shard_size:
            raise ValueError(f"hpZ: a secondary group of {secondary.shard_size} ranks in a shard group of "
                             f"{primary.shard_size}: expected a divisor")
        self.units = units
        self.primary = primary
        self.secondary = secondary
        self.comm = comm
        self.device = device
        self.dtype = dtype
        # Primary shards each secondary shard holds, and where this rank's begin in a gathered unit.
        self.shards_per_rank = primary.shard_size // secondary.shard_size
        self._first_shard = secondary.shard_rank * self.shards_per_rank
        self._offset: dict[GatherUnit, int] = {}
        cursor = 0
        for unit in units:
            self._offset[unit] = cursor
            cursor += self.shards_per_rank * unit.shard_numel
        self.numel = cursor
        self._buffer: torch.Tensor | None = None
        self.make()
        self._index = {unit: i for i, unit in enumerate(units)}
        self.words = -(-len(units) // BITS_PER_WORD)  # ints of the bitmap a forward's last marker carries
        self.recording = False
        self._recorded: set[GatherUnit] = set()
        self._usable: set[GatherUnit] = set()
        self.gathers = 0  # backward gathers served from secondary shards (a fact for tests and benchmarks)
        for unit in units:
            unit.secondary = self

    # ---- the buffer -----------------------------------------------------------------
    def make(self) -> None:
        """Allocate the buffer (with the engine, and again after `drop_buffer`)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def drop_buffer(self) -> None:
        """Free the buffer (offload_states): every shard is forgotten, made and filled again by the next
        training forward."""
        self.forget()
        self._buffer = None

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def _slot(self, unit: GatherUnit) -> torch.Tensor:
        assert self._buffer is not None
        return self._buffer.narrow(0, self._offset[unit], self.shards_per_rank * unit.shard_numel)

    # ---- a root forward: record, then agree -------------------------------------------
    def begin_forward(self, records: bool) -> None:
        """A root forward begins: what the last one left is forgotten; this one records if it builds a graph."""
        self.forget()
        if records:
            self.make()
        self.recording = records

    def record(self, unit: GatherUnit, gathered: torch.Tensor) -> None:
        """A primary gather of `unit` completed (`gathered`: its rank-major shards): keep this rank's part."""
        if not self.recording:
            return
        numel = self.shards_per_rank * unit.shard_numel
        self._slot(unit).copy_(gathered.narrow(0, self._first_shard * unit.shard_numel, numel))
        self._recorded.add(unit)

    def recorded_words(self) -> list[int]:
        """Stop recording; the units recorded, as the bitmap the forward's last marker carries."""
        self.recording = False
        words = [0] * self.words
        for unit in self._recorded:
            i = self._index[unit]
            words[i // BITS_PER_WORD] |= 1 << (i % BITS_PER_WORD)
        return words

    def agree(self, every_ranks_words: Sequence[Sequence[int]]) -> None:
        """Keep usable the units every rank recorded (the same set on every rank)."""
        common = [~0] * self.words
        for words in every_ranks_words:
            common = [a & int(b) for a, b in zip(common, words)]
        self._usable = {unit for unit, i in self._index.items()
                        if common[i // BITS_PER_WORD] >> (i % BITS_PER_WORD) & 1}
        self._recorded = set()

    def end_backward(self) -> None:
        """A backward ended: the step may change the weights now."""
        self._usable = set()

    def forget(self) -> None:
        self.recording = False
        self._recorded = set()
        self._usable = set()

    def usable(self, unit: GatherUnit) -> bool:
        return unit in self._usable

    # ---- gathers ----------------------------------------------------------------------
    def start_gather(self, unit: GatherUnit) -> PendingGather | None:
        """The unit's all-gather from the secondary shards, on the secondary group; None where the ranks
        have none agreed for it (the unit is gathered from its primary shards)."""
        if unit not in self._usable:
            return None
        assert self.comm is not None
        shard = self._slot(unit)
        output = torch.empty(self.primary.shard_size * unit.shard_numel, dtype=shard.dtype, device=shard.device)
        work = self.comm.all_gather_secondary(output, shard, async_op=True)
        self.gathers += 1
        return PendingGather(output, work, inputs=[shard])

    def stand_in_nbytes(self, unit: GatherUnit) -> int:
        """Bytes of reserve `start_stand_in` uses for `unit`."""
        return stand_in_nbytes(self.shards_per_rank * unit.shard_numel, self.primary.shard_size * unit.shard_numel,
                               unit.dtype)

    def start_stand_in(self, unit: GatherUnit, reserve: torch.Tensor) -> PendingGather:
        """`start_gather`'s collective for a unit the ranks hold secondary shards of, by a rank that will not
        use the result: zeros sent, the result in `reserve` (GatherUnit.start_stand_in)."""
        assert self.comm is not None
        shard, output = stand_in_room(reserve, self.shards_per_rank * unit.shard_numel,
                                      self.primary.shard_size * unit.shard_numel, unit.dtype)
        return PendingGather(output, self.comm.all_gather_secondary(output, shard, async_op=True))

    def recorder(self, unit: GatherUnit) -> functools.partial[None] | None:
        """What a primary gather of `unit` calls when it completes, while a forward records."""
        return functools.partial(self.record, unit) if self.recording else None
