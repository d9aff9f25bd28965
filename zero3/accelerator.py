"""The device the engine computes on, and the few device facts it needs.

CUDA-only facilities degrade to correct CPU behaviour: on CPU there is no
pinned memory and no side stream, so callers get plain host tensors and
synchronous copies rather than a skipped feature.
"""

from __future__ import annotations

import os

import torch


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is usable, else the CPU."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def communication_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def supports_pinned_memory(device: torch.device) -> bool:
    """Page-locked host memory only helps (and only exists) beside a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def copy_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A side stream for copies that overlap compute; None on the CPU (copies are synchronous there)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS.

    glibc serves allocations under its (adaptive, up to 32 MiB) mmap threshold
    from the heap and keeps freed pages there, so freeing a state would not
    lower the process's resident memory. `malloc_trim(0)` returns them.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim():  # type: ignore[no-untyped-def]
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


_malloc_trim = _find_malloc_trim()
