"""Bucketed, coalesced reduce-scatter of gradients into the flat gradient buffer.

[Note: gradient path]
A parameter's gradient is handed over as soon as autograd has accumulated it.
Gradients are queued until a bucket's worth has arrived, then one fused
`_chunk_cat` lays them out rank-major in the scratch bucket (the
`contiguous_grad_buffer` state) and one `reduce_scatter_flat` reduces them.
Each rank then adds the mean of its shard into its slot of the `lp_grads`
flat buffer, so gradients accumulate across micro-steps there. With
`overlap_comm` two bucket slots alternate and the reduction runs while
backward goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.sharded_param import ShardedParam


@dataclass
class _Reduction:
    work: dist.Work | None
    destinations: list[torch.Tensor]
    sources: list[torch.Tensor]


class GradientReducer:
    def __init__(
        self,
        comm: Communicator,
        dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        largest_padded_numel: int,
        total_padded_numel: int,
        overlap: bool,
    ) -> None:
        world = comm.world_size
        capacity = max(min(bucket_numel, total_padded_numel), largest_padded_numel)
        self.capacity = -(-capacity // world) * world
        self.comm = comm
        self.dtype = dtype
        self.device = device
        # A second slot only helps when one backward fills more than one bucket.
        self.slots = 2 if overlap and self.capacity < total_padded_numel else 1
        self.overlap = overlap
        self.scratch: FlatBuffer | None = None
        self._pending: list[tuple[ShardedParam, torch.Tensor]] = []
        self._pending_numel = 0
        self._next_slot = 0
        self._inflight: list[_Reduction | None] = [None] * self.slots

    @property
    def slot_numel(self) -> int:
        return self.capacity + self.capacity // self.comm.world_size

    def scratch_numel(self) -> int:
        return self.slot_numel * self.slots

    def allocate_scratch(self) -> None:
        if self.scratch is None:
            self.scratch = FlatBuffer(
                "contiguous_grad_buffer", torch.empty(self.scratch_numel(), dtype=self.dtype, device=self.device)
            )

    def free_scratch(self) -> None:
        """Drop the scratch bucket (it holds nothing between backward passes)."""
        if self._pending or any(self._inflight):
            raise RuntimeError("cannot free the gradient bucket while a reduction is pending")
        self.scratch = None

    def add(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        if sp.grad_slot is None:
            raise RuntimeError(f"parameter {sp.name} has a gradient but no gradient slot (frozen?)")
        if self._pending_numel + sp.padded_numel > self.capacity:
            self.flush()
        self._pending.append((sp, grad))
        self._pending_numel += sp.padded_numel

    def flush(self) -> None:
        if not self._pending:
            return
        self.allocate_scratch()
        assert self.scratch is not None
        slot = self._next_slot
        self._next_slot = (slot + 1) % self.slots
        self._finish(slot)
        world = self.comm.world_size
        shard_total = self._pending_numel // world
        base = slot * self.slot_numel
        bucket = self.scratch.view(base, self._pending_numel)
        output = self.scratch.view(base + self.capacity, shard_total)
        grads = [grad.reshape(-1) for _, grad in self._pending]
        torch._chunk_cat(grads, dim=0, num_chunks=world, out=bucket.view(world, shard_total))
        work = self.comm.reduce_scatter_flat(output, bucket, async_op=self.overlap)
        sources = list(output.split([sp.shard_numel for sp, _ in self._pending]))
        destinations = [sp.grad_slot.view() for sp, _ in self._pending]  # type: ignore[union-attr]
        self._inflight[slot] = _Reduction(work, destinations, sources)
        self._pending = []
        self._pending_numel = 0
        if not self.overlap:
            self._finish(slot)

    def _finish(self, slot: int) -> None:
        reduction = self._inflight[slot]
        if reduction is None:
            return
        if reduction.work is not None:
            reduction.work.wait()
        torch._foreach_add_(reduction.destinations, reduction.sources, alpha=1.0 / self.comm.world_size)
        self._inflight[slot] = None

    def finalize(self) -> None:
        """Reduce everything queued and wait for every reduction to land."""
        self.flush()
        for slot in range(self.slots):
            self._finish(slot)
