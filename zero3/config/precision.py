"""Precision: the `bf16` and `fp16` sections, and `data_types` (the dtype names the config accepts)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from zero3.config.base import _Model


class BF16Config(_Model):
    enabled: bool = False
    # Floating inputs of the engine's forward cast to bf16 (zero3's key, as FSDP2's cast_forward_inputs);
    # false: as given, DeepSpeed's only behaviour in bf16.
    auto_cast: bool = True


class FP16Config(_Model):
    enabled: bool = False
    # DeepSpeed's key: floating inputs of the engine's forward cast to fp16 (DeepSpeed's default is false).
    auto_cast: bool = True
    loss_scale: float = Field(default=0.0, ge=0)  # 0 = dynamic loss scaling
    initial_scale_power: int = Field(default=16, ge=0, le=64)
    loss_scale_window: int = Field(default=1000, gt=0)
    hysteresis: int = Field(default=2, gt=0)
    min_loss_scale: float = Field(default=1.0, gt=0)
    consecutive_hysteresis: bool = False


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DtypeName = Literal["fp32", "fp16", "bf16"]


class DataTypesConfig(_Model):
    # The dtype gradients accumulate in across micro-steps (None: the compute dtype).
    grad_accum_dtype: _DtypeName | None = None
