"""Getting a checkpoint's bytes off the disk ahead of the checks that read them.

[Note: reading ahead]
A load reads the items it needs in file order and sums each before anything
is copied (zero3.checkpoint.trust's [Note: verified reads]). Two things keep
the disk busy ahead of those reads:
* at the world size a checkpoint was saved at, a load of every state reads
  nearly all of the rank's own files, and knows it before it has read
  anything else: from the load's start, `PageIn` faults those files' pages
  in on a thread of its own, in file order, while the engine file and the
  metadata are read and matched. A torch reduction over one byte of each
  page does the faulting (it runs without the GIL), and only the kernel's
  read-ahead is in flight at a time, so the small files read meanwhile do
  not queue behind it all;
* `advise` asks for every item a reader is about to read at once
  (POSIX_FADV_WILLNEED, a span of nearby items per call): the small items
  spread through another rank's file (its scalars) are then read side by
  side, not each in turn when it is reached.
Both are advice: what was not read ahead is read when a check reaches it,
and a missing or short file is reported by the reads as before.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from zero3.checkpoint.tags import ENGINE_FILE, ENGINE_SUM, METADATA, dcp_files, dcp_writers, mapped

_SPAN_GAP = 64 << 10  # items closer than this are asked for as one span (the gap costs less than a request)
_STEP = 8 << 20  # bytes paged in between looks at the stop flag


def advise(file: Path, items: Iterable[tuple[int, int]]) -> None:
    """Ask the kernel to start reading these items of `file` (offset, length) now."""
    spans: list[list[int]] = []
    for offset, length in sorted(items):
        if spans and offset - spans[-1][1] < _SPAN_GAP:
            spans[-1][1] = max(spans[-1][1], offset + length)
        else:
            spans.append([offset, offset + length])
    if not spans or not file.is_file():
        return
    try:
        with open(file, "rb", buffering=0) as source:
            for start, end in spans:
                os.posix_fadvise(source.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)
    except OSError:  # advice only
        return


class PageIn:
    """Files brought into the page cache whole, in order, on a thread of its own (see the Note). Like the
    reads' own mapping, a file truncated while it is paged in ends the process (zero3.checkpoint.trust's
    [Note: verified reads])."""

    def __init__(self, files: list[Path]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(files,), name="zero3-page-in", daemon=True)
        self._thread.start()

    def _run(self, files: list[Path]) -> None:
        try:
            for file in files:
                pages = torch.frombuffer(mapped(file), dtype=torch.uint8)  # as long as the file is now
                for at in range(0, pages.numel(), _STEP):
                    if self._stop.is_set():
                        return
                    pages[at : at + _STEP : mmap.PAGESIZE].sum()  # a fault for each page not there yet
        except Exception:  # noqa: BLE001 - advice only: the reads find, and report, what is wrong
            return

    def stop(self) -> None:
        """End the paging in where it is (what it read stays in the page cache)."""
        self._stop.set()
        self._thread.join()


def page_in_own_files(path: Path, rank: int, world_size: int) -> PageIn | None:
    """Where the tag's data files were written by as many ranks as load it (the saved world size, seen before
    any file is read), this rank's own, paged in from now on; else None. The engine file and the metadata,
    which the load reads first, are asked for before them (else their reads would wait behind the paging)."""
    if dcp_writers(path) != set(range(world_size)):
        return None
    own = [file for file in dcp_files(path, rank) if file.is_file() and file.stat().st_size > 0]
    if not own:
        return None
    for first in (ENGINE_SUM, ENGINE_FILE, METADATA):
        if (path / first).is_file():
            advise(path / first, [(0, (path / first).stat().st_size)])
    return PageIn(own)
