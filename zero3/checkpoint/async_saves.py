"""An engine's async saves: one at a time; the next save, load or close waits for the last.

The state is staged in a shared-memory segment (zero3.checkpoint.staging) on the
training thread; a thread of the engine then hands it to this rank's checkpoint
writer process (zero3.checkpoint.writer_process, and its Note for why a
process) and waits for the answer, the GIL free. Where the job's store has no
address the thread writes the tag itself, on the checkpoint group. Periodic
saves written by the process read the engine's host buffers in place instead
(zero3.checkpoint.shared_state), and whatever changes them first waits
(`settle_readers`).
"""

from __future__ import annotations

import datetime
import threading
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.constants import default_pg_timeout

from zero3.checkpoint.shared_state import Adopt, SharedState
from zero3.checkpoint.staging import IN_STATE, StagingArena
from zero3.checkpoint.writer_process import WriteRequest, WriterProcess, WriterSetup, job_store_address
from zero3.comm import Communicator
from zero3.helper_threads import HelperThreads

if TYPE_CHECKING:  # (DCP is imported at the first save or load, not with zero3)
    from zero3.checkpoint.tag_write import Write

# What a rank says of its writer before each async save (see `_writer_for_this_save`).
_RUNNING, _NEEDED, _UNAVAILABLE = "running", "needed", "unavailable"


class AsyncSaves:
    def __init__(self, comm: Communicator, device: torch.device, rank: int, periodic: bool,
                 adopt: Adopt | None = None) -> None:
        self._comm = comm
        self._rank = rank  # in the job
        # Saves that come back every few steps (automatic checkpoints) keep the staging memory from one to the
        # next; an occasional save frees it once written (at the next wait), as a host copy of the state is large.
        self._periodic = periodic
        self._arena = StagingArena(device)
        self._executor: HelperThreads | None = None
        self._pending: Future[Any] | None = None
        self._writer: WriterProcess | None = None
        self._in_thread = False  # the job agreed that its saves are written in this thread
        # Periodic saves by the writer process read the engine's host buffers here, in place; `adopt` (the
        # engine's) moves buffers (zero3.checkpoint.shared_state's Note).
        self._state = SharedState()
        self._adopt = adopt
        self._reads_in_place = False  # the pending save reads the engine's buffers in place
        self._read = threading.Event()  # the pending save has read its state (or ended)

    def submit(self, write: Write, live: dict[str, Any]) -> Future[Path]:
        """Stage `live` (this rank's state entries) and write it in the background; collective (every rank
        calls it at the same save). The previous save has been waited for."""

        assert self._pending is None or self._pending.done(), "wait() for the last save first"
        if self._periodic and self._adopt is not None and not self._in_thread:
            self._state.share(live, self._adopt, self.settle_readers)
        placements = self._arena.stage(live, shared=not self._in_thread, state=self._state)
        self._reads_in_place = any(placed.segment == IN_STATE for placed in placements)
        writer = self._writer_for_this_save()
        read = self._read = threading.Event()  # set once the state is read, or the save is over
        if writer is None:
            from zero3.checkpoint.tag_write import CommGroup

            group = CommGroup(self._comm, self._comm.checkpoint_group())
            written = self._thread().submit(write.run, group, self._arena.views(placements, self._state), read.set)
        else:
            request = WriteRequest(write, self._arena.name, placements, keep_mapped=self._periodic,
                                   state_segment=self._state.name if self._reads_in_place else None)
            written = self._thread().submit(writer.write, request, read.set)
        written.add_done_callback(lambda _: read.set())
        return written

    def track(self, written: Future[Any] | Path) -> None:
        """Remember a save still writing (a finished one needs nothing)."""
        if isinstance(written, Future):
            self._pending = written

    def settle_readers(self) -> None:
        """Before the engine changes its state: wait until a save reading it in place has read it all (not
        for its sync and publication; its error, if it failed, is raised by the next `wait`)."""
        if self._reads_in_place and self._pending is not None:
            self._read.wait()
            self._reads_in_place = False

    def release_unused_state(self) -> None:
        """Free the shared state once no buffer is in it (the engine moved them: `offload_states`)."""
        self._state.release_if_unused()

    def wait(self) -> None:
        """Wait for a save still writing; raises its error, if it failed."""
        pending, self._pending = self._pending, None
        self._reads_in_place = False
        if pending is None:
            return
        try:
            pending.result()
        finally:
            if not self._periodic:
                self._arena.close()

    def close(self) -> BaseException | None:
        """Wait for the last save, stop the writer and free the staging memory; returns the save's error
        instead of raising it, so the caller can finish tearing down first."""
        error: BaseException | None = None
        try:
            self.wait()
        except Exception as failure:  # noqa: BLE001 - handed back to the caller
            error = failure
        self._stop_writer()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._arena.close()
        return error

    def release_state(self) -> None:
        """Let go of the shared state (once the engine freed its buffers: they live in it), and of the
        engine's `adopt` (a bound method: the engine would not be freed before a collection)."""
        self._state.close()
        self._adopt = None

    def _thread(self) -> HelperThreads:
        if self._executor is None:
            self._executor = HelperThreads(1, "zero3-checkpoint", finish_at_exit_s=self._timeout_s())
        return self._executor

    def _writer_for_this_save(self) -> WriterProcess | None:
        """The writer of this save, as every rank agrees (one exchange): the running ones if every rank's
        runs, else a new generation on every rank (a first save, or one whose writer exited); None where
        some rank cannot have one (writes in the thread, from then on)."""
        if self._in_thread:
            return None
        world = self._comm.job_size
        address = job_store_address()
        if (world > 1 and address is None) or not self._arena.shared:
            said = _UNAVAILABLE
        else:
            said = _RUNNING if self._writer is not None and self._writer.alive else _NEEDED
        proposal = f"zero3-checkpoint-writers/{uuid.uuid4().hex}/" if self._rank == 0 else None
        heard = self._comm.all_gather_objects((said, proposal))
        states = {state for state, _ in heard}
        if _UNAVAILABLE in states:
            self._in_thread = True
            self._stop_writer()
            return None
        if states != {_RUNNING}:
            self._stop_writer()
            setup = WriterSetup(address if world > 1 else None, heard[0][1], self._rank, world, self._timeout_s())
            self._writer = self._thread().submit(WriterProcess, setup).result()  # started by the saves' thread
        return self._writer

    def _stop_writer(self) -> None:
        """Stop this rank's writer, from the thread that started it (its PR_SET_PDEATHSIG follows that thread)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            self._thread().submit(writer.close).result()

    def _timeout_s(self) -> float:
        topology = self._comm.topology
        timeout = topology.timeout if topology is not None and topology.timeout is not None else default_pg_timeout
        assert isinstance(timeout, datetime.timedelta)
        return timeout.total_seconds()
