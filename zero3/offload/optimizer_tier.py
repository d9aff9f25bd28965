"""Where the optimizer's fp32 state lives between steps: device, host memory, or disk (ZeRO-Infinity).

The optimizer never touches these buffers directly during a step: it asks
its tier to `walk` the sub-groups, and the tier hands each sub-group's
window (the fp32 master and each of the optimizer's elementwise states, as
1-D tensors; "hp_params" (absent where the masters are the shards) and, for
Adam, "exp_avg" and "exp_avg_sq") to a visitor that steps it. A memory tier
hands out views of its flat buffers; the disk tier streams windows through
host memory.

[Note: the disk walk]
Each state has two files, generations A and B. A step reads every
sub-group's window from the current generation and writes it, stepped, to
the other, through `buffer_count` rotating host windows: the reads of the
next sub-groups run ahead and the writes of the last ones finish behind.
Only when every write has landed, and every rank's step has (the optimizer
calls `commit` once the ranks agree), does the other generation become
current, so a disk that fails mid-step, on this rank or another, loses
nothing: the step raises and the current generation still holds the state as
before (the reduced gradients, `lp_grads`, stay in memory). The price is
twice the optimizer state's bytes on disk, reserved up front; the windows
exist only during the walk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from zero3.offload.disk import DiskFile, FileIO, StepIOError, Transfer
from zero3.offload.host import HostBufferPool
from zero3.partition.flat_buffer import FlatBuffer

FP32_BYTES = 4

# (sub-group index, its window: state name -> 1-D fp32 tensor)
Visitor = Callable[[int, dict[str, torch.Tensor]], None]


class OptimizerStates(Protocol):
    """The optimizer's fp32 state, wherever its tier keeps it."""

    buffers: dict[str, FlatBuffer]
    # Where the step runs: the memory the visitor's windows are in.
    step_device: torch.device
    # Whether a failed walk leaves the state as it was (the disk tier's two generations).
    transactional: bool

    def walk(self, ranges: list[tuple[int, int]], visit: Visitor, skip: set[int], readonly: bool = False) -> None:
        """Hand each sub-group's window to `visit` (not those in `skip`). With `readonly` the visitor
        only reads: nothing it does to a window is kept."""
        ...

    def commit(self) -> None:
        """Keep what the last walk wrote (every rank's step succeeded)."""
        ...

    def abandon(self) -> None:
        """Drop what the last walk wrote, where the tier can (see `transactional`)."""
        ...

    def close(self) -> None: ...


def _state_of(name: str) -> str:
    return "hp_params" if name == "hp_params" else "optim_states"


class MemoryOptimizerStates:
    """The state in memory: on the device (no offload) or on the host (ZeRO-Offload)."""

    transactional = False

    def __init__(self, names: tuple[str, ...], numel: int, device: torch.device, pin: bool) -> None:
        # The optimizer writes every master from its shard as it lays them out: only the states start as zeros.
        self.buffers = {
            name: FlatBuffer(
                name, (torch.empty if name == "hp_params" else torch.zeros)(
                    numel, dtype=torch.float32, device=device, pin_memory=pin), state=_state_of(name)
            )
            for name in names
        }
        self.step_device = torch.empty(0, device=device).device  # the step runs where the state is (its index)

    def walk(self, ranges: list[tuple[int, int]], visit: Visitor, skip: set[int], readonly: bool = False) -> None:
        for index, (offset, numel) in enumerate(ranges):
            if index not in skip:
                visit(index, {name: buffer.view(offset, numel) for name, buffer in self.buffers.items()})

    def commit(self) -> None:
        pass  # the walk updated the buffers in place

    def abandon(self) -> None:
        pass  # nothing to drop: in place (not transactional)

    def close(self) -> None:
        pass


class _GenerationFile:
    """A state buffer's backing store: the current generation's file (element offsets, fp32)."""

    def __init__(self, owner: "DiskOptimizerStates", name: str) -> None:
        self.owner = owner
        self.name = name

    def read(self, offset: int, into: torch.Tensor) -> None:
        self.owner.disk.read_now(self.owner.current_file(self.name), into, offset * FP32_BYTES)

    def write(self, offset: int, source: torch.Tensor) -> None:
        self.owner.disk.write_now(self.owner.current_file(self.name), source, offset * FP32_BYTES)


@dataclass
class _Window:
    key: int
    tensors: dict[str, torch.Tensor]
    transfer: Transfer | None = None  # the read into it, or the write out of it, in flight


class DiskOptimizerStates:
    """The state in files under `nvme_path`, streamed through `buffer_count` host windows (see the Note)."""

    transactional = True

    def __init__(
        self, names: tuple[str, ...], numel: int, disk: FileIO, pool: HostBufferPool, root: Path, buffer_count: int,
        window_numel: int,
    ) -> None:
        self.names = names
        self.disk = disk
        self.pool = pool
        self.step_device = torch.device("cpu")  # the step runs in the host windows
        self.buffer_count = buffer_count
        self.window_numel = window_numel
        files = {f"{name}.{generation}": numel * FP32_BYTES for generation in "AB" for name in names}
        # Both generations reserved at once: too little space fails here, before anything is written.
        self.files = disk.reserve(root, files, purpose="keep the optimizer state (offload_optimizer)")
        self.generation = "A"
        self.written: str | None = None  # the generation the last walk wrote, until commit or abandon
        self.buffers: dict[str, FlatBuffer] = {}
        for name in names:
            buffer = FlatBuffer(name, torch.empty(numel, dtype=torch.float32, device="meta"), state=_state_of(name))
            buffer.keep_in(_GenerationFile(self, name), "lives on disk (zero_optimization.offload_optimizer)")
            self.buffers[name] = buffer

    def current_file(self, name: str) -> DiskFile:
        return self.files[f"{name}.{self.generation}"]

    def _other(self) -> str:
        return "B" if self.generation == "A" else "A"

    def _window(self, key: int) -> _Window:
        return _Window(key, {
            name: self.pool.get(f"optim-window:{key}:{name}", self.window_numel, torch.float32, pin=False)
            for name in self.names
        })

    def walk(self, ranges: list[tuple[int, int]], visit: Visitor, skip: set[int], readonly: bool = False) -> None:
        """Every sub-group goes through (a skipped one is copied unchanged: the other generation needs it).
        A `readonly` walk reads the skipped ones not at all and writes nothing."""
        try:
            if readonly:
                self._read_walk(ranges, visit, skip)
            else:
                self._walk(ranges, visit, skip)
        finally:
            self.pool.drop("optim-window:")  # every transfer into or out of a window has ended here

    def _read_walk(self, ranges: list[tuple[int, int]], visit: Visitor, skip: set[int]) -> None:
        """The current generation's windows, one at a time, the next one's read ahead."""
        wanted = [index for index in range(len(ranges)) if index not in skip]
        windows = [self._window(key) for key in range(min(2, len(wanted)))]

        def read(slot: int, index: int) -> Transfer:
            offset, numel = ranges[index]
            futures = [
                future for name in self.names
                for future in self.disk.read(
                    self.current_file(name), windows[slot].tensors[name][:numel], offset * FP32_BYTES
                )
            ]
            return Transfer(lambda error: None).track(futures)

        pending = read(0, wanted[0]) if wanted else None
        for position, index in enumerate(wanted):
            assert pending is not None
            error = pending.wait()
            if error is not None:
                raise StepIOError(
                    f"the optimizer step failed reading its state under {self.disk.directory}: {error}. It was not "
                    "applied; call engine.step() again once the disk is healthy.", step_applied=False,
                ) from error
            slot = position % len(windows)
            pending = read((position + 1) % len(windows), wanted[position + 1]) if position + 1 < len(wanted) else None
            numel = ranges[index][1]
            try:
                visit(index, {name: tensor[:numel] for name, tensor in windows[slot].tensors.items()})
            except BaseException:
                if pending is not None:
                    pending.wait()  # nothing may still fill a window we give back
                raise

    def _walk(self, ranges: list[tuple[int, int]], visit: Visitor, skip: set[int]) -> None:
        source, target = self.generation, self._other()
        free = deque(self._window(key) for key in range(min(self.buffer_count, max(len(ranges), 1))))
        reading: dict[int, _Window] = {}
        writing: deque[_Window] = deque()
        failures: list[BaseException] = []
        next_read = 0

        def issue_reads() -> None:
            nonlocal next_read
            while free and next_read < len(ranges):
                window = free.popleft()
                offset, numel = ranges[next_read]
                futures = [
                    future for name in self.names
                    for future in self.disk.read(
                        self.files[f"{name}.{source}"], window.tensors[name][:numel], offset * FP32_BYTES
                    )
                ]
                window.transfer = Transfer(lambda error: None).track(futures)
                reading[next_read] = window
                next_read += 1

        def reclaim(block: bool) -> None:
            """Give back the windows whose writes have landed (with `block`, wait for the oldest first)."""
            while writing:
                transfer = writing[0].transfer
                assert transfer is not None
                if not block and not transfer.done:
                    return
                window = writing.popleft()
                error = transfer.wait()
                if error is not None:
                    failures.append(error)
                window.transfer = None
                free.append(window)
                block = False

        try:
            for index, (offset, numel) in enumerate(ranges):
                reclaim(block=False)
                issue_reads()
                while index not in reading:
                    reclaim(block=True)  # every window is writing: wait for the oldest
                    issue_reads()
                window = reading.pop(index)
                assert window.transfer is not None
                error = window.transfer.wait()
                window.transfer = None
                if error is not None:
                    failures.append(error)
                if failures:
                    raise failures[0]
                views = {name: tensor[:numel] for name, tensor in window.tensors.items()}
                if index not in skip:
                    visit(index, views)
                futures = [
                    future for name in self.names
                    for future in self.disk.write(self.files[f"{name}.{target}"], views[name], offset * FP32_BYTES)
                ]
                window.transfer = Transfer(lambda error: None).track(futures)
                writing.append(window)
            while writing:
                reclaim(block=True)
            if failures:
                raise failures[0]
        except BaseException as error:
            for window in list(reading.values()) + list(writing):
                if window.transfer is not None:
                    window.transfer.wait()  # nothing may still fill or drain a window we give back
            if not isinstance(error, OSError):
                raise
            raise StepIOError(
                f"the optimizer step failed on disk under {self.disk.directory}: {error}. It was not applied: "
                f"the optimizer state on disk is as it was before the step (generation {source}) and the "
                "gradients are kept; call engine.step() again once the disk is healthy.",
                step_applied=False,
            ) from error
        self.written = target

    def commit(self) -> None:
        if self.written is not None:
            self.generation, self.written = self.written, None

    def abandon(self) -> None:
        self.written = None

    def close(self) -> None:
        for file in self.files.values():
            file.remove()
        self.pool.drop("optim-window:")
