"""DeepSpeed's names on its stage-3 optimizer that zero3's optimizer answers from its own state, for code written
against DeepSpeed (`engine.optimizer.averaged_gradients`, ...)."""

from __future__ import annotations

import torch

from zero3.partition.sharded_param import ShardedParam
from zero3.step.grad_shards import GradShards
from zero3.step.layout import SubGroup


class DeepSpeedOptimizerNames:
    """The gradient shards between a backward and the step, under DeepSpeed's names."""

    grads: GradShards
    sub_groups: list[SubGroup]
    grad_norm: torch.Tensor | None

    @property
    def _global_grad_norm(self) -> float | None:
        """DeepSpeed's `_global_grad_norm`: the last step's global gradient norm (unscaled, before clipping);
        None before the first step. (The engine's `get_global_grad_norm()` says the same.)"""
        return None if self.grad_norm is None else float(self.grad_norm)

    @property
    def grad_partitions_flat_buffer(self) -> torch.Tensor:
        """This rank's gradient shards as one flat tensor, DeepSpeed's `grad_partitions_flat_buffer`: the live
        buffer where they have one; where they are made on demand, a copy of those held, zeros elsewhere
        (between steps: all zeros, as they hold no memory then)."""
        return self.grads.flat()

    @property
    def averaged_gradients(self) -> dict[int, list[torch.Tensor]]:
        """DeepSpeed's `averaged_gradients`: from a backward to the step, each parameter group's gradient shards
        (this rank's, reduced across the ranks), one per parameter in the group's order, in lp_grads' dtype;
        empty where no gradient has arrived since the last step. DeepSpeed keys them by its sub-groups, which
        are the parameter groups at its default `sub_group_size` (zero3's own sub-groups, cut for the step's
        working memory, are an inside matter). Views where the shards are held; zeros otherwise."""
        if not self.grads.any_arrived():
            return {}
        by_group: dict[int, dict[ShardedParam, None]] = {}
        for sub in self.sub_groups:
            for piece in sub.pieces:
                by_group.setdefault(sub.group_index, {})[piece.sp] = None
        return {index: [self.grads.read(sp) for sp in sps] for index, sps in by_group.items()}

    def get_fp32_grad_partitions(self) -> dict[int, dict[int, torch.Tensor]]:
        """DeepSpeed's `get_fp32_grad_partitions()`: `averaged_gradients` as {group: {parameter: its fp32
        values}} (the same tensors where lp_grads is fp32)."""
        return {index: {i: grad.float() for i, grad in enumerate(grads)}
                for index, grads in self.averaged_gradients.items()}
