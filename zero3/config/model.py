"""Zero3Config: the whole configuration, its sections and top-level keys, and what is derived from it."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BeforeValidator, Field, field_validator, model_validator

from zero3.config import messages
from zero3.config.base import _KeyedError, _Model, _never_if_infinite, _none_as_empty
from zero3.config.batch import BatchSizes, resolve_batch_sizes
from zero3.config.checkpoint import CheckpointConfig
from zero3.config.expert_parallel import ExpertParallelConfig
from zero3.config.fault_tolerance import FaultToleranceConfig
from zero3.config.optimizer import OptimizerConfig
from zero3.config.precision import _DTYPES, _DtypeName, BF16Config, DataTypesConfig, FP16Config
from zero3.config.scheduler import SchedulerConfig
from zero3.config.zero import AioConfig, ZeroConfig


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
    expert_parallel: Annotated[ExpertParallelConfig, BeforeValidator(_none_as_empty)] = ExpertParallelConfig()
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

    @model_validator(mode="after")
    def _expert_parallel_with(self) -> Zero3Config:
        """Expert parallelism beside what lays the experts out: an expert-parallel group inside one of MiCS's
        shard groups (the experts' replicas are then the dense part's); torchft's replica groups are not laid
        out for expert shares yet."""
        if self.expert_parallel.size == 1:
            return self
        autoep_size, mics = self.expert_parallel.autoep_size, self.zero_optimization.mics_shard_size
        if mics != -1 and mics % autoep_size:
            raise _KeyedError(("expert_parallel.autoep_size", "zero_optimization.mics_shard_size"),
                              "an expert-parallel group lies inside one MiCS shard group: expected a size that "
                              "divides mics_shard_size", (autoep_size, mics))
        if self.fault_tolerance.enabled:
            raise _KeyedError(("expert_parallel.autoep_size", "fault_tolerance.enabled"),
                              "expert parallelism does not lay its expert shares out with fault_tolerance.enabled "
                              "yet: remove one of the two", (autoep_size, True))
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.bf16.enabled:
            return torch.bfloat16
        if self.fp16.enabled:
            return torch.float16
        return torch.float32

    @property
    def casts_inputs(self) -> bool:
        """Whether the engine's forward casts floating inputs to the compute dtype (`auto_cast`)."""
        return (self.bf16.enabled and self.bf16.auto_cast) or (self.fp16.enabled and self.fp16.auto_cast)

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
        return messages.inert_settings(self)

    def ignored_settings(self) -> list[str]:
        """One message per key the user set that zero3 accepts (for DeepSpeed configs) but does not act on."""
        return messages.ignored_settings(self)

    def resolve_batch(self, world_size: int) -> BatchSizes:
        """Fill in the missing batch sizes the way DeepSpeed does (zero3.config.batch).

        train_batch_size = train_micro_batch_size_per_gpu
                           * gradient_accumulation_steps * world_size
        """
        return resolve_batch_sizes(self.train_batch_size, self.train_micro_batch_size_per_gpu,
                                   self.gradient_accumulation_steps, world_size, self.checkpoint.resume)
