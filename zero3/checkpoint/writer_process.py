"""The checkpoint writer process: async saves written outside the training process.

[Note: a writer process per rank]
An async save written by a thread of the training process shares that
process's GIL: DCP's planning and its per-item `torch.save` are Python, and a
training thread that is host-bound (launching kernels, running hooks) waits
for the GIL between every call. Where the step is host-bound and a save
follows every step, the thread's GIL time lengthens the step; where the step's
time is in kernels that let go of the GIL, a thread and a process cost the same
(docs/benchmarks.md, "Measurements behind the design"). So each rank's async
saves are written by a process of its own, as DCP's and torchtitan's "process"
mode does. The training process copies its state into a shared-memory
segment (zero3.checkpoint.staging) and sends the writer a request: the
`Write` (zero3.checkpoint.tag_write) and where each entry sits in the segment.
The writers run the same `Write` a blocking save runs, on a gloo group of
their own, so DCP's files, the checksums, the agreement on a failure and the
publication are the same code.

The writers' group joins the job's TCP store (the default group's, reached by
its address) under a prefix of their own; a job whose store has no address (a
file store, at more than one rank) writes in a thread instead. The writer is
started as `python -c` importing this module (never multiprocessing's spawn, which re-runs a
training script that has no `__main__` guard), asks the kernel to kill it
with its parent, and exits when the parent hangs up. A writer that fails in a
way its peers did not agree on (a peer died) exits: the next async save sees
it, and every rank starts a new writer.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.serialization.config as torch_serialization_config

from zero3.checkpoint.staging import Placement, views
from zero3.shared_segments import attach, release
from zero3.checkpoint.tags import CheckpointError

log = logging.getLogger("zero3")

_PR_SET_PDEATHSIG = 1  # prctl(2)
_ENTRY = "import sys; from zero3.checkpoint.writer_process import main; sys.exit(main())"
_READ = object()  # the writer's word that it has read the state (before the tag's answer)
_STARTUP_S = 600.0  # a writer importing torch on a loaded machine takes seconds; more means it is stuck


@dataclass(frozen=True)
class WriterSetup:
    """How a writer joins its peers: the job's TCP store (None: a world of one, no store needed)."""

    store: tuple[str, int] | None
    prefix: str  # this generation of writers' keys in the store
    rank: int
    world_size: int
    timeout_s: float


@dataclass(frozen=True)
class WriteRequest:
    write: Any  # zero3.checkpoint.tag_write.Write
    segment: str  # the staging segment's name
    placements: list[Placement]
    keep_mapped: bool  # the next save stages into the same segment: keep it mapped, else let it go once written
    state_segment: str | None = None  # the engine's shared state, where placements read in place (kept mapped)


def job_store_address() -> tuple[str, int] | None:
    """Where the default group's TCP store listens, or None where it has no address (a file or hash store)."""
    try:
        store: Any = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


class WriterProcess:
    """The training process's handle on its writer. Every call but `alive` runs on the saves' own thread."""

    def __init__(self, setup: WriterSetup) -> None:
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
            # This process's import path, so the writer imports the zero3 (and torch) it runs, wherever from.
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path)),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._ready = False
        self._send(setup)

    @property
    def alive(self) -> bool:
        """Whether the writer runs, asked between writes. A process that is exiting has let go of its address
        space first (its command line reads empty), then of its files, and only then can it be reaped; it
        sends nothing between writes, so something to read on its connection (its end closed) means it died
        too. Before its first write, its startup answer may be what is waiting."""
        if self._process.poll() is not None or not _has_address_space(self._process.pid):
            return False
        return not self._ready or not self._conn.poll(0)

    def write(self, request: WriteRequest, on_read: Callable[[], None] | None = None) -> Path:
        """Have the writer write one tag; returns its path, or raises what the writer raised. `on_read` is
        called when the writer says it has read all of the state (`Write.run`'s)."""
        if not self._ready:
            self._reply(f"starting the checkpoint writer process (pid {self._process.pid})", _STARTUP_S)
            self._ready = True
        doing = f"writing tag {request.write.tag!r}"
        try:
            self._send(request)
        except OSError:
            code = self._process.wait()
            raise CheckpointError(f"the checkpoint writer process exited (code {code}) before {doing}") from None
        while (path := self._reply(doing, None)) is _READ:
            if on_read is not None:
                on_read()
        return Path(path)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the writer to exit; kill it if it does not within `timeout_s`."""
        try:
            self._send(None)
        except OSError:
            pass  # it is gone already
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._conn.close()

    def _send(self, message: Any) -> None:
        self._conn.send_bytes(pickle.dumps(message))

    def _reply(self, doing: str, timeout_s: float | None) -> Any:
        try:
            if timeout_s is not None and not self._conn.poll(timeout_s):
                raise CheckpointError(f"the checkpoint writer process gave no answer in {timeout_s:.0f} s {doing}")
            outcome, value = pickle.loads(self._conn.recv_bytes())  # our own child's answer
        except (EOFError, OSError):
            code = self._process.wait()
            raise CheckpointError(f"the checkpoint writer process exited (code {code}) while {doing}") from None
        if outcome == "failed":
            raise value
        return _READ if outcome == "read" else value


def _has_address_space(pid: int) -> bool:
    """Whether process `pid` (our child, not yet reaped) still has its memory: an exiting one has none."""
    try:
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:  # no /proc here: the other signs decide
        return True


# --------------------------------------------------------------------------- the writer's side


class _WritersGroup:
    """The writers' gloo group, as `Write.run` reaches its peers."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group
        self._world_size = world_size

    def all_gather_objects(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self._world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self) -> None:
        dist.barrier(group=self.group)


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the request took hold
        os._exit(1)


def _join(setup: WriterSetup) -> Any:
    timeout = datetime.timedelta(seconds=setup.timeout_s)
    if setup.store is None:
        store: dist.Store = dist.HashStore()
    else:
        host, port = setup.store
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore(setup.prefix, store)
    dist.init_process_group("gloo", store=store, rank=setup.rank, world_size=setup.world_size, timeout=timeout)
    return dist.group.WORLD


def _portable(error: BaseException) -> BaseException:
    """`error` as the training process can unpickle it (a CheckpointError naming it where it cannot)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any unpicklable error is described instead
        return CheckpointError(f"the checkpoint writer process failed: {error!r}")


def serve(conn: Connection) -> int:
    """The writer's loop: one request at a time until the parent hangs up."""
    setup: WriterSetup = pickle.loads(conn.recv_bytes())
    try:
        group = _WritersGroup(_join(setup), setup.world_size)
    except BaseException as error:  # noqa: BLE001 - told to the parent
        conn.send_bytes(pickle.dumps(("failed", _portable(error))))
        return 1
    conn.send_bytes(pickle.dumps(("ready", None)))
    segment: Any = None
    state: Any = None  # the engine's shared state (zero3.checkpoint.shared_state), mapped while it is the same
    try:
        while True:
            try:
                request: WriteRequest | None = pickle.loads(conn.recv_bytes())
            except EOFError:
                return 0
            if request is None:
                return 0
            if segment is None or segment.name != request.segment:
                if segment is not None:
                    release(segment, unlink=False)
                segment = attach(request.segment)
            if state is not None and state.name != request.state_segment:
                release(state, unlink=False)
                state = None
            if state is None and request.state_segment is not None:
                state = attach(request.state_segment)
            staged: Any = None
            try:
                staged = views((segment.buf, state.buf if state is not None else None), request.placements)
                def tell_read() -> None:
                    conn.send_bytes(pickle.dumps(("read", None)))

                reply: tuple[str, Any] = ("written", str(request.write.run(group, staged, tell_read)))
            except CheckpointError as error:  # agreed by every writer: the group is whole, go on
                reply = ("failed", error)
            except BaseException as error:  # noqa: BLE001 - a collective broke: this generation is over
                conn.send_bytes(pickle.dumps(("failed", _portable(error))))
                return 1
            staged = None  # (no view may outlive a mapping)
            if not request.keep_mapped:
                release(segment, unlink=False)
                segment = None
            conn.send_bytes(pickle.dumps(reply))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    fd, parent_pid = int(args[0]), int(args[1])
    _die_with_parent(parent_pid)
    torch.set_num_threads(1)
    # torch.save's zip CRC-32 of every item would be a second pass over the bytes: zero3 sums each item
    # itself (XXH3) and checks it at load, and torch.load never reads the CRC. This process saves nothing else.
    torch_serialization_config.save.compute_crc32 = False
    with Connection(fd) as conn:
        return serve(conn)

