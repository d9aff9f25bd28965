"""One rank's failure, told to every rank (issue: "One rank's failure is every rank's").

When a pass ends, its last marker already carries a flag from every rank (see
zero3.runtime.gather_walk); a rank that raised sets its flag. If any did,
every rank exchanges what happened, and each rank that did not fail raises
the failing rank's exception type with "rank R failed in forward: ..." so that
the same `except` clause runs on every rank and `engine.zero_grad()` is
called everywhere. The failing rank's own exception propagates unchanged.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def peer_failure(
    comm: Communicator, where: str, own: BaseException | None, consequence: str = ""
) -> BaseException | None:
    """Collective: every rank's failure is exchanged. On a rank that did not fail, the first failing
    rank's, rebuilt ("rank R failed in <where>: ..." and `consequence`); None on a rank that failed."""
    everyone = comm.all_gather_objects(describe(own))
    if own is not None:
        return None  # this rank's own exception is already on its way
    for rank, found in enumerate(everyone):
        if found is not None:
            module, qualname, text, fields = found
            return rebuild(module, qualname, f"rank {rank} failed in {where}: {text}{consequence}", fields)
    return None


def raise_peer_failure(comm: Communicator, where: str, own: BaseException | None, consequence: str = "") -> None:
    """Collective: a rank that did not fail raises the first failing rank's exception (see `peer_failure`)."""
    error = peer_failure(comm, where, own, consequence)
    if error is not None:
        raise error


def raise_agreed_failure(comm: Communicator, where: str, own: BaseException | None, consequence: str = "") -> None:
    """Collective, once the ranks have agreed that one failed: every rank raises, its own or the first."""
    raise_peer_failure(comm, where, own, consequence)
    if own is not None:
        raise own
    raise RankFailedError(f"a rank failed in {where}{consequence}")  # the flags said so; none described it


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
