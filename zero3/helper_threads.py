"""Helper threads that never hold up the process's exit.

[Note: helper threads and the exit]
The engine hands work to helper threads: a collective's completion to watch, an optimizer step to run
early, a quantized reduction's second half, disk reads and writes, a checkpoint to write. With
`concurrent.futures.ThreadPoolExecutor` those threads are joined when the interpreter shuts down (its
exit hook joins every worker, daemon or not). A rank whose peer died can be left with a worker blocked in a
collective that no timeout ends (seen with gloo's coalesced reduce-scatter): the main thread raised and
returned, and the process then waited on that worker forever, so torchrun never saw the rank fail and
never restarted the job.

`HelperThreads` has ThreadPoolExecutor's shape (`submit`, `shutdown`) on daemon threads that nothing joins
at exit. Work that must not be dropped when a script ends without waiting for it (a checkpoint still being
written) is given `finish_at_exit_s`: an `atexit` hook (it runs after the interpreter has joined its own
threads and before it stops the daemon ones) waits up to that long for it, then lets the process go.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

from zero3.error_exit import leaving_after_an_error

log = logging.getLogger("zero3")

Result = TypeVar("Result")

_NUMBERS = itertools.count()
# Pools with work to finish at exit; weak, so a pool nobody holds is not kept alive by this.
_FINISH_AT_EXIT: weakref.WeakSet[HelperThreads] = weakref.WeakSet()
_STOP = object()


class HelperThreads:
    """A pool of up to `workers` daemon threads, started as work arrives; jobs start in submission order."""

    def __init__(self, workers: int, name: str, finish_at_exit_s: float = 0.0) -> None:
        if workers < 1:
            raise ValueError(f"a pool of helper threads needs at least 1 worker, not {workers}")
        self.workers = workers
        self.name = name
        self.finish_at_exit_s = finish_at_exit_s
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._unfinished: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self._shut = False
        self._idle = 0  # started threads waiting for a job
        if finish_at_exit_s > 0:
            _FINISH_AT_EXIT.add(self)

    def submit(self, fn: Callable[..., Result], /, *args: Any, **kwargs: Any) -> Future[Result]:
        future: Future[Result] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError(f"the {self.name} helper threads were shut down; no new work is taken")
            if self.finish_at_exit_s > 0:  # (only the exit hook asks: a watcher's many small jobs are not tracked)
                self._unfinished.add(future)
                future.add_done_callback(self._forget)
            self._jobs.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1
            elif len(self._threads) < self.workers:
                thread = threading.Thread(target=self._work, name=f"{self.name}_{next(_NUMBERS)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _forget(self, future: Future[Any]) -> None:
        with self._lock:
            self._unfinished.discard(future)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            future, fn, args, kwargs = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(error)
                    del error  # no cycle through the traceback's frames
                else:
                    future.set_result(result)
                    del result
            del future, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def unfinished(self) -> list[Future[Any]]:
        """The jobs queued or running (tracked where the pool finishes work at exit)."""
        with self._lock:
            return list(self._unfinished)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Take no more work; with `cancel_futures`, drop the jobs not started; with `wait`, join the threads
        (after the jobs still to run)."""
        dropped: list[Future[Any]] = []
        with self._lock:
            if self._shut:
                threads: list[threading.Thread] = []
            else:
                self._shut = True
                threads = list(self._threads)
                if cancel_futures:
                    dropped = self._take_queued()
                for _ in threads:
                    self._jobs.put(_STOP)
        for future in dropped:  # outside the lock: a cancelled future's callback takes it
            future.cancel()
        _FINISH_AT_EXIT.discard(self)
        if wait:
            for thread in threads:
                thread.join()

    def _take_queued(self) -> list[Future[Any]]:
        """Take the jobs not started off the queue (under the lock); their futures."""
        taken: list[Future[Any]] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return taken
            taken.append(job[0])


@atexit.register
def _finish_at_exit() -> None:
    """Give each pool's unfinished work up to its `finish_at_exit_s` (see the Note), all pools at once."""
    pools = list(_FINISH_AT_EXIT)
    if not pools or leaving_after_an_error():
        return
    start = time.monotonic()
    for pool in sorted(pools, key=lambda pool: pool.finish_at_exit_s):
        unfinished = pool.unfinished()
        if not unfinished:
            continue
        left = pool.finish_at_exit_s - (time.monotonic() - start)
        _, still = wait(unfinished, timeout=max(left, 0.0))
        if still:
            log.warning("zero3: the process exits with %d job(s) of the %s helper threads unfinished after %.0f s",
                        len(still), pool.name, pool.finish_at_exit_s)
