"""Process-group setup, and the engine's collectives on flat tensors.

`init_distributed` joins the default group (safe across torchrun restarts);
`Communicator` makes the engine's groups and issues its collectives: every
parameter all-gather, gradient reduce-scatter, walk marker and step flag goes
through it, so the choice of collective (torch 2.13's `all_gather_single` /
`reduce_scatter_single`, or the older `*_into_tensor` / `*_tensor` names) and
the care for gloo's worker threads (the Note below) live in one place. Two
exchanges run on its groups without it: Muon's all-to-all (zero3.optim.muon,
on the mesh's shard group) and DCP's own collectives in a save or load
(zero3.checkpoint).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import math
import os
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from zero3 import accelerator
from zero3 import error_exit  # noqa: F401 - its exit hook: a rank that failed leaves now (see its Note)

if TYPE_CHECKING:
    from zero3.topology import Topology

log = logging.getLogger("zero3")

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT: the MASTER_PORT an MPI-discovered world gets.
DEFAULT_PORT = 29500

_MPI_VARIABLES = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join (or create) the default process group: DeepSpeed's `deepspeed.init_distributed`.

    dist_backend: None picks it by zero3's device rule (`zero3.accelerator.resolve_device`: gloo on
        the CPU, NCCL on CUDA; the device is made current); a name ("gloo", "nccl", ...) is used as is.
    auto_mpi_discovery, distributed_port: where RANK/WORLD_SIZE/... are unset but Open MPI's
        OMPI_COMM_WORLD_* are (mpirun), they give the rank, world size and local rank, and
        MASTER_PORT defaults to `distributed_port`; MASTER_ADDR must be set (zero3 does not use
        mpi4py to find rank 0's address). With neither, a plain `python train.py` is a world of one.
    timeout: the default group's timeout (a timedelta, or seconds); None is torch's default.
    init_method: as torch's ("env://" when None); rank, world_size: as torch's (-1: from the method).
    dist_init_required: None or True joins unless a default group exists (then nothing is done);
        False requires one to exist already.
    config: accepted for DeepSpeed's signature, which reads only its comms-logger settings there;
        zero3 has no comms logger, so it is not read. The engine's own settings (comm_timeout_s
        among them) come from the config given to `zero3.initialize`.

    Safe across torchrun restarts: see [Note: one store namespace per attempt].
    """
    if dist_init_required is False:
        if not dist.is_initialized():
            raise RuntimeError(
                "zero3.init_distributed(dist_init_required=False) needs a default process group, but none "
                "exists; call it with dist_init_required=None (or True), or torch.distributed.init_process_group first"
            )
        return
    if dist_init_required not in (None, True):
        raise TypeError(f"dist_init_required must be None, True or False, got {dist_init_required!r}")
    if dist_backend is not None and not isinstance(dist_backend, str):
        raise TypeError(f"dist_backend must be a backend name (e.g. 'gloo', 'nccl') or None, got {dist_backend!r}")
    pg_timeout = _as_timeout(timeout, "timeout")
    if dist.is_initialized():
        if verbose and dist.get_rank() == 0:
            log.info("zero3.init_distributed: the default process group already exists; it is used as is")
        return
    if auto_mpi_discovery:
        _discover_mpi(distributed_port)
    device_id = None
    if dist_backend is None:
        device = accelerator.resolve_device(None)
        accelerator.set_device(device)
        dist_backend = accelerator.communication_backend(device)
        device_id = device if device.type == "cuda" else None
    _init_default_group(dist_backend, pg_timeout, init_method, rank, world_size, device_id)
    if verbose and dist.get_rank() == 0:
        log.info(
            "zero3.init_distributed: a world of %d on %s%s", dist.get_world_size(), dist_backend,
            f" (attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} of this torchrun job)"
            if "TORCHELASTIC_RESTART_COUNT" in os.environ else "",
        )


def join_default_group(device: torch.device, timeout_s: float | None = None) -> None:
    """Join (or create) the default process group on `device`'s backend.

    Under torchrun the env:// variables are set. A plain `python train.py` has
    none of them: it becomes a world of one on a private loopback port.
    `timeout_s` is the group's timeout where this call creates it (None: torch's default).
    """
    if not dist.is_initialized():
        backend = accelerator.communication_backend(device)
        timeout = _as_timeout(timeout_s, "timeout_s")
        _init_default_group(backend, timeout, None, -1, -1, device if device.type == "cuda" else None)


def join_world(device_choice: str | torch.device | None = None) -> torch.device:
    """The device by zero3's rule (an explicit choice, else ZERO3_ACCELERATOR, else auto), made
    current, and the default group joined on its backend: what a script does before building
    models (`zero3 train`'s workers, the examples)."""
    device = accelerator.resolve_device(device_choice)
    accelerator.set_device(device)
    join_default_group(device)
    return device


def _as_timeout(value: datetime.timedelta | float | None, name: str) -> datetime.timedelta | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a datetime.timedelta, a number of seconds or None, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive, finite duration, got {value!r}")
    return datetime.timedelta(seconds=seconds)


def _discover_mpi(port: int) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK and MASTER_PORT from Open MPI's variables, where only those are set."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    if not all(variable in os.environ for variable in _MPI_VARIABLES):
        return
    if "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            "zero3.init_distributed: launched by mpirun (OMPI_COMM_WORLD_RANK is set) without MASTER_ADDR; "
            "zero3 does not ask MPI for rank 0's address: export MASTER_ADDR (rank 0's host) to every rank, "
            "or launch with torchrun"
        )
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["LOCAL_RANK"] = os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]
    os.environ.setdefault("MASTER_PORT", str(port))


def _init_default_group(
    backend: str,
    timeout: datetime.timedelta | None,
    init_method: str | None,
    rank: int,
    world_size: int,
    device_id: torch.device | None,
) -> None:
    explicit = rank >= 0 and world_size > 0
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if device_id is not None:
        kwargs["device_id"] = device_id
    if init_method is None and not explicit and ("RANK" not in os.environ or "WORLD_SIZE" not in os.environ):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["RANK"] = "0"
        os.environ["WORLD_SIZE"] = "1"
        os.environ.setdefault("LOCAL_RANK", "0")
        if "MASTER_PORT" not in os.environ:
            # A world of one hosts its own store, on a port the kernel picks as it binds: a port found free and
            # bound later could be taken in between by another process (two such jobs side by side were).
            store = dist.TCPStore(os.environ["MASTER_ADDR"], 0, 1, True, timeout or default_pg_timeout)
            os.environ["MASTER_PORT"] = str(store.port)
            dist.init_process_group(backend=backend, **(kwargs | {"store": store, "rank": 0, "world_size": 1}))
            return
    url = init_method or "env://"
    if _store_outlives_attempt(url):
        store_timeout = timeout or default_pg_timeout
        store, rank, world_size = next(dist.rendezvous(url, rank, world_size, timeout=store_timeout))
        store.set_timeout(store_timeout)
        token = _attempt_token(store, rank, world_size, store_timeout)
        kwargs.update(rank=rank, world_size=world_size, store=dist.PrefixStore(f"{_ATTEMPT_KEYS}/{token}", store))
        dist.init_process_group(backend=backend, **kwargs)
    else:
        dist.init_process_group(backend=backend, init_method=url, **kwargs)


# [Note: one store namespace per attempt]
# torchrun's agent (its c10d rendezvous, as torch 2.13 has it) hosts the TCPStore that env://
# connects every worker to (TORCHELASTIC_USE_AGENT_STORE=True), and keeps that one server for the
# agent's whole life: a restarted attempt's workers find the dead attempt's keys in it. Every process group's
# keys are named by group ("default_pg/0/", ".../1/", ... in creation order, the same in each
# attempt), and gloo's connectFullMesh reads a peer's address from its key as soon as it exists:
# a stale one sends it to a port of the dead attempt ("Connection refused", or a connect that
# waits out the timeout). TORCHELASTIC_RESTART_COUNT cannot scope the keys: each agent counts its
# own restarts, so nodes disagree on it (pytorch/pytorch#135712, #108158).
# So the attempt's ranks agree on a fresh random token first and run every group under the prefix
# it names. Only fresh values are trusted: each rank r > 0 asks under "ask/r" with a nonce of its
# own and waits for "answer/<nonce>", which only this attempt's rank 0 can write; rank 0 answers
# whatever nonce it finds under "ask/r" (a dead attempt's, until this attempt's overwrites it)
# until rank r has joined under the new token.
_ATTEMPT_KEYS = "zero3/attempt"


def _store_outlives_attempt(url: str) -> bool:
    """Whether the rendezvous store is the torchrun agent's (it outlives this attempt's workers)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True) and url.startswith(("env://", "tcp://"))


def _attempt_token(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A token every rank of this attempt shares and no earlier attempt used (see the Note)."""
    if world_size == 1:
        return uuid.uuid4().hex
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_ATTEMPT_KEYS}/ask/{rank}", nonce)
        answer = f"{_ATTEMPT_KEYS}/answer/{nonce}"
        token = store.get(answer).decode()  # waits, up to the store's timeout, for rank 0
        store.delete_key(answer)
        store.set(f"{_ATTEMPT_KEYS}/{token}/joined/{rank}", "1")
        return token
    token = uuid.uuid4().hex
    answered: dict[int, str] = {}
    waiting = list(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        # Every rank has asked by now, in this attempt or an earlier one: answer what is there.
        for peer, nonce in zip(waiting, store.multi_get([f"{_ATTEMPT_KEYS}/ask/{r}" for r in waiting])):
            if answered.get(peer) != nonce.decode():
                if peer in answered:
                    store.delete_key(f"{_ATTEMPT_KEYS}/answer/{answered[peer]}")  # a dead attempt's nonce
                answered[peer] = nonce.decode()
                store.set(f"{_ATTEMPT_KEYS}/answer/{answered[peer]}", token)
        joined = [f"{_ATTEMPT_KEYS}/{token}/joined/{r}" for r in waiting]
        try:
            store.wait(joined, datetime.timedelta(milliseconds=200))
        except RuntimeError:  # not all joined yet (some nonces read were a dead attempt's): read again
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"zero3.init_distributed: ranks {waiting} did not join this attempt's rendezvous within "
                    f"{timeout}"
                ) from None
            waiting = [r for r, key in zip(waiting, joined) if not store.check([key])]
            continue
        waiting = []
    for peer in range(1, world_size):
        store.delete_key(f"{_ATTEMPT_KEYS}/{token}/joined/{peer}")
    return token


def engine_timeout(timeout_s: float | None) -> datetime.timedelta | None:
    """How long the engine's groups wait for a lost peer: the config's `comm_timeout_s`, else as long
    as the default group does (its owner's choice; None where torch does not say)."""
    return _as_timeout(timeout_s, "comm_timeout_s") or _group_timeout(None)


def _group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The timeout `group` (None: the default group) was made with, where torch says (None: unknown)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            timeout = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


class Communicator:
    """The engine's collectives on flat tensors, on the groups of one `Topology` (zero3.topology).
    Where this rank sits (its shard and replicate coordinates) is not asked here: the topology's
    `ShardMesh` says it.

    [Note: the engine's groups]
    Parameter all-gathers run on the topology's gather group, in the order of
    the lockstep gather walk (zero3.runtime.gather_walk), which every rank
    issues identically; the step's norm sum runs there too. Gradient
    reduce-scatters run in a canonical bucket order, but at times that depend
    on each rank's backward, so they get a group of their own (the reduce
    group): a collective sequence must match only within a group. The walk's
    markers, the step's flags and every agreement are small host tensors on the
    gloo control group, which spans the whole job, so reading one never waits
    on the accelerator and one rank's failure reaches every replica; a
    blocking save and a load run DCP on it too. Checkpoint writes that run
    while training goes on (an async save) get a gloo group of their own (the
    topology's `checkpoint_group`). None of these is the default group
    (zero3.topology's [Note: one topology]). Without a topology (zero3.Init,
    before an engine exists) every collective runs on the default group, as
    DeepSpeed's zero.Init does.
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

    def all_gather_flat(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output[r*n:(r+1)*n] = rank r's `shard` (n = shard.numel())."""
        if self._size == 1:
            output.copy_(shard)
            return None
        out, inp = self._hand_over(output, shard)
        return self._started(_all_gather_flat(out, inp, group=self.group, async_op=True), async_op)

    def all_gather_secondary(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> dist.Work | None:
        """output[r*n:(r+1)*n] = secondary rank r's `shard`, on hpZ's node-local secondary group."""
        assert self.topology is not None and self.topology.secondary is not None, "hpZ is off: no secondary group"
        out, inp = self._hand_over(output, shard)
        group = self.topology.secondary_group
        return self._started(_all_gather_flat(out, inp, group=group, async_op=True), async_op)

    def all_to_all_grads(self, output: torch.Tensor, sent: torch.Tensor, across: bool) -> dist.Work | None:
        """Start qgZ's all-to-all of equal rows (row r of `sent` to rank r, rank r's row for this rank into
        output's row r) inside this rank's node, or `across` the nodes (zero3.topology's Note)."""
        topology = self.topology
        assert topology is not None and topology.grads_inside is not None, "qgZ is off: no gradient groups"
        group = (topology.grads_across if across else topology.grads_inside).shard_group
        out, inp = self._hand_over(output, sent)
        return self._started(dist.all_to_all_single(out, inp, group=group, async_op=True), True)

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
