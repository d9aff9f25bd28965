"""The engine's collectives on flat tensors.

`Communicator` issues the engine's collectives on the groups of a topology
(zero3.topology makes them): every parameter all-gather, gradient
reduce-scatter, walk marker and step flag goes through it, so the choice of
collective (torch 2.13's `all_gather_single` / `reduce_scatter_single`, or
the older `*_into_tensor` / `*_tensor` names) and the care for gloo's worker
threads ([Note: the worker's tensors]) live in one place. Two exchanges run
on its groups without it: Muon's all-to-all (zero3.optim.muon, on the mesh's
shard group) and DCP's own collectives in a save or load (zero3.checkpoint).
Joining the default group before any of this (`init_distributed`,
`join_world`) is zero3.default_group's.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

# Re-exported: the `zero3` command's workers and the examples call `comm.join_world`.
from zero3.default_group import join_world

if TYPE_CHECKING:
    from zero3.topology import Topology

__all__ = ["Communicator", "join_world"]

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Communicator:
    """The engine's collectives on flat tensors, on the groups of one `Topology` (zero3.topology).
    Where this rank sits (its shard and replicate coordinates) is not asked here: the topology's
    `ShardMesh` says it. Which collective runs on which group, and why: see zero3.topology's
    [Note: the engine's groups].
    """

    # [Note: the worker's tensors]
    # A gloo collective runs on a worker thread, which lets go of the work (and
    # so of the tensors in it) only after `wait()` has returned to us. When that
    # release drops a tensor's last reference from C++, torch gives up the
    # tensor's Python object, which takes the GIL. If the interpreter is
    # finalizing by then, CPython kills the thread asking for the GIL, here
    # inside a C++ destructor, and the process aborts with "terminate called
    # without an active exception" (seen in two-rank jobs ending in
    # destroy_process_group()). So each collective gets private aliases of its
    # tensors (`_HANDED_OVER`), whose reference counts say whether a worker
    # still holds them, and at exit the interpreter waits, releasing the GIL,
    # until no worker does.
    def __init__(self, topology: Topology | None = None) -> None:
        self.topology = topology
        if topology is None:
            self.group = self.reduce_group = self.control_group = None
            self._size = self._job_size = dist.get_world_size()
        else:
            self.group = topology.gather_group
            self.reduce_group = topology.reduce_group
            self.control_group = topology.control_group
            self._size = topology.shard.shard_size  # a group of one communicates nothing
            self._job_size = topology.world_size

    def close(self) -> None:
        """Destroy the topology's groups (every rank calls this)."""
        _forget_released()
        if self.topology is not None:
            self.topology.close()
            self.topology = None

    def all_gather_flat(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                        group: dist.ProcessGroup | None = None) -> dist.Work | None:
        """output[r*n:(r+1)*n] = rank r's `shard` (n = shard.numel()), on the shard group, or on `group` (the
        expert-data group an expert's shards lie on: zero3.topology's [Note: the engine's groups])."""
        if group is None and self._size == 1:
            output.copy_(shard)
            return None
        out, inp = self._hand_over(output, shard)
        return self._started(_all_gather_flat(out, inp, group=group if group is not None else self.group, async_op=True), async_op)

    def all_gather_secondary(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output[r*n:(r+1)*n] = secondary rank r's `shard`, on hpZ's node-local secondary group."""
        assert self.topology is not None and self.topology.secondary is not None, "hpZ is off: no secondary group"
        out, inp = self._hand_over(output, shard)
        group = self.topology.secondary_group
        return self._started(_all_gather_flat(out, inp, group=group, async_op=True), async_op)

    def all_to_all_grads(self, output: torch.Tensor, sent: torch.Tensor, across: bool) -> dist.Work | None:
        """Start qgZ's all-to-all of equal rows (row r of `sent` to rank r, rank r's row for this rank into
        output's row r) inside this rank's node, or `across` the nodes (zero3.topology's
        [Note: the engine's groups])."""
        topology = self.topology
        assert topology is not None and topology.grads_inside is not None, "qgZ is off: no gradient groups"
        group = (topology.grads_across if across else topology.grads_inside).shard_group
        out, inp = self._hand_over(output, sent)
        return self._started(dist.all_to_all_single(out, inp, group=group, async_op=True), True)

    def reduce_scatter_flat(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False,
                            group: dist.ProcessGroup | None = None) -> dist.Work | None:
        """output = sum over ranks of full[rank*n:(rank+1)*n] (n = output.numel()), on the reduce group, or on
        `group` (an expert's expert-data group).

        `output` may be this rank's own chunk of `full` (in place)."""
        if group is None and self._size == 1:
            if output.data_ptr() != full.data_ptr():
                output.copy_(full[: output.numel()])
            return None
        out, inp = self._hand_over(output, full)
        work = _reduce_scatter_flat(out, inp, op=dist.ReduceOp.SUM, group=group if group is not None else self.reduce_group, async_op=True)
        return self._started(work, async_op)

    def all_gather_control(self, values: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        """Start gathering a small host tensor from every rank on the control group: ([world, n], work)."""
        output = torch.empty((self._job_size, values.numel()), dtype=values.dtype)
        if self._job_size == 1:
            output[0].copy_(values)
            return output, None
        out, inp = self._hand_over(output.view(-1), values)
        return output, self._started(_all_gather_flat(out, inp, group=self.control_group, async_op=True), True)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the shard group (the replicas' sum is `all_reduce_replicas`)."""
        if self._size > 1:
            (alias,) = self._hand_over(tensor)
            self._started(dist.all_reduce(alias, op=dist.ReduceOp.SUM, group=self.group, async_op=True), False)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Job rank `src`'s `tensor` on every rank of the job, replicas too (so that they start equal)."""
        if self._job_size > 1:
            group = self.topology.job_group if self.topology is not None else None
            (alias,) = self._hand_over(tensor)
            self._started(dist.broadcast(alias, src=src, group=group, async_op=True), False)
        return tensor

    @property
    def has_replicas(self) -> bool:
        """Whether each shard has replicas to sum with (HSDP, MiCS): `all_reduce_replicas` does something."""
        topology = self.topology
        return topology is not None and topology.shard.replicate_size > 1

    def all_reduce_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum across the replicas of this rank's shard (HSDP, MiCS; none: nothing to do). A host tensor
        beside an accelerator goes on the topology's gloo replicate group.

        [Note: the replicas' sum, once a step]
        The reduce-scatters land in an order each rank's timing decides (the
        reducer lands what has finished), so an all-reduce per landed bucket
        would reach the replicate group in different orders on different
        ranks, and a blocking one mid-backward waits on a replica that has
        moved on to the walk's end-of-pass markers, which wait on this rank. So
        the replicas sum the accumulated gradient shard once, where every rank
        agrees on the step (as DeepSpeed's MiCS does at the accumulation
        boundary): the same bytes cross between replicas, once per step rather
        than once per micro-step.
        """
        if not self.has_replicas:
            return tensor
        topology = self.topology
        assert topology is not None
        group = topology.replicate_group
        if tensor.device.type == "cpu" and dist.get_backend(group) != "gloo":
            group = topology.host_replicate_group
        (alias,) = self._hand_over(tensor)
        self._started(dist.all_reduce(alias, op=dist.ReduceOp.SUM, group=group, async_op=True), False)
        return tensor

    @property
    def job_alone(self) -> bool:
        """A job of one rank: no agreement to reach."""
        return self._job_size == 1

    @property
    def job_size(self) -> int:
        """The ranks of the job (the control group's)."""
        return self._job_size

    @property
    def alone(self) -> bool:
        """A shard group of one: every parameter and gradient collective is the identity."""
        return self._size == 1

    def any_of_flags(self, flags: list[bool], group: dist.ProcessGroup | None = None) -> list[bool]:
        """For each flag, whether it is set on any rank: a host all-reduce on the gloo control group (or
        `group`, a gloo group), so the answer never waits on the accelerator."""
        if self._members(group) == 1:
            return list(flags)
        counts = torch.tensor(flags, dtype=torch.uint8)
        (alias,) = self._hand_over(counts)
        self._started(dist.all_reduce(alias, op=dist.ReduceOp.MAX, group=group or self.control_group,
                                      async_op=True), False)
        return [count > 0 for count in counts.tolist()]

    def all_gather_objects(self, value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
        """Every rank's picklable `value`, in rank order (default: the gloo control group, between steps)."""
        members = self._members(group)
        if members == 1:
            return [value]
        out: list[Any] = [None] * members
        dist.all_gather_object(out, value, group=group or self.control_group)
        return out

    def _members(self, group: dist.ProcessGroup | None) -> int:
        return self._job_size if group is None else dist.get_world_size(group)

    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        """Every rank has reached this point (default: the gloo control group, between steps)."""
        if self._job_size > 1:
            dist.barrier(group=group or self.control_group)

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The gloo group of checkpoint writes that run while training goes on (the topology's)."""
        return self.topology.checkpoint_group() if self.topology is not None else self.group

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
        with _HANDED_OVER_LOCK:
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
# Collectives start from more than one thread (the walk's keeper, qgZ's helper): the list changes under a lock.
_HANDED_OVER_LOCK = threading.Lock()


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
    with _HANDED_OVER_LOCK:
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
