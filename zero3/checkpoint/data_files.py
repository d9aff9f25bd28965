"""A rank's DCP data file, written in one pass: each item summed as it is written, the file bypassing the
page cache where the filesystem allows it.

[Note: one pass per data file]
DCP's file writer `torch.save`s each item into a buffered file (about 40
Python write calls per item), clones an item that views a larger storage, and
zero3 then read every file back to sum its items. Half of that CPU time is
the kernel's: a buffered write takes, dirties and writes back page-cache
pages, where the same bytes written with `O_DIRECT` from an aligned buffer
cost a small fraction of it (docs/benchmarks.md, "Measurements behind the
design"). The cores are training meanwhile, so every CPU-second the writer
takes is taken from the step: with a save every step, it is most of what
checkpointing costs the training.

So `DataFileWriter` writes the file itself, front to back, through one
aligned buffer (`DirectFile`), with `O_DIRECT` where the filesystem takes it
and buffered writes where it does not (tmpfs before Linux 6.6, some network
filesystems: the open or the first write says so). A large item (64 KiB or
more) skips the buffer: a gap before it puts its data at the place within a
page of the file that it has within a page of memory (the staging segment
starts each on a page: zero3.checkpoint.staging), so its whole pages go to
the disk from where they are, without a copy of the state; only its first and
last part-pages pass through the buffer. Each item's bytes are what `torch.save` writes for
it, so torch's own `FileSystemReader` reads the files as before (the gaps are
in no item); they are summed (XXH3, zero3.checkpoint.tags' [Note: checksums])
from memory as they go out.

Where the process saves without torch's zip CRC-32 (the writer process:
zero3.checkpoint.writer_process), `torch.save`'s bytes for a tensor depend
on its data only in the data record: the rest is a function of its dtype and
shape. Each (dtype, shape) is saved once with every data byte 0x00 and once
with 0xFF; what differs is the data record, and what does not is kept
(`SavedForm`) and written around each later item's bytes, with no call into
`torch.save` at all. Where a form cannot be found that way (a torch whose
bytes vary otherwise) or the CRC is on (a blocking save in the training
process, whose `torch.save` config is the user's), each item goes through
`torch.save` into the same stream, as DCP's writer did.

With this writer, DCP's plan cached (zero3.checkpoint.planners) and the state
handed to DCP in three groups (zero3.checkpoint.tag_write's `grouped`), a save
costs the writer a fraction of what it did (`benchmarks/checkpoint.py
--overhead`; the figures in docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import io
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
import torch.utils.serialization.config as torch_serialization_config
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from zero3.checkpoint.staging import LARGE, PAGE  # O_DIRECT's alignment (a page covers 512-byte sectors)
from zero3.checkpoint.tags import Checksum, FileSums, ItemSums, RunningSum

_BUFFER = 8 << 20  # bytes written per call


class DirectFile:
    """A file written front to back through one page-aligned buffer: with `O_DIRECT` where the filesystem
    takes it (no page-cache pages to take, dirty and write back), buffered where it does not. Large
    bytes (`write_large`) go to the file straight from their memory, without the buffer."""

    def __init__(self, path: Path, direct: bool = True) -> None:
        self.path = path
        # Not truncated: a recycled file is written over in place, then cut to what was written ([Note:
        # recycled data files] in zero3.checkpoint.tags).
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as error:
            if not self.direct or error.errno != errno.EINVAL:
                raise
            self.direct = False  # the filesystem refuses O_DIRECT at open (tmpfs before Linux 6.6)
            self._fd = os.open(path, flags, 0o644)
        self._buffer = mmap.mmap(-1, _BUFFER)  # page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self._filled = 0  # bytes waiting in the buffer
        self._flushed = 0  # bytes in the file
        self._old_size = os.fstat(self._fd).st_size  # what the file held before (a recycled file's)

    def tell(self) -> int:
        return self._flushed + self._filled

    def write(self, data: memoryview | bytes) -> int:
        source = memoryview(data).cast("B")
        taken = 0
        while taken < len(source):
            step = min(_BUFFER - self._filled, len(source) - taken)
            self._view[self._filled : self._filled + step] = source[taken : taken + step]
            self._filled += step
            taken += step
            if self._filled == _BUFFER:
                self._send(self._view[:_BUFFER])
                self._filled = 0
        return taken

    def write_large(self, data: memoryview, address: int) -> None:
        """`data` (at memory `address`) to the file without copying it into the buffer: all of it where the
        file is buffered; with O_DIRECT, where it sits at the same place within a page of memory as the file
        is within a page, its whole pages, and the rest (its first and last part-pages) through the buffer."""
        if not self.direct:
            self._send_buffer()
            self._send(data)
            return
        if (address - self.tell()) % PAGE:
            self.write(data)
            return
        head = min(-address % PAGE, len(data))
        self.write(data[:head])  # completes the file's page: the buffer holds whole pages now
        self._send_buffer()
        body = head + (len(data) - head) // PAGE * PAGE
        self._send(data[head:body])
        self.write(data[body:])

    def _send_buffer(self) -> None:
        if self._filled:
            self._send(self._view[: self._filled])
            self._filled = 0

    def flush(self) -> None:
        """torch.save calls it; the buffer goes out when full or at `close`."""

    def close(self) -> int:
        """Write what is left, make it durable, close; returns the file's size in bytes."""
        try:
            size = self.tell()
            tail = self._filled
            if tail:
                padded = -(-tail // PAGE) * PAGE if self.direct else tail
                self._view[tail:padded] = bytes(padded - tail)
                self._send(self._view[:padded])
                self._filled = 0
            if self._flushed != size or self._old_size > size:
                os.ftruncate(self._fd, size)  # O_DIRECT's padding, or the end of what the file held before
                self._flushed = size
            os.fsync(self._fd)
            return size
        finally:
            self._release()

    def abandon(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._view.release()
        try:
            self._buffer.close()
        except BufferError:  # a slice still held (by a failed write's traceback): unmapped when it goes
            pass

    def _send(self, data: memoryview) -> None:
        written = 0
        while written < len(data):
            try:
                written += os.write(self._fd, data[written:])
            except OSError as error:
                # Some filesystems take O_DIRECT at open and refuse it at the first write: go on buffered.
                if not self.direct or error.errno != errno.EINVAL or self._flushed or written:
                    raise
                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False
        self._flushed += written


@dataclass(frozen=True)
class SavedForm:
    """What `torch.save` writes for a tensor of one dtype and shape (its own storage, no CRC), around the
    tensor's bytes: `prefix` + the bytes + `suffix` (see [Note: one pass per data file])."""

    prefix: bytes
    suffix: bytes


class _Recorder:
    """Where `torch.save` writes while a form is found: each call's bytes, in order (a large call, which only
    the data record can be, as its length and sum)."""

    def __init__(self) -> None:
        self.calls: list[bytes | tuple[int, int]] = []

    def write(self, data: memoryview | bytes) -> int:
        length = memoryview(data).nbytes
        self.calls.append(bytes(data) if length <= _SMALL else (length, xxhash.xxh3_64_intdigest(data)))
        return length

    def flush(self) -> None:
        pass


_SMALL = 64 << 10  # bytes: a save's calls up to this size are kept whole while its form is found


def saved_form(dtype: torch.dtype, shape: tuple[int, ...]) -> SavedForm | None:
    """The form of a (dtype, shape) tensor's `torch.save` bytes in this process, or None where its bytes
    outside the data record depend on the data (torch's CRC-32 is on, or its format varies otherwise)."""
    return None if crc_is_on() else _form_without_crc(dtype, shape)


def crc_is_on() -> bool:
    """Whether this process's `torch.save` writes zip CRC-32s (torch's default)."""
    return bool(torch_serialization_config.save.compute_crc32)


@contextlib.contextmanager
def saves_without_crc() -> Iterator[None]:
    """`torch.save` without the zip CRC-32 for the duration (each item's form then applies: the Note above),
    the process's setting restored after. For a process that saves only zero3's files meanwhile (the
    import command): torch.load never reads the CRC, and zero3 checks its own sums."""
    before = torch_serialization_config.save.compute_crc32
    torch_serialization_config.save.compute_crc32 = False
    try:
        yield
    finally:
        torch_serialization_config.save.compute_crc32 = before


@functools.lru_cache(maxsize=4096)
def _form_without_crc(dtype: torch.dtype, shape: tuple[int, ...]) -> SavedForm | None:
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    saved = []
    for fill in (0x00, 0xFF):
        tensor = torch.full((nbytes,), fill, dtype=torch.uint8).view(dtype).view(shape) if nbytes else \
            torch.empty(shape, dtype=dtype)
        recorder = _Recorder()
        torch.save(tensor, recorder)  # type: ignore[arg-type]
        saved.append(recorder.calls)
        del tensor
    zeros, ones = saved
    if len(zeros) != len(ones):
        return None
    differing = [index for index, (a, b) in enumerate(zip(zeros, ones)) if a != b]
    if not differing:  # no data bytes: the whole is the form
        whole = _joined(zeros)
        return SavedForm(whole, b"") if nbytes == 0 and whole is not None else None
    if len(differing) != 1:
        return None
    data, found = differing[0], zeros[differing[0]]
    if isinstance(found, tuple):
        if found[0] != nbytes:
            return None
    elif found != bytes(nbytes) or ones[data] != b"\xff" * nbytes:
        return None
    prefix, suffix = _joined(zeros[:data]), _joined(zeros[data + 1 :])
    return SavedForm(prefix, suffix) if prefix is not None and suffix is not None else None


def _joined(calls: list[bytes | tuple[int, int]]) -> bytes | None:
    """The calls' bytes, or None if one was too large to keep (only a data record is that large)."""
    kept = [call for call in calls if isinstance(call, bytes)]
    return b"".join(kept) if len(kept) == len(calls) else None


class _Summed:
    """A stream that sums what passes through it."""

    def __init__(self, sink: DirectFile, running: RunningSum) -> None:
        self._sink = sink
        self.running = running

    def write(self, data: memoryview | bytes) -> int:
        self.running.update(data)
        return self._sink.write(data)

    def write_tensor(self, tensor: torch.Tensor) -> None:
        """A contiguous tensor's bytes, a large one without a copy into the file's buffer."""
        data = _bytes_of(tensor)
        self.running.update(data)
        if len(data) >= LARGE:
            self._sink.write_large(data, tensor.data_ptr())
        else:
            self._sink.write(data)

    def flush(self) -> None:
        pass


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy; the caller keeps the tensor alive while it reads them
    (a view through ctypes, several times cheaper than one through NumPy, per item of every save)."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with a storage of exactly its bytes: torch.save writes a view's whole storage."""
    tensor = tensor.detach()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


class DataFileWriter(FileSystemWriter):
    """DCP's file writer (one file per rank, DCP's names and metadata), each file written by `DirectFile`
    with every item summed as it is written (see [Note: one pass per data file]); `sums` holds this rank's
    files' entries for the engine file."""

    def __init__(self, path: Path, checksum: Checksum, on_read: Callable[[], None] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self._root = Path(path)
        self._checksum = checksum
        # Told once every item has gone to the file (before its sync): the state it read may change from then.
        self._on_read = on_read
        self.sums: dict[str, FileSums] = {}
        self.results: list[WriteResult] = []  # this rank's, once written
        self.all_results: list[list[WriteResult]] | None = None  # every rank's, where this rank coordinated

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        file = DirectFile(self._root / name)
        results: list[WriteResult] = []
        items: ItemSums = {}
        try:
            # DCP's order: pickled objects first, then tensors, each as its plan lists them.
            ordered = [i for i in plan.items if i.type == WriteItemType.BYTE_IO] + \
                      [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
            with_forms = not crc_is_on()
            for item in ordered:
                data = planner.resolve_data(item)
                form = _form_without_crc(data.dtype, tuple(data.shape)) \
                    if with_forms and isinstance(data, torch.Tensor) else None
                if form is not None and file.direct and data.nbytes >= LARGE:
                    # A gap before the item, so that its data sits where it does within a page of memory
                    # (`write_large` sends its whole pages from there).
                    file.write(bytes((data.data_ptr() - file.tell() - len(form.prefix)) % PAGE))
                offset = file.tell()
                out = _Summed(file, self._checksum.start())
                if isinstance(data, io.BytesIO):
                    out.write(data.getbuffer())
                elif form is not None:
                    out.write(form.prefix)
                    out.write_tensor(data.detach().contiguous())
                    out.write(form.suffix)
                else:
                    torch.save(_own_storage(data), out)  # type: ignore[arg-type]
                length = file.tell() - offset
                items[offset] = (length, out.running.intdigest())
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            if self._on_read is not None:
                self._on_read()
            size = file.close()
        except BaseException:
            file.abandon()
            raise
        self.sums[name] = (size, items)
        self.results = results
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)  # DCP waits on it
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        super().finish(metadata, results)
        self.all_results = results  # zero3.checkpoint.repeat_saves remembers them
