"""Batch arithmetic: the three batch sizes, any two of which fix the third (DeepSpeed's rule)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from zero3.config.base import ConfigError

log = logging.getLogger("zero3")


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes: train_batch_size = micro * gas * world_size."""

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(
    train: int | None, micro: int | None, gas: int | None, world_size: int, resume: bool
) -> BatchSizes:
    """Fill in the missing batch sizes the way DeepSpeed does.

    train_batch_size = train_micro_batch_size_per_gpu
                       * gradient_accumulation_steps * world_size

    `train`, `micro` and `gas` are the config's train_batch_size, train_micro_batch_size_per_gpu and
    gradient_accumulation_steps (None: not set); `resume` is its checkpoint.resume.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int (got {world_size!r})")

    def _divide(total: int, divisor: int, what: str, given: str) -> int:
        if total % divisor:
            raise ConfigError(
                f"train_batch_size ({total}) is not divisible by {given}, "
                f"so {what} would not be a whole number"
            )
        return total // divisor

    if (train is not None and micro is not None and gas is not None and train != micro * gas * world_size
            and resume and train % (micro * world_size) == 0):
        # A job that resumes may come back on another world (a restart with fewer or more ranks): its
        # global batch is kept by the accumulation, as when gradient_accumulation_steps is left out.
        log.warning(
            "gradient_accumulation_steps=%d gives a global batch of %d at world size %d; "
            "train_batch_size=%d is kept with %d (checkpoint.resume: the world may change between runs)",
            gas, micro * gas * world_size, world_size, train, train // (micro * world_size),
        )
        gas = None
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world_size:
            raise ConfigError(
                "train_batch_size must equal train_micro_batch_size_per_gpu * "
                "gradient_accumulation_steps * world_size "
                f"(got train_batch_size={train}, train_micro_batch_size_per_gpu={micro}, "
                f"gradient_accumulation_steps={gas}, world_size={world_size}: "
                f"{micro} * {gas} * {world_size} = {micro * gas * world_size})"
            )
    elif train is not None and micro is not None:
        gas = _divide(
            train,
            micro * world_size,
            "gradient_accumulation_steps",
            f"train_micro_batch_size_per_gpu * world_size = {micro} * {world_size}"
            f" = {micro * world_size}",
        )
    elif train is not None and gas is not None:
        micro = _divide(
            train,
            gas * world_size,
            "train_micro_batch_size_per_gpu",
            f"gradient_accumulation_steps * world_size = {gas} * {world_size}"
            f" = {gas * world_size}",
        )
    elif train is not None:
        gas = 1
        micro = _divide(
            train, world_size, "train_micro_batch_size_per_gpu", f"world_size = {world_size}"
        )
    elif micro is not None:
        gas = gas if gas is not None else 1
        train = micro * gas * world_size
    elif gas is not None:
        raise ConfigError(
            f"gradient_accumulation_steps={gas} alone does not fix the batch size: "
            "also set train_micro_batch_size_per_gpu or train_batch_size"
        )
    else:
        micro, gas = 1, 1
        train = world_size
    assert train is not None and micro is not None and gas is not None
    return BatchSizes(train, micro, gas)
