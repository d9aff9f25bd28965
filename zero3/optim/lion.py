"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023): the sign of an
interpolated momentum, with decoupled weight decay. Elementwise, so it steps shards as it steps
whole tensors.

    update = sign(beta1 * m + (1 - beta1) * g)
    p     <- p * (1 - lr * weight_decay) - lr * update
    m     <- beta2 * m + (1 - beta2) * g
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    # Read by zero3: the update of each element depends on that element alone.
    elementwise = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        maximize: bool = False,
        foreach: bool | None = None,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"Lion: lr must be > 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= beta <= 1.0 for beta in betas):
            raise ValueError(f"Lion: betas must be two values in [0, 1], got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "maximize": maximize,
                    "foreach": foreach}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                params.append(param)
                grads.append(param.grad)
                exp_avgs.append(state["exp_avg"])
            if params:
                _lion(params, grads, exp_avgs, group)
        return loss


def _lion(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
          group: dict[str, Any]) -> None:
    lr, weight_decay, maximize = group["lr"], group["weight_decay"], group["maximize"]
    beta1, beta2 = group["betas"]
    if group["foreach"] is False:
        for param, grad, exp_avg in zip(params, grads, exp_avgs):
            grad = -grad if maximize else grad
            if weight_decay != 0:
                param.mul_(1 - lr * weight_decay)
            param.add_(torch.lerp(exp_avg, grad, 1 - beta1).sign_(), alpha=-lr)
            exp_avg.lerp_(grad, 1 - beta2)
        return
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    updates = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    torch._foreach_sign_(updates)
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta2)
