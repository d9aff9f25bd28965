"""The DeepSpeed-style JSON configuration, as frozen pydantic models.

Key names and defaults follow DeepSpeed so an existing ``ds_config.json`` for a
stage-3 run loads unchanged. Validation is deliberately strict (unknown keys and
wrong types are errors, never silently coerced) because a typo in a training
config otherwise costs a whole run. ``load_config`` is the entry point: it turns
every pydantic error into one readable ``ConfigError``.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (
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

__all__ = [
    "BatchSizes",
    "BF16Config",
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
    "SchedulerConfig",
    "TorchOptimizerConfig",
    "WarmupCosineLRConfig",
    "WarmupCosineLRParams",
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

_WarmupType = Literal["log", "linear"]


class WarmupLRParams(_Model):
    warmup_min_lr: float = Field(default=0.0, ge=0)
    warmup_max_lr: float = Field(default=0.001, ge=0)
    warmup_num_steps: int = Field(default=1000, ge=0)
    warmup_type: _WarmupType = "log"


class WarmupCosineLRParams(_Model):
    total_num_steps: int = Field(gt=0)
    warmup_min_ratio: float = Field(default=0.0, ge=0, le=1)
    warmup_num_steps: int = Field(default=1000, ge=0)
    cos_min_ratio: float = Field(default=0.0001, ge=0, le=1)
    warmup_type: _WarmupType = "log"

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupCosineLRParams:
        if self.warmup_num_steps > self.total_num_steps:
            raise _KeyedError(
                ("warmup_num_steps",),
                f"must not exceed total_num_steps ({self.total_num_steps})",
                (self.warmup_num_steps,),
            )
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


class WarmupLRConfig(_SchedulerBase):
    type: Literal["WarmupLR"]
    params: WarmupLRParams


class WarmupCosineLRConfig(_SchedulerBase):
    type: Literal["WarmupCosineLR"]
    params: WarmupCosineLRParams


# Discriminated on "type", so each type's params are validated by their own model.
SchedulerConfig = Annotated[WarmupLRConfig | WarmupCosineLRConfig, Field(discriminator="type")]


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


class ZeroConfig(_Model):
    stage: int = 3
    stage3_param_persistence_threshold: _Size = Field(default=100_000, ge=0)
    stage3_prefetch_bucket_size: _Size = Field(default=50_000_000, ge=0)
    stage3_max_live_parameters: _Size = Field(default=1_000_000_000, gt=0)
    # Accepted for DeepSpeed compatibility.
    stage3_max_reuse_distance: _Size = Field(default=1_000_000_000, ge=0)
    reduce_bucket_size: _Size = Field(default=500_000_000, gt=0)
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    sub_group_size: _Size = Field(default=1_000_000_000, gt=0)
    stage3_gather_16bit_weights_on_model_save: bool = False
    # Accepted for DeepSpeed compatibility (its debugging checks of parameter status).
    enable_sanity_checks: bool = False
    offload_param: Annotated[OffloadParamConfig, BeforeValidator(_none_as_empty)] = (
        OffloadParamConfig()
    )
    offload_optimizer: Annotated[OffloadOptimizerConfig, BeforeValidator(_none_as_empty)] = (
        OffloadOptimizerConfig()
    )

    @field_validator("stage")
    @classmethod
    def _stage_3_only(cls, stage: int) -> int:
        if stage != 3:
            raise ValueError("zero3 implements ZeRO stage 3 only")
        return stage


# -------------------------------------------------------------- data types

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DtypeName = Literal["fp32", "fp16", "bf16"]


class DataTypesConfig(_Model):
    # The dtype gradients accumulate in across micro-steps (None: the compute dtype).
    grad_accum_dtype: _DtypeName | None = None


# ------------------------------------------------------------------- top level


@dataclass(frozen=True)
class BatchSizes:
    """Resolved batch sizes: train_batch_size = micro * gas * world_size."""

    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


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
    steps_per_print: int = Field(default=10, gt=0)
    # The DataLoader initialize(training_data=...) returns drops a last, short batch (DeepSpeed's key).
    dataloader_drop_last: bool = False
    wall_clock_breakdown: bool = False

    @model_validator(mode="after")
    def _one_half_precision(self) -> Zero3Config:
        if self.bf16.enabled and self.fp16.enabled:
            raise _KeyedError(
                ("bf16.enabled", "fp16.enabled"), "enable at most one of bf16 and fp16", (True, True)
            )
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
            lines.append(f"{key}: unknown key (got {_show(err['input'])})")
        else:
            lines.append(f"{key}: {message} (got {_show(err['input'])})")
    count = len(lines)
    header = f"invalid zero3 config ({count} error{'s' if count != 1 else ''}):"
    return "\n".join([header, *("  " + line for line in lines)])


def load_config(config: dict[str, Any] | str | os.PathLike[str] | Zero3Config) -> Zero3Config:
    """Build a validated ``Zero3Config`` from a dict, a JSON file path, or a config.

    Raises ``ConfigError`` for a missing/unreadable file, bad JSON, or any
    invalid key or value. The input dict is never modified.
    """
    if isinstance(config, Zero3Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {str(path)!r} must hold a JSON object (got {type(data).__name__})"
            )
    elif isinstance(config, dict):
        # Deep copy: validation must never alias or alter the caller's nested dicts.
        data = copy.deepcopy(config)
    else:
        raise ConfigError(
            "config must be a dict, a path to a JSON file, or a Zero3Config "
            f"(got {type(config).__name__})"
        )
    try:
        return Zero3Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, data)) from None
