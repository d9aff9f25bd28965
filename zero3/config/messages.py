"""The startup messages: one line per key the user set that zero3 accepts but does not act on
(`Zero3Config.inert_settings` and `ignored_settings`; `initialize` logs them)."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

from zero3.config.base import _show
from zero3.config.keys import _NOTED_ELSEWHERE, DEEPSPEED_KEYS
from zero3.config.optimizer import AdamConfig, OptimizerConfig
from zero3.config.zero import AioConfig, ZeroConfig


class _Settings(Protocol):
    """What `ignored_settings` reads of the whole config (zero3.config.model's `Zero3Config`)."""

    zero_optimization: ZeroConfig
    aio: AioConfig
    optimizer: OptimizerConfig | None
    prescale_gradients: bool
    gradient_predivide_factor: float

    @property
    def model_fields_set(self) -> set[str]: ...


def inert_settings(config: BaseModel) -> list[str]:
    """One line per DeepSpeed key the user set that does nothing in zero3, and why (DEEPSPEED_KEYS)."""
    lines = []
    for path, (fate, why) in DEEPSPEED_KEYS.items():
        if fate != "no effect" or path in _NOTED_ELSEWHERE:
            continue
        owner: BaseModel = config
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        if name in owner.model_fields_set:
            lines.append(f"config key {path}={_show(getattr(owner, name))} has no effect in zero3: {why}")
    return lines


def ignored_settings(config: _Settings) -> list[str]:
    """One message per key the user set that zero3 accepts (for DeepSpeed configs) but does not act on."""
    zc = config.zero_optimization
    notes: list[str] = []

    def note(key: str, value: Any, why: str) -> None:
        notes.append(f"config key {key}={_show(value)} has no effect in zero3: {why}")

    if "stage3_max_reuse_distance" in zc.model_fields_set:
        note("zero_optimization.stage3_max_reuse_distance", zc.stage3_max_reuse_distance,
             "a unit is released as soon as nothing holds it, and gathered again ahead of its next use "
             "along the recorded order (stage3_prefetch_bucket_size bounds how far ahead)")
    if "contiguous_gradients" in zc.model_fields_set and not zc.contiguous_gradients:
        note("zero_optimization.contiguous_gradients", False,
             "gradients always reduce into one flat buffer per rank")
    if "stage3_gather_16bit_weights_on_model_save" in zc.model_fields_set:
        note("zero_optimization.stage3_gather_16bit_weights_on_model_save",
             zc.stage3_gather_16bit_weights_on_model_save,
             "save_16bit_model always writes the whole model, gathering one parameter at a time")
    tiers = (("offload_param", zc.offload_param), ("offload_optimizer", zc.offload_optimizer))
    for key, tier in tiers:
        if tier.device == "none":
            for field in sorted(tier.model_fields_set - {"device"}):
                note(f"zero_optimization.{key}.{field}", getattr(tier, field), f"{key}.device is 'none'")
            continue
        if tier.device == "cpu" and tier.nvme_path is not None:
            note(f"zero_optimization.{key}.nvme_path", tier.nvme_path, f"{key}.device is 'cpu'")
    for field in ("pipeline_read", "pipeline_write", "fast_init"):
        if field in zc.offload_optimizer.model_fields_set and zc.offload_optimizer.device != "none":
            note(f"zero_optimization.offload_optimizer.{field}", getattr(zc.offload_optimizer, field),
                 "zero3 always reads the next sub-group and writes the last one while a sub-group steps")
    for field in ("single_submit", "overlap_events", "use_gds"):
        if field in config.aio.model_fields_set:
            note(f"aio.{field}", getattr(config.aio, field),
                 "zero3's disk I/O keeps aio.queue_depth requests in flight on aio.thread_count threads")
    if isinstance(config.optimizer, AdamConfig) and "torch_adam" in config.optimizer.params.model_fields_set:
        note("optimizer.params.torch_adam", config.optimizer.params.torch_adam,
             "zero3 always steps torch's own fused Adam/AdamW kernel (on the host too)")
    if "gradient_predivide_factor" in config.model_fields_set and config.prescale_gradients:
        note("gradient_predivide_factor", config.gradient_predivide_factor,
             "prescale_gradients is true, which divides by the world size before the sum")
    return notes
