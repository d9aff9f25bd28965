"""The background writer of async saves: one save at a time; the next save, load or close waits for it."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zero3.offload.host import HostBufferPool

STAGING = "ckpt-staging:"  # host-pool keys of an async save's copies


class AsyncSaves:
    def __init__(self, host_pool: HostBufferPool) -> None:
        self._host_pool = host_pool  # holds the staged copies (keys under STAGING) until the write is done
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Any] | None = None

    def executor(self) -> ThreadPoolExecutor:
        """The writer thread (made on the first async save)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-checkpoint")
        return self._executor

    def track(self, written: Future[Any] | Path) -> None:
        """Remember a save still writing (a finished one needs nothing)."""
        if isinstance(written, Future):
            self._pending = written

    def wait(self) -> None:
        """Wait for a save still writing; raises its error, if it failed. The staged copies are freed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        finally:
            self._host_pool.drop(STAGING)

    def close(self) -> BaseException | None:
        """Wait for the last save and stop the writer; returns the save's error instead of raising it,
        so the caller can finish tearing down first."""
        error: BaseException | None = None
        try:
            self.wait()
        except Exception as failure:  # noqa: BLE001 - handed back to the caller
            error = failure
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return error
