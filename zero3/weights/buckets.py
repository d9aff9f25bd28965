"""Whole parameters in buckets, two in flight: `engine.iter_weight_buckets` and `iter_full_params(bucket_bytes=)`.

[Note: weight buckets]
An RLHF step ends by handing every weight to the generator, on the critical
path. One all-gather per parameter (zero3.weights.full_params) pays a
collective's latency hundreds of times; here parameters are packed into
buckets of at most `bucket_bytes` (a larger parameter gets a bucket of its
own), and each bucket is one exact all-gather (never qwZ's quantized one):
this rank's shards of the bucket, cast to the asked dtype, concatenated; the
rank-major result is laid out so that each parameter's value is contiguous in
the bucket's `flat` tensor, at its entry's `offset`.

Where the ranks gather host memory, a parameter of at least `ALONE_FROM_BYTES`
gets a bucket of its own too: its rank-major output already is its value,
where a packed bucket pays a copy to lay each parameter out, and on the CPU
that copy costs more than a collective's latency (on a GPU the reverse).

Parameters are packed in the order their shards are stored (each 16-bit
buffer's, from its start), not in `named_parameters` order, which
interleaves units with the persistent parameters kept together at the
buffer's end. Packed in storage order, a bucket's shards lie end to end, so
where they are in memory in the asked dtype the gather sends a view of the
engine's buffer, with no copy into a staging buffer, and on a world of one
the bucket itself is that view. Every rank stores alike, so every rank packs
alike.

Two buckets are in flight: a bucket is handed out only after the next one's
gather has been issued, so the collective runs (on gloo's worker thread, or
NCCL's stream) while the consumer reads. On CUDA each bucket carries an event
recorded after its layout, which a consumer on another stream, or another
process (an IPC event), waits on before reading. A bucket's memory comes from
a pool and goes back only when the consumer calls `release()`: one that is
held is never written again (the pool makes another buffer instead), so a
consumer may keep a bucket as long as it likes, at the cost of that memory.
Extra memory while the consumer releases each bucket before the next: three
buffers of the largest bucket (the one being read, the one laid out before
it is released, the next one's rank-major output) and this rank's part of
one. A bucket read from disk, cast to another dtype or (lean memory mode)
from the masters goes through copies, as before.

A shared-out expert weight (zero3.moe.expert_parallel) is sharded over
another group than the dense parameters, and its whole spans the
expert-parallel group: each comes after the dense buckets in a bucket of its
own, gathered whole (`[E, ...]`) as `iter_full_params` gathers it, in memory
of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zero3.comm import Communicator
from zero3.moe.expert_parallel import expert_share
from zero3.partition.collectives import ParamGather, PendingGather
from zero3.partition.sharded_param import ShardedParam
from zero3.weights.full_params import GatherBuffer, ParkedStates, read_own_shard, whole


@dataclass(frozen=True)
class BucketEntry:
    """One parameter in a bucket: its values are `flat[offset : offset + numel].view(shape)`."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    offset: int
    numel: int


class WeightBucket:
    """Whole parameters in one flat tensor (see [Note: weight buckets]). Read `flat` (or `tensors()`) after
    waiting on `event` where there is one (CUDA); call `release()` when done, so that its memory is reused."""

    def __init__(self, flat: torch.Tensor, entries: list[BucketEntry], event: Any, pool: _BufferPool | None) -> None:
        self.flat = flat
        self.entries = entries
        self.event = event  # a torch.cuda.Event on CUDA (recorded when the values are in place), else None
        self._pool = pool  # None: nothing to give back (a view of the engine's own buffer, or memory of its own)
        self.released = False

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter in the bucket: views of `flat`."""
        for entry in self.entries:
            yield entry.name, self.flat[entry.offset : entry.offset + entry.numel].view(entry.shape)

    @property
    def nbytes(self) -> int:
        """The bytes of `flat` (each parameter padded to whole shards)."""
        return self.flat.numel() * self.flat.element_size()

    def release(self) -> None:
        """The consumer is done with the values: the bucket's memory may be written again."""
        if not self.released and self._pool is not None:
            self._pool.give(self.flat)
        self.released = True


# A parameter at least this large (padded, in the asked dtype) gets a bucket of its own when the ranks gather
# host memory (see `buckets`): measured on benchmarks/weight_sync.py's 12 x 1024 model at 2 ranks.
ALONE_FROM_BYTES = 1 << 20


class _BufferPool:
    """Flat buffers of one size (the largest bucket's), reused once given back; a new one when none is free."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self._free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def give(self, flat: torch.Tensor) -> None:
        base = flat._base if flat._base is not None else flat
        self._free.append(base)


def storage_order(chosen: list[tuple[str, ShardedParam]]) -> list[tuple[str, ShardedParam]]:
    """`chosen` in the order their shards are stored (see the Note): by buffer, in the order `chosen` first
    meets each, then by offset."""
    buffers: dict[int, int] = {}

    def where(item: tuple[str, ShardedParam]) -> tuple[int, int]:
        sp = item[1]
        slot = sp.lp_slot if sp.lp_slot is not None else sp.lean_master
        if slot is None:
            return (len(chosen), 0)
        return (buffers.setdefault(id(slot.buffer), len(buffers)), slot.offset)

    return sorted(chosen, key=where)


def plan(chosen: list[tuple[str, ShardedParam]], dtype: torch.dtype, bucket_bytes: int,
         alone_from: int | None = None) -> list[list[tuple[str, ShardedParam]]]:
    """The parameters, in storage order, packed into buckets of at most `bucket_bytes` of padded values in
    `dtype`; a larger parameter, or one of at least `alone_from` bytes where given, alone in its own."""
    buckets: list[list[tuple[str, ShardedParam]]] = []
    filled = 0
    alone = False  # the last bucket holds a parameter that goes alone
    for name, sp in storage_order(chosen):
        size = sp.padded_numel * dtype.itemsize
        goes_alone = alone_from is not None and size >= alone_from
        if not buckets or alone or goes_alone or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append((name, sp))
        filled += size
        alone = goes_alone
    return buckets


def _entries(bucket: list[tuple[str, ShardedParam]], dtype: torch.dtype) -> list[BucketEntry]:
    entries, cursor = [], 0
    for name, sp in bucket:
        entries.append(BucketEntry(name, sp.shape, dtype, cursor, sp.numel))
        cursor += sp.padded_numel
    return entries


def _record_event(device: torch.device) -> Any:
    """An event recorded on the current stream now (CUDA), for a consumer on another stream or process."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(interprocess=True)
    event.record()
    return event


def _in_place(bucket: list[tuple[str, ShardedParam]], dtype: torch.dtype) -> torch.Tensor | None:
    """This rank's shards of the bucket as one view of the 16-bit buffer they lie end to end in, when they do
    and need no cast or read (on a world of one, the bucket's values); else None."""
    slots = [sp.lp_slot for _, sp in bucket]
    first = slots[0]
    if first is None or any(slot is None or slot.buffer is not first.buffer for slot in slots):
        return None
    buffer = first.buffer
    if buffer.parked or buffer.store is not None or buffer.dtype != dtype:
        return None
    cursor = first.offset
    for slot in slots:
        assert slot is not None
        if slot.offset != cursor:
            return None
        cursor += slot.numel
    return buffer.view(first.offset, cursor - first.offset)


def _read_own_shards(bucket: list[tuple[str, ShardedParam]], into: torch.Tensor, staging: GatherBuffer
                     ) -> torch.Tensor:
    """This rank's shards of the bucket, each read from wherever it lives and cast to `into`'s dtype, end to
    end at the start of `into`: the part filled."""
    cursor = 0
    for _, sp in bucket:
        read_own_shard(sp, into[cursor : cursor + sp.shard_numel], staging)
        cursor += sp.shard_numel
    return into[:cursor]


class _BucketGather:
    """One bucket's gather under way: this rank's shards sent, the rank-major output still arriving."""

    def __init__(self, bucket: list[tuple[str, ShardedParam]], gather: ParamGather, pool: _BufferPool,
                 staging: GatherBuffer) -> None:
        self.bucket = bucket
        self.gather = gather
        self.pool = pool
        self.shard_numels = [sp.shard_numel for _, sp in bucket]
        own = _in_place(bucket, staging.dtype)  # this rank's shards, concatenated, in the asked dtype
        if own is None:  # on disk, cast, or not end to end: copied together
            own = _read_own_shards(bucket, staging.take(sum(self.shard_numels)), staging)
        self.wire = pool.take()  # the rank-major output
        self.pending: PendingGather = gather.start(own, self.wire[: gather.mesh.shard_size * own.numel()])

    def finish(self, dtype: torch.dtype) -> WeightBucket:
        """Wait for the gather and lay each parameter out contiguously (a lone parameter's rank-major output
        already is its value: the bucket keeps that buffer), then record the event."""
        gathered = self.pending.wait()
        if len(self.shard_numels) == 1:
            flat = gathered
        else:
            flat = self.gather.copy_out(gathered, self.shard_numels, out=self.pool.take()[: gathered.numel()])
            self.pool.give(self.wire)
        return WeightBucket(flat, _entries(self.bucket, dtype), _record_event(flat.device), self.pool)


def buckets(
    chosen: list[tuple[str, ShardedParam]], gather: ParamGather, parked: ParkedStates, dtype: torch.dtype,
    bucket_bytes: int,
) -> Iterator[WeightBucket]:
    """The buckets of `chosen`, each gathered while the consumer reads the one before, then each expert
    weight's (see the Note)."""
    experts = [(name, sp) for name, sp in chosen if expert_share(sp.param) is not None]
    shared = {name for name, _ in experts}
    yield from _dense_buckets([item for item in chosen if item[0] not in shared], gather, parked, dtype, bucket_bytes)
    for name, sp in experts:
        parked.settle()
        numel = sp.whole_shape.numel()
        values = whole(sp, gather, GatherBuffer(sp.padded_numel, dtype, sp.placeholder.device, sp.shard_numel, numel))
        yield WeightBucket(values.view(-1), [BucketEntry(name, sp.whole_shape, dtype, 0, numel)],
                           _record_event(values.device), None)
    if experts:
        Communicator.forget_released()


def _dense_buckets(
    chosen: list[tuple[str, ShardedParam]], gather: ParamGather, parked: ParkedStates, dtype: torch.dtype,
    bucket_bytes: int,
) -> Iterator[WeightBucket]:
    if not chosen:
        return
    gather = gather.exact()
    device = chosen[0][1].placeholder.device
    # In host memory a packed bucket's layout copy costs more than a gather of its own for a large parameter
    # (whose rank-major output already is its value); on a GPU the copy is cheap beside a collective's launch.
    alone_from = ALONE_FROM_BYTES if device.type == "cpu" and gather.mesh.sharded else None
    planned = plan(chosen, dtype, bucket_bytes, alone_from)
    parked.settle()  # background offload writes or reloads land first: each buffer is where it says
    largest = max(sum(sp.padded_numel for _, sp in bucket) for bucket in planned)
    largest_own = max(sum(sp.shard_numel for _, sp in bucket) for bucket in planned)
    pool = _BufferPool(largest, dtype, device)
    if not gather.mesh.sharded:
        yield from _unsharded(planned, pool, dtype, device, largest)
        return
    staging = GatherBuffer(largest_own, dtype, device, max(sp.shard_numel for _, sp in chosen))
    in_flight = _BucketGather(planned[0], gather, pool, staging)
    for index in range(len(planned)):
        ready = in_flight.finish(dtype)
        if index + 1 < len(planned):  # issued before this bucket is handed out: it gathers while that is read
            in_flight = _BucketGather(planned[index + 1], gather, pool, staging)
        yield ready
    Communicator.forget_released()  # the collectives' aliases of the buffers go with them


def _unsharded(planned: list[list[tuple[str, ShardedParam]]], pool: _BufferPool, dtype: torch.dtype,
               device: torch.device, largest: int) -> Iterator[WeightBucket]:
    """A world of one: each bucket is a view of the engine's buffer where it can be (see the Note), else its
    shards read into a pooled buffer."""
    staging = GatherBuffer(0, dtype, device, largest)
    for bucket in planned:
        view = _in_place(bucket, dtype)
        if view is not None:
            yield WeightBucket(view, _entries(bucket, dtype), _record_event(device), None)
            continue
        flat = _read_own_shards(bucket, pool.take(), staging)
        yield WeightBucket(flat, _entries(bucket, dtype), _record_event(device), pool)


def whole_params(bucketed: Iterator[WeightBucket]) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_full_params(bucket_bytes=)`: the buckets' parameters one by one; a bucket is released when the
    consumer asks for the first parameter two buckets after it, so a yielded tensor stays valid until then."""
    previous: WeightBucket | None = None
    for bucket in bucketed:
        if bucket.event is not None:
            bucket.event.wait()  # the consumer reads on the current stream
        for item in bucket.tensors():
            yield item
        if previous is not None:
            previous.release()
        previous = bucket
    if previous is not None:
        previous.release()
