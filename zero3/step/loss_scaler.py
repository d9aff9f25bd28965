"""Loss scaling for fp16 training: a fixed scale, or DeepSpeed's dynamic scaler.

The engine multiplies the loss by ``loss_scale`` before backward, divides the
gradients by it before the optimizer step, and calls ``update(overflow)`` once
per optimizer step (skipping the step when ``overflow`` is true).
"""

from __future__ import annotations

from typing import Any

from zero3.config import FP16Config

__all__ = ["DynamicLossScaler", "LossScaler", "build_loss_scaler"]


class LossScaler:
    """A constant loss scale; overflows are the caller's problem."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self._scale = float(scale)

    @property
    def loss_scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        """Nothing to adapt: a static scale never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = float(state_dict["loss_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler.

    On overflow the scale is divided by ``scale_factor`` only once ``hysteresis``
    overflows have been seen (so a single spike does not shrink it), never going
    below ``min_scale``. After ``scale_window`` updates without an overflow the
    scale is multiplied by ``scale_factor`` and the hysteresis budget restored.
    With ``consecutive_hysteresis`` the budget is restored by any clean step, so
    only back-to-back overflows shrink the scale.
    """

    dynamic = True

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        scale_window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        scale_factor: float = 2.0,
        consecutive_hysteresis: bool = False,
    ) -> None:
        if not initial_scale > 0:
            raise ValueError(f"initial_scale must be > 0, got {initial_scale}")
        if scale_window < 1:
            raise ValueError(f"scale_window must be >= 1, got {scale_window}")
        if hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {hysteresis}")
        if not min_scale > 0:
            raise ValueError(f"min_scale must be > 0, got {min_scale}")
        if not scale_factor > 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = float(scale_factor)
        self.consecutive_hysteresis = consecutive_hysteresis
        # Running state (what state_dict saves).
        self.cur_scale = float(initial_scale)
        self.cur_iter = 0
        # -1 so the first increase comes after exactly scale_window clean updates.
        self.last_overflow_iter = -1
        self.cur_hysteresis = hysteresis

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Adapt the scale after one optimizer step; call once per step."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        # Only the running state: the hyperparameters come from the config of
        # the run that loads the checkpoint, so a resumed run may change them.
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.cur_scale = float(state_dict["cur_scale"])
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        # A resumed run may configure a smaller hysteresis than was saved.
        self.cur_hysteresis = min(int(state_dict["cur_hysteresis"]), self.hysteresis)


def build_loss_scaler(fp16_cfg: FP16Config) -> LossScaler | DynamicLossScaler:
    """The scaler an ``fp16`` config section describes.

    ``loss_scale == 0`` means dynamic scaling starting at 2**initial_scale_power.
    With fp16 disabled (bf16/fp32 training) this is a static scale of 1, so the
    engine can use one code path.
    """
    if not fp16_cfg.enabled:
        return LossScaler(1.0)
    if fp16_cfg.loss_scale > 0:
        return LossScaler(fp16_cfg.loss_scale)
    return DynamicLossScaler(
        initial_scale=2.0**fp16_cfg.initial_scale_power,
        scale_window=fp16_cfg.loss_scale_window,
        hysteresis=fp16_cfg.hysteresis,
        min_scale=fp16_cfg.min_loss_scale,
        consecutive_hysteresis=fp16_cfg.consecutive_hysteresis,
    )
