"""DeepSpeed's WarmupLR and WarmupCosineLR as torch LR schedulers.

Both are closed-form in the step count ``s = last_epoch`` (0 right after
construction, +1 per ``step()``), so resuming from ``state_dict()`` or stepping
to an explicit epoch gives exactly the same learning rate as stepping there.
"""

from __future__ import annotations

import math
from typing import Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zero3.config import SchedulerConfig, WarmupCosineLRConfig, WarmupLRConfig

__all__ = ["WarmupCosineLR", "WarmupLR", "build_lr_scheduler"]

WarmupType = Literal["log", "linear"]


def _warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Warmup progress in [0, 1) for ``step < warmup_num_steps``."""
    if warmup_type == "log":
        # log(1) = 0 would make a one-step warmup divide by zero: treat it as done.
        if warmup_num_steps <= 1:
            return 1.0
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if warmup_num_steps < 0:
        raise ValueError(f"warmup_num_steps must be >= 0, got {warmup_num_steps}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")


class WarmupLR(LRScheduler):
    """Raise every group's lr from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    The absolute min/max replace the optimizer's own lr (DeepSpeed semantics).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        self.warmup_num_steps = warmup_num_steps
        self.warmup_type = warmup_type
        # Attributes first: the base constructor already takes the first step.
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int) -> float:
        """The learning rate (same for every group) after ``step`` scheduler steps."""
        if step < self.warmup_num_steps:
            gamma = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma
        return self.warmup_max_lr

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self.lr_at(self.last_epoch)] * len(self.optimizer.param_groups)

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()


class WarmupCosineLR(LRScheduler):
    """Warm up to each group's initial lr, then cosine-decay it to ``cos_min_ratio`` of it.

    ``lr = initial_lr * ratio``; the ratio rises from ``warmup_min_ratio`` to 1
    over ``warmup_num_steps``, then follows half a cosine to ``cos_min_ratio``
    at ``total_num_steps`` and stays there.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: WarmupType = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        if total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be > 0, got {total_num_steps}")
        if warmup_num_steps > total_num_steps:
            raise ValueError(
                f"warmup_num_steps ({warmup_num_steps}) must not exceed "
                f"total_num_steps ({total_num_steps})"
            )
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = warmup_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def ratio_at(self, step: int) -> float:
        """The multiplier of each group's initial lr after ``step`` scheduler steps."""
        if step < self.warmup_num_steps:
            gamma = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        decay_steps = self.total_num_steps - self.warmup_num_steps
        # No decay phase (warmup == total): sit at the floor once warmup ends.
        progress = 1.0 if decay_steps == 0 else (step - self.warmup_num_steps) / decay_steps
        progress = min(max(progress, 0.0), 1.0)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine

    def get_lr(self) -> list[float]:  # type: ignore[override]
        ratio = self.ratio_at(self.last_epoch)
        return [float(base_lr) * ratio for base_lr in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()


def build_lr_scheduler(cfg: SchedulerConfig, optimizer: Optimizer) -> LRScheduler:
    """The scheduler a validated ``scheduler`` config section describes."""
    if isinstance(cfg, WarmupLRConfig):
        p = cfg.params
        return WarmupLR(
            optimizer,
            warmup_min_lr=p.warmup_min_lr,
            warmup_max_lr=p.warmup_max_lr,
            warmup_num_steps=p.warmup_num_steps,
            warmup_type=p.warmup_type,
        )
    if isinstance(cfg, WarmupCosineLRConfig):
        q = cfg.params
        return WarmupCosineLR(
            optimizer,
            total_num_steps=q.total_num_steps,
            warmup_min_ratio=q.warmup_min_ratio,
            warmup_num_steps=q.warmup_num_steps,
            cos_min_ratio=q.cos_min_ratio,
            warmup_type=q.warmup_type,
        )
    raise TypeError(f"not a scheduler config: {type(cfg).__name__}")
