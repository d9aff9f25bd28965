"""The optimizer's sub-groups (each a window of the flat state buffers, stepped as one torch step) and the
snapshot of its scalar states that a failed or undone step puts back."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from zero3.partition.flat_buffer import FlatBuffer
from zero3.step.grad_shards import Piece


@dataclass
class ScalarSnapshot:
    """Pieces without state (`fresh`), and the others' scalar state: 0-dim tensors stacked per name,
    anything else (`loose`) copied one by one."""

    fresh: list[nn.Parameter]
    stacked: dict[str, tuple[list[nn.Parameter], torch.Tensor]]
    loose: list[tuple[nn.Parameter, str, Any]]


@dataclass
class SubGroup:
    offset: int
    numel: int
    pieces: list[Piece]
    masters: list[nn.Parameter]  # one per piece
    group_index: int = 0  # its parameter group
    muon: bool = False  # its matrices step with Muon (zero3.optim.muon)
    # Its pieces' runs in the 16-bit shard buffers: (buffer, offset there, offset here, elements).
    lp_runs: list[tuple[FlatBuffer, int, int, int]] = field(default_factory=list)

    @cached_property
    def piece_numels(self) -> list[int]:
        """Each piece's elements, in order: how its gradients are cut, in one `split`, at every step."""
        return [piece.numel for piece in self.pieces]
