"""TrainJob: what `zero3 train` hands each worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zero3.models.gpt import GPTConfig


@dataclass(frozen=True)
class TrainJob:
    """Everything a worker needs; pickled to each spawned process."""

    model: GPTConfig
    ds_config: dict[str, Any]
    steps: int
    seed: int
    log_every: int
    precision: str
    micro_batch: int
    grad_accum: int
    device: str | None = None  # None: zero3's own rule (zero3.accelerator.resolve_device)
    save_dir: str | None = None
    save_every: int | None = None
    resume: bool = False
    max_restarts: int = 0
