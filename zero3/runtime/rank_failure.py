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


def describe(failure: BaseException | None) -> tuple[str, str, str] | None:
    if failure is None:
        return None
    cls = type(failure)
    return cls.__module__, cls.__qualname__, f"{cls.__name__}: {failure}"


def raise_peer_failure(comm: Communicator, where: str, own: BaseException | None) -> None:
    """Collective: every rank's failure is exchanged; a rank that did not fail raises the first one."""
    everyone = comm.all_gather_objects(describe(own))
    if own is not None:
        return  # this rank's own exception is already on its way
    for rank, found in enumerate(everyone):
        if found is not None:
            module, qualname, text = found
            raise rebuild(module, qualname, f"rank {rank} failed in {where}: {text}")


def rebuild(module: str, qualname: str, message: str) -> BaseException:
    """The failing rank's exception type with `message` (RankFailedError when it cannot be built)."""
    found: Any = None
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        found = None
    if isinstance(found, type) and issubclass(found, Exception):
        try:
            error = found(message)
            if str(error) == message:
                return error
        except Exception:  # noqa: BLE001 - a type whose constructor wants other arguments
            pass
    return RankFailedError(message)
