"""A gather unit: the parameters that are all-gathered and released together.

[Note: unit layout]
The unit's shards are contiguous in the rank's 16-bit flat buffer, so the
all-gather input is a view, never a copy. The all-gather output is rank-major
([N, S] for S = the unit's shard elements); parameter i's padded full value is
its column block [:, off_i:off_i+s_i]. With one parameter, or one rank, that
block already is the contiguous full value; otherwise one fused
`split_with_sizes_copy` lays the parameters out contiguously ("copy-out").
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.enums import ParamStatus
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam


class UnitState(Enum):
    SHARDED = ParamStatus.NOT_AVAILABLE
    INFLIGHT = ParamStatus.INFLIGHT
    UNSHARDED = ParamStatus.AVAILABLE


class ShardSource(Protocol):
    """Brings a unit's shard to its device for an all-gather when the shard's home is elsewhere
    (host memory beside a GPU, or disk): zero3.offload's parameter tier."""

    def acquire(self, unit: "GatherUnit") -> torch.Tensor: ...


class GatherUnit:
    def __init__(self, params: list[ShardedParam], comm: Communicator, label: str) -> None:
        if not params:
            raise ValueError(f"gather unit {label!r} has no parameters")
        self.params = params
        self.comm = comm
        self.label = label
        self.persistent = False
        self.shard_numel = sum(sp.shard_numel for sp in params)
        self.numel = sum(sp.numel for sp in params)
        self.state = UnitState.SHARDED
        self.lp_slot: Slot | None = None
        self._work: dist.Work | None = None
        self._gather_output: torch.Tensor | None = None
        self.unsharded: torch.Tensor | None = None
        # Who needs the gathered values now (the unit is released when none do).
        self.refcount = 0  # forward frames
        self.pins = 0  # GatheredParameters contexts
        self.backward_held = False
        self.pending_grads = 0
        # Told of every state change (old, new): the runtime maps gathered storage
        # back to units and counts the gathered elements.
        self.observer: Callable[["GatherUnit", UnitState, UnitState], None] | None = None
        # How a runtime brings the unit in while it drives the gathers (its lockstep
        # walk); None: gather directly. Used by `fetch`.
        self.fetcher: Callable[["GatherUnit"], None] | None = None
        # Where the shard comes from when it does not live on the device (None: the lp slot's view).
        self.source: ShardSource | None = None
        self._gather_input: torch.Tensor | None = None  # kept alive until the gather completes
        for sp in params:
            sp.unit = self

    # ---- placement -------------------------------------------------------
    def assign_lp(self, buffer: FlatBuffer, offset: int) -> None:
        """Point the unit (and each parameter) at its region of a 16-bit flat buffer."""
        self.lp_slot = Slot(buffer, offset, self.shard_numel)
        cursor = offset
        for sp in self.params:
            sp.lp_slot = Slot(buffer, cursor, sp.shard_numel)
            cursor += sp.shard_numel

    @property
    def status(self) -> ParamStatus:
        return self.state.value

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].placeholder.device

    # ---- transitions -----------------------------------------------------
    def _set_state(self, new: UnitState) -> None:
        old, self.state = self.state, new
        if self.observer is not None:
            self.observer(self, old, new)

    def fetch(self) -> None:
        """Start bringing the unit in (the runtime's way, if it drives the gathers); `wait` completes it."""
        if self.fetcher is not None:
            self.fetcher(self)
        else:
            self.start_unshard(async_op=True)

    def start_unshard(self, async_op: bool) -> None:
        """Issue the all-gather (SHARDED -> INFLIGHT). No-op unless SHARDED."""
        if self.state is not UnitState.SHARDED:
            return
        world = self.comm.world_size
        if self.gathers_in_place:
            assert self.lp_slot is not None, f"unit {self.label} has no shard storage"
            self._work = None
            self._gather_output = self.lp_slot.view()
        else:
            output = torch.empty(world * self.shard_numel, dtype=self.dtype, device=self.device)
            shard = self.local_shard()
            self._work = self.comm.all_gather_flat(output, shard, async_op=async_op)
            self._gather_input = shard if self.source is not None else None
            self._gather_output = output
        self._set_state(UnitState.INFLIGHT)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Complete an in-flight all-gather (INFLIGHT -> UNSHARDED)."""
        if self.state is not UnitState.INFLIGHT:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._gather_input = None
        output = self._gather_output
        assert output is not None
        self._gather_output = None
        world = self.comm.world_size
        if world == 1 or len(self.params) == 1:
            self.unsharded = output
        else:
            self.unsharded = torch.empty_like(output)
            blocks = []
            cursor = 0
            for sp in self.params:
                blocks.append(self.unsharded[cursor : cursor + sp.padded_numel].view(world, sp.shard_numel))
                cursor += sp.padded_numel
            torch.split_with_sizes_copy(
                output.view(world, self.shard_numel), [sp.shard_numel for sp in self.params], dim=1, out=blocks
            )
        cursor = 0
        for sp in self.params:
            sp.set_full(self.unsharded[cursor : cursor + sp.numel].view(sp.shape))
            cursor += sp.padded_numel
        self._set_state(UnitState.UNSHARDED)

    def local_shard(self) -> torch.Tensor:
        """This rank's shard on the unit's device, ready to all-gather."""
        if self.source is not None:
            return self.source.acquire(self)
        assert self.lp_slot is not None, f"unit {self.label} has no shard storage"
        return self.lp_slot.view()

    def unshard(self) -> None:
        self.start_unshard(async_op=False)
        self.wait()

    def reshard(self) -> None:
        """Drop the gathered values (-> SHARDED). An in-flight gather is completed first."""
        if self.state is UnitState.SHARDED:
            return
        self.wait()
        self._set_state(UnitState.SHARDED)
        for sp in self.params:
            sp.set_released()
        self.unsharded = None
        self.comm.forget_released()  # the gather's aliases would keep the freed storage otherwise

    @property
    def needed(self) -> bool:
        return self.persistent or self.refcount > 0 or self.pins > 0 or self.backward_held

    def release_if_unneeded(self) -> None:
        if not self.needed:
            self.reshard()

    def write_back(self, params: "set[ShardedParam] | None" = None) -> None:
        """Store the current full values (edited in place by the user) into the shards.

        Only `params` (all, if None): writing a parameter's master from its 16-bit
        value rounds it, so a parameter nobody edited must keep its master.
        """
        if self.state is not UnitState.UNSHARDED:
            raise RuntimeError(f"unit {self.label} is not gathered; nothing to write back")
        for sp in self.params:
            if params is None or sp in params:
                sp.write_full(sp.param.data)

    @property
    def gathers_in_place(self) -> bool:
        """A world of one with the shard in memory: nothing to gather, the parameters view the shard
        (edits go straight to it, as GatheredParameters' write-back would put them)."""
        return self.comm.world_size == 1 and self.source is None

    def unsharded_nbytes(self) -> int:
        """Memory the gathered values take beyond the shard (none when they are the shard)."""
        if self.unsharded is None or self.gathers_in_place:
            return 0
        return self.unsharded.numel() * self.unsharded.element_size()

    def __repr__(self) -> str:
        return f"GatherUnit({self.label}, params={len(self.params)}, state={self.state.name})"
