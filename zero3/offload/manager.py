"""`offload_states` / `reload_states`: where each state lives, and moving it there and back.

[Note: offload order]
An offload changes nothing until it can finish: arguments are checked, and
disk files are reserved (a full or unwritable disk fails here), before the
engine is asked to let go of its views (`prepare`: gathered parameters and
prefetches released, optimizer views dropped). A state's memory is released
only after every byte of every state in the call is on its new tier: if a
write fails, the files are removed and every state stays where it was. With
`non_blocking=True` the disk writes finish in the background: the buffers'
memory is released by the thread that completes the last write, a reader of
a buffer in the meantime waits for the writes, and a failed background write
is reported at the next call (`settle`) with the states left in memory.

[Note: states that hold no memory now]
Some states hold no bytes between steps: gradient shards made on demand
(lean memory mode, a CPU device at several ranks) exist only from a backward
to its step. Such a state still has a place, the device its shards are made
on, and that is what `get_state_devices` says (DeepSpeed's test, and a
user's "is every state back?", read the answer as where the state lives;
the empty set is for the scratch bucket an offload freed). Offloading it
moves no bytes, but it is recorded as offloaded all the same: it reports
the offload's device (`meta` for disk), the engine refuses a backward until
`reload_states()`, as it does for a state with bytes, so a CPU engine and a
device engine say and do the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from zero3 import accelerator
from zero3.enums import OffloadDevice, OffloadStateType
from zero3.offload.disk import DiskFile, FileIO, OffloadIOError, Transfer, empty_host
from zero3.offload.host import HostBufferPool, HostCopier
from zero3.offload.report import StateReport
from zero3.partition.flat_buffer import FlatBuffer

log = logging.getLogger("zero3")

SCRATCH = OffloadStateType.contiguous_grad_buffer
ON_DISK = "is offloaded to disk; call engine.reload_states() first"


class ScratchOwner(Protocol):
    """What owns the scratch gradient bucket (the GradientReducer)."""

    scratch: FlatBuffer | None

    def free_scratch(self) -> None: ...

    def allocate_scratch(self) -> None: ...


@dataclass(frozen=True)
class ParkedFile:
    """The file a buffer is parked in, as the buffer reads it (`FlatBuffer.file`): element offsets."""

    disk: FileIO
    file: DiskFile
    element_size: int

    def read(self, offset: int, into: torch.Tensor) -> None:
        self.disk.read_now(self.file, into, offset * self.element_size)


@dataclass
class _Parked:
    """One buffer's data away from its home device."""

    buffer: FlatBuffer
    location: OffloadDevice
    home: torch.device
    file: DiskFile | None = None
    writing: Transfer | None = None  # a non-blocking disk write still finishing
    failed: list[BaseException] = field(default_factory=list)

    def park_on_disk(self, disk: FileIO) -> None:
        """Memory lets go of the buffer: its bytes are in the file (written, and not removed)."""
        assert self.file is not None
        self.buffer.park_in(ParkedFile(disk, self.file, self.buffer.dtype.itemsize), ON_DISK)


class StateOffloader:
    """Moves this rank's states between the device, host memory and disk. No collectives."""

    def __init__(
        self,
        device: torch.device,
        disk: FileIO,
        pool: HostBufferPool,
        buffers: Callable[[OffloadStateType], list[FlatBuffer]],
        scratch: ScratchOwner,
        default_disk_root: str | None,
        held_by: dict[OffloadStateType, OffloadStateType] | None = None,
        home_of: Callable[[OffloadStateType], torch.device | None] = lambda state: None,
    ) -> None:
        self.device = device
        self._buffers = buffers
        # Where a state that holds no memory now would have it (None: a state the engine does not have).
        self._home_of = home_of
        # States offloaded while they held no memory ([Note: states that hold no memory now]): the device
        # they report, and the call's background writes (if those fail, the state was never offloaded).
        self._bare: dict[OffloadStateType, tuple[torch.device, Transfer | None]] = {}
        # States with no bytes of their own, held by another's buffers (an fp32 engine's masters are its
        # shards: hp_params in lp_params): they are where their holder is, and move with it.
        self._held_by = held_by or {}
        self._scratch = scratch
        self._default_disk_root = default_disk_root
        self._parked: dict[OffloadStateType, list[_Parked]] = {}
        self._loading: dict[OffloadStateType, list[_Parked]] = {}
        self._scratch_freed = False
        # The background writes of the call that freed the scratch bucket: if they fail, it comes back too.
        self._scratch_freed_with: Transfer | None = None
        self.disk = disk  # shared with the tiers: the engine closes it
        self.host = HostCopier(device, pool)

    # ---- where things are ---------------------------------------------------
    def offloaded(self) -> list[OffloadStateType]:
        """States away from the device (host, disk, or freed), in API order."""
        return [
            state for state in OffloadStateType
            if state in self._parked or state in self._bare or (state is SCRATCH and self._scratch_freed)
            or self._held_by.get(state) in self._parked
        ]

    def missing(self, needed: Iterable[OffloadStateType]) -> list[OffloadStateType]:
        """Which of `needed` are offloaded now (after in-flight moves have settled)."""
        self.settle()
        away = set(self.offloaded())
        return [state for state in needed if state in away]

    def _held(self, state: OffloadStateType) -> list[FlatBuffer]:
        """The buffers that hold `state` now (the scratch bucket's, if it exists)."""
        if state is SCRATCH:
            return [self._scratch.scratch] if self._scratch.scratch is not None else []
        return self._buffers(state)

    def devices(self, state: OffloadStateType) -> set[torch.device]:
        """Where `state` rests: moves in flight are waited for first."""
        self.settle()
        held = self._held(self._held_by.get(state, state))
        if held or state is SCRATCH:
            return {buffer.device for buffer in held}
        place = self._bare_place(state)
        return {place} if place is not None else set()

    def _bare_place(self, state: OffloadStateType) -> torch.device | None:
        """Where a state that holds no memory is ([Note: states that hold no memory now])."""
        if state in self._bare:
            return self._bare[state][0]
        return self._home_of(state)

    def report(self) -> StateReport:
        self.settle()
        entries: dict[str, dict[str, int]] = {}
        homes: dict[str, dict[str, int]] = {}
        for state in OffloadStateType:
            where: dict[str, int] = {}
            home: dict[str, int] = {}
            own = state not in self._held_by  # a held state is where its holder is, with no bytes of its own
            held = self._held(self._held_by.get(state, state))
            for buffer in held:
                key = "nvme" if buffer.parked else str(buffer.device)
                where[key] = where.get(key, 0) + (buffer.nbytes if own else 0)
                home[buffer.home] = home.get(buffer.home, 0) + (buffer.nbytes if own else 0)
            place, resting = self._bare_place(state), self._home_of(state)
            if not held and state is not SCRATCH and place is not None and resting is not None:
                where["nvme" if place.type == "meta" else str(place)] = 0
                home[str(resting)] = 0
            entries[state.value] = where
            homes[state.value] = home
        directory = str(self.disk.directory) if self.disk.directory is not None else None
        return StateReport(entries, homes, disk_directory=directory, pinned_bytes=self.host.pinned_bytes)

    # ---- offload ------------------------------------------------------------
    def pin_ahead(self, states: list[OffloadStateType]) -> int:
        """Page-lock the host copies an offload of `states` to "cpu" will use, in the background (see
        zero3.offload.host's [Note: pinning ahead]); returns how many buffers are being made."""
        self.settle()
        wanted = [
            (buffer.name, buffer.numel, buffer.dtype)
            for state in states if state is not SCRATCH  # the scratch bucket is freed, never copied
            for buffer in self._buffers(state)
            if buffer.store is None and not buffer.parked and buffer.device.type != "cpu"
        ]
        making = self.host.reserve(wanted)
        if not wanted:
            log.info("pin_offload_buffers: %s live in host memory or on disk; nothing to pin", _names(states))
        elif making:
            log.info("pin_offload_buffers: page-locking %d host buffers (%s) in the background", making,
                     _mib(sum(numel * dtype.itemsize for _, numel, dtype in wanted)))
        return making

    def disk_root(self, nvme_path: str | Path | None) -> Path:
        """The directory `offload_states(device="nvme")` parks under: its `nvme_path`, else the config's."""
        path = nvme_path if nvme_path is not None else self._default_disk_root
        if not path:
            raise ValueError(
                "offload_states(device='nvme') needs a directory: pass nvme_path=... or set "
                "zero_optimization.offload_param.nvme_path in the config"
            )
        return Path(path)

    def offload(
        self,
        states: list[OffloadStateType],
        target: OffloadDevice,
        pin_memory: bool,
        non_blocking: bool,
        root: Path | None,
        prepare: Callable[[set[OffloadStateType]], None],
    ) -> None:
        self.settle()
        started = time.perf_counter()
        away = set(self.offloaded())
        if away & set(states):
            log.info("offload_states: %s already offloaded; left as they are", _names(s for s in states if s in away))
        moving: dict[OffloadStateType, list[FlatBuffer]] = {}
        in_place: list[OffloadStateType] = []
        on_disk: list[OffloadStateType] = []
        bare: list[OffloadStateType] = []
        for state in states:
            if state is SCRATCH or state in away:
                continue
            # A buffer whose tier keeps it on disk is already there: nothing of it is in memory to move.
            buffers = [b for b in self._buffers(state) if b.store is None]
            if not buffers:
                if self._buffers(state):
                    on_disk.append(state)
                elif (home := self._home_of(state)) is not None:
                    # Nothing to move ([Note: states that hold no memory now]); in place on a CPU engine.
                    (in_place if target is OffloadDevice.cpu and home.type == "cpu" else bare).append(state)
                continue
            if target is OffloadDevice.cpu and all(b.device.type == "cpu" for b in buffers):
                in_place.append(state)  # a CPU engine's states already live in host memory
            elif buffers:
                moving[state] = buffers
        if in_place:
            log.info(
                "offload_states(device='cpu'): the engine computes on the CPU, so %s already live in host "
                "memory; nothing to move", _names(in_place),
            )
        if on_disk:
            log.info("offload_states: %s live on disk by the offload tier (zero_optimization); nothing to move",
                     _names(on_disk))
        files: dict[str, DiskFile] = {}
        if target is OffloadDevice.nvme and moving:
            assert root is not None
            # "parked-": the tiers keep their own files (lp_params.bin...) in the same directory.
            files = self.disk.reserve(root, {f"parked-{b.name}": b.nbytes for bs in moving.values() for b in bs})
        free_scratch = SCRATCH in states and SCRATCH not in away
        prepare(set(moving) | ({SCRATCH} if free_scratch else set()))
        writes: Transfer | None = None
        if moving:
            if target is OffloadDevice.cpu:
                self._to_host(moving, pin_memory, non_blocking)
            else:
                writes = self._to_disk(moving, files, non_blocking)
            log.info(
                "offload_states: %s (%s) to %s in %.3f s%s", _names(moving),
                _mib(sum(b.nbytes for bs in moving.values() for b in bs)),
                target.value if target is OffloadDevice.cpu else f"disk at {self.disk.directory}",
                time.perf_counter() - started,
                ", writes finishing in the background" if non_blocking and target is OffloadDevice.nvme else "",
            )
        # Last, so a failed write leaves these where they were too.
        for state in bare:
            self._bare[state] = (torch.device("cpu") if target is OffloadDevice.cpu else torch.device("meta"), writes)
        if bare:
            log.info("offload_states: %s hold no memory now; offloaded with nothing to move", _names(bare))
        if free_scratch:
            existed = self._scratch.scratch is not None  # made at the first backward: none before it
            freed = self._scratch.scratch.nbytes if existed else 0
            self._scratch.free_scratch()
            self._scratch_freed = existed  # so reload recreates only a bucket that was there
            self._scratch_freed_with = writes
            log.info("offload_states: contiguous_grad_buffer freed (%s); reload_states() recreates it", _mib(freed))
        accelerator.release_host_memory()

    def _to_host(self, moving: dict[OffloadStateType, list[FlatBuffer]], pin: bool, non_blocking: bool) -> None:
        for state, buffers in moving.items():
            entries = []
            for buffer in buffers:
                home = buffer.device
                host, complete = self.host.to_host(buffer.name, buffer.tensor, pin, non_blocking)
                buffer.replace(host, complete)
                entries.append(_Parked(buffer, OffloadDevice.cpu, home))
            self._parked[state] = entries

    def _to_disk(
        self, moving: dict[OffloadStateType, list[FlatBuffer]], files: dict[str, DiskFile], non_blocking: bool
    ) -> Transfer:
        entries = [
            (state, _Parked(buffer, OffloadDevice.nvme, buffer.device, files[f"parked-{buffer.name}"]))
            for state, buffers in moving.items() for buffer in buffers
        ]
        # The bytes to write: the buffer itself on the CPU; a transient host copy of a device buffer.
        sources = [e.buffer.tensor if e.home.type == "cpu" else e.buffer.tensor.to("cpu") for _, e in entries]

        def written(error: BaseException | None) -> None:
            # Runs once, when the last write of the whole call has ended (see the Note).
            if error is None:
                for _, entry in entries:
                    entry.park_on_disk(self.disk)
                accelerator.release_host_memory()
                return
            for _, entry in entries:
                assert entry.file is not None
                entry.file.remove()
                entry.failed.append(error)

        transfer = Transfer(written)
        for state, entry in entries:
            entry.writing = transfer
            self._parked.setdefault(state, []).append(entry)
            # A reader waits for the writes (then finds the buffer parked, or intact if they failed).
            entry.buffer.replace(entry.buffer.tensor, transfer.wait)
        transfer.track([f for (_, e), source in zip(entries, sources) for f in self.disk.write(e.file, source)])
        if not non_blocking:
            self.settle()
        return transfer

    # ---- settle: finish what is in flight ------------------------------------
    def settle(self) -> None:
        """Wait for background writes, reads and file removals; report a failed background write once."""
        failures: list[tuple[str, str]] = []
        failed_writes: list[Transfer] = []
        for state, entries in list(self._parked.items()):
            for entry in entries:
                if entry.writing is not None:
                    entry.writing.wait()
                    if entry.failed:
                        failed_writes.append(entry.writing)
                    entry.writing = None
                    entry.buffer.wait()
            if any(entry.failed for entry in entries):
                del self._parked[state]  # the write failed: the state never left memory
                failures.append((state.value, str(entries[0].failed[0])))
        if self._scratch_freed and any(w is self._scratch_freed_with for w in failed_writes):
            self._scratch.allocate_scratch()  # the failed call is undone whole
            self._scratch_freed = False
        self._scratch_freed_with = None  # every write has ended
        for state, (place, writes) in list(self._bare.items()):
            if writes is not None and any(writes is failed for failed in failed_writes):
                del self._bare[state]  # the failed call is undone whole
            else:
                self._bare[state] = (place, None)
        for state in list(self._loading):
            self._finish_loading(state)
        self.disk.finish_removals()
        if failures:
            # One call's writes share one outcome: each distinct error once, with the states it kept.
            by_error: dict[str, list[str]] = {}
            for state_name, error in failures:
                by_error.setdefault(error, []).append(state_name)
            raise OffloadIOError(
                "writing states to disk failed, so they stayed in memory, intact (nothing was lost): "
                + "; ".join(f"{', '.join(names)}: {error}" for error, names in by_error.items())
            )

    # ---- reload ---------------------------------------------------------------
    def mark(self) -> tuple[set[OffloadStateType], bool]:
        """What is offloaded now, for `undo`."""
        return set(self._parked) | set(self._bare), self._scratch_freed

    def undo(self, mark: tuple[set[OffloadStateType], bool]) -> None:
        """Bring back what was offloaded since `mark` (another rank's offload failed: none keeps it)."""
        parked, scratch_freed = mark
        self.reload(False, only=(set(self._parked) | set(self._bare)) - parked, scratch=not scratch_freed)

    def reload(self, non_blocking: bool, only: set[OffloadStateType] | None = None, scratch: bool = True) -> None:
        self.settle()
        started = time.perf_counter()
        states = [state for state in self._parked if only is None or state in only]
        nbytes = sum(entry.buffer.nbytes for state in states for entry in self._parked[state])
        bare = [state for state in self._bare if only is None or state in only]
        for state in bare:
            del self._bare[state]  # nothing to bring back: its shards are made where they were again
        errors: list[OffloadIOError] = []
        for state in states:
            entries = self._parked.pop(state)
            self._loading[state] = entries
            try:
                for entry in entries:
                    if entry.location is OffloadDevice.cpu:
                        target, complete = self.host.to_device(entry.buffer.tensor, non_blocking)
                        entry.buffer.replace(target, complete)
                    else:
                        self._from_disk(entry, non_blocking)
                if not non_blocking:
                    self._finish_loading(state)
            except OffloadIOError as error:
                errors.append(error)
                self._repark(state)
        recreated = self._scratch_freed and scratch
        if recreated:
            self._scratch.allocate_scratch()
            self._scratch_freed = False
        if errors:
            raise errors[0]
        if states or bare or recreated:
            log.info(
                "reload_states: %s (%s)%s in %.3f s%s", _names([*states, *bare]) or "nothing else", _mib(nbytes),
                ", contiguous_grad_buffer recreated" if recreated else "", time.perf_counter() - started,
                ", reads finishing in the background" if non_blocking and states else "",
            )
        else:
            log.info("reload_states: nothing is offloaded; nothing to do")

    def _from_disk(self, entry: _Parked, non_blocking: bool) -> None:
        assert entry.file is not None
        staging = empty_host(entry.buffer.numel, entry.buffer.dtype)
        transfer = Transfer(lambda error: None).track(self.disk.read(entry.file, staging))

        def complete() -> None:
            error = transfer.wait()
            if error is not None:
                entry.park_on_disk(self.disk)  # never expose a half-read buffer
                assert entry.file is not None
                raise OffloadIOError(
                    f"reading state {entry.buffer.state!r} back from {entry.file.path} failed: {error}. "
                    "The state stays offloaded and its file is kept."
                ) from error

        if entry.home.type == "cpu":
            # The reads fill the buffer's new memory directly; a reader waits for them.
            entry.buffer.replace(staging, complete)
            return
        # A device buffer is filled from the host copy once it is read.
        complete()
        target, copied = self.host.to_device(staging, non_blocking)
        entry.buffer.replace(target, copied)

    def _finish_loading(self, state: OffloadStateType) -> None:
        """Complete a state's reads and remove its files; on a failed read the state is parked again."""
        entries = self._loading[state]
        try:
            for entry in entries:
                entry.buffer.wait()
        except OffloadIOError:
            self._repark(state)
            raise
        del self._loading[state]
        self.disk.discard([entry.file for entry in entries if entry.file is not None])

    def _repark(self, state: OffloadStateType) -> None:
        """Put a state whose reload failed back on disk: every buffer, so none is half there."""
        entries = self._loading.pop(state, None)
        if entries is None:
            return  # already parked again by the failed read's own handler
        for entry in entries:
            try:
                entry.buffer.wait()  # no read may still be filling memory we drop
            except OffloadIOError:
                pass  # the failure being handled, or another buffer's: the caller raises one
            if entry.location is OffloadDevice.nvme:
                entry.park_on_disk(self.disk)
        self._parked[state] = entries

    # ---- teardown ---------------------------------------------------------------
    def close(self) -> None:
        """Finish or drop everything in flight and remove every file (engine.destroy)."""
        for entries in list(self._parked.values()) + list(self._loading.values()):
            for entry in entries:
                if entry.writing is not None:
                    entry.writing.wait()
                try:
                    entry.buffer.wait()  # a read still filling memory finishes before its file goes
                except OffloadIOError:
                    pass  # the engine is going away; its data with it
                if entry.file is not None:
                    entry.file.remove()
        self._parked.clear()
        self._loading.clear()
        self._bare.clear()
        self.disk.finish_removals()


def _names(states: Iterable[OffloadStateType]) -> str:
    return ", ".join(state.value for state in states)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
