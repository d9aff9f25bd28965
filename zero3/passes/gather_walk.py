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
When the ranks agree, which is the usual case, the sequence is exactly the
trace, as plain prefetching would issue it, and the pass costs one MARK.

[Note: the walk's keeper]
A model may run its own collective inside forward or backward (a sync
statistic, an all-reduce in an autograd function), on every rank as DDP and
FSDP require. On ranks that took different routes, that breaks the argument
above: a rank blocked in the model's all-reduce issues nothing, while a
peer waits, before its own all-reduce, on a gather further along the
sequence (often past a MARK) that only the blocked rank could pair. So each
rank keeps a keeper thread (zero3.passes.walk_keeper) that issues the
sequence on the rank's behalf while its own thread is away from the walk:
after KEEPER_IDLE_S it issues the rest of the current segment (what the
rank's own end of pass would issue anyway), and after KEEPER_CROSS_S it
issues the MARK too, with a flag that says "the keeper, not a need", and
reads it. A MARK is also marked by the rank that crossed it for a need, or
while draining; if any peer's row says so, the keeper issues the next
segment for it, and so on. It never waits on a gather (it only issues;
what it gathered is claimed or released by the rank's own thread), so it
cannot block the job; and every rank still issues a prefix of the one
sequence. A keeper's MARK says "not done", so a pass it crossed into ends
one MARK later: the price of a model's collective meeting different routes,
paid only when a rank's thread stayed away that long.

[Note: following through a failed pass]
A rank whose pass failed (its forward or backward raised, or it joins a
pass it could not start) still walks to the pass's end with the others,
issuing its part of every gather they may wait on. It does so with
stand-ins: the same collective (group, codec, sizes), zeros sent and the
result landing in one reserve buffer, reused gather after gather, so it
reads nothing from a tier and allocates nothing per gather: a failure that
repeats on every call (a device out of memory, a disk that keeps failing)
cannot fail it again before its done marker. The reserve (the largest
unit's gather, in bytes) is allocated once, at the first stand-in, after the
walk let go of every gather it held, and freed at the pass's end. The same
holds where issuing an entry fails on a rank that had not failed (a spare
gather's allocation, a tier read): a stand-in takes the entry's place, so
every rank still issues the one sequence, and the failure is this rank's:
raised to its thread, or, met by its keeper or while draining, carried in
the pass's last marker (`failure_slot`) and raised at the pass's end.

A world of one has nothing to agree on: the walk then gathers only what is
needed and prefetches along its own previous trace.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from zero3.comm import Communicator
from zero3.partition.collectives import PendingGather
from zero3.shard_mesh import ShardMesh
from zero3.partition.unit import GatherUnit, UnitState

log = logging.getLogger("zero3")

MARK = -1  # a marker's place in the sequence (unit entries are indices >= 0)
# A marker row: [done, beyond, trace length, trace..., extras...]. `beyond`: the rank crossed this MARK
# because it needs an entry further on (not a keeper's crossing: see [Note: the walk's keeper]).
DONE, BEYOND, TRACE_LEN, TRACE = 0, 1, 2, 3
KEEPER_IDLE_S = 0.5  # the rank's thread away this long: its keeper issues the rest of the segment
KEEPER_CROSS_S = 1.0  # away this long: the keeper crosses the MARK to see whether a peer needs more


class LiveCount:
    """Elements of non-persistent units that are gathered or in flight, kept up to date by the units' observer
    (from the rank's thread and its walk keeper: the count is locked)."""

    def __init__(self) -> None:
        self.numel = 0
        self._lock = threading.Lock()

    def observe(self, unit: GatherUnit, old: UnitState, new: UnitState) -> None:
        if unit.persistent:
            return
        if old is UnitState.SHARDED and new is not UnitState.SHARDED:
            with self._lock:
                self.numel += unit.numel
        elif new is UnitState.SHARDED and old is not UnitState.SHARDED:
            with self._lock:
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
        failure_slot: int | None = None,
    ) -> None:
        self.name = name
        # Which of `extra`'s ints says "this rank's pass failed" (see [Note: following through a failed pass]).
        self.failure_slot = failure_slot
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
        # The rank's thread and its keeper (see [Note: the walk's keeper]) take turns on the walk.
        self.lock = threading.RLock()
        self._draining = False  # in the pass's end (`_drain`)
        self._keeping = False  # the keeper's turn (`keep_up`)
        self.in_pass = False
        self._last_entry = time.monotonic()  # the rank's own thread's last call into the walk
        self._keeper_marker: tuple[torch.Tensor, dist.Work | None] | None = None  # a crossing not yet read
        self.keeper_gathers = 0  # entries the keeper issued (a fact for tests)
        self._warned_keeper = False
        # A pass this rank failed: the rest of its entries are stand-ins (see the Note).
        self.failing = False
        self.failure: BaseException | None = None  # what failed in the walk itself, this pass
        self._reserve: torch.Tensor | None = None
        self.stand_ins = 0  # (a fact for tests)

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
        with self.lock:
            self._pos = 0
            self.trace = []
            self._markers = []
            self._keeper_marker = None
            self._last_entry = time.monotonic()
            self.failing = False
            self.failure = None
            self.in_pass = True

    def fetch(self, unit: GatherUnit) -> None:
        """Make sure `unit` is gathered or in flight for this rank's use (the caller waits on it)."""
        with self.lock:
            self._last_entry = time.monotonic()
            if self.failure is not None:  # met by the keeper: this rank's pass has failed
                raise self.failure
            self._fetch(unit)
            self._last_entry = time.monotonic()

    def _fetch(self, unit: GatherUnit) -> None:
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
        with self.lock:
            self.in_pass = False
            self._keeper_marker = None
            return self._end(extra)

    def _end(self, extra: Sequence[int]) -> list[list[int]]:
        if len(extra) > self.extra_len:
            raise ValueError(f"the {self.name} walk carries {self.extra_len} extra ints, got {len(extra)}")
        extra = list(extra) + [0] * (self.extra_len - len(extra))
        slot = self.failure_slot
        if slot is not None and (extra[slot] or self.failure is not None):
            self.failing = True  # (see [Note: following through a failed pass])
            extra[slot] = 1
        extras: list[list[int]] = [extra]
        try:
            if self.lockstep:
                self._draining = True
                extras = self._drain(extra)
            else:
                self.set_order(self.trace[: self._trace_cap])
            self.release_unclaimed()
            self._finish_side_work()
        finally:
            self._draining = False
            if self._reserve is not None:
                self._reserve = None
                self.comm.forget_released()  # (the stand-ins' aliases would keep it otherwise)
        self.passes += 1
        return extras

    def release_unclaimed(self) -> None:
        with self.lock:
            while self._unclaimed:
                self._release_oldest()

    # ---- walking --------------------------------------------------------------------
    def _walk_to(self, unit: GatherUnit) -> None:
        target = self._index[unit]
        while True:
            entry = self._entry()
            self._pos += 1
            if entry == MARK:
                self._issue_marker(done=False, payload=[0] * self.extra_len, beyond=True)
            elif entry == target:
                self._make_room(unit.numel)
                self._issue(unit, lambda: unit.start_unshard(async_op=True))
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
        if not self.lockstep:
            return  # nobody else waits on it
        if unit.state is UnitState.SHARDED and not self.failing:
            self._make_room(unit.numel)
        self._issue_entry(unit)
        # Within the prefetch budget (each bound moves only with its own kind of entry).
        while self._unclaimed_numel > self.prefetch_numel and self._unclaimed:
            self._release_oldest()
        while self._throwaway_numel > self.prefetch_numel and self._throwaway:
            self._drop_throwaway()

    def _issue_entry(self, unit: GatherUnit) -> None:
        """This rank's part in an entry it does not need now: a gather the walk holds until claimed, or, for
        a unit gathered here already (in use), a spare gather for the others; in a failed pass, a stand-in."""
        if self.failing:
            self._stand_in(unit)
        elif unit.state is UnitState.SHARDED:
            self._gather_unclaimed(unit)
        else:
            self._issue(unit, lambda: self._spare(unit))

    def _spare(self, unit: GatherUnit) -> None:
        spare = unit.start_gather()
        self._throwaway.append(spare)
        self._throwaway_numel += spare.output.numel()

    def _issue(self, unit: GatherUnit, start: Callable[[], None]) -> None:
        """Issue one entry of the sequence with `start`; where it fails before the collective is issued (a tier
        read, an allocation), a stand-in takes its place, so this rank still issues its part, and the failure
        is this rank's pass's: raised to its own thread, kept when the keeper or the pass's end met it (see
        [Note: following through a failed pass])."""
        if self.failing:
            self._stand_in(unit)
            return
        try:
            start()
        except Exception as error:  # noqa: BLE001 - the entry is issued anyway, below; the error goes on
            if not self.lockstep:
                raise
            self.failure = self.failure or error
            self.failing = True
            self._stand_in(unit)
            if not (self._draining or self._keeping):
                raise

    def _stand_in(self, unit: GatherUnit) -> None:
        """This rank's part in `unit`'s gather, for a pass it failed: zeros sent, into the reserve, waited on."""
        if self._reserve is None:
            self.release_unclaimed()  # (their memory first: the reserve is allocated once per failed pass)
            while self._throwaway:
                self._drop_throwaway()
            needed = max(each.stand_in_nbytes() for each in self.units)
            self._reserve = torch.empty(needed, dtype=torch.uint8, device=unit.device)
        unit.start_stand_in(self._reserve).wait()
        self.stand_ins += 1

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
        self._issue(unit, lambda: unit.start_unshard(async_op=True))
        if unit.state is not UnitState.SHARDED:  # (a stand-in leaves it so: nothing to hold)
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
        # Every rank issues what any rank issued (see the Note): this completes. Unneeded, its values are
        # dropped without being laid out (GatherUnit.reshard).
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
    def _issue_marker(self, done: bool, payload: Sequence[int], beyond: bool = False
                      ) -> tuple[torch.Tensor, dist.Work | None]:
        values = torch.zeros(TRACE + self._trace_cap + self.extra_len, dtype=torch.int64)
        values[BEYOND] = int(beyond)
        if done:
            trace = self.trace[: self._trace_cap]
            values[DONE] = 1
            values[TRACE_LEN] = len(trace)
            if trace:
                values[TRACE : TRACE + len(trace)] = torch.tensor(trace, dtype=torch.int64)
            if payload:
                values[TRACE + self._trace_cap :] = torch.tensor(list(payload), dtype=torch.int64)
        marker = self.comm.all_gather_control(values)
        self._markers.append(marker)
        return marker

    def _drain(self, extra: list[int]) -> list[list[int]]:
        while True:
            while self.sequence and self._entry() != MARK:
                entry = self._entry()
                self._pos += 1
                self._pass(self.units[entry])
            if self.failure is not None and self.failure_slot is not None:
                extra[self.failure_slot] = 1  # met while draining: the marker says so
            self._pos += 1  # past the MARK (an empty sequence is a lone MARK)
            result, work = self._issue_marker(done=True, payload=extra)
            if work is not None:
                work.wait()
            if bool(result[:, DONE].all()):
                break
        traces = [row[TRACE : TRACE + int(row[TRACE_LEN])].tolist() for row in result]
        self.set_order(merge_traces(traces))
        return [row[TRACE + self._trace_cap :].tolist() for row in result]

    def _finish_side_work(self) -> None:
        while self._throwaway:
            self._drop_throwaway()
        for _, work in self._markers:
            if work is not None:
                work.wait()
        self._markers = []

    # ---- the keeper (see [Note: the walk's keeper]) --------------------------------------
    def keep_up(self, now: float) -> None:
        """The keeper's turn: issue the sequence on this rank's behalf while its thread stays away."""
        if not self.lockstep or not self.in_pass or not self.sequence:
            return
        if not self.lock.acquire(blocking=False):
            return  # the rank's own thread is in the walk
        self._keeping = True
        try:
            if not self.in_pass:
                return
            idle = now - self._last_entry
            if self._keeper_marker is not None:
                rows, work = self._keeper_marker
                if work is not None and not work.is_completed():
                    return
                self._keeper_marker = None
                if not bool((rows[:, DONE] | rows[:, BEYOND]).any()):
                    return  # every rank's thread is away too: nobody needs anything further
                self._keep_to_mark()  # a peer is past this MARK: issue what it may wait on
            elif idle >= KEEPER_IDLE_S and self._entry() != MARK:
                self._keep_to_mark()
            elif idle >= KEEPER_CROSS_S and self._entry() == MARK:
                self._pos += 1
                self._keeper_marker = self._issue_marker(done=False, payload=[0] * self.extra_len)
        finally:
            self._keeping = False
            self.lock.release()

    def _keep_to_mark(self) -> None:
        """Issue every entry up to the next MARK without waiting on any (the rank's thread claims or
        releases what was gathered; a spare gather is dropped at the pass's end), within
        stage3_max_live_parameters: the keeper never holds more than the rank may."""
        while self._entry() != MARK:
            unit = self.units[self._entry()]
            if self.live.numel + self._throwaway_numel + unit.numel > self.max_live_numel:
                if not self._warned_keeper:
                    self._warned_keeper = True
                    log.warning(
                        "zero3: the %s walk's keeper stopped at stage3_max_live_parameters=%d while this rank's "
                        "thread was away (a model's own collective?); if the job hangs there, raise it",
                        self.name, self.max_live_numel,
                    )
                return
            self._pos += 1
            self.keeper_gathers += 1
            self._issue_entry(unit)
