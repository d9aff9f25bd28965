"""A rank's random number generators, captured with a checkpoint and restored with it.

Dropout, random crops and shuffles draw from torch's CPU generator, the
device's generator, Python's `random` and NumPy's global generator; a run
resumed from a checkpoint draws the same numbers as the uninterrupted run
only if each rank's four come back as they were. Each is stored as plain
tensors and numbers, so a checkpoint holding them still loads weights-only.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:  # NumPy is a dependency, but the generator state is optional to restore
    import numpy
except ImportError:  # pragma: no cover - numpy is installed with zero3
    numpy = None  # type: ignore[assignment]


def capture(device: torch.device) -> dict[str, Any]:
    """This process's generator states (the device's where it has one)."""
    version, mt_state, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if numpy is not None:
        name, keys, position, has_gauss, cached = numpy.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(position), int(has_gauss), float(cached)]
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Put back what `capture` took (a generator it did not take is left as it is)."""
    torch.set_rng_state(state["torch"])
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(int(value) for value in mt_state.tolist()), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if numpy is not None and "numpy" in state:
        name, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((name, keys.numpy().astype("uint32"), position, has_gauss, cached))
