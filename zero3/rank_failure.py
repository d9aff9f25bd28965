"""One rank's failure, told to every rank (issue: "One rank's failure is every rank's").

A rank that fails alone (its batch, its memory, its disk) must not leave the
others waiting in a collective it will never make, or stepping while it does
not. So wherever a rank can fail alone, the ranks agree on a flag at a point
they all reach:
* a pass (forward, backward): its last marker already carries a flag per rank
  (zero3.passes.gather_walk); a rank that raised sets its flag, after still
  walking the pass to its end with the others;
* the step: its gradient flags, and one flag round after its walk
  (zero3.step.step_plan's [Note: a step on every rank or on none]);
* calls between steps (initialize's checks, offload and reload, checkpoint
  loads): one exchange of what each rank saw (`agreed`);
* a failure in the user's code between the engine's calls (one rank's data,
  a check on its loss): `engine.zero_grad()` makes that rank's part of the
  call the others are in, as a rank that failed (zero3.engine.engine's
  [Note: a failure between the engine's calls]).
If any flag is set, every rank exchanges what happened, and each rank that did
not fail raises the failing rank's exception type with "rank R failed in
<where>: ..." so that the same `except` clause runs on every rank and
`engine.zero_grad()` is called everywhere. The failing rank's own exception
propagates unchanged. An engine's parts make these agreements through its one
step protocol (zero3.step_protocol), which uses the functions here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from zero3.comm import Communicator


class RankFailedError(RuntimeError):
    """Another rank failed, with an exception that cannot be rebuilt here under its own type."""


# Attributes an exception carries beyond its message that its constructor takes back (StepIOError's).
_FIELDS = ("step_applied",)


def describe(failure: BaseException | None) -> tuple[str, str, str, dict[str, Any]] | None:
    if failure is None:
        return None
    cls = type(failure)
    fields = {name: getattr(failure, name) for name in _FIELDS if hasattr(failure, name)}
    return cls.__module__, cls.__qualname__, f"{cls.__name__}: {failure}", fields


@dataclass(frozen=True)
class Scope:
    """The ranks an agreement spans: a gloo group (None: the communicator's control group, the whole job)
    and the job rank of each member, in the group's order (so that a failure names the job's rank)."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]

    @classmethod
    def job(cls, comm: Communicator) -> Scope:
        return cls(None, tuple(range(comm.job_size)))

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> Scope:
        return cls(group, tuple(dist.get_process_group_ranks(group)))


def peer_failure(
    comm: Communicator, scope: Scope, where: str, own: BaseException | None, consequence: str = "",
) -> BaseException | None:
    """Collective on `scope`: every rank's failure is exchanged. On a rank that did not fail, the first
    failing rank's, rebuilt ("rank R failed in <where>: ..." and `consequence`); None on a rank that failed."""
    everyone = comm.all_gather_objects(describe(own), scope.group)
    if own is not None:
        return None  # this rank's own exception is already on its way
    return first_failure(everyone, where, consequence, scope.ranks)


def first_failure(
    everyone: list[tuple[str, str, str, dict[str, Any]] | None], where: str, consequence: str = "",
    ranks: tuple[int, ...] | None = None,
) -> BaseException | None:
    """From every rank's `describe()`, gathered: the first failing rank's exception, rebuilt (naming its job
    rank: `ranks[i]` for the i-th gathered, where the exchange spanned a group of the job)."""
    for index, found in enumerate(everyone):
        if found is not None:
            module, qualname, text, fields = found
            rank = ranks[index] if ranks is not None else index
            return rebuild(module, qualname, f"rank {rank} failed in {where}: {text}{consequence}", fields)
    return None


def raise_peer_failure(comm: Communicator, scope: Scope, where: str, own: BaseException | None,
                       consequence: str = "") -> None:
    """Collective: a rank that did not fail raises the first failing rank's exception (see `peer_failure`)."""
    error = peer_failure(comm, scope, where, own, consequence)
    if error is not None:
        raise error


def raise_agreed_failure(comm: Communicator, scope: Scope, where: str, own: BaseException | None,
                         consequence: str = "") -> None:
    """Collective, once the ranks have agreed that one failed: every rank raises, its own or the first."""
    raise_peer_failure(comm, scope, where, own, consequence)
    if own is not None:
        raise own
    raise RankFailedError(f"a rank failed in {where}{consequence}")  # the flags said so; none described it


T = TypeVar("T")


def agreed(
    comm: Communicator, scope: Scope, where: str, action: Callable[[], T], consequence: str = "",
    undo: Callable[[], None] | None = None,
) -> T:
    """Collective: run `action` on every rank; if it raises on any, every rank raises (one exchange of
    what each rank saw, on `scope`: for calls between steps, not for the hot path). A rank
    whose `action` succeeded runs `undo` first, if given."""
    own: Exception | None = None
    result: Any = None
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - every rank raises it, below
        own = error
    everyone = comm.all_gather_objects(describe(own), scope.group)
    if own is not None:
        raise own
    peer = first_failure(everyone, where, consequence, scope.ranks)
    if peer is not None:
        if undo is not None:
            undo()
        raise peer
    return result


def rebuild(module: str, qualname: str, message: str, fields: dict[str, Any] | None = None) -> BaseException:
    """The failing rank's exception type with `message` (RankFailedError when it cannot be built)."""
    found: Any = None
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        found = None
    if isinstance(found, type) and issubclass(found, Exception):
        for kwargs in ([fields] if fields else []) + [{}]:
            try:
                error = found(message, **kwargs)
                if str(error) == message:
                    return error
            except Exception:  # noqa: BLE001 - a type whose constructor wants other arguments
                pass
    return RankFailedError(message)
