"""`deepspeed.utils`: the `safe_*` accessors, the z3 leaf functions, `logger` and `log_dist`."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch.distributed as dist

from zero3 import (
    get_z3_leaf_modules,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from zero3.deepspeed.utils import zero_to_fp32

logger = logging.getLogger("zero3")  # the engine's own messages go here too

__all__ = [
    "get_z3_leaf_modules", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
    "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
    "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
    "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
    "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized", "set_z3_leaf_module",
    "set_z3_leaf_modules", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "unset_z3_leaf_modules",
    "z3_leaf_module", "z3_leaf_parameter", "zero_to_fp32",
]


def log_dist(message: str, ranks: Iterable[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the given ranks (DeepSpeed's default: rank 0; `[-1]`: every rank)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    chosen = list(ranks) if ranks is not None else [0]
    if -1 in chosen or rank in chosen:
        logger.log(level, "[Rank %d] %s", rank, message)
