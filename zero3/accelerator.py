"""The device the engine computes on, and the few device and host-memory facts it needs.

One rule picks the device for `zero3.Init` and `zero3.initialize` (`resolve_device`), so two
ranks never land on one GPU by accident. CUDA-only facilities degrade to correct CPU behaviour:
on CPU there is no pinned memory and no side stream, so callers get plain host tensors and
synchronous copies rather than a skipped feature. On the host side, glibc's heap is handed back
to the OS (`release_host_memory`) and a buffer can be zeroed by dropping its pages
(`DroppableZeros`), so freed or zeroed state leaves the resident set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys

import torch
import torch.distributed as dist


# Environment variables that choose the device, in precedence order. DS_ACCELERATOR
# is DeepSpeed's name for the same choice, honoured for users moving over.
DEVICE_VARIABLES = ("ZERO3_ACCELERATOR", "DS_ACCELERATOR")
_DEVICE_TYPES = ("cpu", "cuda")


class DeviceChoiceError(ValueError):
    """The device setting names something this machine or this job cannot use."""


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """The device this rank computes on. One rule for `zero3.Init` and `zero3.initialize`:

    1. an explicit `device` ("cpu", "cuda", "cuda:1", a torch.device);
    2. ZERO3_ACCELERATOR, else DS_ACCELERATOR ("cpu" or "cuda");
    3. an existing default process group's backend (gloo: the CPU, nccl: CUDA);
    4. auto: cuda:LOCAL_RANK when CUDA is usable, else the CPU.

    "cuda" without an index means cuda:LOCAL_RANK, and is refused when this
    machine has fewer GPUs than local ranks: ranks are never wrapped onto a
    shared GPU (NCCL refuses that with "Duplicate GPU detected").
    """
    if device is not None:
        chosen = _parse_device(device, "device=")
        source = f"device={str(device)!r}"
    else:
        chosen, source = _from_environment()
    if chosen is None:
        chosen, source = _from_process_group()
    if chosen is None:
        usable = torch.cuda.is_available() and torch.cuda.device_count() > 0
        chosen, source = torch.device("cuda" if usable else "cpu"), "auto"
    if chosen.type == "cuda":
        chosen = _cuda_for_this_rank(chosen, source)
    _check_against_process_group(chosen, source)
    return chosen


def _parse_device(value: object, what: str) -> torch.device:
    try:
        parsed = torch.device(value)  # type: ignore[arg-type]
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in _DEVICE_TYPES:
        raise DeviceChoiceError(f"{what}{value!r} is not a device zero3 runs on; expected 'cpu' or 'cuda' (or 'cuda:N')")
    if parsed.type == "cpu":
        return torch.device("cpu")  # an index means nothing there (accelerate hands out cpu:0)
    return parsed


def _from_environment() -> tuple[torch.device | None, str]:
    for variable in DEVICE_VARIABLES:
        value = os.environ.get(variable)
        if value is None or value == "":
            continue
        if value.strip().lower() not in _DEVICE_TYPES:
            raise DeviceChoiceError(
                f"{variable}={value!r} is not a device zero3 runs on; expected one of {', '.join(_DEVICE_TYPES)}"
            )
        return torch.device(value.strip().lower()), f"{variable}={value}"
    return None, ""


def _group_backend() -> str | None:
    """The default process group's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl"), if one exists."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    backend = str(dist.get_backend())
    if backend == "undefined":
        # A group made with backend=None (accelerate's, on a machine without a GPU) names its backends
        # per device type only in its config: "cpu:gloo" (and "cuda:nccl" where CUDA is built in).
        backend = str(dist.get_backend_config())
    return backend


def _from_process_group() -> tuple[torch.device | None, str]:
    backend = _group_backend()
    if backend is None:
        return None, ""
    # "cpu:gloo,cuda:nccl" style backends serve both; the accelerator wins there.
    if "nccl" in backend:
        return torch.device("cuda"), f"the process group's backend {backend!r}"
    return torch.device("cpu"), f"the process group's backend {backend!r}"


def _cuda_for_this_rank(device: torch.device, source: str) -> torch.device:
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise DeviceChoiceError(
            f"{source} asks for CUDA, but torch sees no usable CUDA device here; "
            f"set {DEVICE_VARIABLES[0]}=cpu to run on the CPU"
        )
    count = torch.cuda.device_count()
    if device.index is not None:
        if device.index >= count:
            raise DeviceChoiceError(f"{source} names cuda:{device.index}, but this machine has {count} CUDA device(s)")
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    if local_world > count or local_rank >= count:
        raise DeviceChoiceError(
            f"{max(local_world, local_rank + 1)} local ranks but only {count} CUDA device(s) on this machine "
            f"(device chosen by {source}): each rank needs a GPU of its own. Launch at most {count} ranks per "
            f"node, or set {DEVICE_VARIABLES[0]}=cpu to run every rank on the CPU"
        )
    return torch.device("cuda", local_rank)


def _check_against_process_group(device: torch.device, source: str) -> None:
    backend = _group_backend()
    if backend is None:
        return
    wanted = communication_backend(device)
    if wanted not in backend:
        raise DeviceChoiceError(
            f"{source} picks {device}, but the default process group was created with backend {backend!r}, "
            f"which cannot run zero3's collectives on {device.type} tensors; create the group with "
            f"backend {wanted!r}, or choose the device that matches it"
        )


def communication_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def set_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def computes_bf16_natively(device: torch.device) -> bool:
    """Whether `device` has bf16 arithmetic units. A CPU without them (AVX2 only) emulates a bf16 matmul at
    about 170x the time of an fp32 one (docs/benchmarks.md); every CUDA device zero3 runs on has them."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def cpu_capability() -> str:
    """The CPU's vector capability as torch dispatches on it ("AVX2", "AVX512", ...), and its bf16 units."""
    native = "with" if computes_bf16_natively(torch.device("cpu")) else "without"
    return f"{torch.backends.cpu.get_cpu_capability()}, {native} bf16 units"


def supports_pinned_memory(device: torch.device) -> bool:
    """Page-locked host memory only helps (and only exists) beside a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def register_host_pages(memory: torch.Tensor, device: torch.device) -> bool:
    """Page-lock host memory that torch did not allocate (a shared-memory segment) for DMA copies to and
    from `device`; False where that means nothing (no CUDA) or the driver refused (the copies then stage
    through the driver's own buffers: slower, still correct)."""
    if not supports_pinned_memory(device):
        return False
    status = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel() * memory.element_size(), 0)
    return int(status) == 0


def unregister_host_pages(memory: torch.Tensor, device: torch.device) -> None:
    """Undo `register_host_pages` (before the memory is unmapped)."""
    if supports_pinned_memory(device):
        torch.cuda.cudart().cudaHostUnregister(memory.data_ptr())


def copy_stream(device: torch.device) -> "torch.cuda.Stream | None":
    """A side stream for copies that overlap compute; None on the CPU (copies are synchronous there)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def release_host_memory() -> None:
    """Hand freed heap pages back to the OS.

    glibc serves allocations under its (adaptive, up to 32 MiB) mmap threshold
    from the heap and keeps freed pages there, so freeing a state would not
    lower the process's resident memory. `malloc_trim(0)` returns them.
    """
    if _libc is not None:
        _libc.malloc_trim(0)


class DroppableZeros:
    """A zeroed host tensor whose memory is a private anonymous mapping of its own, so that `zero()`
    zeroes it by handing its pages back to the OS (MADV_DONTNEED) instead of writing them: nothing is
    written, and the memory stays out of the resident set until something writes it again.

    Where that is not Linux's semantics (elsewhere MADV_DONTNEED may keep the bytes), it is a plain
    tensor that `zero()` fills."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self._region: mmap.mmap | None = None
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_DONTNEED") and numel > 0:
            self._region = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            # The tensor holds the mapping (an exported buffer) for as long as it lives.
            self.tensor = torch.frombuffer(self._region, dtype=dtype, count=numel)
        else:
            self.tensor = torch.zeros(numel, dtype=dtype)

    def zero(self) -> None:
        if self._region is not None:
            self._region.madvise(mmap.MADV_DONTNEED)
        else:
            self.tensor.zero_()


UNTOUCHED_FROM_BYTES = 1 << 20  # smaller host zeros are written: a mapping of their own is not worth it


def untouched_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose pages nothing has touched yet (a mapping of its own, see `DroppableZeros`):
    no time spent writing zeros, and no resident memory until something writes it. Small ones, and where
    that is not Linux's semantics, are plain `torch.zeros`."""
    if numel * dtype.itemsize < UNTOUCHED_FROM_BYTES:
        return torch.zeros(numel, dtype=dtype)
    return DroppableZeros(numel, dtype).tensor


def host_heap_bytes() -> dict[str, int] | None:
    """What glibc's allocator holds, over all its arenas (None where it is not glibc 2.33+): `in_use`
    handed out from the heap, `free` freed but kept in it (mostly still resident), `mmapped` in blocks
    mapped apart (large allocations, returned to the OS when freed)."""
    if _libc is None or not hasattr(_libc, "mallinfo2"):
        return None
    info = _libc.mallinfo2()
    return {"in_use": info.uordblks, "free": info.fordblks, "mmapped": info.hblkhd}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _find_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "malloc_trim"):
            return None  # not glibc (macOS, musl): nothing to trim or read
    except OSError:
        return None
    if hasattr(libc, "mallinfo2"):
        libc.mallinfo2.restype = _MallInfo2
    return libc


_libc = _find_libc()
