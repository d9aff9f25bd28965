"""Weights to a generator in another process on this machine, through shared memory.

[Note: weights through shared memory]
Training rank 0 listens on a `multiprocessing.connection` address (an HMAC
handshake with `authkey`); the generator's process connects a
`SharedMemoryReceiver`. Each `send()` (collective on the training ranks)
streams the engine's weight buckets (zero3.weights.buckets): rank 0
copies each bucket into one of two POSIX shared-memory segments and sends the
receiver a JSON message (the segment's name and each parameter's name,
shape, dtype and offset); the receiver yields `(name, tensor)` views of the
segment, which a generator's `load_weights` copies. When its consumer asks
for the first parameter of the next bucket, the receiver tells rank 0 it has
released the last one, and only then does rank 0 write that segment again.
So rank 0 fills one segment while the receiver reads the other, and the
other ranks gather the next bucket meanwhile. Nothing crosses but bytes and
JSON: no pickle, no code.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection, Listener
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import torch

from zero3.shared_segments import attach, create
from zero3.weights.wire import DEFAULT_BUCKET_BYTES, NameMap, header, raw_bytes, views


def _no_delay(conn: Connection) -> Connection:
    """A TCP connection sends each small message at once (Nagle's algorithm, with the peer's delayed ACK,
    would hold a release for tens of milliseconds); a Unix socket has nothing to set."""
    try:
        sock = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)  # a duplicate of the descriptor
    except OSError:
        return conn
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass  # not TCP
    finally:
        sock.close()
    return conn


def _send(conn: Connection, message: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _receive(conn: Connection) -> dict[str, Any]:
    message = json.loads(conn.recv_bytes().decode())
    if not isinstance(message, dict):
        raise ValueError(f"weights over shared memory: an unexpected message {message!r}")
    return message


class SharedMemorySender:
    """The training side (see the Note). Construct it on every training rank, with the same arguments; rank 0
    listens at `address` (("127.0.0.1", 0) picks a free port: read `address` back) for one receiver."""

    def __init__(self, engine: Any, address: Any, authkey: bytes, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 name_map: NameMap = None) -> None:
        if not isinstance(authkey, bytes) or not authkey:
            raise ValueError("SharedMemorySender: authkey must be non-empty bytes (the receiver passes the same)")
        self.engine = engine
        self.bucket_bytes = bucket_bytes
        self.name_map = name_map
        self.sends = engine.global_rank == 0
        self._listener = Listener(address, authkey=authkey) if self.sends else None
        self._conn: Connection | None = None
        self._segments: list[SharedMemory | None] = [None, None]
        self._holds: list[int | None] = [None, None]  # the bucket each segment holds until the receiver releases it
        self._released: set[int] = set()

    @property
    def address(self) -> Any:
        """Where rank 0 listens (None on the other ranks)."""
        return self._listener.address if self._listener is not None else None

    def send(self) -> int:
        """Deliver every weight (collective on the training ranks). Rank 0 waits for the receiver to connect
        on the first call, and returns once the receiver has released every bucket; returns the bytes sent
        (0 on the other ranks)."""
        sent = 0
        conn = self._connection() if self.sends else None
        for index, bucket in enumerate(self.engine.iter_weight_buckets(self.bucket_bytes)):
            if conn is not None:
                sent += self._deliver(conn, index, bucket)
            bucket.release()
        if conn is not None:
            _send(conn, {"done": True})
            for slot in range(2):
                self._wait_released(conn, slot)
            self._released.clear()
        return sent

    def _connection(self) -> Connection:
        if self._conn is None:
            assert self._listener is not None
            self._conn = _no_delay(self._listener.accept())
        return self._conn

    def _deliver(self, conn: Connection, index: int, bucket: Any) -> int:
        slot = index % 2
        self._wait_released(conn, slot)
        nbytes = bucket.nbytes
        segment = self._segment(slot, nbytes)
        values = raw_bytes(bucket)
        torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes).copy_(values.cpu() if values.is_cuda else values)
        self._holds[slot] = index
        _send(conn, {"bucket": index, "segment": segment.name, **header(bucket, self.name_map)})
        return nbytes

    def _segment(self, slot: int, nbytes: int) -> SharedMemory:
        segment = self._segments[slot]
        if segment is None or segment.size < nbytes:
            if segment is not None:
                segment.close()
                segment.unlink()
            size = max(nbytes, self.bucket_bytes)  # every bucket but a lone larger parameter fits: made once
            segment = create("weights", size)
            self._segments[slot] = segment
        return segment

    def _wait_released(self, conn: Connection, slot: int) -> None:
        held = self._holds[slot]
        while held is not None and held not in self._released:
            message = _receive(conn)
            if "release" not in message:
                raise ValueError(f"weights over shared memory: expected a release, got {message!r}")
            self._released.add(int(message["release"]))
        self._holds[slot] = None

    def close(self) -> None:
        """Hang up (the receiver's `closed` turns true) and free the segments (on every rank; only rank 0
        holds any)."""
        if self._conn is not None:
            _send(self._conn, {"closed": True})
            self._conn.close()
            self._conn = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for segment in self._segments:
            if segment is not None:
                segment.close()
                segment.unlink()
        self._segments = [None, None]


class SharedMemoryReceiver:
    """The generator's side (see the Note): connects to rank 0's `address` with the sender's `authkey`."""

    def __init__(self, address: Any, authkey: bytes) -> None:
        self._conn = _no_delay(Client(address, authkey=authkey))
        self._attached: dict[str, SharedMemory] = {}
        self.closed = False  # the sender hung up: no delivery will come

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One delivery: `(name, tensor)` for every weight, views of shared memory valid until the first
        weight of the next bucket is asked for (copy them: a generator's `load_weights` does)."""
        while True:
            message = _receive(self._conn)
            if message.get("done"):
                return
            if message.get("closed"):
                self.closed = True
                return
            segment = self._attach(str(message["segment"]))
            yield from views(torch.frombuffer(segment.buf, dtype=torch.uint8), message)
            _send(self._conn, {"release": message["bucket"]})

    def _attach(self, name: str) -> SharedMemory:
        segment = self._attached.get(name)
        if segment is None:
            segment = attach(name)
            self._attached[name] = segment
        return segment

    def close(self) -> None:
        self._conn.close()
        for segment in self._attached.values():
            segment.close()
        self._attached.clear()
