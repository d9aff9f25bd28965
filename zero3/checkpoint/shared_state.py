"""Periodic async saves without a copy: the engine's host state kept in memory its checkpoint writer maps.

[Note: saves read the state in place]
An async save copies the state into a staging segment on the training thread
(zero3.checkpoint.staging) so that training may change it while the writer
process writes. Where the state lives in host memory (training on the CPU,
or optimizer state offloaded to the host) and a save comes every few steps
(automatic checkpoints), that copy is the largest part of a save's cost on
the training thread (33 of 51 ms per save, 6 x 512 GPT at two CPU ranks)
and the staging segment doubles the memory the state takes.

So at its first automatic save the engine moves each host buffer a save reads
(the masters, the optimizer's moments, and the 16-bit shards where they hold
values that are saved) into one shared-memory segment: copied once, the
engine's views of them let go of and bound again, as `offload_states` does.
From then on a save only says where each entry already is, and the writer
writes it from there; nothing is copied. In exchange, the state must not
change while the writer reads it: whatever changes it first waits until the
save in flight has read it all (its data file written; the sync, checksums
and publication go on behind; `AsyncSaves.settle_readers`, which the optimizer calls before
a step, an early step in the backward, an accessor's read or write, and a
load or repair of its states; and a moved buffer's own `write_range`, which
the accessors of frozen parameters write through). A step follows a save by a forward and a
backward, so the write has that long before anyone waits.

A buffer that leaves the segment (`offload_states`, or anything else that
gives it new memory; a load copies into it in place) is copied at each save
again until the next save moves it back in;
once no buffer is left in it, the segment is freed, so parking the state
frees its memory. Memory that is pinned (beside a CUDA device), on the
device, or on disk is never moved: those saves stage as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from zero3.checkpoint.chunks import RangeChunks
from zero3.partition.flat_buffer import FlatBuffer
from zero3.shared_segments import PAGE, create_backed, release

log = logging.getLogger("zero3")


# The engine's part of moving buffers: let go of every view of each buffer, then point it at its new tensor
# (zero3.engine.checkpoints).
Adopt = Callable[[dict[FlatBuffer, torch.Tensor]], None]


def movable(buffer: FlatBuffer) -> bool:
    """Whether `buffer` may move into shared memory: in this process's ordinary host memory."""
    return buffer.store is None and not buffer.parked and buffer.device.type == "cpu" and not buffer.tensor.is_pinned()


def homes(live: dict[str, Any]) -> list[FlatBuffer]:
    """The engine buffers the entries of `live` view, once each, in order."""
    found: dict[int, FlatBuffer] = {}
    for entry in live.values():
        if isinstance(entry, RangeChunks) and entry.home is not None and entry.values is not None:
            found.setdefault(id(entry.home.buffer), entry.home.buffer)
    return list(found.values())


class SharedState:
    """This rank's engine buffers in one shared-memory segment (see the Note), or none."""

    def __init__(self) -> None:
        self.segment: SharedMemory | None = None
        self._buffers: list[FlatBuffer] = []
        self._base = 0  # the segment's address
        self._told = False  # a segment that could not be made was logged

    @property
    def name(self) -> str | None:
        return self.segment.name if self.segment is not None else None

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where `tensor`'s bytes start in the segment; None if they are not all in it."""
        if self.segment is None or tensor.device.type != "cpu":
            return None
        start = tensor.data_ptr() - self._base
        if 0 <= start and start + tensor.nbytes <= self.segment.size:
            return start
        return None

    def holds(self, buffer: FlatBuffer) -> bool:
        return not buffer.parked and buffer.store is None and self.offset_of(buffer.tensor) is not None

    def share(self, live: dict[str, Any], adopt: Adopt, settle: Callable[[], None]) -> None:
        """Move every movable buffer `live` views into a segment (a new one, with those already shared, where
        one is missing from it), and point `live`'s entries at them; a write through a moved buffer's
        `write_range` runs `settle` first. A segment that cannot be made (no room in /dev/shm) leaves
        everything where it is."""
        wanted = [buffer for buffer in homes(live) if movable(buffer)]
        if not wanted or all(self.holds(buffer) for buffer in wanted):
            return
        sizes = [-(-buffer.nbytes // PAGE) * PAGE for buffer in wanted]  # each buffer on a page
        segment = _segment(sum(sizes))
        if segment is None:
            if not self._told:
                log.warning("async saves: /dev/shm has no room for %d MiB of state; each save copies it",
                            sum(sizes) >> 20)
                self._told = True
            return
        memory = torch.frombuffer(segment.buf, dtype=torch.uint8)
        moved: dict[FlatBuffer, torch.Tensor] = {}
        at = 0
        for buffer, size in zip(wanted, sizes):
            tensor = memory[at : at + buffer.nbytes].view(buffer.dtype)
            tensor.copy_(buffer.tensor)
            moved[buffer] = tensor
            at += size
        del memory
        adopt(moved)
        for buffer in wanted:
            buffer.before_write = settle
        old, self.segment, self._buffers = self.segment, segment, wanted
        self._base = moved[wanted[0]].data_ptr()
        if old is not None:
            release(old, unlink=True)
        repoint(live)

    def release_if_unused(self) -> None:
        """Free the segment once none of its buffers is in it any more (they were parked, or replaced)."""
        if self.segment is not None and not any(self.holds(buffer) for buffer in self._buffers):
            self.close()

    def close(self) -> None:
        """Let go of the segment (its pages go once no buffer views them)."""
        if self.segment is not None:
            segment, self.segment, self._buffers = self.segment, None, []
            release(segment, unlink=True)


def repoint(live: dict[str, Any]) -> None:
    """Each entry that views an engine buffer, made to view the buffer's tensor as it is now."""
    for entry in live.values():
        if isinstance(entry, RangeChunks) and entry.home is not None and entry.values is not None:
            entry.values = entry.home.view()[: entry.end - entry.start]


def _segment(size: int) -> SharedMemory | None:
    try:
        return create_backed("state", size)
    except OSError:
        return None

