"""Copies between the device and host memory, and the pool of reusable host buffers.

[Note: host copies]
With `pin_memory`, each buffer's page-locked host tensor is made once and
reused on every later cycle (pinning is slow and fragments host memory). A
non-blocking device-to-host copy (`copy_to_host`, used by parking and by
ZeRO-Offload's gradients) runs on a side stream that first waits for the
current stream, marks the source's memory as used by the side stream
(`record_stream`), and returns an event; on the CPU it is a plain copy. A
parked buffer's first reader runs its completion: a host read waits for the
copy's event, a device read makes the compute stream wait for the
host-to-device copy's.

[Note: pinning ahead]
Page-locking host memory is slow (seconds per GiB: the pages are faulted in
and pinned), so the first `offload_states` of a large model would spend most of
its time allocating. `engine.pin_offload_buffers()` makes those buffers in a
background thread while training goes on: the pool's `reserve`. Only a `get`
of a key still being made waits for the thread; other keys (the tiers'
windows, checkpoint staging) are served at once. Pinning ahead is best effort:
if it fails (host memory runs out), the error is logged and the buffers it did
not make are made on demand, as without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from zero3 import accelerator

log = logging.getLogger("zero3")


def copy_to_host(
    source: torch.Tensor, host: torch.Tensor, stream: "torch.cuda.Stream | None", record_source: bool = True
) -> "torch.cuda.Event | None":
    """Copy `source` into `host` (a host tensor of its shape, pinned for an overlapped copy).

    With a side `stream`: the stream waits for the current one (the copy goes behind the work that
    made `source`), copies non-blocking, and, with `record_source`, marks `source`'s memory as used
    by it; returns the event that marks the copy's arrival. Without one (the CPU, or a blocking
    copy): a plain copy, done on return, and None.
    """
    if stream is None:
        host.copy_(source)
        return None
    stream.wait_stream(torch.cuda.current_stream(source.device))
    with torch.cuda.stream(stream):
        host.copy_(source, non_blocking=True)
        if record_source:
            source.record_stream(stream)
        copied = torch.cuda.Event()
        copied.record(stream)
    return copied


class HostBufferPool:
    """The one pool of reusable host buffers: parked states' pinned copies and the tiers' windows.

    A buffer is kept under its key and handed out again while its size and
    dtype still fit; pinned (page-locked) beside a CUDA device when asked,
    ordinary memory elsewhere (pinning is meaningless without CUDA).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # the reserving thread adds buffers while the owner reads them
        self._reserving: threading.Thread | None = None
        self._pending: set[str] = set()  # keys the reserving thread has yet to make

    def _fits(self, key: str, numel: int, dtype: torch.dtype, pin: bool) -> bool:
        held = self.buffers.get(key)
        return held is not None and held.numel() >= numel and held.dtype == dtype and held.is_pinned() == pin

    def get(self, key: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        pin = pin and accelerator.supports_pinned_memory(self.device)
        with self._lock:
            pending = key in self._pending
        if pending:
            self.settle()  # being made in the background (see [Note: pinning ahead])
        with self._lock:
            if not self._fits(key, numel, dtype, pin):
                self.buffers.pop(key, None)  # the old one goes before the new one is made
                self.buffers[key] = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
            return self.buffers[key][:numel]

    def reserve(self, wanted: list[tuple[str, int, torch.dtype]], pin: bool = True) -> int:
        """Make the buffers `wanted` (key, elements, dtype) in a background thread; returns how many
        it will make (those not held already). See [Note: pinning ahead]."""
        pin = pin and accelerator.supports_pinned_memory(self.device)
        self.settle()  # one reservation at a time
        with self._lock:
            missing = [(key, numel, dtype) for key, numel, dtype in wanted if not self._fits(key, numel, dtype, pin)]
            self._pending = {key for key, _, _ in missing}
        if not missing:
            return 0
        self._reserving = threading.Thread(
            target=self._make, args=(missing, pin), name="zero3-pin-ahead", daemon=True
        )
        self._reserving.start()
        return len(missing)

    def _make(self, wanted: list[tuple[str, int, torch.dtype]], pin: bool) -> None:
        for key, numel, dtype in wanted:
            try:
                made = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
            except Exception as error:  # host memory exhausted, say: the rest is made on demand
                log.warning("pin_offload_buffers: making %s (%d x %s) failed (%s); it and the buffers after it "
                            "are made when offload_states needs them", key, numel, dtype, error)
                break
            with self._lock:
                self.buffers.pop(key, None)
                self.buffers[key] = made
                self._pending.discard(key)
        with self._lock:
            self._pending.clear()

    @property
    def reserving(self) -> bool:
        """Whether a background reservation is still making buffers."""
        return self._reserving is not None and self._reserving.is_alive()

    def settle(self) -> None:
        """Wait for a background reservation to end."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def drop(self, prefix: str) -> None:
        with self._lock:
            for key in [key for key in self.buffers if key.startswith(prefix)]:
                del self.buffers[key]

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The buffers held now (a copy of the mapping: the reserving thread may be adding to it)."""
        with self._lock:
            return dict(self.buffers)

    @property
    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshot().values() if t.is_pinned())

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshot().values())

    def clear(self) -> None:
        self.settle()
        with self._lock:
            self.buffers.clear()


class HostCopier:
    """Copies parked states between the device and host memory (see [Note: host copies])."""

    def __init__(self, device: torch.device, pool: HostBufferPool) -> None:
        self.device = device
        self.pool = pool
        self._stream = accelerator.copy_stream(device)

    @property
    def pinned(self) -> dict[str, torch.Tensor]:
        """The page-locked copies kept for reuse across offload cycles."""
        return {key: t for key, t in self.pool.snapshot().items() if key.startswith("park:") and t.is_pinned()}

    def _host_tensor(self, name: str, like: torch.Tensor, pin: bool) -> torch.Tensor:
        if not (pin and accelerator.supports_pinned_memory(self.device)):
            return torch.empty(like.shape, dtype=like.dtype, device="cpu")
        return self.pool.get(self.key(name), like.numel(), like.dtype, pin=True).view(like.shape)

    @staticmethod
    def key(name: str) -> str:
        """The pool key of a parked buffer's page-locked copy."""
        return f"park:{name}"

    def reserve(self, buffers: list[tuple[str, int, torch.dtype]]) -> int:
        """Page-lock, in the background, the host copies that parking these buffers (name, elements,
        dtype) will use; returns how many are being made. None on the CPU: nothing is pinned there."""
        if not accelerator.supports_pinned_memory(self.device):
            return 0
        return self.pool.reserve([(self.key(name), numel, dtype) for name, numel, dtype in buffers])

    def to_host(
        self, name: str, source: torch.Tensor, pin: bool, non_blocking: bool
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """A host copy of a device tensor, and the completion a reader must run (None if done)."""
        host = self._host_tensor(name, source, pin)
        copied = copy_to_host(source, host, self._stream if non_blocking else None)
        return host, copied.synchronize if copied is not None else None

    def to_device(self, host: torch.Tensor, non_blocking: bool) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """A device copy of a host tensor, and the completion a reader must run (None if done)."""
        target = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        if not non_blocking or self._stream is None:
            target.copy_(host)
            return target, None
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            target.copy_(host, non_blocking=True)
            target.record_stream(self._stream)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return target, lambda: compute.wait_event(copied)

    @property
    def pinned_bytes(self) -> int:
        return self.pool.pinned_bytes
