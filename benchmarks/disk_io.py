#!/usr/bin/env python
"""By-hand disk I/O benchmark: which way should offloaded training state go to and from disk?

Not a test: nothing here asserts on timings. It does assert on correctness:
every read-back is compared with what was written (``torch.equal`` on int64
views of the bytes; each 4 KiB page of the source carries its page index, so a
chunk landing at the wrong offset is caught too), and a mismatch stops the run.

One buffer of ``--gib`` GiB + ``--tail-bytes`` (default 2468, so the size is
not a multiple of 4096, as a flat bf16 buffer's seldom is) is written to a
fresh file in ``--dir`` and read back, once per path (``--repeats`` for
medians). Every buffer is page-aligned anonymous memory (``mmap``), touched
before any timing, for every path alike. The paths carry their own I/O code
(only the argument checks come from zero3):

* ``plain sequential`` -- the baseline: ONE ``open(path, "wb").write(memoryview)``
  of the whole buffer, then ``os.fsync``; a read is ONE ``f.readinto`` of the
  preallocated buffer (``open(path, "rb")``: its readinto loops over the
  kernel's 2 GiB-per-read(2) cap). Run first and again last; ratios are
  against the mean of the two, and the two show any drift of the disk.
* ``pool`` -- zero3's approach today (zero3/offload/disk.py): a file reserved
  with ``posix_fallocate``, a ``ThreadPoolExecutor`` of ``--threads`` workers
  issuing ``os.pwrite`` / ``os.preadv`` of ``--chunks-mib`` chunks. A grid:
  every chunk x every thread count, buffered (page cache) and with
  ``O_DIRECT``.
* ``io_uring`` (PyPI ``liburing``, the Cython API of 2024.5.3) and ``libaio``
  (PyPI ``libaio``, ctypes over libaio.so.1): one thread keeping ``--depth``
  requests of ``--binding-chunk-mib`` in flight, buffered and O_DIRECT. Each
  candidate binding (also ``pyuring`` and ``caio``) is first probed in a
  child process (a crash such as SIGILL is reported, not suffered); one line
  per candidate says what happened. They are importable only where installed:
  run the script with the venv's python (see below).

O_DIRECT: the file descriptor is opened with ``O_DIRECT`` and every request
is 4096-aligned (address, offset and length; the chunk sizes are multiples of
4096). The tail (the bytes past the last 4096 boundary) goes through a second,
buffered descriptor of the same file: a final buffered ``pwrite`` / ``pread``,
inside the timed region. The file is not padded.

Timings per path (GB = 1e9 bytes, ``time.perf_counter``):

* ``write returns`` -- until the last write call has returned. Buffered:
  the bytes are in the page cache, which is what a training step waits for
  when the files are scratch (never fsynced). O_DIRECT: the device has them.
* ``write + fsync`` -- the same plus ``os.fsync``: durable.
* ``read`` -- after ``fsync`` and ``posix_fadvise(POSIX_FADV_DONTNEED)`` of
  the whole file (untimed), so the bytes come from the disk. That the drop
  worked is checked with ``mincore(2)`` (the resident fraction is reported),
  and, on the plain baseline, by a second, cached read of the same file
  (reported as ``plain cached read``).

``posix_fallocate`` (pool and bindings) is untimed and reported apart. Dirty
page limits (``vm.dirty_*``) decide how much a buffered write may park in
the page cache before it is throttled to disk speed; they are recorded.

    python3 benchmarks/disk_io.py                         # defaults: 4 GiB, ~8 min on a 2-core VM
    python3 benchmarks/disk_io.py --gib 8 --chunks-mib 4,16 --threads 1,4
    /tmp/iovenv/bin/python benchmarks/disk_io.py          # also io_uring / libaio, where installed

The venv for the bindings (they are not dependencies of zero3):

    python3 -m venv --system-site-packages /tmp/iovenv
    apt-get install libaio1                               # libaio.so.1, for PyPI libaio
    /tmp/iovenv/bin/pip install libaio 'liburing==2024.5.3' --no-binary liburing

Results: a table on stdout and JSON at ``--json`` (default
``benchmarks/results/disk_io.json``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from offload import evict  # benchmarks/offload.py: fsync + POSIX_FADV_DONTNEED per file
from zero3.cli import non_negative_int, positive_float, positive_int

ALIGN = 4096  # O_DIRECT alignment used for addresses, offsets and lengths
PAGE = mmap.PAGESIZE
MIB = 1 << 20
GIB = 1 << 30
POISON = 0xA5  # written over the first 8 bytes of every destination page before a read
_REPO = Path(__file__).resolve().parent.parent
_DEFAULT_OUT = _REPO / "benchmarks" / "results" / "disk_io.json"

PLAIN = "plain sequential"
CANDIDATES = ("liburing", "libaio", "pyuring", "caio")
BENCHMARKED_BINDINGS = ("liburing", "libaio")
# What happened on the machine this was written on, shown when a candidate is not importable.
INSTALL_NOTES = {
    "liburing": "pip install 'liburing==2024.5.3' --no-binary liburing (builds from source; the 2026.3.30 "
    "wheel, a Zig build, dies with SIGILL in Ring() on CPUs without the features it was built for)",
    "libaio": "pip install libaio; it loads the system libaio.so.1 (apt-get install libaio1)",
    "pyuring": "its sdist builds a C library against the system liburing headers and needs newer ones "
    "than Debian 12's liburing-dev 2.3 (IORING_OP_RECV_ZC undeclared)",
    "caio": "pip install caio",
}


class CorrectnessError(AssertionError):
    """A read-back differs from what was written."""


# ------------------------------------------------------------------------ memory


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class AlignedBuffer:
    """`nbytes` of page-aligned anonymous memory (mmap), padded to whole pages and touched up front."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, _round_up(max(nbytes, 1), PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.padded = torch.frombuffer(self._map, dtype=torch.uint8)  # whole pages
        self.tensor = self.padded[:nbytes]
        self.view = memoryview(self._map).cast("B")[:nbytes]

    def fill_pattern(self, seed: int) -> None:
        """Random bytes (a 64 MiB random block, tiled), each page stamped with its index in its first 8 bytes."""
        generator = torch.Generator().manual_seed(seed)
        block = min(64 * MIB, self.padded.numel())
        pattern = torch.randint(0, 256, (block,), dtype=torch.uint8, generator=generator)
        whole = self.padded.numel() // block * block
        self.padded[:whole].view(-1, block).copy_(pattern)
        self.padded[whole:].copy_(pattern[: self.padded.numel() - whole])
        stamps = self.padded.view(torch.int64).view(-1, PAGE // 8)[:, 0]
        stamps.copy_(torch.arange(stamps.numel(), dtype=torch.int64))

    def poison(self) -> None:
        """Overwrite the first 8 bytes of every page, so a read that skipped a page cannot pass."""
        self.padded.view(-1, PAGE)[:, :8].fill_(POISON)

    def equals(self, other: AlignedBuffer) -> bool:
        """Byte-for-byte equality of the first `nbytes` (int64 views for the bulk: ~7x faster than uint8)."""
        if self.nbytes != other.nbytes:
            return False
        bulk = self.nbytes // 8 * 8
        return torch.equal(self.padded[:bulk].view(torch.int64), other.padded[:bulk].view(torch.int64)) and (
            torch.equal(self.tensor[bulk:], other.tensor[bulk:])
        )


# ---------------------------------------------------------------- the page cache

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache: mincore(2) over a read-only mapping (faults nothing in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0.0
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {path}: {os.strerror(err)}")
        try:
            pages = _round_up(size, PAGE) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore of {path}: {os.strerror(err)}")
            resident = int(torch.frombuffer(vec, dtype=torch.uint8).bitwise_and(1).sum().item())
        finally:
            _libc.munmap(addr, size)
        return resident / pages
    finally:
        os.close(fd)


def drop_cache(path: Path) -> None:
    """fsync the file and drop its pages from the page cache (DONTNEED only drops clean pages)."""
    evict([path])


# ------------------------------------------------------------- other activity


class ActivityMeter:
    """What else the machine did while a row ran: other processes' CPU, and the device's bytes moved.

    The machine's busy CPU time comes from /proc/stat, this process's from os.times(); the device's
    sectors read and written from /proc/diskstats (its name from the directory's filesystem). A row
    expects 2 x its bytes per cycle on the device (one write, one read); much more means someone
    else used the disk while it ran, and its figures are suspect.
    """

    def __init__(self, device: str | None) -> None:
        self.device = device
        self._tick = os.sysconf("SC_CLK_TCK")

    def _busy_s(self) -> float:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / self._tick  # user nice system idle iowait irq softirq steal

    def _device_bytes(self) -> int | None:
        if self.device is None:
            return None
        with open("/proc/diskstats", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if fields[2] == self.device:
                    return (int(fields[5]) + int(fields[9])) * 512  # sectors read + written
        return None

    def snapshot(self) -> tuple[float, float, float, int | None]:
        t = os.times()
        return time.perf_counter(), self._busy_s(), t.user + t.system, self._device_bytes()

    @staticmethod
    def since(before: tuple[float, float, float, int | None],
              after: tuple[float, float, float, int | None]) -> dict[str, float | None]:
        wall = after[0] - before[0]
        others = max(0.0, (after[1] - before[1]) - (after[2] - before[2]))
        moved = None if before[3] is None or after[3] is None else float(after[3] - before[3])
        return {"wall_s": wall, "others_cpu_cores": others / wall if wall > 0 else 0.0, "device_bytes": moved}


# ------------------------------------------------------------------- the I/O paths


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data = data[written:]
        offset += written


def _pread_all(fd: int, into: memoryview, offset: int) -> None:
    while into:
        count = os.preadv(fd, [into], offset)
        if count == 0:
            raise OSError(f"the file ended at byte {offset}, before the buffer was filled")
        into = into[count:]
        offset += count


def _chunks(data: memoryview, offset: int, chunk: int) -> list[tuple[int, memoryview]]:
    return [(offset + start, data[start : start + chunk]) for start in range(0, len(data), chunk)]


class ChunkedIO(Protocol):
    """Moves a contiguous range of a file to or from memory, in chunks; blocks until done."""

    def write(self, fd: int, data: memoryview, offset: int) -> None: ...

    def read(self, fd: int, into: memoryview, offset: int) -> None: ...

    def close(self) -> None: ...


class PoolIO:
    """zero3's approach: a thread pool, one pwrite/preadv per chunk (each a syscall that releases the GIL)."""

    def __init__(self, threads: int, chunk: int) -> None:
        self.chunk = chunk
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="disk-io-bench")
        for future in [self._pool.submit(time.sleep, 0.01) for _ in range(threads)]:
            future.result()  # the threads exist before anything is timed

    def _run(self, fn: Callable[[int, memoryview, int], None], fd: int, data: memoryview, offset: int) -> None:
        futures = [self._pool.submit(fn, fd, view, off) for off, view in _chunks(data, offset, self.chunk)]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]

    def write(self, fd: int, data: memoryview, offset: int) -> None:
        self._run(_pwrite_all, fd, data, offset)

    def read(self, fd: int, into: memoryview, offset: int) -> None:
        self._run(_pread_all, fd, into, offset)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _check_result(res: int, view: memoryview, offset: int, reading: bool) -> int:
    """Bytes done by one completed request (a short one is resubmitted by the caller); raises on an error."""
    if res < 0:
        raise OSError(-res, f"{'read' if reading else 'write'} of {len(view)} bytes at {offset}: {os.strerror(-res)}")
    if res == 0 and reading:
        raise OSError(f"the file ended at byte {offset}, before the buffer was filled")
    return res


class UringIO:
    """io_uring through PyPI `liburing` (Cython API, 2024.5.x): one thread, `depth` requests in flight."""

    def __init__(self, depth: int, chunk: int) -> None:
        import liburing

        if not hasattr(liburing, "io_uring"):
            raise RuntimeError(
                f"liburing {getattr(liburing, '__version__', '?')} lacks the Cython API (io_uring, io_uring_cqe) "
                "this benchmark uses; install liburing==2024.5.3"
            )
        self._lib = liburing
        self.depth = depth
        self.chunk = chunk
        self._ring = liburing.io_uring()
        liburing.io_uring_queue_init(depth, self._ring, 0)
        self._cqe = liburing.io_uring_cqe()

    def _run(self, fd: int, data: memoryview, offset: int, reading: bool) -> None:
        lib = self._lib
        pending = deque(_chunks(data, offset, self.chunk))
        in_flight: dict[int, tuple[int, memoryview]] = {}
        token = 0
        while pending or in_flight:
            queued = 0
            while pending and len(in_flight) < self.depth:
                off, view = pending.popleft()
                sqe = lib.io_uring_get_sqe(self._ring)  # never NULL: the ring has `depth` entries
                if reading:
                    lib.io_uring_prep_read(sqe, fd, view, len(view), off)
                else:
                    lib.io_uring_prep_write(sqe, fd, view, len(view), off)
                token += 1  # user_data 0 is refused by the binding
                sqe.user_data = token
                in_flight[token] = (off, view)
                queued += 1
            if queued:
                lib.io_uring_submit(self._ring)
            rc = lib.io_uring_wait_cqe(self._ring, self._cqe)
            if rc < 0:
                raise OSError(-rc, f"io_uring_wait_cqe: {os.strerror(-rc)}")
            res, done = self._cqe.res, self._cqe.user_data
            lib.io_uring_cqe_seen(self._ring, self._cqe)
            off, view = in_flight.pop(done)
            moved = _check_result(res, view, off, reading)
            if moved < len(view):
                pending.appendleft((off + moved, view[moved:]))

    def write(self, fd: int, data: memoryview, offset: int) -> None:
        self._run(fd, data, offset, reading=False)

    def read(self, fd: int, into: memoryview, offset: int) -> None:
        self._run(fd, into, offset, reading=True)

    def close(self) -> None:
        self._lib.io_uring_queue_exit(self._ring)


class LibaioIO:
    """Linux native AIO through PyPI `libaio`: one thread, `depth` requests in flight (async only with O_DIRECT)."""

    def __init__(self, depth: int, chunk: int) -> None:
        import libaio

        self._lib = libaio
        self.depth = depth
        self.chunk = chunk
        self._ctx = libaio.AIOContext(depth)

    def _run(self, fd: int, data: memoryview, offset: int, reading: bool) -> None:
        lib = self._lib
        mode = lib.AIOBLOCK_MODE_READ if reading else lib.AIOBLOCK_MODE_WRITE
        pending = deque(_chunks(data, offset, self.chunk))
        in_flight: dict[int, tuple[int, memoryview]] = {}
        while pending or in_flight:
            blocks: list[Any] = []
            while pending and len(in_flight) + len(blocks) < self.depth:
                off, view = pending.popleft()
                block = lib.AIOBlock(mode, fd, [view], off)
                blocks.append(block)
                in_flight[id(block)] = (off, view)
            if blocks and self._ctx.submit(blocks) != len(blocks):
                raise OSError(f"io_submit accepted fewer than {len(blocks)} requests")
            for block, res, _res2 in self._ctx.getEvents(min_nr=1):
                off, view = in_flight.pop(id(block))
                moved = _check_result(res, view, off, reading)
                if moved < len(view):
                    pending.appendleft((off + moved, view[moved:]))

    def write(self, fd: int, data: memoryview, offset: int) -> None:
        self._run(fd, data, offset, reading=False)

    def read(self, fd: int, into: memoryview, offset: int) -> None:
        self._run(fd, into, offset, reading=True)

    def close(self) -> None:
        self._ctx.close()


def make_io(kind: str, workers: int, chunk: int) -> ChunkedIO:
    if kind == "pool":
        return PoolIO(workers, chunk)
    if kind == "liburing":
        return UringIO(workers, chunk)
    if kind == "libaio":
        return LibaioIO(workers, chunk)
    raise ValueError(f"unknown I/O kind {kind!r}")


# ------------------------------------------------------------------ measurement


@dataclass
class Cycle:
    """One write + fsync + drop + read of the whole buffer (seconds)."""

    write_s: float
    fsync_s: float
    read_s: float
    fallocate_s: float | None = None
    resident_after_drop: float | None = None
    cached_read_s: float | None = None
    resident_before_cached_read: float | None = None


@dataclass
class Row:
    path: str
    kind: str  # plain | pool | liburing | libaio
    direct: bool
    workers: int  # threads, or requests in flight for a binding
    chunk: int  # bytes; 0 for the plain baseline (one call)
    nbytes: int
    cycles: list[Cycle] = field(default_factory=list)
    correct: bool = False
    results: dict[str, float | None] = field(default_factory=dict)
    activity: dict[str, float | None] = field(default_factory=dict)

    def disturbed(self) -> bool:
        """Other processes used > 0.25 core on average, or the device moved > 15% more than this row's bytes."""
        extra = self.activity.get("device_extra_fraction")
        return float(self.activity.get("others_cpu_cores") or 0.0) > 0.25 or (extra is not None and extra > 0.15)

    def summarise(self) -> None:
        def rate(seconds: list[float]) -> float:
            return self.nbytes / statistics.median(seconds) / 1e9

        c = self.cycles
        self.results = {
            "write_returns_gbps": rate([x.write_s for x in c]),
            "write_durable_gbps": rate([x.write_s + x.fsync_s for x in c]),
            "read_gbps": rate([x.read_s for x in c]),
            "fsync_s": statistics.median(x.fsync_s for x in c),
            "resident_after_drop": max((x.resident_after_drop or 0.0) for x in c),
        }
        if c[0].fallocate_s is not None:
            self.results["fallocate_s"] = statistics.median(x.fallocate_s or 0.0 for x in c)
        if c[0].cached_read_s is not None:
            self.results["cached_read_gbps"] = rate([x.cached_read_s or 0.0 for x in c])
            self.results["resident_before_cached_read"] = min((x.resident_before_cached_read or 0.0) for x in c)


def _verify(src: AlignedBuffer, dst: AlignedBuffer, what: str) -> None:
    if not src.equals(dst):
        raise CorrectnessError(f"{what}: the bytes read back differ from the bytes written")


def plain_cycle(src: AlignedBuffer, dst: AlignedBuffer, directory: Path, what: str) -> Cycle:
    """The baseline: one write() + fsync, drop, one readinto(); then a cached readinto() of the same file."""
    path = directory / "plain.bin"
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            written = f.write(src.view)
            t1 = time.perf_counter()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        if written != src.nbytes:
            raise OSError(f"{what}: write() wrote {written} of {src.nbytes} bytes")
        drop_cache(path)
        resident = resident_fraction(path)

        def readinto() -> float:
            dst.poison()
            t = time.perf_counter()
            with open(path, "rb") as f:
                got = f.readinto(dst.view)
            seconds = time.perf_counter() - t
            if got != dst.nbytes:
                raise OSError(f"{what}: readinto() read {got} of {dst.nbytes} bytes")
            _verify(src, dst, what)
            return seconds

        read_s = readinto()
        cached = resident_fraction(path)  # the read just filled the cache: this one is served from memory
        cached_read_s = readinto()
        return Cycle(write_s=t1 - t0, fsync_s=t2 - t1, read_s=read_s, resident_after_drop=resident,
                     cached_read_s=cached_read_s, resident_before_cached_read=cached)
    finally:
        path.unlink(missing_ok=True)


def chunked_cycle(io: ChunkedIO, direct: bool, src: AlignedBuffer, dst: AlignedBuffer, directory: Path,
                  what: str) -> Cycle:
    """posix_fallocate (untimed), chunked write (+ buffered tail if O_DIRECT), fsync, drop, chunked read."""
    path = directory / "chunked.bin"
    nbytes = src.nbytes
    body = nbytes - nbytes % ALIGN if direct else nbytes  # O_DIRECT moves whole 4096-byte blocks only
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    tail_fd = os.open(path, os.O_RDWR) if body < nbytes else -1  # the tail goes through the page cache
    try:
        t = time.perf_counter()
        os.posix_fallocate(fd, 0, nbytes)
        fallocate_s = time.perf_counter() - t

        t0 = time.perf_counter()
        io.write(fd, src.view[:body], 0)
        if tail_fd >= 0:
            _pwrite_all(tail_fd, src.view[body:], body)
        t1 = time.perf_counter()
        os.fsync(fd)  # one inode: covers what went through either descriptor
        t2 = time.perf_counter()

        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        resident = resident_fraction(path)
        dst.poison()
        t3 = time.perf_counter()
        io.read(fd, dst.view[:body], 0)
        if tail_fd >= 0:
            _pread_all(tail_fd, dst.view[body:], body)
        t4 = time.perf_counter()
        _verify(src, dst, what)
        return Cycle(write_s=t1 - t0, fsync_s=t2 - t1, read_s=t4 - t3, fallocate_s=fallocate_s,
                     resident_after_drop=resident)
    finally:
        if tail_fd >= 0:
            os.close(tail_fd)
        os.close(fd)
        path.unlink(missing_ok=True)


def path_label(kind: str, direct: bool) -> str:
    names = {"pool": "pool pwrite/preadv", "liburing": "io_uring (liburing)", "libaio": "libaio"}
    return f"{names[kind]}, {'O_DIRECT' if direct else 'buffered'}"


def run_row(kind: str, direct: bool, workers: int, chunk: int, src: AlignedBuffer, dst: AlignedBuffer,
            directory: Path, repeats: int, meter: ActivityMeter, label: str | None = None) -> Row:
    row = Row(path=label or path_label(kind, direct), kind=kind, direct=direct, workers=workers, chunk=chunk,
              nbytes=src.nbytes)
    before = meter.snapshot()
    what = f"{row.path}, {workers} x {chunk // MIB} MiB" if chunk else row.path
    if kind == "plain":
        row.cycles = [plain_cycle(src, dst, directory, what) for _ in range(repeats)]
    else:
        io = make_io(kind, workers, chunk)
        try:
            row.cycles = [chunked_cycle(io, direct, src, dst, directory, what) for _ in range(repeats)]
        finally:
            io.close()
    row.correct = True  # every cycle was verified (else CorrectnessError)
    row.summarise()
    row.activity = ActivityMeter.since(before, meter.snapshot())
    moved = row.activity["device_bytes"]
    row.activity["device_extra_fraction"] = None if moved is None else moved / (2 * src.nbytes * repeats) - 1
    return row


# ------------------------------------------------------------- binding probes


@dataclass
class Probe:
    name: str
    usable: bool
    line: str
    version: str | None = None


def _probe_in_child(name: str, directory: Path) -> None:
    """Run in a child process: import the candidate and, for the benchmarked ones, move a small buffer both ways."""
    import importlib

    module = importlib.import_module(name)
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version(name)
        except Exception:  # noqa: BLE001 - a version is only decoration
            version = "?"
    if name == "liburing" and not hasattr(module, "io_uring") and hasattr(module, "Ring"):
        ring = module.Ring()  # the newer (Zig) API; creating a ring is what crashes where it does
        module.io_uring_queue_init(8, ring)
        raise RuntimeError(f"liburing {version} has the newer Ring/Cqe API, which this benchmark does not "
                           "implement; liburing==2024.5.3 (built from source) has the one it does")
    if name not in BENCHMARKED_BINDINGS:
        print(f"VERSION {version}")
        return
    src = AlignedBuffer(5 * ALIGN * 16 + 1234)
    dst = AlignedBuffer(src.nbytes)
    src.fill_pattern(0)
    for direct in (False, True):
        io = make_io(name, 4, 4 * ALIGN)
        try:
            chunked_cycle(io, direct, src, dst, directory, f"{name} probe, direct={direct}")
        finally:
            io.close()
    print(f"VERSION {version}")


def probe_bindings(directory: Path, timeout_s: float = 120.0) -> list[Probe]:
    probes = []
    for name in CANDIDATES:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", name, "--dir", str(directory)]
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            probes.append(Probe(name, False, f"{name}: the probe hung for {timeout_s:.0f} s: not used"))
            continue
        out = proc.stdout.strip().splitlines()
        version = next((line.split(" ", 1)[1] for line in out if line.startswith("VERSION ")), None)
        last_err = (proc.stderr.strip().splitlines() or ["(no message)"])[-1]
        if proc.returncode < 0:
            sig = signal.Signals(-proc.returncode).name
            line = f"{name}: imports, but the process died with {sig} when used: not usable here"
            probes.append(Probe(name, False, line, version))
        elif proc.returncode != 0:
            if "ModuleNotFoundError" in last_err or "No module named" in last_err:
                line = f"{name}: not importable in {sys.executable}. To get it: {INSTALL_NOTES[name]}"
            else:
                line = f"{name}: fails when used: {last_err}"
            probes.append(Probe(name, False, line, version))
        elif name == "caio":
            probes.append(Probe(name, False, (
                f"caio {version}: installs and imports (it has linux_aio and linux_uring contexts) but is not "
                "benchmarked: Operation.read(nbytes, fd, offset) returns a new bytes object (no read into a "
                "caller's buffer: one more copy of every byte read), and it is built around asyncio"), version))
        elif name in BENCHMARKED_BINDINGS:
            probes.append(Probe(name, True, f"{name} {version}: a small write/read, buffered and O_DIRECT, "
                                "read back equal: benchmarked", version))
        else:
            probes.append(Probe(name, False, f"{name} {version}: imports; not benchmarked", version))
    return probes


# ------------------------------------------------------------------- reporting


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError:
        return None


def machine_info(directory: Path) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
        "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "vm": {k: _read_text(f"/proc/sys/vm/{k}") for k in
               ("dirty_ratio", "dirty_background_ratio", "dirty_bytes", "dirty_background_bytes",
                "dirty_expire_centisecs")},
        "transparent_hugepage": _read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
    }
    try:
        out = subprocess.run(["df", "-PT", str(directory)], capture_output=True, text=True, check=True).stdout
        fields = out.splitlines()[-1].split()
        info["directory_fs"] = {"filesystem": fields[0], "type": fields[1], "mounted_on": fields[6]}
        block = Path(fields[0]).name
        queue = Path("/sys/block") / block / "queue"
        if queue.is_dir():
            info["block_device"] = {k: _read_text(str(queue / k)) for k in
                                    ("rotational", "logical_block_size", "max_sectors_kb", "scheduler", "nr_requests")}
    except (OSError, subprocess.CalledProcessError, IndexError) as exc:
        info["directory_fs"] = {"error": f"{type(exc).__name__}: {exc}"}
    return info


def _describe(row: Row) -> str:
    return f"{row.path}, {row.workers} x {f'{row.chunk / MIB:g} MiB' if row.chunk else 'one call'}"


def _others(row: Row) -> str:
    extra = row.activity.get("device_extra_fraction")
    io = "" if extra is None else f", io {extra:+.0%}"
    return f"cpu {float(row.activity.get('others_cpu_cores') or 0.0):.2f}{io}"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summarise(rows: list[Row]) -> dict[str, Any]:
    """Plain reference (mean of the first and last plain runs), ratios, the fastest paths."""
    plains = [r for r in rows if r.kind == "plain"]
    ref = {k: statistics.mean(float(p.results[k] or 0.0) for p in plains)
           for k in ("write_returns_gbps", "write_durable_gbps", "read_gbps")}
    for row in rows:
        for k, reference in ref.items():
            row.results[f"{k}_ratio"] = float(row.results[k] or 0.0) / reference
    others = [r for r in rows if r.kind != "plain"]

    def best(key: str, pool: list[Row]) -> dict[str, Any] | None:
        if not pool:
            return None
        row = max(pool, key=lambda r: float(r.results[key] or 0.0))
        return {"path": row.path, "workers": row.workers, "chunk_mib": row.chunk / MIB,
                "gbps": row.results[key], "ratio_to_plain": row.results[f"{key}_ratio"]}

    summary: dict[str, Any] = {"plain_reference": ref}
    for key in ref:
        summary[f"fastest_{key}"] = best(key, others)
        summary[f"fastest_buffered_{key}"] = best(key, [r for r in others if not r.direct])
        summary[f"fastest_direct_{key}"] = best(key, [r for r in others if r.direct])
    first = plains[0].results
    summary["page_cache_check"] = {
        "plain_cold_read_gbps": first["read_gbps"], "plain_cached_read_gbps": first.get("cached_read_gbps"),
        "resident_after_drop": first["resident_after_drop"],
        "resident_before_cached_read": first.get("resident_before_cached_read"),
        "drop_works": bool(float(first["resident_after_drop"] or 0.0) < 0.01
                           and float(first.get("cached_read_gbps") or 0.0) > float(first["read_gbps"] or 0.0)),
        "max_resident_after_drop_any_path": max(float(r.results["resident_after_drop"] or 0.0) for r in rows),
    }
    return summary


def print_report(results: dict[str, Any], rows: list[Row], console: Any) -> None:
    from rich.table import Table

    s = results["setup"]
    table = Table(
        title=(f"Disk I/O: {s['nbytes'] / GIB:.2f} GiB ({s['nbytes']} bytes), {s['directory_fs']}, "
               f"median of {s['repeats']}"),
        caption="GB/s = 1e9 bytes/s. write returns = until the last write call returned (buffered: in the page "
        "cache, what a step waits for with scratch files); + fsync = durable; read = after fsync + "
        "POSIX_FADV_DONTNEED (from the disk). x plain = / mean of the two plain sequential runs. workers = "
        "threads (pool) or requests in flight (bindings). resident = page-cache fraction of the file after "
        "the drop (mincore). others = CPU cores used by other processes on average, and the device's bytes "
        "beyond this row's own (red: > 0.25 core or > 15%: the row's figures are suspect).",
    )
    for name in ("path", "workers", "chunk MiB", "write returns", "x plain", "write + fsync", "x plain",
                 "read", "x plain", "resident", "equal", "others"):
        table.add_column(name, justify="left" if name == "path" else "right")
    for row in rows:
        r = row.results
        table.add_row(
            row.path, str(row.workers), f"{row.chunk / MIB:g}" if row.chunk else "all",
            _fmt(r["write_returns_gbps"]), _fmt(r["write_returns_gbps_ratio"]),
            _fmt(r["write_durable_gbps"]), _fmt(r["write_durable_gbps_ratio"]),
            _fmt(r["read_gbps"]), _fmt(r["read_gbps_ratio"]),
            _fmt(r["resident_after_drop"], 3), "yes" if row.correct else "NO",
            ("[red]" if row.disturbed() else "") + _others(row) + ("[/red]" if row.disturbed() else ""),
        )
    console.print(table)

    summary = results["summary"]
    if summary["disturbed_rows"]:
        console.print("[bold red]disturbed by other activity, rerun on a quiet machine:[/bold red] "
                      + "; ".join(summary["disturbed_rows"]))
    check = summary["page_cache_check"]
    console.print(
        f"page cache: plain read after the drop {_fmt(check['plain_cold_read_gbps'])} GB/s "
        f"(resident {_fmt(check['resident_after_drop'], 3)}), cached read of the same file "
        f"{_fmt(check['plain_cached_read_gbps'])} GB/s (resident {_fmt(check['resident_before_cached_read'], 3)}): "
        f"{'the drop works' if check['drop_works'] else 'THE DROP DID NOT WORK: reads may be cached'}"
    )
    labels = {"write_returns_gbps": "write (returns)", "write_durable_gbps": "write + fsync", "read_gbps": "read"}
    for key, label in labels.items():
        for scope in ("", "buffered_", "direct_"):
            b = summary.get(f"fastest_{scope}{key}")
            if b is None:
                continue
            chunk = f"{b['chunk_mib']:g} MiB" if b["chunk_mib"] else "one call"
            console.print(f"fastest {scope.rstrip('_') + ' ' if scope else ''}{label}: {b['path']}, "
                          f"{b['workers']} x {chunk}: {b['gbps']:.2f} GB/s = {b['ratio_to_plain']:.2f} x plain "
                          f"({summary['plain_reference'][key]:.2f} GB/s)")
    for probe in results["bindings"]:
        console.print(probe["line"], markup=False, highlight=False)


# ------------------------------------------------------------------------ main


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Disk I/O benchmark: plain sequential vs thread-pool pwrite/preadv (buffered, O_DIRECT) vs "
        "io_uring / libaio bindings, for multi-GB flat buffers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--dir", type=Path, default=None,
                   help="directory to write in (a fresh subdirectory is made and removed); default: a temp dir "
                   "under /tmp")
    p.add_argument("--gib", type=positive_float, default=4.0, help="buffer size in GiB (2**30 bytes)")
    p.add_argument("--tail-bytes", type=non_negative_int, default=2468,
                   help="bytes added to --gib GiB, so the size is not a multiple of 4096 (exercises the O_DIRECT "
                   "tail); 0 for none")
    p.add_argument("--chunks-mib", type=_int_list, default=[1, 4, 16], help="pool chunk sizes (MiB)")
    p.add_argument("--threads", type=_int_list, default=[1, 4, 8], help="pool thread counts")
    p.add_argument("--modes", default="buffered,direct", help="comma-separated subset of buffered, direct")
    p.add_argument("--bindings", default=",".join(BENCHMARKED_BINDINGS),
                   help="bindings to benchmark where usable (comma-separated subset of liburing, libaio; '' none)")
    p.add_argument("--depth", type=positive_int, default=8, help="requests in flight for a binding")
    p.add_argument("--binding-chunk-mib", type=positive_int, default=4, help="request size for a binding (MiB)")
    p.add_argument("--repeats", type=positive_int, default=1, help="cycles per row (medians reported)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--json", type=Path, default=_DEFAULT_OUT, help="JSON results file")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: the child of probe_bindings
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.probe is not None:
        _probe_in_child(args.probe, args.dir if args.dir is not None else Path(tempfile.gettempdir()))
        return 0

    from rich.console import Console

    # A SIGTERM unwinds like Ctrl-C, so the finally below still removes the multi-GB scratch files.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    console = Console() if sys.stdout.isatty() else Console(width=220)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bindings = [b.strip() for b in args.bindings.split(",") if b.strip()]
    bad = sorted(set(modes) - {"buffered", "direct"}) + sorted(set(bindings) - set(BENCHMARKED_BINDINGS))
    if bad:
        print(f"unknown mode(s)/binding(s): {', '.join(bad)}", file=sys.stderr)
        return 2
    nbytes = int(args.gib * GIB) // ALIGN * ALIGN + args.tail_bytes

    root = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="zero3-disk-io-bench-", dir=root))
    started = time.perf_counter()
    rows: list[Row] = []
    try:
        free = shutil.disk_usage(directory).free
        if nbytes + GIB > free:
            raise SystemExit(f"{directory}: {free} bytes free, {nbytes} + 1 GiB of headroom needed")
        info = machine_info(directory)
        fs = info["directory_fs"]
        console.print(f"{nbytes} bytes in {directory} ({fs.get('type', '?')} on {fs.get('filesystem', '?')}); "
                      f"{sys.executable}")

        console.print("probing the io_uring / libaio bindings (each in a child process) ...")
        probes = probe_bindings(directory)
        for probe in probes:
            console.print("  " + probe.line, markup=False, highlight=False)
        usable = [p.name for p in probes if p.usable and p.name in bindings]
        meter = ActivityMeter(Path(fs["filesystem"]).name if "filesystem" in fs else None)

        console.print("allocating and filling the buffers ...")
        src = AlignedBuffer(nbytes)
        dst = AlignedBuffer(nbytes)
        src.fill_pattern(args.seed)
        dst.padded.zero_()  # touched: no page faults in the timed reads

        plan: list[tuple[str, bool, int, int, str | None]] = [("plain", False, 1, 0, f"{PLAIN} (first)")]
        for mode in modes:
            for chunk in args.chunks_mib:
                for threads in args.threads:
                    plan.append(("pool", mode == "direct", threads, chunk * MIB, None))
        for name in usable:
            for mode in modes:
                plan.append((name, mode == "direct", args.depth, args.binding_chunk_mib * MIB, None))
        plan.append(("plain", False, 1, 0, f"{PLAIN} (last)"))

        for i, (kind, direct, workers, chunk, label) in enumerate(plan, 1):
            row = run_row(kind, direct, workers, chunk, src, dst, directory, args.repeats, meter, label)
            rows.append(row)
            r = row.results
            console.print(
                f"  [{i}/{len(plan)}] {_describe(row)}: "
                f"write {r['write_returns_gbps']:.2f} "
                f"(+fsync {r['write_durable_gbps']:.2f}), read {r['read_gbps']:.2f} GB/s; "
                f"{time.perf_counter() - started:.0f} s{'; DISTURBED: ' + _others(row) if row.disturbed() else ''}",
                highlight=False)

        setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "probe"}
        setup.update({"directory": str(directory), "nbytes": nbytes,
                      "directory_fs": f"{fs.get('type', '?')} on {fs.get('filesystem', '?')}",
                      "o_direct_tail": "the bytes past the last 4096 boundary: a final buffered pwrite/pread "
                      "through a second descriptor (file not padded)"})
        results: dict[str, Any] = {
            "setup": setup, "machine": info,
            "bindings": [asdict(p) for p in probes],
            "rows": [],
            "all_correct": True,  # every read-back was verified (else CorrectnessError stopped the run)
        }
        results["summary"] = summarise(rows)
        results["summary"]["disturbed_rows"] = [_describe(r) for r in rows if r.disturbed()]
        results["rows"] = [asdict(r) for r in rows]
        results["wall_s"] = time.perf_counter() - started
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    print_report(results, rows, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    console.print(f"every read-back equal; {results['wall_s']:.0f} s; results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
