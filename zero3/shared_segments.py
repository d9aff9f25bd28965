"""Named shared-memory segments that another process of this machine maps: an async save's staged state
(zero3.checkpoint.staging) and weights to a generator (zero3.weights.shared_memory).

The process that creates a segment alone unlinks it. Python before 3.13 registers a segment that a process
merely attaches with its resource tracker, which unlinks it when that process exits, under its creator's
feet: `attach` takes it off again.
"""

from __future__ import annotations

import gc
import itertools
import logging
import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

log = logging.getLogger("zero3")

_NAMES = itertools.count()

PAGE = 4096  # bytes: where a buffer within a segment starts (O_DIRECT's alignment covers 512-byte sectors)


def create(kind: str, size: int) -> SharedMemory:
    """A new segment of `size` bytes, named after `kind` and this process."""
    return SharedMemory(name=f"zero3-{kind}-{os.getpid()}-{next(_NAMES)}", create=True, size=size)


def create_backed(kind: str, size: int) -> SharedMemory:
    """A new segment whose pages are taken now; OSError (the segment released) when /dev/shm lacks the room.

    Without that, a tmpfs short of room would kill the process with SIGBUS at the first copy into it.
    """
    segment = create(kind, size)
    try:
        os.posix_fallocate(segment._fd, 0, size)  # type: ignore[attr-defined]
    except OSError:
        release(segment, unlink=True)
        raise
    return segment


def attach(name: str) -> SharedMemory:
    """Another process's segment, mapped here."""
    segment = SharedMemory(name=name)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def release(segment: SharedMemory, unlink: bool) -> None:
    """Unmap `segment` (and unlink it, from its creator) once no tensor views it any more."""
    try:
        segment.close()
    except BufferError:  # a view still alive in a reference cycle: collect it, then unmap
        gc.collect()
        try:
            segment.close()
        except BufferError:
            log.debug("shared segment %s is still viewed; it is unmapped at exit", segment.name)
    if unlink:
        try:
            segment.unlink()
        except FileNotFoundError:
            pass
