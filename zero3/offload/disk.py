"""File I/O: a rank's directories of state files, and the engine that moves their bytes.

Parking (`offload_states`) and the ZeRO-Infinity tiers use this one layer:
one file format (a flat buffer's raw bytes, one file per buffer), one I/O
engine. Callers type against `FileIO`; `ThreadPoolFileIO` is the engine
today (a GPUDirect Storage engine would be another). "Disk" here is any
file, NVMe or not.

[Note: disk I/O]
Each buffer is one file, reserved up front with `posix_fallocate` (so a full
disk or a file-size limit fails before any state changes, and the file is
laid out contiguously), then written or read in chunks of `aio.block_size`
bytes by a thread pool of `aio.thread_count * aio.queue_depth` workers: that
many `pwrite`/`preadv` requests in flight, each a plain syscall that releases
the GIL. A request may cover a range of a file (a tier reads one sub-group or
one unit at a time). CPU tensors are written from, and read into, their own
memory: no staging copy. Parked files are private scratch, not checkpoints:
they are not fsynced, and are removed once read back, off the caller's path.

A reload needs fresh memory; `empty_host` maps it anonymously with
transparent huge pages advised (2 MiB faults instead of 4 KiB ones), which
also lets a later offload hand it straight back to the OS.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from zero3.helper_threads import HelperThreads

CHUNK_BYTES = 16 << 20  # large enough to stream, small enough to spread over the threads
IO_THREADS = 4
# A script that ends with disk work queued (a parked state's files being removed) gives it this long.
FINISH_AT_EXIT_S = 30.0


class OffloadIOError(RuntimeError):
    """Disk offload or reload failed; the message says which file, what was asked, and what was kept."""


class StepIOError(OffloadIOError):
    """An optimizer step failed on a disk tier. `step_applied` says whether it landed:

    False: the state is as before the step and the gradients are kept; call `engine.step()` again.
    True: the optimizer state was updated but some 16-bit shards were not written; they are
    rewritten from the masters before the next forward. Do not repeat the step.
    """

    def __init__(self, message: str, step_applied: bool) -> None:
        super().__init__(message)
        self.step_applied = step_applied


HUGE_PAGE_BYTES = 2 << 20


def empty_host(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised host memory for a reload, huge-page backed where the kernel allows it."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_BYTES or advise is None:
        return torch.empty(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advise)
    except OSError:
        pass  # THP disabled ("never"): ordinary pages, same data
    # The tensor keeps the mapping alive; when the tensor is freed, the pages go back to the OS.
    return torch.frombuffer(region, dtype=dtype, count=numel)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory (any dtype, bf16 included)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


def _naming(path: Path, error: OSError) -> OSError:
    """The OS's error with the file it hit (pwrite and preadv report none)."""
    if error.filename is not None or error.errno is None:
        return error
    return OSError(error.errno, error.strerror, str(path))


def _pwrite_all(fd: int, held: list[memoryview], offset: int, path: Path) -> None:
    # The chunk comes in a list the write empties: the executor's work item keeps its arguments until
    # after the future's callbacks ran, and a parked buffer's memory must be free when they do.
    data = held.pop()
    try:
        while data:
            written = os.pwrite(fd, data, offset)
            data = data[written:]
            offset += written
    except OSError as error:
        raise _naming(path, error) from None


def _pread_all(fd: int, into: memoryview, offset: int, path: Path) -> None:
    try:
        while into:
            count = os.preadv(fd, [into], offset)
            if count == 0:
                raise OSError(f"{path} ended at byte {offset}, before the buffer was filled")
            into = into[count:]
            offset += count
    except OSError as error:
        raise _naming(path, error) from None


class Transfer:
    """A set of chunk requests, and a completion that runs once when all of them have ended.

    Made before any request is submitted (so whoever must wait on it can be
    told first), then given its requests with `track`. `on_done(error)` runs
    in whichever thread finishes the last request; `wait()` blocks until it
    has run and returns the first error, or None.
    """

    def __init__(self, on_done: Callable[[BaseException | None], None]) -> None:
        self._on_done = on_done
        self._remaining = 0
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._finished = threading.Event()

    def track(self, futures: list[Future]) -> "Transfer":
        if not futures:
            self._finish()
            return self
        self._remaining = len(futures)
        for future in futures:
            future.add_done_callback(self._request_done)
        return self

    def _request_done(self, future: Future) -> None:
        with self._lock:
            error = future.exception()
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._finish()

    def _finish(self) -> None:
        try:
            self._on_done(self._error)
        except BaseException as error:  # noqa: BLE001 - reported by wait(), never lost in a worker
            self._error = self._error or error
        finally:
            self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> BaseException | None:
        self._finished.wait()
        return self._error


class DiskFile:
    """One reserved file (a parked buffer's, or a tier's); its descriptor stays open until it is removed."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        self.nbytes = nbytes
        # O_EXCL: a rank's directory holds only its own live files; never truncate one of them.
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            if nbytes:
                os.posix_fallocate(self.fd, 0, nbytes)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


class FileIO(Protocol):
    """What the offload code asks of an I/O engine: reserve files, move bytes between them and
    contiguous host tensors, remove them.

    `read`/`write` only submit: each returns the futures of its requests (a `Transfer` tracks them),
    and `read_now`/`write_now` wait and raise the first failure. Offsets are in bytes. `directory`
    is where parked states go (the latest root asked for); `bytes_read`/`bytes_written` count what
    was asked of the disk (benchmarks read them).
    """

    directory: Path | None
    bytes_read: int
    bytes_written: int

    def reserve(self, root: Path, files: dict[str, int], purpose: str = "offload") -> dict[str, DiskFile]:
        """Create and reserve every file (name -> bytes) in this rank's directory under `root`, or none:
        raises OffloadIOError."""
        ...

    def write(self, file: DiskFile, source: torch.Tensor, offset: int = 0) -> list[Future]: ...

    def read(self, file: DiskFile, into: torch.Tensor, offset: int | None = None) -> list[Future]: ...

    def write_now(self, file: DiskFile, source: torch.Tensor, offset: int = 0) -> None: ...

    def read_now(self, file: DiskFile, into: torch.Tensor, offset: int = 0) -> None: ...

    def discard(self, files: list[DiskFile]) -> None:
        """Remove files in the background; `finish_removals` waits for them."""
        ...

    def finish_removals(self) -> None: ...

    def close(self) -> None:
        """Finish everything in flight and remove every file and directory this engine made."""
        ...


class ThreadPoolFileIO:
    """The `FileIO` engine on a thread pool: `pwrite`/`preadv` in chunks (see [Note: disk I/O]),
    and this rank's directories under the configured roots."""

    def __init__(self, rank: int, chunk_bytes: int = CHUNK_BYTES, threads: int = IO_THREADS) -> None:
        self.rank = rank
        self.chunk_bytes = chunk_bytes
        self.threads = threads
        # The directory parked states go to (the latest root asked for), and every directory made.
        self.directory: Path | None = None
        self._directories: dict[Path, Path] = {}
        self._pool: HelperThreads | None = None
        self._removals: list[Future] = []
        # Bytes asked of the disk since the engine was built (benchmarks read them).
        self.bytes_read = 0
        self.bytes_written = 0

    def _executor(self) -> HelperThreads:
        if self._pool is None:
            self._pool = HelperThreads(self.threads, "zero3-disk", finish_at_exit_s=FINISH_AT_EXIT_S)
        return self._pool

    def reserve(self, root: Path, files: dict[str, int], purpose: str = "offload") -> dict[str, DiskFile]:
        """Create and reserve every file (name -> bytes), or none of them: raises OffloadIOError."""
        needed = sum(files.values())
        created: dict[str, DiskFile] = {}
        self.finish_removals()
        try:
            directory = self.directory_under(root)
            free = shutil.disk_usage(directory).free
            if needed > free:
                raise OSError(f"{needed} bytes are needed and {free} are free")
            for name, nbytes in files.items():
                created[name] = DiskFile(directory / f"{name.replace(':', '-')}.bin", nbytes)
        except OSError as error:
            for file in created.values():
                file.remove()
            self.remove_directory_if_empty()
            raise OffloadIOError(
                f"cannot {purpose} {sorted(files)} ({needed} bytes) to disk under {str(root)!r}: {error}. "
                "Nothing was moved: every state is where it was."
            ) from error
        return created

    def directory_under(self, root: Path) -> Path:
        """This rank's private directory under `root` (made once; parked states go to the latest)."""
        directory = self._directories.get(root)
        if directory is None or not directory.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            directory = Path(tempfile.mkdtemp(prefix=f"zero3-rank{self.rank}-", dir=root))
            self._directories[root] = directory
        self.directory = directory
        return directory

    def write(self, file: DiskFile, source: torch.Tensor, offset: int = 0) -> list[Future]:
        """Submit the writes of a contiguous CPU tensor's bytes to `file` at byte `offset`, in chunks."""
        data = _byte_view(source)
        if offset + len(data) > file.nbytes:
            raise ValueError(f"{file.path} holds {file.nbytes} bytes; cannot write {len(data)} at {offset}")
        self.bytes_written += len(data)
        return [
            self._executor().submit(
                _pwrite_all, file.fd, [data[start : start + self.chunk_bytes]], offset + start, file.path,
            )
            for start in range(0, len(data), self.chunk_bytes)
        ]

    def read(self, file: DiskFile, into: torch.Tensor, offset: int | None = None) -> list[Future]:
        """Submit the reads of `file` (from byte `offset`; the whole file when None) into a contiguous CPU tensor."""
        data = _byte_view(into)
        if offset is None:
            if len(data) != file.nbytes:
                raise ValueError(f"{file.path} holds {file.nbytes} bytes, the buffer {len(data)}")
            offset = 0
        elif offset + len(data) > file.nbytes:
            raise ValueError(f"{file.path} holds {file.nbytes} bytes; cannot read {len(data)} at {offset}")
        self.bytes_read += len(data)
        return [
            self._executor().submit(
                _pread_all, file.fd, data[start : start + self.chunk_bytes], offset + start, file.path
            )
            for start in range(0, len(data), self.chunk_bytes)
        ]

    def write_now(self, file: DiskFile, source: torch.Tensor, offset: int = 0) -> None:
        """Write and wait; raises the first failure."""
        _wait_all(self.write(file, source.contiguous(), offset))

    def read_now(self, file: DiskFile, into: torch.Tensor, offset: int = 0) -> None:
        """Read and wait; raises the first failure."""
        _wait_all(self.read(file, into, offset))

    def discard(self, files: list[DiskFile]) -> None:
        """Remove files in the background; `finish_removals` waits for them."""
        self._removals.extend(self._executor().submit(file.remove) for file in files)

    def finish_removals(self) -> None:
        removals, self._removals = self._removals, []
        for removal in removals:
            removal.result()
        self.remove_directory_if_empty()

    def remove_directory_if_empty(self) -> None:
        for root, directory in list(self._directories.items()):
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
            if not directory.is_dir():
                del self._directories[root]
                if self.directory == directory:
                    self.directory = None

    def close(self) -> None:
        self.finish_removals()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for directory in self._directories.values():
            shutil.rmtree(directory, ignore_errors=True)
        self._directories.clear()
        self.directory = None


def _wait_all(futures: list[Future]) -> None:
    error: BaseException | None = None
    for future in futures:
        failure = future.exception()
        error = error or failure
    if error is not None:
        raise error
