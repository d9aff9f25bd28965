"""This rank's reduced gradient shards: the `lp_grads` state.

One flat buffer (in `grad_accum_dtype`; host memory with ZeRO-Offload, else
the device; in lean memory mode and on a CPU device at several ranks, chunks
made as gradients land instead, see the last two Notes) with a slot per
trained parameter, laid out in the optimizer's order, and which parameters
got a gradient since the last step. The reducer adds landed shards into it,
the optimizer steps from it and zeroes it; the engine builds it and hands it
to both, so neither reaches into the other.

In host memory a large buffer is zeroed by dropping its pages (`DroppableZeros`),
not by writing zeros: from a step to the next backward's gradients it holds
no resident memory, as FSDP2's gradients (freed by `zero_grad`) hold none,
and the forward's activations, the largest part of a step's peak, do not
come on top of it. Its pages return as the gradients land.

Each returning page costs a fault (a read maps the zero page, the first add
copies it), several times what writing zeros costs (docs/benchmarks.md,
"Measurements behind the design"). A buffer under `DROP_PAGES_FROM_BYTES` is
zeroed by writing: its memory is small beside the step's peak, and the faults
would be a large part of a small model's step.

[Note: gradients held only from the backward to the step]
In lean memory mode (zero3.partition.lean) the shards have no flat buffer.
They are made a chunk at a time: a chunk is a run of shards next to each
other in the flat layout whose parameters share a gather unit, so the
backward reaches a chunk at once. A chunk is made (zeroed) when the first
gradient of any of its shards lands and dropped by the step's `zero()`, as
FSDP2 makes its sharded gradients in the backward and frees them at
`zero_grad`. Between steps the shards hold no memory, and during the
backward the chunks not yet reached hold none either. The flat layout's
offsets still place everything else: the optimizer's sub-groups read their
pieces from whichever chunks exist, zeros for the rest, and fp32 gradients
on the step's device are stepped on in place, piece by piece. Both forms
give the same arithmetic. The squared norm sums the norms of the same
NORM_CHUNK windows of the flat layout, each window a view inside one chunk
or put together in a scratch window. A chunk starts at the address its flat
stretch would have modulo ALIGN_BYTES, and a window, at a multiple of
NORM_CHUNK, starts aligned, so a kernel that vectorizes by alignment adds
the same elements in the same order.

[Note: on demand on the CPU, at several ranks]
Where the device is the CPU the activations are glibc heap blocks, freed as
the backward goes. A flat lp_grads is a mapping of its own: its pages come
back as gradients land, on top of the freed activations' pages, which glibc
keeps resident unless they are handed back (zero3.passes.host_heap; each
page handed back faults again in the next forward). Chunks made on demand
are heap blocks too (a gather unit's shards; glibc's mmap threshold grows to
such sizes once one is freed), so they take the freed activations' places,
as FSDP2's gradients do, and nothing is handed back. So a CPU device that
reduces across ranks makes its shards on demand: alternated with FSDP2, it
was the faster of the two forms (the figures are in docs/benchmarks.md). A
world of one keeps the flat buffer: it adds each gradient straight into it,
and making the chunks and their views every step is a cost a host-bound
small model feels.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence

import torch

from zero3.accelerator import DroppableZeros
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam


DROP_PAGES_FROM_BYTES = 64 << 20  # a host buffer at least this large is zeroed by dropping its pages
NORM_CHUNK = 1 << 20  # elements per piece of the squared norm (a 16-bit piece is cast to fp32 whole)
ALIGN_BYTES = 64  # a chunk keeps its flat stretch's address modulo this (see the Note)


def made_on_demand(lean: bool, device: torch.device, alone: bool, states_in_memory: bool,
                   super_offload: bool) -> bool:
    """Whether the gradient shards are made a chunk at a time as they land (the last Note) instead of held in
    one flat buffer: in lean memory mode, and on a CPU device where gradients are reduced across ranks
    (the Note on the CPU's heap). Not where the optimizer state is on disk (a failed step is retried on the
    kept gradients) or the host step overlaps the backward (it reads landed shards as a flat buffer)."""
    if not states_in_memory or super_offload:
        return False
    return lean or (device.type == "cpu" and not alone)


@dataclass
class Piece:
    """`numel` elements of a parameter's shard, from `start` within it: the part one optimizer sub-group
    steps, or one norm window holds."""

    sp: ShardedParam
    start: int
    numel: int


class GradShards:
    def __init__(self, params: list[ShardedParam], dtype: torch.dtype, device: torch.device,
                 on_demand: bool = False, group_of: Mapping[ShardedParam, object] | None = None) -> None:
        self.params = params
        self.on_demand = on_demand  # the shards in chunks of their own, from a first gradient to the step
        self._dtype = dtype
        self._device = device
        numel = sum(sp.shard_numel for sp in params)
        self.buffer: FlatBuffer | None = None
        self._droppable: DroppableZeros | None = None
        if not on_demand:
            # In host memory and large, zeroed by dropping its pages (see the module's doc); until it moves.
            droppable = device.type == "cpu" and numel * dtype.itemsize >= DROP_PAGES_FROM_BYTES
            self._droppable = DroppableZeros(numel, dtype) if droppable else None
            tensor = (self._droppable.tensor if self._droppable is not None
                      else torch.zeros(numel, dtype=dtype, device=device))
            self.buffer = FlatBuffer("lp_grads", tensor)
        self.slots: dict[ShardedParam, Slot] = {}
        self.offsets: dict[ShardedParam, int] = {}  # each shard's place in the flat layout
        cursor = 0
        for sp in params:
            if self.buffer is not None:
                self.slots[sp] = Slot(self.buffer, cursor, sp.shard_numel)
            self.offsets[sp] = cursor
            cursor += sp.shard_numel
            sp.grad_owner = self
        self.numel = cursor
        self._starts = [self.offsets[sp] for sp in params]  # ascending: the shards lie in order
        # On demand, shards are made a chunk at a time: a run of shards next to each other in the flat
        # layout whose parameters share a group (`group_of`: the gather unit; none: a shard each), so a
        # chunk is a stretch of the flat layout the backward reaches at once.
        self._chunk_of: dict[ShardedParam, int] = {}
        self._chunks: list[tuple[int, int]] = []  # (offset in the flat layout, elements)
        previous_group: object = None
        for sp in params:
            group = group_of.get(sp) if group_of is not None else None
            if group is not None and group == previous_group:
                offset, length = self._chunks[-1]
                self._chunks[-1] = (offset, length + sp.shard_numel)
            else:
                self._chunks.append((self.offsets[sp], sp.shard_numel))
            self._chunk_of[sp] = len(self._chunks) - 1
            previous_group = group
        # Each held chunk's buffer (a FlatBuffer, so offload_states can move it) and where the chunk starts
        # in it (see the Note); each shard's view, made once (dropped with the chunks, or before they move).
        self._own: dict[int, tuple[FlatBuffer, int]] = {}
        self._views: dict[ShardedParam, torch.Tensor] = {}
        # Whether a gradient reached the parameter since the last step (on this rank, until agreed).
        self.arrived: dict[ShardedParam, bool] = dict.fromkeys(params, False)
        # Each slot's view in its parameter's shape, made once per buffer tensor: a world of one adds every
        # gradient through one, and a narrow per gradient would cost host time on every gradient. Dropped
        # (forget_views) before the buffer moves, so no view keeps the old memory alive.
        self._shaped: dict[ShardedParam, torch.Tensor] = {}
        self._shaped_of: torch.Tensor | None = None
        self._pieces: list[torch.Tensor] = []  # the squared norm's pieces of the flat buffer, per tensor
        self._pieces_of: torch.Tensor | None = None

    @staticmethod
    def of(sp: ShardedParam) -> GradShards | None:
        """The gradient shards that hold `sp`'s, if it is trained."""
        owner: GradShards | None = sp.grad_owner
        return owner

    def __contains__(self, sp: ShardedParam) -> bool:
        return sp in self.offsets

    # ---- facts --------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        """Where the shards are: the flat buffer's device (meta while parked on disk); on demand, where new
        shards are made."""
        return self.buffer.device if self.buffer is not None else self._device

    @property
    def nbytes(self) -> int:
        """Bytes held now (on demand: the shards made since the last step, alignment included)."""
        if self.buffer is not None:
            return self.buffer.nbytes
        return sum(buffer.nbytes for buffer, _ in self._own.values())

    def buffers(self) -> list[FlatBuffer]:
        """The flat buffers that hold the state now (what offload_states moves)."""
        if self.buffer is not None:
            return [self.buffer]
        return [buffer for buffer, _ in self._own.values()]

    def steps_in_place(self, step_device: torch.device) -> bool:
        """Whether a step can run on views of these gradients themselves: fp32 on the step's device (the
        caller adds its own conditions)."""
        device = self.buffer.tensor.device if self.buffer is not None else self._device
        return self._dtype == torch.float32 and device == step_device

    # ---- one parameter's shard ------------------------------------------------------
    def in_place(self, device: torch.device) -> torch.Tensor:
        """The reduced gradients a step runs on in place (`steps_in_place`): the flat buffer, or an empty
        tensor where each shard is a tensor of its own (each sub-group then takes its pieces' views)."""
        return self.buffer.tensor if self.buffer is not None else torch.empty(0, device=device)

    def in_place_window(self, work: torch.Tensor, offset: int, numel: int) -> torch.Tensor | None:
        """A sub-group's gradients to step in place: its window of `in_place`'s tensor, or None (own shards)."""
        return work.narrow(0, offset, numel) if self.buffer is not None else None

    def held(self, sp: ShardedParam) -> bool:
        """Whether the shard has memory (always, in a flat buffer)."""
        return self.buffer is not None or self._chunk_of[sp] in self._own

    def view(self, sp: ShardedParam) -> torch.Tensor:
        """The parameter's gradient shard, to write (on demand: made, zeroed, with its chunk if that has
        none yet)."""
        if self.buffer is not None:
            return self.slots[sp].view()
        view = self._views.get(sp)
        if view is None:
            chunk = self._chunk_of[sp]
            buffer, lead = self._held_chunk(chunk)
            view = self._views[sp] = buffer.view(lead + self.offsets[sp] - self._chunks[chunk][0], sp.shard_numel)
        return view

    def _held_chunk(self, chunk: int) -> tuple[FlatBuffer, int]:
        own = self._own.get(chunk)
        if own is None:
            offset, numel = self._chunks[chunk]
            # Zeroed, then added to: the same arithmetic as a zeroed flat slot (a copy would keep a -0.0).
            lead = (offset * self._dtype.itemsize) % ALIGN_BYTES // self._dtype.itemsize
            storage = torch.zeros(lead + numel, dtype=self._dtype, device=self._device)
            own = self._own[chunk] = (FlatBuffer(f"lp_grads.{chunk}", storage, state="lp_grads"), lead)
        return own

    def read(self, sp: ShardedParam) -> torch.Tensor:
        """The parameter's gradient shard, to read: a view, or zeros where an on-demand shard has none."""
        if self.held(sp):
            return self.view(sp)
        return torch.zeros(sp.shard_numel, dtype=self._dtype, device=self._device)

    def flat(self) -> torch.Tensor:
        """Every shard in the flat layout, as one tensor: the flat buffer itself, or, on demand, a copy of
        the shards held (zeros where none is), which nothing writes back."""
        if self.buffer is not None:
            return self.buffer.tensor
        return torch.cat([self.read(sp) for sp in self.params]) if self.params else \
            torch.zeros(0, dtype=self._dtype, device=self._device)

    def views(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        return [self.view(sp) for sp in params]

    def shaped(self, sp: ShardedParam) -> torch.Tensor:
        """The shard in its parameter's shape (a world of one, where the shard is the whole parameter), to
        write; cached per flat buffer tensor (param_shaped_views)."""
        if self.buffer is not None:
            return self.param_shaped_views()[sp]
        return self.view(sp).view(sp.shape)

    def param_shaped_views(self) -> dict[ShardedParam, torch.Tensor]:
        """Every slot viewed in its parameter's shape, made once per buffer tensor: at a world of one a
        slot holds the whole parameter, and the reducer adds gradients into these (or autograd does:
        zero3.passes.grad_hooks). On demand: the shards held now."""
        if self.buffer is None:
            return {sp: self.view(sp).view(sp.shape) for sp in self.params if self._chunk_of[sp] in self._own}
        tensor = self.buffer.tensor  # waits for an in-flight copy; raises if the buffer is on disk
        if tensor is not self._shaped_of:
            self._shaped = {
                sp: tensor.narrow(0, slot.offset, slot.numel).view(sp.shape) for sp, slot in self.slots.items()
            }
            self._shaped_of = tensor
        return self._shaped

    # ---- what the step reads ----------------------------------------------------------
    def copy_range(self, offset: int, pieces: Sequence[Piece], into: torch.Tensor) -> None:
        """Elements [offset, offset + into.numel()) of the flat layout into `into`; `pieces` tile the
        range, in order."""
        if self.buffer is not None:
            into.copy_(self.buffer.view(offset, into.numel()))
            return
        cursor = 0
        for piece in pieces:
            target = into[cursor : cursor + piece.numel]
            if self._chunk_of[piece.sp] in self._own:
                target.copy_(self.view(piece.sp)[piece.start : piece.start + piece.numel])
            else:
                target.zero_()
            cursor += piece.numel

    def squared_norm(self) -> torch.Tensor:
        """The sum of squares of every shard, in fp32: the flat layout in NORM_CHUNK windows, a norm each,
        summed (a 16-bit window is cast to fp32 whole, so none is larger). On demand, a window that is not
        part of one held shard is put together in a scratch window first (see the Note: the same windows,
        the same addresses modulo ALIGN_BYTES, the same arithmetic)."""
        if self.numel == 0:
            return torch.zeros((), dtype=torch.float32, device=self._device)
        if self.buffer is not None:
            tensor = self.buffer.tensor
            if tensor is not self._pieces_of:  # a flat buffer's windows are made once per tensor
                self._pieces, self._pieces_of = list(tensor.split(NORM_CHUNK)), tensor
            return torch.stack(torch._foreach_norm(self._pieces, 2, dtype=torch.float32)).pow(2).sum()
        norms = []
        scratch: torch.Tensor | None = None
        for start in range(0, self.numel, NORM_CHUNK):
            numel = min(NORM_CHUNK, self.numel - start)
            pieces = self._pieces_in(start, numel)
            chunk = self._chunk_of[pieces[0].sp]
            if chunk in self._own and chunk == self._chunk_of[pieces[-1].sp]:  # inside one chunk: itself
                buffer, lead = self._own[chunk]
                window = buffer.view(lead + start - self._chunks[chunk][0], numel)
            else:
                if scratch is None:
                    scratch = torch.empty(min(NORM_CHUNK, self.numel), dtype=self._dtype, device=self._device)
                window = scratch[:numel]
                self.copy_range(start, pieces, window)
            norms.append(torch._foreach_norm([window], 2, dtype=torch.float32)[0])
        return torch.stack(norms).pow(2).sum()

    def _pieces_in(self, start: int, numel: int) -> list[Piece]:
        """The shards' pieces that tile elements [start, start + numel) of the flat layout, in order."""
        index = bisect.bisect_right(self._starts, start) - 1
        pieces = []
        end = start + numel
        while start < end:
            sp = self.params[index]
            offset = self._starts[index]
            take = min(end, offset + sp.shard_numel) - start
            if take > 0:
                pieces.append(Piece(sp, start - offset, take))
                start += take
            index += 1
        return pieces

    def sum_whole(self, reduce: Callable[[torch.Tensor], object]) -> None:
        """Apply an in-place collective (`reduce`) to every shard at once, in the flat layout: the flat
        buffer itself, or (on demand) a flat copy, written back into every chunk (made where none was)."""
        if self.buffer is not None:
            reduce(self.buffer.tensor)
            return
        flat = torch.zeros(self.numel, dtype=self._dtype, device=self._device)
        for chunk, (buffer, lead) in self._own.items():
            offset, numel = self._chunks[chunk]
            flat.narrow(0, offset, numel).copy_(buffer.view(lead, numel))
        reduce(flat)
        for chunk, (offset, numel) in enumerate(self._chunks):
            buffer, lead = self._held_chunk(chunk)
            buffer.view(lead, numel).copy_(flat.narrow(0, offset, numel))

    # ---- lifetime ---------------------------------------------------------------------
    def forget_views(self) -> None:
        """Drop the cached views (the buffer is about to move: they would keep its memory)."""
        self._shaped, self._shaped_of = {}, None
        self._pieces, self._pieces_of = [], None
        self._views.clear()
        self._droppable = None  # nor may the mapping outlive the tensor; a moved buffer is zeroed by writing

    def mark_arrived(self, sp: ShardedParam) -> None:
        self.arrived[sp] = True

    def any_arrived(self) -> bool:
        return any(self.arrived.values())

    def zero(self) -> None:
        if self.buffer is None:
            self._own.clear()  # on demand: the shards are dropped (see the Note)
            self._views.clear()
        else:
            tensor = self.buffer.tensor
            if self._droppable is not None and tensor is self._droppable.tensor:
                self._droppable.zero()
            else:
                tensor.zero_()
        for sp in self.arrived:
            self.arrived[sp] = False

    def close(self) -> None:
        """Forget the parameters (the engine is being destroyed)."""
        self.forget_views()
        for sp in self.params:
            if sp.grad_owner is self:
                sp.grad_owner = None
        self.slots.clear()
        self._own.clear()
        self.arrived.clear()

