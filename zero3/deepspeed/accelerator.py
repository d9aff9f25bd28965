"""`deepspeed.accelerator.get_accelerator()`: the device zero3 computes on, with DeepSpeed's accelerator methods.

The device is zero3's choice (`zero3.accelerator.resolve_device`: ZERO3_ACCELERATOR or DeepSpeed's
DS_ACCELERATOR, the process group's backend, else CUDA where there is one). On the CPU, memory figures are
the process's resident memory (as DeepSpeed's CPU accelerator reports them) and streams, events and
synchronisation are no-ops with the same answers a CUDA device gives.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from zero3 import accelerator as devices

__all__ = ["Accelerator", "get_accelerator", "set_accelerator"]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Accelerator:
    """One device type's accelerator (DeepSpeed's `DeepSpeedAccelerator` methods that scripts call)."""

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"accelerator {device_type!r}: expected 'cpu' or 'cuda'")
        self._name = device_type
        self._peak_rss = 0

    @property
    def _cuda(self) -> bool:
        return self._name == "cuda"

    # ---- the device -----------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None or not self._cuda else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._cuda else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return devices.communication_backend(torch.device(self._name))

    def is_synchronized_device(self) -> bool:
        return not self._cuda  # DeepSpeed's meaning: no asynchronous kernel queue

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    # ---- numbers it supports ------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return devices.computes_bf16_natively(torch.device(self._name))

    def is_fp16_supported(self) -> bool:
        if self._cuda:
            return torch.cuda.is_available()
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        found = [torch.float32]
        found += [torch.bfloat16] if self.is_bf16_supported() else []
        found += [torch.float16] if self.is_fp16_supported() else []
        return found

    # ---- random numbers -------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # ---- memory -----------------------------------------------------------------------
    def memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.memory_allocated(device_index)
        rss = _resident_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.max_memory_allocated(device_index)
        return max(self._peak_rss, self.memory_allocated())

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._peak_rss = 0

    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self.memory_allocated()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()
        else:
            devices.release_host_memory()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self.memory_allocated(), "allocated_bytes.all.peak":
                self.max_memory_allocated()}

    # ---- streams and events ---------------------------------------------------------
    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream(*args, **kwargs) if self._cuda else _NoStream()

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index) if self._cuda else _NoStream()

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index) if self._cuda else _NoStream()

    def Event(self, **kwargs: Any) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event(**kwargs) if self._cuda else _NoEvent()

    # ---- host memory ----------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda and torch.cuda.is_available() else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    @contextlib.contextmanager
    def range(self, msg: str) -> Iterator[None]:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.nvtx.range_pop()


class _NoStream:
    """A CPU stream: work runs in order, so waiting is already done."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoEvent":
        return event if event is not None else _NoEvent()


class _NoEvent:
    """A CPU event: recorded work has already run."""

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


_chosen: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of the device zero3 computes on (chosen once per process)."""
    global _chosen
    if _chosen is None:
        _chosen = Accelerator(devices.resolve_device().type)
    return _chosen


def set_accelerator(accel: Accelerator) -> None:
    global _chosen
    _chosen = accel
