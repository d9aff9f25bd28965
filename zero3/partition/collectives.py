"""Every all-gather of parameter shards and every reduction of gradient shards, in one place.

[Note: one plan per collective]
A parameter all-gather is issued from five places (a unit's gather, the
lockstep walk's spare gather for a unit another rank needs, the whole-parameter
stream, the fp32 accessor and Init's fp32 read). Ranks pair collectives by
order and size alone, so the five must issue the same thing: they all call
`ParamGather.start`. A gather is three steps: copy-in (this rank's shard,
encoded by the plan's codec when it has one), the collective on the shard
group, copy-out (decoded, and laid out parameter by parameter with
`copy_out`). A gradient reduction is a reduce-scatter over the shard group,
then, where the mesh has replicas, an all-reduce of the reduced shard across
them (`GradReduce`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.topology import ShardMesh


class ShardCodec(Protocol):
    """The encode/decode slot of a parameter all-gather: what travels instead of the shard.

    `encode` turns this rank's shard into the flat tensor that is gathered (all ranks' encoded
    shards have one size); `decode` turns the gathered, rank-major encoded shards into `out`
    (the rank-major shards in the parameters' dtype)."""

    def encoded_numel(self, shard_numel: int) -> int: ...

    def encoded_dtype(self, dtype: torch.dtype) -> torch.dtype: ...

    def encode(self, shard: torch.Tensor, out: torch.Tensor) -> None: ...

    def decode(self, gathered: torch.Tensor, out: torch.Tensor) -> None: ...


@dataclass
class PendingGather:
    """An issued all-gather; `wait` gives the rank-major shards ([shard_size * n])."""

    output: torch.Tensor
    work: dist.Work | None
    codec: ShardCodec | None = None
    wire: torch.Tensor | None = None  # the encoded shards' buffer, when a codec runs
    inputs: list[torch.Tensor] = field(default_factory=list)  # alive until the collective completes

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.codec is not None and self.wire is not None:
            self.codec.decode(self.wire, self.output)
            self.wire = None
        self.inputs.clear()
        return self.output


class ParamGather:
    """The parameter all-gather of one mesh: copy-in, collective, copy-out (see the Note)."""

    def __init__(self, mesh: ShardMesh, comm: Communicator | None, codec: ShardCodec | None = None) -> None:
        self.mesh = mesh
        self.comm = comm  # None: a layout that never communicates (zero3 estimate)
        self.codec = codec

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
            work = self.comm.all_gather_flat(output, source, async_op=True)
            return PendingGather(output, work, inputs=[shard])
        encoded = torch.empty(self.codec.encoded_numel(shard.numel()), device=shard.device,
                              dtype=self.codec.encoded_dtype(shard.dtype))
        self.codec.encode(shard, encoded)
        wire = torch.empty(size * encoded.numel(), dtype=encoded.dtype, device=encoded.device)
        work = self.comm.all_gather_flat(wire, encoded, async_op=True)
        return PendingGather(output, work, self.codec, wire, [shard, encoded])

    def gather(self, shard: torch.Tensor, output: torch.Tensor | None = None) -> torch.Tensor:
        """`start` and `wait`: the rank-major shards."""
        return self.start(shard, output).wait()

    def exact(self) -> ParamGather:
        """The same gather without a codec: for values that must arrive bit-exact (fp32 masters)."""
        return self if self.codec is None else ParamGather(self.mesh, self.comm)

    def copy_out(self, gathered: torch.Tensor, shard_numels: list[int]) -> torch.Tensor:
        """Rank-major shards of several parameters -> each parameter's padded value, contiguous, in order.

        The gathered buffer is [N, S]: parameter i's padded value is its column block. With one
        parameter, or one rank, that block already is the contiguous value (returned as is)."""
        size = self.mesh.shard_size
        if size == 1 or len(shard_numels) == 1:
            return gathered
        laid_out = torch.empty_like(gathered)
        blocks, cursor = [], 0
        for numel in shard_numels:
            blocks.append(laid_out[cursor : cursor + size * numel].view(size, numel))
            cursor += size * numel
        torch.split_with_sizes_copy(gathered.view(size, sum(shard_numels)), shard_numels, dim=1, out=blocks)
        return laid_out


class GradReduce:
    """The gradient reduction of one mesh's shard group: a reduce-scatter per bucket. Where the mesh has
    replicas, the reduced shards are summed across them once per step, not here: see
    `Communicator.all_reduce_replicas` (zero3.runtime.optimizer's `agree_on_gradients`)."""

    def __init__(self, mesh: ShardMesh, comm: Communicator | None) -> None:
        self.mesh = mesh
        self.comm = comm

    def own_chunk(self, full: torch.Tensor, shard_numel: int) -> torch.Tensor:
        """This rank's chunk of a rank-major flat tensor (where its reduced shard lands in place)."""
        return full.narrow(0, self.mesh.shard_rank * shard_numel, shard_numel)

    def start(self, output: torch.Tensor, full: torch.Tensor) -> dist.Work | None:
        """Issue output = sum over the shard group of each rank's chunk of `full` (`output` may be this
        rank's own chunk); None when there is nothing to wait for (a shard group of one)."""
        assert self.comm is not None, "a layout-only mesh cannot reduce"
        return self.comm.reduce_scatter_flat(output, full, async_op=True)

