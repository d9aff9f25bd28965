"""A gather unit: the parameters that are all-gathered and released together.

[Note: unit layout]
The unit's shards are contiguous in the rank's 16-bit flat buffer, so the
all-gather input is a view, never a copy, where that buffer is on the device
(a parameter tier's `source` brings the shard in from host memory or disk
first). The gather itself (copy-in, collective, copy-out to each parameter's
contiguous value) is the mesh's `ParamGather` (zero3.partition.collectives).
A unit changes state only through its methods (`start_unshard`, `wait`,
`reshard`), and stays gathered while it has a `Hold`
(zero3.passes.coordinator's [Note: who holds a gathered unit]).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch

from zero3.comm import Communicator
from zero3.enums import ParamStatus
from zero3.partition.collectives import ParamGather, PendingGather
from zero3.partition.flat_buffer import FlatBuffer, Slot
from zero3.partition.sharded_param import ShardedParam

if TYPE_CHECKING:
    from zero3.step_protocol import StepProtocol


class UnitState(Enum):
    SHARDED = ParamStatus.NOT_AVAILABLE
    INFLIGHT = ParamStatus.INFLIGHT
    UNSHARDED = ParamStatus.AVAILABLE


class Hold(Enum):
    """Why a unit stays gathered. A unit is released when no hold is left (and it is not persistent)."""

    FORWARD = "forward"  # a forward frame uses it (counted: frames nest, a returned parameter adds one)
    PIN = "pin"  # a GatheredParameters block (counted: blocks nest)
    BACKWARD = "backward"  # backward reads it until its gradients are in (held once, whoever asks again)


class ShardSource(Protocol):
    """Brings a unit's shard to its device for an all-gather when the shard's home is elsewhere
    (host memory beside a GPU, or disk): zero3.offload's parameter tier; or makes it (lean memory's casts)."""

    # Whether a world of one takes what `acquire` returns as the gathered values (a tensor nobody else
    # holds) instead of copying it.
    hands_over_fresh: bool

    def acquire(self, unit: "GatherUnit") -> torch.Tensor: ...


class SecondaryRoute(Protocol):
    """A second place a unit may be gathered from, beside its primary shards: hpZ's secondary shards
    on the node (zero3.partition.secondary), kept where the engine keeps them."""

    def usable(self, unit: "GatherUnit") -> bool:
        """Whether the ranks agreed they hold `unit` there (so every rank gathers it from there)."""
        ...

    def start_gather(self, unit: "GatherUnit") -> PendingGather | None:
        """The unit's all-gather from there; None where the unit is gathered from its primary shards."""
        ...

    def recorder(self, unit: "GatherUnit") -> Callable[[torch.Tensor], None] | None:
        """What a primary gather of `unit` calls with its result when it completes, if anything."""
        ...

    def stand_in_nbytes(self, unit: "GatherUnit") -> int: ...

    def start_stand_in(self, unit: "GatherUnit", reserve: torch.Tensor) -> PendingGather: ...


def unit_of(sp: ShardedParam) -> "GatherUnit | None":
    """The unit that gathers `sp` (None once its engine was destroyed): the parameter's own `unit`."""
    return sp.unit


class UnitDriver(Protocol):
    """The runtime that drives a unit's gathers (zero3.passes.coordinator): told of every state change
    (it maps gathered storage back to units and counts gathered elements), and asked to bring the unit
    in (through its lockstep walk)."""

    def observe(self, unit: "GatherUnit", old: UnitState, new: UnitState) -> None: ...

    def fetch(self, unit: "GatherUnit", exact: bool = False) -> None: ...

    def gathers_directly(self) -> bool:
        """Whether a fetch now starts the unit's own all-gather (between passes), not the pass's walk."""
        ...

    @property
    def protocol(self) -> "StepProtocol":
        """Where the runtime's agreements are made (zero3.step_protocol)."""
        ...


class GatherUnit:
    def __init__(self, params: list[ShardedParam], gather: ParamGather, label: str, persistent: bool = False) -> None:
        if not params:
            raise ValueError(f"gather unit {label!r} has no parameters")
        self.params = params
        self.gather = gather
        self.label = label
        # Gathered once and kept (small parameters, stage3_param_persistence_threshold) until closed.
        self.persistent = persistent
        # A gathered copy some of whose shards changed behind it (a local setter): gathered again at next use.
        self.stale = False
        # zero_optimization.enable_sanity_checks: an in-place edit inside GatheredParameters without a modifier
        # rank raises (zero3.partition.gathered), where it is otherwise discarded with a warning.
        self.sanity_checks = False
        self.shard_numel = sum(sp.shard_numel for sp in params)
        self.numel = sum(sp.numel for sp in params)
        self.state = UnitState.SHARDED
        self.lp_slot: Slot | None = None
        self._pending: PendingGather | None = None
        self.unsharded: torch.Tensor | None = None
        # Who needs the gathered values now (see `holds`).
        self._forward_holds = 0
        self._pins = 0
        self._backward_held = False
        self._shard_numels = [sp.shard_numel for sp in params]  # the gather's copy-out layout
        self._driver: UnitDriver | None = None  # the runtime driving the gathers, while one does
        # Where the shard comes from when it does not live on the device (None: the lp slot's view).
        self.source: ShardSource | None = None
        # This rank's shard, brought in ahead of the gather that sends it (`prepare_gather`).
        self._prepared: torch.Tensor | None = None
        # hpZ's secondary shards, where the engine keeps them (zero3.partition.secondary).
        self.secondary: SecondaryRoute | None = None
        # Whether the gathered values are the shards' own: False after a quantized gather (qwZ's codec on
        # `gather`), which only a pass's computation may read; a reader that keeps values asks for exact.
        self.exact_values = True
        for sp in params:
            sp.unit = self  # the latest unit built over a parameter is its unit

    # ---- placement -------------------------------------------------------
    def assign_lp(self, buffer: FlatBuffer, offset: int, source: ShardSource | None = None) -> None:
        """Point the unit (and each parameter) at its region of a 16-bit flat buffer, and say where its
        shard comes from for a gather when that region is not on the device (`source`)."""
        self.lp_slot = Slot(buffer, offset, self.shard_numel)
        self.source = source
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
        if self._driver is not None:
            self._driver.observe(self, old, new)

    def shards_changed(self) -> None:
        """Some of its shards were written behind a gathered copy (a local setter): gathered again at the next
        use, on every rank (the next forward agrees on it)."""
        if self.state is not UnitState.SHARDED:
            self.stale = True

    def attach(self, driver: UnitDriver) -> None:
        """Let a runtime drive the unit's gathers (told of each state change, asked to fetch)."""
        if self._driver is not None and self._driver is not driver:
            raise RuntimeError(f"unit {self.label} is already driven by another engine")
        self._driver = driver

    def detach(self) -> None:
        self._driver = None

    @property
    def driver(self) -> UnitDriver | None:
        """The runtime driving the unit's gathers, while one does."""
        return self._driver

    def fetch(self, exact: bool = False) -> None:
        """Start bringing the unit in (the runtime's way, if it drives the gathers); `wait` completes it.
        `exact`: the values must be the shards' own, never a quantized gather's, where the runtime can
        gather them so (between passes: see `GatherUnit.exact_values`)."""
        if self._driver is not None:
            self._driver.fetch(self, exact)
        else:
            self.start_unshard(async_op=True, exact=exact)

    def gathers_directly(self) -> bool:
        """Whether `fetch` now starts the unit's own all-gather (no runtime, or between its passes)."""
        return self._driver is None or self._driver.gathers_directly()

    def will_gather(self, exact: bool = False) -> bool:
        """Whether `start_unshard(exact=exact)` would issue an all-gather now."""
        stale_values = exact and self.state is UnitState.UNSHARDED and not self.exact_values
        return (self.state is UnitState.SHARDED or stale_values) and not self.gathers_in_place

    def prepare_gather(self, exact: bool = False) -> None:
        """Bring this rank's shard in now (a tier's read from host memory or disk: the local part of a
        gather, which can fail on one rank alone), so the gather `start_unshard` issues next sends it."""
        if self.will_gather(exact) and self._prepared is None:
            self._prepared = self.local_shard()

    def drop_prepared(self) -> None:
        """Let go of a shard `prepare_gather` brought in and no gather sent."""
        self._prepared = None

    def start_unshard(self, async_op: bool, exact: bool = False) -> None:
        """Issue the all-gather (SHARDED -> INFLIGHT). No-op unless SHARDED; gathered with quantized values
        (qwZ), an `exact` one gathers again, exactly."""
        if exact and self.state is UnitState.UNSHARDED and not self.exact_values:
            self.reshard()
        if self.state is not UnitState.SHARDED:
            self._prepared = None
            return
        if self.gathers_in_place:
            assert self.lp_slot is not None, f"unit {self.label} has no shard storage"
            self._pending = PendingGather(self.lp_slot.view(), None)
        elif not self.gather.mesh.sharded and self.source is not None and self.source.hands_over_fresh:
            self._pending = PendingGather(self.local_shard(), None)  # (a fresh shard is the whole value)
        elif exact and self.gather.codec is not None:
            self._pending = self.gather.exact().start(self.local_shard())
        else:
            self._pending = self.start_gather()
        self._prepared = None  # (sent, or not needed: hpZ's gather from the secondary shards)
        self.exact_values = exact or self.gather.codec is None
        self._set_state(UnitState.INFLIGHT)
        if not async_op:
            self.wait()

    def start_gather(self) -> PendingGather:
        """This rank's part in the unit's all-gather, whoever reads the result: the unit's own gather,
        or the lockstep walk's spare one for a unit another rank needs (the same collective). Under hpZ,
        from the secondary shards on the node where the ranks agree they hold the unit, else from the
        primary shards, keeping this rank's secondary shard while a forward records."""
        secondary = self.secondary
        if secondary is None:
            return self.gather.start(self.local_shard())
        pending = secondary.start_gather(self)
        if pending is None:
            pending = self.gather.start(self.local_shard())
            pending.on_complete = secondary.recorder(self)
        return pending

    def stand_in_nbytes(self) -> int:
        """Bytes of reserve `start_stand_in` may use for this unit."""
        need = self.gather.stand_in_nbytes(self.shard_numel, self.dtype)
        return max(need, self.secondary.stand_in_nbytes(self)) if self.secondary is not None else need

    def start_stand_in(self, reserve: torch.Tensor) -> PendingGather:
        """This rank's part in the all-gather `start_gather` would issue now, for a pass this rank failed:
        the same collective (group, codec, sizes), with zeros sent and the result landing in `reserve`,
        so nothing is read from a tier and nothing allocated (zero3.passes.gather_walk's Note). The
        unit's state is left as it is."""
        secondary = self.secondary
        if secondary is not None and secondary.usable(self):
            return secondary.start_stand_in(self, reserve)
        return self.gather.start_stand_in(self.shard_numel, self.dtype, reserve)

    def wait(self) -> None:
        """Complete an in-flight all-gather (INFLIGHT -> UNSHARDED)."""
        if self.state is not UnitState.INFLIGHT:
            return
        pending, self._pending = self._pending, None
        assert pending is not None
        self.unsharded = self.gather.copy_out(pending.wait(), self._shard_numels)
        cursor = 0
        for sp in self.params:
            sp.set_full(self.unsharded[cursor : cursor + sp.numel].view(sp.shape))
            cursor += sp.padded_numel
        self._set_state(UnitState.UNSHARDED)

    def local_shard(self) -> torch.Tensor:
        """This rank's shard on the unit's device, ready to all-gather (the one `prepare_gather` brought in,
        if it did)."""
        if self._prepared is not None:
            return self._prepared
        if self.source is not None:
            return self.source.acquire(self)
        assert self.lp_slot is not None, f"unit {self.label} has no shard storage"
        return self.lp_slot.view()

    def unshard(self) -> None:
        self.start_unshard(async_op=False)
        self.wait()

    def reshard(self) -> None:
        """Drop the gathered values (-> SHARDED). An in-flight gather's collective is completed first (every
        rank issued it), its values dropped without being laid out (nothing allocated)."""
        self.stale = False  # (what was gathered is dropped: the next gather reads every shard as it is)
        if self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.INFLIGHT:
            pending, self._pending = self._pending, None
            assert pending is not None
            pending.wait()
        self._set_state(UnitState.SHARDED)
        for sp in self.params:
            sp.set_released()
        self.unsharded = None
        Communicator.forget_released()  # the gather's aliases would keep the freed storage otherwise

    # ---- holds -------------------------------------------------------------
    def acquire(self, hold: Hold) -> None:
        """Record a reason to keep the unit gathered (gathering it is `fetch`/`wait`'s job)."""
        self._set_holds(hold, 1 if hold is Hold.BACKWARD else self.holds(hold) + 1)

    def release(self, hold: Hold) -> None:
        """Drop one such reason; with none left, the gathered values are dropped."""
        count = self.holds(hold)
        if count == 0:
            raise RuntimeError(f"unit {self.label}: released a {hold.value} hold it does not have")
        self._set_holds(hold, count - 1)
        self.release_if_unneeded()

    def release_all(self, hold: Hold) -> None:
        """Drop every hold of this kind (a pass that ended, or was abandoned by an exception)."""
        self._set_holds(hold, 0)
        self.release_if_unneeded()

    def holds(self, hold: Hold) -> int:
        if hold is Hold.FORWARD:
            return self._forward_holds
        return self._pins if hold is Hold.PIN else int(self._backward_held)

    def _set_holds(self, hold: Hold, count: int) -> None:
        # Plain attributes, not a dict keyed by the enum: this runs in every module hook.
        if hold is Hold.FORWARD:
            self._forward_holds = count
        elif hold is Hold.PIN:
            self._pins = count
        else:
            self._backward_held = count > 0

    @property
    def needed(self) -> bool:
        return self.persistent or self._forward_holds > 0 or self._pins > 0 or self._backward_held

    def release_if_unneeded(self) -> None:
        if not self.needed:
            self.reshard()

    def close(self) -> None:
        """Drop every hold and the gathered values, persistent or not, and let go of the parameters
        (the engine is being destroyed)."""
        self.persistent = False
        for hold in Hold:
            self._set_holds(hold, 0)
        self.reshard()
        for sp in self.params:
            if sp.unit is self:
                sp.unit = None

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
        return not self.gather.mesh.sharded and self.source is None

    def unsharded_nbytes(self) -> int:
        """Memory the gathered values take beyond the shard (none when they are the shard)."""
        if self.unsharded is None or self.gathers_in_place:
            return 0
        return self.unsharded.numel() * self.unsharded.element_size()

    def __repr__(self) -> str:
        return f"GatherUnit({self.label}, params={len(self.params)}, state={self.state.name})"
