"""The step's protocol: the collective each rank owes the others next, and the engine's agreements.

[Note: the step protocol]
A step is a sequence of collective calls that every rank makes in one order:
the forward (its walk ends at a marker carrying each rank's failure flag:
zero3.runtime.gather_walk), the backward (likewise), the step (its two flag
rounds: zero3.runtime.optimizer's [Note: a step on every rank or on none]),
and the calls between steps (offload, reload, saves, loads), each of which
agrees once on what every rank saw. `StepProtocol` is the engine's one
account of where it stands in that sequence:
* `begin()` and `returned(owed)` bracket each engine call. `owed` is the
  collective the other ranks are in next, should this rank fail before its
  next call (in its data, its loss, its own code between the calls);
* `join_as_failed(failure)` makes that collective as a rank that failed (an
  empty forward pass, a backward that ends at once, the step's flags), so the
  others raise `failure` too: the one way a rank joins a collective as failed;
* `agree(where, action)` runs a call between steps on every rank and raises
  on every rank if it raised on any (zero3.rank_failure's `agreed`).
A fault-tolerance manager hooks in here: its quorum before the forward of a
step's first micro-step (`begin` with `owed` FORWARD after a step), its
commit decision with the step's second flag round.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TypeVar

from zero3.comm import Communicator
from zero3.rank_failure import agreed
from zero3.runtime.coordinator import ParamCoordinator
from zero3.runtime.grad_hooks import BackwardPass
from zero3.runtime.optimizer import ZeroOptimizer

T = TypeVar("T")


class Owed(enum.Enum):
    """The collective the other ranks are in next, after this rank's last engine call returned."""

    FORWARD = "forward"  # the next forward's gathers
    BACKWARD = "backward"  # the backward of the forward that returned
    STEP = "step"  # the step's flag rounds, at the accumulation boundary


class StepProtocol:
    """Where this rank stands in the step's sequence of collective calls (see the Note)."""

    def __init__(self, comm: Communicator, coordinator: ParamCoordinator, backward: BackwardPass,
                 optimizer: ZeroOptimizer | None) -> None:
        self.comm = comm
        self.coordinator = coordinator
        self.backward = backward
        self.optimizer = optimizer
        self.owed: Owed | None = Owed.FORWARD

    def begin(self) -> None:
        """An engine call begins: from here on, what this rank owes is that call itself."""
        self.owed = None

    def returned(self, owed: Owed) -> None:
        """An engine call returned; `owed` is the collective the others make next."""
        self.owed = owed

    def join_as_failed(self, failure: BaseException) -> None:
        """Make the owed collective as a rank that failed (the others raise `failure`); nothing is owed
        after it. A rank whose call failed with the others owes nothing: that call began and never
        returned."""
        owed, self.owed = self.owed, Owed.FORWARD
        if owed is Owed.FORWARD:
            self.coordinator.join_forward_as_failed(failure)
        elif owed is Owed.BACKWARD:
            self.backward.begin()
            self.backward.finish(failure)
        elif owed is Owed.STEP and self.optimizer is not None:
            self.optimizer.join_as_failed(failure)

    def agree(self, where: str, action: Callable[[], T], consequence: str = "",
              undo: Callable[[], None] | None = None) -> T:
        """`action` on every rank; if it raised on any, every rank raises (a rank where it succeeded runs
        `undo` first): one exchange on the job's control group."""
        return agreed(self.comm, where, action, consequence, undo)
