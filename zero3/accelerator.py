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
