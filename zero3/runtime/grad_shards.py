"""This rank's reduced gradient shards: the `lp_grads` state.

One flat buffer (in `grad_accum_dtype`; host memory with ZeRO-Offload, else
the device) with a slot per trained parameter, laid out in the optimizer's
order, and which parameters got a gradient since the last step. The reducer
adds landed shards into it, the optimizer steps from it and zeroes it; the
engine builds it and hands it to both, so neither reaches into the other.

In host memory a large buffer is zeroed by dropping its pages (`DroppableZeros`),
not by writing zeros: from a step to the next backward's gradients it holds
no resident memory, as FSDP2's gradients (freed by `zero_grad`) hold none,
and the forward's activations, the largest part of a step's peak, do not
come on top of it. Its pages return as the gradients land.

Each returning page costs a fault (a read maps the zero page, the first add
copies it): about 0.7 ms per MiB on the AMD EPYC of docs/benchmarks.md, where
writing zeros costs 0.1. A buffer under `DROP_PAGES_FROM_BYTES` is zeroed by
writing: its memory is small beside the step's peak, and the faults were a
sixth of the 16 x 64 stand-in's step (benchmarks/step_time.py).
"""

from __future__ import annotations

import weakref

import torch

from zero3.accelerator import DroppableZeros
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam

# Each parameter's gradient shards, for the per-parameter accessors (zero3.safe_get_local_grad).
_OWNER: weakref.WeakKeyDictionary[ShardedParam, "GradShards"] = weakref.WeakKeyDictionary()

DROP_PAGES_FROM_BYTES = 64 << 20  # a host buffer at least this large is zeroed by dropping its pages


class GradShards:
    def __init__(self, params: list[ShardedParam], dtype: torch.dtype, device: torch.device) -> None:
        self.params = params
        numel = sum(sp.shard_numel for sp in params)
        # In host memory and large, zeroed by dropping its pages (see the module's doc); until it moves.
        droppable = device.type == "cpu" and numel * dtype.itemsize >= DROP_PAGES_FROM_BYTES
        self._droppable: DroppableZeros | None = DroppableZeros(numel, dtype) if droppable else None
        tensor = self._droppable.tensor if self._droppable is not None else torch.zeros(numel, dtype=dtype, device=device)
        self.buffer = FlatBuffer("lp_grads", tensor)
        self.slots: dict[ShardedParam, Slot] = {}
        cursor = 0
        for sp in params:
            self.slots[sp] = Slot(self.buffer, cursor, sp.shard_numel)
            cursor += sp.shard_numel
            _OWNER[sp] = self
        # Whether a gradient reached the parameter since the last step (on this rank, until agreed).
        self.arrived: dict[ShardedParam, bool] = dict.fromkeys(params, False)
        # Each slot's view in its parameter's shape, made once per buffer tensor: a world of one adds every
        # gradient through one, and a narrow per gradient would cost host time on every gradient. Dropped
        # (forget_views) before the buffer moves, so no view keeps the old memory alive.
        self._shaped: dict[ShardedParam, torch.Tensor] = {}
        self._shaped_of: torch.Tensor | None = None

    @staticmethod
    def of(sp: ShardedParam) -> GradShards | None:
        """The gradient shards that hold `sp`'s, if it is trained."""
        return _OWNER.get(sp)

    def __contains__(self, sp: ShardedParam) -> bool:
        return sp in self.slots

    def view(self, sp: ShardedParam) -> torch.Tensor:
        """A fresh view of the parameter's gradient shard (what the accessors hand out)."""
        return self.slots[sp].view()

    def views(self, params: list[ShardedParam]) -> list[torch.Tensor]:
        return [self.slots[sp].view() for sp in params]

    def param_shaped_views(self) -> dict[ShardedParam, torch.Tensor]:
        """Every slot viewed in its parameter's shape, made once per buffer tensor: at a world of one a
        slot holds the whole parameter, and the reducer adds gradients into these (or autograd does:
        zero3.runtime.grad_hooks)."""
        tensor = self.buffer.tensor  # waits for an in-flight copy; raises if the buffer is on disk
        if tensor is not self._shaped_of:
            self._shaped = {
                sp: tensor.narrow(0, slot.offset, slot.numel).view(sp.shape) for sp, slot in self.slots.items()
            }
            self._shaped_of = tensor
        return self._shaped

    def forget_views(self) -> None:
        """Drop the cached views (the buffer is about to move: they would keep its memory)."""
        self._shaped, self._shaped_of = {}, None
        self._droppable = None  # nor may the mapping outlive the tensor; a moved buffer is zeroed by writing

    def mark_arrived(self, sp: ShardedParam) -> None:
        self.arrived[sp] = True

    def any_arrived(self) -> bool:
        return any(self.arrived.values())

    def zero(self) -> None:
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
            if _OWNER.get(sp) is self:
                del _OWNER[sp]
        self.slots.clear()
        self.arrived.clear()
