"""Reduce-scatter of gradients, bucket by bucket in one fixed order, into the flat gradient buffer.

[Note: gradient path]
The trainable parameters are cut once into buckets of at most
`reduce_bucket_size` elements, in reverse registration order (about the order
backward produces them). Every backward, every rank reduces every bucket, in
that order, whatever its own backward touched: ranks that ran different
parameters still issue matching collectives, and a parameter unused on this
rank contributes zeros there, as in DDP and FSDP2. A bucket goes out once
each of its parameters is accounted for (its gradient arrived, or its unit
was not used by any forward since the last backward) and every earlier
bucket has gone out; whatever is left goes out when the backward ends.

A bucket is laid out rank-major in a slot of the scratch buffer (the
`contiguous_grad_buffer` state), in `communication_data_type`: each
gradient is copied to its place as it arrives (the bucket takes its slot at
its first gradient), so autograd's full-size gradient is freed at once and
nothing waits for a bucket to fill but the bucket itself (as in DeepSpeed;
holding the gradients until the bucket went out kept up to a bucket of them
alive besides the slot). One reduce-scatter (the mesh's `GradReduce`) sums the slot across
ranks, in place (this rank's sum lands in its own chunk of the slot). Each rank then adds its
shard into its region of `lp_grads` (in `grad_accum_dtype`), so gradients
accumulate across micro-steps there. Scaling follows DeepSpeed: gradients
are multiplied by 1/gradient_predivide_factor before the sum and by
factor/world after it (`prescale_gradients` divides by world before).

A slot is reused once its reduction has landed. On CUDA that wait is a
stream wait, which never blocks this thread. On the CPU it would block, and
during a backward another rank may need this one to walk on first
(zero3.passes.gather_walk), so a busy slot whose reduction has not finished
is replaced by a fresh buffer instead; the backward thread never blocks on a
reduce-scatter before every rank has left the backward. (A gloo
reduce-scatter's work never reports `is_completed()` in torch 2.13: its
`wait()` waits for an all-reduce and then copies this rank's chunk out, on
the calling thread. So on the CPU one helper thread waits on the reductions
in order and says which have finished, and it is the only thread that calls
`wait()` on them: the backward thread waits for the helper's answer instead.)
Nothing here reduces across replicas (a mesh with a replicate group): the
replicas sum the accumulated shards once a step, where every rank agrees on
the step (`Communicator.all_reduce_replicas`, called by the optimizer's
`agree_on_gradients`: zero3.comm's [Note: the replicas' sum, once a step]).
In a world of one (no shard group, no replicas) there is nothing to reduce:
a gradient goes straight into its region of `lp_grads` as it arrives, through
the same rounding the bucket would give it (the communication dtype, then the
scales), and no bucket is filled or sent. The scratch is still made, for the
optimizer's step to borrow.
A gradient that arrives for a bucket already sent (a parameter accumulated
twice in one backward, as reentrant checkpointing can do) is reduced in one
more round at the end, which every rank joins if any rank needs it.

With ZeRO-Offload the gradients accumulate in host memory. On CUDA a landed
shard is copied to a pinned host buffer on a side stream (ordered after the
reduction, so the compute stream never waits for the copy, and the host
thread not at all); a slot holding a shard still being copied is reused only
behind that copy, and the host adds shards into `lp_grads` as their copies
arrive, in landing order, all of them before the backward ends. On the CPU
the shard is already in host memory and is added as it lands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.helper_threads import HelperThreads
from zero3.offload.host import copy_to_host
from zero3.partition.collectives import GradReduce
from zero3.partition.flat_buffer import FlatBuffer, StateOffloadedError
from zero3.partition.sharded_param import ShardedParam
from zero3.step.grad_shards import GradShards
from zero3.passes.host_heap import FreedHeapReturn


# A backward's gradients go out in at least this many buckets where the model allows (a bucket still never
# exceeds reduce_bucket_size): with one bucket for the whole model (DeepSpeed's 5e8 default covers models
# up to 500M parameters) nothing is reduced before the backward ends, and the scratch is the whole model.
# 16 makes the scratch (two slots) an eighth of the gradients, near FSDP2's per-block reduce buffers.
MIN_BUCKETS = 16


def bucket_capacity(total: int, largest: int, bucket_numel: int, world: int) -> int:
    """Elements of one bucket (a scratch slot): at most `bucket_numel` and a MIN_BUCKETS-th of the
    `total`, at least the `largest` parameter, in whole shards (padded numels throughout)."""
    capacity = max(min(bucket_numel, -(-total // MIN_BUCKETS)), largest)
    return -(-capacity // world) * world


def slot_count(total: int, capacity: int, overlap: bool) -> int:
    """Scratch slots: a second one only helps when one backward fills more than one bucket."""
    return 2 if overlap and total > capacity else 1


_FILLING = object()  # a slot taken by a bucket whose gradients are still arriving


@dataclass
class _Bucket:
    params: list[ShardedParam]
    padded_numel: int
    shard_numel: int
    reduce: GradReduce  # the dense mesh's, or the experts' (their expert-data group)

    @property
    def ranks(self) -> int:
        return self.reduce.mesh.shard_size


@dataclass
class _Reduction:
    bucket: _Bucket
    work: dist.Work | None
    output: torch.Tensor
    slot: int | None  # None: the reduction owns a fresh buffer
    finished: Future[None] | None = None  # on the CPU: the helper thread's wait

    def has_finished(self) -> bool:
        if self.work is None:
            return True
        return self.finished.done() if self.finished is not None else self.work.is_completed()


@dataclass
class _HostArrival:
    """A reduced shard on its way to host memory (ZeRO-Offload on CUDA): added to `lp_grads` on arrival."""

    copied: torch.cuda.Event
    staged: torch.Tensor  # pinned host memory, filled by the side stream
    params: list[ShardedParam]


class GradientReducer:
    def __init__(
        self,
        reduce: GradReduce,
        params: list[ShardedParam],
        comm_dtype: torch.dtype,
        device: torch.device,
        bucket_numel: int,
        overlap: bool,
        predivide_factor: float = 1.0,
        prescale: bool = False,
        grads: GradShards | None = None,
        expert_reduce: GradReduce | None = None,
    ) -> None:
        world = reduce.mesh.shard_size
        total = sum(sp.padded_numel for sp in params)
        largest = max((sp.padded_numel for sp in params), default=0)
        self.capacity = bucket_capacity(total, largest, bucket_numel, world)
        self.reduce = reduce
        # Shared-out experts' gradients are reduced over their expert-data group only (zero3.moe.expert_parallel):
        # their buckets hold nothing else. The mean is still over every rank (post_scale).
        self.expert_reduce = expert_reduce
        self.grads = grads  # where landed shards are added (None: nothing is trained)
        self.world = world
        self.dtype = comm_dtype
        self.device = device
        self.buckets = self._cut(list(reversed(params)))
        self._where = {sp: (j, k) for j, bucket in enumerate(self.buckets) for k, sp in enumerate(bucket.params)}
        self.slots = slot_count(total, self.capacity, overlap)
        ranks = reduce.mesh.world_size  # the mean is over every rank's gradient, replicas included
        self._alone = ranks == 1  # a world of one: gradients go straight to lp_grads (see the Note)
        self._direct = False  # this pass's gradients do (set by begin: lp_grads must be beside them)
        self._direct_views: dict[ShardedParam, torch.Tensor] = {}  # a direct pass's lp_grads slots, shaped
        self._direct_factor = 1.0
        self.pre_scale = 1.0 / ranks if prescale else 1.0 / predivide_factor
        self.post_scale = 1.0 if prescale else predivide_factor / ranks
        self._stream_waits = device.type == "cuda"  # waiting does not block the host there
        self._waiter: HelperThreads | None = None  # the CPU's completion watcher (see the Note)
        self._watched: list[Future[None]] = []
        self.scratch: FlatBuffer | None = None
        self._busy: list[_Reduction | object | None] = [None] * self.slots  # _FILLING: a bucket being filled
        # ZeRO-Offload on CUDA (see the Note): the side stream, each slot's pending copy, the arrivals.
        self._copy_stream: torch.cuda.Stream | None = None
        self._slot_copy: list[torch.cuda.Event | None] = [None] * self.slots
        self._arriving: list[_HostArrival] = []
        self._inflight: list[_Reduction] = []
        self._open = False
        self._pass_scale = 1.0  # this pass's factor on its gradients (begin's `scale`)
        # Per bucket in this pass: its storage once its first gradient arrived (slot index or None for a
        # fresh buffer), and which of its parameters have a gradient placed there.
        self._storage: list[tuple[torch.Tensor, int | None] | None] = []
        self._placed: list[list[bool]] = []
        self._accounted: list[list[bool]] = []
        self._remaining: list[int] = []
        self._next = 0
        self._late: list[tuple[ShardedParam, torch.Tensor]] = []
        self._offsets = [
            [sum(sp.shard_numel for sp in bucket.params[:k]) for k in range(len(bucket.params))]
            for bucket in self.buckets
        ]
        self.fresh_buffers = 0  # buckets that found no free slot (see the Note), over the engine's life
        # On the CPU: the heap the backward frees goes back to the OS as gradients land in a flat lp_grads
        # (zero3.passes.host_heap); shards made on demand reuse it instead.
        self.heap_return = FreedHeapReturn(device, needed=grads is None or not grads.on_demand)
        # Told of each landed shard's parameters, and of a late round (the overlapped host step:
        # zero3.step.early_step).
        self.on_landed: Callable[[list[ShardedParam]], None] | None = None
        self.on_late_round: Callable[[], None] | None = None

    def _reduce_of(self, sp: ShardedParam) -> GradReduce:
        expert = self.expert_reduce
        return expert if expert is not None and sp.mesh is expert.mesh else self.reduce

    def _cut(self, params: list[ShardedParam]) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: list[ShardedParam] = []
        size = 0
        for sp in params:
            reduce = self._reduce_of(sp)
            if current and (size + sp.padded_numel > self.capacity or reduce is not self._reduce_of(current[0])):
                buckets.append(self._bucket(current, size))
                current, size = [], 0
            current.append(sp)
            size += sp.padded_numel
        if current:
            buckets.append(self._bucket(current, size))
        return buckets

    def _bucket(self, params: list[ShardedParam], size: int) -> _Bucket:
        reduce = self._reduce_of(params[0])
        return _Bucket(params, size, size // reduce.mesh.shard_size, reduce)

    # ---- scratch --------------------------------------------------------------
    @property
    def slot_numel(self) -> int:
        # The reduce-scatter runs in place: each rank's summed shard lands in its own chunk of the
        # bucket (NCCL's and gloo's in-place form), so a slot is one bucket and nothing more.
        return self.capacity

    def scratch_numel(self) -> int:
        return self.slot_numel * self.slots

    def allocate_scratch(self) -> None:
        if self.scratch is None:
            self.scratch = FlatBuffer(
                "contiguous_grad_buffer", torch.empty(self.scratch_numel(), dtype=self.dtype, device=self.device)
            )

    def idle_scratch(self, nbytes: int, device: torch.device) -> torch.Tensor | None:
        """The scratch bucket's first `nbytes` as bytes, to use between backward passes; None when it
        is busy, freed (offloaded), elsewhere, or too small. Its contents are garbage by the next send."""
        scratch = self.scratch
        if self._open or self._inflight or self._arriving or scratch is None:
            return None
        tensor = scratch.tensor
        if tensor.device != device or tensor.numel() * tensor.element_size() < nbytes:
            return None
        return tensor.view(torch.uint8)[:nbytes]

    def free_scratch(self) -> None:
        """Drop the scratch bucket (it holds nothing between backward passes)."""
        if self._open or self._inflight or self._arriving:
            raise RuntimeError("cannot free the gradient bucket while a reduction is pending")
        self.scratch = None

    # ---- a backward pass ------------------------------------------------------------
    @property
    def open(self) -> bool:
        return self._open

    def begin(self, absent: Iterable[ShardedParam] = (), scale: float = 1.0) -> None:
        """Start a pass; `absent` parameters cannot get a gradient in it (they count as zero). Its gradients
        are multiplied by `scale` before the sum (a plain loss.backward()'s 1/accumulation steps)."""
        if self._open:
            return
        self._open = True
        self.heap_return.backward_begins()
        self._pass_scale = scale
        self._direct = self._beside_grads
        self._storage = [None] * len(self.buckets)
        self._placed = [[False] * len(b.params) for b in self.buckets]
        self._accounted = [[False] * len(b.params) for b in self.buckets]
        self._remaining = [len(b.params) for b in self.buckets]
        self._next = 0
        self._late = []
        if self._direct:
            assert self.grads is not None
            # Looked up once a pass: nothing moves lp_grads during one (offloading it then is refused).
            self._direct_views = self.grads.param_shaped_views()  # (on demand: the shards held so far)
            self._direct_factor = self.pre_scale * self._pass_scale
            self.allocate_scratch()  # lent to the optimizer's step, as after a bucketed pass
            self._next = len(self.buckets)  # nothing to send: absent parameters simply add nothing
            return
        for sp in absent:
            if sp in self._where:
                self._account(*self._where[sp])
        self._send_ready()

    @property
    def _beside_grads(self) -> bool:
        """A world of one whose lp_grads are on the gradients' device: a pass adds straight into them."""
        return self._alone and self.grads is not None and self.grads.device == self.device

    @property
    def adds_unchanged(self) -> bool:
        """Whether a world of one adds each gradient to lp_grads as it is: never rounded to another
        dtype, never scaled but by a plain loss.backward()'s pass factor (`direct_factor`)."""
        grads = self.grads
        return (self._beside_grads and grads is not None and grads.dtype == self.dtype
                and self.pre_scale == 1.0 and self.post_scale == 1.0)

    @property
    def direct_factor(self) -> float:
        return self._direct_factor

    def direct_view(self, sp: ShardedParam) -> torch.Tensor:
        """A direct pass's lp_grads slot of `sp`, in the parameter's shape (valid until the pass ends)."""
        if not self._direct:
            raise StateOffloadedError(
                "a backward needs lp_grads beside the gradients, offloaded by offload_states(); call "
                "engine.reload_states() first"
            )
        return self._shaped(sp)

    def _shaped(self, sp: ShardedParam) -> torch.Tensor:
        view = self._direct_views.get(sp)
        if view is None:  # an on-demand shard, made at its first gradient (zero3.step.grad_shards' Note)
            assert self.grads is not None
            view = self._direct_views[sp] = self.grads.shaped(sp)
        return view

    def add(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        if self._direct and self._open:  # the common case of a world of one, first (see _add_direct)
            self._add_direct(sp, grad)
            return
        if sp not in self._where:
            raise RuntimeError(f"parameter {sp.name} has a gradient but no gradient slot (frozen?)")
        self.begin()
        j, k = self._where[sp]
        if self._direct:
            self._add_direct(sp, grad)
            return
        if j < self._next:
            self._late.append((sp, grad))
            return
        self._place(j, k, grad)
        self._account(j, k)
        self._send_ready()

    def _add_direct(self, sp: ShardedParam, grad: torch.Tensor) -> None:
        """A world of one: the gradient, rounded as its bucket would round it, added to its lp_grads region."""
        source = grad
        if source.dtype != self.dtype:
            source = source.to(self.dtype)  # the bucket's communication dtype
        factor = self._direct_factor
        if factor != 1.0:
            source = source * factor
        destination = self._shaped(sp)
        if self.post_scale != 1.0:
            destination.add_(source, alpha=self.post_scale)
        else:
            destination.add_(source)
        self.heap_return.landed(destination.numel() * destination.element_size())

    @property
    def has_late(self) -> bool:
        return bool(self._late)

    def finish(self, any_rank_late: bool = False) -> None:
        """Send every remaining bucket and land every reduction (every rank, after the backward ended everywhere)."""
        self.begin()  # a rank whose backward produced no gradient still joins every reduction
        while self._next < len(self.buckets):
            self._send(self._next, may_block=True)
            self._next += 1
        self._land_all()
        if any_rank_late:
            if self.on_late_round is not None:
                self.on_late_round()
            late, self._late = self._late, []
            self._storage = [None] * len(self.buckets)
            self._placed = [[False] * len(b.params) for b in self.buckets]
            for j in range(len(self.buckets)):  # one bucket at a time: its late gradients, then out
                for sp, grad in late:
                    if self._where[sp][0] == j:
                        self._place(j, self._where[sp][1], grad, may_block=True)
                self._send(j, may_block=True)
            self._land_all()
        self._open = False
        self._storage, self._placed, self._accounted, self._late = [], [], [], []
        self._direct_views = {}  # no view outlives the pass (lp_grads may be offloaded next)

    def _bucket_storage(self, j: int, may_block: bool) -> torch.Tensor:
        """Bucket j's storage in this pass: a scratch slot, taken at its first gradient."""
        if self._storage[j] is None:
            slot = self._take_slot(may_block)
            if slot is None:
                self.fresh_buffers += 1
                storage = torch.empty(self.slot_numel, dtype=self.dtype, device=self.device)
            else:
                assert self.scratch is not None
                storage = self.scratch.view(slot * self.slot_numel, self.slot_numel)
                copy = self._slot_copy[slot]
                if copy is not None:  # the slot's last shard is still being copied to the host
                    torch.cuda.current_stream(self.device).wait_event(copy)
                    self._slot_copy[slot] = None
                self._busy[slot] = _FILLING
            self._storage[j] = (storage, slot)
        return self._storage[j][0]

    def _param_view(self, j: int, k: int, storage: torch.Tensor) -> torch.Tensor:
        """Parameter k's place in bucket j: [world, its shard numel], one row per rank's chunk."""
        bucket = self.buckets[j]
        full = storage.narrow(0, 0, bucket.padded_numel).view(bucket.ranks, bucket.shard_numel)
        return full.narrow(1, self._offsets[j][k], bucket.params[k].shard_numel)

    def _place(self, j: int, k: int, grad: torch.Tensor, may_block: bool = False) -> None:
        """Copy (or, arriving twice in a pass, add) a gradient into its place in bucket j: rank r's
        chunk gets elements [r*s, (r+1)*s) of the flat gradient, the last one zero-padded."""
        place = self._param_view(j, k, self._bucket_storage(j, may_block))
        flat = grad.reshape(-1)
        width = place.shape[1]
        rows, rest = divmod(flat.numel(), width)
        if self._placed[j][k]:
            if rows:
                place[:rows].add_(flat[: rows * width].view(rows, width))
            if rest:
                place[rows, :rest].add_(flat[rows * width :])
            return
        self._placed[j][k] = True
        if rows:
            place[:rows].copy_(flat[: rows * width].view(rows, width))
        if rest:
            place[rows, :rest].copy_(flat[rows * width :])
            place[rows, rest:].zero_()
            rows += 1
        if rows < place.shape[0]:
            place[rows:].zero_()

    def _account(self, j: int, k: int) -> None:
        if not self._accounted[j][k]:
            self._accounted[j][k] = True
            self._remaining[j] -= 1

    def _send_ready(self) -> None:
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._send(self._next, may_block=False)
            self._next += 1

    # ---- one bucket ---------------------------------------------------------------------
    def _send(self, j: int, may_block: bool) -> None:
        bucket = self.buckets[j]
        empty = self._storage[j] is None  # no gradient of this bucket arrived on this rank
        storage = self._bucket_storage(j, may_block)
        if empty:
            storage.narrow(0, 0, bucket.padded_numel).zero_()
        else:
            for k, placed in enumerate(self._placed[j]):
                if not placed:  # unused on this rank: it contributes zeros
                    self._param_view(j, k, storage).zero_()
        slot = self._storage[j][1]  # type: ignore[index]
        self._storage[j] = None
        full = storage.narrow(0, 0, bucket.padded_numel)
        output = bucket.reduce.own_chunk(full, bucket.shard_numel)  # reduced in place
        factor = self.pre_scale * self._pass_scale
        if factor != 1.0:
            full.mul_(factor)
        work = bucket.reduce.start(output, full)
        reduction = _Reduction(bucket, work, output, slot, self._watch(work))
        self._inflight.append(reduction)
        if slot is not None:
            self._busy[slot] = reduction

    def _take_slot(self, may_block: bool) -> int | None:
        self.allocate_scratch()
        for reduction in list(self._inflight):  # land what has finished already, freeing its memory
            if reduction.has_finished():
                self._land(reduction)
        for slot, busy in enumerate(self._busy):
            if busy is None:
                return slot
        sent = [r for r in self._busy if isinstance(r, _Reduction)]  # a filling slot frees only once sent
        if sent and (may_block or self._stream_waits):
            oldest = min(sent, key=self._inflight.index)
            self._land(oldest)
            return oldest.slot
        return None  # see the Note: a fresh buffer rather than a wait that could hang

    def _land(self, reduction: _Reduction) -> None:
        if reduction.finished is not None:
            # Never wait on a gloo reduce-scatter's work from two threads: its wait() is what copies the
            # reduced chunk into `output`, so a second waiter could still be writing into the slot after
            # it was handed to the next bucket (a gradient then comes out wrong).
            reduction.finished.result()
        elif reduction.work is not None:
            reduction.work.wait()
        params = reduction.bucket.params
        assert self.grads is not None, "a gradient was reduced but nothing is trained"
        if params and self.grads.device != reduction.output.device:
            # ZeRO-Offload keeps the gradients in host memory (see the Note).
            self._copy_to_host(reduction)
        else:
            self._add(params, reduction.output)
        self._inflight.remove(reduction)
        if reduction.slot is not None:
            self._busy[reduction.slot] = None
        reduction.work = None
        Communicator.forget_released()

    def _add(self, params: list[ShardedParam], output: torch.Tensor) -> None:
        """Accumulate a landed shard (the bucket's parameters, in order) into their gradient slots."""
        assert self.grads is not None
        destinations = self.grads.views(params)
        sources = output.split([sp.shard_numel for sp in params])
        torch._foreach_add_(destinations, list(sources), alpha=self.post_scale)
        if destinations:
            self.heap_return.landed(output.numel() * destinations[0].element_size())  # the sources split it whole
        if self.on_landed is not None:
            self.on_landed(params)

    def _copy_to_host(self, reduction: _Reduction) -> None:
        """Start the shard's copy to pinned host memory on the side stream; it is added when it arrives."""
        output = reduction.output
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        staged = torch.empty(output.shape, dtype=output.dtype, pin_memory=True)
        # After work.wait() the reduction is ordered on the current stream: the copy goes behind it. A slot is
        # kept until its copy's event (below); a fresh buffer's memory outlives the copy by record_stream.
        copied = copy_to_host(output, staged, self._copy_stream, record_source=reduction.slot is None)
        assert copied is not None  # a side stream's copy always has an event
        if reduction.slot is not None:
            self._slot_copy[reduction.slot] = copied
        self._arriving.append(_HostArrival(copied, staged, reduction.bucket.params))
        self._add_arrived(block=False)

    def _add_arrived(self, block: bool) -> None:
        """Add the shards whose copies have arrived (with `block`, all of them), in landing order."""
        while self._arriving and (block or self._arriving[0].copied.query()):
            arrival = self._arriving.pop(0)
            arrival.copied.synchronize()
            self._add(arrival.params, arrival.staged)

    def _land_all(self) -> None:
        """Land every reduction (and add every shard on its way to the host); settle the helper thread."""
        for reduction in list(self._inflight):
            self._land(reduction)
        self._add_arrived(block=True)
        self._slot_copy = [None] * self.slots  # every copy has arrived
        if self._watched:
            wait(self._watched)
            self._watched = []

    def _watch(self, work: dist.Work | None) -> Future[None] | None:
        if work is None or self._stream_waits:
            return None
        if self._waiter is None:
            self._waiter = HelperThreads(1, "zero3-reduce-wait")
        finished = self._waiter.submit(work.wait)
        self._watched.append(finished)
        return finished

    def close(self) -> None:
        """Stop the helper threads (every reduction has landed by then, unless a peer was lost)."""
        if self._waiter is not None:
            # Not joined: its thread only waits on works, and one whose peer died may never end (a gloo
            # reduction after a lost node was seen to); the engine's teardown must not wait for it.
            self._waiter.shutdown(wait=False, cancel_futures=True)
            self._waiter = None
        self.reduce.close()
        if self.expert_reduce is not None:
            self.expert_reduce.close()
