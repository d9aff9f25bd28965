"""`deepspeed.ops.adam`: `FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's signatures, on torch's Adam.

`adam_w_mode=True` (the default) is AdamW's decoupled weight decay, False is Adam's L2 term, as in DeepSpeed.
Both classes are `torch.optim.Adam`, so zero3 shards them like any elementwise torch optimizer: it builds
the same class over each rank's fp32 shards, with torch's fused kernel where the shards' device has one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _no_bias_correction(bias_correction: bool, name: str) -> None:
    if not bias_correction:
        raise NotImplementedError(f"{name}(bias_correction=False): torch's Adam always corrects the bias; "
                                  "zero3 offers no uncorrected Adam")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's `FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    set_grad_none)`. Torch's own arguments (`fused`, `foreach`, `decoupled_weight_decay`, ...) are accepted
    too, so the class rebuilds from its `defaults` (zero3 builds it again over its shards)."""

    elementwise = True  # read by zero3: Adam's update of each element depends on that element alone

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 **torch_options: Any) -> None:
        _no_bias_correction(bias_correction, type(self).__name__)
        torch_options.setdefault("decoupled_weight_decay", adam_w_mode)
        if torch_options.get("fused") is None and torch_options.get("foreach") is None:
            torch_options["fused"] = True  # DeepSpeed's point: one kernel for every tensor (torch's, on CPU and CUDA)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         **torch_options)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class DeepSpeedCPUAdam(FusedAdam):
    """DeepSpeed's `DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
    adamw_mode, fp32_optimizer_states)`: the same update; where it runs is the config's `offload_optimizer`
    (zero3 steps a host-offloaded optimizer on the host, with torch's fused CPU kernel)."""

    def __init__(self, model_params: Iterable[Any] | None = None, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True,
                 **torch_options: Any) -> None:
        if not fp32_optimizer_states:
            raise NotImplementedError("DeepSpeedCPUAdam(fp32_optimizer_states=False): zero3 keeps Adam's moments "
                                      "in fp32")
        params = torch_options.pop("params", model_params)
        torch_options.setdefault("decoupled_weight_decay", adamw_mode)
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, **torch_options)
