"""`wall_clock_breakdown`: how long forward, backward and the optimizer step take."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zero3 import accelerator


class StepTimers:
    """Wall time per phase, averaged over the calls since the last `report()`.

    On CUDA each timed phase is bracketed by a device synchronize, so the
    figures are the device's time, not the launch time (as DeepSpeed's
    timers); that costs overlap, which is why it is off unless asked for.
    """

    PHASES = ("forward", "backward", "step")

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled
        self._total = dict.fromkeys(self.PHASES, 0.0)
        self._calls = dict.fromkeys(self.PHASES, 0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        accelerator.synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            accelerator.synchronize(self.device)
            self._total[name] += time.perf_counter() - start
            self._calls[name] += 1

    def report(self) -> str:
        """'forward 12.31 ms | backward 30.02 ms | step 4.10 ms' (means since the last report), then reset."""
        parts = [
            f"{name} {1000 * self._total[name] / self._calls[name]:.2f} ms"
            for name in self.PHASES
            if self._calls[name]
        ]
        self._total = dict.fromkeys(self.PHASES, 0.0)
        self._calls = dict.fromkeys(self.PHASES, 0)
        return " | ".join(parts)
