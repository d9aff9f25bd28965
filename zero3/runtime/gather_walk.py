"""The lockstep gather walk: one agreed order of all-gathers per pass, walked alike by every rank.

[Note: lockstep gathers]
An all-gather is a collective: every rank must issue the same gathers in the
same order, or the job hangs (or ranks trade shards of different
parameters). Ranks that route through different modules in one step (MoE
routing, a data-dependent branch, a module skipped on one rank) each need
their own gathers, so no rank may gather just what it needs. Instead every
rank walks one agreed, cyclic sequence

    order[0], order[1], ..., MARK, rest[0], rest[1], ..., MARK, order[0], ...

`order` is the merged gather trace of the previous pass of this kind (the
same on every rank: it is computed from every rank's trace), `rest` every
other unit. A rank that needs a unit issues the sequence up to that unit's
next occurrence; the units it passes are gathered too, since another rank
may need them, and are kept (within the prefetch budget) in case this rank
needs them next. Prefetch is issuing the sequence ahead of need.

A MARK is a small all-gather of each rank's "done" flag on the control
group. A rank that has finished the pass walks on to the next MARK and reads
it; the pass ends at the first MARK that every rank reached done, so every
rank leaves the pass at the same point of the sequence. The final MARK also
carries each rank's trace, from which every rank computes the same next
`order`.

No wait can hang: all ranks issue prefixes of one sequence, and the rank
that is furthest behind waits only on entries every other rank has already
issued, while any rank that has finished keeps walking until all have.
(This holds while the engine's own gathers are the only collectives on the
group during a pass: a model that issues its own collectives from forward
must run them on every rank, as under DDP or FSDP.) When the ranks agree,
which is the usual case, the sequence is exactly the trace, as plain
prefetching would issue it, and the pass costs one MARK.

A world of one has nothing to agree on: the walk then gathers only what is
needed and prefetches along its own previous trace.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.partition.collectives import PendingGather
from zero3.topology import ShardMesh
from zero3.partition.unit import GatherUnit, UnitState

log = logging.getLogger("zero3")

MARK = -1  # a marker's place in the sequence (unit entries are indices >= 0)


class LiveCount:
    """Elements of non-persistent units that are gathered or in flight, kept up to date by the units' observer."""

    def __init__(self) -> None:
        self.numel = 0

    def observe(self, unit: GatherUnit, old: UnitState, new: UnitState) -> None:
        if unit.persistent:
            return
        if old is UnitState.SHARDED and new is not UnitState.SHARDED:
            self.numel += unit.numel
        elif new is UnitState.SHARDED and old is not UnitState.SHARDED:
            self.numel -= unit.numel


def merge_traces(traces: Sequence[Sequence[int]]) -> list[int]:
    """One sequence that holds every trace as a subsequence (so no rank has to wrap around).

    Pairwise, in rank order, with a look-ahead merge: linear time, and equal
    to the common trace when the ranks agree.
    """
    merged: list[int] = list(traces[0]) if traces else []
    for trace in traces[1:]:
        if list(trace) != merged:
            merged = _merge_two(merged, list(trace))
    return merged


def _merge_two(a: list[int], b: list[int]) -> list[int]:
    def occurrences(seq: list[int]) -> dict[int, list[int]]:
        where: dict[int, list[int]] = {}
        for position, value in enumerate(seq):
            where.setdefault(value, []).append(position)
        return where

    def distance(where: dict[int, list[int]], value: int, start: int) -> int | None:
        positions = where.get(value)
        if not positions:
            return None
        k = bisect.bisect_left(positions, start)
        return positions[k] - start if k < len(positions) else None

    in_a, in_b = occurrences(a), occurrences(b)
    out: list[int] = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            out.append(a[i])
            i += 1
            j += 1
            continue
        # Emit first the head whose partner comes sooner in the other sequence.
        b_in_a = distance(in_a, b[j], i)
        a_in_b = distance(in_b, a[i], j)
        if b_in_a is not None and (a_in_b is None or b_in_a <= a_in_b):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


class GatherWalk:
    """The gathers of one kind of pass (forward, or backward) on this rank."""

    def __init__(
        self,
        name: str,
        units: list[GatherUnit],
        comm: Communicator,
        mesh: ShardMesh,
        live: LiveCount,
        prefetch_numel: int,
        max_live_numel: int,
        extra_len: int = 0,
    ) -> None:
        self.name = name
        # Ints each rank adds to the pass's last marker (`end(extra)`): every marker has one size.
        self.extra_len = extra_len
        self.units = units
        self.comm = comm
        self.live = live
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.lockstep = mesh.sharded  # gathers are collectives only across a shard group
        self._index = {unit: i for i, unit in enumerate(units)}
        # Fixed size of a marker's trace field (longer traces are cut: the order is only a hint).
        self._trace_cap = 4 * len(units) + 16
        self.order: list[int] = []
        self.sequence: list[int] = []
        self.set_order([])
        self.passes = 0
        self._pos = 0
        self.trace: list[int] = []
        self._unclaimed: dict[GatherUnit, None] = {}  # gathered by the walk, not yet used (oldest first)
        self._unclaimed_numel = 0
        self._throwaway: deque[PendingGather] = deque()  # spare gathers: this rank's part for the others
        self._throwaway_numel = 0
        self._markers: list[tuple[torch.Tensor, dist.Work | None]] = []
        self._warned_live = False

    # ---- the agreed sequence ----------------------------------------------------
    def set_order(self, order: list[int]) -> None:
        """The expected order of this pass's gathers (identical on every rank)."""
        self.order = order
        listed = set(order)
        rest = [i for i in range(len(self.units)) if i not in listed]
        self.sequence = []
        for segment in (order, rest):
            if segment:
                self.sequence.extend(segment)
                self.sequence.append(MARK)

    def _entry(self) -> int:
        return self.sequence[self._pos % len(self.sequence)]

    # ---- a pass ---------------------------------------------------------------------
    def begin(self) -> None:
        self._pos = 0
        self.trace = []
        self._markers = []

    def fetch(self, unit: GatherUnit) -> None:
        """Make sure `unit` is gathered or in flight for this rank's use (the caller waits on it)."""
        if unit in self._unclaimed:
            self._claim(unit)
        elif unit.state is UnitState.SHARDED and unit in self._index:
            self.trace.append(self._index[unit])
            if self.lockstep and self.sequence:
                self._walk_to(unit)
            else:
                self._align_to(unit)
                self._make_room(unit.numel)
                unit.start_unshard(async_op=True)
        elif unit.state is UnitState.SHARDED:
            unit.start_unshard(async_op=True)  # not a unit of this walk (persistent)
        self._prefetch()

    def end(self, extra: Sequence[int] = ()) -> list[list[int]]:
        """Leave the pass on every rank at the same point; returns every rank's `extra` ints
        (`extra_len` of them, zero-filled)."""
        if len(extra) > self.extra_len:
            raise ValueError(f"the {self.name} walk carries {self.extra_len} extra ints, got {len(extra)}")
        extra = list(extra) + [0] * (self.extra_len - len(extra))
        extras: list[list[int]] = [extra]
        if self.lockstep:
            extras = self._drain(extra)
        else:
            self.set_order(self.trace[: self._trace_cap])
        self.release_unclaimed()
        self._finish_side_work()
        self.passes += 1
        return extras

    def release_unclaimed(self) -> None:
        while self._unclaimed:
            self._release_oldest()

    # ---- walking --------------------------------------------------------------------
    def _walk_to(self, unit: GatherUnit) -> None:
        target = self._index[unit]
        while True:
            entry = self._entry()
            self._pos += 1
            if entry == MARK:
                self._issue_marker(done=False, payload=[0] * self.extra_len)
            elif entry == target:
                self._make_room(unit.numel)
                unit.start_unshard(async_op=True)
                return
            else:
                self._pass(self.units[entry])

    def _align_to(self, unit: GatherUnit) -> None:
        """Without lockstep: move the prefetch position past the unit's next occurrence, if it is near."""
        if not self.sequence:
            return
        target = self._index[unit]
        for step in range(len(self.sequence)):
            if self.sequence[(self._pos + step) % len(self.sequence)] == target:
                self._pos += step + 1
                return

    def _pass(self, unit: GatherUnit) -> None:
        """Issue an entry this rank does not need now (another rank may)."""
        if unit.state is UnitState.SHARDED:
            if not self.lockstep:
                return  # nobody else waits on it
            self._make_room(unit.numel)
            self._gather_unclaimed(unit)
            while self._unclaimed_numel > self.prefetch_numel and self._unclaimed:
                self._release_oldest()
        elif self.lockstep:
            # Gathered here already (in use): still part of the collective for the others.
            spare = unit.start_gather()
            self._throwaway.append(spare)
            self._throwaway_numel += spare.output.numel()
            while self._throwaway_numel > self.prefetch_numel and self._throwaway:
                self._drop_throwaway()

    def _prefetch(self) -> None:
        """Issue the sequence ahead of need, within the prefetch and live budgets, up to the next MARK."""
        if not self.sequence:
            return
        budget = self.prefetch_numel - self._unclaimed_numel
        for _ in range(len(self.sequence)):
            entry = self._entry()
            if entry == MARK:
                return
            unit = self.units[entry]
            if unit.state is not UnitState.SHARDED:
                if self.lockstep:
                    return  # passing a gathered unit costs a throwaway gather: leave it to need
                self._pos += 1
                continue
            if unit.numel > budget or self.live.numel + unit.numel > self.max_live_numel:
                return
            self._pos += 1
            budget -= unit.numel
            self._gather_unclaimed(unit)

    def _gather_unclaimed(self, unit: GatherUnit) -> None:
        """Start a gather this rank has not asked for (yet): held by the walk until claimed."""
        unit.start_unshard(async_op=True)
        self._unclaimed[unit] = None
        self._unclaimed_numel += unit.numel

    def _claim(self, unit: GatherUnit) -> None:
        del self._unclaimed[unit]
        self._unclaimed_numel -= unit.numel
        self.trace.append(self._index[unit])

    def _release_oldest(self) -> None:
        unit = next(iter(self._unclaimed))
        del self._unclaimed[unit]
        self._unclaimed_numel -= unit.numel
        unit.wait()  # every rank issues what any rank issued (see the Note): this completes
        unit.release_if_unneeded()

    def _make_room(self, numel: int) -> None:
        """Bound every gather by max_live: release unclaimed gathers first (a needed unit is gathered anyway)."""
        while self._unclaimed and self.live.numel + numel > self.max_live_numel:
            self._release_oldest()
        if self.live.numel + numel > self.max_live_numel and not self._warned_live:
            self._warned_live = True
            log.warning(
                "stage3_max_live_parameters=%d is below what this %s pass holds at once (%d elements in use "
                "plus %d to gather); gathering anyway",
                self.max_live_numel, self.name, self.live.numel, numel,
            )

    def _drop_throwaway(self) -> None:
        spare = self._throwaway.popleft()  # the input is dropped with it, once the gather is done
        self._throwaway_numel -= spare.wait().numel()
        del spare
        self.comm.forget_released()

    # ---- markers --------------------------------------------------------------------
    def _issue_marker(self, done: bool, payload: Sequence[int]) -> tuple[torch.Tensor, dist.Work | None]:
        values = torch.zeros(2 + self._trace_cap + self.extra_len, dtype=torch.int64)
        if done:
            trace = self.trace[: self._trace_cap]
            values[0] = 1
            values[1] = len(trace)
            if trace:
                values[2 : 2 + len(trace)] = torch.tensor(trace, dtype=torch.int64)
            if payload:
                values[2 + self._trace_cap :] = torch.tensor(list(payload), dtype=torch.int64)
        marker = self.comm.all_gather_control(values)
        self._markers.append(marker)
        return marker

    def _drain(self, extra: list[int]) -> list[list[int]]:
        while True:
            while self.sequence and self._entry() != MARK:
                entry = self._entry()
                self._pos += 1
                self._pass(self.units[entry])
            self._pos += 1  # past the MARK (an empty sequence is a lone MARK)
            result, work = self._issue_marker(done=True, payload=extra)
            if work is not None:
                work.wait()
            if bool(result[:, 0].all()):
                break
        traces = [row[2 : 2 + int(row[1])].tolist() for row in result]
        self.set_order(merge_traces(traces))
        return [row[2 + self._trace_cap :].tolist() for row in result]

    def _finish_side_work(self) -> None:
        while self._throwaway:
            self._drop_throwaway()
        for _, work in self._markers:
            if work is not None:
                work.wait()
        self._markers = []
