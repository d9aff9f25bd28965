"""The training engine: the object `zero3.initialize` returns."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from zero3 import accelerator
from zero3.checkpoint import state as checkpoint_state
from zero3.checkpoint import weights as checkpoint_weights
from zero3.checkpoint.async_saves import AsyncSaves
from zero3.comm import Communicator
from zero3.config import Zero3Config
from zero3.enums import OffloadDevice, OffloadStateType, parse_offload_device, parse_state, parse_states
from zero3.offload.report import StateReport
from zero3.offload.tiers import check_tiers
from zero3.partition.flat_buffer import StateOffloadedError
from zero3.partition.collectives import ParamGather
from zero3.partition.mesh import ShardMesh
from zero3.partition.unit import GatherUnit, Hold, UnitState
from zero3.runtime.lr_schedules import build_lr_scheduler
from zero3.runtime.build import build
from zero3.runtime.timers import StepTimers

log = logging.getLogger("zero3")

# The states each training call reads or writes (a call refuses to run while one is offloaded).
FORWARD_NEEDS = (OffloadStateType.lp_params,)
BACKWARD_NEEDS = (OffloadStateType.lp_params, OffloadStateType.lp_grads, OffloadStateType.contiguous_grad_buffer)
CHECKPOINT_NEEDS = (OffloadStateType.hp_params, OffloadStateType.lp_params, OffloadStateType.optim_states)
STEP_NEEDS = (
    OffloadStateType.hp_params, OffloadStateType.lp_params, OffloadStateType.lp_grads, OffloadStateType.optim_states,
)


class ZeroEngine:
    """Wraps a model: partitioned parameters, hooks, gradient reduction, optimizer."""

    def __init__(
        self,
        model: nn.Module,
        config: Zero3Config,
        comm: Communicator,
        mesh: ShardMesh,
        device: torch.device,
        model_parameters: Iterable[Any] | None,
        lr_scheduler: Any = None,
    ) -> None:
        self.module = model
        self.config = config
        self.comm = comm
        self.mesh = mesh
        self.gather = ParamGather(mesh, comm)
        self.device = device
        self.global_rank = dist.get_rank()
        self.world_size = mesh.world_size
        self.batch = config.resolve_batch(mesh.world_size)
        self.compute_dtype = config.compute_dtype
        check_tiers(config, device)
        if lr_scheduler is not None and (
            not callable(lr_scheduler) or isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
        ):
            raise TypeError(
                "lr_scheduler must be a factory called with the engine's torch optimizer "
                f"(the optimizer does not exist before initialize), got {type(lr_scheduler).__name__}"
            )
        if self.global_rank == 0:
            for message in config.ignored_settings():
                log.warning("%s", message)

        comm.open_side_groups()
        self.parts = build(model, config, comm, self.gather, device, model_parameters, self.global_rank)
        parts = self.parts
        self.units, self.persistent_unit, self.sharded_params = parts.units, parts.persistent_unit, parts.sharded_params
        self.disk, self.host_pool, self.lp_buffers, self.param_disk = (
            parts.disk, parts.host_pool, parts.lp_buffers, parts.param_disk
        )
        self.grads, self.reducer, self.loss_scaler, self.optimizer = (
            parts.grads, parts.reducer, parts.loss_scaler, parts.optimizer
        )
        self.coordinator, self.offloader = parts.coordinator, parts.offloader

        self.lr_scheduler = None
        if self.optimizer is not None:
            if lr_scheduler is not None:
                self.lr_scheduler = lr_scheduler(self.optimizer.optimizer)
            elif config.scheduler is not None:
                self.lr_scheduler = build_lr_scheduler(config.scheduler, self.optimizer.optimizer)
        self.micro_steps = 0
        self.global_steps = 0
        self._skipped_on_host = 0  # dynamic-scale skips; static-scale ones are counted on the device
        self._last_grad_norm: torch.Tensor | None = None
        self.timers = StepTimers(device, enabled=config.wall_clock_breakdown)
        self.saves = AsyncSaves(self.host_pool)
        self._destroyed = False

    @property
    def all_units(self) -> list[GatherUnit]:
        return self.parts.all_units

    # ---- training API -------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        self._require_resident("forward", FORWARD_NEEDS)
        self._repair_lp()
        if self.compute_dtype != torch.float32:
            # Floating inputs follow the parameters' dtype (FSDP2's cast_forward_inputs).
            def cast(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    return value.to(self.compute_dtype)
                return value

            args, kwargs = tree_map(cast, (args, kwargs))
        with self.timers.phase("forward"):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        """Backward of `loss` scaled by 1/gradient_accumulation_steps (and the fp16 loss scale).

        If it raises, the pass still ends on every rank that raised (nothing is
        left gathered or in flight); `engine.zero_grad()` then drops the partial
        gradients, as `optimizer.zero_grad()` does in plain PyTorch.
        """
        self._check_alive()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        if self.optimizer is None:
            raise RuntimeError("engine.backward needs an optimizer: the config has no 'optimizer' section")
        self._require_resident("backward", BACKWARD_NEEDS)
        factor = self.loss_scaler.loss_scale / self.batch.gradient_accumulation_steps
        scaled = loss.float() * factor if factor != 1.0 else loss
        with self.timers.phase("backward"):
            self.parts.backward.begin()
            try:
                scaled.backward(retain_graph=retain_graph)
            finally:
                self.parts.backward.finish()
        return loss

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (DeepSpeed's name; `optimizer.zero_grad()` in plain PyTorch).

        After an exception escaped forward or backward, this also ends any pass
        left open and releases what it held, so the next step starts clean.
        Call it on every rank.
        """
        self._check_alive()
        self.parts.backward.finish()
        self.coordinator.reset()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary, step the optimizer."""
        self._check_alive()
        if self.optimizer is None:
            raise RuntimeError("engine.step needs an optimizer: the config has no 'optimizer' section")
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._require_resident("step", STEP_NEEDS)
        self.parts.backward.finish()  # a plain loss.backward() left its pass open
        if not boundary:
            self.micro_steps += 1
            return
        with self.timers.phase("step"):
            self.coordinator.release_all()
            stepped, norm = self.optimizer.step()
            self._last_grad_norm = norm
            if stepped:
                self._refresh_gathered()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            else:
                self._skipped_on_host += 1
                log.info("fp16 overflow: step %d skipped, loss scale now %s", self.global_steps, self.loss_scaler.loss_scale)
        # Counted once the step has landed: a step that raised (a failing disk) can be retried.
        self.micro_steps += 1
        self.global_steps += 1
        printing = self.global_rank == 0 and log.isEnabledFor(logging.INFO)  # it reads the norm: a host sync
        if printing and self.global_steps % self.config.steps_per_print == 0:
            self._print_progress()
        if self.optimizer.lp_write_error is not None:
            error, self.optimizer.lp_write_error = self.optimizer.lp_write_error, None
            raise error

    # [Note: a step without host syncs]
    # Nothing in a step reads a device value on the host unless the config
    # needs it (a dynamic fp16 loss scale reads whether the step overflowed):
    # the grad norm, the clip coefficient and the non-finite check stay on the
    # device, and the fused Adam kernel skips the update itself when a static-
    # scale step's gradients are not finite (`found_inf`). The scheduler
    # advances on such a step, as it does under torch's GradScaler. So the
    # norm and the skip count are read only when asked for, below.
    @property
    def last_grad_norm(self) -> float | None:
        """The last step's global gradient norm, unscaled and before clipping (reading it waits for it)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def get_global_grad_norm(self) -> float | None:
        """DeepSpeed's name for `last_grad_norm`."""
        return self.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped: fp16 overflows, and non-finite gradients under a static scale."""
        on_device = int(self.optimizer.skipped) if self.optimizer is not None else 0
        return self._skipped_on_host + on_device

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self._skipped_on_host = int(count)
        if self.optimizer is not None:
            self.optimizer.skipped.zero_()

    def _print_progress(self) -> None:
        """steps_per_print: DeepSpeed's progress line (and wall_clock_breakdown's times)."""
        lr = ", ".join(f"{value:.4g}" for value in self.get_lr())
        log.info(
            "step %d: lr [%s], grad norm %.4g, loss scale %g, skipped %d",
            self.global_steps, lr, self.last_grad_norm or 0.0, self.loss_scale, self.skipped_steps,
        )
        if self.timers.enabled:
            log.info("step %d time: %s", self.global_steps, self.timers.report())

    def _repair_lp(self) -> None:
        """16-bit shards that do not follow their masters (a step failed on disk after writing some, or
        a load put new masters in) are rewritten from the masters, and what is gathered follows."""
        if self.optimizer is not None and self.optimizer.lp_stale:
            self.optimizer.repair_lp()
            self._refresh_gathered()

    def _refresh_gathered(self) -> None:
        """Units still gathered (persistent, pinned) get the new values."""
        for unit in self.all_units:
            if unit.state is not UnitState.SHARDED:
                unit.reshard()
                unit.unshard()

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self.module.named_parameters(*args, **kwargs)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    # ---- checkpoints ------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: Any = None,
        save_latest: bool = True,
        keep_last: int | None = None,
        async_save: bool = False,
    ) -> bool:
        """Save this engine to `save_dir/<tag>` (default tag: global_step<N>); collective, every rank calls it.

        Each rank writes its own pieces of every parameter's fp32 master and
        Adam state (torch.distributed.checkpoint); no rank gathers the model.
        `client_state` (any picklable object) comes back from load_checkpoint.
        `latest` names the tag once every rank's files are complete (unless
        `save_latest=False`); `keep_last=N` then removes older tags. With
        `async_save=True` it returns once the state is copied to host memory
        and the files are written in the background; the next save, load or
        `destroy()` waits for them (and raises if they failed).
        """
        self._check_alive()
        self._check_between_steps("save_checkpoint")
        self.wait_for_checkpoint()
        self.parts.backward.finish()
        self._require_resident("save_checkpoint", CHECKPOINT_NEEDS)
        if self.grads is not None and self.grads.any_arrived():
            log.warning("save_checkpoint between micro-steps: the gradients accumulated so far are not saved")
        written = checkpoint_state.save(
            self._checkpointed(), save_dir, tag, client_state, save_latest, keep_last,
            self.saves.executor() if async_save else None,
        )
        self.saves.track(written)
        return True

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
        max_shard_size: str | int = "5GB",
    ) -> bool:
        """Write the whole model's weights (in the compute dtype) as safetensors; collective.

        Streams the parameters (`iter_full_params`: one gathered at a time,
        read where they rest, so parked states stay parked); rank 0 writes. A
        tied weight is written once. Above `max_shard_size` the files follow
        Hugging Face's sharded layout (`model-00001-of-0000N.safetensors` and
        an index).
        """
        self._check_alive()
        self._check_between_steps("save_16bit_model")
        shard_bytes = checkpoint_weights.parse_size(max_shard_size)
        checkpoint_weights.save_live(
            self.global_rank, self.module, lambda names: self.iter_full_params(names=names),
            save_dir, save_filename, shard_bytes, exclude_frozen_parameters,
        )
        self.comm.barrier()  # the files are complete on every rank's return
        return True

    def iter_full_params(
        self, dtype: torch.dtype | None = None, names: Iterable[str] | None = None,
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for every parameter, whole, one gathered at a time; collective.

        For handing weights to a generator: vLLM's `model.load_weights(weights=...)`,
        SGLang's `update_weights_from_tensor` (see examples/generator_weights.py).
        Every rank calls it with the same arguments and iterates it to the end.

        A yielded tensor is valid only until the next item is requested: the
        consumer copies it (as vLLM's load_weights does) and never modifies it
        (it is a view of a buffer reused for the next parameter, or in a world
        of one of the engine's own shard). Extra memory is that one buffer, the
        size of the largest parameter streamed: at most the largest unit. A tied weight comes once, under its first name
        (named_parameters order; with `names`, its first name listed). `names` restricts what is yielded; a name the
        model does not have raises ValueError before anything is gathered.
        `dtype` casts (None: the compute dtype, as stored). Works while states
        are parked by offload_states, lp_params included: they are read where
        they rest (host memory or disk), one parameter at a time, and stay
        parked. Works with the offload_param tiers. Buffers are not yielded.
        """
        from zero3.runtime import full_params

        self._check_alive()
        self._check_between_steps("iter_full_params")
        self._repair_lp()
        return full_params.stream(
            self.module, self.gather, self.offloader, self.compute_dtype if dtype is None else dtype, names,
        )

    def wait_for_checkpoint(self) -> None:
        """Wait for an async save still writing (raises its error, if it failed)."""
        self.saves.wait()

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str, Any]:
        """Load `load_dir/<tag>` (default: the tag `latest` names), saved at any world size; collective.

        Returns (the checkpoint's path, its client_state). The checkpoint is
        checked first (the tag is complete, every name and shape matches this
        model, every file matches its checksum, the optimizer is the same
        kind): a failed check raises `zero3.CheckpointError` and changes
        nothing. Accumulated gradients are dropped.
        """
        self._check_alive()
        self._check_between_steps("load_checkpoint")
        self.wait_for_checkpoint()
        self.parts.backward.finish()
        self._require_resident("load_checkpoint", CHECKPOINT_NEEDS)
        self.coordinator.release_all()
        restored = checkpoint_state.load(
            self._checkpointed(), load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only,
            load_module_strict,
        )
        self._repair_lp()  # the load marked the 16-bit shards stale: they are written from the loaded masters
        if self.optimizer is None:
            self._refresh_gathered()  # what is gathered follows the parameters loaded in place
        if restored.counters is not None:
            self.global_steps = restored.counters.global_steps
            self.micro_steps = restored.counters.micro_steps
            self.skipped_steps = restored.counters.skipped_steps
            self.loss_scaler.load_state_dict(restored.loss_scaler)
            if self.lr_scheduler is not None and restored.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(restored.lr_scheduler)
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        return restored.path, restored.client_state

    def _checkpointed(self) -> checkpoint_state.CheckpointedEngine:
        return checkpoint_state.CheckpointedEngine(
            module=self.module, comm=self.comm, rank=self.global_rank, world_size=self.world_size,
            compute_dtype=self.compute_dtype, device=self.device, sharded_params=self.sharded_params,
            optimizer=self.optimizer, loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler,
            host_pool=self.host_pool,
            counters=checkpoint_state.TrainingCounters(self.global_steps, self.micro_steps, self.skipped_steps),
        )

    # ---- state offloading ---------------------------------------------------------
    def offload_states(
        self,
        include: Any = None,
        device: OffloadDevice | str = OffloadDevice.cpu,
        pin_memory: bool = True,
        non_blocking: bool = False,
        nvme_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Move this rank's states off the device: `include` (None = all five) to "cpu" or "nvme" (disk).

        Gathered parameters and in-flight prefetches are released first. The
        disk tier writes under `nvme_path` (default: the config's
        zero_optimization.offload_param.nvme_path). Offloading a state that is
        already offloaded does nothing. Every argument is checked, and disk
        space reserved, before anything moves. Call on every rank between
        training steps (it has no collective).
        """
        self._check_alive()
        states = parse_states(include)
        target = parse_offload_device(device)
        root = self.offloader.disk_root(nvme_path) if target is OffloadDevice.nvme else None
        self._check_between_steps("offload_states")
        self.offloader.offload(states, target, bool(pin_memory), bool(non_blocking), root, self._prepare_offload)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back every offloaded state, bit-exact; recreate a freed scratch bucket.

        With `non_blocking=True` the copies finish in the background and any
        later use of a state waits for its copy.
        """
        self._check_alive()
        self._check_between_steps("reload_states")
        self.offloader.reload(bool(non_blocking))

    def state_devices(self, state: OffloadStateType | str) -> set[torch.device]:
        """The devices whose memory holds `state` (see zero3.get_state_devices)."""
        self._check_alive()
        return self.offloader.devices(parse_state(state))

    def state_report(self) -> StateReport:
        """Per state, where it lives and its bytes there (a dict; `print()` it for a table)."""
        self._check_alive()
        return self.offloader.report()

    def _check_between_steps(self, what: str) -> None:
        if self.coordinator.in_forward or self.coordinator.in_backward:
            raise RuntimeError(f"engine.{what}() was called inside a forward or backward; call it between steps")
        pinned = [unit.label for unit in self.all_units if unit.holds(Hold.PIN)]
        if pinned:
            raise RuntimeError(
                f"engine.{what}() was called inside GatheredParameters (gathered: {pinned}); call it after the block"
            )

    def _prepare_offload(self, states: set[OffloadStateType]) -> None:
        """Let go of every view of the states about to move (see zero3.offload.manager's Note)."""
        self.parts.backward.finish()
        self.coordinator.release_all()
        self.comm.settle()  # collectives' aliases would keep released memory (the scratch bucket) resident
        if OffloadStateType.lp_params in states and self.persistent_unit is not None:
            self.persistent_unit.reshard()  # re-gathered by the next forward
        if self.optimizer is not None and states & {OffloadStateType.hp_params, OffloadStateType.optim_states}:
            self.optimizer.unbind_views()

    def _require_resident(self, what: str, needed: tuple[OffloadStateType, ...]) -> None:
        away = self.offloader.missing(needed)
        if away:
            names = ", ".join(state.value for state in away)
            raise StateOffloadedError(
                f"engine.{what}() needs {names}, offloaded by offload_states(); call engine.reload_states() first"
            )

    # ---- accounting -----------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model state, by state (the 16P/N of ZeRO-3)."""
        states = {"lp_params": sum(buffer.nbytes for buffer in self.lp_buffers), "hp_params": 0, "lp_grads": 0, "optim_states": 0}
        if self.optimizer is not None:
            states.update(self.optimizer.state_bytes())
        states["persistent_params"] = self.persistent_unit.unsharded_nbytes() if self.persistent_unit else 0
        states["total"] = sum(states.values())
        # Scratch, not model state: reported beside the total, not in it.
        states["contiguous_grad_buffer"] = self.reducer.scratch.nbytes if self.reducer.scratch is not None else 0
        return states

    # ---- teardown ---------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this zero3 engine was destroyed")

    def destroy(self) -> None:
        """Remove every hook and free every buffer. The engine is unusable afterwards."""
        if self._destroyed:
            return
        checkpoint_error = self.saves.close()  # raised once the engine is torn down
        self.parts.close()
        self.optimizer = self.grads = None
        self.lr_scheduler = None
        self.units = []
        self.persistent_unit = None
        self.sharded_params = []
        self._destroyed = True
        accelerator.synchronize(self.device)
        self.comm.close()
        if checkpoint_error is not None:
            raise checkpoint_error
