"""Process-group setup and every collective the engine issues.

All engine communication goes through this module so that the choice of
collective (torch 2.13's `all_gather_single` / `reduce_scatter_single`, or the
older `*_into_tensor` / `*_tensor` names) is made once.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from zero3 import accelerator

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(device: torch.device) -> None:
    """Join (or create) the default process group.

    Under torchrun the env:// variables are set. A plain `python train.py` has
    none of them: it becomes a world of one on a private loopback port.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ["RANK"] = "0"
            os.environ["WORLD_SIZE"] = "1"
            os.environ.setdefault("LOCAL_RANK", "0")
        backend = accelerator.communication_backend(device)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)


def join_world(device_choice: str | torch.device | None = None) -> torch.device:
    """The device by zero3's rule (an explicit choice, else ZERO3_ACCELERATOR, else auto), made
    current, and the default group joined on its backend: what a script does before building
    models (`zero3 train`'s workers, the examples)."""
    device = accelerator.resolve_device(device_choice)
    accelerator.set_device(device)
    init_distributed(device)
    return device


class Communicator:
    """The collectives of one shard group, on flat tensors only. Where this rank sits (its shard and
    replicate coordinates) is not asked here: zero3.partition.mesh.ShardMesh says it.

    [Note: three groups]
    Parameter all-gathers run on `group`, in the order of the lockstep gather
    walk (zero3.runtime.gather_walk), which every rank issues identically.
    Gradient reduce-scatters run in a canonical bucket order, but at times
    that depend on each rank's backward, so they get a group of their own
    (`reduce_group`): a collective sequence must match only within a group.
    The walk's markers are small host tensors on a gloo group (`control_group`),
    so reading one never waits on the accelerator. `open_side_groups` makes
    the two extra groups (a collective call, made by the engine on every
    rank); `close` destroys them. A world of one needs neither.
    """

    # [Note: the worker's tensors]
    # A gloo collective runs on a worker thread, which lets go of the work (and
    # so of the tensors in it) only after `wait()` has returned to us. When that
    # release drops a tensor's last reference from C++, torch gives up the
    # tensor's Python object, which takes the GIL. If the interpreter is
    # finalizing by then, CPython kills the thread asking for the GIL, here
    # inside a C++ destructor, and the process aborts with "terminate called
    # without an active exception" (3 of 80 two-rank jobs ending in
    # destroy_process_group()). So each collective gets private aliases of its
    # tensors (`_HANDED_OVER`), whose reference counts say whether a worker
    # still holds them, and at exit the interpreter waits, releasing the GIL,
    # until no worker does.
    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._size = dist.get_world_size(group)  # a group of one communicates nothing
        self.reduce_group: dist.ProcessGroup | None = group
        self.control_group: dist.ProcessGroup | None = group
        self._side_groups: list[dist.ProcessGroup] = []
        self._checkpoint_group: dist.ProcessGroup | None = None

    def open_side_groups(self) -> None:
        if self._size == 1 or self._side_groups:
            return
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
        backend = dist.get_backend(self.group)
        self.reduce_group = dist.new_group(ranks=ranks, backend=backend)
        self.control_group = dist.new_group(ranks=ranks, backend="gloo")
        self._side_groups = [self.reduce_group, self.control_group]

    def close(self) -> None:
        """Destroy the side groups (every rank calls this, as it called `open_side_groups`)."""
        groups, self._side_groups = self._side_groups, []
        self._checkpoint_group = None
        _forget_released()
        self.reduce_group = self.control_group = self.group
        if dist.is_initialized():
            for group in groups:
                dist.destroy_process_group(group)

    def all_gather_flat(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output[r*n:(r+1)*n] = rank r's `shard` (n = shard.numel())."""
        if self._size == 1:
            output.copy_(shard)
            return None
        out, inp = self._hand_over(output, shard)
        return self._started(_all_gather_flat(out, inp, group=self.group, async_op=True), async_op)

    def reduce_scatter_flat(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output = sum over ranks of full[rank*n:(rank+1)*n] (n = output.numel()), on the reduce group.

        `output` may be this rank's own chunk of `full` (in place)."""
        if self._size == 1:
            if output.data_ptr() != full.data_ptr():
                output.copy_(full[: output.numel()])
            return None
        out, inp = self._hand_over(output, full)
        work = _reduce_scatter_flat(out, inp, op=dist.ReduceOp.SUM, group=self.reduce_group, async_op=True)
        return self._started(work, async_op)

    def all_gather_control(self, values: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        """Start gathering a small host tensor from every rank on the control group: ([world, n], work)."""
        output = torch.empty((self._size, values.numel()), dtype=values.dtype)
        if self._size == 1:
            output[0].copy_(values)
            return output, None
        out, inp = self._hand_over(output.view(-1), values)
        return output, self._started(_all_gather_flat(out, inp, group=self.control_group, async_op=True), True)

    def all_reduce_sum(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Sum over the shard group (or over `group`, e.g. a mesh's replicate group)."""
        group = group if group is not None else self.group
        if dist.get_world_size(group) > 1:
            (alias,) = self._hand_over(tensor)
            self._started(dist.all_reduce(alias, op=dist.ReduceOp.SUM, group=group, async_op=True), False)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self._size > 1:
            root = dist.get_global_rank(self.group, src) if self.group else src
            (alias,) = self._hand_over(tensor)
            self._started(dist.broadcast(alias, src=root, group=self.group, async_op=True), False)
        return tensor

    @property
    def alone(self) -> bool:
        """A group of one: every collective is the identity."""
        return self._size == 1

    def any_of_flags(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether it is set on any rank: a host all-reduce on the gloo control group,
        so the answer never waits on the accelerator."""
        if self._size == 1:
            return list(flags)
        counts = torch.tensor(flags, dtype=torch.uint8)
        (alias,) = self._hand_over(counts)
        self._started(dist.all_reduce(alias, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True), False)
        return [count > 0 for count in counts.tolist()]

    def all_gather_objects(self, value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
        """Every rank's picklable `value`, in rank order (default: the gloo control group, between steps)."""
        if self._size == 1:
            return [value]
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, value, group=group or self.control_group)
        return out

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        """Every rank has reached this point (default: the gloo control group, between steps)."""
        if self._size > 1:
            dist.barrier(group=group or self.control_group)

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for checkpoint writes that run while training goes on (made on first
        use: every rank must ask at the same point, as a save does)."""
        if self._size == 1:
            return self.group
        if self._checkpoint_group is None:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else None
            self._checkpoint_group = dist.new_group(ranks=ranks, backend="gloo")
            self._side_groups.append(self._checkpoint_group)
        return self._checkpoint_group

    @staticmethod
    def forget_released() -> None:
        """Let go of the aliases no worker holds any more, so their storage can be freed now.

        Every collective does this first; callers that just freed a collective's
        buffer (a released unit, a landed reduction) call it too.
        """
        _forget_released()

    @staticmethod
    def settle(timeout_s: float = 1.0) -> None:
        """Between collectives (every work complete): wait, the GIL free, until the workers
        have let go of every alias, so the memory they pin is freed (before an offload)."""
        _settle(timeout_s)

    @staticmethod
    def _hand_over(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Private aliases (same storage) of a collective's tensors; see the Note."""
        _forget_released()
        aliases = tuple(t.detach() for t in tensors)
        _HANDED_OVER.append(aliases)
        return aliases

    @staticmethod
    def _started(work: dist.Work, async_op: bool) -> dist.Work | None:
        """An async op's work goes to the caller, who waits on it; a blocking one is waited here."""
        if async_op:
            return work
        work.wait()
        return None


# Aliases of every communicator's collectives that a worker may still hold (see the Note).
_HANDED_OVER: list[tuple[torch.Tensor, ...]] = []


def _python_refs(aliases: tuple[torch.Tensor, ...]) -> list[int]:
    return [sys.getrefcount(alias) for alias in aliases]


# What `_python_refs` counts for an alias nothing but its tuple holds.
_LONE_REFS = _python_refs((torch.empty(0),))[0]


def _still_held(aliases: tuple[torch.Tensor, ...]) -> bool:
    """Whether a worker holds an alias, or is still letting go of it.

    A worker first drops its C++ reference (the use count falls to ours, 1),
    then the reference torch keeps on the alias's Python object while C++
    holds the tensor; only after both is the alias ours alone.
    """
    return any(alias._use_count() > 1 for alias in aliases) or any(
        refs > _LONE_REFS for refs in _python_refs(aliases)
    )


def _forget_released() -> None:
    """Drop the aliases no work holds any more (ours is then the last reference)."""
    _HANDED_OVER[:] = [aliases for aliases in _HANDED_OVER if _still_held(aliases)]


def _settle(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    _forget_released()
    while _HANDED_OVER and time.monotonic() < deadline:
        time.sleep(0.001)
        _forget_released()


@atexit.register
def _let_workers_release() -> None:
    """Atexit runs before finalization: let every worker finish letting go (see the Note).

    Two seconds is ample for a descheduled worker thread; an alias still held
    after it belongs to a work Python itself keeps, freed by the GC under the GIL.
    """
    _settle(2.0)
