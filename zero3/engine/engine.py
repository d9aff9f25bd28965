"""The training engine: the object `zero3.initialize` returns.

`ZeroEngine` composes the parts zero3.engine.build makes (`self.parts`): a forward runs the
module (the coordinator's hooks gather each unit), `backward` brackets autograd's backward (the
gradient hooks hand gradients to the reducer), `step` steps the optimizer at the accumulation
boundary. It also keeps the step counters and agrees failures across ranks (the Note below).
Checkpoints, state offloading and DeepSpeed's getters are its mixins.
"""

from __future__ import annotations

import functools

import logging
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from zero3 import accelerator
from zero3.checkpoint.async_saves import AsyncSaves
from zero3.comm import Communicator
from zero3.config import Zero3Config
from zero3.fault_tolerance.peer_state import PeerView, Recovered
from zero3.fault_tolerance.replica_step import ReplicaStep
from zero3.offload.tiers import check_tiers
from zero3.optim import spec as optimizer_spec
from zero3.partition.collectives import ParamGather
from zero3.shard_mesh import ShardMesh
from zero3.offload.manager import StateOffloader
from zero3.partition.flat_buffer import FlatBuffer
from zero3.partition.sharded_param import ShardedParam
from zero3.partition.unit import GatherUnit
from zero3.passes.coordinator import ParamCoordinator
from zero3.step.grad_shards import GradShards
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler
from zero3.step.optimizer import ZeroOptimizer
from zero3.engine.build import build
from zero3.engine.checkpoints import CheckpointMethods
from zero3.engine.getters import DeepSpeedGetters
from zero3.engine.offload import BACKWARD_NEEDS, FORWARD_NEEDS, STEP_NEEDS, OffloadMethods
from zero3.step.lr_schedules import build_lr_scheduler
from zero3.step_protocol import Owed, StepProtocol
from zero3.engine.timers import StepTimers

log = logging.getLogger("zero3")

NO_OPTIMIZER = "needs an optimizer: the config has no 'optimizer' section and initialize was given none"

class ZeroEngine(CheckpointMethods, OffloadMethods, DeepSpeedGetters):
    """Wraps a model: partitioned parameters, hooks, gradient reduction, optimizer.

    Training is here; the checkpoint and state-offloading API and DeepSpeed's getters are its mixins.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Zero3Config,
        comm: Communicator,
        mesh: ShardMesh,
        device: torch.device,
        model_parameters: Iterable[Any] | None,
        lr_scheduler: Any = None,
        client_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.module = model
        self.config = config
        self.comm = comm
        self.mesh = mesh
        self.gather = ParamGather(mesh, comm)
        self.device = device
        # The rank in the whole job, not in the shard group: rank 0 logs, and the disk directory, the data
        # sampler and a checkpoint's rank state are per job rank. The mesh's shard groups times its replicas
        # are the whole job (zero3.topology), so its world size is the job's.
        self.global_rank = dist.get_rank()
        self.world_size = mesh.world_size
        self.batch = config.resolve_batch(mesh.world_size)
        self.compute_dtype = config.compute_dtype
        # Where this rank stands in the step's collective calls, and every agreement (zero3.step_protocol).
        self.protocol = StepProtocol(comm)
        # Paths are each rank's own filesystem: a check that fails on one rank fails on every rank.
        self.protocol.agree("initialize", lambda: check_tiers(config, device))
        if lr_scheduler is not None and (
            not callable(lr_scheduler) or isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
        ):
            raise TypeError(
                "lr_scheduler must be a factory called with the engine's torch optimizer "
                f"(the optimizer does not exist before initialize), got {type(lr_scheduler).__name__}"
            )
        if self.global_rank == 0:
            if self.compute_dtype == torch.bfloat16 and not accelerator.computes_bf16_natively(device):
                _warn_emulated_bf16()
            for message in config.ignored_settings():
                log.warning("%s", message)
            for message in config.inert_settings():
                log.info("%s", message)

        spec = None
        if client_optimizer is not None:
            if config.optimizer is not None and self.global_rank == 0:
                # DeepSpeed's rule (its initialize takes the client's too), said once.
                log.warning("the config's 'optimizer' section (%s) is ignored: the client optimizer (%s) passed to "
                            "initialize is the one stepped", config.optimizer.type, type(client_optimizer).__name__)
            spec = optimizer_spec.from_client(client_optimizer)
        elif config.optimizer is not None:
            spec = optimizer_spec.from_config(config.optimizer)
        if spec is not None and not any(p.requires_grad for p in model.parameters()):
            # A frozen model (a reference or reward model built with the training config): nothing to step.
            log.info("no parameter requires grad: the engine is built without an optimizer (it does not train)")
            spec = None

        self.parts = build(
            model, config, comm, self.gather, device, model_parameters, self.global_rank, spec,
            self.batch.gradient_accumulation_steps, self.protocol,
        )

        self.lr_scheduler = None
        if self.optimizer is not None:
            if lr_scheduler is not None:
                self.lr_scheduler = lr_scheduler(self.optimizer.optimizer)
            elif config.scheduler is not None:
                self.lr_scheduler = build_lr_scheduler(config.scheduler, self.optimizer.optimizer)
        self.micro_steps = 0
        self.global_steps = 0
        self._skipped_on_host = 0  # dynamic-scale skips; static-scale ones are counted on the device
        self._last_step_applied = True
        self._boundary_override: bool | None = None  # set_gradient_accumulation_boundary's answer
        self.timers = StepTimers(device, enabled=config.wall_clock_breakdown)
        self.saves = AsyncSaves(comm, device, self.global_rank, periodic=config.checkpoint.automatic,
                                adopt=self._adopt_buffers)
        if self.optimizer is not None:  # a save may read the state in place (zero3.checkpoint.shared_state)
            self.optimizer.before_state_change = self.saves.settle_readers
        self.client_state: Any = None
        self._checkpoint_states: dict[str, Any] = {}
        self._pending_states: dict[str, Any] = {}
        self._destroyed = False
        # torchft's side of each step (zero3.fault_tolerance.replicas' Note): this job is one replica group.
        self.fault_tolerance: ReplicaStep | None = None
        if config.fault_tolerance.enabled:
            if self.optimizer is None:
                raise ValueError(f"fault_tolerance.enabled {NO_OPTIMIZER}")
            grads = self.optimizer.grads
            self.fault_tolerance = ReplicaStep(
                config.fault_tolerance, grads.device if grads is not None else self.device, self.protocol,
                self.comm.all_gather_objects, view=self._peer_view, apply=self._apply_recovered,
            )
            self.optimizer.replica_step = self.fault_tolerance

    def _peer_view(self) -> PeerView:
        """What a recovering replica's peer reads of this engine, and a recovery writes into."""
        return PeerView(
            lp_buffers=self.parts.lp_buffers, sharded_params=self.parts.sharded_params,
            shard=(self.mesh.shard_size, self.mesh.shard_rank), optimizer=self.optimizer,
            counters=(self.global_steps, self.micro_steps, self.skipped_steps),
            loss_scaler=self.loss_scaler.state_dict(),
            lr_scheduler=None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            rank_state=self._rank_state,
        )

    def _apply_recovered(self, recovered: Recovered) -> None:
        """A peer's state landed (its buffers and optimizer states written): the rest of it."""
        if self.optimizer is not None:
            self.optimizer.lp_stale = False  # the 16-bit shards came with the masters
        self.global_steps, self.micro_steps, self.skipped_steps = recovered.counters
        self.loss_scaler.load_state_dict(recovered.loss_scaler)
        if self.lr_scheduler is not None and recovered.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(recovered.lr_scheduler)
        if recovered.rank_state is not None:
            self._apply_rank_state(recovered.rank_state)

    @property
    def all_units(self) -> list[GatherUnit]:
        return self.parts.all_units

    def __getattr__(self, name: str) -> Any:
        """What the engine lacks, its module answers (`engine.generate`, `engine.gradient_checkpointing_enable`),
        as DeepSpeed's engine does; only names the engine does not have get here."""
        module = self.__dict__.get("module")
        if module is not None and not name.startswith("__"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {name!r}"
            + (f", and neither has its module ({type(module).__name__})" if module is not None else "")
        )

    # ---- the parts, under the engine's names: each is its EngineParts field (one place holds it) ----------
    @property
    def units(self) -> list[GatherUnit]:
        return self.parts.units

    @property
    def persistent_unit(self) -> GatherUnit | None:
        return self.parts.persistent_unit

    @property
    def sharded_params(self) -> list[ShardedParam]:
        return self.parts.sharded_params

    @property
    def lp_buffers(self) -> list[FlatBuffer]:
        return self.parts.lp_buffers

    @property
    def optimizer(self) -> ZeroOptimizer | None:
        return self.parts.optimizer

    @property
    def grads(self) -> GradShards | None:
        return self.parts.grads

    @property
    def loss_scaler(self) -> LossScaler | DynamicLossScaler:
        return self.parts.loss_scaler

    @property
    def coordinator(self) -> ParamCoordinator:
        return self.parts.coordinator

    @property
    def offloader(self) -> StateOffloader:
        return self.parts.offloader

    # ---- training API -------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_alive()
        self.protocol.begin()
        self._check_consistent("forward")
        self._require_resident("forward", FORWARD_NEEDS)
        if self.fault_tolerance is not None and torch.is_grad_enabled():
            self.fault_tolerance.begin_step()  # the quorum forms during the forward (async_quorum)
            if self.fault_tolerance.take_recovered():  # (a quorum before the forward brought a peer's state)
                self.parts.refresh_gathered()
        self.parts.repair_lp("forward")
        if self.config.casts_inputs:
            # Floating inputs follow the parameters' dtype (`auto_cast`: FSDP2's cast_forward_inputs).
            def cast(value: Any) -> Any:
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    return value.to(self.compute_dtype)
                return value

            args, kwargs = tree_map(cast, (args, kwargs))
        with self.timers.phase("forward"):
            output = self.module(*args, **kwargs)
        self.protocol.returned(Owed.BACKWARD if torch.is_grad_enabled() and self.optimizer is not None else Owed.FORWARD)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` scaled by 1/gradient_accumulation_steps (and the fp16 loss scale).

        `scale_wrt_gas=False` (DeepSpeed's argument): the caller has already
        divided the loss by its accumulation steps (accelerate does), so only the
        loss scale is applied.

        If it raises, the pass still ends on every rank that raised (nothing is
        left gathered or in flight); `engine.zero_grad()` then drops the partial
        gradients, as `optimizer.zero_grad()` does in plain PyTorch.
        """
        self._check_alive()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got {type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        if self.optimizer is None:
            raise RuntimeError(f"engine.backward {NO_OPTIMIZER}")
        self._require_resident("backward", BACKWARD_NEEDS)
        self.protocol.begin()
        factor = self.loss_scaler.loss_scale
        if scale_wrt_gas:
            factor /= self.batch.gradient_accumulation_steps
        scaled = loss.float() * factor if factor != 1.0 else loss
        early = self.optimizer.early
        if early is not None:
            if self.is_gradient_accumulation_boundary():
                early.arm(self.loss_scaler.loss_scale)  # the host step begins as gradients land (early_step)
            else:
                early.undo("a backward that does not end at the step")
        with self.timers.phase("backward"):
            self.parts.backward.begin()
            try:
                scaled.backward(retain_graph=retain_graph)
            except BaseException as failure:
                # Ends the pass on every rank; the others raise this rank's failure (zero3.rank_failure).
                self.parts.backward.finish(failure)
                raise
            if early is not None:
                early.backward_computed()
            self.parts.backward.finish()
        self.protocol.returned(Owed.STEP if self.is_gradient_accumulation_boundary() else Owed.FORWARD)
        return loss

    def allreduce_gradients(self, bucket_size: int | None = None) -> None:
        """Land every gradient reduction of the backward pass now (DeepSpeed's method; collective).
        engine.backward already ends with this; a plain `loss.backward()` leaves its pass open until
        `step()`, and this ends it earlier (e.g. to read `safe_get_local_grad`). `bucket_size` is
        DeepSpeed's and has no effect: buckets are `reduce_bucket_size`."""
        self._check_alive()
        if self.optimizer is None:
            raise RuntimeError(f"engine.allreduce_gradients {NO_OPTIMIZER}")
        self.parts.backward.finish()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale, for a plain `.backward()` (DeepSpeed's method): the
        gradients are then handled as engine.backward's are (see the Note on a plain loss.backward() in
        zero3.passes.grad_hooks). Without an fp16 scale it returns `loss` itself."""
        self._check_alive()
        if self.optimizer is None:
            raise RuntimeError(f"engine.scale {NO_OPTIMIZER}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError("engine.scale expects a scalar loss tensor with a grad_fn, got "
                             + (f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__))
        self.parts.backward.manually_scaled = True
        factor = self.loss_scaler.loss_scale
        return loss.float() * factor if factor != 1.0 else loss

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (DeepSpeed's name; `optimizer.zero_grad()` in plain PyTorch).

        After an exception escaped forward or backward, this also ends any pass
        left open and releases what it held, so the next step starts clean.
        Called in an `except` clause on a rank that failed alone between the
        engine's calls (its data, its loss), it makes that rank's part of the
        call the other ranks are in, so they raise its exception too (see the
        Note below). Call it on every rank.
        """
        self._check_alive()
        handled = sys.exc_info()[1]  # called in an `except` clause: the exception being handled
        if self.parts.backward.open:
            # A backward still open here was ended by an exception (a plain loss.backward() that raised)
            # or abandoned; either way the other ranks raise it at their next engine.step(), rather than
            # step alone.
            self.parts.backward.finish(handled or RuntimeError(
                "engine.zero_grad() dropped a backward pass that engine.step() had not ended"
            ))
        elif handled is not None and self.protocol.owed is not None:
            self.protocol.join_as_failed(handled)
        self.protocol.returned(Owed.FORWARD)
        self.coordinator.reset()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    # [Note: a failure between the engine's calls]
    # A rank can also fail outside the engine: in its data (a bad sample on
    # one rank, before the forward), in the user's code between forward and
    # backward (a check on the loss) or between backward and step, while the
    # other ranks go on into the next forward's gathers, the backward's, or
    # the step's agreement. The step protocol records which one this rank
    # owes (zero3.step_protocol: set when a call returned, cleared
    # when the next one begins); `zero_grad`, called in the `except` clause,
    # then makes this rank's part of it as a rank that failed (an empty pass,
    # or the step's flags), so the others raise the exception too. A rank
    # whose call failed with the others (every rank raised) owes nothing:
    # that call began and did not return.

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next `step()` steps the optimizer: the caller's answer if it set one
        (`set_gradient_accumulation_boundary`), else every gradient_accumulation_steps micro-steps."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.batch.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Decide the accumulation boundary from outside (DeepSpeed's method; accelerate calls it before
        each backward): the next `step()` steps the optimizer iff `is_boundary`, until set again. None
        returns to counting micro-steps. Every rank must set the same value."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be a bool or None, got {is_boundary!r}")
        self._boundary_override = is_boundary

    def step(self) -> None:
        """Count a micro-step; at the accumulation boundary, step the optimizer."""
        self._check_alive()
        if self.optimizer is None:
            raise RuntimeError(f"engine.step {NO_OPTIMIZER}")
        self._check_consistent("step")
        self.protocol.begin()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._require_resident("step", STEP_NEEDS)
        self.parts.backward.finish()  # a plain loss.backward() left its pass open
        if not boundary:
            self.micro_steps += 1
            self.protocol.returned(Owed.FORWARD)
            return
        with self.timers.phase("step"):
            self.coordinator.release_all()
            stepped, _ = self.optimizer.step()
            self._last_step_applied = stepped
            # The state a recovering group took from its peer at the commit: what is gathered follows it.
            recovered = self.fault_tolerance is not None and self.fault_tolerance.take_recovered()
            dropped = self.optimizer.dropped
            if stepped or recovered:
                self.parts.refresh_gathered(views_follow=True)
            if stepped and self.lr_scheduler is not None:
                self.lr_scheduler.step()
            elif dropped:
                log.info("fault_tolerance: the quorum dropped step %d (its gradients are discarded)", self.global_steps + 1)
            elif not stepped:
                self._skipped_on_host += 1
                log.info("fp16 overflow: step %d skipped, loss scale now %s", self.global_steps, self.loss_scaler.loss_scale)
        # Counted once the step has landed: a step that raised (a failing disk) can be retried. A step the
        # fault-tolerant quorum dropped is no step (torchft does not count it either).
        self.micro_steps += 1
        if not dropped:  # (only a boundary gets here)
            self.global_steps += 1
        self.protocol.returned(Owed.FORWARD)
        printing = self.global_rank == 0 and log.isEnabledFor(logging.INFO)  # it reads the norm: a host sync
        every = self.config.steps_per_print
        if printing and every is not None and self.global_steps % every == 0:
            self._print_progress()
        if self.optimizer.lp_write_error is not None:
            error, self.optimizer.lp_write_error = self.optimizer.lp_write_error, None
            raise error
        self._save_on_interval()

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
        norm = self.parts.optimizer.grad_norm if self.parts.optimizer is not None else None
        return None if norm is None else float(norm)

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

    # ---- accounting -----------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model state, by state (the 16P/N of ZeRO-3)."""
        self._check_alive()
        return self.parts.model_state_bytes()

    # ---- teardown ---------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this zero3 engine was destroyed")

    def _check_consistent(self, what: str) -> None:
        """Refuse to train on shards from different steps (zero3.step.optimizer's Note)."""
        if self.optimizer is not None and self.optimizer.diverged is not None:
            raise RuntimeError(f"engine.{what}() refused: {self.optimizer.diverged}")

    def destroy(self) -> None:
        """Remove every hook and free every buffer. The engine is unusable afterwards."""
        if self._destroyed:
            return
        checkpoint_error = self.saves.close()  # raised once the engine is torn down
        if self.fault_tolerance is not None:
            self.fault_tolerance.close()
        self.parts.close()
        self.parts.forget()
        self.saves.release_state()  # (the buffers that lived in it are freed)
        self.lr_scheduler = None
        self._destroyed = True
        accelerator.synchronize(self.device)
        self.comm.close()
        if checkpoint_error is not None:
            raise checkpoint_error


@functools.cache
def _warn_emulated_bf16() -> None:
    """Once per process: a bf16 engine on a CPU without bf16 units."""
    log.warning("bf16 on this CPU (%s): each bf16 matmul is emulated, about 170x the time of an fp32 one; "
                "set bf16.enabled to false to train in fp32", accelerator.cpu_capability())
