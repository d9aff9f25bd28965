"""The `scheduler` section: DeepSpeed's five schedulers (deepspeed/step/lr_schedules.py), with its key
names and defaults."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from zero3.config.base import _KeyedError, _Model, _Size

_WarmupType = Literal["log", "linear"]


def _per_group(low: float, high: float | None = None) -> Any:
    """A number, or a list of one number per param group (DeepSpeed's "float or list"), in [low, high)."""
    bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g})"

    def check(value: Any) -> Any:
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ValueError("expected a number, or a list of one number per param group")
        if not all(math.isfinite(v) and v >= low and (high is None or v < high) for v in values):
            raise ValueError(f"expected {'numbers' if isinstance(value, list) else 'a number'} {bound}")
        return [float(v) for v in values] if isinstance(value, list) else float(value)

    return Annotated[float | list[float], BeforeValidator(check)]


_GroupLr = _per_group(0.0)
_GroupMomentum = _per_group(0.0, 1.0)
# DeepSpeed (0.19.3 on) refuses a warmup of 0 steps; its log and linear warmups last at least 2 steps.
_WarmupSteps = Annotated[int, Field(gt=0)]


def _warmup_within_total(warmup_num_steps: int, total_num_steps: int) -> None:
    if warmup_num_steps > total_num_steps:
        raise _KeyedError(
            ("warmup_num_steps",), f"must not exceed total_num_steps ({total_num_steps})", (warmup_num_steps,)
        )


class LRRangeTestParams(_Model):
    lr_range_test_min_lr: _GroupLr = 0.001
    lr_range_test_step_size: int = Field(default=2000, gt=0)
    lr_range_test_step_rate: float = Field(default=1.0, ge=0)
    lr_range_test_staircase: bool = False


class OneCycleParams(_Model):
    cycle_min_lr: _GroupLr
    cycle_max_lr: _GroupLr
    decay_lr_rate: float = Field(default=0.0, ge=0)
    cycle_first_step_size: _Size = Field(default=2000, gt=0)
    cycle_second_step_size: _Size | None = Field(default=None, ge=0)  # None: cycle_first_step_size
    # 0, or DeepSpeed's command-line default -1: no stairs (lr and momentum move every step).
    cycle_first_stair_count: int = Field(default=0, ge=-1)
    cycle_second_stair_count: int | None = Field(default=None, ge=-1)  # None: cycle_first_stair_count
    decay_step_size: _Size = Field(default=0, ge=0)  # 0: no decay after the cycle
    cycle_momentum: bool = True
    cycle_min_mom: _GroupMomentum = 0.8
    cycle_max_mom: _GroupMomentum = 0.9
    decay_mom_rate: float = Field(default=0.0, ge=0)


class WarmupLRParams(_Model):
    warmup_min_lr: _GroupLr = 0.0
    warmup_max_lr: _GroupLr | None = None  # None: each param group's own lr (DeepSpeed 0.17.2 on)
    warmup_num_steps: _WarmupSteps = 1000
    warmup_type: _WarmupType = "log"


class WarmupDecayLRParams(_Model):
    total_num_steps: int = Field(gt=0)
    warmup_min_lr: _GroupLr = 0.0
    warmup_max_lr: _GroupLr = 0.001
    warmup_num_steps: _WarmupSteps = 1000
    warmup_type: _WarmupType = "log"

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupDecayLRParams:
        _warmup_within_total(self.warmup_num_steps, self.total_num_steps)
        return self


class WarmupCosineLRParams(_Model):
    total_num_steps: int = Field(gt=0)
    warmup_min_ratio: float = Field(default=0.0, ge=0, le=1)
    warmup_num_steps: _WarmupSteps = 1000
    cos_min_ratio: float = Field(default=0.0001, ge=0, le=1)
    warmup_type: _WarmupType = "log"

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupCosineLRParams:
        _warmup_within_total(self.warmup_num_steps, self.total_num_steps)
        return self


class _SchedulerBase(_Model):
    @model_validator(mode="before")
    @classmethod
    def _params_default(cls, data: Any) -> Any:
        # An absent "params" is validated as {} so a missing required parameter
        # is reported as scheduler.params.<name>, not as a missing "params".
        if isinstance(data, dict) and "params" not in data:
            return {**data, "params": {}}
        return data


class LRRangeTestConfig(_SchedulerBase):
    type: Literal["LRRangeTest"]
    params: LRRangeTestParams


class OneCycleConfig(_SchedulerBase):
    type: Literal["OneCycle"]
    params: OneCycleParams


class WarmupLRConfig(_SchedulerBase):
    type: Literal["WarmupLR"]
    params: WarmupLRParams


class WarmupDecayLRConfig(_SchedulerBase):
    type: Literal["WarmupDecayLR"]
    params: WarmupDecayLRParams


class WarmupCosineLRConfig(_SchedulerBase):
    type: Literal["WarmupCosineLR"]
    params: WarmupCosineLRParams


# Discriminated on "type", so each type's params are validated by their own model.
SchedulerConfig = Annotated[
    LRRangeTestConfig | OneCycleConfig | WarmupLRConfig | WarmupDecayLRConfig | WarmupCosineLRConfig,
    Field(discriminator="type"),
]
