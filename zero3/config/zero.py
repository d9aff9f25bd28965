"""The `zero_optimization` section (ZeRO stage 3): its offload tiers, leaf modules and DeepSpeed's
deprecated ZeRO keys; and `aio`, the disk tiers' I/O."""

from __future__ import annotations

import logging
import sys
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from zero3.config.base import _KeyedError, _Model, _none_as_empty, _Size

log = logging.getLogger("zero3")


class _OffloadBase(_Model):
    device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    # Page-locked host buffers for the device<->host copies (CUDA only; a warning elsewhere).
    pin_memory: bool = False

    @model_validator(mode="after")
    def _nvme_needs_path(self) -> _OffloadBase:
        if self.device == "nvme" and not self.nvme_path:
            raise _KeyedError(
                ("nvme_path",), "required when device is 'nvme'", (self.nvme_path,)
            )
        return self


class OffloadParamConfig(_OffloadBase):
    """ZeRO-Infinity parameter offload: the 16-bit shards live on the host or on disk."""

    # Host buffers a disk tier streams shards through (each `buffer_size` elements).
    buffer_count: int = Field(default=5, gt=0)
    buffer_size: _Size = Field(default=100_000_000, gt=0)
    # With device 'nvme': this many shard elements stay in host memory, the rest on disk.
    max_in_cpu: _Size = Field(default=1_000_000_000, ge=0)


class OffloadOptimizerConfig(_OffloadBase):
    """ZeRO-Offload / ZeRO-Infinity optimizer offload: fp32 masters and moments on the host or on disk."""

    # Sub-group windows a disk tier streams the optimizer state through (read ahead, write behind).
    buffer_count: int = Field(default=4, gt=1)
    # The fraction of the optimizer state offloaded (DeepSpeed's partial offload); the rest stays
    # on the device.
    ratio: float = Field(default=1.0, gt=0, le=1)
    # Accepted for DeepSpeed configs: reads and writes always overlap the step here.
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    # DeepSpeed's SuperOffload switch: the host step of each sub-group begins during the backward, as its
    # gradients land, and is kept or undone exactly at the step (zero3.step.early_step).
    super_offload: bool = False
    # DeepSpeed's share of the host's cores for its CPU Adam under SuperOffload (torch's threads step here).
    cpuadam_cores_perc: float = Field(default=0.8, gt=0, le=1)


class AioConfig(_Model):
    """The disk tier's I/O (DeepSpeed's `aio` section): request size, requests in flight, threads."""

    block_size: _Size = Field(default=1_048_576, gt=0)
    queue_depth: int = Field(default=8, gt=0)
    thread_count: int = Field(default=1, gt=0)
    # Accepted for DeepSpeed configs (libaio submission details; requests are always overlapped).
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False

    @field_validator("block_size")
    @classmethod
    def _whole_pages(cls, block_size: int) -> int:
        if block_size % 4096:
            raise ValueError("must be a multiple of 4096 bytes")
        return block_size


class LeafModuleConfig(_Model):
    """zero_optimization.leaf_module: modules gathered as one unit (zero3.partition.leaf_modules), by
    class name (`Block` or `pkg.module.Block`), by `named_modules()` name, or by name suffix."""

    classes: list[str] = []
    names: list[str] = []
    name_suffixes: list[str] = []


def _to_device_cpu(key: str) -> Any:
    def translate(value: Any, data: dict[str, Any]) -> tuple[str | None, Any]:
        if value is True and data.get(key) is None:
            return key, {"device": "cpu"}
        return None, value  # false, or the new key given as well: it stands

    return translate


# DeepSpeed's deprecated ZeRO keys: (the key that replaces it, how a value translates).
_DEPRECATED_ZERO_KEYS: dict[str, tuple[str, Any]] = {
    "cpu_offload": ("offload_optimizer", _to_device_cpu("offload_optimizer")),
    "cpu_offload_param": ("offload_param", _to_device_cpu("offload_param")),
    "cpu_offload_use_pin_memory": ("offload_param.pin_memory or offload_optimizer.pin_memory",
                                   lambda value, data: (None, value)),  # DeepSpeed only warns
    "stage3_gather_fp16_weights_on_model_save": (
        "stage3_gather_16bit_weights_on_model_save",
        lambda value, data: ("stage3_gather_16bit_weights_on_model_save", value),
    ),
}


def _both_names(name: str) -> Any:
    """DeepSpeed's ZeRO keys come with and without their `stage3_` prefix (its `populate_by_name`)."""
    return AliasChoices(name, name.removeprefix("stage3_"))


class ZeroConfig(_Model):
    """Every key of DeepSpeed's `DeepSpeedZeroConfig`, under both its names; what each does in zero3
    is DEEPSPEED_KEYS' row for it (implemented, translated, or accepted with no effect)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, populate_by_name=True)

    stage: int = 3
    stage3_param_persistence_threshold: _Size = Field(
        default=100_000, ge=0, validation_alias=_both_names("stage3_param_persistence_threshold"))
    stage3_model_persistence_threshold: _Size = Field(
        default=sys.maxsize, ge=0, validation_alias=_both_names("stage3_model_persistence_threshold"))
    stage3_prefetch_bucket_size: _Size = Field(
        default=50_000_000, ge=0, validation_alias=_both_names("stage3_prefetch_bucket_size"))
    stage3_max_live_parameters: _Size = Field(
        default=1_000_000_000, gt=0, validation_alias=_both_names("stage3_max_live_parameters"))
    stage3_max_reuse_distance: _Size = Field(
        default=1_000_000_000, ge=0, validation_alias=_both_names("stage3_max_reuse_distance"))
    stage3_module_granularity_threshold: _Size = Field(
        default=0, ge=0, validation_alias=_both_names("stage3_module_granularity_threshold"))
    stage3_use_all_reduce_for_fetch_params: bool = Field(
        default=False, validation_alias=_both_names("stage3_use_all_reduce_for_fetch_params"))
    stage3_allgather_sequential: bool = Field(
        default=False, validation_alias=_both_names("stage3_allgather_sequential"))
    stage3_gather_16bit_weights_on_model_save: bool = Field(
        default=False, validation_alias=_both_names("stage3_gather_16bit_weights_on_model_save"))
    reduce_bucket_size: _Size = Field(default=500_000_000, gt=0)
    reduce_scatter: bool = True
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    sub_group_size: _Size = Field(default=1_000_000_000, gt=0)
    ignore_unused_parameters: bool = True
    enable_sanity_checks: bool = False
    offload_param: Annotated[OffloadParamConfig, BeforeValidator(_none_as_empty)] = (
        OffloadParamConfig()
    )
    offload_optimizer: Annotated[OffloadOptimizerConfig, BeforeValidator(_none_as_empty)] = (
        OffloadOptimizerConfig()
    )
    # Accepted with no effect in zero3 (DEEPSPEED_KEYS says why); validated for type.
    allgather_partitions: bool = True
    allgather_bucket_size: _Size = Field(default=500_000_000, ge=0)
    use_multi_rank_bucket_allreduce: bool = True
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    legacy_stage1: bool = False
    round_robin_gradients: bool = False
    parameter_alignment: bool = False
    memory_efficient_linear: bool = True
    pipeline_loading_checkpoint: bool = False
    override_module_apply: bool = True
    log_trace_cache_warnings: bool = False
    save_muon_momentum_buffer_in_memory: bool = False
    compute_grad_norm: bool = True
    # MiCS (DeepSpeed's keys): every state sharded within groups of this many ranks, the groups
    # replicas of each other (-1: the whole job is one shard group). zero3.topology checks the size
    # against the world.
    mics_shard_size: int = Field(default=-1, ge=-1)
    mics_hierarchical_params_gather: bool = False
    # hpZ (DeepSpeed's key): after a forward each rank keeps a secondary 16-bit shard within groups of
    # this many consecutive ranks (a node), and the backward gathers from those (1 or 0: off).
    # zero3.topology checks it against the shard group and the node.
    zero_hpz_partition_size: int = Field(default=1, ge=0)
    # ZeRO++'s qwZ (DeepSpeed's keys): parameter all-gathers carry int8 blocks with a scale each, for every
    # unit, or for the frozen ones only; the shards, masters and every path that keeps weights stay exact.
    zero_quantized_weights: bool = False
    zero_quantized_nontrainable_weights: bool = False
    # ZeRO++'s qgZ: each gradient reduce-scatter is two int4 all-to-alls, inside the node, then across.
    zero_quantized_gradients: bool = False
    # zero3's own: no resident 16-bit shards for the trained parameters; each gather casts them from the
    # fp32 masters (zero3.partition.lean's Note). Off by default: DeepSpeed's layout.
    lean_memory: bool = False
    zenflow: dict[str, Any] | None = None
    leaf_module: LeafModuleConfig = LeafModuleConfig()

    @model_validator(mode="before")
    @classmethod
    def _deprecated_names(cls, data: Any) -> Any:
        """DeepSpeed's deprecated keys, translated as DeepSpeed translates them (one warning each); a key
        given under both its names is refused (one would silently win)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for name, field in cls.model_fields.items():
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                given = [choice for choice in alias.choices if choice in data]
                if len(given) > 1:
                    raise _KeyedError(tuple(given), "the same key under both its names; give one",
                                      tuple(data[key] for key in given))
        for old, (new, translate) in _DEPRECATED_ZERO_KEYS.items():
            if old not in data:
                continue
            value = data.pop(old)
            target, translated = translate(value, data)
            log.warning("config key zero_optimization.%s is deprecated (DeepSpeed's name); read as %s", old,
                        f"zero_optimization.{new}" if target is None else f"zero_optimization.{target}={translated!r}")
            if target is not None:
                data[target] = translated
        return data

    @field_validator("mics_shard_size")
    @classmethod
    def _a_group_size_or_off(cls, size: int) -> int:
        if size == 0:
            raise ValueError("expected -1 (one shard group of every rank) or a positive number of ranks per group")
        return size

    @field_validator("stage")
    @classmethod
    def _stage_3_only(cls, stage: int) -> int:
        if stage != 3:
            raise ValueError("zero3 implements ZeRO stage 3 only")
        return stage

    @model_validator(mode="after")
    def _not_offered(self) -> ZeroConfig:
        unsupported = {
            "compute_grad_norm": (not self.compute_grad_norm,
                                  "DeepSpeed allows compute_grad_norm=false with ZeRO stage 1 or 2 only"),
            "zenflow": (self.zenflow is not None, "ZenFlow (stale-gradient offload) is not offered"),
        }
        for key, (refused, why) in unsupported.items():
            if refused:
                raise _KeyedError((key,), why, (getattr(self, key),))
        if self.lean_memory and self.offload_param.device != "none":
            raise _KeyedError(("lean_memory", "offload_param.device"),
                              "lean_memory keeps no 16-bit shards for offload_param to page out; use one or the "
                              "other", (True, self.offload_param.device))
        if self.offload_optimizer.super_offload and self.offload_optimizer.device != "cpu":
            raise _KeyedError(("offload_optimizer.super_offload", "offload_optimizer.device"),
                              "super_offload steps the optimizer on the host during the backward: it needs "
                              "offload_optimizer.device 'cpu'", (True, self.offload_optimizer.device))
        if self.offload_optimizer.super_offload and self.lean_memory:
            raise _KeyedError(("offload_optimizer.super_offload", "lean_memory"),
                              "lean_memory casts the backward's gathers from the fp32 masters, which super_offload "
                              "steps during that backward; use one or the other", (True, True))
        if self.lean_memory and self.offload_optimizer.device == "nvme":
            raise _KeyedError(("lean_memory", "offload_optimizer.device"),
                              "lean_memory casts each gather from the fp32 masters, which offload_optimizer.device="
                              "'nvme' keeps on disk between steps; use 'cpu' or 'none' with it", (True, "nvme"))
        return self
