"""Joining the default process group: the bootstrap before any engine group exists.

`init_distributed` (DeepSpeed's name, `zero3.init_distributed`), `join_default_group` (what
`zero3.initialize` and `zero3.Init` call) and `join_world` (a script's first line) join torchrun's group, or
make a world of one under a plain `python train.py`; Open MPI's variables stand in for torchrun's under
mpirun. Safe across torchrun restarts (the Note below). `engine_timeout` says how long the engine's groups
(made by zero3.topology) wait for a lost peer. The collectives the engine issues are zero3.comm's.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from zero3 import accelerator
from zero3 import error_exit  # noqa: F401 - its exit hook: a rank that failed leaves now (see its Note)

log = logging.getLogger("zero3")


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
