"""A process that leaves with an error leaves now, not after its collectives' timeout.

[Note: leaving after an error]
A rank whose peer died (or that failed itself) leaves with an exception while collectives may still be in
flight: a gradient reduction a helper thread watches, a gather a peer will never pair. Two things in the
interpreter's shutdown wait on them:

1. it joins every non-daemon thread: zero3's helper threads are daemon ones (zero3.helper_threads);
2. it then frees the modules, and with them the process groups: a gloo group's destructor waits for every
   collective it has queued or running, and gloo cannot abort one (`ProcessGroup.abort()` leaves a running
   gloo collective as it is). With torch's default timeout of 30 minutes, a survivor of a lost node waited
   that long before torchrun saw it fail, and its peers on the same node waited on it.

So when the main script ends with an unhandled exception (the interpreter has then set `sys.last_value`),
this module's exit hook takes one more reference to every process group, so none of them is torn down:
the operating system closes their sockets as the process ends, which also ends the peers' waits. A normal
exit is left as it is (every group torn down, as `tests/test_exit.py` requires). Process groups live in
torch's `distributed_c10d` registry, which has no public listing; where it is missing only the default
group is kept.
"""

from __future__ import annotations

import atexit
import ctypes
import sys
from typing import Any

import torch.distributed as dist


def leaving_after_an_error() -> bool:
    """Whether the main script has ended with an unhandled exception (from an exit hook)."""
    return getattr(sys, "last_value", None) is not None


def _process_groups() -> list[Any]:
    if not dist.is_available() or not dist.is_initialized():
        return []
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if isinstance(registry, dict):
        return list(registry)
    return [dist.group.WORLD]


@atexit.register
def _keep_groups_after_an_error() -> None:
    if not leaving_after_an_error():
        return
    for group in _process_groups():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never released: its destructor never runs
