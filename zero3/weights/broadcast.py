"""Weights to generator ranks in other processes or on other nodes: a broadcast from training rank 0.

[Note: weights by broadcast]
The generator's ranks are not in the training job: they join training rank 0 in a group of their own
(`sync_group`: a TCPStore that training rank 0 serves, and a gloo process group over it, NCCL on GPUs),
so neither job's world changes. For each of the engine's weight buckets (zero3.weights.buckets),
training rank 0 broadcasts a header (the JSON of each parameter's name, shape, dtype and offset, as bytes
in a uint8 tensor, after its length) and then the bucket's flat tensor; each receiver yields
`(name, tensor)` views of what arrived, valid until it asks for the next bucket's first parameter. A
header of length 0 ends a delivery, and one of length -1 the sender's last (`close`). The other training
ranks take part in the gathers only.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.weights.wire import DEFAULT_BUCKET_BYTES, NameMap, header, raw_bytes, views


def sync_group(host: str, port: int, rank: int, size: int, device: torch.device | str = "cpu",
               timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> dist.ProcessGroup:
    """The group of training rank 0 (`rank` 0: it serves the store at `host:port`) and the generator's
    `size - 1` ranks (1 to size-1), each calling this with the same `host`, `port` and `size`; it returns once
    all have joined. gloo, or NCCL for a CUDA `device`."""
    store = dist.TCPStore(host, port, size, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    prefixed = dist.PrefixStore("zero3-weights", store)
    if torch.device(device).type == "cuda":
        group: Any = dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return group  # (it holds the store, and so rank 0's server, for as long as it lives)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    # Through a private alias, which zero3.comm waits on at exit: a gloo worker that lets go of a tensor's
    # last reference while the interpreter finalizes aborts the process (zero3.comm's [Note: the worker's
    # tensors]).
    (alias,) = Communicator._hand_over(tensor)
    group.broadcast([alias], options).wait()


class BroadcastSender:
    """The training side (see the Note): construct it on every training rank; training rank 0 passes the
    `sync_group` it made (the others pass None)."""

    def __init__(self, engine: Any, group: Any | None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 name_map: NameMap = None) -> None:
        self.engine = engine
        self.sends = engine.global_rank == 0
        if self.sends and group is None:
            raise ValueError("BroadcastSender: training rank 0 needs the sync_group it shares with the generator")
        self.group = group if self.sends else None
        self.bucket_bytes = bucket_bytes
        self.name_map = name_map

    def send(self) -> int:
        """Deliver every weight (collective on the training ranks and, through the group, the receivers);
        returns the bytes broadcast (0 on training ranks other than 0)."""
        sent = 0
        for bucket in self.engine.iter_weight_buckets(self.bucket_bytes):
            if self.group is not None:
                self._header(header(bucket, self.name_map))
                _broadcast(self.group, raw_bytes(bucket))
                sent += bucket.nbytes
            bucket.release()
        if self.group is not None:
            self._header(None)
        return sent

    def close(self) -> None:
        """Tell the receivers that no delivery will come (their `closed` turns true), and let go of the group;
        on every training rank."""
        if self.group is not None:
            _broadcast(self.group, torch.tensor([-1], dtype=torch.int64))
            Communicator.settle()
            self.group = None

    def _header(self, sent: dict[str, Any] | None) -> None:
        raw = json.dumps(sent).encode() if sent is not None else b""
        _broadcast(self.group, torch.tensor([len(raw)], dtype=torch.int64))
        if raw:
            _broadcast(self.group, torch.frombuffer(bytearray(raw), dtype=torch.uint8))


class BroadcastReceiver:
    """A generator rank's side (see the Note): `group` is its `sync_group`; `device` where the weights land."""

    def __init__(self, group: Any, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.device = torch.device(device)
        self.closed = False  # the sender closed: no delivery will come

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One delivery: `(name, tensor)` for every weight, views valid until the next bucket's first weight
        is asked for (copy them: a generator's `load_weights` does)."""
        while True:
            length = torch.zeros(1, dtype=torch.int64)
            _broadcast(self.group, length)
            if int(length) <= 0:
                self.closed = int(length) < 0
                return
            raw = torch.empty(int(length), dtype=torch.uint8)
            _broadcast(self.group, raw)
            received = json.loads(bytes(raw.numpy()).decode())
            flat = torch.empty(int(received["nbytes"]), dtype=torch.uint8, device=self.device)
            _broadcast(self.group, flat)
            yield from views(flat, received)

    def close(self) -> None:
        """Let go of the group (its threads end now, not while the interpreter exits)."""
        Communicator.settle()
        self.group = None
