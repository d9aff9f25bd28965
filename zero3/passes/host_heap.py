"""Handing the host heap a backward frees back to the OS while the gradient shards fill.

[Note: the heap a backward frees]
Where the device is the CPU, the activations live in host memory, mostly in
glibc's heap (it serves blocks under its adaptive mmap threshold, up to 32 MiB,
from there), and glibc keeps freed heap pages resident. A backward frees the
activations as it goes while the reduced gradient shards land in `lp_grads`,
whose pages it touches for the first time in the step (they were handed back
at the last step: zero3.accelerator.DroppableZeros). Without a hand-back the
resident set at the end of a backward is every activation the forward held
plus every gradient; FSDP2's gradients are heap blocks that reuse the freed
activations' holes, ours are a buffer of their own. So at the start of each
backward (the forward's freed temporaries) and after every HAND_BACK_EVERY_BYTES
of gradient shards landed, `malloc_trim(0)` hands the freed heap pages back
(zero3.accelerator.release_host_memory), so the freed activations go about as
fast as the gradients' pages come. A cadence in bytes, not per bucket, keeps the
cost in proportion: a small model's short backward makes one or two calls.

The price: a page handed back costs a page fault when the next forward uses
it again, most of it from the hand-back at the start of the backward (the
peak-memory and step-time effect is measured by `benchmarks/step_time.py
--memory`; docs/benchmarks.md has the figures). On CUDA the activations are in
device memory and nothing is done. Nor where the gradient shards are made on
demand (at several CPU ranks: zero3.step.grad_shards' Note "on demand on
the CPU"): those are heap blocks that reuse the freed pages, so a hand-back
would only make the next forward fault them in again. What is left is a world
of one, whose flat lp_grads the gradients are added straight into.
"""

from __future__ import annotations

import time

import torch

from zero3 import accelerator

HAND_BACK_EVERY_BYTES = 32 << 20


class FreedHeapReturn:
    """Calls `accelerator.release_host_memory` at the start of a backward and after every `every_bytes`
    of gradient shards landed in host memory, where the device is the CPU (otherwise does nothing)."""

    def __init__(self, device: torch.device, every_bytes: int = HAND_BACK_EVERY_BYTES, needed: bool = True) -> None:
        if every_bytes <= 0:
            raise ValueError(f"every_bytes must be positive, got {every_bytes}")
        self.enabled = device.type == "cpu" and needed
        self.every_bytes = every_bytes
        self._landed = 0
        self.calls = 0  # hand-backs over the engine's life, and the seconds they took (the benchmark reads them)
        self.seconds = 0.0

    def backward_begins(self) -> None:
        if self.enabled:
            self._hand_back()

    def landed(self, nbytes: int) -> None:
        """`nbytes` of gradient shards were added to host `lp_grads` (pages the step may touch first)."""
        if not self.enabled:
            return
        self._landed += nbytes
        if self._landed >= self.every_bytes:
            self._hand_back()

    def _hand_back(self) -> None:
        started = time.perf_counter()
        accelerator.release_host_memory()
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self._landed = 0
