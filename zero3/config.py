"""The DeepSpeed-style JSON configuration, as frozen pydantic models.

Key names and defaults follow DeepSpeed so an existing ``ds_config.json`` for a
stage-3 run loads unchanged. Validation is deliberately strict (unknown keys and
wrong types are errors, never silently coerced) because a typo in a training
config otherwise costs a whole run. ``load_config`` is the entry point: it turns
every pydantic error into one readable ``ConfigError``.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

log = logging.getLogger("zero3")

__all__ = [
    "BatchSizes",
    "BF16Config",
    "CheckpointConfig",
    "FaultToleranceConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "AdamConfig",
    "LionConfig",
    "MuonConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerParams",
    "LRRangeTestConfig",
    "LRRangeTestParams",
    "OneCycleConfig",
    "OneCycleParams",
    "SchedulerConfig",
    "TorchOptimizerConfig",
    "WarmupCosineLRConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRConfig",
    "WarmupDecayLRParams",
    "WarmupLRConfig",
    "WarmupLRParams",
    "Zero3Config",
    "ZeroConfig",
    "load_config",
]


class ConfigError(ValueError):
    """An invalid zero3 / DeepSpeed configuration."""


class _KeyedError(ValueError):
    """A validator error that names its own keys (relative to where it is raised).

    Pydantic locates a model-validator error at the model, not at the fields it
    is about; ``_format_errors`` uses ``keys`` to print the real key paths.
    """

    def __init__(self, keys: tuple[str, ...], message: str, values: tuple[Any, ...]) -> None:
        super().__init__(message)
        self.keys = keys
        self.message = message
        self.values = values


def _whole_number(value: Any) -> Any:
    # DeepSpeed configs write sizes as 5e8, which JSON parses as a float; accept
    # it when it is a whole number, but never truncate 1.5 to 1.
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise ValueError("expected a whole number")
    return value


def _never_if_infinite(value: Any) -> Any:
    # float("inf") (JSON's Infinity) is how accelerate turns DeepSpeed's progress line off.
    if isinstance(value, float) and value == math.inf:
        return None
    return _whole_number(value)


# Integer byte/element counts that may be written as whole floats (5e8).
_Size = Annotated[int, BeforeValidator(_whole_number)]


class _Model(BaseModel):
    # strict: no str->int or bool->int coercion (ints are still accepted for
    # floats); allow_inf_nan=False because Python's json accepts NaN/Infinity.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


# --------------------------------------------------------------------- optimizer

_ADAM_TYPES = ("Adam", "AdamW")
# zero3's own optimizer types; any other type names a torch.optim class.
_OWN_TYPES = (*_ADAM_TYPES, "Lion")
# torch.optim classes whose update is elementwise (LBFGS, SparseAdam, Adafactor and Muon are not).
TORCH_ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta"}
)


class OptimizerParams(_Model):
    lr: float = Field(default=1e-3, gt=0)
    # strict=False only so a JSON list is accepted for the tuple; the items are
    # still strict floats.
    betas: Annotated[tuple[float, float], Field(strict=False)] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    # The type-dependent default (0.01 for AdamW) is filled in by OptimizerConfig.
    weight_decay: float = Field(default=0.0, ge=0)
    # DeepSpeed picks torch's Adam over its fused kernel with this; zero3 always
    # uses torch's implementation, so it is accepted and ignored.
    torch_adam: bool = False
    adam_w_mode: bool | None = None

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for beta in betas:
            if not 0.0 <= beta < 1.0:
                raise ValueError("each beta must be in [0, 1)")
        return betas


class AdamConfig(_Model):
    """DeepSpeed's Adam and AdamW (its "Adam" decouples weight decay unless adam_w_mode is false)."""

    type: Literal["Adam", "AdamW"]
    params: OptimizerParams = OptimizerParams()

    @model_validator(mode="before")
    @classmethod
    def _canonical_type_and_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)  # never mutate the caller's config
        kind = data.get("type")
        if isinstance(kind, str):
            canonical = {t.lower(): t for t in _ADAM_TYPES}.get(kind.lower())
            if canonical is None:
                raise _KeyedError(
                    ("type",),
                    f"unknown optimizer type; supported: {', '.join(_ADAM_TYPES)}",
                    (kind,),
                )
            data["type"] = canonical
            params = data.get("params")
            # torch.optim.AdamW defaults weight_decay to 0.01, Adam to 0.
            if canonical == "AdamW" and isinstance(params, dict) and "weight_decay" not in params:
                data["params"] = {**params, "weight_decay": 0.01}
            elif canonical == "AdamW" and "params" not in data:
                data["params"] = {"weight_decay": 0.01}
        return data

    @model_validator(mode="after")
    def _mode_consistent(self) -> AdamConfig:
        if self.type == "AdamW" and self.params.adam_w_mode is False:
            raise _KeyedError(
                ("params.adam_w_mode",),
                "AdamW always decouples weight decay; use type Adam for L2-style decay",
                (False,),
            )
        return self

    @property
    def decoupled_weight_decay(self) -> bool:
        """Whether to apply AdamW-style (decoupled) weight decay.

        DeepSpeed's ``"Adam"`` is AdamW unless ``adam_w_mode`` is false, so a
        DeepSpeed config keeps its meaning here.
        """
        if self.type == "AdamW":
            return True
        return True if self.params.adam_w_mode is None else self.params.adam_w_mode


def _named(data: Any, canonical: str) -> Any:
    """The section with its `type` spelled as zero3 does (the type is matched case-insensitively)."""
    if isinstance(data, dict) and isinstance(data.get("type"), str):
        data = {**data, "type": canonical}
    return data


class LionParams(_Model):
    lr: float = Field(default=1e-4, gt=0)
    betas: Annotated[tuple[float, float], Field(strict=False)] = (0.9, 0.99)
    weight_decay: float = Field(default=0.0, ge=0)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for beta in betas:
            if not 0.0 <= beta <= 1.0:
                raise ValueError("each beta must be in [0, 1]")
        return betas


class LionConfig(_Model):
    """zero3.optim.Lion: the sign of an interpolated momentum."""

    type: Literal["Lion"]
    params: LionParams = LionParams()

    _canonical_type = model_validator(mode="before")(classmethod(lambda cls, data: _named(data, "Lion")))


class MuonParams(_Model):
    # torch.optim.Muon's names and defaults, with DeepSpeed's muon_lr / adam_lr beside them.
    lr: float = Field(default=1e-3, gt=0)
    muon_lr: float | None = Field(default=None, gt=0)  # the matrices' lr (default: lr)
    adam_lr: float | None = Field(default=None, gt=0)  # every other parameter's AdamW lr (default: lr)
    momentum: float = Field(default=0.95, ge=0, lt=1)
    weight_decay: float = Field(default=0.1, ge=0)
    nesterov: bool = True
    ns_method: Literal["standard"] = "standard"  # torch's Newton-Schulz iteration
    ns_steps: int = Field(default=5, gt=0, lt=100)
    ns_coefficients: Annotated[tuple[float, float, float], Field(strict=False)] = (3.4445, -4.775, 2.0315)
    eps: float = Field(default=1e-7, gt=0)
    adjust_lr_fn: Literal["original", "match_rms_adamw"] | None = None


class MuonConfig(_Model):
    """Muon for the hidden weight matrices, AdamW for every other parameter (zero3.optim.muon)."""

    type: Literal["Muon"]
    params: MuonParams = MuonParams()

    _canonical_type = model_validator(mode="before")(classmethod(lambda cls, data: _named(data, "Muon")))


def _torch_optimizer_names() -> dict[str, str]:
    return {
        name.lower(): name for name in dir(torch.optim)
        if isinstance(getattr(torch.optim, name), type) and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
        and name != "Optimizer"
    }


class TorchOptimizerConfig(_Model):
    """Any other type names a torch.optim class (as in DeepSpeed), with its constructor's keyword
    arguments as `params`; its update must be elementwise (see zero3.optim.spec)."""

    type: str
    params: dict[str, Any] = {}

    @model_validator(mode="before")
    @classmethod
    def _torch_class_and_arguments(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kind = data.get("type")
        if not isinstance(kind, str):
            return data
        canonical = _torch_optimizer_names().get(kind.lower())
        if canonical is None:
            raise _KeyedError(
                ("type",),
                f"unknown optimizer type; zero3's own: {', '.join((*_OWN_TYPES, 'Muon'))}; or a torch.optim class",
                (kind,),
            )
        if canonical not in TORCH_ELEMENTWISE:
            raise _KeyedError(
                ("type",),
                f"torch.optim.{canonical} is not elementwise: zero3 steps each rank's shard of a parameter on its "
                f"own (elementwise torch types: {', '.join(sorted(TORCH_ELEMENTWISE))})",
                (kind,),
            )
        params = data.get("params", {})
        if not isinstance(params, dict):
            return data  # the field's own error
        optimizer_cls = getattr(torch.optim, canonical)
        accepted = [name for name in inspect.signature(optimizer_cls.__init__).parameters if name not in ("self", "params")]
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise _KeyedError(
                tuple(f"params.{key}" for key in unknown),
                f"not an argument of torch.optim.{canonical} (its arguments: {', '.join(accepted)})",
                tuple(params[key] for key in unknown),
            )
        params = {key: tuple(value) if isinstance(value, list) else value for key, value in params.items()}
        try:
            optimizer_cls([torch.zeros(1, requires_grad=True)], **params)
        except (ValueError, TypeError, RuntimeError) as error:
            raise _KeyedError(("params",), f"torch.optim.{canonical} refuses them: {error}", (params,)) from None
        return {**data, "type": canonical, "params": params}


def _optimizer_kind(data: Any) -> str | None:
    kind = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
    if not isinstance(kind, str):
        return None
    lowered = kind.lower()
    if lowered in ("adam", "adamw"):
        return "adam"
    if lowered in ("lion", "muon"):
        return lowered
    return "torch"


_UNION_TAGS = frozenset({"adam", "lion", "muon", "torch"})

# The `optimizer` section: by its `type`, DeepSpeed's Adam family, Lion, Muon, or a torch.optim class.
OptimizerConfig = Annotated[
    Annotated[AdamConfig, Tag("adam")] | Annotated[LionConfig, Tag("lion")] | Annotated[MuonConfig, Tag("muon")]
    | Annotated[TorchOptimizerConfig, Tag("torch")],
    Discriminator(_optimizer_kind),
]


# --------------------------------------------------------------------- scheduler
# DeepSpeed's five schedulers (deepspeed/runtime/lr_schedules.py), with its key names and defaults.

_WarmupType = Literal["log", "linear"]


def _per_group(low: float, high: float | None = None) -> Any:
    """A number, or a list of one number per param group (DeepSpeed's "float or list"), in [low, high)."""
    bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g})"

    def check(value: Any) -> Any:
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
            raise ValueError("expected a number, or a list of one number per param group")
        if not all(math.isfinite(v) and v >= low and (high is None or v < high) for v in values):
            raise ValueError(f"expected {'numbers' if isinstance(value, list) else 'a number'} {bound}")
        return [float(v) for v in values] if isinstance(value, list) else float(value)

    return Annotated[float | list[float], BeforeValidator(check)]


_GroupLr = _per_group(0.0)
_GroupMomentum = _per_group(0.0, 1.0)
# DeepSpeed (0.19.3 on) refuses a warmup of 0 steps; its log and linear warmups last at least 2 steps.
_WarmupSteps = Annotated[int, Field(gt=0)]


def _warmup_within_total(warmup_num_steps: int, total_num_steps: int) -> None:
    if warmup_num_steps > total_num_steps:
        raise _KeyedError(
            ("warmup_num_steps",), f"must not exceed total_num_steps ({total_num_steps})", (warmup_num_steps,)
        )


class LRRangeTestParams(_Model):
    lr_range_test_min_lr: _GroupLr = 0.001
    lr_range_test_step_size: int = Field(default=2000, gt=0)
    lr_range_test_step_rate: float = Field(default=1.0, ge=0)
    lr_range_test_staircase: bool = False


class OneCycleParams(_Model):
    cycle_min_lr: _GroupLr
    cycle_max_lr: _GroupLr
    decay_lr_rate: float = Field(default=0.0, ge=0)
    cycle_first_step_size: _Size = Field(default=2000, gt=0)
    cycle_second_step_size: _Size | None = Field(default=None, ge=0)  # None: cycle_first_step_size
    # 0, or DeepSpeed's command-line default -1: no stairs (lr and momentum move every step).
    cycle_first_stair_count: int = Field(default=0, ge=-1)
    cycle_second_stair_count: int | None = Field(default=None, ge=-1)  # None: cycle_first_stair_count
    decay_step_size: _Size = Field(default=0, ge=0)  # 0: no decay after the cycle
    cycle_momentum: bool = True
    cycle_min_mom: _GroupMomentum = 0.8
    cycle_max_mom: _GroupMomentum = 0.9
    decay_mom_rate: float = Field(default=0.0, ge=0)


class WarmupLRParams(_Model):
    warmup_min_lr: _GroupLr = 0.0
    warmup_max_lr: _GroupLr | None = None  # None: each param group's own lr (DeepSpeed 0.17.2 on)
    warmup_num_steps: _WarmupSteps = 1000
    warmup_type: _WarmupType = "log"


class WarmupDecayLRParams(_Model):
    total_num_steps: int = Field(gt=0)
    warmup_min_lr: _GroupLr = 0.0
    warmup_max_lr: _GroupLr = 0.001
    warmup_num_steps: _WarmupSteps = 1000
    warmup_type: _WarmupType = "log"

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupDecayLRParams:
        _warmup_within_total(self.warmup_num_steps, self.total_num_steps)
        return self


class WarmupCosineLRParams(_Model):
    total_num_steps: int = Field(gt=0)
    warmup_min_ratio: float = Field(default=0.0, ge=0, le=1)
    warmup_num_steps: _WarmupSteps = 1000
    cos_min_ratio: float = Field(default=0.0001, ge=0, le=1)
    warmup_type: _WarmupType = "log"

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupCosineLRParams:
        _warmup_within_total(self.warmup_num_steps, self.total_num_steps)
        return self


class _SchedulerBase(_Model):
    @model_validator(mode="before")
    @classmethod
    def _params_default(cls, data: Any) -> Any:
        # An absent "params" is validated as {} so a missing required parameter
        # is reported as scheduler.params.<name>, not as a missing "params".
        if isinstance(data, dict) and "params" not in data:
            return {**data, "params": {}}
        return data


class LRRangeTestConfig(_SchedulerBase):
    type: Literal["LRRangeTest"]
    params: LRRangeTestParams


class OneCycleConfig(_SchedulerBase):
    type: Literal["OneCycle"]
    params: OneCycleParams


class WarmupLRConfig(_SchedulerBase):
    type: Literal["WarmupLR"]
    params: WarmupLRParams


class WarmupDecayLRConfig(_SchedulerBase):
    type: Literal["WarmupDecayLR"]
    params: WarmupDecayLRParams


class WarmupCosineLRConfig(_SchedulerBase):
    type: Literal["WarmupCosineLR"]
    params: WarmupCosineLRParams


# Discriminated on "type", so each type's params are validated by their own model.
SchedulerConfig = Annotated[
    LRRangeTestConfig | OneCycleConfig | WarmupLRConfig | WarmupDecayLRConfig | WarmupCosineLRConfig,
    Field(discriminator="type"),
]


# ------------------------------------------------------------------- precision


class BF16Config(_Model):
    enabled: bool = False


class FP16Config(_Model):
    enabled: bool = False
    loss_scale: float = Field(default=0.0, ge=0)  # 0 = dynamic loss scaling
    initial_scale_power: int = Field(default=16, ge=0, le=64)
    loss_scale_window: int = Field(default=1000, gt=0)
    hysteresis: int = Field(default=2, gt=0)
    min_loss_scale: float = Field(default=1.0, gt=0)
    consecutive_hysteresis: bool = False


# ------------------------------------------------------------------ ZeRO stage 3


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
    # gradients land, and is kept or undone exactly at the step (zero3.runtime.early_step).
    super_offload: bool = False
    # DeepSpeed's share of the host's cores for its CPU Adam under SuperOffload (torch's threads step here).
    cpuadam_cores_perc: float = Field(default=0.8, gt=0, le=1)


def _none_as_empty(value: Any) -> Any:
    # DeepSpeed allows "offload_param": null; treat it as "no offload" so the
    # engine never has to test for None.
    return {} if value is None else value


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


# -------------------------------------------------------------- data types

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DtypeName = Literal["fp32", "fp16", "bf16"]


class DataTypesConfig(_Model):
    # The dtype gradients accumulate in across micro-steps (None: the compute dtype).
    grad_accum_dtype: _DtypeName | None = None


# ------------------------------------------------------------------ checkpoint

_ValidationMode = Annotated[
    Literal["IGNORE", "WARN", "FAIL"], BeforeValidator(lambda value: value.upper() if isinstance(value, str) else value)
]


class CheckpointConfig(_Model):
    """The `checkpoint` section: DeepSpeed's keys (accepted; DEEPSPEED_KEYS says what each does here) and
    zero3's automatic checkpoints (`engine.step` saves every `interval_steps`, `zero3.initialize` resumes:
    zero3.runtime.engine_checkpoints' `_save_on_interval` and `resume_from_config`)."""

    # zero3's: save every `interval_steps` optimizer steps into `dir`, keep the newest `keep_last` complete
    # tags, write in the background with `async_save`, and start from the newest one with `resume`.
    dir: str | None = None
    interval_steps: int | None = Field(default=None, gt=0)
    async_save: bool = False
    keep_last: int | None = Field(default=None, gt=0)
    resume: bool = False
    # DeepSpeed's.
    tag_validation: _ValidationMode = "WARN"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] | None = None
    checkpoint_serialization: bool = True
    writer: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _dir_where_needed(self) -> CheckpointConfig:
        for key in ("interval_steps", "resume", "keep_last", "async_save"):
            if key in self.model_fields_set and getattr(self, key) not in (None, False) and self.dir is None:
                raise _KeyedError((key,), "needs checkpoint.dir, the directory the checkpoints live in",
                                  (getattr(self, key),))
        if self.dir is not None and not self.dir.strip():
            raise _KeyedError(("dir",), "expected a directory path", (self.dir,))
        if self.load_universal:
            raise _KeyedError(("load_universal",), "zero3 loads its own checkpoints at any world size with no "
                              "conversion; DeepSpeed's universal checkpoints are not read (use false)", (True,))
        return self

    @property
    def automatic(self) -> bool:
        """Whether the engine saves by itself (every interval_steps)."""
        return self.dir is not None and self.interval_steps is not None


# ------------------------------------------------------------- fault tolerance


class FaultToleranceConfig(_Model):
    """The `fault_tolerance` section: this torchrun job is one replica group of a torchft job
    (zero3.fault_tolerance's Note). The replicas' gradient average runs through torchft's Manager,
    each step commits where its quorum says so, and a group that comes back takes its state from a
    healthy peer."""

    enabled: bool = False
    # This group's name among the replica groups (torchft's replica_id; its trailing digits number it).
    # None: the TORCHFT_REPLICA_ID environment variable.
    replica_id: str | None = None
    # The lighthouse's address (http://host:port); None: the TORCHFT_LIGHTHOUSE environment variable.
    lighthouse: str | None = None
    # Replica groups a step needs to commit (torchft's min_replica_size).
    min_replicas: int = Field(default=1, ge=1)
    # torchft's timeouts: its collectives, should_commit and a recovery's transfer; and forming a quorum.
    timeout_s: float = Field(default=60.0, gt=0)
    quorum_timeout_s: float = Field(default=60.0, gt=0)
    # The quorum forms during the forward (torchft's default); false: before it, so a recovery lands
    # before the step's forward rather than at its commit.
    async_quorum: bool = True
    # torchft's first quorum copies each rank's state from one group to the others, so that groups whose
    # models were initialized differently start equal; false where every group builds the same weights
    # (the same seed), which also lets the first step average every group's gradients.
    init_sync: bool = True

    @model_validator(mode="after")
    def _named(self) -> FaultToleranceConfig:
        if self.replica_id is not None and not self.replica_id.strip():
            raise _KeyedError(("replica_id",), "expected a non-empty name for this replica group", (self.replica_id,))
        if self.lighthouse is not None and not self.lighthouse.strip():
            raise _KeyedError(("lighthouse",), "expected the lighthouse's address, as http://host:port",
                              (self.lighthouse,))
        return self


# ------------------------------------------------------------------- top level


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes: train_batch_size = micro * gas * world_size."""

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


# Keys whose "no effect" note ignored_settings() words itself (it depends on the value).
_NOTED_ELSEWHERE = frozenset({
    "zero_optimization.stage3_max_reuse_distance", "zero_optimization.contiguous_gradients",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save", "zero_optimization.enable_sanity_checks",
})

# [Note: DeepSpeed's keys in zero3]
# Every key of DeepSpeed's ZeRO config (`DeepSpeedZeroConfig`, 0.19.8) and the
# top-level keys ZeRO-3 users write, with what each does here: "implemented"
# (it does what DeepSpeed's does), "translated" (a deprecated name, read as
# DeepSpeed reads it, with a warning), "no effect" (validated for type; one
# info line at initialize says why), or "off only" (a feature zero3 does not
# offer yet: accepted at the value that leaves it off, a clear error
# otherwise). A key given under both of its names (`stage3_x` and `x`) is an
# error. docs/configuration.md prints this table (see [Note: the configuration reference]).
DEEPSPEED_KEYS: dict[str, tuple[str, str]] = {
    "zero_optimization.stage": ("implemented", "3; other stages are refused"),
    "zero_optimization.stage3_param_persistence_threshold": (
        "implemented", "parameters this small stay gathered"),
    "zero_optimization.mics_shard_size": (
        "implemented", "MiCS: every state sharded within groups of this many ranks (consecutive ranks), "
        "replicated across the groups; gradients reduce-scattered in the group each micro-step and "
        "summed across the replicas once per step; -1: one group of every rank. Must divide the world size. The same layout as "
        "`zero3.initialize(mesh=...)` with a 2-D (replicate, shard) DeviceMesh"),
    "zero_optimization.mics_hierarchical_params_gather": (
        "no effect", "zero3 gathers a MiCS shard group's parameters in one all-gather on the group's own "
        "communicator, whose library (NCCL) already routes it across nodes hierarchically"),
    "zero_optimization.stage3_model_persistence_threshold": (
        "implemented", "caps the elements kept gathered in all"),
    "zero_optimization.stage3_prefetch_bucket_size": (
        "implemented", "elements gathered ahead of use"),
    "zero_optimization.stage3_max_live_parameters": (
        "implemented", "elements gathered at once"),
    "zero_optimization.reduce_bucket_size": ("implemented", "elements per gradient reduce-scatter"),
    "zero_optimization.overlap_comm": ("implemented", "reductions overlap backward (two bucket slots)"),
    "zero_optimization.sub_group_size": ("implemented", "elements the optimizer steps at a time"),
    "zero_optimization.offload_param": ("implemented", "the 16-bit parameters on the host or on disk"),
    "zero_optimization.offload_optimizer": ("implemented", "the optimizer state on the host or on disk"),
    "zero_optimization.ignore_unused_parameters": (
        "implemented", "false: a step where a trained parameter got no gradient on any rank raises"),
    "zero_optimization.reduce_scatter": (
        "no effect", "zero3 always reduce-scatters gradients; DeepSpeed's false (an all-reduce, each rank then "
        "keeping its partition) leaves every rank the same gradient shard"),
    "zero_optimization.cpu_offload": ("translated", "true: offload_optimizer.device = 'cpu'"),
    "zero_optimization.cpu_offload_param": ("translated", "true: offload_param.device = 'cpu'"),
    "zero_optimization.cpu_offload_use_pin_memory": (
        "translated", "a warning only, as in DeepSpeed: set offload_*.pin_memory"),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        "translated", "read as stage3_gather_16bit_weights_on_model_save"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "no effect", "save_16bit_model always writes the whole model, gathering one parameter at a time"),
    "zero_optimization.stage3_max_reuse_distance": (
        "no effect", "a unit is released once nothing holds it and gathered again ahead of its next use"),
    "zero_optimization.stage3_module_granularity_threshold": (
        "implemented", "modules with fewer parameter elements per layer become leaf modules (one unit)"),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (
        "no effect", "zero3 fetches parameters with an all-gather, which gives the same values"),
    "zero_optimization.stage3_allgather_sequential": (
        "no effect", "zero3 issues gathers in one agreed order (the lockstep walk)"),
    "zero_optimization.contiguous_gradients": ("no effect", "gradients always reduce into one flat buffer"),
    "zero_optimization.enable_sanity_checks": (
        "no effect", "zero3 checks a unit's holds on every release (a release it does not have is an error)"),
    "zero_optimization.allgather_partitions": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.allgather_bucket_size": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.use_multi_rank_bucket_allreduce": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.legacy_stage1": ("no effect", "a ZeRO stage 1 setting"),
    "zero_optimization.round_robin_gradients": ("no effect", "a ZeRO stage 1/2 setting"),
    "zero_optimization.load_from_fp32_weights": (
        "no effect", "zero3's checkpoints hold the fp32 masters, and a load always reads them"),
    "zero_optimization.elastic_checkpoint": ("no effect", "zero3's checkpoints load at any world size"),
    "zero_optimization.parameter_alignment": ("no effect", "shards are padded to whole elements per rank"),
    "zero_optimization.memory_efficient_linear": (
        "no effect", "backward re-gathers what nn.Linear saved through saved-tensor hooks, for any module"),
    "zero_optimization.pipeline_loading_checkpoint": ("no effect", "a pipeline-parallel setting"),
    "zero_optimization.override_module_apply": (
        "no effect", "module.apply on a partitioned model: gather under zero3.GatheredParameters"),
    "zero_optimization.log_trace_cache_warnings": ("no effect", "zero3 logs trace changes at debug level"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (
        "no effect", "Muon's momentum is a state of zero3's optimizer tier like any other"),
    "zero_optimization.compute_grad_norm": ("off only", "true; false is a ZeRO stage 1/2 setting"),
    "zero_optimization.zero_hpz_partition_size": (
        "implemented", "hpZ: after each forward a secondary 16-bit shard within groups of this many "
        "consecutive ranks (a node), from which the backward gathers on the node; 2P/K bytes per rank; "
        "1 or 0: off. Must divide the shard group (world size, or mics_shard_size) and the ranks per node"),
    "zero_optimization.zero_quantized_weights": (
        "implemented", "ZeRO++ qwZ: every parameter all-gather carries int8 blocks of 256 with an fp32 scale "
        "each (half the bytes of bf16); the shards, masters, checkpoints, exports, iter_full_params and "
        "GatheredParameters (between steps) stay exact"),
    "zero_optimization.zero_quantized_nontrainable_weights": (
        "implemented", "qwZ for the gathers of frozen parameters only (a LoRA base model); the frozen "
        "shards stay 16-bit at rest, so exports and checkpoints stay exact"),
    "zero_optimization.zero_quantized_gradients": (
        "implemented", "ZeRO++ qgZ: each gradient reduce-scatter is an int4 block-quantized all-to-all inside "
        "the node, then one across the nodes (a quarter of bf16's bytes, and only 1/L of them cross); the "
        "reduced gradients, masters and optimizer states stay in their own precision"),
    "zero_optimization.zenflow": ("off only", "absent; ZenFlow is not offered"),
    "zero_optimization.leaf_module": (
        "implemented", "classes, names, name_suffixes: each such module's parameters are one gather unit"),
    "zero_allow_untested_optimizer": ("no effect", "zero3 steps any elementwise torch optimizer"),
    "zero_force_ds_cpu_optimizer": ("no effect", "the host step is torch's fused kernel, not DeepSpeed's"),
    "activation_checkpointing": (
        "implemented", "cpu_checkpointing, synchronize_checkpoint_boundary and profile configure "
        "deepspeed.checkpointing.checkpoint (torch's non-reentrant checkpoint, re-gathered by zero3); "
        "partition_activations and contiguous_memory_optimization are refused (no model parallelism)"),
    "checkpoint.tag_validation": (
        "no effect", "a save always refuses different tags on different ranks (DeepSpeed's \"Fail\")"),
    "checkpoint.load_universal": (
        "off only", "false; zero3's own checkpoints load at any world size with no conversion"),
    "checkpoint.use_node_local_storage": (
        "no effect", "every rank writes its own files; a load at another world size reads other ranks' files, so "
        "the directory must be one every rank can read"),
    "checkpoint.parallel_write": ("no effect", "a pipeline-parallel setting"),
    "checkpoint.checkpoint_serialization": ("no effect", "DCP writes each rank's pieces itself"),
    "checkpoint.writer": ("no effect", "DeepSpeed's checkpoint writers; zero3 writes with DCP (async_save: in the "
                          "background)"),
    "comms_logger": ("no effect", "DeepSpeed's communication logger"),
    "flops_profiler": ("no effect", "DeepSpeed's profiler; use torch.profiler"),
    "tensorboard": ("no effect", "DeepSpeed's monitor; log from the training loop"),
    "wandb": ("no effect", "DeepSpeed's monitor; log from the training loop"),
    "csv_monitor": ("no effect", "DeepSpeed's monitor; log from the training loop"),
    "memory_breakdown": ("no effect", "engine.state_report() and engine.model_state_bytes() say it"),
    "dump_state": ("no effect", "print(engine.state_report())"),
    "amp": ("off only", "enabled false; use bf16 or fp16 (NVIDIA apex AMP is not offered)"),
}


# [Note: the configuration reference]
# docs/configuration.md's key tables are `config_reference()`'s output, and a test keeps the page equal to
# it. Every key of Zero3Config's models has a row, with its default read from the models (an optimizer
# type's from a section that names only the type, so AdamW's weight decay of 0.01 shows) and what it does
# here: DEEPSPEED_KEYS' entry, else CONFIG_KEYS' (DeepSpeed's other keys, and zero3's own, whose fate is
# "zero3"). A key with neither entry, or an entry that names no key, fails the generator, so a key cannot
# be added undocumented. A sub-model's entry (`checkpoint`, `zero_optimization.offload_param`) is the
# sentence under its table's heading.
CONFIG_KEYS: dict[str, tuple[str, str]] = {
    "train_batch_size": (
        "implemented", "the global batch: micro batch x accumulation steps x world size; null: computed from "
        "the other two (DeepSpeed's arithmetic; any two of the three fix the third)"),
    "train_micro_batch_size_per_gpu": (
        "implemented", "samples per rank per forward and backward; null: from the other two, and 1 when none "
        "of the three is set"),
    "gradient_accumulation_steps": (
        "implemented", "micro-steps per optimizer step: `engine.step()` steps the optimizer at every N-th call, "
        "and `engine.backward` divides the loss by N; null: from the other two, else 1"),
    "gradient_clipping": (
        "implemented", "clip the gradients to this global norm, taken across every rank's shards; 0: no "
        "clipping"),
    "optimizer": (
        "implemented", "`{\"type\": ..., \"params\": {...}}` ([types](#optimizer-types)); null: none, unless "
        "`initialize` gets a client `optimizer=` (not both)"),
    "scheduler": (
        "implemented", "`{\"type\": ..., \"params\": {...}}` ([types](#scheduler-types)), stepped after every "
        "optimizer step but one an fp16 overflow skipped; null: none, unless `initialize` gets `lr_scheduler=` "
        "(a factory called with the engine's optimizer)"),
    "bf16": ("implemented", "bf16 compute: 16-bit shards, gathers and gradients in bf16, fp32 masters"),
    "bf16.enabled": ("implemented", "compute in bf16 (at most one of bf16 and fp16; neither: fp32)"),
    "fp16": ("implemented", "fp16 compute with a loss scale, dynamic unless `loss_scale` is set"),
    "fp16.enabled": ("implemented", "compute in fp16"),
    "fp16.loss_scale": ("implemented", "0: a dynamic loss scale; above 0: this static scale"),
    "fp16.initial_scale_power": ("implemented", "the dynamic scale starts at 2 to this power"),
    "fp16.loss_scale_window": (
        "implemented", "steps without an overflow after which the dynamic scale doubles"),
    "fp16.hysteresis": (
        "implemented", "the dynamic scale halves at the N-th overflow (each overflow skips its step); the count "
        "starts again when the scale grows"),
    "fp16.min_loss_scale": ("implemented", "the dynamic scale never falls below this"),
    "fp16.consecutive_hysteresis": (
        "implemented", "true: any step without an overflow starts the `hysteresis` count again, so only "
        "consecutive overflows halve the scale"),
    "zero_optimization": ("implemented", "ZeRO's settings; stage 3 only"),
    "zero_optimization.offload_param.device": (
        "implemented", "`cpu`: the 16-bit shards in host memory; `nvme`: up to `max_in_cpu` elements of them in "
        "host memory, the rest in a file; `none`: on the device"),
    "zero_optimization.offload_param.nvme_path": (
        "implemented", "required with `nvme`: an existing, writable directory; each rank writes in a directory "
        "of its own under it"),
    "zero_optimization.offload_param.pin_memory": (
        "implemented", "page-locked host buffers for the copies to a CUDA device; without CUDA a warning"),
    "zero_optimization.offload_param.buffer_count": (
        "implemented", "with `nvme`: shards read ahead of their all-gather"),
    "zero_optimization.offload_param.buffer_size": (
        "no effect", "each shard is read into a buffer of its own size (no line is logged for it)"),
    "zero_optimization.offload_param.max_in_cpu": (
        "implemented", "with `nvme`: shard elements kept in host memory (the persistent parameters first, then "
        "units in model order)"),
    "zero_optimization.offload_optimizer.device": (
        "implemented", "`cpu` (ZeRO-Offload): fp32 masters, optimizer states and reduced gradients in host "
        "memory, the step on the host; `nvme` (ZeRO-Infinity): masters and states in files, stepped through "
        "host windows; `none`: on the device"),
    "zero_optimization.offload_optimizer.nvme_path": (
        "implemented", "required with `nvme`: an existing, writable directory; the files take twice the "
        "optimizer state (two generations)"),
    "zero_optimization.offload_optimizer.pin_memory": (
        "implemented", "page-locked host buffers for the copies to and from a CUDA device; without CUDA a "
        "warning"),
    "zero_optimization.offload_optimizer.buffer_count": (
        "implemented", "with `nvme`: host windows the step rotates sub-groups through (at least 2)"),
    "zero_optimization.offload_optimizer.ratio": (
        "off only", "1.0; below 1 (DeepSpeed's partial offload) is refused on a GPU (`TierConfigError`), and on a "
        "CPU engine logs a warning and offloads the whole state"),
    "zero_optimization.offload_optimizer.pipeline_read": (
        "no effect", "reads of the next sub-groups always overlap the step"),
    "zero_optimization.offload_optimizer.pipeline_write": (
        "no effect", "writes of the last sub-groups always overlap the step"),
    "zero_optimization.offload_optimizer.fast_init": ("no effect", "the tier's files are reserved at build"),
    "zero_optimization.offload_optimizer.super_offload": (
        "implemented", "with `cpu`: each sub-group's host step begins during the backward, as its gradients land, "
        "and is kept or undone at the step, so training is bit-identical to the step after the backward "
        "(docs/offload.md#the-overlapped-host-step); not with Muon or `lean_memory`"),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (
        "no effect", "the host step runs on torch's threads (`torch.set_num_threads`)"),
    "zero_optimization.leaf_module.classes": (
        "implemented", "class names (`Block` or `pkg.module.Block`) whose modules are leaves"),
    "zero_optimization.leaf_module.names": ("implemented", "`named_modules()` names of leaf modules"),
    "zero_optimization.leaf_module.name_suffixes": (
        "implemented", "name suffixes: each module whose name ends so is a leaf"),
    "data_types": ("implemented", "DeepSpeed's gradient dtype section"),
    "data_types.grad_accum_dtype": (
        "implemented", "`fp32`, `bf16` or `fp16`: the dtype gradients accumulate in across micro-steps "
        "(`lp_grads`); null: the compute dtype"),
    "aio": (
        "implemented", "the disk I/O of the `nvme` tiers and of `offload_states(device=\"nvme\")`"),
    "aio.block_size": ("implemented", "bytes per read or write request (a multiple of 4096)"),
    "aio.queue_depth": (
        "implemented", "the I/O pool runs `thread_count` x `queue_depth` threads, so that many requests are in "
        "flight"),
    "aio.thread_count": ("implemented", "see `queue_depth`"),
    "aio.single_submit": ("no effect", "libaio's submission detail; requests are always overlapped"),
    "aio.overlap_events": ("no effect", "libaio's submission detail; requests are always overlapped"),
    "aio.use_gds": ("no effect", "GPUDirect Storage is not used; reads and writes go through host memory"),
    "communication_data_type": (
        "implemented", "`fp32`, `bf16` or `fp16`: the dtype gradients are summed across ranks in; null: the "
        "compute dtype"),
    "gradient_predivide_factor": (
        "implemented", "gradients are divided by this before the sum across ranks and by world size / this "
        "after it"),
    "prescale_gradients": (
        "implemented", "true: divide by the world size before the sum (then `gradient_predivide_factor` has "
        "no effect)"),
    "steps_per_print": (
        "implemented", "rank 0 logs DeepSpeed's progress line (lr, grad norm, loss scale, skipped steps) at "
        "INFO every this many optimizer steps; null or `Infinity`: never"),
    "dataloader_drop_last": (
        "implemented", "the DataLoader `initialize(training_data=...)` returns drops a last, short batch"),
    "zero_optimization.lean_memory": (
        "zero3", "true: no resident 16-bit shards for the trained parameters; each unit's gather casts them from "
        "the fp32 masters as it starts (bit-identical to the default), and each gradient shard is made as the "
        "backward reaches it and dropped at the step, so model state between steps is the masters and the "
        "optimizer states; frozen parameters keep their 16-bit shards. Not with "
        "`offload_param` or `offload_optimizer.device: nvme`"),
    "comm_timeout_s": (
        "zero3", "seconds a collective on the engine's groups waits for a peer (a dead or hung rank) before "
        "it raises; null: the default group's timeout (torch's: 30 min on gloo, 10 on NCCL); also the default "
        "group's when `initialize` creates it"),
    "wall_clock_breakdown": (
        "implemented", "adds forward, backward and step times to the `steps_per_print` line"),
    "checkpoint": (
        "implemented", "DeepSpeed's checkpoint section, with zero3's automatic checkpoints "
        "([checkpoints](checkpoints.md#automatic-checkpoints-the-checkpoint-section))"),
    "checkpoint.dir": (
        "zero3", "where automatic checkpoints live and `resume` looks (every rank must read the same files)"),
    "checkpoint.interval_steps": (
        "zero3", "`engine.step()` saves into `dir` after every N-th optimizer step (tag `global_step<N>`); "
        "null: no automatic saves"),
    "checkpoint.async_save": (
        "zero3", "automatic saves write in the background: the step returns once the state is in host memory"),
    "checkpoint.keep_last": (
        "zero3", "automatic saves keep the newest K complete tags (the next save writes over the oldest removed "
        "one's files, kept in `dir/.recycled`); null: all"),
    "fault_tolerance": (
        "zero3", "this torchrun job is one replica group of a torchft job: the replicas' gradient average, each "
        "step's commit and a returning group's recovery from a healthy peer go through torchft "
        "([fault tolerance](fault_tolerance.md))"),
    "fault_tolerance.enabled": ("zero3", "run on torchft (needs `pip install torchft`)"),
    "fault_tolerance.replica_id": (
        "zero3", "this group's name among the replica groups; null: `TORCHFT_REPLICA_ID`"),
    "fault_tolerance.lighthouse": (
        "zero3", "the torchft lighthouse's address (`http://host:29510`); null: `TORCHFT_LIGHTHOUSE`"),
    "fault_tolerance.min_replicas": ("zero3", "replica groups a step needs to commit"),
    "fault_tolerance.timeout_s": (
        "zero3", "seconds torchft's gradient average, commit vote and a recovery's transfer may take"),
    "fault_tolerance.quorum_timeout_s": ("zero3", "seconds a step may wait for its quorum to form"),
    "fault_tolerance.init_sync": (
        "zero3", "the first quorum copies each rank's state from one replica group to the others (torchft's "
        "`init_sync`); false where every group builds the same weights (the same seed)"),
    "fault_tolerance.async_quorum": (
        "zero3", "true: the quorum forms while the forward runs, and a recovering group takes its peer's state "
        "at the step's commit; false: before the forward"),
    "checkpoint.resume": (
        "zero3", "`zero3.initialize` loads the newest complete checkpoint in `dir`, if there is one "
        "(`engine.global_steps` says where it resumed)"),
}

# The `optimizer` section's types: "torch" stands for any other elementwise torch.optim class.
OPTIMIZER_TYPES: dict[str, str] = {
    "Adam": "torch.optim.AdamW (DeepSpeed's Adam decouples weight decay), or torch.optim.Adam with "
            "`adam_w_mode: false`; `torch_adam` has no effect (torch's fused kernel steps it)",
    "AdamW": "torch.optim.AdamW; `adam_w_mode: false` is refused",
    "Lion": "zero3.optim.Lion",
    "Muon": "torch's Muon math for the 2-D hidden matrices (lr `muon_lr`, null: `lr`), AdamW for every other "
            "parameter (lr `adam_lr`, null: `lr`; torch's betas and eps, the same weight decay); each matrix is "
            "orthogonalized once, by the rank that owns it",
    "torch": "the torch.optim class of that name, with its constructor's arguments (checked against them) and "
             "torch's defaults",
}

# The `scheduler` section's types (zero3.runtime.lr_schedules, DeepSpeed's five).
SCHEDULER_TYPES: dict[str, str] = {
    "LRRangeTest": "the lr grows from `lr_range_test_min_lr` by `lr_range_test_step_rate` times it per "
                   "`lr_range_test_step_size` steps (in whole stairs with `lr_range_test_staircase`), without end",
    "OneCycle": "the lr rises from `cycle_min_lr` to `cycle_max_lr` and falls back (second half: null is the "
                "first's size and stair count), then decays by `decay_lr_rate` per `decay_step_size` steps; "
                "Adam's first beta cycles the other way between the momentum bounds",
    "WarmupLR": "the lr rises from `warmup_min_lr` to `warmup_max_lr` (null: each group's own lr) over "
                "`warmup_num_steps`, logarithmically or linearly, then stays",
    "WarmupDecayLR": "WarmupLR, then a linear decay back to `warmup_min_lr` at `total_num_steps`",
    "WarmupCosineLR": "each group's lr times a ratio rising from `warmup_min_ratio` to 1, then half a cosine "
                      "down to `cos_min_ratio` at `total_num_steps`",
}


def _reference_default(field: Any) -> str:
    """A field's default as the user would write it in JSON (`5e8` for a round count of elements)."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value == sys.maxsize:
        return "no limit"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10**6:
        digits = str(value).rstrip("0")
        zeros = len(str(value)) - len(digits)
        if zeros >= 6 and len(digits) == 1:
            return f"`{digits}e{zeros}`"
    return f"`{_show(value)}`"


def _submodel(field: Any) -> type[BaseModel] | None:
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _config_sections() -> list[tuple[str, type[BaseModel]]]:
    """(path, model) of Zero3Config and each of its sections, a section before those nested in it."""
    found: list[tuple[str, type[BaseModel]]] = []

    def walk(path: str, model: type[BaseModel]) -> None:
        found.append((path, model))
        for name, field in model.model_fields.items():
            sub = _submodel(field)
            if sub is not None:
                walk(f"{path}.{name}" if path else name, sub)

    walk("", Zero3Config)
    return found


def config_key_paths() -> list[str]:
    """Every key path of the config's models (sections too), and DeepSpeed's deprecated ZeRO keys."""
    paths = [path for path, _ in _config_sections() if path]
    for section, model in _config_sections():
        paths += [f"{section}.{name}" if section else name for name, field in model.model_fields.items()
                  if _submodel(field) is None]
    return paths + [f"zero_optimization.{name}" for name in _DEPRECATED_ZERO_KEYS]


def _key_entry(path: str) -> tuple[str, str]:
    if path in DEEPSPEED_KEYS and path in CONFIG_KEYS:
        raise ValueError(f"config key {path} has an entry in both DEEPSPEED_KEYS and CONFIG_KEYS")
    entry = DEEPSPEED_KEYS.get(path) or CONFIG_KEYS.get(path)
    if entry is None:
        raise ValueError(f"config key {path} has no entry in DEEPSPEED_KEYS or CONFIG_KEYS: say what it does")
    return entry


def config_reference() -> str:
    """The Markdown tables of every config key, its default and what it does (docs/configuration.md)."""
    from typing import get_args

    stale = sorted((set(DEEPSPEED_KEYS) | set(CONFIG_KEYS)) - set(config_key_paths()))
    if stale:
        raise ValueError(f"DEEPSPEED_KEYS / CONFIG_KEYS name keys the config does not have: {stale}")
    header = ["| key | default | fate | what it does in zero3 |", "| --- | --- | --- | --- |"]
    out: list[str] = []
    for section, model in _config_sections():
        if section:
            fate, why = _key_entry(section)
            out += [f"### `{section}`", "", f"{fate}: {why}.", ""]
        else:
            out += ["### Top level", ""]
        out += header
        for name, field in model.model_fields.items():
            if _submodel(field) is not None:
                continue
            path = f"{section}.{name}" if section else name
            fate, why = _key_entry(path)
            short = name.removeprefix("stage3_")
            also = f" (also `{short}`)" if isinstance(field.validation_alias, AliasChoices) else ""
            out.append(f"| `{path}`{also} | {_reference_default(field)} | {fate} | {why} |")
        if section == "zero_optimization":
            for name in _DEPRECATED_ZERO_KEYS:
                fate, why = _key_entry(f"{section}.{name}")
                out.append(f"| `{section}.{name}` | - | {fate} | {why} |")
        out.append("")

    def params_text(model: type[BaseModel], values: dict[str, Any] | None = None) -> str:
        """Each parameter with its default (`values`' where given: a validated section's)."""
        shown = []
        for name, field in model.model_fields.items():
            if field.is_required():
                shown.append(f"`{name}` required")
            else:
                value = values[name] if values is not None else field.get_default(call_default_factory=True)
                shown.append(f"`{name}` `{_show(value)}`")
        return ", ".join(shown)

    out += ["### `optimizer` types", "", "| `type` | `params`, with their defaults | steps with |",
            "| --- | --- | --- |"]
    kinds: list[tuple[str, str, str]] = []
    for model in (AdamConfig, LionConfig, MuonConfig):
        for kind in get_args(model.model_fields["type"].annotation):
            params = load_config({"optimizer": {"type": kind}}).optimizer.params  # type: ignore[union-attr]
            kinds.append((kind, f"`{kind}`", params_text(type(params), params.model_dump())))
    torch_kinds = sorted(TORCH_ELEMENTWISE - {"Adam", "AdamW"})
    kinds.append(("torch", ", ".join(f"`{kind}`" for kind in torch_kinds), "its constructor's keyword arguments"))
    if {kind for kind, *_ in kinds} != set(OPTIMIZER_TYPES):
        raise ValueError(f"OPTIMIZER_TYPES must describe exactly {sorted(kind for kind, *_ in kinds)}")
    out += [f"| {names} | {params} | {OPTIMIZER_TYPES[kind]} |" for kind, names, params in kinds]
    out += ["", "### `scheduler` types", "", "| `type` | `params`, with their defaults | what it does |",
            "| --- | --- | --- |"]
    schedulers = get_args(get_args(SchedulerConfig)[0])
    scheduler_kinds = [get_args(model.model_fields["type"].annotation)[0] for model in schedulers]
    if set(scheduler_kinds) != set(SCHEDULER_TYPES):
        raise ValueError(f"SCHEDULER_TYPES must describe exactly {sorted(scheduler_kinds)}")
    for kind, model in zip(scheduler_kinds, schedulers):
        out.append(f"| `{kind}` | {params_text(model.model_fields['params'].annotation)} | {SCHEDULER_TYPES[kind]} |")
    return "\n".join(out) + "\n"


class Zero3Config(_Model):
    train_batch_size: int | None = Field(default=None, gt=0)
    train_micro_batch_size_per_gpu: int | None = Field(default=None, gt=0)
    gradient_accumulation_steps: int | None = Field(default=None, gt=0)
    gradient_clipping: float = Field(default=0.0, ge=0)  # 0 = no clipping
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    bf16: BF16Config = BF16Config()
    fp16: FP16Config = FP16Config()
    zero_optimization: ZeroConfig = ZeroConfig()
    data_types: DataTypesConfig = DataTypesConfig()
    aio: AioConfig = AioConfig()
    # The dtype gradients are summed across ranks in (None: the compute dtype).
    communication_data_type: _DtypeName | None = None
    # Gradients are divided by this before the sum across ranks and by world/this
    # after it (1.0: sum, then average; world size: average first, no fp16 overflow).
    gradient_predivide_factor: float = Field(default=1.0, gt=0)
    prescale_gradients: bool = False
    # A progress line every this many steps; None never (accelerate writes float("inf") for that).
    steps_per_print: Annotated[int | None, BeforeValidator(_never_if_infinite)] = Field(default=10, gt=0)
    # The DataLoader initialize(training_data=...) returns drops a last, short batch (DeepSpeed's key).
    dataloader_drop_last: bool = False
    # Seconds a collective on the engine's process groups may wait for a peer before it raises (a rank
    # that died or hangs). None: the default process group's timeout (torch's default where no one set
    # one: 30 min on gloo, 10 min on NCCL), since a healthy peer may legitimately be slow for minutes
    # (a large checkpoint write, a first step). Also the default group's when zero3.initialize creates it.
    comm_timeout_s: float | None = Field(default=None, gt=0)
    wall_clock_breakdown: bool = False
    # DeepSpeed's top-level keys that ZeRO-3 users write: no effect here (DEEPSPEED_KEYS).
    # DeepSpeed reads these flags by truth value (its own tests write 1): 0 and 1 are accepted too.
    zero_allow_untested_optimizer: Annotated[bool, Field(strict=False)] = False
    zero_force_ds_cpu_optimizer: Annotated[bool, Field(strict=False)] = True
    memory_breakdown: Annotated[bool, Field(strict=False)] = False
    dump_state: Annotated[bool, Field(strict=False)] = False
    activation_checkpointing: dict[str, Any] | None = None
    checkpoint: Annotated[CheckpointConfig, BeforeValidator(_none_as_empty)] = CheckpointConfig()
    fault_tolerance: Annotated[FaultToleranceConfig, BeforeValidator(_none_as_empty)] = FaultToleranceConfig()
    comms_logger: dict[str, Any] | None = None
    flops_profiler: dict[str, Any] | None = None
    tensorboard: dict[str, Any] | None = None
    wandb: dict[str, Any] | None = None
    csv_monitor: dict[str, Any] | None = None
    amp: dict[str, Any] | None = None

    @field_validator("amp")
    @classmethod
    def _no_apex_amp(cls, amp: dict[str, Any] | None) -> dict[str, Any] | None:
        if amp is not None and amp.get("enabled", False) is not False:
            raise ValueError("NVIDIA apex AMP is not offered: use bf16 or fp16 (amp.enabled must be false)")
        return amp

    @model_validator(mode="after")
    def _one_half_precision(self) -> Zero3Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise _KeyedError(
                ("bf16.enabled", "fp16.enabled"), "enable at most one of bf16 and fp16", (True, True)
            )
        return self

    @model_validator(mode="after")
    def _fault_tolerance_alone(self) -> Zero3Config:
        """torchft owns the replicate dimension: no replicas inside the job beside it, and no step that
        runs before the replicas' gradients are known."""
        if not self.fault_tolerance.enabled:
            return self
        zc = self.zero_optimization
        if zc.mics_shard_size != -1:
            raise _KeyedError(("fault_tolerance.enabled", "zero_optimization.mics_shard_size"),
                              "with fault_tolerance each torchrun job is one shard group and torchft's replica "
                              "groups are the replicas: remove mics_shard_size (-1)", (True, zc.mics_shard_size))
        if zc.offload_optimizer.super_offload:
            raise _KeyedError(("fault_tolerance.enabled", "zero_optimization.offload_optimizer.super_offload"),
                              "super_offload steps the optimizer during the backward, before the replicas' "
                              "gradient average and the quorum's commit: use one or the other", (True, True))
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        name = self.data_types.grad_accum_dtype
        return _DTYPES[name] if name is not None else self.compute_dtype

    @property
    def communication_dtype(self) -> torch.dtype:
        name = self.communication_data_type
        return _DTYPES[name] if name is not None else self.compute_dtype

    def inert_settings(self) -> list[str]:
        """One line per DeepSpeed key the user set that does nothing in zero3, and why (DEEPSPEED_KEYS)."""
        lines = []
        for path, (fate, why) in DEEPSPEED_KEYS.items():
            if fate != "no effect" or path in _NOTED_ELSEWHERE:
                continue
            owner: BaseModel = self
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            if name in owner.model_fields_set:
                lines.append(f"config key {path}={_show(getattr(owner, name))} has no effect in zero3: {why}")
        return lines

    def ignored_settings(self) -> list[str]:
        """One message per key the user set that zero3 accepts (for DeepSpeed configs) but does not act on."""
        zc = self.zero_optimization
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
        if "enable_sanity_checks" in zc.model_fields_set and zc.enable_sanity_checks:
            note("zero_optimization.enable_sanity_checks", True,
                 "zero3 checks a unit's holds on every release (a release it does not have is an error)")
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
            if field in self.aio.model_fields_set:
                note(f"aio.{field}", getattr(self.aio, field),
                     "zero3's disk I/O keeps aio.queue_depth requests in flight on aio.thread_count threads")
        if isinstance(self.optimizer, AdamConfig) and "torch_adam" in self.optimizer.params.model_fields_set:
            note("optimizer.params.torch_adam", self.optimizer.params.torch_adam,
                 "zero3 always steps torch's own fused Adam/AdamW kernel (on the host too)")
        if "gradient_predivide_factor" in self.model_fields_set and self.prescale_gradients:
            note("gradient_predivide_factor", self.gradient_predivide_factor,
                 "prescale_gradients is true, which divides by the world size before the sum")
        return notes

    def resolve_batch(self, world_size: int) -> BatchSizes:
        """Fill in the missing batch sizes the way DeepSpeed does.

        train_batch_size = train_micro_batch_size_per_gpu
                           * gradient_accumulation_steps * world_size
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int (got {world_size!r})")
        train = self.train_batch_size
        micro = self.train_micro_batch_size_per_gpu
        gas = self.gradient_accumulation_steps

        def _divide(total: int, divisor: int, what: str, given: str) -> int:
            if total % divisor:
                raise ConfigError(
                    f"train_batch_size ({total}) is not divisible by {given}, "
                    f"so {what} would not be a whole number"
                )
            return total // divisor

        if (train is not None and micro is not None and gas is not None and train != micro * gas * world_size
                and self.checkpoint.resume and train % (micro * world_size) == 0):
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


# ------------------------------------------------------------------- loading


def _show(value: Any) -> str:
    # JSON spelling (true, null, "text") because the user wrote JSON.
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _key_path(loc: tuple[int | str, ...], data: Any) -> list[str]:
    """The user-facing key path of a pydantic error location.

    Pydantic puts the tag of a discriminated union (e.g. "WarmupCosineLR") into
    the location; it is not a key the user wrote, so it is dropped by walking
    the input alongside the location.
    """
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(node, dict) and item not in node and (node.get("type") == item or item in _UNION_TAGS):
            continue
        parts.append(f"[{item}]" if isinstance(item, int) else str(item))
        if isinstance(node, dict):
            node = node.get(item)
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            node = node[item]
        else:
            node = None
    return parts


def _join(parts: list[str]) -> str:
    return ".".join(parts).replace(".[", "[")


def _format_errors(error: ValidationError, data: Any) -> str:
    lines: list[str] = []
    for err in error.errors():
        parts = _key_path(err["loc"], data)
        kind = err["type"]
        ctx = err.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, _KeyedError):
            keys = ", ".join(_join(parts + k.split(".")) for k in cause.keys)
            got = ", ".join(_show(v) for v in cause.values)
            lines.append(f"{keys}: {cause.message} (got {got})")
            continue
        if kind in ("union_tag_invalid", "union_tag_not_found"):
            # The discriminator key itself is what is wrong or missing.
            discriminator = str(ctx.get("discriminator", "type")).strip("'")
            key = _join(parts + ["type" if "(" in discriminator else discriminator])  # a callable's: the type
            if kind == "union_tag_not_found":
                lines.append(f"{key}: required key is missing")
            else:
                expected = ctx.get("expected_tags", "")
                # ctx["tag"] is str() of the value; show what the user wrote.
                node = err["input"]
                tag = node.get(key.rsplit(".", 1)[-1]) if isinstance(node, dict) else ctx.get("tag")
                lines.append(f"{key}: expected one of {expected} (got {_show(tag)})")
            continue
        key = _join(parts) or "<config>"
        message = err["msg"].removeprefix("Value error, ")
        if kind == "missing":
            lines.append(f"{key}: required key is missing")
        elif kind == "extra_forbidden":
            close = difflib.get_close_matches(parts[-1] if parts else key, _known_keys(), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"{key}: unknown key (got {_show(err['input'])}){hint}")
        else:
            lines.append(f"{key}: {message} (got {_show(err['input'])})")
    count = len(lines)
    header = f"invalid zero3 config ({count} error{'s' if count != 1 else ''}):"
    return "\n".join([header, *("  " + line for line in lines)])


def _known_keys() -> list[str]:
    """Every key name some config model accepts (its field names and aliases), for "did you mean"."""
    names: set[str] = set(_DEPRECATED_ZERO_KEYS)
    models: list[type[BaseModel]] = [_Model]
    while models:
        model = models.pop()
        models.extend(model.__subclasses__())
        for name, field in model.model_fields.items():
            names.add(name)
            if isinstance(field.validation_alias, AliasChoices):
                names.update(choice for choice in field.validation_alias.choices if isinstance(choice, str))
    return sorted(names)


def _auto_values(data: Any, path: str = "") -> list[str]:
    """The keys holding "auto": the Hugging Face template's placeholders, which its integration fills."""
    if isinstance(data, dict):
        return [found for key, value in data.items() for found in _auto_values(value, f"{path}.{key}" if path else key)]
    if isinstance(data, list):
        return [found for i, value in enumerate(data) for found in _auto_values(value, f"{path}[{i}]")]
    return [path] if data == "auto" else []


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON config file's object, unvalidated (ConfigError naming the file if it cannot be read as one)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a JSON object (got {type(data).__name__})")
    return data


def load_config(config: dict[str, Any] | str | os.PathLike[str] | Zero3Config) -> Zero3Config:
    """Build a validated ``Zero3Config`` from a dict, a JSON file path, or a config.

    Raises ``ConfigError`` for a missing/unreadable file, bad JSON, or any
    invalid key or value. The input dict is never modified.
    """
    if isinstance(config, Zero3Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        data = read_config_file(config)
    elif isinstance(config, dict):
        # Deep copy: validation must never alias or alter the caller's nested dicts.
        data = copy.deepcopy(config)
    else:
        raise ConfigError(
            "config must be a dict, a path to a JSON file, or a Zero3Config "
            f"(got {type(config).__name__})"
        )
    auto = _auto_values(data)
    if auto:
        raise ConfigError(
            f"invalid zero3 config: {', '.join(auto)} {'is' if len(auto) == 1 else 'are'} \"auto\", the Hugging Face "
            "template's placeholder, which its DeepSpeed integration fills from the Trainer's arguments; it reached "
            "zero3 unfilled: write the value itself"
        )
    try:
        return Zero3Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, data)) from None
