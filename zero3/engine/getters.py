"""DeepSpeed's engine getters, for ported training loops (`engine.train_micro_batch_size_per_gpu()`, ...).

A mixin of `ZeroEngine`: each answers from the engine's own state under
DeepSpeed's name and with DeepSpeed's meaning.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zero3.config import BatchSizes, Zero3Config
from zero3.engine.build import EngineParts
from zero3.step.optimizer import ZeroOptimizer


class DeepSpeedGetters:
    batch: BatchSizes
    config: Zero3Config
    compute_dtype: torch.dtype
    global_steps: int
    optimizer: ZeroOptimizer | None
    parts: EngineParts
    _check_alive: Callable[[], None]
    _last_step_applied: bool

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.batch.micro_batch_per_gpu

    def train_batch_size(self) -> int:
        return self.batch.train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.batch.gradient_accumulation_steps

    def bfloat16_enabled(self) -> bool:
        return self.compute_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.compute_dtype == torch.float16

    def zero_optimization(self) -> bool:
        """Whether ZeRO is on (DeepSpeed's meaning): always, in zero3."""
        return True

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    @property
    def global_samples(self) -> int:
        """Samples trained on, over every rank: one global batch per optimizer step."""
        return self.global_steps * self.batch.train_batch_size

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (False after an fp16 overflow's skip, or a
        non-finite gradient's; reading the latter waits for the step, as `last_grad_norm` does)."""
        if not self._last_step_applied:
            return False
        overflow = self.optimizer.last_overflow if self.optimizer is not None else None
        return overflow is None or not bool(overflow)

    def empty_partition_cache(self) -> None:
        """Release every gathered parameter now, those kept whole by the persistence threshold too, as
        DeepSpeed's does: between steps, e.g. before generation with another model. The next forward
        gathers the persistent ones again."""
        self._check_alive()
        self.parts.check_between_steps("empty_partition_cache")
        self.parts.backward.finish()
        self.parts.coordinator.release_all()
        for unit in self.parts.units:
            unit.release_if_unneeded()
        if self.parts.persistent_unit is not None:
            self.parts.persistent_unit.reshard()  # re-gathered by the next forward
