"""`deepspeed.ops.lion`: `FusedLion` and `DeepSpeedCPULion`, zero3's Lion under DeepSpeed's names."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from zero3.optim.lion import Lion

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(Lion):
    """DeepSpeed's `FusedLion(params, lr, betas, weight_decay, set_grad_none)`."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True, **options: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, **options)
        self.set_grad_none = set_grad_none


class DeepSpeedCPULion(FusedLion):
    """DeepSpeed's `DeepSpeedCPULion(model_params, lr, betas, weight_decay, fp32_optimizer_states)`."""

    def __init__(self, model_params: Iterable[Any] | None = None, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool = True, **options: Any) -> None:
        if not fp32_optimizer_states:
            raise NotImplementedError("DeepSpeedCPULion(fp32_optimizer_states=False): zero3 keeps Lion's "
                                      "momentum in fp32")
        params = options.pop("params", model_params)
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay, **options)
