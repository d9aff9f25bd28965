"""A named flat 1-D tensor that per-parameter slots point into.

Slots hold (buffer, offset, numel) rather than views, so a buffer can be moved
or reallocated (offload, reload, consolidation) without stale views anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class FlatBuffer:
    """One state's flat storage on one rank."""

    def __init__(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dim() != 1:
            raise ValueError(f"flat buffer {name!r} must be 1-D, got shape {tuple(tensor.shape)}")
        self.name = name
        self.tensor = tensor

    @classmethod
    def zeros(cls, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> "FlatBuffer":
        return cls(name, torch.zeros(numel, dtype=dtype, device=device))

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def view(self, offset: int, numel: int) -> torch.Tensor:
        return self.tensor.narrow(0, offset, numel)


@dataclass(frozen=True)
class Slot:
    """A parameter's (or a unit's) contiguous region of a flat buffer."""

    buffer: FlatBuffer
    offset: int
    numel: int

    def view(self) -> torch.Tensor:
        return self.buffer.view(self.offset, self.numel)
