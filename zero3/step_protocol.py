"""The step's protocol: the collective each rank owes next, and every agreement of a step and between steps.

[Note: the step protocol]
A step is a sequence of collective calls that every rank makes in one order:
the forward (its walk ends at a marker carrying each rank's failure flag:
zero3.passes.gather_walk), the backward (likewise), the step (its flag
rounds: zero3.step.step_plan's [Note: a step on every rank or on none]),
and the calls between steps (offload, reload, saves, GatheredParameters),
each of which agrees on what every rank saw. One `StepProtocol` per engine
is where all of it is decided; the parts that reach an agreement point (the
coordinator at a pass's end, the backward, the optimizer's step, the 16-bit
repair, GatheredParameters) ask it, never the communicator:
* `begin()` and `returned(owed)` bracket each engine call. `owed` is the
  collective the other ranks are in next, should this rank fail before its
  next call (in its data, its loss, its own code between the calls);
  `join_as_failed(failure)` makes that collective as a rank that failed (an
  empty forward pass, a backward that ends at once, the step's flags), so the
  others raise `failure` too: the one way a rank joins a collective as failed;
* `flags(...)`: one round of host flags (set on any rank?);
  `fail_together(where, own)`: once the flags said a rank failed, every rank
  raises (that rank its own exception, the others one naming it);
  `raise_together(where, own)`: the two together, for one failure flag;
  `peer_failure` / `raise_if_peer_failed`: the exchange alone, where a pass's
  marker already carried the flags;
* `agree(where, action)`: a call between steps run on every rank, raised on
  every rank if it raised on any; `outcomes` (each rank's failure beside what
  it found, in one message) and `problems` (a line per rank that met one) for
  the calls that decide more than whether to raise: a checkpoint's save and
  load, the tiers' checks of free space. A save run in the background agrees
  on a group of its own (`group`), off the training thread's.
Every agreement runs on the protocol's `scope` (zero3.rank_failure's
`Scope`): by default the job's control group (`comm.control_group`), so a
failure anywhere is every rank's. This is the seam a fault-tolerance manager
hooks into: its quorum before the forward of a step's first micro-step, its
commit decision with the step's last flag round, and agreements scoped to
one replica group (a protocol made with that group's `Scope.of(group)`),
whose failures its members agree on alone and name by their job ranks,
while the other replica groups go on.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar

from zero3.comm import Communicator
from zero3.rank_failure import (
    Scope, agreed, describe, first_failure, peer_failure, raise_agreed_failure, raise_peer_failure,
)

T = TypeVar("T")


class Owed(enum.Enum):
    """The collective the other ranks are in next, after this rank's last engine call returned."""

    FORWARD = "forward"  # the next forward's gathers
    BACKWARD = "backward"  # the backward of the forward that returned
    STEP = "step"  # the step's flag rounds, at the accumulation boundary


class TrainingState(enum.Enum):
    """Where this rank is inside an engine call: which pass is under way (the coordinator moves it).

    The nested states exist because real models nest passes: activation
    checkpointing runs a forward inside backward, and a gradient penalty
    (`torch.autograd.grad` in a forward) runs a backward inside forward.
    """

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD = enum.auto()
    FORWARD_IN_BACKWARD = enum.auto()
    BACKWARD_IN_FORWARD = enum.auto()


class StepProtocol:
    """Where this rank stands in the step's collective calls, and every agreement they make (see the Note)."""

    def __init__(self, comm: Communicator, scope: Scope | None = None) -> None:
        self.comm = comm
        # The ranks every agreement spans: the whole job, or one replica group's (a fault-tolerance manager's).
        self.scope = scope if scope is not None else Scope.job(comm)
        self.owed: Owed | None = Owed.FORWARD  # between engine calls
        self.state = TrainingState.IDLE  # within one: the pass under way
        self._joins: dict[Owed, Callable[[BaseException], None]] = {}

    @property
    def in_forward(self) -> bool:
        # Identity tests: an enum's hash is a Python call, and this is read on every saved tensor.
        state = self.state
        return state is not TrainingState.IDLE and state is not TrainingState.BACKWARD

    @property
    def in_backward(self) -> bool:
        state = self.state
        return state is not TrainingState.IDLE and state is not TrainingState.FORWARD

    # ---- what this rank owes ------------------------------------------------------------
    def bind(self, owed: Owed, join: Callable[[BaseException], None]) -> None:
        """How this rank makes the `owed` collective as a rank that failed (the part that runs it binds it)."""
        self._joins[owed] = join

    def close(self) -> None:
        """Forget the joins (the engine is being destroyed: they hold its parts)."""
        self._joins.clear()

    def begin(self) -> None:
        """An engine call begins: from here on, what this rank owes is that call itself."""
        self.owed = None

    def returned(self, owed: Owed) -> None:
        """An engine call returned; `owed` is the collective the others make next."""
        self.owed = owed

    def join_as_failed(self, failure: BaseException) -> None:
        """Make the owed collective as a rank that failed (the others raise `failure`); afterwards this rank
        owes the next forward. A rank whose call failed with the others owes nothing: that call began and
        never returned."""
        owed, self.owed = self.owed, Owed.FORWARD
        join = self._joins.get(owed) if owed is not None else None
        if join is not None:
            join(failure)

    # ---- agreements -----------------------------------------------------------------------
    def flags(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether any rank set it (one host all-reduce on the scope's group)."""
        return self.comm.any_of_flags(flags, self.scope.group)

    def fail_together(self, where: str, own: BaseException | None, consequence: str = "") -> None:
        """The flags said a rank failed in `where`: every rank raises (its own exception, or the first failing
        rank's, rebuilt, with `consequence`)."""
        raise_agreed_failure(self.comm, self.scope, where, own, consequence)

    def raise_together(self, where: str, own: BaseException | None, consequence: str = "",
                       undo: Callable[[], None] | None = None) -> None:
        """One failure flag: if any rank's `own` is set, every rank runs `undo` (if given) and raises."""
        if self.flags([own is not None])[0]:
            if undo is not None:
                undo()
            self.fail_together(where, own, consequence)

    def peer_failure(self, where: str, own: BaseException | None, consequence: str = "") -> BaseException | None:
        """Every rank's failure exchanged: on a rank that did not fail, the first failing rank's; else None."""
        return peer_failure(self.comm, self.scope, where, own, consequence)

    def raise_if_peer_failed(self, where: str, own: BaseException | None, consequence: str = "") -> None:
        """`peer_failure`, raised where there is one (a rank that failed goes on with its own exception)."""
        raise_peer_failure(self.comm, self.scope, where, own, consequence)

    def outcomes(self, own: BaseException | None, payload: Any = None, group: Any = None) -> list[tuple[Any, Any]]:
        """One exchange of every rank's failure (described: zero3.rank_failure's `describe`) beside its
        `payload` (what the call found, in the same message), on `group` (default: the scope's)."""
        return self.comm.all_gather_objects((describe(own), payload), group or self.scope.group)

    def exchange(self, value: Any) -> list[tuple[int, Any]]:
        """Every rank's `value` (what an agreement needs beyond its flags: the names a rank edited, the disks
        its files need), in one exchange on the scope's group: (job rank, value), in rank order."""
        return list(zip(self.scope.ranks, self.comm.all_gather_objects(value, self.scope.group)))

    def first_failure(self, where: str, outcomes: list[tuple[Any, Any]], consequence: str = "") -> BaseException | None:
        """From `outcomes`, the first failing rank's exception, rebuilt ("rank R failed in <where>: ...")."""
        return first_failure([described for described, _ in outcomes], where, consequence, self.scope.ranks)

    def problems(self, problem: str | None, group: Any = None) -> list[str]:
        """Every rank's problem, a line each (a rank that had none says None), in one exchange on `group`:
        the lines that were said, in rank order."""
        return [found for found in self.comm.all_gather_objects(problem, group or self.scope.group) if found is not None]

    def agree(self, where: str, action: Callable[[], T], consequence: str = "",
              undo: Callable[[], None] | None = None) -> T:
        """`action` on every rank; if it raised on any, every rank raises (a rank where it succeeded runs
        `undo` first): one exchange on the scope's group, for calls between steps."""
        return agreed(self.comm, self.scope, where, action, consequence, undo)
