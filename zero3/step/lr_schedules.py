"""DeepSpeed's five learning-rate schedulers as torch LR schedulers.

`LRRangeTest`, `OneCycle`, `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR` take
DeepSpeed's parameter names and defaults and give DeepSpeed's learning rate (and
OneCycle's momentum) at every step, quirks included, so a ported script's
losses match from the first step.

[Note: the step count]
Every value here is closed-form in ``step = last_epoch``: 0 right after
construction, +1 per ``step()``, so resuming from ``state_dict()`` lands on the
same values as stepping there. DeepSpeed counts the same steps from -1 (its
``last_batch_iteration = step - 1``): its scheduler writes its iteration -1
value into the optimizer when built, and its engine (like ours) calls
``step()`` once after every applied optimizer step. So optimizer step n (from
1) runs with the values for ``step = n - 1``; ``*_at(step)`` below are
DeepSpeed's formulas evaluated at iteration ``step - 1``. That is why WarmupLR
holds ``warmup_min_lr`` for two optimizer steps and WarmupCosineLR's first step
uses lr 0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from zero3.config import (
    LRRangeTestConfig,
    OneCycleConfig,
    SchedulerConfig,
    WarmupCosineLRConfig,
    WarmupDecayLRConfig,
    WarmupLRConfig,
)

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_lr_scheduler"]

log = logging.getLogger("zero3")

WarmupType = Literal["log", "linear"]
PerGroup = float | Sequence[float]  # one value for every param group, or one per group

# DeepSpeed's OneCycle writes this as Adam's second beta whenever it cycles the first (whatever the
# optimizer had); kept so that the steps match DeepSpeed's.
ONE_CYCLE_BETA2 = 0.99


def _per_group(optimizer: Optimizer, value: PerGroup, name: str) -> list[float]:
    count = len(optimizer.param_groups)
    if isinstance(value, (int, float)):
        return [float(value)] * count
    if len(value) != count:
        raise ValueError(f"{name}: expected one value per param group ({count}), got {len(value)}")
    return [float(v) for v in value]


def _set_group_value(group: dict[str, Any], key: str, value: float) -> None:
    if isinstance(group[key], Tensor):
        group[key].fill_(value)  # a tensor lr stays the same tensor (compiled steps hold it)
    else:
        group[key] = value


class _StepCountSchedule(LRScheduler):
    """A closed-form schedule of the step count (see [Note: the step count])."""

    def lr_at(self, step: int) -> list[float]:
        """Every param group's lr after `step` scheduler steps."""
        raise NotImplementedError

    def momentum_at(self, step: int) -> list[float] | None:
        """Every group's momentum (Adam's first beta) after `step` scheduler steps; None: not scheduled."""
        return None

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's name for the position: it counts from -1."""
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self.lr_at(self.last_epoch)

    def _get_closed_form_lr(self) -> list[float]:
        return self.lr_at(self.last_epoch)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._write_momentum()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The optimizer runs with the restored step's values whether or not its own state (which holds
        # them) was loaded, or loaded first.
        for group, lr in zip(self.optimizer.param_groups, self.lr_at(self.last_epoch), strict=True):
            _set_group_value(group, "lr", lr)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self._write_momentum()

    def _write_momentum(self) -> None:
        momenta = self.momentum_at(self.last_epoch)
        if momenta is not None:
            for group, momentum in zip(self.optimizer.param_groups, momenta, strict=True):
                group["betas"] = (momentum, ONE_CYCLE_BETA2)


# ------------------------------------------------------------------ LRRangeTest


class LRRangeTest(_StepCountSchedule):
    """Raise the lr from `lr_range_test_min_lr` by `lr_range_test_step_rate` times it per
    `lr_range_test_step_size` steps (in whole stairs with `lr_range_test_staircase`), without end:
    a range test finds the largest lr that still trains."""

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: PerGroup = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_epoch: int = -1,
    ) -> None:
        if lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        # Attributes first: the base constructor already takes the first step.
        super().__init__(optimizer, last_epoch)

    def lr_at(self, step: int) -> list[float]:
        interval = math.floor(step / self.step_size) if self.staircase else step / self.step_size
        increase = 1 + self.step_rate * interval
        return [min_lr * increase for min_lr in self.min_lrs]


# --------------------------------------------------------------------- OneCycle


class OneCycle(_StepCountSchedule):
    """One cycle: the lr rises from `cycle_min_lr` to `cycle_max_lr` over `cycle_first_step_size`
    steps and falls back over `cycle_second_step_size`, then decays by `decay_lr_rate` per
    `decay_step_size` steps (none if either is 0); the momentum moves the other way between
    `cycle_max_mom` and `cycle_min_mom`.

    As DeepSpeed's: the momentum is Adam's first beta (written with a second beta of 0.99), and is
    left alone (with a warning) for an optimizer without `betas`, such as SGD; it starts at
    `cycle_min_mom` for the first step, then follows the cycle from `cycle_max_mom`; stair counts
    above 0 move lr and momentum in that many equal stairs per half cycle; after the cycle the
    momentum grows by `decay_mom_rate` per `decay_step_size` steps.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: PerGroup,
        cycle_max_lr: PerGroup,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: PerGroup = 0.8,
        cycle_max_mom: PerGroup = 0.9,
        decay_mom_rate: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        second = cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size
        if cycle_first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be > 0, got {cycle_first_step_size}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be >= 0, got {second}")
        if decay_step_size < 0:
            raise ValueError(f"decay_step_size must be >= 0, got {decay_step_size}")
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = float(second)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (
            cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            log.warning("OneCycle: %s has no betas, so its momentum is not cycled (as in DeepSpeed)",
                        type(optimizer).__name__)
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        self.decay_mom_rate = decay_mom_rate
        super().__init__(optimizer, last_epoch)

    def _scale(self, step: int) -> float:
        """Where in the cycle `step` is: 0 at the ends, 1 at the peak."""
        cycle = math.floor(1 + step / self.total_size)
        x = 1.0 + step / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs from the whole step offset: the float scale can land just under a stair edge.
            offset = step % self.total_size
            if offset <= self.first_step_size:
                position = offset * stairs / self.first_step_size
            else:
                position = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def _in_cycle(self, step: int) -> bool:
        return step - 1 < self.total_size

    def _decay_interval(self, step: int) -> float:
        return (step - self.total_size) / self.decay_step_size

    def lr_at(self, step: int) -> list[float]:
        if self._in_cycle(step):
            scale = self._scale(step)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval(step)
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, step: int) -> list[float] | None:
        if not self.cycle_momentum:
            return None
        if step == 0:
            return list(self.min_moms)  # DeepSpeed's starting value, not the cycle's
        if self._in_cycle(step):
            scale = self._scale(step)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_interval(step)
        return [hi * factor for hi in self.max_moms]


# --------------------------------------------------------------- the warmups


def _warmup_steps(warmup_num_steps: int, warmup_type: str) -> int:
    if warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be > 0, got {warmup_num_steps}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    # DeepSpeed warms up over at least 2 steps (a log warmup over 1 would divide by log(1) = 0).
    return max(2, warmup_num_steps)


def _warmup_progress(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's warmup gamma in [0, 1) at its `iteration` (>= 0, < warmup_num_steps)."""
    if warmup_type == "log":
        # DeepSpeed's operation order (a precomputed 1 / log), so the floats match bit for bit.
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


def _check_total(total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps <= 0:
        raise ValueError(f"total_num_steps must be > 0, got {total_num_steps}")
    if warmup_num_steps > total_num_steps:
        raise ValueError(
            f"warmup_num_steps ({warmup_num_steps}) must not exceed total_num_steps ({total_num_steps})"
        )


class WarmupLR(_StepCountSchedule):
    """Raise every group's lr from `warmup_min_lr` to `warmup_max_lr` (default: the group's own lr)
    over `warmup_num_steps` steps (at least 2), logarithmically or linearly, then hold it."""

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log",
        last_epoch: int = -1,
    ) -> None:
        self.warmup_num_steps = _warmup_steps(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in optimizer.param_groups]
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_progress(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, step: int) -> list[float]:
        if step == 0:
            return list(self.min_lrs)
        gamma = self._gamma(step - 1)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay from `warmup_max_lr` back to `warmup_min_lr` at
    `total_num_steps`, where it stays."""

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: PerGroup = 0.0,
        warmup_max_lr: PerGroup = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: WarmupType = "log",
        last_epoch: int = -1,
    ) -> None:
        _check_total(total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_progress(iteration, self.warmup_num_steps, self.warmup_type)
        remaining = float(self.total_num_steps - iteration)
        return max(0.0, remaining / float(max(1, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_StepCountSchedule):
    """Scale each group's own lr by a ratio that rises from `warmup_min_ratio` to 1 over
    `warmup_num_steps` steps (at least 2), then follows half a cosine down to `cos_min_ratio`
    at `total_num_steps`, where it stays.

    As DeepSpeed's: the first step runs at lr 0, and the cosine is one step along already at
    the first step after the warmup.
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
        _check_total(total_num_steps, warmup_num_steps)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = _warmup_steps(warmup_num_steps, warmup_type)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def ratio_at(self, step: int) -> float:
        """The multiplier of each group's initial lr after `step` scheduler steps."""
        if step == 0:
            return 0.0
        iteration = step - 1
        if iteration < self.warmup_num_steps:
            gamma = _warmup_progress(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, step: int) -> list[float]:
        ratio = self.ratio_at(step)
        return [float(base_lr) * ratio for base_lr in self.base_lrs]


# ------------------------------------------------------------------------ build

_SCHEDULERS: dict[type, type[_StepCountSchedule]] = {
    LRRangeTestConfig: LRRangeTest,
    OneCycleConfig: OneCycle,
    WarmupLRConfig: WarmupLR,
    WarmupDecayLRConfig: WarmupDecayLR,
    WarmupCosineLRConfig: WarmupCosineLR,
}


def build_lr_scheduler(cfg: SchedulerConfig, optimizer: Optimizer) -> LRScheduler:
    """The scheduler a validated `scheduler` config section describes (its params are the
    constructor's keyword arguments, DeepSpeed's names)."""
    scheduler = _SCHEDULERS.get(type(cfg))
    if scheduler is None:
        raise TypeError(f"not a scheduler config: {type(cfg).__name__}")
    return scheduler(optimizer, **cfg.params.model_dump())
