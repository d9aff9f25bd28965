"""A named flat 1-D tensor that per-parameter slots point into.

Slots hold (buffer, offset, numel) rather than views, so a buffer can be moved
or reallocated (offload, reload, consolidation) without stale views anywhere.

[Note: buffer residency]
Every read of a state's storage goes through `FlatBuffer.tensor`, so the
offload tier can change where the data lives without the rest of the engine
knowing. While a state is parked on disk (or after `destroy()`) its tensor is
a `meta` tensor of the same shape (memory holds none of it) and reading raises
`StateOffloadedError`.
While a copy into the buffer is in flight (a non-blocking reload), the buffer
carries a completion callback that the first reader runs, so a read before
an explicit sync waits for the data instead of seeing garbage.

[Note: buffer homes]
A buffer has a home, where its tier keeps it between uses: the device, host
memory ("cpu"), or a file ("nvme", ZeRO-Infinity). A buffer whose home is a
file has no tensor at all: its `store` reads and writes ranges of the file,
and whoever needs the data in memory (the optimizer's sub-group windows, a
unit's shard before its all-gather) reads a range. `Slot.read`/`Slot.write`
work wherever the tier keeps the data; `Slot.view` only where it is in memory.
A buffer parked on disk by `offload_states` is not in use (those raise), but
`file` names the file that holds its bytes either way (its home file, or the
one it is parked in), and `read_into` reads a range from wherever it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch


class StateOffloadedError(RuntimeError):
    """A state was used while it is offloaded (call `engine.reload_states()` first)."""


class FileReader(Protocol):
    """A file that holds a buffer's bytes (supplied by zero3.offload). Offsets in elements; `into` is
    a contiguous host tensor of the buffer's dtype."""

    def read(self, offset: int, into: torch.Tensor) -> None: ...


class BackingStore(FileReader, Protocol):
    """The file a buffer whose home is disk lives in: read and written in place."""

    def write(self, offset: int, source: torch.Tensor) -> None: ...


class FlatBuffer:
    """One state's flat storage on one rank."""

    def __init__(self, name: str, tensor: torch.Tensor, state: str | None = None) -> None:
        if tensor.dim() != 1:
            raise ValueError(f"flat buffer {name!r} must be 1-D, got shape {tuple(tensor.shape)}")
        self.name = name
        # The offloadable state this buffer belongs to (an OffloadStateType value).
        self.state = state or name
        self._tensor = tensor
        self._complete: Callable[[], None] | None = None
        self._released_because = ""
        # Where the tier keeps it (see [Note: buffer homes]); a file's store when that is disk.
        self.home = str(tensor.device)
        self.store: BackingStore | None = None
        self._parked_in: FileReader | None = None  # the file offload_states parked it in
        # Run before `write_range` and `fill` change the data: a save may be reading it in place
        # (zero3.checkpoint.shared_state sets it).
        self.before_write: Callable[[], None] | None = None

    # ---- the data ----------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The data, waiting for an in-flight copy first; raises if parked on disk."""
        self.wait()
        if self._tensor.is_meta:
            raise StateOffloadedError(f"state {self.state!r} (buffer {self.name!r}) {self._released_because}")
        return self._tensor

    @tensor.setter
    def tensor(self, value: torch.Tensor) -> None:
        if value.dim() != 1 or value.numel() != self._tensor.numel():
            raise ValueError(
                f"flat buffer {self.name!r} holds {self._tensor.numel()} elements, got a tensor of shape {tuple(value.shape)}"
            )
        self._tensor = value

    def replace(self, value: torch.Tensor, on_complete: Callable[[], None] | None = None) -> None:
        """Point the buffer at new storage, optionally still being filled (see the Note)."""
        self.tensor = value
        self._complete = on_complete
        self._parked_in = None

    def release(self, because: str) -> None:
        """Drop the storage, keeping shape and dtype; reads raise, naming `because`."""
        self._tensor = torch.empty(self._tensor.shape, dtype=self._tensor.dtype, device="meta")
        self._complete = None
        self._released_because = because
        self._parked_in = None

    def park_in(self, file: FileReader, because: str) -> None:
        """Drop the storage: its bytes are in `file` now (the caller wrote them there). Uses raise,
        naming `because`; `read_into` reads them from the file."""
        self.release(because)
        self._parked_in = file

    def keep_in(self, store: BackingStore, because: str) -> None:
        """Make a file the buffer's home: memory holds none of it from now on (the caller wrote it there)."""
        self.release(because)
        self.store = store
        self.home = "nvme"

    @property
    def file(self) -> FileReader | None:
        """The file that holds the bytes while memory holds none of them: the home file of a disk tier,
        or the file `offload_states` parked the buffer in. None while they are in memory (or freed)."""
        if not self._tensor.is_meta:
            return None
        return self.store if self.store is not None else self._parked_in

    def read_into(self, offset: int, into: torch.Tensor) -> None:
        """Elements [offset, offset + into.numel()) into `into`, from wherever they are: memory (any
        `into`), or the file in `file` (`into` a contiguous host tensor of this dtype). Nothing moves."""
        self.wait()
        file = self.file
        if file is None:
            into.copy_(self.view(offset, into.numel()))  # raises if freed
            return
        if into.dtype != self.dtype or into.device.type != "cpu" or not into.is_contiguous():
            raise ValueError(
                f"reading buffer {self.name!r} from its file needs a contiguous host {self.dtype} tensor, "
                f"got {into.dtype} on {into.device}"
            )
        file.read(offset, into)

    def read_range(self, offset: int, numel: int) -> torch.Tensor:
        """Elements [offset, offset+numel): a view when in memory, a fresh host copy when on its file."""
        if self.store is not None and self._tensor.is_meta:
            into = torch.empty(numel, dtype=self.dtype)
            self.store.read(offset, into)
            return into
        return self.view(offset, numel)

    def write_range(self, offset: int, values: torch.Tensor) -> None:
        """Store `values` (cast to the buffer's dtype) at [offset, offset+numel), in memory or on its file."""
        if self.before_write is not None:
            self.before_write()
        if self.store is not None and self._tensor.is_meta:
            self.store.write(offset, values.detach().to("cpu", self.dtype).contiguous())
            return
        target = self.view(offset, values.numel())
        # Host to device runs behind the compute stream's later work (safe to overlap); the reverse
        # must land before the host reads it, so it stays blocking.
        target.copy_(values.reshape(-1), non_blocking=target.device.type == "cuda" and values.device.type == "cpu")

    def fill(self, value: float, chunk_numel: int = 1 << 20) -> None:
        """Every element set to `value`, in memory or on its file (a chunk at a time there)."""
        if self.before_write is not None:
            self.before_write()
        if not (self.store is not None and self._tensor.is_meta):
            self.tensor.fill_(value)
            return
        chunk = torch.full((min(chunk_numel, self.numel),), value, dtype=self.dtype)
        for offset in range(0, self.numel, chunk.numel()):
            self.write_range(offset, chunk[: min(chunk.numel(), self.numel - offset)])

    def wait(self) -> None:
        """Run the pending completion, if any (it may raise; it runs only once)."""
        complete, self._complete = self._complete, None
        if complete is not None:
            complete()

    # ---- facts that need no data ---------------------------------------------
    @property
    def parked(self) -> bool:
        return self._tensor.is_meta

    @property
    def device(self) -> torch.device:
        return self._tensor.device

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    @property
    def numel(self) -> int:
        return self._tensor.numel()

    @property
    def nbytes(self) -> int:
        return self._tensor.numel() * self._tensor.element_size()

    def view(self, offset: int, numel: int) -> torch.Tensor:
        return self.tensor.narrow(0, offset, numel)


@dataclass(frozen=True)
class Slot:
    """A parameter's (or a unit's) contiguous region of a flat buffer."""

    buffer: FlatBuffer
    offset: int
    numel: int

    def view(self) -> torch.Tensor:
        return self.buffer.view(self.offset, self.numel)

    def read(self) -> torch.Tensor:
        """The values wherever they live (a view in memory, a copy from disk)."""
        return self.buffer.read_range(self.offset, self.numel)

    def write(self, values: torch.Tensor) -> None:
        self.buffer.write_range(self.offset, values)
