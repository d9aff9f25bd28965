"""Where an async save's state waits while it is written: one shared-memory segment per rank.

An async save copies every entry of the rank's state (zero3.checkpoint.state's
`entries`) into the segment and training goes on; the checkpoint writer process
(zero3.checkpoint.writer_process) maps the same segment and writes from it. For
automatic checkpoints the segment is kept from one save to the next while the state's
size holds, so a save every few steps neither allocates nor faults its pages in again;
an occasional save's is freed once written (zero3.checkpoint.async_saves). Beside a CUDA device its
pages are registered with the driver (page-locked), so the device-to-host copies are
DMA; elsewhere page-locking means nothing and is skipped.

Each box of a parameter's range (zero3.checkpoint.chunks) has a place of its own, and a large one (64 KiB
or more) starts on a page, so that the writer sends it to the file straight from the segment (`O_DIRECT`
wants page-aligned memory: zero3.checkpoint.data_files' [Note: one pass per data file]). An entry that
already lives in the engine's shared state (zero3.checkpoint.shared_state) is not copied: its placement
names that segment (`IN_STATE`) and where it is there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from zero3 import accelerator
from zero3.checkpoint.chunks import RangeChunks
from zero3.checkpoint.shared_state import SharedState
from zero3.shared_segments import PAGE, create_backed, release  # PAGE: where a large box starts

log = logging.getLogger("zero3")

_ALIGN = 64  # bytes: every entry starts on a cache line (and at any dtype's alignment)
LARGE = 64 << 10  # bytes: a box this large is written to its file straight from the segment
STAGED, IN_STATE = 0, 1  # a placement's segment: the staging segment, or the engine's shared state


@dataclass(frozen=True)
class Placement:
    """One entry of the state in the segment: `numel` values of `dtype`, a whole tensor at byte `offset`, or
    a RangeChunks' boxes, each at its byte offset in `box_offsets`."""

    key: str
    offset: int  # a tensor's; a RangeChunks' first box's
    dtype: torch.dtype
    shape: tuple[int, ...]  # a whole tensor's shape; a RangeChunks' range is flat
    chunks: tuple[tuple[int, ...], int, int] | None  # a RangeChunks' (global shape, start, end); None: a tensor
    box_offsets: tuple[int, ...] = ()  # a RangeChunks' boxes, in order
    segment: int = STAGED  # which segment the offsets are in

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _aligned(cursor: int, nbytes: int) -> int:
    step = PAGE if nbytes >= LARGE else _ALIGN
    return -(-cursor // step) * step


def place(live: dict[str, Any], state: SharedState | None = None) -> tuple[list[Placement], int]:
    """Where each entry of `live` goes in the staging segment, or is in the engine's shared `state`; and the
    staging segment's size in bytes."""
    placements: list[Placement] = []
    cursor = 0
    for key, entry in live.items():
        in_state = state.offset_of(entry.values) if isinstance(entry, RangeChunks) and entry.values is not None \
            and state is not None else None
        if in_state is not None:
            assert isinstance(entry, RangeChunks)
            offsets, at = [], in_state
            for _, sizes in entry.boxes:
                offsets.append(at)
                at += math.prod(sizes) * entry.dtype.itemsize
            placements.append(Placement(key, in_state, entry.dtype, (entry.end - entry.start,),
                                        (entry.shape, entry.start, entry.end), tuple(offsets), IN_STATE))
            continue
        if isinstance(entry, RangeChunks):
            offsets = []
            for _, sizes in entry.boxes:
                nbytes = math.prod(sizes) * entry.dtype.itemsize
                cursor = _aligned(cursor, nbytes)
                offsets.append(cursor)
                cursor += nbytes
            placement = Placement(key, offsets[0] if offsets else _aligned(cursor, 0), entry.dtype,
                                  (entry.end - entry.start,), (entry.shape, entry.start, entry.end), tuple(offsets))
        elif isinstance(entry, torch.Tensor):
            cursor = _aligned(cursor, entry.nbytes)
            placement = Placement(key, cursor, entry.dtype, tuple(entry.shape), None)
            cursor += entry.nbytes
        else:
            raise TypeError(f"checkpoint entry {key!r} is a {type(entry).__name__}: expected a tensor or RangeChunks")
        placements.append(placement)
    return placements, max(_aligned(cursor, 0), _ALIGN)


def views(segments: tuple[memoryview, memoryview | None], placements: list[Placement]) -> dict[str, Any]:
    """The state as DCP saves it, every tensor over the memory of its segment (`segments`: the staging
    segment's, the shared state's) and, unlike a slice, with a storage of its own: DCP copies a tensor whose
    storage is larger than it before saving it."""
    state: dict[str, Any] = {}
    for placed in placements:
        segment = segments[placed.segment]
        assert segment is not None, f"{placed.key!r} is in the engine's shared state, which is not mapped here"
        if placed.chunks is None:
            state[placed.key] = _own(segment, placed.offset, placed.dtype, placed.numel).view(placed.shape)
        else:
            shape, start, end = placed.chunks
            state[placed.key] = _StagedChunks(shape, placed.dtype, start, end, segment=segment,
                                              box_offsets=placed.box_offsets)
    return state


def _own(segment: memoryview, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return torch.frombuffer(segment, dtype=dtype, count=numel, offset=offset) if numel else torch.empty(0, dtype=dtype)


@dataclass
class _StagedChunks(RangeChunks):
    """A parameter's staged range, each of its boxes a tensor with a storage of its own (see `views`)."""

    segment: memoryview | None = None
    box_offsets: tuple[int, ...] = ()  # bytes: where each box starts in the segment

    def __post_init__(self) -> None:
        super().__post_init__()
        self._box_offset = {tuple(offsets): at for (offsets, _), at in zip(self.boxes, self.box_offsets)}

    def box(self, offsets: torch.Size | None) -> tuple[int, torch.Tensor]:
        key = tuple(offsets or ())
        cursor, sizes = self._at[key]
        assert self.segment is not None
        return cursor, _own(self.segment, self._box_offset[key], self.dtype, math.prod(sizes)).view(sizes)


class StagingArena:
    """This rank's staging memory (made on the first async save, remade when the state outgrows it): a
    shared-memory segment, or, where /dev/shm has no room for it (a container's default is 64 MiB),
    private memory, which only a writer thread of this process can read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.segment: SharedMemory | None = None
        self._private: bytearray | None = None
        self._registered = False  # its pages are registered with the CUDA driver
        self._told = False  # the fallback to private memory was logged

    @property
    def shared(self) -> bool:
        return self.segment is not None

    @property
    def name(self) -> str:
        assert self.segment is not None
        return self.segment.name

    def stage(self, live: dict[str, Any], shared: bool = True, state: SharedState | None = None) -> list[Placement]:
        """Copy every entry of `live` into the staging memory (shared if `shared` and there is room), but those
        in the engine's shared `state`; returns where each is (`views` makes the state of them, for a writer
        in this process). The copies have landed when this returns, so training may change the originals
        (not those in `state`: see zero3.checkpoint.shared_state's Note)."""
        placements, size = place(live, state)
        memory = self._memory(size, shared)
        arena = torch.frombuffer(memory, dtype=torch.uint8)
        for placed in placements:
            if placed.segment == IN_STATE:
                continue
            entry = live[placed.key]
            if isinstance(entry, RangeChunks):
                numel = entry.end - entry.start
                values = entry.values if entry.values is not None else entry.read(0, numel)  # type: ignore[misc]
                values = values.detach()
                cursor = 0
                for at, (_, sizes) in zip(placed.box_offsets, entry.boxes):
                    count = math.prod(sizes)
                    target = arena[at : at + count * placed.dtype.itemsize].view(placed.dtype)
                    target.copy_(values[cursor : cursor + count], non_blocking=self._registered)
                    cursor += count
                continue
            target = arena[placed.offset : placed.offset + placed.nbytes].view(placed.dtype).view(placed.shape)
            target.copy_(entry.detach(), non_blocking=self._registered)
        accelerator.synchronize(self.device)
        return placements

    def views(self, placements: list[Placement], state: SharedState | None = None) -> dict[str, Any]:
        """The staged state as tensors over the staging memory and the shared `state` (`views`), for a writer
        in this process."""
        held = self._held()
        assert held is not None, "nothing is staged"
        return views((held, state.segment.buf if state is not None and state.segment is not None else None),
                     placements)

    def _held(self) -> memoryview | None:
        """The staging memory held now (shared or private), if any."""
        if self.segment is not None:
            return self.segment.buf
        return memoryview(self._private) if self._private is not None else None

    def _memory(self, size: int, shared: bool) -> memoryview:
        held = self._held()
        if held is not None and len(held) >= size and (shared or self.segment is None):
            return held
        self.close()
        if shared:
            self.segment = self._shared_segment(size)
        if self.segment is None:
            self._private = bytearray(size)
        memory = self._held()
        assert memory is not None
        self._registered = accelerator.register_host_pages(torch.frombuffer(memory, dtype=torch.uint8), self.device)
        return memory

    def _shared_segment(self, size: int) -> SharedMemory | None:
        try:
            return create_backed("ckpt", size)
        except OSError as error:
            if not self._told:
                log.warning("async saves: /dev/shm has no room for %d MiB of staged state (%s); staging in this "
                            "process's memory, written by a thread (a container wants a larger --shm-size)",
                            size >> 20, error.strerror or error)
                self._told = True
            return None

    def close(self) -> None:
        """Free the staging memory (a writer still mapping the segment keeps its pages until it lets go)."""
        held = self._held()
        if self._registered and held is not None:
            accelerator.unregister_host_pages(torch.frombuffer(held, dtype=torch.uint8), self.device)
            self._registered = False
        del held  # no view may outlive the mapping
        if self.segment is not None:
            release(self.segment, unlink=True)
            self.segment = None
        self._private = None
