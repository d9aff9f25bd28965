"""The walk keeper: a thread that issues a rank's gather walk while the rank's own thread is away.

See zero3.passes.gather_walk's [Note: the walk's keeper]: a model's own collective, on ranks that took
different routes, would otherwise leave a peer waiting on a gather that only the blocked rank can pair.
The keeper looks at each walk a few times a second and never waits on a collective, so it costs nothing
while the rank's thread keeps calling into the walk, and it stops with the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

from zero3.passes.gather_walk import GatherWalk

log = logging.getLogger("zero3")

TICK_S = 0.05


class WalkKeeper:
    """One daemon thread over a rank's walks (the forward's and the backward's)."""

    def __init__(self, walks: Sequence[GatherWalk], device: torch.device) -> None:
        self.walks = [walk for walk in walks if walk.lockstep]
        self.device = device  # a new thread's current CUDA device is 0: the keeper's is the rank's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.walks or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="zero3-walk-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stop.wait(TICK_S):
            for walk in self.walks:
                try:
                    walk.keep_up(time.monotonic())
                except Exception:  # noqa: BLE001 - a keeper that fails must not take the rank down
                    log.exception("zero3: the %s walk's keeper failed; it stops", walk.name)
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
