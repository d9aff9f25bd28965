"""One partitioned parameter: its geometry, its 16-bit slot, its released placeholder, and what it belongs to
(its gather unit, its optimizer-side slots, its gradient shards), as FSDP2's `FSDPParam` owns its own.

The `nn.Parameter` object itself is kept (optimizers, tied weights and user
references stay valid); only its `.data` changes: a view into its unit's
gathered buffer while AVAILABLE, a zero-element placeholder otherwise. The one
attribute added to the parameter is `_zero3`, pointing here.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn

from zero3.moe.expert_parallel import expert_share
from zero3.partition.flat_buffer import Slot


class MasterKeeper(Protocol):
    """What keeps a parameter's fp32 master: `lp_stale` set, it rewrites the 16-bit shards from the masters
    before their next use (alike on every rank)."""

    lp_stale: bool
from zero3.shard_mesh import ShardMesh

ATTR = "_zero3"


class ShardedParam:
    def __init__(
        self,
        param: nn.Parameter,
        name: str,
        mesh: ShardMesh,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.param = param
        self.name = name
        self.shape = param.shape
        self.numel = param.numel()
        self.mesh = mesh
        self.shard_numel = mesh.shard_numel(self.numel)
        self.ds_id = -1  # DeepSpeed's parameter id (zero3.partition.ds_attributes gives one)
        self.leaf = False  # gathered with a leaf module's unit (zero3.partition.leaf_modules)
        self.lp_slot: Slot | None = None
        # What the parameter belongs to, each set by its owner and cleared when the owner closes: the gather
        # unit that gathers it (zero3.partition.unit's `unit_of`), its optimizer-side slots (master and
        # moments: zero3.step.masters' MasterSlots) and the gradient shards that hold its gradient
        # (zero3.step.grad_shards' GradShards). The last two are the step's types, held here untyped so that
        # this room does not reach up to the step's.
        self.unit: Any = None
        self.master_slots: Any = None
        self.grad_owner: Any = None
        # DeepSpeed's `param.all_gather_coalesced()` block this parameter is gathered by, until `param.partition()`.
        self.held_gather: Any = None
        # Lean memory mode (zero3.partition.lean): no 16-bit slot; the 16-bit shard is this fp32 master, cast.
        self.lean_master: Slot | None = None
        # Other copies of this shard that a new full value must reach too (an optimizer's fp32
        # master): the optimizer adds its own and keeps everything else of its state to itself.
        self.followers: list[Slot] = []
        # What keeps the fp32 master the 16-bit shard follows (zero3.step.optimizer), told when the shard
        # was lost: it writes the shards again from the masters before their next use.
        self.master_keeper: MasterKeeper | None = None
        # fp32 copy of this rank's shard taken at partition time, so the master
        # starts from the exact fp32 initialisation rather than a 16-bit round trip.
        self.hp_seed: torch.Tensor | None = None
        # Set by a runtime: called when the parameter is read through its
        # module attribute, so a use outside its owner's forward gets gathered.
        self.on_access: Callable[["ShardedParam"], None] | None = None
        # A zero-element view of a private one-element storage: the storage pointer
        # identifies this parameter's released state (see zero3.partition.init_context).
        self.placeholder = torch.empty(1, dtype=dtype, device=device)[:0]
        setattr(param, ATTR, self)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.mesh.shard_size

    @property
    def dtype(self) -> torch.dtype:
        return self.placeholder.dtype

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full value of the parameter, zero padded."""
        shard = torch.empty(self.shard_numel, dtype=full.dtype, device=full.device)
        self.copy_shard_of(full, shard)
        return shard

    def copy_shard_of(self, full: torch.Tensor, into: torch.Tensor) -> None:
        """This rank's shard of a full value written into `into` (`shard_numel` elements, any dtype), zero
        padded: one pass over the shard, no copy of it made first."""
        start, end = self.shard_range()
        held = max(end - start, 0)
        if held:
            into[:held].copy_(full.reshape(-1)[start:end])
        if held < self.shard_numel:
            into[held:].zero_()

    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this rank's shard within the flattened parameter (may be empty)."""
        return self.mesh.shard_range(self.numel)

    @property
    def whole_shape(self) -> torch.Size:
        """The shape of the model's whole parameter: `shape`, or for a shared-out expert weight (this rank's
        experts only: zero3.moe.expert_parallel) the shape with every expert."""
        share = expert_share(self.param)
        return self.shape if share is None else torch.Size((share.total, *self.shape[1:]))

    def whole_range(self) -> tuple[int, int]:
        """`shard_range` within the whole parameter (`whole_shape`): a share's experts are a contiguous run of
        the whole's rows, so its shard is a contiguous range of the whole's flat values too."""
        start, end = self.shard_range()
        share = expert_share(self.param)
        if share is None:
            return start, end
        shift = share.first * math.prod(self.shape[1:])
        return start + shift, end + shift

    def lp_shard(self) -> torch.Tensor:
        assert self.lp_slot is not None
        return self.lp_slot.view()

    def read_lp(self) -> torch.Tensor:
        """This rank's 16-bit shard: its slot's values (a view where they are in memory), or, in lean memory
        mode, its master cast as a step would write it (the values a gather sends)."""
        if self.lp_slot is not None:
            return self.lp_slot.read()
        if self.lean_master is None:
            raise RuntimeError(f"parameter {self.name} has no shard storage (its engine was destroyed)")
        return self.lean_master.read().to(self.dtype)

    def write_full(self, full: torch.Tensor) -> None:
        """Store a new full value: this rank's shard goes to the 16-bit slot and the master."""
        self.write_shard(self.shard_of(full.detach()))

    def write_shard(self, shard: torch.Tensor) -> None:
        """Store this rank's shard (`shard_numel` elements, zero padded) of a new value, everywhere it lives."""
        if shard.numel() != self.shard_numel:
            raise ValueError(f"{self.name}: a shard of {shard.numel()} elements, expected {self.shard_numel}")
        if self.lp_slot is not None:  # (none in lean memory mode: the master, a follower, is the shard's home)
            self.lp_slot.write(shard)
        for follower in self.followers:
            follower.write(shard)
        if self.hp_seed is not None:
            self.hp_seed.copy_(shard)

    # The engine's own `.data` swaps bypass torch-function modes: zero3.Init's
    # mode treats a user's `.data =` on a partitioned parameter as a write.
    def set_released(self) -> None:
        with torch._C.DisableTorchFunction():
            self.param.data = self.placeholder

    def set_full(self, full_view: torch.Tensor) -> None:
        with torch._C.DisableTorchFunction():
            self.param.data = full_view

    def __repr__(self) -> str:
        return f"ShardedParam({self.name}, shape={tuple(self.shape)}, shard={self.shard_numel})"


def sharded(param: torch.Tensor) -> ShardedParam | None:
    return getattr(param, ATTR, None)


# Parameters whose data a destroyed engine released (`.data` empty): a new engine over them would train on
# nothing, so `zero3.initialize` refuses them until they hold data again.
# Keyed by id with weak references: a WeakSet compares tensors with `==`, which is elementwise.
_RELEASED: dict[int, weakref.ref[torch.Tensor]] = {}


def mark_released(param: torch.Tensor) -> None:
    key = id(param)
    _RELEASED[key] = weakref.ref(param, lambda _: _RELEASED.pop(key, None))


def released_by_destroy(param: torch.Tensor) -> bool:
    """Whether `param` still holds nothing since an engine's `destroy()` released it."""
    found = _RELEASED.get(id(param))
    return found is not None and found() is param and param.numel() == 0


def require_sharded(param: torch.Tensor, what: str) -> ShardedParam:
    sp = sharded(param)
    if sp is None:
        raise ValueError(
            f"{what}: the tensor of shape {tuple(param.shape)} is not a zero3-partitioned parameter "
            "(build the model under zero3.Init or pass it to zero3.initialize first)"
        )
    return sp
