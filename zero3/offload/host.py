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
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero3 import accelerator


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

    def get(self, key: str, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        pin = pin and accelerator.supports_pinned_memory(self.device)
        held = self.buffers.get(key)
        if held is None or held.numel() < numel or held.dtype != dtype or held.is_pinned() != pin:
            self.buffers.pop(key, None)  # the old one goes before the new one is made
            held = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)
            self.buffers[key] = held
        return held[:numel]

    def drop(self, prefix: str) -> None:
        for key in [key for key in self.buffers if key.startswith(prefix)]:
            del self.buffers[key]

    @property
    def pinned_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values() if t.is_pinned())

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def clear(self) -> None:
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
        return {key: t for key, t in self.pool.buffers.items() if key.startswith("park:") and t.is_pinned()}

    def _host_tensor(self, name: str, like: torch.Tensor, pin: bool) -> torch.Tensor:
        if not (pin and accelerator.supports_pinned_memory(self.device)):
            return torch.empty(like.shape, dtype=like.dtype, device="cpu")
        return self.pool.get(f"park:{name}", like.numel(), like.dtype, pin=True).view(like.shape)

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
