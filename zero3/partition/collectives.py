"""Every all-gather of parameter shards and every reduction of gradient shards, in one place.

[Note: one plan per collective]
A parameter all-gather is issued from five places (a unit's gather, the
lockstep walk's spare gather for a unit another rank needs, the whole-parameter
stream, the fp32 accessor and Init's fp32 read). Ranks pair collectives by
order and size alone, so the five must issue the same thing: they all call
`ParamGather.start`. A gather is three steps: copy-in (this rank's shard,
encoded by the plan's codec when it has one), the collective on the shard
group, copy-out (decoded, and laid out parameter by parameter with
`copy_out`). A gradient reduction is a reduce-scatter over the shard group
(`GradReduce`); where the mesh has replicas, the reduced shards are summed
across them once a step, not per reduction (zero3.comm's [Note: the
replicas' sum, once a step]).

[Note: qgZ's reduction]
Under `zero_quantized_gradients` a bucket's reduce-scatter is ZeRO++'s
hierarchical all-to-all (`QuantizedGradReduce`). Shard rank r = m*L + l sits
at place l of node m (L ranks of the shard group per node, M nodes). Each rank
sends its node peer l' the bucket's chunks of every rank at place l' (M
chunks), int4 block-quantized; each sums the L dequantized copies it receives
(fp32), which leaves it the node's partial sums of the chunks of the M ranks
at its place. Those M partial sums are quantized again and sent across, one
to each node's rank at the same place; the M received are summed into this
rank's reduced chunk. What crosses nodes is M-1 int4 chunks per rank instead
of N-1 16-bit ones. The step across waits on the step inside, so the pair
runs on one helper thread, bucket after bucket: every rank issues its
all-to-alls across in the same order, and none waits on the main thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.helper_threads import HelperThreads
from zero3.partition.quantize import BlockQuantizer
from zero3.shard_mesh import ShardMesh

if TYPE_CHECKING:
    from zero3.partition.sharded_param import ShardedParam


class ShardCodec(Protocol):
    """The encode/decode slot of a parameter all-gather: what travels instead of the shard.

    `encode` turns this rank's shard into the flat tensor that is gathered (all ranks' encoded
    shards have one size); `decode` turns the gathered, rank-major encoded shards of `ranks` ranks
    into `out` (the rank-major shards in the parameters' dtype)."""

    def encoded_numel(self, shard_numel: int) -> int: ...

    def encoded_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None: ...

    def decode(self, gathered: torch.Tensor, out: torch.Tensor, ranks: int) -> None: ...


@dataclass
class PendingGather:
    """An issued all-gather; `wait` gives the rank-major shards ([shard_size * n])."""

    output: torch.Tensor
    work: dist.Work | None
    codec: ShardCodec | None = None
    wire: torch.Tensor | None = None  # the encoded shards' buffer, when a codec runs
    shard_numel: int = 0  # elements of one rank's shard (the decoded rows' length), when a codec runs
    inputs: list[torch.Tensor] = field(default_factory=list)  # alive until the collective completes
    # Called once with the rank-major shards when they are in (hpZ keeps its secondary shard).
    on_complete: Callable[[torch.Tensor], None] | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.codec is not None and self.wire is not None:
            self.codec.decode(self.wire, self.output, self.output.numel() // self.shard_numel)
            self.wire = None
        self.inputs.clear()
        if self.on_complete is not None:
            on_complete, self.on_complete = self.on_complete, None
            on_complete(self.output)
        return self.output


class ParamGather:
    """The parameter all-gather of one mesh: copy-in, collective, copy-out (see the Note)."""

    def __init__(self, mesh: ShardMesh, comm: Communicator | None, codec: ShardCodec | None = None,
                 own_group: bool = False) -> None:
        self.mesh = mesh
        self.comm = comm  # None: a layout that never communicates (zero3 estimate)
        self.codec = codec
        # True: the mesh's shard group is not the communicator's (an expert's shards, on its expert-data group).
        self.own_group = own_group
        self._group = mesh.shard_group if own_group else None

    def start(self, shard: torch.Tensor, output: torch.Tensor | None = None) -> PendingGather:
        """Issue the gather of every rank's `shard` into `output` (made when None).

        `output` may hold this rank's shard already in its own chunk (an in-place gather)."""
        size = self.mesh.shard_size
        fresh = output is None
        if output is None:
            output = torch.empty(size * shard.numel(), dtype=shard.dtype, device=shard.device)
        if size == 1:
            if fresh or output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return PendingGather(output, None)
        assert self.comm is not None, "a layout-only mesh cannot gather"
        if self.codec is None:
            source = shard
            if not fresh:  # an in-place gather hands the collective its own chunk of the output
                own = output.narrow(0, self.mesh.shard_rank * shard.numel(), shard.numel())
                source = own if own.data_ptr() == shard.data_ptr() else shard
            work = self._all_gather(output, source)
            return PendingGather(output, work, inputs=[shard])
        encoded = torch.empty(self.codec.encoded_numel(shard.numel()), device=shard.device,
                              dtype=self.codec.encoded_dtype(shard.dtype))
        self.codec.encode(shard, encoded)
        wire = torch.empty(size * encoded.numel(), dtype=encoded.dtype, device=encoded.device)
        work = self._all_gather(wire, encoded)
        return PendingGather(output, work, self.codec, wire, shard.numel(), [shard, encoded])

    def _all_gather(self, output: torch.Tensor, shard: torch.Tensor) -> dist.Work | None:
        assert self.comm is not None
        if self._group is None:
            return self.comm.all_gather_flat(output, shard, async_op=True)
        return self.comm.all_gather_flat(output, shard, async_op=True, group=self._group)

    def _wire(self, shard_numel: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
        """Elements and dtype of one rank's part on the wire (the codec's encoding, if any)."""
        if self.codec is None:
            return shard_numel, dtype
        return self.codec.encoded_numel(shard_numel), self.codec.encoded_dtype(dtype)

    def stand_in_nbytes(self, shard_numel: int, dtype: torch.dtype) -> int:
        """Bytes of reserve `start_stand_in` uses for a shard of `shard_numel` elements."""
        numel, wire_dtype = self._wire(shard_numel, dtype)
        return stand_in_nbytes(numel, self.mesh.shard_size * numel, wire_dtype)

    def start_stand_in(self, shard_numel: int, dtype: torch.dtype, reserve: torch.Tensor) -> PendingGather:
        """This rank's part in a gather whose result it will not use (a pass that failed here): the same
        collective as `start`'s, with zeros sent and the result landing in `reserve` (bytes, at least
        `stand_in_nbytes`): nothing read from a tier, nothing allocated (zero3.passes.gather_walk's Note)."""
        numel, wire_dtype = self._wire(shard_numel, dtype)
        size = self.mesh.shard_size
        shard, output = stand_in_room(reserve, numel, size * numel, wire_dtype)
        if size == 1:
            return PendingGather(output, None)
        assert self.comm is not None, "a layout-only mesh cannot gather"
        return PendingGather(output, self._all_gather(output, shard))

    def gather(self, shard: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
        """`start` and `wait`: the rank-major shards."""
        return self.start(shard, output).wait()

    def exact(self) -> ParamGather:
        """The same gather without a codec: for values that must arrive bit-exact (fp32 masters)."""
        return self if self.codec is None else ParamGather(self.mesh, self.comm, own_group=self.own_group)

    def copy_out(self, gathered: torch.Tensor, shard_numels: list[int], out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """Rank-major shards of several parameters -> each parameter's padded value, contiguous, in order
        (into `out` where given, else a new tensor).

        The gathered buffer is [N, S]: parameter i's padded value is its column block. With one
        parameter, or one rank, that block already is the contiguous value (returned as is)."""
        size = self.mesh.shard_size
        if size == 1 or len(shard_numels) == 1:
            return gathered
        laid_out = torch.empty_like(gathered) if out is None else out
        blocks, cursor = [], 0
        for numel in shard_numels:
            blocks.append(laid_out[cursor : cursor + size * numel].view(size, numel))
            cursor += size * numel
        torch.split_with_sizes_copy(gathered.view(size, sum(shard_numels)), shard_numels, dim=1, out=blocks)
        return laid_out


def stand_in_nbytes(shard_numel: int, output_numel: int, dtype: torch.dtype) -> int:
    """Bytes of reserve a stand-in gather (`stand_in_room`) takes."""
    return (shard_numel + output_numel) * dtype.itemsize


def stand_in_room(reserve: torch.Tensor, shard_numel: int, output_numel: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in gather's zeroed shard to send and its output, carved from `reserve` (bytes): the same sizes
    as the real gather's, nothing allocated (zero3.passes.gather_walk's Note)."""
    room = reserve[: stand_in_nbytes(shard_numel, output_numel, dtype)].view(dtype)
    shard, output = room[:shard_numel], room[shard_numel:]
    shard.zero_()
    return shard, output


def gather_full_fp32(sp: ShardedParam, gather: ParamGather, device: torch.device) -> torch.Tensor:
    """The whole fp32 value of a partitioned parameter, on `device` (collective): from the fp32 master
    seed where the shards are 16-bit (an fp32 shard already is exact), so no value goes through 16 bits."""
    seed = sp.hp_seed if sp.hp_seed is not None else sp.read_lp().float()
    out = gather.exact().gather(seed.to(device))
    return out[: sp.numel].view(sp.shape).clone()


class GradReduce:
    """The gradient reduction of one mesh's shard group: a reduce-scatter per bucket. Where the mesh has
    replicas, the reduced shards are summed across them once per step, not here: see
    `Communicator.all_reduce_replicas` (zero3.step.optimizer's `agree_on_gradients`)."""

    def __init__(self, mesh: ShardMesh, comm: Communicator | None, own_group: bool = False) -> None:
        self.mesh = mesh
        self.comm = comm
        # True: the mesh's shard group is not the communicator's (experts' gradients, on their expert-data group).
        self._group = mesh.shard_group if own_group else None

    def own_chunk(self, full: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """This rank's chunk of a rank-major flat tensor (where its reduced shard lands in place)."""
        return full.narrow(0, self.mesh.shard_rank * shard_numel, shard_numel)

    def start(self, output: torch.Tensor, full: torch.Tensor) -> dist.Work | None:
        """Issue output = sum over the shard group of each rank's chunk of `full` (`output` may be this
        rank's own chunk); None when there is nothing to wait for (a shard group of one)."""
        assert self.comm is not None, "a layout-only mesh cannot reduce"
        if self._group is not None and self.mesh.shard_size == 1:
            return None  # a group of one: this rank's chunk already is the sum
        if self._group is None:
            return self.comm.reduce_scatter_flat(output, full, async_op=True)
        return self.comm.reduce_scatter_flat(output, full, async_op=True, group=self._group)

    def close(self) -> None:
        """Let go of any helper thread (the engine is being destroyed): a plain reduction has none;
        `QuantizedGradReduce` stops its own (the reducer's `close` calls this whichever it holds)."""


class QuantizedReduction:
    """One bucket's qgZ reduction under way, as the reducer waits on a collective's work."""

    def __init__(self, finished: Future[torch.cuda.Event | None], keep: list[torch.Tensor]) -> None:
        self.finished = finished
        self.keep = keep  # the buffers the collectives read and write, alive until done

    def wait(self) -> bool:
        """Block until the reduced chunk is written (on a GPU: the caller's stream waits for it)."""
        done = self.finished.result()
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        self.keep.clear()
        return True

    def is_completed(self) -> bool:
        return self.finished.done()


class QuantizedGradReduce(GradReduce):
    """qgZ: a bucket's reduce-scatter as two int4 all-to-alls, inside the node then across (see the Note)."""

    def __init__(self, mesh: ShardMesh, comm: Communicator | None, inside: int, across: int,
                 quantizer: BlockQuantizer | None = None) -> None:
        super().__init__(mesh, comm)
        if inside * across != mesh.shard_size:
            raise ValueError(f"qgZ: {across} nodes of {inside} ranks do not make a shard group of {mesh.shard_size}")
        self.inside, self.across = inside, across
        self.quantizer = quantizer or BlockQuantizer(bits=4)
        self._helper: HelperThreads | None = None
        self._lock = threading.Lock()

    def start(self, output: torch.Tensor, full: torch.Tensor) -> QuantizedReduction:  # type: ignore[override]
        assert self.comm is not None, "a layout-only mesh cannot reduce"
        numel = output.numel()
        # [L, M, n]: row l holds the chunks of the ranks at place l on each node
        by_place = full.view(self.across, self.inside, numel).transpose(0, 1)
        keep = [full]
        ready = _stream_event(full.device)  # the helper's stream waits for the bucket to be written
        if self.inside > 1:
            sent = self.quantizer.encode(by_place, rows=self.inside)
            received = torch.empty_like(sent)
            first = self.comm.all_to_all_grads(received, sent, across=False)
            keep += [sent, received]
            own: torch.Tensor | None = None
        else:
            received, first, own = None, None, by_place[0].float()  # [M, n], copied before output is written
        finished = self._pool().submit(self._finish, output, numel, received, first, own, ready)
        return QuantizedReduction(finished, keep)

    def _finish(self, output: torch.Tensor, numel: int, received: torch.Tensor | None, first: dist.Work | None,
                own: torch.Tensor | None, ready: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """The rest of a bucket's reduction, on the helper thread; on a GPU, the event that marks it done."""
        if ready is None:
            self._reduce(output, numel, received, first, own)
            return None
        with torch.cuda.device(output.device):
            torch.cuda.current_stream().wait_event(ready)
            self._reduce(output, numel, received, first, own)
            return _stream_event(output.device)

    def _reduce(self, output: torch.Tensor, numel: int, received: torch.Tensor | None, first: dist.Work | None,
                own: torch.Tensor | None) -> None:
        assert self.comm is not None
        if received is not None:
            if first is not None:
                first.wait()
            partial = self.quantizer.decode(received, self.across * numel).view(self.inside, self.across, numel).sum(0)
        else:
            assert own is not None
            partial = own
        if self.across > 1:
            sent = self.quantizer.encode(partial, rows=self.across)
            arrived = torch.empty_like(sent)
            work = self.comm.all_to_all_grads(arrived, sent, across=True)
            if work is not None:
                work.wait()
            total = self.quantizer.decode(arrived, numel).view(self.across, numel).sum(0)
        else:
            total = partial[0]
        output.copy_(total)

    def _pool(self) -> HelperThreads:
        with self._lock:
            if self._helper is None:  # one thread: the buckets' steps across go out in order
                self._helper = HelperThreads(1, "zero3-qgz")
            return self._helper

    def close(self) -> None:
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is not None:
            # Not joined: every reduction has landed when the engine closes, unless a peer was lost, and then
            # its collective may never end (see zero3.helper_threads' Note).
            helper.shutdown(wait=False)


def _stream_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on `device`'s current stream (None off a GPU, where work is done when issued)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
