"""The engine's checkpoint API: sharded save and load, exported weights, full-parameter streaming.

A mixin of `ZeroEngine`. `zero3.checkpoint` does the work on a view of the
engine (`CheckpointedEngine`); what is here checks the moment, lets go of what
is gathered, and applies what a load returns (counters, loss scale, schedule).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zero3.checkpoint.async_saves import AsyncSaves
from zero3.checkpoint.tags import CheckpointError, latest_tag
from zero3.config import Zero3Config
from zero3.enums import OffloadStateType
from zero3.comm import Communicator
from zero3.offload.manager import StateOffloader
from zero3.partition.collectives import ParamGather
from zero3.partition.flat_buffer import FlatBuffer
from zero3.step_protocol import StepProtocol
from zero3.engine.build import EngineParts
from zero3.engine.offload import CHECKPOINT_NEEDS
from zero3.engine import rng_state
from zero3.step.loss_scaler import DynamicLossScaler, LossScaler
from zero3.step.optimizer import ZeroOptimizer

if TYPE_CHECKING:
    from zero3.fault_tolerance.replica_step import ReplicaStep
    from zero3.checkpoint import state as checkpoint_state

log = logging.getLogger("zero3")


# [Note: checkpoint code is imported on first use]
# zero3.checkpoint stands on torch.distributed.checkpoint, whose import pulls in DTensor and sympy: most of
# the time `import zero3` took. A rank that never saves or loads (every rank of a short job, every test
# worker) should not pay it, so the methods below import it when they are first called.
def _state():  # noqa: ANN202 - the module
    from zero3.checkpoint import state

    return state


def _weights():  # noqa: ANN202 - the module
    from zero3.checkpoint import weights

    return weights


class CheckpointMethods:
    module: nn.Module
    config: Zero3Config
    comm: Communicator
    protocol: StepProtocol
    gather: ParamGather
    parts: EngineParts
    offloader: StateOffloader
    saves: AsyncSaves
    optimizer: ZeroOptimizer | None
    loss_scaler: LossScaler | DynamicLossScaler
    lr_scheduler: Any
    global_rank: int
    world_size: int
    compute_dtype: torch.dtype
    device: torch.device
    global_steps: int
    micro_steps: int
    skipped_steps: int
    _check_alive: Callable[[], None]  # the engine's: refuses a destroyed engine
    _require_resident: Callable[..., None]
    _prepare_offload: Callable[[set[OffloadStateType]], None]  # lets go of every view of the states named
    # The client state the last load returned, and what automatic checkpoints save (set it to save yours).
    client_state: Any
    _checkpoint_states: dict[str, Any]  # register_checkpoint_state's objects, by name
    fault_tolerance: ReplicaStep | None  # torchft's side of the step (zero3.fault_tolerance), if enabled
    _pending_states: dict[str, Any]  # states a load read for names not registered yet, by name

    def register_checkpoint_state(self, name: str, obj: Any) -> None:
        """Save and restore `obj` (anything with `state_dict()` / `load_state_dict()`: a stateful data loader,
        a sampler, an RNG holder) with every checkpoint of this engine, each rank its own.

        Every rank registers the same names. A checkpoint loaded before the
        registration (as `checkpoint.resume` loads inside `zero3.initialize`)
        keeps the object's state until it is registered, and hands it to
        `load_state_dict` then; so register right after initialize, before the
        first batch is drawn.
        """
        self._check_alive()
        if not isinstance(name, str) or not name:
            raise ValueError(f"register_checkpoint_state: name must be a non-empty string, got {name!r}")
        missing = [method for method in ("state_dict", "load_state_dict") if not callable(getattr(obj, method, None))]
        if missing:
            raise TypeError(f"register_checkpoint_state({name!r}, ...): a {type(obj).__name__} has no "
                            f"{' or '.join(missing)}; expected an object with state_dict() and load_state_dict()")
        known = self._checkpoint_states.get(name)
        if known is not None and known is not obj:
            raise ValueError(f"register_checkpoint_state: {name!r} is already registered (to a "
                             f"{type(known).__name__}); each name holds one object")
        self._checkpoint_states[name] = obj
        pending = self._pending_states.pop(name, None)
        if pending is not None:
            obj.load_state_dict(pending)

    def _rank_state(self) -> dict[str, Any]:
        """What this rank saves of its own beside the engine: its generators and the registered objects."""
        return {
            "rng": rng_state.capture(self.device),
            "registered": {name: obj.state_dict() for name, obj in self._checkpoint_states.items()},
        }

    def _run_facts(self) -> dict[str, Any]:
        """The run's batch sizes (train_batch_size, micro_batch_per_gpu, gradient_accumulation_steps)."""
        return dataclasses.asdict(self.batch)  # type: ignore[attr-defined] # the engine's resolved BatchSizes

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
        self.parts.check_between_steps("save_checkpoint")
        self.wait_for_checkpoint()
        self.parts.backward.finish()
        self._require_resident("save_checkpoint", CHECKPOINT_NEEDS)
        grads = self.parts.grads
        if grads is not None and grads.any_arrived():
            log.warning("save_checkpoint between micro-steps: the gradients accumulated so far are not saved")
        written = _state().save(
            self._checkpointed(saving=True), save_dir, tag, client_state, save_latest, keep_last,
            self.saves if async_save else None,
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
        """Write the whole model's weights (in the compute dtype) as safetensors; collective. A name not
        ending in `.safetensors` (DeepSpeed's default `pytorch_model.bin`) gets DeepSpeed's format, one
        torch.save of the state dict. A write that fails on rank 0 is every rank's error.

        Streams the parameters (`iter_full_params`: one gathered at a time,
        read where they rest, so parked states stay parked); rank 0 writes. A
        tied weight is written once. Above `max_shard_size` the files follow
        Hugging Face's sharded layout (`model-00001-of-0000N.safetensors` and
        an index).
        """
        self._check_alive()
        self.parts.check_between_steps("save_16bit_model")
        weights = _weights()
        shard_bytes = weights.parse_size(max_shard_size)
        weights.check_weights_name(save_filename)
        _, failure = weights.save_live(
            self.global_rank, self.module, lambda names: self.iter_full_params(names=names),
            save_dir, save_filename, shard_bytes, exclude_frozen_parameters,
        )

        def written() -> None:
            if failure is not None:
                raise failure

        # The files are complete on every rank's return; a write that failed on rank 0 fails every rank.
        self.protocol.agree("save_16bit_model", written)
        return True

    def consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict in the compute dtype, on rank 0's host; None on the other ranks.
        Collective. DeepSpeed's `_zero3_consolidated_16bit_state_dict` (what Hugging Face's `save_model`
        calls), also under that name.

        Rank 0 ends up holding the whole model (the point of it); to write the
        weights without that, `save_16bit_model` streams them to files.
        Parameters are gathered one at a time (`iter_full_params`); a tied
        weight is one tensor under each of its names; buffers come as they are.
        """
        self._check_alive()
        self.parts.check_between_steps("consolidated_16bit_state_dict")
        return _weights().consolidated_state_dict(
            self.global_rank, self.module, lambda names: self.iter_full_params(names=names), exclude_frozen_parameters,
        )

    _zero3_consolidated_16bit_state_dict = consolidated_16bit_state_dict

    def iter_full_params(
        self, dtype: torch.dtype | None = None, names: Iterable[str] | None = None, bucket_bytes: int | None = None,
    ) -> Iterable[tuple[str, torch.Tensor]]:
        """Yield `(name, tensor)` for every parameter, whole; collective. A shared-out expert weight
        (`expert_parallel`) comes whole too, `[E, ...]` as the model has it without expert parallelism.

        For handing weights to a generator: vLLM's `model.load_weights(weights=...)`,
        SGLang's `update_weights_from_tensor` (see examples/generator_weights.py).
        Every rank calls it with the same arguments and iterates it to the end.

        Without `bucket_bytes`, one parameter is gathered at a time, and a
        yielded tensor is valid only until the next item is requested: the
        consumer copies it (as vLLM's load_weights does) and never modifies it
        (it is a view of a buffer reused for the next parameter, or in a world
        of one of the engine's own shard). Extra memory is that one buffer, the
        size of the largest parameter streamed: at most the largest unit. With
        `bucket_bytes`, parameters are gathered that many bytes at a time, two
        buckets in flight (`iter_weight_buckets`), in the order the engine
        stores them rather than `named_parameters` order, and a yielded tensor
        stays valid until the first parameter two buckets later is requested.
        A tied weight comes once, under its first name
        (named_parameters order; with `names`, its first name listed). `names` restricts what is yielded; a name the
        model does not have raises ValueError before anything is gathered.
        `dtype` casts (None: the compute dtype, as stored). Works while states
        are parked by offload_states, lp_params included: they are read where
        they rest (host memory or disk) and stay parked. Works with the
        offload_param tiers. Buffers are not yielded.
        """
        from zero3.weights import full_params
        from zero3.weights import buckets as weight_buckets

        if bucket_bytes is not None:
            return weight_buckets.whole_params(iter(self.iter_weight_buckets(bucket_bytes, dtype, names)))
        self._check_alive()
        self.parts.check_between_steps("iter_full_params")
        self.parts.repair_lp("iter_full_params")
        return full_params.stream(
            self.module, self.gather, self.offloader, self.compute_dtype if dtype is None else dtype, names,
        )

    def iter_weight_buckets(
        self, bucket_bytes: int, dtype: torch.dtype | None = None, names: Iterable[str] | None = None,
    ) -> Iterable[Any]:
        """Yield `zero3.WeightBucket`s: every parameter, whole, packed in the order the engine stores their
        shards (so that a bucket's shards are sent, and on a world of one handed out, as a view of the engine's
        buffer) into flat tensors of at most `bucket_bytes` (a larger parameter alone), each gathered in one exact all-gather
        while the consumer reads the previous one (zero3.weights.buckets' Note); collective, as
        `iter_full_params`. A bucket's `entries` give each parameter's name, shape, dtype and offset in
        `flat`; on CUDA wait on its `event` before reading from another stream or process; call its
        `release()` when done: a bucket not released is never written again (the next ones take new memory).
        """
        from zero3.weights import full_params
        from zero3.weights import buckets as weight_buckets

        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes!r}: expected a positive number of bytes")
        self._check_alive()
        self.parts.check_between_steps("iter_full_params")
        self.parts.repair_lp("iter_full_params")
        dtype = self.compute_dtype if dtype is None else dtype
        chosen = full_params.request(self.module, self.gather, dtype, names)
        return weight_buckets.buckets(chosen, self.gather, self.offloader, dtype, bucket_bytes)

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
        weights_only: bool = True,
    ) -> tuple[str | None, Any]:
        """Load `load_dir/<tag>` (default: the tag `latest` names), saved at any world size; collective.

        Returns (the checkpoint's path, its client_state), also kept as
        `engine.client_state`. With `tag=None` and no `latest` in `load_dir` (or
        no `load_dir`), nothing is loaded: it returns (None, None) and logs a
        warning, as DeepSpeed does, so a script's first run and its restarts
        share one line. Each rank's random generators and the objects given to
        `register_checkpoint_state` come back as they were saved (at the same
        world size; at another one they are left as they are, with a warning).
        The checkpoint is
        checked first (the tag is complete, every name and shape matches this
        model, every file matches its checksum, the optimizer is the same
        kind): a failed check raises `zero3.CheckpointError` and changes
        nothing. Accumulated gradients are dropped.

        A checkpoint runs none of its code: its files are read weights-only
        (torch.load's rule, plus what `torch.serialization.add_safe_globals`
        registers) and DCP's metadata through an allowlist; a file naming
        anything else is refused with `CheckpointError`, naming the file and
        the global. `weights_only=False` is your word that you trust the files
        (a `client_state` holding your own classes needs it).
        """
        self._check_alive()
        self.parts.check_between_steps("load_checkpoint")
        if self.fault_tolerance is not None:
            self.fault_tolerance.require_closed("load_checkpoint")
        self.wait_for_checkpoint()
        if tag is None:
            tag = self._agreed_latest(load_dir)
            if tag is None:
                if self.global_rank == 0:
                    log.warning("load_checkpoint: %r holds no checkpoint yet (no 'latest' marker): nothing was "
                                "loaded, (None, None) returned", str(load_dir))
                return None, None
        self.parts.backward.finish()
        self._require_resident("load_checkpoint", CHECKPOINT_NEEDS)
        self.parts.coordinator.release_all()
        restored = _state().load(
            self._checkpointed(), load_dir, tag, load_optimizer_states, load_lr_scheduler_states, load_module_only,
            load_module_strict, weights_only,
        )
        self.parts.repair_lp("load_checkpoint")  # the load marked the 16-bit shards stale: they are written from the loaded masters
        if self.optimizer is None:
            self.parts.refresh_gathered()  # what is gathered follows the parameters loaded in place
        if restored.counters is not None:
            self.global_steps = restored.counters.global_steps
            self.micro_steps = restored.counters.micro_steps
            self.skipped_steps = restored.counters.skipped_steps
            self.loss_scaler.load_state_dict(restored.loss_scaler)
            if self.lr_scheduler is not None and restored.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(restored.lr_scheduler)
        if self.optimizer is not None:
            self.optimizer.zero_grad()
            if load_optimizer_states and not load_module_only:
                self.optimizer.diverged = None  # every rank's masters and moments are the checkpoint's again
        if not load_module_only:
            self._restore_run(restored)
        if self.fault_tolerance is not None and restored.counters is not None:
            self.fault_tolerance.replicas.follow_checkpoint(self.global_steps)  # the quorum compares steps
        self.client_state = restored.client_state
        return restored.path, restored.client_state

    def _agreed_latest(self, load_dir: str | os.PathLike[str]) -> str | None:
        """The tag `load_dir`'s `latest` names on every rank, or None where no rank has one; ranks that see
        another tag or none (a directory not every rank reads alike) are an error on every rank."""
        seen = self.comm.all_gather_objects(latest_tag(load_dir))
        if len(set(seen)) == 1:
            return seen[0]
        raise CheckpointError(f"load_checkpoint: the ranks read different 'latest' markers in {str(load_dir)!r} "
                              f"({dict(enumerate(seen))}, None: none): checkpoints must live where every rank "
                              "reads the same files")

    def _restore_run(self, restored: checkpoint_state.Restored) -> None:
        """Put back what is saved per rank (generators, registered objects) and say what changed with the world."""
        facts = restored.facts
        if facts is not None and self.global_rank == 0:
            now = self._run_facts()
            if facts["train_batch_size"] != now["train_batch_size"]:
                log.warning(
                    "load_checkpoint: the global batch changes from %d (world %d: micro %d x accumulation %d) to %d "
                    "(world %d: micro %d x accumulation %d); set train_batch_size to a multiple of micro x world to keep it",
                    facts["train_batch_size"], restored.world_size, facts["micro_batch_per_gpu"],
                    facts["gradient_accumulation_steps"], now["train_batch_size"], self.world_size,
                    now["micro_batch_per_gpu"], now["gradient_accumulation_steps"],
                )
        states = restored.rank_states
        if states is None:
            return
        if restored.world_size != self.world_size:
            if self.global_rank == 0:
                names = sorted({name for state in states for name in state["registered"]})
                log.warning("load_checkpoint: saved at world size %d, loaded at %d: each rank's random generators%s "
                            "belong to the ranks of that world and are left as they are", restored.world_size,
                            self.world_size, f" and registered states {names}" if names else "")
            return
        unsaved = self._apply_rank_state(states[self.global_rank])
        if unsaved and self.global_rank == 0:
            log.warning("load_checkpoint: the checkpoint holds no state for %s (registered after it was saved)", unsaved)

    def _apply_rank_state(self, mine: dict[str, Any]) -> list[str]:
        """Put back a rank state `_rank_state` took (here or on a peer: zero3.fault_tolerance.peer_state);
        returns the registered names it holds nothing for."""
        rng_state.restore(mine["rng"], self.device)
        self._pending_states = {}
        for name, value in mine["registered"].items():
            target = self._checkpoint_states.get(name)
            if target is None:
                self._pending_states[name] = value  # applied when registered
            else:
                target.load_state_dict(value)
        return sorted(set(self._checkpoint_states) - set(mine["registered"]))

    def _save_on_interval(self) -> None:
        """After an optimizer step: the automatic checkpoint, when the config's interval says so."""
        cfg = self.config.checkpoint
        if cfg.automatic and self.global_steps % cfg.interval_steps == 0:  # type: ignore[operator]
            assert cfg.dir is not None
            self.save_checkpoint(cfg.dir, client_state=self.client_state, keep_last=cfg.keep_last,
                                 async_save=cfg.async_save)

    def resume_from_config(self) -> str | None:
        """`checkpoint.resume`: load the newest complete checkpoint in `checkpoint.dir` if there is one
        (what `zero3.initialize` does); returns its path, or None on a first run."""
        cfg = self.config.checkpoint
        if not cfg.resume or cfg.dir is None:
            return None
        tag = self._agreed_latest(cfg.dir)
        if tag is None:
            if self.global_rank == 0:
                log.info("checkpoint.resume: no checkpoint in %r yet; starting at step 0", cfg.dir)
            return None
        path, _ = self.load_checkpoint(cfg.dir, tag=tag)
        if self.global_rank == 0:
            log.info("checkpoint.resume: resumed from %s at step %d", path, self.global_steps)
        return path

    def _adopt_buffers(self, moved: dict[FlatBuffer, torch.Tensor]) -> None:
        """Point flat buffers at new tensors holding the same values (zero3.checkpoint.shared_state), after
        letting go of every view of their states, as `offload_states` does before it moves them."""
        optimizer = self.optimizer
        bound = optimizer is not None and optimizer.views_bound
        self._prepare_offload({OffloadStateType(buffer.state) for buffer in moved})
        for buffer, tensor in moved.items():
            buffer.replace(tensor)
        if bound:
            assert optimizer is not None
            optimizer.bind_views()

    def _checkpointed(self, saving: bool = False) -> checkpoint_state.CheckpointedEngine:
        checkpoint_state = _state()
        if self.optimizer is not None:  # a save or load between a backward and its step sees no early step
            self.optimizer.undo_early_steps("a checkpoint was saved or loaded")
        return checkpoint_state.CheckpointedEngine(
            module=self.module, comm=self.comm, protocol=self.protocol, rank=self.global_rank, world_size=self.world_size,
            compute_dtype=self.compute_dtype, device=self.device, sharded_params=self.parts.sharded_params,
            optimizer=self.optimizer, loss_scaler=self.loss_scaler, lr_scheduler=self.lr_scheduler,
            host_pool=self.parts.host_pool,
            counters=checkpoint_state.TrainingCounters(self.global_steps, self.micro_steps, self.skipped_steps),
            rank_state=self._rank_state() if saving else None, facts=self._run_facts(),
        )
